"""What both engines' config.json formats share, declared as strict, frozen pydantic models (the way speculators
declares its Eagle3SpeculatorConfig): the Llama decoder layer, eagle3's provenance block, and the rules that make
one model serve both kinds of directory (docs/design.md, section 5); and speculators' `speculators_config` block.
No torch: the serve commands (steps/serving.py) read exports through these models without importing it.

A field that an engine reads with a default carries that default, so a drafter made elsewhere validates as its
engine reads it (unknown keys kept aside, as the engines skip them). Our own exports are validated with
`ours=True`, and then every field must be given explicitly, no field may be null where eagle3 writes a value, and
no key eagle3 does not write may be there: an engine would take an absent field as its default and skip an unknown
one silently. The format's own models live beside its writer (sglang.py, speculators.py); the writer builds the
model and writes `model_dump`, a reader gets `validated`'s model, or one ExportError naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self, TypeVar

from annotated_types import MinLen
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError

from eagle3_core.errors import ExportError
from eagle3_core.store.records import FIELD, field_error, field_path

FormatName = Literal["sglang", "speculators"]
DtypeName = Literal["float32", "bfloat16", "float16"]  # the dtypes a drafter is exported in
CONFIG_FILE = "config.json"
PROVENANCE_KEY = "eagle3_export"  # our own block inside config.json; the engines ignore unknown fields
VARIANT_KEY = "drafter_variant"  # inside the provenance: the variant the drafter was trained as
SCHEMA = "eagle3.export/2"
# exports written before the variant flags: their drafter had none (all false, no window), and their SGLang
# config names no flag, so they are read as the engine reads them and checked against that all-false variant
LEGACY_SCHEMA = "eagle3.export/1"

M = TypeVar("M", bound=BaseModel)


def is_ours(info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get("ours"))


def _not_null(value: Any) -> Any:
    if value is None:
        raise PydanticCustomError("eagle3", "is null: give a value or leave the field out")
    return value


def _not_null_in_ours(value: Any, info: ValidationInfo) -> Any:
    if value is None and is_ours(info):
        raise PydanticCustomError("eagle3", "is null: eagle3 writes a value (an engine reads null as unset)")
    return value


# may be absent (the engine's default) but never null
NOT_NULL = AfterValidator(_not_null)
# null reads as unset in a drafter made elsewhere; ours always writes a value
NOT_NULL_IN_OURS = AfterValidator(_not_null_in_ours)
# a variant flag: absent or null is the engine's default (false)
Flag = Annotated[bool | None, NOT_NULL_IN_OURS]


def _three_distinct(ids: list[int]) -> list[int]:
    if len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0:
        raise PydanticCustomError("eagle3", f"must be three distinct integers >= 0, got {ids!r}")
    return ids


LayerIds = Annotated[list[int], AfterValidator(_three_distinct)]


def _positive(window: int | None) -> int | None:
    if window is not None and window < 1:
        raise PydanticCustomError("eagle3", f"must be positive, got {window}")
    return window


Window = Annotated[int | None, AfterValidator(_positive)]


class EngineModel(BaseModel):
    """A JSON object of a config.json: strict JSON types (no 1 for true, no "3" for 3), frozen."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True, protected_namespaces=())

    @model_validator(mode="after")
    def _written_by_eagle3(self, info: ValidationInfo) -> Self:
        if not is_ours(info):
            return self
        for name in self.model_extra or {}:
            raise field_error(name, "is no field eagle3 writes (an engine would read or skip it unasked)")
        for name, spec in type(self).model_fields.items():
            if spec.exclude and name in self.model_fields_set:
                raise field_error(name, "is no field eagle3 writes (a legacy name an engine still reads)")
            if not spec.exclude and name not in self.model_fields_set:
                raise field_error(spec.alias or name, "missing (eagle3 writes every field explicitly)")
        return self


class RopeParameters(EngineModel):
    rope_type: Literal["default"]  # our drafter runs plain RoPE whatever the target uses
    rope_theta: float


class LlamaLayer(EngineModel):
    """The one Llama decoder layer both engines build the drafter from, as eagle3 writes it. Only our own exports
    are read with it: a drafter made elsewhere goes through transformers' LlamaConfig, as in the engines.

    RoPE is written both ways: `rope_theta` for transformers 4 readers (SGLang, older vLLM), `rope_parameters` for
    transformers 5; no scaling. The dtype too: `torch_dtype` for transformers 4, `dtype` for 5.
    """

    model_type: Literal["llama"]
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # explicit: speculators builds its RoPE from a config with hidden_size doubled
    hidden_act: Literal["silu"]
    rms_norm_eps: float
    rope_theta: float
    rope_parameters: RopeParameters
    vocab_size: int  # the target's
    max_position_embeddings: int
    num_hidden_layers: Literal[1]  # one EAGLE-3 decoder layer
    attention_bias: Literal[False]  # our drafter has no biases
    mlp_bias: Literal[False]
    tie_word_embeddings: Literal[False]  # lm_head is the drafter's own
    torch_dtype: DtypeName
    dtype: DtypeName

    @model_validator(mode="after")
    def _said_once(self) -> Self:
        if self.rope_parameters.rope_theta != self.rope_theta:
            raise field_error(
                "rope_parameters.rope_theta",
                f"{self.rope_parameters.rope_theta} disagrees with rope_theta {self.rope_theta}",
            )
        if self.dtype != self.torch_dtype:
            raise field_error("dtype", f"{self.dtype!r} disagrees with torch_dtype {self.torch_dtype!r}")
        return self

    def drafter_sizes(self) -> dict[str, Any]:
        """The layer's sizes as DrafterConfig fields."""
        derived = self.head_dim * self.num_attention_heads == self.hidden_size
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_attention_heads,
            "num_kv_heads": self.num_key_value_heads,
            # None when it is the derived value, so a reloaded config equals the one that was exported
            "head_dim": None if derived else self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "target_vocab_size": self.vocab_size,
        }


class DrafterVariant(EngineModel):
    """The variant the drafter was trained as; the engine fields must give the same network."""

    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    norm_before_residual: bool
    sliding_window: Window  # the W keys in (q - W, q]; SGLang's serve command reads it from here


class TargetRecord(EngineModel):
    name_or_path: str | None = None  # what the serving host loads the target as
    num_layers: int | None = None
    architectures: list[str] | None = None
    model_type: str | None = None
    vocab_size: int | None = None
    hidden_size: int | None = None


class Provenance(EngineModel):
    """Our block in config.json (the engines ignore it): what the engine fields cannot say."""

    schema_: Literal["eagle3.export/2", "eagle3.export/1"] = Field(alias="schema")
    format: FormatName
    aux_layer_ids: LayerIds  # the project convention
    aux_layer_convention: str | None = None
    engine_aux_layer_ids: list[int] | None = None  # as the config gives them to the engine
    final_state_convention: Literal["pre_norm", "post_norm"]
    drafter_variant: Annotated[DrafterVariant | None, NOT_NULL_IN_OURS] = None  # from eagle3.export/2 on
    vocab_mapping_fingerprint: str | None = None
    dtype: str | None = None
    target: Annotated[TargetRecord | None, NOT_NULL_IN_OURS] = None


def _at_least_one(tokens: int | None) -> int | None:
    if tokens is not None and tokens < 1:
        raise PydanticCustomError("eagle3", f"must be >= 1, got {tokens}")
    return tokens


class Proposal(EngineModel):
    proposal_type: Annotated[str | None, NOT_NULL] = None
    speculative_tokens: Annotated[int | None, NOT_NULL, AfterValidator(_at_least_one)] = None
    verifier_accept_k: Annotated[int | None, NOT_NULL] = None
    accept_tolerance: Annotated[float | None, NOT_NULL] = None


class Verifier(EngineModel):
    # required, as vLLM needs the field; speculators' trainer may save a verifier without a path (null)
    name_or_path: Annotated[str | None, NOT_NULL_IN_OURS]
    architectures: Annotated[list[str] | None, NOT_NULL_IN_OURS] = None


class SpeculatorsBlock(EngineModel):
    """`speculators_config` of a speculators config.json: what vLLM's speculators reader needs
    (`validate_speculators_config`). Here, not in export/speculators.py, so that serving reads the verifier
    without importing torch."""

    algorithm: Literal["eagle3"]
    default_proposal_method: str
    proposal_methods: Annotated[list[Proposal], MinLen(1)]
    verifier: Verifier

    @model_validator(mode="after")
    def _proposals(self) -> Self:
        if self.proposal_methods[0].speculative_tokens is None:
            raise field_error("proposal_methods[0].speculative_tokens", "missing")
        if self.default_proposal_method not in [m.proposal_type for m in self.proposal_methods]:
            raise field_error(
                "default_proposal_method", f"{self.default_proposal_method!r} is not a listed proposal"
            )
        return self


def validated(model: type[M], data: Any, where: str, *, ours: bool) -> M:
    """`data` (a config.json's object) as `model`, or an ExportError naming the file and the field path."""
    try:
        return model.model_validate(data, context={"ours": ours})
    except ValidationError as e:
        raise ExportError(f"{where}: {CONFIG_FILE}: {describe(e.errors()[0])}") from e


def describe(error: ErrorDetails) -> str:
    """One pydantic error as `path.to[0].field: what is wrong`."""
    ctx = error.get("ctx") or {}
    path = field_path((*error["loc"], *([ctx[FIELD]] if FIELD in ctx else [])))
    kind = error["type"]
    if kind == "missing":
        detail = "missing"
    elif kind == "eagle3":
        detail = error["msg"]
    elif kind == "value_error":  # a ValueError raised by a field's own validator: its message alone
        detail = str(ctx["error"])
    elif kind == "literal_error":
        detail = f"must be {ctx['expected']}, got {error['input']!r}"
    else:
        detail = f"{error['msg'][0].lower()}{error['msg'][1:]}, got {error['input']!r}"
    return f"{path or 'the file'}: {detail}"
