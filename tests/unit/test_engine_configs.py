"""The engines' config.json formats: what the export writes is pinned byte for byte (tests/snapshots/
export_configs, written by the hand-built dicts the models replaced), and each model's refusals name the field."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from eagle3_core.export import ExportTarget, FormatName, export_sglang, export_speculators
from tests.conftest import REPO
from tests.exports import LLAMA_8L, drafter_config, hand_mapping, random_drafter

GOLDEN = REPO / "tests" / "snapshots" / "export_configs"
K = 24
MAPPING = hand_mapping(LLAMA_8L.vocab_size, K)
DEEPSEEK_8L = replace(
    LLAMA_8L, architectures=("DeepseekV3ForCausalLM",), model_type="deepseek_v3", aux_layer_ids=(3, 4, 5)
)
CASES: dict[str, tuple[ExportTarget, dict[str, object], torch.dtype, int]] = {
    "plain": (LLAMA_8L, {}, torch.float32, 3),
    "variant": (
        LLAMA_8L,
        {"norm_before_fc": True, "norm_output": True, "sliding_window": 4},
        torch.bfloat16,
        5,
    ),
    "deepseek": (DEEPSEEK_8L, {"fc_norm": True}, torch.float16, 3),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_config_json_is_written_byte_for_byte_as_pinned(tmp_path: Path, fmt: FormatName, case: str) -> None:
    target, overrides, dtype, tokens = CASES[case]
    drafter = random_drafter(drafter_config(target, K, **overrides))
    if fmt == "sglang":
        out = export_sglang(drafter, MAPPING, target, tmp_path / fmt, dtype=dtype)
    else:
        out = export_speculators(
            drafter, MAPPING, target, tmp_path / fmt, dtype=dtype, speculative_tokens=tokens
        )
    assert (out / "config.json").read_bytes() == (GOLDEN / f"{fmt}_{case}.json").read_bytes()
