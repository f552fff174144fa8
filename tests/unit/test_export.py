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

from eagle3_cli.main import main
from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.errors import ExportError, TargetError
from eagle3_core.export import (
    ExportTarget,
    FormatName,
    detect_format,
    export_sglang,
    export_speculators,
    load_drafter_dir,
    load_export,
    validate_export,
    written_layer_ids,
)
from eagle3_core.export.common import drafter_shapes
from tests.conftest import write_config
from tests.exports import LLAMA_8L, drafter_config, hand_mapping, random_drafter
from tests.helpers import FLAG_VARIANTS, SPECULATORS_FLAGS
from tests.records import DAMAGED_JSON

TARGET = LLAMA_8L
K = 24
LLAMA, DEEPSEEK = ("LlamaForCausalLM",), ("DeepseekV3ForCausalLM",)
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


def test_the_layer_ids_an_sglang_export_wrote_read_back_through_its_model(
    tmp_path: Path, pristine: dict[FormatName, Path]
) -> None:
    assert written_layer_ids(pristine["sglang"]) == [1, 3, 4]
    broken = tmp_path / "sglang"
    shutil.copytree(pristine["sglang"], broken)
    config = config_of(broken)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, "x"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ExportError, match=r"config\.json: eagle_config\.eagle_aux_hidden_state_layer_ids\[2\]"
    ):
        written_layer_ids(broken)
    del config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ExportError, match=r"config\.json: eagle_config\.eagle_aux_hidden_state_layer_ids: missing"
    ):
        written_layer_ids(broken)


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
    assert keys["sglang"] == top | {f"midlayer.{k}" for k in layer}  # docs/design.md, section 5, exactly
    assert keys["speculators"] == top | {f"layers.0.{k}" for k in layer} | {"embed_tokens.weight"}


def test_neither_engine_can_express_aux_layer_0(tmp_path: Path, drafter: Eagle3Drafter) -> None:
    target = replace(TARGET, aux_layer_ids=(0, 4, 5))
    # SGLang's Llama captures the input of layer id + 1, and an id of -1 cannot be written
    with pytest.raises(
        ExportError,
        match=r"\[0, 4, 5\] cannot be captured .*\[-1, 3, 4\] is no valid .*\[0, 4, 5\] would capture \[1, 5, 6\]",
    ):
        export_sglang(drafter, MAPPING, target, tmp_path / "out")
    # vLLM's Llama captures hidden_states + residual, and the input of layer 0 has no residual yet
    with pytest.raises(ExportError, match="vLLM cannot capture the input of layer 0"):
        export_speculators(drafter, MAPPING, target, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unsorted_aux_layer_ids_are_refused() -> None:
    # the engines concatenate the aux states in layer order: fc would read a permutation of what it learned
    with pytest.raises(ExportError, match="ascending layer order"):
        replace(TARGET, aux_layer_ids=(4, 2, 5))


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
    ("sglang", _drop("draft_vocab_size"), "config.json: draft_vocab_size: missing"),
    ("sglang", _drop("target_hidden_size"), "config.json: target_hidden_size: missing"),
    (
        "sglang",
        _drop("eagle_config.eagle_aux_hidden_state_layer_ids"),
        "config.json: eagle_config.eagle_aux_hidden_state_layer_ids: missing",
    ),
    ("sglang", _drop("architectures"), "config.json: architectures: missing"),
    ("sglang", _drop("head_dim"), "config.json: head_dim: missing"),
    (
        "sglang",
        _drop("rope_theta"),
        "config.json: rope_theta: missing",
    ),  # what SGLang reads (transformers 4 API)
    ("sglang", _set("architectures", ["LlamaForCausalLM"]), "LlamaForCausalLMEagle3"),
    ("sglang", _set("num_hidden_layers", 2), "num_hidden_layers: must be 1, got 2"),
    ("sglang", _set("tie_word_embeddings", True), "tie_word_embeddings: must be False, got True"),
    ("sglang", _set("rope_scaling", {"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    # the project ids written unconverted: SGLang would capture one layer too deep (vLLM PR #43671)
    (
        "sglang",
        _set("eagle_config.eagle_aux_hidden_state_layer_ids", [2, 4, 5]),
        r"should be written \[1, 3, 4\]",
    ),
    ("sglang", _set("draft_vocab_size", K + 1), "lm_head.weight"),
    # every flag is written: an engine would take an absent one as its default
    ("sglang", _drop("norm_before_fc"), "config.json: norm_before_fc: missing"),
    ("sglang", _drop("fc_norm"), "config.json: fc_norm: missing"),
    ("sglang", _drop("norm_output"), "config.json: norm_output: missing"),
    ("sglang", _drop("norm_before_residual"), "config.json: norm_before_residual: missing"),
    # SGLang and vLLM read eagle_config's norm_before_fc before the top-level one
    (
        "sglang",
        _set("eagle_config.norm_before_fc", True),
        "eagle_config.norm_before_fc: True, but norm_before_fc is False",
    ),
    ("sglang", _set("norm_before_residual", True), "SGLang has no such option"),
    ("sglang", _set("norm_output", True), "another drafter than the one trained: norm_output True"),
    # SGLang's window lives in the provenance alone (a server argument, not a config field)
    (
        "sglang",
        _drop("eagle3_export.drafter_variant"),
        "config.json: eagle3_export.drafter_variant: missing",
    ),
    (
        "sglang",
        _set("eagle3_export.drafter_variant.sliding_window", 0),
        "drafter_variant.sliding_window: must be positive, got 0",
    ),
    # the engine fields must give the network that was trained (here: no such step, no window)
    ("speculators", _drop("norm_before_residual"), "config.json: norm_before_residual: missing"),
    (
        "speculators",
        _drop("eagle3_export.drafter_variant"),
        "config.json: eagle3_export.drafter_variant: missing",
    ),
    ("speculators", _drop("norm_output"), "config.json: norm_output: missing"),
    (
        "speculators",
        _set("norm_before_residual", True),
        "another drafter than the one trained: norm_before_residual True",
    ),
    ("speculators", _set("norm_output", True), "another drafter than the one trained: norm_output True"),
    ("speculators", _set("fc_norm", True), r"fc_norm True \(trained False\)"),
    (
        "speculators",
        _drop("transformer_layer_config.layer_types"),
        "config.json: transformer_layer_config.layer_types: missing",
    ),
    (
        "speculators",
        _set("transformer_layer_config.layer_types", ["sliding_attention"]),
        r"transformer_layer_config.sliding_window: None, but layer_types is \['sliding_attention'\]",
    ),
    (
        "speculators",
        _set("transformer_layer_config.layer_types", ["full_attention", "full_attention"]),
        "one decoder layer",
    ),
    (
        "speculators",
        _drop("eagle_aux_hidden_state_layer_ids"),
        "config.json: eagle_aux_hidden_state_layer_ids: missing",
    ),
    ("speculators", _set("eagle_aux_hidden_state_layer_ids", [1, 3, 4]), r"should be written \[2, 4, 5\]"),
    ("speculators", _drop("speculators_model_type"), "config.json: speculators_model_type: missing"),
    (
        "speculators",
        _drop("transformer_layer_config.hidden_size"),
        "config.json: transformer_layer_config.hidden_size: missing",
    ),
    ("speculators", _drop_rope, "config.json: transformer_layer_config.rope_theta: missing"),
    (
        "speculators",
        _drop("speculators_config.verifier.name_or_path"),
        "config.json: speculators_config.verifier.name_or_path: missing",
    ),
    (
        "speculators",
        _drop("speculators_config.proposal_methods"),
        "config.json: speculators_config.proposal_methods: missing",
    ),
    (
        "speculators",
        _set("transformer_layer_config.torch_dtype", "bfloat16"),
        "transformer_layer_config.dtype: 'float32' disagrees with torch_dtype 'bfloat16'",
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


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
@pytest.mark.parametrize(
    ("value", "dtype", "said"),
    [
        (float("nan"), torch.float32, "1 NaN"),
        (float("-inf"), torch.bfloat16, "1 infinite"),
        (1e6, torch.float16, "1 infinite"),  # finite in float32, past float16's largest: inf once exported
    ],
)
def test_an_export_of_weights_that_are_not_finite_is_refused_naming_the_tensor(
    tmp_path: Path, fmt: FormatName, value: float, dtype: torch.dtype, said: str
) -> None:
    """A diverged run's weights (NaN, inf) drafted nothing, yet were exported and promoted."""
    drafter = random_drafter(CFG, seed=2)
    with torch.no_grad():
        drafter.midlayer.mlp.up_proj.weight[3, 1] = value
    out = tmp_path / fmt
    with pytest.raises(ExportError) as refused:
        EXPORTERS[fmt](drafter, MAPPING, TARGET, out, dtype=dtype)
    message = str(refused.value)
    name = "layers.0.mlp.up_proj.weight" if fmt == "speculators" else "midlayer.mlp.up_proj.weight"
    assert "\n" not in message and message.startswith(f"{out}: not exported: {name} holds {said}"), message
    assert "not finite" in message and "train.lr" in message, message
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary


# ---- variants: each flag written as the engines read it, and reloaded as the same network ----------------
EMBED = torch.randn(TARGET.vocab_size, TARGET.hidden_size, generator=torch.Generator().manual_seed(9))
STEPS = 3
VARIANTS: dict[str, dict[str, Any]] = {
    **FLAG_VARIANTS,
    "sliding_window": {"sliding_window": 4},  # the inputs are 12 long: the window cuts
    # what speculators' own trainer defaults to
    "speculators_defaults": {**SPECULATORS_FLAGS, "sliding_window": 2048},
}
PLAIN_VARIANT = {
    "norm_before_fc": False,
    "fc_norm": False,
    "norm_output": False,
    "norm_before_residual": False,
    "sliding_window": None,
}


def engine_view(fmt: FormatName, config: dict[str, Any]) -> dict[str, Any]:
    """The variant as each engine's reader takes it from config.json (SGLang 0.5.23 llama_eagle3.py, vLLM
    configs/speculators/algos.py and llama.py's layer_types rule), written out again here independently."""
    if fmt == "sglang":
        eagle = config.get("eagle_config") or {}
        return {
            "norm_before_fc": bool(eagle.get("norm_before_fc", config.get("norm_before_fc", False))),
            "fc_norm": bool(config.get("fc_norm") or config.get("use_aux_norm", False)),
            "norm_output": bool(config.get("norm_output", False)),
            "norm_before_residual": False,  # SGLang has no such option: its residual is h
            # not a config field: the serve command's --speculative-draft-window-size, from our provenance
            "sliding_window": config["eagle3_export"]["drafter_variant"]["sliding_window"],
        }
    layer = config["transformer_layer_config"]
    sliding = (layer.get("layer_types") or ["full_attention"])[0] == "sliding_attention"
    return {
        "norm_before_fc": config.get("norm_before_fc", False),
        "fc_norm": config.get("fc_norm", False),
        "norm_output": config.get("norm_output", False),
        "norm_before_residual": config.get("norm_before_residual", True),  # vLLM: absent is true
        "sliding_window": layer.get("sliding_window") if sliding else None,
    }


def inputs(length: int = 12, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, length, 3 * TARGET.hidden_size, generator=g)
    return aux, torch.randint(0, TARGET.vocab_size, (1, length), generator=g)


def logits_of(drafter: Eagle3Drafter, length: int = 12) -> list[torch.Tensor]:
    aux, ids = inputs(length)
    with torch.no_grad():
        return drafter.ttt_forward(aux, ids, STEPS)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_each_variant_is_written_for_its_engine_and_reloads_as_the_same_network(
    tmp_path: Path, fmt: FormatName, variant: str
) -> None:
    cfg = drafter_config(TARGET, K, **VARIANTS[variant])
    drafter = random_drafter(cfg, EMBED, seed=2)
    out = tmp_path / fmt
    if fmt == "sglang" and cfg.norm_before_residual:
        with pytest.raises(ExportError, match=r"SGLang has no such option .* residual is h"):
            export_sglang(drafter, MAPPING, TARGET, out, dtype=torch.float32)
        assert not out.exists()
        return
    EXPORTERS[fmt](drafter, MAPPING, TARGET, out, dtype=torch.float32)
    config = config_of(out)
    trained = {**PLAIN_VARIANT, **VARIANTS[variant]}
    assert engine_view(fmt, config) == trained
    # every flag explicitly, true or false: no engine default decides the network
    assert all(isinstance(config[flag], bool) for flag in PLAIN_VARIANT if flag != "sliding_window")
    keys = set(load_file(str(out / "model.safetensors")))
    assert ("input_norm.weight" in keys) == cfg.norm_before_fc
    assert ({"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= keys) == cfg.fc_norm

    loaded = load_export(out, fmt, EMBED)
    assert loaded.drafter.cfg == cfg and loaded.info.external is False
    ours, theirs = logits_of(drafter), logits_of(loaded.drafter)
    for step in range(STEPS):
        assert torch.equal(ours[step], theirs[step]), step
    if variant != "plain":
        # the flags are what makes the network: the same weights without them draft otherwise
        plain = Eagle3Drafter(cfg.model_copy(update=PLAIN_VARIANT))
        plain.load_state_dict(loaded.drafter.state_dict(), strict=False)
        assert max(float((a - b).abs().max()) for a, b in zip(logits_of(plain), theirs, strict=True)) > 1e-3


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_exporter_knows_every_tensor_of_each_variant(variant: str) -> None:
    cfg = drafter_config(TARGET, K, **VARIANTS[variant])
    assert drafter_shapes(cfg) == {k: tuple(v.shape) for k, v in Eagle3Drafter(cfg).state_dict().items()}


def test_sglang_is_given_the_window_as_a_server_argument(tmp_path: Path) -> None:
    """SGLang's --speculative-draft-window-size S admits keys [q - S, q]: a trained window W is S = W - 1."""
    from eagle3_core.steps.serving import sglang_draft_window

    for window, argument in ((4, 3), (None, None)):
        cfg = drafter_config(TARGET, K, sliding_window=window)
        export_sglang(random_drafter(cfg), MAPPING, TARGET, tmp_path / str(window) / "sglang")
        assert sglang_draft_window(tmp_path / str(window)) == argument
        assert "sliding_window" not in config_of(
            tmp_path / str(window) / "sglang"
        )  # SGLang has no such field
    with pytest.raises(ExportError, match="--speculative-draft-window-size 0"):
        export_sglang(
            random_drafter(drafter_config(TARGET, K, sliding_window=1)), MAPPING, TARGET, tmp_path / "w1"
        )
    export_speculators(
        random_drafter(drafter_config(TARGET, K, sliding_window=1)), MAPPING, TARGET, tmp_path / "s1"
    )


# ---- drafters made elsewhere -----------------------------------------------------------------------------
def external(
    source: Path,
    out: Path,
    config_edit: Callable[[dict[str, Any]], None] | None = None,
    tensors_edit: Callable[[Tensors], object] | None = None,
) -> Path:
    """A copy of one of our exports as another trainer would leave it: no provenance block, then edited."""
    directory = Path(shutil.copytree(source, out))
    config = config_of(directory)
    del config["eagle3_export"]
    if config_edit is not None:
        config_edit(config)
    (directory / "config.json").write_text(json.dumps(config))
    if tensors_edit is not None:
        tensors = load_file(str(directory / "model.safetensors"))
        tensors_edit(tensors)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def variant_exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Eagle3Drafter, Path]]:
    """fc_norm for SGLang, the speculators defaults for speculators: drafters with norm weights of their own."""
    root = tmp_path_factory.mktemp("variants")
    sglang = random_drafter(drafter_config(TARGET, K, fc_norm=True), EMBED, seed=3)
    spec = random_drafter(drafter_config(TARGET, K, **VARIANTS["speculators_defaults"]), EMBED, seed=4)
    return {
        "sglang": (sglang, export_sglang(sglang, MAPPING, TARGET, root / "sglang", dtype=torch.float32)),
        "speculators": (
            spec,
            export_speculators(spec, MAPPING, TARGET, root / "speculators", dtype=torch.float32),
        ),
    }


def assert_same_network(a: Eagle3Drafter, b: Eagle3Drafter) -> None:
    assert a.cfg == b.cfg
    for step, (x, y) in enumerate(zip(logits_of(a), logits_of(b), strict=True)):
        assert torch.equal(x, y), step


def test_a_speculators_drafter_from_elsewhere_loads_as_its_engine_reads_it(
    tmp_path: Path, variant_exports: dict[str, tuple[Eagle3Drafter, Path]]
) -> None:
    drafter, source = variant_exports["speculators"]

    def like_the_package(config: dict[str, Any]) -> None:
        # what speculators' save_pretrained writes instead of our fields
        config["architectures"] = ["Eagle3DraftModel"]
        config["target_hidden_size"] = None
        config["speculators_config"]["verifier"] = {"name_or_path": None, "architectures": []}
        layer = config["transformer_layer_config"]
        for key in ("head_dim", "rope_theta", "torch_dtype", "dtype", "tie_word_embeddings"):
            del layer[key]  # LlamaConfig's defaults, or derived: head_dim = hidden / heads here
        config["dtype"] = "float32"

    def with_verifier_copies(t: Tensors) -> None:
        t["verifier_lm_head.weight"] = torch.zeros(K, TARGET.hidden_size)
        t["verifier_norm.weight"] = torch.ones(TARGET.hidden_size)

    out = external(source, tmp_path / "ext", like_the_package, with_verifier_copies)
    (out / "optimizer_state_dict.pt").write_bytes(b"not read")  # speculators' checkpointer leaves these
    (out / "config.py").write_text("")
    validate_export(out, "auto")
    loaded = load_drafter_dir(out)  # the embedding travels with it
    assert loaded.info.external and loaded.info.format == "speculators"
    assert loaded.info.aux_layer_ids == (2, 4, 5) and loaded.info.final_state_convention is None
    assert torch.equal(loaded.d2t, MAPPING.d2t) and torch.equal(loaded.t2d, MAPPING.t2d)
    assert_same_network(drafter, loaded.drafter)

    # without the embedding, the target's is needed
    bare = external(source, tmp_path / "bare", tensors_edit=lambda t: t.pop("embed_tokens.weight"))
    with pytest.raises(ExportError, match="pass the target's embedding"):
        load_drafter_dir(bare)
    assert_same_network(drafter, load_drafter_dir(bare, "speculators", EMBED).drafter)


def test_a_drafter_from_elsewhere_is_loaded_in_its_own_dtype(
    tmp_path: Path, variant_exports: dict[str, tuple[Eagle3Drafter, Path]]
) -> None:
    drafter, source = variant_exports["speculators"]
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):

        def cast(t: Tensors, dtype: torch.dtype = dtype) -> None:
            for key in [k for k in t if t[k].is_floating_point()]:
                t[key] = t[key].to(dtype)

        # its config still says float32: the engines cast to their own dtype, the weights are what it is
        loaded = load_drafter_dir(external(source, tmp_path / name, tensors_edit=cast))
        assert loaded.info.dtype == dtype and loaded.drafter.fc.weight.dtype == dtype
        assert torch.equal(loaded.drafter.fc.weight, drafter.fc.weight.to(dtype))

    def mixed(t: Tensors) -> None:
        t["lm_head.weight"] = t["lm_head.weight"].half()

    with pytest.raises(ExportError, match=r"share one of .*\['F16', 'F32'\]"):
        load_drafter_dir(external(source, tmp_path / "mixed", tensors_edit=mixed))


def test_an_sglang_drafter_from_elsewhere_with_legacy_names_loads(
    tmp_path: Path, variant_exports: dict[str, tuple[Eagle3Drafter, Path]]
) -> None:
    drafter, source = variant_exports["sglang"]

    def legacy_config(config: dict[str, Any]) -> None:
        for key in ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual", "target_hidden_size"):
            del config[key]
        del config["eagle_config"]["norm_before_fc"]
        config["use_aux_norm"] = True  # SGLang's older name for fc_norm

    def legacy_names(t: Tensors) -> None:
        for i, level in enumerate(("low", "mid", "high")):
            t[f"aux_norm_{level}.weight"] = t.pop(f"fc_norm.{i}.weight")
        for name in [n for n in t if n.startswith("midlayer.")]:
            t[name.replace("midlayer.", "model.layers.0.")] = t.pop(name)
        t["embed_tokens.weight"] = torch.zeros(
            TARGET.vocab_size, TARGET.hidden_size
        )  # SGLang uses the target's

    out = external(source, tmp_path / "ext", legacy_config, legacy_names)
    assert detect_format(out) == "sglang"
    with pytest.raises(ExportError, match=r"depend on the target's model .* pass target_architectures"):
        load_drafter_dir(out, "auto", EMBED)
    loaded = load_drafter_dir(out, "auto", EMBED, target_architectures=LLAMA)
    assert loaded.info.external and loaded.info.aux_layer_ids == (2, 4, 5)
    assert_same_network(drafter, loaded.drafter)
    assert torch.equal(loaded.drafter.embed_tokens.weight, EMBED)
    # the same config drafting for DeepSeek-V3, whose SGLang adds one only to a first id of 1: (1, 3, 4) -> 2, 4, 5
    assert load_drafter_dir(out, "auto", EMBED, target_architectures=DEEPSEEK).info.aux_layer_ids == (2, 4, 5)

    def no_layer_ids(config: dict[str, Any]) -> None:
        del config["eagle_config"]

    bare = external(source, tmp_path / "no-ids", no_layer_ids)
    with pytest.raises(ExportError, match=r"names no aux layers.*pass target_num_layers"):
        load_drafter_dir(bare, "sglang", EMBED, target_architectures=LLAMA)
    # SGLang then captures the inputs of layers (2, L//2, L-3)
    defaulted = load_drafter_dir(bare, "sglang", EMBED, target_num_layers=8, target_architectures=LLAMA)
    assert defaulted.info.aux_layer_ids == (2, 4, 5) and defaulted.info.engine_aux_layer_ids == (1, 3, 4)


def test_a_sharded_drafter_from_elsewhere_loads(
    tmp_path: Path, variant_exports: dict[str, tuple[Eagle3Drafter, Path]]
) -> None:
    drafter, source = variant_exports["speculators"]
    out = external(source, tmp_path / "sharded")
    tensors = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_network(drafter, load_drafter_dir(out).drafter)
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ExportError, match="missing shards"):
        load_drafter_dir(out)


def test_a_full_vocab_drafter_needs_no_mapping_and_our_export_writes_none(tmp_path: Path) -> None:
    full = hand_mapping(TARGET.vocab_size, TARGET.vocab_size)  # the identity: d2t all zeros
    drafter = random_drafter(drafter_config(TARGET, TARGET.vocab_size), EMBED, seed=5)
    source = export_speculators(drafter, full, TARGET, tmp_path / "ours", dtype=torch.float32)
    # vLLM 0.34.0 has no draft_id_to_target_id parameter when the sizes are equal and refuses a d2t to load
    assert not {"d2t", "t2d"} & set(load_file(str(source / "model.safetensors")))

    loaded = load_drafter_dir(source)
    assert torch.equal(loaded.d2t, torch.zeros(TARGET.vocab_size, dtype=torch.long))
    assert bool(loaded.t2d.all())
    assert_same_network(drafter, loaded.drafter)
    assert_same_network(drafter, load_drafter_dir(external(source, tmp_path / "ext")).drafter)

    def half_mapping(t: Tensors) -> None:
        t["d2t"] = torch.zeros(TARGET.vocab_size, dtype=torch.long)

    with pytest.raises(ExportError, match="d2t without its pair"):
        load_drafter_dir(external(source, tmp_path / "half", tensors_edit=half_mapping))


def _pop(*keys: str) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        for key in keys:
            del config[key]

    return edit


def _pruned_without_mapping(t: Tensors) -> None:
    del t["d2t"], t["t2d"]


def _scaled_rope(config: dict[str, Any]) -> None:
    layer = config.get("transformer_layer_config", config)
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0}
    rope |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    layer["rope_parameters"] = rope
    layer.pop("rope_theta", None)


EXTERNAL_REFUSALS: list[tuple[FormatName, Callable[[dict[str, Any]], None] | None, Any, str]] = [
    # vLLM takes an absent norm_before_residual as true, speculators as false: ambiguous
    ("speculators", _pop("norm_before_residual"), None, "config.json: norm_before_residual: missing"),
    ("speculators", _pop("draft_vocab_size"), None, "vLLM would take the target's vocab, speculators 32000"),
    ("speculators", _set("transformer_layer_config.model_type", "qwen3"), None, "only a Llama decoder layer"),
    ("sglang", _set("num_hidden_layers", 2), None, "num_hidden_layers is 2: eagle3's drafter has one"),
    (
        "speculators",
        _set("transformer_layer_config.num_hidden_layers", 2),
        None,
        r"not a valid LlamaConfig \(.*`num_hidden_layers` \(2\) must be equal to the number of `layer_types`",
    ),
    ("speculators", _scaled_rope, None, "plain full-head RoPE only"),
    ("speculators", _set("speculators_model_type", "peagle"), None, "must be 'eagle3'"),
    ("speculators", None, _pruned_without_mapping, r"missing \['d2t', 't2d'\]"),
    ("sglang", _set("norm_before_residual", True), None, "SGLang has no such option"),
    ("sglang", _pop("draft_vocab_size"), None, "SGLang would then use the target's lm_head"),
    ("sglang", _set("tie_word_embeddings", True), None, "tie_word_embeddings is true"),
    ("sglang", _scaled_rope, None, "plain full-head RoPE only"),
    ("sglang", None, _extra_key, r"unexpected \['midlayer.self_attn.q_norm.weight'\]"),
]


@pytest.mark.parametrize(("fmt", "config_edit", "tensors_edit", "message"), EXTERNAL_REFUSALS)
def test_drafters_from_elsewhere_that_no_engine_runs_as_ours_are_refused(
    tmp_path: Path,
    variant_exports: dict[str, tuple[Eagle3Drafter, Path]],
    fmt: FormatName,
    config_edit: Callable[[dict[str, Any]], None] | None,
    tensors_edit: Callable[[Tensors], None] | None,
    message: str,
) -> None:
    out = external(variant_exports[fmt][1], tmp_path / fmt, config_edit, tensors_edit)
    with pytest.raises(ExportError, match=message):
        load_drafter_dir(out, fmt, EMBED)


def test_pickled_weights_and_unknown_configs_are_refused(
    tmp_path: Path, variant_exports: dict[str, tuple[Eagle3Drafter, Path]]
) -> None:
    out = external(variant_exports["sglang"][1], tmp_path / "bin")
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    with pytest.raises(ExportError, match=r"\['pytorch_model.bin'\] are pickled: eagle3 never unpickles"):
        load_drafter_dir(out, "auto", EMBED)
    shutil.copy(variant_exports["sglang"][1] / "model.safetensors", out / "model.safetensors")
    # beside safetensors the engines skip it, and so do we: it is never opened
    loaded = load_drafter_dir(out, "auto", EMBED, target_architectures=LLAMA)
    assert_same_network(variant_exports["sglang"][0], loaded.drafter)
    save_file({"fc.weight": torch.zeros(1)}, str(out / "extra.safetensors"))  # one an engine would load too
    with pytest.raises(ExportError, match=r"unexpected weight files \['extra.safetensors'\]"):
        load_drafter_dir(out, "auto", EMBED)
    target_like = tmp_path / "target"
    target_like.mkdir()
    (target_like / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ExportError, match=r"neither a speculators config .* nor an SGLang"):
        load_drafter_dir(target_like)
    with pytest.raises(ExportError, match=r"no config\.json"):
        detect_format(tmp_path / "absent")
    ours = variant_exports["speculators"][1]
    copy = Path(shutil.copytree(ours, tmp_path / "ours"))
    (copy / "optimizer_state_dict.pt").write_bytes(b"")  # beside our own export, nothing may be
    with pytest.raises(ExportError, match=r"unexpected weight files \['optimizer_state_dict.pt'\]"):
        validate_export(copy, "speculators")


def test_an_export_of_the_first_schema_still_loads(tmp_path: Path, pristine: dict[FormatName, Path]) -> None:
    """Written before the variant flags: no flag in its SGLang config, the plain drafter."""
    for fmt, source in pristine.items():
        out = Path(shutil.copytree(source, tmp_path / fmt))
        config = config_of(out)
        block = config["eagle3_export"]
        block["schema"], block["norm_before_residual"] = "eagle3.export/1", False
        del block["drafter_variant"]
        if fmt == "sglang":
            for flag in ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual"):
                del config[flag]
            del config["eagle_config"]["norm_before_fc"]
        else:
            del (
                config["transformer_layer_config"]["layer_types"],
                config["transformer_layer_config"]["sliding_window"],
            )
        (out / "config.json").write_text(json.dumps(config))
        loaded = load_export(out, fmt, EMBED if fmt == "sglang" else None)
        assert loaded.drafter.cfg == CFG and loaded.info.final_state_convention == "post_norm"
        config["norm_output"] = True  # a first-schema drafter had no such step
        (out / "config.json").write_text(json.dumps(config))
        with pytest.raises(ExportError, match="another drafter than the one trained: norm_output True"):
            validate_export(out, fmt)


# ---- damaged JSON: one line naming the file ----------------------------------------------------------------
@pytest.mark.parametrize("damage", sorted(DAMAGED_JSON))
def test_eval_of_a_drafter_directory_whose_config_json_is_damaged_is_one_line(
    damage: str, tmp_path: Path, pristine: dict[FormatName, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """`eagle3 eval --drafter DIR` reads DIR/config.json first: bad bytes there are the user's to fix."""
    data, said = DAMAGED_JSON[damage]
    drafter_dir = Path(shutil.copytree(pristine["speculators"], tmp_path / "drafter"))
    (drafter_dir / "config.json").write_bytes(data)
    config = write_config(tmp_path / "project", "store: store\n")
    capsys.readouterr()
    rc = main(["--config", str(config), "eval", "--drafter", str(drafter_dir)])
    out = capsys.readouterr().out
    assert rc == 2 and out.count("\n") == 1 and "Traceback" not in out, out
    assert out.startswith(f"error: {drafter_dir / 'config.json'}: ") and said in out, out


@pytest.mark.parametrize("damage", sorted(DAMAGED_JSON))
def test_a_damaged_shard_index_of_a_drafter_from_elsewhere_is_an_export_error(
    damage: str, tmp_path: Path, variant_exports: dict[str, tuple[Eagle3Drafter, Path]]
) -> None:
    data, said = DAMAGED_JSON[damage]
    out = external(variant_exports["speculators"][1], tmp_path / "sharded")
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_bytes(data)
    with pytest.raises(ExportError) as caught:
        load_drafter_dir(out)
    assert str(caught.value).startswith(f"{out / 'model.safetensors.index.json'}: ") and said in str(
        caught.value
    )


def test_a_shard_index_without_a_weight_map_names_the_field(
    tmp_path: Path, variant_exports: dict[str, tuple[Eagle3Drafter, Path]]
) -> None:
    out = external(variant_exports["speculators"][1], tmp_path / "sharded")
    (out / "model.safetensors").unlink()
    (out / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {"fc.weight": 3}}')
    with pytest.raises(
        ExportError, match=r"index\.json: weight_map\.fc\.weight: Input should be a valid string"
    ):
        load_drafter_dir(out)


@pytest.mark.parametrize("damage", sorted(DAMAGED_JSON))
def test_a_damaged_target_config_json_is_a_target_error_at_export(damage: str, tmp_path: Path) -> None:
    data, said = DAMAGED_JSON[damage]
    (tmp_path / "config.json").write_bytes(data)
    with pytest.raises(TargetError) as caught:
        ExportTarget.from_model_dir(tmp_path, (2, 4, 5), "post_norm")
    assert str(caught.value).startswith(f"{tmp_path / 'config.json'}: ") and said in str(caught.value)


def test_a_target_config_json_without_a_size_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"num_hidden_layers": 8, "vocab_size": 64}})
    )
    with pytest.raises(TargetError, match=r"config\.json: text_config\.hidden_size: Field required"):
        ExportTarget.from_model_dir(tmp_path, (2, 4, 5), "post_norm")
