"""In-process regeneration with a static KV cache (`regenerate.kv_cache`) gives the token ids a dynamic one
gives: a left-padded batch of prompts of different lengths, greedy, in float32 on the CPU (where transformers
compiles nothing), rows that end early and rows cut at max_new_tokens alike."""

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, StaticCache

from eagle3_core.config import RegenerateConfig
from eagle3_core.data.tokenize import generation_prompt_ids
from eagle3_core.errors import ConfigError
from eagle3_core.targets.regenerate import Regenerator, uses_static_cache
from tests.helpers import SCRIPTED_REPLY, save_scripted_chat_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 6


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_scripted_chat_target(tmp_path_factory.mktemp("scripted") / "target")


def _regenerator(model: Any, tokenizer: Any, kv_cache: str) -> Regenerator:
    cfg = RegenerateConfig(max_new_tokens=MAX_NEW_TOKENS, batch_size=8, kv_cache=kv_cache)  # type: ignore[arg-type]
    return Regenerator(model, tokenizer, cfg, max_seq_len=256)


def _static_and_dynamic(model: Any, tokenizer: Any, prompts: list[list[int]]) -> list[list[int]]:
    """The static cache's ids, asserted equal to the dynamic cache's (and the static cache really used)."""
    caches: set[type] = set()

    def record(_module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        caches.update(type(v) for v in [*args, *kwargs.values()] if isinstance(v, StaticCache))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        static = _regenerator(model, tokenizer, "static").generate_ids(prompts)
    finally:
        handle.remove()
    assert caches == {StaticCache}
    assert static == _regenerator(model, tokenizer, "dynamic").generate_ids(prompts)
    return static


def _ended(rows: list[list[int]], eos: int) -> list[bool]:
    return [eos in row[:MAX_NEW_TOKENS] for row in rows]


def test_a_static_cache_replies_what_a_dynamic_one_does_on_the_scripted_target(scripted: Path) -> None:
    """Prompts ending where the scripted reply starts (cut at max_new_tokens: the reply is longer) and
    ending inside the reply (two tokens left: the row ends early and is padded), of different lengths."""
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    model = LlamaForCausalLM.from_pretrained(scripted, dtype=torch.float32).eval()
    eot = int(tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    reply = tokenizer.encode(SCRIPTED_REPLY, add_special_tokens=False)
    assert len(reply) > MAX_NEW_TOKENS
    starts = [
        generation_prompt_ids(tokenizer, [{"role": "user", "content": text}])
        for text in ("hi", "a much longer question than the other one, with more words in it")
    ]
    prompts = [*starts, [*starts[0], *reply[:-1]], reply[3:-1]]
    rows = _static_and_dynamic(model, tokenizer, prompts)
    assert rows[0][:MAX_NEW_TOKENS] == rows[1][:MAX_NEW_TOKENS] == reply[:MAX_NEW_TOKENS]
    assert rows[2][:2] == rows[3][:2] == [reply[-1], eot]
    assert _ended(rows, eot) == [False, False, True, True]


def test_a_static_cache_replies_what_a_dynamic_one_does_on_a_random_llama(scripted: Path) -> None:
    """A random Llama (every layer contributing): its end-of-turn id is set to a token one prompt's reply
    reaches early and another's never does, so some rows end early and some are cut."""
    tokenizer = AutoTokenizer.from_pretrained(scripted)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    model = LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, len(tokenizer), (n,), generator=generator).tolist() for n in (3, 11, 29, 7)]
    free = _regenerator(model, tokenizer, "dynamic").generate_ids(prompts)
    eos = next(t for t in free[0][1:3] if any(t not in row for row in free[1:]))
    model.generation_config.eos_token_id = eos
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)
    ended = _ended(_static_and_dynamic(model, tokenizer, prompts), eos)
    assert ended[0] and not all(ended)


def test_a_static_cache_for_a_target_that_takes_no_cache_is_refused() -> None:
    class NoCacheModel:
        def _supports_default_dynamic_cache(self) -> bool:
            return False

    with pytest.raises(ConfigError, match=r"^regenerate.kv_cache: static: .*NoCacheModel.*dynamic$"):
        uses_static_cache("static", NoCacheModel(), on_gpu=True)
    assert not uses_static_cache("auto", NoCacheModel(), on_gpu=True)
