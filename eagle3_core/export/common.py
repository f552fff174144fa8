"""What the SGLang and speculators/vLLM exports share: the target's facts, the weight layout, the drafter's
variant flags, strict validation, an atomic directory write, and loading a drafter directory into our drafter.

A format (sglang.py, speculators.py) says only what differs: how it names the decoder layer's weights, whether it
carries the embedding, how it numbers the aux layers, how it writes and reads its config.json, and which variants
its engine can run. A missing or unexpected key is an error, never a warning (docs/design.md, section 6): the engines
skip unknown keys silently and run random weights in place of missing ones (docs/design.md, section 5).

Two kinds of directory are read:
- our own exports (config.json carries the `eagle3_export` provenance block): every field must be written
  explicitly, the weights file holds exactly the format's tensors in the dtype config.json names, and the
  engine fields must agree with the variant the provenance records;
- a drafter from another trainer (speculators' `save_pretrained`, SpecForge, EAGLE's releases): no provenance,
  and every field is read as its engine reads it, the engine's defaults included. Its weights get the same shape
  checks, with what those trainers write beside the drafter tolerated (an embedding the engine replaces or may
  take, speculators' `verifier_*` copies, no d2t/t2d when the draft vocab is the target's, sharded safetensors,
  speculators' optimizer/scheduler state); its dtype is the weights' own. Pickled weights are refused.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Protocol, cast

import torch
from pydantic import PositiveInt, ValidationError
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_core.conventions import (
    AUX_LAYER_CONVENTION,
    FinalStateConvention,
    check_aux_layer_ids,
    default_aux_layer_ids,
)
from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.engines.engine_config import (
    CONFIG_FILE,
    LEGACY_SCHEMA,
    PROVENANCE_KEY,
    SCHEMA,
    VARIANT_KEY,
    EngineModel,
    FormatName,
    Provenance,
)
from eagle3_core.engines.sglang_models import read_architectures
from eagle3_core.errors import ExportError, TargetError
from eagle3_core.finite import nonfinite_tensor
from eagle3_core.store.atomic import atomic_directory, read_json_object
from eagle3_core.store.records import validation_message
from eagle3_core.targets.model_config import HFFields, read_language_fields
from eagle3_core.targets.weights import SafetensorsIndex

WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"
OUR_LAYER_PREFIX = "midlayer."
EMBED_KEY = "embed_tokens.weight"
# the variant flags of DrafterConfig that engines read from config.json (the sliding window is apart: where it
# is said differs per engine)
FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")

# torch dtype <-> config.json name <-> safetensors header name, for the dtypes a drafter is exported in
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, (torch_dtype, _) in DTYPES.items():
        if torch_dtype == dtype:
            return name
    raise ExportError(f"cannot export in {dtype}: choose one of {', '.join(DTYPES)}")


def variant_of(cfg: DrafterConfig) -> dict[str, Any]:
    """The drafter's variant as the provenance records it: every flag and the window, explicitly."""
    return {**{flag: bool(getattr(cfg, flag)) for flag in FLAGS}, "sliding_window": cfg.sliding_window}


# ---- the target ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerTarget:
    """What decides the numbers an engine's config gives aux layers: the target's architectures (SGLang's
    rule differs by model, engines/sglang_models.py) and its layer count."""

    architectures: tuple[str, ...]
    num_layers: int | None


class ExportedTargetFields(HFFields):
    """What an export records of the target's language model, from its config.json."""

    num_hidden_layers: PositiveInt
    vocab_size: PositiveInt
    hidden_size: PositiveInt
    max_position_embeddings: PositiveInt = 4096  # the engines' own fallback when a config lacks it
    model_type: str = ""


@dataclass(frozen=True)
class ExportTarget:
    """What an export must say about the target it drafts for."""

    name_or_path: str  # what the serving host loads the target as (a hub id or a path there)
    num_layers: int
    aux_layer_ids: tuple[int, int, int]  # PROJECT convention: aux k = the residual stream entering layer k
    final_state_convention: FinalStateConvention
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    architectures: tuple[str, ...] = ()
    model_type: str = ""

    @property
    def layers(self) -> LayerTarget:
        return LayerTarget(self.architectures, self.num_layers)

    def __post_init__(self) -> None:
        try:
            check_aux_layer_ids(self.aux_layer_ids, self.num_layers)
        except ValueError as e:
            raise ExportError(str(e)) from e
        if self.final_state_convention not in ("pre_norm", "post_norm"):
            raise ExportError(
                f"final_state_convention must be pre_norm or post_norm, got {self.final_state_convention!r}"
            )

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path,
        aux_layer_ids: Sequence[int],
        final_state_convention: FinalStateConvention,
        *,
        name_or_path: str | None = None,
    ) -> ExportTarget:
        """Facts from the target's config.json; `name_or_path` defaults to the directory itself."""
        path = Path(model_dir) / CONFIG_FILE
        if not path.is_file():
            raise ExportError(f"{model_dir}: no {CONFIG_FILE}; is this a Hugging Face model directory?")
        # the language model's fields (a multimodal wrapper's text_config), TargetError naming file and field
        config, _ = read_language_fields(Path(model_dir), ExportedTargetFields)
        ids = tuple(int(k) for k in aux_layer_ids)
        return cls(
            name_or_path=name_or_path if name_or_path is not None else str(model_dir),
            num_layers=config.num_hidden_layers,
            aux_layer_ids=cast(tuple[int, int, int], ids),
            final_state_convention=final_state_convention,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            max_position_embeddings=config.max_position_embeddings,
            architectures=read_architectures(path, TargetError),
            model_type=config.model_type,
        )


@dataclass(frozen=True)
class ExportInfo:
    """What a reloaded export says about itself, layer ids converted back to the project convention."""

    format: FormatName
    aux_layer_ids: tuple[int, int, int]  # project convention
    engine_aux_layer_ids: tuple[int, int, int]  # as config.json gives them to the engine (or its default)
    dtype: torch.dtype
    final_state_convention: FinalStateConvention | None  # None for an export made elsewhere (no provenance)
    vocab_mapping_fingerprint: str | None
    target_name_or_path: str | None
    external: bool = False  # made by another trainer: read as its engine reads it, no provenance


class LoadedExport(NamedTuple):
    drafter: Eagle3Drafter
    d2t: torch.Tensor
    t2d: torch.Tensor
    info: ExportInfo


# ---- config.json reading ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigFacts:
    """What a format's config.json says, in our terms."""

    drafter: DrafterConfig
    # None: the config names no aux layers, and the engines use their default for the target
    engine_aux_layer_ids: tuple[int, int, int] | None
    # None: a drafter made elsewhere, whose dtype is its weights' own (the engines cast to theirs anyway)
    dtype: torch.dtype | None
    provenance: Provenance | None  # None: a drafter made elsewhere


def llama_layer_config(cfg: DrafterConfig, target: ExportTarget, dtype: torch.dtype) -> dict[str, Any]:
    """The fields of the Llama decoder layer (engine_config.LlamaLayer) that `cfg` is built from."""
    name = dtype_name(dtype)
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.dim,  # explicit: speculators builds its RoPE from a config with hidden_size doubled
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "vocab_size": cfg.target_vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "num_hidden_layers": 1,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": name,
        "dtype": name,
    }


def read_external_layer(layer: dict[str, Any], where: str, prefix: str) -> dict[str, Any]:
    """The decoder layer of a drafter made elsewhere, as the engines build it: through transformers'
    LlamaConfig, so an absent field takes the value the engines' readers give it. Sizes as DrafterConfig fields.
    """
    from transformers import LlamaConfig

    place = prefix or "config"
    kind = layer.get("model_type")
    if kind != "llama":
        raise ExportError(
            f"{where}: {place} model_type is {kind!r}: only a Llama decoder layer is supported (eagle3's drafter)"
        )
    try:
        llama = LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"})
    except Exception as e:  # transformers' own validation: say which file, not a library traceback
        message = " ".join(str(e).split())  # one line: transformers' messages span several
        raise ExportError(f"{where}: {place} is not a valid LlamaConfig ({message})") from e
    layers = llama.num_hidden_layers
    if layers != 1:
        raise ExportError(
            f"{where}: {place} num_hidden_layers is {layers}: eagle3's drafter has one decoder layer"
        )
    if llama.tie_word_embeddings is not False:
        raise ExportError(
            f"{where}: {place} tie_word_embeddings is true: the engine would use the embedding as lm_head"
        )
    if llama.hidden_act != "silu":
        raise ExportError(f"{where}: {place} hidden_act must be silu, got {llama.hidden_act!r}")
    biases = [k for k in ("attention_bias", "mlp_bias") if getattr(llama, k, False)]
    if biases:
        raise ExportError(f"{where}: {place} {biases} set: eagle3's drafter has no biases")
    rope = dict(llama.rope_parameters or {})
    theta = rope.pop("rope_theta", None)
    rope_type = rope.pop("rope_type", "default")
    partial = rope.pop("partial_rotary_factor", 1.0)
    if not (rope_type == "default" and not rope and partial == 1.0 and isinstance(theta, int | float)):
        raise ExportError(
            f"{where}: {place} rope_parameters {llama.rope_parameters!r}: eagle3's drafter runs plain full-head RoPE only"
        )
    assert isinstance(theta, int | float)  # for mypy; refused above otherwise
    head_dim = int(llama.head_dim or llama.hidden_size // llama.num_attention_heads)
    return {
        "hidden_size": llama.hidden_size,
        "intermediate_size": llama.intermediate_size,
        "num_heads": llama.num_attention_heads,
        "num_kv_heads": llama.num_key_value_heads,
        "head_dim": None if head_dim * llama.num_attention_heads == llama.hidden_size else head_dim,
        "rms_norm_eps": float(llama.rms_norm_eps),
        "rope_theta": float(theta),
        "target_vocab_size": llama.vocab_size,
    }


def drafter_config(fields: dict[str, Any], where: str) -> DrafterConfig:
    try:
        return DrafterConfig(**fields)
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        message = " ".join(str(e).split())  # one line: pydantic's messages span several
        raise ExportError(f"{where}: inconsistent drafter config ({message})") from e


class FormatFields(Protocol):
    """The fields both formats' config.json hold under the same names, as each format's model reads them."""

    @property
    def draft_vocab_size(self) -> int | None: ...

    @property
    def target_hidden_size(self) -> int | None: ...

    @property
    def eagle3_export(self) -> Provenance | None: ...


def config_facts(
    fields: FormatFields,
    sizes: dict[str, Any],
    flags: dict[str, bool],
    window: int | None,
    engine_ids: Sequence[int] | None,
    dtype: torch.dtype | None,
    where: str,
    without_vocab: str,
) -> ConfigFacts:
    """A format's config.json in our terms, from what its `read_config` read: the layer's sizes, the variant
    flags and window, and the aux ids in the engine's numbering. An absent target width is the drafter's own,
    as both engines take it; an absent draft vocabulary is refused, `without_vocab` saying what the engine would
    do instead."""
    vocab, target_hidden = fields.draft_vocab_size, fields.target_hidden_size
    if vocab is None:
        raise ExportError(f"{where}: {CONFIG_FILE}: draft_vocab_size: missing: {without_vocab}")
    return ConfigFacts(
        drafter=drafter_config(
            {
                **sizes,
                "target_hidden_size": sizes["hidden_size"] if target_hidden is None else target_hidden,
                "draft_vocab_size": vocab,
                **flags,
                "sliding_window": window,
            },
            where,
        ),
        engine_aux_layer_ids=None if engine_ids is None else (engine_ids[0], engine_ids[1], engine_ids[2]),
        dtype=dtype,
        provenance=fields.eagle3_export,
    )


# ---- formats ---------------------------------------------------------------------------------------------
class ExportFormat(ABC):
    name: ClassVar[FormatName]
    layer_prefix: ClassVar[str]  # what our "midlayer." is called in this format
    with_embedding: ClassVar[bool]  # whether our export puts the target's embedding in the weights file

    @abstractmethod
    def engine_layer_ids(
        self, project_ids: tuple[int, int, int], target: LayerTarget
    ) -> tuple[int, int, int]:
        """Project-convention aux ids -> the numbers this engine's config expects for `target`."""

    @abstractmethod
    def project_layer_ids(
        self, engine_ids: tuple[int, int, int], target: LayerTarget
    ) -> tuple[int, int, int]:
        """The inverse of `engine_layer_ids`: the layers the engine captures for `target`."""

    @abstractmethod
    def check_expressible(self, cfg: DrafterConfig) -> None:
        """ExportError unless this format's engine can run exactly the drafter `cfg` describes."""

    @abstractmethod
    def build_config(
        self, cfg: DrafterConfig, target: ExportTarget, dtype: torch.dtype, provenance: dict[str, Any]
    ) -> EngineModel:
        """The whole config.json of an export, validated as this format's own exports are read."""

    @abstractmethod
    def read_config(self, config: dict[str, Any], where: str, *, ours: bool) -> ConfigFacts:
        """Check the fields the engine needs and turn them into our terms; ExportError on anything absent or off.

        `ours`: the directory is our own export (every field written explicitly); otherwise fields are read as
        the engine reads them, its defaults for absent ones included.
        """

    def canonical_key(self, theirs: str) -> str:
        """A weight name of a drafter made elsewhere -> this format's name for the same tensor (the aliases the
        engine's loader accepts). Our exports use the format's names only."""
        return theirs

    def external_optional(self, cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
        """Tensors a drafter made elsewhere may carry or not, beside the format's own (with their shapes)."""
        shapes: dict[str, tuple[int, ...]] = {EMBED_KEY: (cfg.target_vocab_size, cfg.hidden_size)}
        if cfg.draft_vocab_size == cfg.target_vocab_size:
            # no vocab pruning: trainers leave the identity mapping out, and the engines need none
            shapes |= {"d2t": (cfg.draft_vocab_size,), "t2d": (cfg.target_vocab_size,)}
        return shapes

    def engine_key(self, ours: str) -> str:
        return (
            self.layer_prefix + ours.removeprefix(OUR_LAYER_PREFIX)
            if ours.startswith(OUR_LAYER_PREFIX)
            else ours
        )

    def our_key(self, theirs: str) -> str:
        return (
            OUR_LAYER_PREFIX + theirs.removeprefix(self.layer_prefix)
            if theirs.startswith(self.layer_prefix)
            else theirs
        )

    def expected_shapes(self, cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
        """Exactly the tensors our export in this format holds, with their shapes."""
        shapes = {
            self.engine_key(k): s
            for k, s in drafter_shapes(cfg).items()
            if self.with_embedding or k != EMBED_KEY
        }
        if cfg.draft_vocab_size == cfg.target_vocab_size:
            return shapes  # no vocab pruning: no mapping (`vocab_tensors`)
        return {**shapes, "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.target_vocab_size,)}


def vocab_tensors(mapping: VocabMapping) -> dict[str, torch.Tensor]:
    """d2t (int64) and t2d (bool) of a pruned draft vocabulary; none for the target's whole vocabulary, as the
    other trainers write it: vLLM (0.34.0, models/llama_eagle3.py) has no draft_id_to_target_id parameter when
    the two sizes are equal, and its loader refuses a d2t it has nowhere to put; SGLang then drafts over the
    whole vocabulary."""
    if mapping.draft_vocab_size == mapping.target_vocab_size:
        return {}
    return {
        "d2t": mapping.d2t.to("cpu", torch.int64).contiguous(),
        "t2d": mapping.t2d.to("cpu", torch.bool).contiguous(),
    }


def drafter_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Our drafter's state_dict shapes, from the config alone (no model is built: the embedding can be GBs)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.dim
    aux = cfg.num_aux * cfg.target_hidden_size
    shapes: dict[str, tuple[int, ...]] = {EMBED_KEY: (cfg.target_vocab_size, h)}
    if cfg.norm_before_fc:
        shapes["input_norm.weight"] = (aux,)
    if cfg.fc_norm:
        shapes |= {f"fc_norm.{k}.weight": (cfg.target_hidden_size,) for k in range(cfg.num_aux)}
    return shapes | {
        "fc.weight": (h, aux),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (cfg.num_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (cfg.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (cfg.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, cfg.num_heads * d),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }


def vocab_problem(
    d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, target_vocab_size: int
) -> str | None:
    """What is wrong between d2t and t2d, or None: target id = i + d2t[i], ascending, exactly the ids t2d marks."""
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        return f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}"
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (target_vocab_size,):
        return f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match vocab sizes {draft_vocab_size} / {target_vocab_size}"
    target_ids = torch.arange(draft_vocab_size) + d2t
    if draft_vocab_size and (int(target_ids.min()) < 0 or int(target_ids.max()) >= target_vocab_size):
        return "d2t maps draft ids outside the target vocab"
    if not bool((target_ids[1:] > target_ids[:-1]).all()):
        return "arange(K) + d2t is not strictly ascending (draft ids must keep target order)"
    if int(t2d.sum()) != draft_vocab_size or not bool(t2d[target_ids].all()):
        return "t2d does not mark exactly the target ids that d2t maps to"
    return None


# ---- writing ---------------------------------------------------------------------------------------------
def _check_inputs(cfg: DrafterConfig, mapping: VocabMapping, target: ExportTarget) -> None:
    pairs = {
        "drafter target_vocab_size vs target vocab_size": (cfg.target_vocab_size, target.vocab_size),
        "mapping target_vocab_size vs target vocab_size": (mapping.target_vocab_size, target.vocab_size),
        "drafter draft_vocab_size vs mapping draft_vocab_size": (
            cfg.draft_vocab_size,
            mapping.draft_vocab_size,
        ),
        "drafter target_hidden_size vs target hidden_size": (cfg.target_hidden_size, target.hidden_size),
        "drafter num_aux vs target aux layers": (cfg.num_aux, len(target.aux_layer_ids)),
    }
    off = [f"{name}: {a} != {b}" for name, (a, b) in pairs.items() if a != b]
    if off:
        raise ExportError("the drafter, its vocab mapping and the target disagree: " + "; ".join(off))
    problem = vocab_problem(mapping.d2t, mapping.t2d, mapping.draft_vocab_size, mapping.target_vocab_size)
    if problem:
        raise ExportError(f"vocab mapping {mapping.fingerprint[:12]}: {problem}")


def provenance(
    fmt: ExportFormat, cfg: DrafterConfig, target: ExportTarget, mapping: VocabMapping, dtype: torch.dtype
) -> dict[str, Any]:
    """Our block in config.json: what the engines' fields cannot say (conventions, fingerprint, origin, and
    the variant trained, which the engine fields must match)."""
    return {
        "schema": SCHEMA,
        "format": fmt.name,
        "aux_layer_ids": list(target.aux_layer_ids),
        "aux_layer_convention": AUX_LAYER_CONVENTION,
        "engine_aux_layer_ids": list(fmt.engine_layer_ids(target.aux_layer_ids, target.layers)),
        "final_state_convention": target.final_state_convention,
        VARIANT_KEY: variant_of(cfg),
        "vocab_mapping_fingerprint": mapping.fingerprint,
        "dtype": dtype_name(dtype),
        "target": {
            "name_or_path": target.name_or_path,
            "num_layers": target.num_layers,
            "architectures": list(target.architectures),
            "model_type": target.model_type,
            "vocab_size": target.vocab_size,
            "hidden_size": target.hidden_size,
        },
    }


# each format's config.json (a few KB) and its weights file's safetensors header (a line per tensor), generously
CONFIG_AND_HEADER_BYTES = 1 << 16


def export_bytes(fmt: ExportFormat, drafter: Eagle3Drafter, mapping: VocabMapping, dtype: torch.dtype) -> int:
    """What `write_export` puts on disk for `fmt`, from the shapes alone: the drafter's tensors in `dtype`
    (the embedding only where the format carries it), d2t (int64) and t2d (bool), its config and header."""
    weights = sum(
        tensor.numel() * dtype.itemsize
        for name, tensor in drafter.state_dict().items()
        if fmt.with_embedding or name != EMBED_KEY
    )
    return weights + mapping.d2t.numel() * 8 + mapping.t2d.numel() + CONFIG_AND_HEADER_BYTES


@dataclass(frozen=True)
class ExportContents:
    """What `write_export` writes for one format: its tensors (WEIGHTS_FILE) and config.json's text."""

    tensors: dict[str, torch.Tensor]
    config_text: str


def export_contents(
    fmt: ExportFormat,
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: ExportTarget,
    dtype: torch.dtype,
    where: str,
) -> ExportContents:
    """What an export of `drafter` in `fmt` holds, checked first: ExportError for a dtype no engine loads, a
    variant the format's engine cannot run, a drafter, mapping and target that disagree, or a weight that is
    not finite in `dtype` (a diverged run's NaN, or a value past float16's range), in one line naming `where`
    and the tensor."""
    cfg = drafter.cfg
    dtype_name(dtype)  # refuse an unsupported dtype before any work
    fmt.check_expressible(cfg)
    _check_inputs(cfg, mapping, target)
    tensors = {
        fmt.engine_key(name): tensor.detach().to("cpu", dtype).contiguous()
        for name, tensor in drafter.state_dict().items()
        if fmt.with_embedding or name != EMBED_KEY
    }
    bad = nonfinite_tensor(tensors.items())
    if bad is not None:
        raise ExportError(
            f"{where}: not exported: {bad} in {dtype_name(dtype)}: weights that are not finite draft nothing "
            "(a diverged training run? train it again with a lower train.lr)"
        )
    tensors |= vocab_tensors(mapping)
    written = fmt.build_config(cfg, target, dtype, provenance(fmt, cfg, target, mapping, dtype))
    config = written.model_dump(mode="json", by_alias=True)
    return ExportContents(tensors, json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_export(
    fmt: ExportFormat,
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: ExportTarget,
    out_dir: Path,
    dtype: torch.dtype,
) -> Path:
    """Write `out_dir` as `fmt` (`export_contents`), validate it while still hidden, then put it in place
    atomically."""
    contents = export_contents(fmt, drafter, mapping, target, dtype, str(out_dir))
    # replace: exporting again swaps the whole directory; a failed export leaves the previous one
    with atomic_directory(out_dir, replace=True) as temp:
        # transformers refuses a safetensors file whose metadata lacks format=pt
        save_file(contents.tensors, str(temp / WEIGHTS_FILE), metadata={"format": "pt"})
        (temp / CONFIG_FILE).write_text(contents.config_text)
        check_export(fmt, temp)
    return Path(out_dir)


# ---- validation ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckedExport:
    config: dict[str, Any]
    facts: ConfigFacts
    provenance: Provenance | None  # None: a drafter made elsewhere
    dtype: torch.dtype  # of its float tensors
    tensors: dict[str, tuple[Path, str]]  # this format's name -> (the file holding it, the name there)


def read_config_file(directory: Path, where: str) -> dict[str, Any]:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ExportError(f"{where}: no {CONFIG_FILE}")
    return read_json_object(path, ExportError)


def _weight_files(out_dir: Path, ours: bool, where: str) -> list[Path]:
    """The safetensors files an engine loads from `out_dir`; any other weight file there is an error."""
    present = sorted(p.name for p in out_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if ours:
        if WEIGHTS_FILE not in present:
            raise ExportError(f"{where}: no {WEIGHTS_FILE}")
        # another weights file would be loaded too (or instead) by an engine: only ours may be there
        others = [n for n in present if n != WEIGHTS_FILE] + sorted(
            p.name for p in out_dir.glob("*.index.json")
        )
        if others:
            raise ExportError(f"{where}: unexpected weight files {others}")
        return [out_dir / WEIGHTS_FILE]
    index = out_dir / SHARD_INDEX_FILE
    if index.is_file():
        if WEIGHTS_FILE in present:
            raise ExportError(f"{where}: both {WEIGHTS_FILE} and {SHARD_INDEX_FILE}: which is it?")
        try:
            weight_map = SafetensorsIndex.model_validate(read_json_object(index, ExportError)).weight_map
        except ValidationError as err:
            raise ExportError(validation_message(index, err)) from None
        shards = sorted(set(weight_map.values()))
        if not all(isinstance(s, str) and "/" not in s for s in shards):
            raise ExportError(f"{where}: {SHARD_INDEX_FILE} names {shards}")
        missing = [s for s in shards if not (out_dir / s).is_file()]
        if missing:
            raise ExportError(f"{where}: {SHARD_INDEX_FILE} names missing shards {missing}")
        files = shards
    elif WEIGHTS_FILE in present:
        files = [WEIGHTS_FILE]
    else:
        pickled = [n for n in present if not n.endswith(".safetensors")]
        if pickled:
            raise ExportError(
                f"{where}: weights {pickled} are pickled: eagle3 never unpickles; convert them to {WEIGHTS_FILE}"
            )
        raise ExportError(f"{where}: no {WEIGHTS_FILE}")
    # SGLang's and vLLM's loaders take the safetensors when there are any and skip pickled files (speculators'
    # optimizer/scheduler state, a repository's older .bin); a stray .safetensors they would load as well
    stray = [n for n in present if n.endswith(".safetensors") and n not in files]
    if stray:
        raise ExportError(f"{where}: unexpected weight files {stray} beside {files}")
    return [out_dir / f for f in files]


def _weights_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) from the header alone."""
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
            return {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except Exception as e:  # a torn or foreign file: say which, not a library traceback
        raise ExportError(f"{path}: unreadable safetensors file ({e})") from e


def _check_provenance(fmt: ExportFormat, facts: ConfigFacts, where: str) -> Provenance:
    block = facts.provenance
    if block is None:  # the reader validated the block that check_export found
        raise ExportError(f"{where}: {CONFIG_FILE}: {PROVENANCE_KEY}: missing")
    if block.format != fmt.name:
        raise ExportError(
            f"{where}: {CONFIG_FILE}: {PROVENANCE_KEY}.format: {block.format!r}, not {fmt.name!r}"
        )
    ours = cast(tuple[int, int, int], tuple(block.aux_layer_ids))
    written = fmt.engine_layer_ids(ours, provenance_layers(block))
    if written != facts.engine_aux_layer_ids:
        raise ExportError(
            f"{where}: aux layers {list(ours)} (project convention) should be written {list(written)} for "
            f"{fmt.name}, but the config has {list(facts.engine_aux_layer_ids or [])}"
        )
    trained = (
        block.drafter_variant.model_dump()
        if block.drafter_variant is not None
        else {**dict.fromkeys(FLAGS, False), "sliding_window": None}
    )
    served = variant_of(facts.drafter)
    off = [f"{k} {served[k]!r} (trained {trained[k]!r})" for k in served if trained[k] != served[k]]
    if off:
        raise ExportError(
            f"{where}: the engine fields give another drafter than the one trained: {'; '.join(off)}"
        )
    return block


def provenance_layers(block: Provenance) -> LayerTarget:
    """The target an export of ours was written for, as far as its aux layer numbers go."""
    target = block.target
    if target is None:
        return LayerTarget((), None)
    return LayerTarget(tuple(target.architectures or ()), target.num_layers)


def check_export(fmt: ExportFormat, out_dir: Path) -> CheckedExport:
    """Validate a directory as `fmt`; returns what it read. Reads the weights' header and d2t/t2d only.

    Our own exports (with provenance) are checked strictly; a drafter made elsewhere as its engine reads it.
    """
    out_dir = Path(out_dir)
    where = f"{out_dir} ({fmt.name} export)"
    config = read_config_file(out_dir, where)
    block = config.get(PROVENANCE_KEY)
    ours = block is not None
    files = _weight_files(out_dir, ours, where)
    legacy = isinstance(block, dict) and block.get("schema") == LEGACY_SCHEMA
    facts = fmt.read_config(config, where, ours=ours and not legacy)
    provenance_block = _check_provenance(fmt, facts, where) if ours else None

    header: dict[str, tuple[str, tuple[int, ...]]] = {}
    tensors: dict[str, tuple[Path, str]] = {}
    for path in files:
        for name, meta in _weights_header(path).items():
            key = name if ours else fmt.canonical_key(name)
            if key in tensors:
                raise ExportError(f"{where}: two tensors for {key} ({tensors[key][1]} and {name})")
            header[key], tensors[key] = meta, (path, name)
    expected = fmt.expected_shapes(facts.drafter)
    optional = {} if ours else fmt.external_optional(facts.drafter)
    required = expected.keys() - optional.keys()
    allowed = expected | optional
    missing, unexpected = sorted(required - header.keys()), sorted(header.keys() - allowed.keys())
    if missing or unexpected:
        raise ExportError(
            f"{where}: weight keys differ from the {fmt.name} layout: missing {missing}, unexpected {unexpected}"
        )
    wrong = [
        f"{k} {list(header[k][1])} (expected {list(allowed[k])})"
        for k in header
        if header[k][1] != allowed[k]
    ]
    if wrong:
        raise ExportError(f"{where}: shapes do not match config.json: {'; '.join(wrong)}")
    dtype = _float_dtype(header, facts.dtype, where)

    d2t, t2d = _read_pair(tensors, facts.drafter, where)
    problem = vocab_problem(d2t, t2d, facts.drafter.draft_vocab_size, facts.drafter.target_vocab_size)
    if problem is not None:
        raise ExportError(f"{where}: inconsistent d2t/t2d: {problem}")
    return CheckedExport(config, facts, provenance_block, dtype, tensors)


def _float_dtype(
    header: dict[str, tuple[str, tuple[int, ...]]], declared: torch.dtype | None, where: str
) -> torch.dtype:
    """The one dtype of the drafter's float tensors: the declared one for our exports, the weights' own else."""
    kinds = {k: ("I64" if k == "d2t" else "BOOL" if k == "t2d" else None) for k in header}
    if declared is not None:
        float_name = DTYPES[dtype_name(declared)][1]
        want = {k: v or float_name for k, v in kinds.items()}
        wrong = [f"{k} {header[k][0]} (expected {d})" for k, d in want.items() if header[k][0] != d]
        if wrong:
            raise ExportError(
                f"{where}: dtypes do not match config.json ({dtype_name(declared)}): {'; '.join(wrong)}"
            )
        return declared
    wrong = [f"{k} {header[k][0]} (expected {v})" for k, v in kinds.items() if v and header[k][0] != v]
    if wrong:
        raise ExportError(f"{where}: vocab mapping dtypes: {'; '.join(wrong)}")
    floats = {header[k][0] for k, v in kinds.items() if v is None}
    by_header = {st: name for name, (_, st) in DTYPES.items()}
    if not (len(floats) == 1 and next(iter(floats)) in by_header):
        raise ExportError(f"{where}: the weights must share one of {', '.join(DTYPES)}, got {sorted(floats)}")
    return DTYPES[by_header[next(iter(floats))]][0]


def _read_pair(
    tensors: dict[str, tuple[Path, str]], cfg: DrafterConfig, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from the weights, or the identity mapping where a full-vocab drafter carries none."""
    present = [key for key in ("d2t", "t2d") if key in tensors]
    if not present:
        # check_export allows this only when the draft vocab is the target's (external_optional)
        return torch.zeros(cfg.draft_vocab_size, dtype=torch.int64), torch.ones(
            cfg.target_vocab_size, dtype=torch.bool
        )
    if len(present) != 2:
        raise ExportError(f"{where}: {present[0]} without its pair: give both d2t and t2d, or neither")
    pair = []
    for key in ("d2t", "t2d"):
        path, name = tensors[key]
        with safe_open(str(path), framework="pt") as f:
            pair.append(f.get_tensor(name))
    return pair[0], pair[1]


# ---- loading ---------------------------------------------------------------------------------------------
def load(
    fmt: ExportFormat,
    out_dir: Path,
    embed_weight: torch.Tensor | None,
    *,
    target_num_layers: int | None = None,
    target_architectures: Sequence[str] = (),
) -> LoadedExport:
    """Validate, then rebuild our drafter (in the directory's dtype) with d2t, t2d and what the directory says.

    `target_num_layers`: only for a config that names no aux layers, whose engines then use their default
    (2, L//2, L-3) for the target. `target_architectures`: the target's, for a drafter made elsewhere whose
    engine numbers aux layers by model (SGLang); ours records the target it was exported for.
    """
    checked = check_export(fmt, out_dir)
    facts, where, dtype = checked.facts, f"{out_dir} ({fmt.name} export)", checked.dtype
    external = checked.provenance is None
    d2t, t2d = _read_pair(checked.tensors, facts.drafter, where)
    drafter_keys = {fmt.engine_key(k) for k in drafter_shapes(facts.drafter)}
    state: dict[str, torch.Tensor] = {}
    for path in sorted({path for path, _ in checked.tensors.values()}):
        with safe_open(str(path), framework="pt") as f:
            for key, (where_is, name) in checked.tensors.items():
                # d2t/t2d are returned apart; speculators' verifier_* copies are no part of the drafter
                if where_is == path and key in drafter_keys:
                    state[fmt.our_key(key)] = f.get_tensor(name)
    if EMBED_KEY in state and not fmt.with_embedding:
        # SGLang always gives an EAGLE-3 drafter the target's embedding (set_embed); the file's is not used
        del state[EMBED_KEY]
    if EMBED_KEY in state:
        # the directory carries the embedding the engine will use; a different one from the caller is a wrong pairing
        if embed_weight is not None:
            same = embed_weight.shape == state[EMBED_KEY].shape and torch.equal(
                embed_weight.to("cpu", dtype), state[EMBED_KEY]
            )
            if not same:
                raise ExportError(
                    f"{where}: its embed_tokens differ from the embedding given: exported for another target?"
                )
    else:
        if embed_weight is None:
            raise ExportError(f"{where}: no embed_tokens in the export: pass the target's embedding")
        expected = (facts.drafter.target_vocab_size, facts.drafter.hidden_size)
        if tuple(embed_weight.shape) != expected:
            raise ExportError(
                f"{where}: embedding given is {list(embed_weight.shape)}, expected {list(expected)}"
            )
        state[EMBED_KEY] = embed_weight.to("cpu", dtype)
    drafter = Eagle3Drafter(facts.drafter).to(dtype)
    # check_export made the key sets equal; strict all the same, so a drift in our own model cannot pass
    drafter.load_state_dict(state, strict=True)
    engine_ids = facts.engine_aux_layer_ids
    if engine_ids is None:
        if target_num_layers is None:
            raise ExportError(
                f"{where}: config.json names no aux layers, so the engine uses its default (2, L//2, L-3) for the target: "
                "pass target_num_layers"
            )
        try:
            project_ids = default_aux_layer_ids(target_num_layers, where)
        except ValueError as e:
            raise ExportError(str(e)) from e
    block = checked.provenance
    # ours says what it was written for; a drafter from elsewhere is read for the target the caller names
    layers = (
        provenance_layers(block)
        if block is not None
        else LayerTarget(tuple(target_architectures), target_num_layers)
    )
    if engine_ids is None:
        engine_ids = fmt.engine_layer_ids(project_ids, layers)
    info = ExportInfo(
        format=fmt.name,
        aux_layer_ids=fmt.project_layer_ids(engine_ids, layers),
        engine_aux_layer_ids=engine_ids,
        dtype=dtype,
        final_state_convention=block.final_state_convention if block else None,
        vocab_mapping_fingerprint=block.vocab_mapping_fingerprint if block else None,
        target_name_or_path=block.target.name_or_path if block and block.target else None,
        external=external,
    )
    return LoadedExport(drafter, d2t, t2d, info)
