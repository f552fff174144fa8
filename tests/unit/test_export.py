"""Export formats: layer-id conventions pinned, strict validation (each way an export can be wrong), atomic writes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.errors import ExportError
from eagle3_core.export import (
    ExportTarget,
    FormatName,
    export_sglang,
    export_speculators,
    load_export,
    validate_export,
)
from eagle3_core.export.common import drafter_shapes
from tests.exports import drafter_config, hand_mapping, random_drafter

# An 8-layer target; aux layers 2, 4, 5 in the project convention (the inputs of those decoder layers).
TARGET = ExportTarget(
    name_or_path="org/target-8l",
    num_layers=8,
    aux_layer_ids=(2, 4, 5),
    final_state_convention="post_norm",
    vocab_size=64,
    hidden_size=16,
    max_position_embeddings=512,
    architectures=("LlamaForCausalLM",),
    model_type="llama",
)
K = 24
MAPPING = hand_mapping(TARGET.vocab_size, K)
CFG = drafter_config(TARGET, K)
EXPORTERS: dict[FormatName, Callable[..., Path]] = {
    "sglang": export_sglang,
    "speculators": export_speculators,
}


@pytest.fixture(scope="module")
def drafter() -> Eagle3Drafter:
    return random_drafter(CFG)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, drafter: Eagle3Drafter) -> dict[FormatName, Path]:
    root = tmp_path_factory.mktemp("exports")
    return {
        fmt: export(drafter, MAPPING, TARGET, root / fmt, dtype=torch.float32)
        for fmt, export in EXPORTERS.items()
    }


def config_of(directory: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return config


def test_aux_layer_ids_are_pinned_per_engine(pristine: dict[FormatName, Path]) -> None:
    """Project aux (2, 4, 5) of an 8-layer target: SGLang writes [1, 3, 4] (it adds 1), vLLM/speculators [2, 4, 5]."""
    sglang, speculators = config_of(pristine["sglang"]), config_of(pristine["speculators"])
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert speculators["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    for config in (sglang, speculators):  # the provenance keeps the project numbers and says which they are
        assert config["eagle3_export"]["aux_layer_ids"] == [2, 4, 5]
        assert config["eagle3_export"]["aux_layer_convention"] == "input_of_layer"
        assert config["eagle3_export"]["final_state_convention"] == "post_norm"
    embed = torch.zeros(TARGET.vocab_size, TARGET.hidden_size)
    for fmt, directory in pristine.items():
        info = load_export(directory, fmt, embed if fmt == "sglang" else None).info
        assert info.aux_layer_ids == (2, 4, 5), fmt
    assert load_export(pristine["sglang"], "sglang", embed).info.engine_aux_layer_ids == (1, 3, 4)


def test_the_engine_fields_are_written(pristine: dict[FormatName, Path]) -> None:
    sglang = config_of(pristine["sglang"])
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (
        sglang["model_type"] == "llama"
        and sglang["num_hidden_layers"] == 1
        and sglang["tie_word_embeddings"] is False
    )
    assert (sglang["vocab_size"], sglang["draft_vocab_size"], sglang["target_hidden_size"]) == (64, K, 16)
    assert sglang["eagle_config"]["use_aux_hidden_state"] is True
    assert (
        sglang["rope_theta"] == 50000.0
        and sglang["head_dim"] == CFG.dim
        and sglang["torch_dtype"] == "float32"
    )
    spec = config_of(pristine["speculators"])
    assert spec["speculators_model_type"] == "eagle3"
    assert spec["norm_before_residual"] is False  # written explicitly: vLLM takes an absent one as true
    assert spec["draft_vocab_size"] == K and spec["transformer_layer_config"]["vocab_size"] == 64
    assert spec["speculators_config"]["verifier"] == {
        "name_or_path": "org/target-8l",
        "architectures": ["LlamaForCausalLM"],
    }
    assert spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    keys = {fmt: set(load_file(str(d / "model.safetensors"))) for fmt, d in pristine.items()}
    layer = {f"self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")
    }
    layer |= {f"{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")}
    top = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert keys["sglang"] == top | {f"midlayer.{k}" for k in layer}  # DESIGN.md section 3, exactly
    assert keys["speculators"] == top | {f"layers.0.{k}" for k in layer} | {"embed_tokens.weight"}


def test_the_exporter_knows_every_drafter_tensor() -> None:
    model = Eagle3Drafter(CFG)
    assert drafter_shapes(CFG) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_sglang_cannot_express_aux_layer_0(tmp_path: Path, drafter: Eagle3Drafter) -> None:
    target = replace(TARGET, aux_layer_ids=(0, 4, 5))
    with pytest.raises(ExportError, match="aux layer 0"):
        export_sglang(drafter, MAPPING, target, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_speculators(
        drafter, MAPPING, target, tmp_path / "out"
    )  # vLLM can: the embedding output is layer 0's input


def test_bad_target_facts_are_refused() -> None:
    with pytest.raises(ExportError, match="aux_layer_ids"):
        replace(TARGET, aux_layer_ids=(2, 4, 8))  # layer 8 of 8 does not exist
    with pytest.raises(ExportError, match="final_state_convention"):
        replace(TARGET, final_state_convention="normed")  # type: ignore[arg-type]


def test_a_drafter_and_mapping_that_disagree_are_not_exported(tmp_path: Path, drafter: Eagle3Drafter) -> None:
    with pytest.raises(ExportError, match="draft_vocab_size"):
        export_sglang(drafter, hand_mapping(TARGET.vocab_size, K + 1), TARGET, tmp_path / "out")
    broken = hand_mapping(TARGET.vocab_size, K)
    broken.t2d[int(torch.nonzero(~broken.t2d)[0])] = True
    with pytest.raises(ExportError, match="t2d"):
        export_speculators(drafter, broken, TARGET, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---- validation: each way an export can be wrong ---------------------------------------------------------
Tensors = dict[str, torch.Tensor]


def _extra_key(t: Tensors) -> None:
    t["midlayer.self_attn.q_norm.weight"] = torch.ones(4)


def _missing_key(prefix: str) -> Callable[[Tensors], None]:
    def edit(t: Tensors) -> None:
        del t[f"{prefix}hidden_norm.weight"]

    return edit


def _renamed_layer(t: Tensors) -> None:  # a speculators file with SGLang's names (speculators #1114)
    for name in [n for n in t if n.startswith("layers.0.")]:
        t[name.replace("layers.0.", "midlayer.")] = t.pop(name)


def _embedding_in_sglang(t: Tensors) -> None:
    t["embed_tokens.weight"] = torch.zeros(TARGET.vocab_size, TARGET.hidden_size)


def _fc_transposed(t: Tensors) -> None:
    t["fc.weight"] = t["fc.weight"].T.contiguous()


def _lm_head_full_vocab(t: Tensors) -> None:
    t["lm_head.weight"] = torch.zeros(TARGET.vocab_size, TARGET.hidden_size)


def _d2t_reordered(t: Tensors) -> None:
    t["d2t"] = t["d2t"].flip(0).contiguous()


def _t2d_flipped(t: Tensors) -> None:
    t["t2d"][int(torch.nonzero(t["t2d"])[0])] = False


def _half_lm_head(t: Tensors) -> None:
    t["lm_head.weight"] = t["lm_head.weight"].half()


WEIGHT_CASES: list[tuple[FormatName, Callable[[Tensors], None], str]] = [
    ("sglang", _extra_key, r"unexpected \['midlayer.self_attn.q_norm.weight'\]"),
    ("speculators", _extra_key, "unexpected"),
    ("sglang", _missing_key("midlayer."), r"missing \['midlayer.hidden_norm.weight'\]"),
    ("speculators", _missing_key("layers.0."), r"missing \['layers.0.hidden_norm.weight'\]"),
    ("speculators", _renamed_layer, "missing .*layers.0.*unexpected .*midlayer"),
    ("sglang", _embedding_in_sglang, r"unexpected \['embed_tokens.weight'\]"),
    ("sglang", _fc_transposed, r"fc.weight \[48, 16\] \(expected \[16, 48\]\)"),
    ("speculators", _lm_head_full_vocab, r"lm_head.weight \[64, 16\] \(expected \[24, 16\]\)"),
    ("sglang", _d2t_reordered, "d2t/t2d"),
    ("speculators", _t2d_flipped, "d2t/t2d"),
    ("sglang", _half_lm_head, r"lm_head.weight F16 \(expected F32\)"),
]


@pytest.mark.parametrize(("fmt", "edit", "message"), WEIGHT_CASES, ids=lambda v: getattr(v, "__name__", None))
def test_validation_refuses_bad_weights(
    tmp_path: Path,
    pristine: dict[FormatName, Path],
    fmt: FormatName,
    edit: Callable[[Tensors], None],
    message: str,
) -> None:
    directory = shutil.copytree(pristine[fmt], tmp_path / fmt)
    validate_export(directory, fmt)
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ExportError, match=message):
        validate_export(directory, fmt)
    with pytest.raises(ExportError, match=message):  # nor can it be loaded
        load_export(
            directory, fmt, torch.zeros(TARGET.vocab_size, TARGET.hidden_size) if fmt == "sglang" else None
        )


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for part in parents:
            config = config[part]
        del config[last]

    return edit


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        for part in parents:
            config = config[part]
        config[last] = value

    return edit


def _drop_rope(config: dict[str, Any]) -> None:
    del (
        config["transformer_layer_config"]["rope_theta"],
        config["transformer_layer_config"]["rope_parameters"],
    )


CONFIG_CASES: list[tuple[FormatName, Callable[[dict[str, Any]], None], str]] = [
    ("sglang", _drop("draft_vocab_size"), "'draft_vocab_size' is missing"),
    ("sglang", _drop("target_hidden_size"), "'target_hidden_size' is missing"),
    (
        "sglang",
        _drop("eagle_config.eagle_aux_hidden_state_layer_ids"),
        "'eagle_config.eagle_aux_hidden_state_layer_ids' is missing",
    ),
    ("sglang", _drop("architectures"), "'architectures' is missing"),
    ("sglang", _drop("head_dim"), "'head_dim' is missing"),
    ("sglang", _drop("rope_theta"), "'rope_theta' is missing"),  # what SGLang reads (transformers 4 API)
    ("sglang", _set("architectures", ["LlamaForCausalLM"]), "LlamaForCausalLMEagle3"),
    ("sglang", _set("num_hidden_layers", 2), "num_hidden_layers must be 1"),
    ("sglang", _set("tie_word_embeddings", True), "tie_word_embeddings must be false"),
    ("sglang", _set("rope_scaling", {"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    # the project ids written unconverted: SGLang would capture one layer too deep (vLLM PR #43671)
    (
        "sglang",
        _set("eagle_config.eagle_aux_hidden_state_layer_ids", [2, 4, 5]),
        r"should be written \[1, 3, 4\]",
    ),
    ("sglang", _set("draft_vocab_size", K + 1), "lm_head.weight"),
    ("speculators", _drop("norm_before_residual"), "'norm_before_residual' is missing"),
    ("speculators", _set("norm_before_residual", True), "norm_before_residual must be false"),
    ("speculators", _set("norm_output", True), "norm_output must be false"),
    (
        "speculators",
        _drop("eagle_aux_hidden_state_layer_ids"),
        "'eagle_aux_hidden_state_layer_ids' is missing",
    ),
    ("speculators", _set("eagle_aux_hidden_state_layer_ids", [1, 3, 4]), r"should be written \[2, 4, 5\]"),
    ("speculators", _drop("speculators_model_type"), "'speculators_model_type' is missing"),
    (
        "speculators",
        _drop("transformer_layer_config.hidden_size"),
        "'transformer_layer_config.hidden_size' is missing",
    ),
    ("speculators", _drop_rope, "rope_theta must be given"),
    (
        "speculators",
        _drop("speculators_config.verifier.name_or_path"),
        "'speculators_config.verifier.name_or_path' is missing",
    ),
    (
        "speculators",
        _drop("speculators_config.proposal_methods"),
        "'speculators_config.proposal_methods' is missing",
    ),
    (
        "speculators",
        _set("transformer_layer_config.torch_dtype", "bfloat16"),
        "torch_dtype/dtype must be given and agree",
    ),
]


@pytest.mark.parametrize(("fmt", "edit", "message"), CONFIG_CASES)
def test_validation_refuses_bad_configs(
    tmp_path: Path,
    pristine: dict[FormatName, Path],
    fmt: FormatName,
    edit: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    directory = shutil.copytree(pristine[fmt], tmp_path / fmt)
    config = config_of(directory)
    edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=message):
        validate_export(directory, fmt)


def test_validation_refuses_stray_files_and_the_other_format(
    tmp_path: Path, pristine: dict[FormatName, Path]
) -> None:
    directory = shutil.copytree(pristine["sglang"], tmp_path / "sglang")
    with pytest.raises(ExportError, match="speculators_model_type"):
        validate_export(directory, "speculators")
    (directory / "pytorch_model.bin").write_bytes(b"")  # an engine would load this one too
    with pytest.raises(ExportError, match=r"unexpected weight files \['pytorch_model.bin'\]"):
        validate_export(directory, "sglang")
    with pytest.raises(ExportError, match=r"no config\.json"):
        validate_export(tmp_path / "absent", "sglang")


def test_loading_checks_the_embedding(pristine: dict[FormatName, Path]) -> None:
    with pytest.raises(ExportError, match="pass the target's embedding"):
        load_export(pristine["sglang"], "sglang")
    with pytest.raises(ExportError, match="embedding given is"):
        load_export(pristine["sglang"], "sglang", torch.zeros(TARGET.vocab_size + 1, TARGET.hidden_size))
    with pytest.raises(ExportError, match="differ from the embedding given"):
        load_export(
            pristine["speculators"], "speculators", torch.zeros(TARGET.vocab_size, TARGET.hidden_size)
        )


# ---- atomic replacement ----------------------------------------------------------------------------------
def test_an_export_replaces_the_old_one_whole(tmp_path: Path, drafter: Eagle3Drafter) -> None:
    out = tmp_path / "drafter"
    export_sglang(drafter, MAPPING, TARGET, out)
    other = random_drafter(CFG, seed=1)
    export_sglang(other, MAPPING, TARGET, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no temporaries left behind
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(
        load_file(str(out / "model.safetensors"))["fc.weight"], other.fc.weight.to(torch.bfloat16)
    )


def test_a_failed_export_leaves_the_previous_one(
    tmp_path: Path, drafter: Eagle3Drafter, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "drafter"
    export_speculators(drafter, MAPPING, TARGET, out)
    before = (out / "model.safetensors").read_bytes()
    (tmp_path / ".drafter.tmp-999").mkdir()  # what a crashed earlier export leaves
    import eagle3_core.export.common as common

    def fail(*_: object) -> None:
        raise ExportError("validation failed")

    monkeypatch.setattr(common, "check_export", fail)
    with pytest.raises(ExportError, match="validation failed"):
        export_speculators(random_drafter(CFG, seed=1), MAPPING, TARGET, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]
