"""What the SGLang and speculators/vLLM exports share: the target's facts, the weight layout, strict validation,
an atomic directory write, and reloading an export into our drafter.

A format (sglang.py, speculators.py) says only what differs: how it names the decoder layer's weights, whether it
carries the embedding, how it numbers the aux layers, and how it writes and reads its config.json. A missing or
unexpected key is an error, never a warning (DESIGN.md section 3): the engines skip unknown keys silently and
run random weights in place of missing ones (REFERENCE.md failure mode 2).
"""

from __future__ import annotations

import json
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, cast

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.errors import ExportError
from eagle3_core.store.atomic import fsync_path
from eagle3_core.targets.base import AUX_LAYER_CONVENTION, FinalStateConvention, check_aux_layer_ids

FormatName = Literal["sglang", "speculators"]
SCHEMA = "eagle3.export/1"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROVENANCE_KEY = "eagle3_export"  # our own block inside config.json; the engines ignore unknown fields
OUR_LAYER_PREFIX = "midlayer."
EMBED_KEY = "embed_tokens.weight"

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


# ---- the target ------------------------------------------------------------------------------------------
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
        outer = json.loads(path.read_text())
        # multimodal wrappers keep the language model's config inside
        config = outer.get("text_config", outer)
        missing = [k for k in ("num_hidden_layers", "vocab_size", "hidden_size") if k not in config]
        if missing:
            raise ExportError(f"{path}: missing {', '.join(missing)}")
        ids = tuple(int(k) for k in aux_layer_ids)
        return cls(
            name_or_path=name_or_path if name_or_path is not None else str(model_dir),
            num_layers=int(config["num_hidden_layers"]),
            aux_layer_ids=cast(tuple[int, int, int], ids),
            final_state_convention=final_state_convention,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            # the engines' own fallback when a config lacks it
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            architectures=tuple(outer.get("architectures") or ()),
            model_type=str(config.get("model_type", "")),
        )


@dataclass(frozen=True)
class ExportInfo:
    """What a reloaded export says about itself, layer ids converted back to the project convention."""

    format: FormatName
    aux_layer_ids: tuple[int, int, int]  # project convention
    engine_aux_layer_ids: tuple[int, int, int]  # as written in config.json for the engine
    dtype: torch.dtype
    final_state_convention: FinalStateConvention | None  # None for an export made elsewhere (no provenance)
    vocab_mapping_fingerprint: str | None
    target_name_or_path: str | None


class LoadedExport(NamedTuple):
    drafter: Eagle3Drafter
    d2t: torch.Tensor
    t2d: torch.Tensor
    info: ExportInfo


# ---- config.json reading ---------------------------------------------------------------------------------
_MISSING = object()


def field(
    config: dict[str, Any], path: str, kind: type | tuple[type, ...], where: str, within: str = ""
) -> Any:
    """config["a"]["b"] for path "a.b", of the given JSON type; anything else is an ExportError naming it.

    `within`: where `config` itself sits in the file (e.g. "transformer_layer_config"), for the message.
    """
    full = f"{within}.{path}" if within else path
    value: Any = config
    for part in path.split("."):
        value = value.get(part, _MISSING) if isinstance(value, dict) else _MISSING
        if value is _MISSING:
            raise ExportError(f"{where}: config field {full!r} is missing")
    # bool is an int in Python: never let true/false pass as a size, nor 1/0 as a flag
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise ExportError(f"{where}: config field {full!r} is {value!r}, not {_names(kind)}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def expect(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise ExportError(f"{where}: {message}")


def layer_ids(value: Any, path: str, where: str) -> tuple[int, int, int]:
    ok = (
        isinstance(value, list)
        and len(value) == 3
        and all(type(v) is int for v in value)
        and len(set(value)) == 3
    )
    expect(ok, where, f"{path} must be three distinct integers, got {value!r}")
    return (value[0], value[1], value[2])


def config_dtype(config: dict[str, Any], where: str) -> torch.dtype:
    """The dtype a config declares (`torch_dtype` for transformers 4 readers, `dtype` for 5); both must agree."""
    names = {config[k] for k in ("torch_dtype", "dtype") if config.get(k) is not None}
    expect(
        len(names) == 1, where, f"torch_dtype/dtype must be given and agree, got {sorted(map(str, names))}"
    )
    name = next(iter(names))
    expect(name in DTYPES, where, f"unsupported dtype {name!r}")
    return DTYPES[name][0]


@dataclass(frozen=True)
class ConfigFacts:
    """What a format's config.json says, in our terms."""

    drafter: DrafterConfig
    engine_aux_layer_ids: tuple[int, int, int]
    dtype: torch.dtype


def llama_layer_config(cfg: DrafterConfig, target: ExportTarget, dtype: torch.dtype) -> dict[str, Any]:
    """The Llama decoder-layer fields both engines build the drafter's one layer from.

    RoPE is written both ways: `rope_theta` for transformers 4 readers (SGLang, older vLLM), `rope_parameters`
    for transformers 5; no scaling, because our drafter runs plain RoPE whatever the target uses.
    """
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


def read_llama_layer(
    layer: dict[str, Any],
    where: str,
    prefix: str,
    *,
    target_hidden_size: int | None,
    draft_vocab_size: int,
    require_rope_theta: bool,
) -> tuple[DrafterConfig, torch.dtype]:
    """The inverse of `llama_layer_config`, every field checked; `prefix` names the fields' place in the file.

    `require_rope_theta`: the reader knows only the transformers 4 field (SGLang), not `rope_parameters`.
    """

    def get(key: str, kind: type | tuple[type, ...]) -> Any:
        return field(layer, key, kind, where, prefix)

    expect(get("model_type", str) == "llama", where, f"{prefix or 'config'} model_type must be 'llama'")
    expect(
        get("num_hidden_layers", int) == 1, where, "num_hidden_layers must be 1 (one EAGLE-3 decoder layer)"
    )
    expect(
        get("tie_word_embeddings", bool) is False,
        where,
        "tie_word_embeddings must be false (lm_head is the drafter's own)",
    )
    act = layer.get("hidden_act", "silu")
    expect(act == "silu", where, f"hidden_act must be silu, got {act!r}")
    biases = [k for k in ("attention_bias", "mlp_bias") if layer.get(k)]
    expect(not biases, where, f"{biases} set: our drafter has no biases")
    thetas = set()
    if "rope_theta" in layer or require_rope_theta:
        thetas.add(float(get("rope_theta", (int, float))))
    rope = layer.get("rope_parameters")
    if rope is not None:
        expect(
            isinstance(rope, dict) and rope.get("rope_type", "default") == "default",
            where,
            f"rope_parameters {rope!r}: only plain RoPE is supported",
        )
        thetas.add(float(get("rope_parameters.rope_theta", (int, float))))
    expect(
        len(thetas) == 1,
        where,
        f"rope_theta must be given (rope_theta or rope_parameters.rope_theta) and agree, got {sorted(thetas)}",
    )
    expect(
        layer.get("rope_scaling") is None,
        where,
        f"rope_scaling {layer.get('rope_scaling')!r}: our drafter runs plain RoPE",
    )
    get("max_position_embeddings", int)
    hidden = get("hidden_size", int)
    heads = get("num_attention_heads", int)
    head_dim = get("head_dim", int)
    try:
        drafter = DrafterConfig(
            target_hidden_size=target_hidden_size if target_hidden_size is not None else hidden,
            hidden_size=hidden,
            intermediate_size=get("intermediate_size", int),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", int),
            # None when it is the derived value, so a reloaded config equals the one that was exported
            head_dim=None if head_dim * heads == hidden else head_dim,
            rms_norm_eps=float(get("rms_norm_eps", (int, float))),
            rope_theta=thetas.pop(),
            target_vocab_size=get("vocab_size", int),
            draft_vocab_size=draft_vocab_size,
        )
    except ValueError as e:  # pydantic's ValidationError is a ValueError
        raise ExportError(f"{where}: inconsistent sizes ({e})") from e
    return drafter, config_dtype(layer, where)


# ---- formats ---------------------------------------------------------------------------------------------
class ExportFormat(ABC):
    name: ClassVar[FormatName]
    layer_prefix: ClassVar[str]  # what our "midlayer." is called in this format
    with_embedding: ClassVar[bool]  # whether the target's embedding travels in the weights file

    @abstractmethod
    def engine_layer_ids(self, project_ids: tuple[int, int, int]) -> tuple[int, int, int]:
        """Project-convention aux ids -> the numbers this engine's config expects."""

    @abstractmethod
    def project_layer_ids(self, engine_ids: tuple[int, int, int]) -> tuple[int, int, int]:
        """The inverse of `engine_layer_ids`."""

    @abstractmethod
    def build_config(
        self, cfg: DrafterConfig, target: ExportTarget, dtype: torch.dtype, provenance: dict[str, Any]
    ) -> dict[str, Any]:
        """The whole config.json of an export."""

    @abstractmethod
    def read_config(self, config: dict[str, Any], where: str) -> ConfigFacts:
        """Check every field the engine needs and turn them into our terms; ExportError on anything absent or off."""

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
        """Exactly the tensors this format's weights file holds, with their shapes."""
        shapes = {
            self.engine_key(k): s
            for k, s in drafter_shapes(cfg).items()
            if self.with_embedding or k != EMBED_KEY
        }
        return {**shapes, "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.target_vocab_size,)}


def drafter_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Our drafter's state_dict shapes, from the config alone (no model is built: the embedding can be GBs)."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.dim
    return {
        EMBED_KEY: (cfg.target_vocab_size, h),
        "fc.weight": (h, cfg.num_aux * cfg.target_hidden_size),
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
    fmt: ExportFormat, target: ExportTarget, mapping: VocabMapping, dtype: torch.dtype
) -> dict[str, Any]:
    """Our block in config.json: what the engines' fields cannot say (conventions, fingerprint, origin)."""
    return {
        "schema": SCHEMA,
        "format": fmt.name,
        "aux_layer_ids": list(target.aux_layer_ids),
        "aux_layer_convention": AUX_LAYER_CONVENTION,
        "engine_aux_layer_ids": list(fmt.engine_layer_ids(target.aux_layer_ids)),
        "final_state_convention": target.final_state_convention,
        # our drafter's residual comes from h, not hidden_norm(h): the network SGLang runs (failure mode 11)
        "norm_before_residual": False,
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


@contextmanager
def _staging_dir(out_dir: Path) -> Iterator[Path]:
    """A fresh temporary directory beside `out_dir`, renamed over it once the body succeeds.

    A directory cannot be swapped in one rename when the old one exists: the old one is first moved aside
    (`.NAME.old-PID`) and deleted after the new one is in place. A crash leaves at most the hidden directories,
    which the next export of the same name deletes; `out_dir` itself is always a whole export or absent.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in [
        *out_dir.parent.glob(f".{out_dir.name}.tmp-*"),
        *out_dir.parent.glob(f".{out_dir.name}.old-*"),
    ]:
        shutil.rmtree(stale, ignore_errors=True)
    temp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    temp.mkdir()
    try:
        yield temp
        fsync_path(temp)
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(temp, out_dir)
        fsync_path(out_dir.parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def write_export(
    fmt: ExportFormat,
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: ExportTarget,
    out_dir: Path,
    dtype: torch.dtype,
) -> Path:
    """Write `out_dir` as `fmt`, validate it while still hidden, then put it in place atomically."""
    cfg = drafter.cfg
    dtype_name(dtype)  # refuse an unsupported dtype before any work
    _check_inputs(cfg, mapping, target)
    tensors = {
        fmt.engine_key(name): tensor.detach().to("cpu", dtype).contiguous()
        for name, tensor in drafter.state_dict().items()
        if fmt.with_embedding or name != EMBED_KEY
    }
    tensors["d2t"] = mapping.d2t.to("cpu", torch.int64).contiguous()
    tensors["t2d"] = mapping.t2d.to("cpu", torch.bool).contiguous()
    config = fmt.build_config(cfg, target, dtype, provenance(fmt, target, mapping, dtype))
    with _staging_dir(out_dir) as temp:
        # transformers refuses a safetensors file whose metadata lacks format=pt
        save_file(tensors, str(temp / WEIGHTS_FILE), metadata={"format": "pt"})
        fsync_path(temp / WEIGHTS_FILE)
        (temp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        fsync_path(temp / CONFIG_FILE)
        check_export(fmt, temp)
    return Path(out_dir)


# ---- validation ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckedExport:
    config: dict[str, Any]
    facts: ConfigFacts
    provenance: dict[str, Any] | None


def _weights_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) from the header alone."""
    try:
        with safe_open(str(path), framework="pt") as f:
            slices = {name: f.get_slice(name) for name in f.keys()}  # noqa: SIM118 (a safe_open handle, not a dict)
            return {name: (s.get_dtype(), tuple(s.get_shape())) for name, s in slices.items()}
    except Exception as e:  # a torn or foreign file: say which, not a library traceback
        raise ExportError(f"{path}: unreadable safetensors file ({e})") from e


def _check_provenance(
    fmt: ExportFormat, config: dict[str, Any], facts: ConfigFacts, where: str
) -> dict[str, Any] | None:
    block = config.get(PROVENANCE_KEY)
    if block is None:
        return None  # an export made elsewhere (SpecForge, speculators): the engine fields were checked all the same
    expect(isinstance(block, dict), where, f"{PROVENANCE_KEY} must be an object")
    expect(
        block.get("schema") == SCHEMA,
        where,
        f"{PROVENANCE_KEY}.schema is {block.get('schema')!r}, not {SCHEMA!r}",
    )
    expect(
        block.get("format") == fmt.name,
        where,
        f"{PROVENANCE_KEY} says format {block.get('format')!r}, not {fmt.name!r}",
    )
    ours = layer_ids(block.get("aux_layer_ids"), f"{PROVENANCE_KEY}.aux_layer_ids", where)
    expect(
        fmt.engine_layer_ids(ours) == facts.engine_aux_layer_ids,
        where,
        f"aux layers {list(ours)} (project convention) should be written {list(fmt.engine_layer_ids(ours))} for "
        f"{fmt.name}, but the config has {list(facts.engine_aux_layer_ids)}",
    )
    expect(
        block.get("final_state_convention") in ("pre_norm", "post_norm"),
        where,
        f"{PROVENANCE_KEY}.final_state_convention is {block.get('final_state_convention')!r}",
    )
    return block


def check_export(fmt: ExportFormat, out_dir: Path) -> CheckedExport:
    """Validate a directory as `fmt`; returns what it read. Reads the weights' header and d2t/t2d only."""
    out_dir = Path(out_dir)
    where = f"{out_dir} ({fmt.name} export)"
    config_path, weights_path = out_dir / CONFIG_FILE, out_dir / WEIGHTS_FILE
    expect(config_path.is_file(), where, f"no {CONFIG_FILE}")
    expect(weights_path.is_file(), where, f"no {WEIGHTS_FILE}")
    # another weights file would be loaded too (or instead) by an engine: only ours may be there
    others = sorted(
        p.name
        for p in out_dir.iterdir()
        if p.name != WEIGHTS_FILE and p.suffix in (".safetensors", ".bin", ".pt", ".pth")
    )
    others += sorted(p.name for p in out_dir.glob("*.index.json"))
    expect(not others, where, f"unexpected weight files {others}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ExportError(f"{config_path}: not JSON ({e})") from e
    expect(isinstance(config, dict), where, f"{CONFIG_FILE} is not a JSON object")
    facts = fmt.read_config(config, where)

    header = _weights_header(weights_path)
    expected = fmt.expected_shapes(facts.drafter)
    missing, unexpected = sorted(expected.keys() - header.keys()), sorted(header.keys() - expected.keys())
    if missing or unexpected:
        raise ExportError(
            f"{where}: weight keys differ from the {fmt.name} layout: missing {missing}, unexpected {unexpected}"
        )
    wrong = [
        f"{k} {list(header[k][1])} (expected {list(s)})" for k, s in expected.items() if header[k][1] != s
    ]
    if wrong:
        raise ExportError(f"{where}: shapes do not match config.json: {'; '.join(wrong)}")
    float_dtype = DTYPES[dtype_name(facts.dtype)][1]
    want = {k: ("I64" if k == "d2t" else "BOOL" if k == "t2d" else float_dtype) for k in expected}
    wrong = [f"{k} {header[k][0]} (expected {d})" for k, d in want.items() if header[k][0] != d]
    if wrong:
        raise ExportError(
            f"{where}: dtypes do not match config.json ({dtype_name(facts.dtype)}): {'; '.join(wrong)}"
        )

    with safe_open(str(weights_path), framework="pt") as f:
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    problem = vocab_problem(d2t, t2d, facts.drafter.draft_vocab_size, facts.drafter.target_vocab_size)
    expect(problem is None, where, f"inconsistent d2t/t2d: {problem}")
    return CheckedExport(config, facts, _check_provenance(fmt, config, facts, where))


# ---- loading ---------------------------------------------------------------------------------------------
def load(fmt: ExportFormat, out_dir: Path, embed_weight: torch.Tensor | None) -> LoadedExport:
    """Validate, then rebuild our drafter (in the export's dtype) with d2t, t2d and what the export says."""
    checked = check_export(fmt, out_dir)
    facts, where = checked.facts, f"{out_dir} ({fmt.name} export)"
    tensors = load_file(str(Path(out_dir) / WEIGHTS_FILE))
    d2t, t2d = tensors.pop("d2t"), tensors.pop("t2d")
    state = {fmt.our_key(name): tensor for name, tensor in tensors.items()}
    if EMBED_KEY in state:
        # the export carries the embedding the engine will use; a different one from the caller is a wrong pairing
        if embed_weight is not None:
            same = embed_weight.shape == state[EMBED_KEY].shape and torch.equal(
                embed_weight.to("cpu", facts.dtype), state[EMBED_KEY]
            )
            expect(
                same, where, "its embed_tokens differ from the embedding given: exported for another target?"
            )
    else:
        expect(embed_weight is not None, where, "no embed_tokens in the export: pass the target's embedding")
        assert embed_weight is not None  # for mypy; expect() raised otherwise
        expected = (facts.drafter.target_vocab_size, facts.drafter.hidden_size)
        expect(
            tuple(embed_weight.shape) == expected,
            where,
            f"embedding given is {list(embed_weight.shape)}, expected {list(expected)}",
        )
        state[EMBED_KEY] = embed_weight.to("cpu", facts.dtype)
    drafter = Eagle3Drafter(facts.drafter).to(facts.dtype)
    # check_export made the key sets equal; strict all the same, so a drift in our own model cannot pass
    drafter.load_state_dict(state, strict=True)
    block = checked.provenance or {}
    info = ExportInfo(
        format=fmt.name,
        aux_layer_ids=fmt.project_layer_ids(facts.engine_aux_layer_ids),
        engine_aux_layer_ids=facts.engine_aux_layer_ids,
        dtype=facts.dtype,
        final_state_convention=block.get("final_state_convention"),
        vocab_mapping_fingerprint=block.get("vocab_mapping_fingerprint"),
        target_name_or_path=(block.get("target") or {}).get("name_or_path"),
    )
    return LoadedExport(drafter, d2t, t2d, info)
