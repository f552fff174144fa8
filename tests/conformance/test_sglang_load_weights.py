"""eagle3's SGLang export loaded by SGLang 0.5.23's own LlamaForCausalLMEagle3.load_weights, every variant."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from eagle3_core.engines.sglang_models import MODELS, captured_layer_ids
from eagle3_core.export import ExportTarget, export_sglang
from eagle3_core.train.trainer import drafter_config_for
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


# Kimi-K2.5's width and aux layers (61 layers: eagle3's default ids 2, 30, 58), its text model's sizes; the
# vocabularies are small (the target's embedding is SGLang's to give, and 163,840 rows of 7,168 would only cost
# memory here)
KIMI_TEXT = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
    "num_key_value_heads": 64, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "num_hidden_layers": 61, "vocab_size": 16384,
    "rms_norm_eps": 1e-6,
}  # fmt: skip
KIMI = ExportTarget(
    name_or_path="moonshotai/Kimi-K2.5",
    num_layers=61,
    aux_layer_ids=(2, 30, 58),
    final_state_convention="post_norm",
    vocab_size=16384,
    hidden_size=7168,
    max_position_embeddings=262144,
    architectures=("KimiK25ForConditionalGeneration",),
    model_type="kimi_k25",
)


def test_an_export_at_kimi_k25_s_width_loads_whole_in_sglang(sglang_probe: Probe, tmp_path: Path) -> None:
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    config = {"architectures": list(KIMI.architectures), "model_type": "kimi_k25", "text_config": KIMI_TEXT}
    (kimi / "config.json").write_text(json.dumps(config))
    cfg = drafter_config_for(kimi, 4096)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.dim) == (56, 8, 128)  # chosen for an MLA target
    export = export_sglang(
        random_drafter(cfg),
        hand_mapping(KIMI.vocab_size, 4096),
        KIMI,
        tmp_path / "sglang",
        dtype=torch.bfloat16,
    )
    written = json.loads((export / "config.json").read_text())
    target = tmp_path / "target"
    LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=8, num_attention_heads=4,
                architectures=["LlamaForCausalLM"]).save_pretrained(target)  # fmt: skip
    result = sglang_probe("probe_load_weights.py", json.dumps([str(export)]), str(target))[str(export)]
    assert result["unconsumed"] == [] and result["unexpected"] == []
    assert result["not_loaded"] == ["model.embed_tokens.weight"]
    assert max(result["max_abs_diff"].values()) == 0.0  # every tensor, qkv and gate/up as SGLang stacks them
    assert result["hot_token_id_is_d2t_plus_arange"] is True
    # the ids whose DeepSeek rule (+ 1 only when the first is 1) makes SGLang capture the trained layers 2, 30, 58
    ids = written["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [1, 29, 57] and captured_layer_ids(MODELS[KIMI.architectures[0]], ids, 61) == (2, 30, 58)
