"""eagle3's SGLang export loaded by SGLang 0.5.23's own LlamaForCausalLMEagle3.load_weights, every variant."""

import json

import pytest
import torch
from transformers import LlamaConfig

from eagle3_core.export import export_sglang
from tests.conformance.conftest import Probe
from tests.exports import LLAMA_8L, drafter_config, hand_mapping, random_drafter
from tests.helpers import FLAG_VARIANTS

TARGET = LLAMA_8L
SGLANG_VARIANTS = {name: flags for name, flags in FLAG_VARIANTS.items() if name != "norm_before_residual"}


@pytest.fixture(scope="module")
def loaded(sglang_probe: Probe, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    root = tmp_path_factory.mktemp("sglang-load")
    target = root / "target"  # the server arguments SGLang publishes are for a target: a tiny Llama one
    LlamaConfig(
        vocab_size=TARGET.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, architectures=["LlamaForCausalLM"],
    ).save_pretrained(target)  # fmt: skip
    mapping = hand_mapping(TARGET.vocab_size, 24)
    dirs = {}
    for i, (name, flags) in enumerate(SGLANG_VARIANTS.items()):
        drafter = random_drafter(drafter_config(TARGET, 24, **flags), seed=i)
        dirs[name] = export_sglang(drafter, mapping, TARGET, root / name, dtype=torch.float32)
    report = sglang_probe("probe_load_weights.py", json.dumps([str(d) for d in dirs.values()]), str(target))
    return {name: report[str(d)] for name, d in dirs.items()}


@pytest.mark.parametrize("variant", sorted(SGLANG_VARIANTS))
def test_sglangs_load_weights_takes_every_tensor_of_the_export_into_the_drafter_it_builds(
    loaded: dict[str, dict[str, object]], variant: str
) -> None:
    result = loaded[variant]
    assert result["unconsumed"] == [] and result["unexpected"] == []
    # the target's embedding is SGLang's to give (set_embed): the one parameter no export tensor fills
    assert result["not_loaded"] == ["model.embed_tokens.weight"]
    diffs = result["max_abs_diff"]
    assert isinstance(diffs, dict) and len(diffs) >= 9 and max(diffs.values()) == 0.0
    assert result["hot_token_id_is_d2t_plus_arange"] is True
    flags = SGLANG_VARIANTS[variant]
    assert result["flags"] == {
        f: bool(flags.get(f, False)) for f in ("norm_before_fc", "fc_norm", "norm_output")
    }
