"""The engines' config.json formats: what the export writes is pinned byte for byte (tests/snapshots/
export_configs, written by the hand-built dicts the models replaced), and each model's refusals name the field."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import pytest
import torch
from pydantic import ValidationError

from eagle3_core.engines.engine_config import DtypeName, EngineModel, validated
from eagle3_core.errors import ExportError
from eagle3_core.export import ExportTarget, FormatName, export_sglang, export_speculators
from eagle3_core.export.common import DTYPES
from eagle3_core.export.sglang import SGLangConfig, SGLangFields
from eagle3_core.export.speculators import SpeculatorsConfig, SpeculatorsFields
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


# ---- the models themselves -------------------------------------------------------------------------------
MODELS: dict[FormatName, type[EngineModel]] = {"sglang": SGLangConfig, "speculators": SpeculatorsConfig}
ELSEWHERE: dict[FormatName, type[EngineModel]] = {"sglang": SGLangFields, "speculators": SpeculatorsFields}


def golden(fmt: FormatName, case: str = "variant") -> dict[str, Any]:
    config: dict[str, Any] = json.loads((GOLDEN / f"{fmt}_{case}.json").read_text())
    return config


def edited(config: dict[str, Any], path: str, value: Any = None, *, drop: bool = False) -> dict[str, Any]:
    config = copy.deepcopy(config)
    *parents, last = path.split(".")
    inner = config
    for part in parents:
        inner = inner[part]
    if drop:
        del inner[last]
    else:
        inner[last] = value
    return config


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_a_config_round_trips_through_its_model(fmt: FormatName, case: str) -> None:
    text = (GOLDEN / f"{fmt}_{case}.json").read_text()
    model = validated(MODELS[fmt], json.loads(text), "x", ours=True)
    assert json.dumps(model.model_dump(mode="json", by_alias=True), indent=2, sort_keys=True) + "\n" == text
    with pytest.raises(ValidationError):  # frozen
        model.draft_vocab_size = 1  # type: ignore[attr-defined]


REFUSALS: list[tuple[FormatName, str, Any, bool, str]] = [
    # a required field left out
    ("sglang", "eagle_config.eagle_aux_hidden_state_layer_ids", None, True, "missing"),
    ("speculators", "transformer_layer_config.head_dim", None, True, "missing"),
    ("speculators", "speculators_config.verifier.name_or_path", None, True, "missing"),
    # a wrong JSON type: strict, so neither "16" for 16 nor true for 1 nor 1 for true
    (
        "speculators",
        "transformer_layer_config.hidden_size",
        "16",
        False,
        "input should be a valid integer, got '16'",
    ),
    ("sglang", "num_attention_heads", True, False, "input should be a valid integer, got True"),
    ("sglang", "fc_norm", 1, False, "input should be a valid boolean, got 1"),
    ("sglang", "fc_norm", None, False, "is null"),
    (
        "speculators",
        "eagle_aux_hidden_state_layer_ids",
        [2, 2, 5],
        False,
        "must be three distinct integers >= 0",
    ),
    ("speculators", "eagle3_export.target", "org/target", False, "input should be a valid dictionary"),
    (
        "speculators",
        "speculators_config.proposal_methods",
        [{"speculative_tokens": 0}],
        False,
        "must be >= 1",
    ),
    # a key eagle3 does not write, which an engine would read (use_aux_norm) or skip
    ("sglang", "use_aux_norm", True, False, "is no field eagle3 writes"),
    ("sglang", "eagle_config.extra_field", 1, False, "is no field eagle3 writes"),
    (
        "speculators",
        "transformer_layer_config.rope_scaling",
        {"factor": 8.0},
        False,
        "is no field eagle3 writes",
    ),
    ("speculators", "eagle3_export.drafter_variant.window", 4, False, "is no field eagle3 writes"),
]


@pytest.mark.parametrize(("fmt", "path", "value", "drop", "message"), REFUSALS)
def test_our_configs_are_refused_naming_the_field(
    fmt: FormatName, path: str, value: Any, drop: bool, message: str
) -> None:
    config = edited(golden(fmt), path, value, drop=drop)
    where = "/d (export)"
    shown = path if path != "speculators_config.proposal_methods" else f"{path}[0].speculative_tokens"
    with pytest.raises(ExportError, match=re.escape(f"{where}: config.json: {shown}: {message}")) as e:
        validated(MODELS[fmt], config, where, ours=True)
    assert "\n" not in str(e.value)


def test_a_drafter_from_elsewhere_may_leave_out_or_add_what_its_engine_does_not_need() -> None:
    config = edited(golden("sglang"), "use_aux_norm", True)
    for flag in ("fc_norm", "norm_output", "target_hidden_size"):
        config = edited(config, flag, drop=True)
    config = edited(config, "norm_before_fc", None)  # the engines read a null flag as unset
    fields = validated(SGLangFields, config, "x", ours=False)
    assert fields.fc_norm is None and fields.norm_before_fc is None and fields.use_aux_norm is True
    assert fields.model_extra and fields.model_extra["hidden_size"] == 16  # the layer: LlamaConfig's to read
    # what no reading allows: a wrong type, and a present null where the engine has no use for one
    for path, value, message in (
        ("fc_norm", 1, "fc_norm: input should be a valid boolean"),
        ("draft_vocab_size", None, "draft_vocab_size: is null"),
        ("architectures", ["LlamaForCausalLM"], "architectures: must be ['LlamaForCausalLMEagle3']"),
    ):
        with pytest.raises(ExportError, match=re.escape(message)):
            validated(SGLangFields, edited(config, path, value), "x", ours=False)
    spec = edited(golden("speculators"), "norm_before_residual", drop=True)
    with pytest.raises(ExportError, match=r"config\.json: norm_before_residual: missing"):
        validated(ELSEWHERE["speculators"], spec, "x", ours=False)


def test_the_declared_dtypes_are_the_exported_ones() -> None:
    assert set(get_args(DtypeName)) == set(DTYPES)
