"""The teacher's logits from stored final states equal the target model's own logits."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from eagle3_core.targets.head import load_target_head
from tests.helpers import save_tiny_llama


@pytest.mark.parametrize("tied", [False, True])
def test_head_logits_equal_the_models(tmp_path: Path, tied: bool) -> None:
    if tied:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=90,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        )
        LlamaForCausalLM(config).save_pretrained(tmp_path)
    else:
        save_tiny_llama(tmp_path, layers=2, vocab=90)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 90, (1, 12))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        pre_norm = model.model.layers[-1](
            out.hidden_states[-2],
            position_embeddings=model.model.rotary_emb(out.hidden_states[-2], torch.arange(12)[None]),
        )
    head = load_target_head(tmp_path)
    assert torch.equal(head.embed, model.model.embed_tokens.weight.detach())
    torch.testing.assert_close(
        head.logits(out.hidden_states[-1], "post_norm"), out.logits, rtol=1e-5, atol=1e-5
    )
    if not tied:  # the pre_norm path applies the final norm itself
        pre = pre_norm[0] if isinstance(pre_norm, tuple) else pre_norm
        torch.testing.assert_close(head.logits(pre, "pre_norm"), out.logits, rtol=1e-4, atol=1e-4)
