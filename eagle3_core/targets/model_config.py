"""The fields eagle3 reads of a target's config.json (the user's Hugging Face file, so any other field is
kept as given): the language model's shape, which the drafter copies, and the dtype it is served in.

A multimodal wrapper keeps its language model's config in `text_config`; `read_text_config` returns that, or
the file itself. A field missing or of the wrong type is one TargetError line naming the file and the field
(`text_config.hidden_size: Field required`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, ValidationError

from eagle3_core.errors import TargetError
from eagle3_core.store.atomic import read_json_object
from eagle3_core.store.records import validation_message

CONFIG_FILE = "config.json"
TEXT_CONFIG = "text_config"  # where a multimodal wrapper keeps its language model's config
DEFAULT_ROPE_THETA = 10000.0  # transformers' LlamaConfig default
# The drafter of an MLA target (`TextConfig.drafter_attention`): 128, the head size of Llama-3, Qwen3 and their
# drafters, which every attention backend of SGLang and vLLM serves, and 8 key/value heads as Llama-3-70B has
MLA_DRAFTER_HEAD_DIM = 128
MLA_DRAFTER_KV_HEADS = 8


class HFFields(BaseModel):
    model_config = ConfigDict(frozen=True, extra="allow")


class RopeParameters(HFFields):
    """transformers 5's `rope_parameters` (one RoPE for every layer; other shapes keep their fields as given)."""

    rope_theta: PositiveFloat | None = None


class TextConfig(HFFields):
    """The language model's config: what the drafter's one decoder layer is shaped from, the target's head, and
    the serving dtype."""

    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_attention_heads: PositiveInt
    vocab_size: PositiveInt
    num_key_value_heads: PositiveInt | None = None  # absent or null: as many as the attention heads
    head_dim: PositiveInt | None = None  # absent or null: hidden_size // num_attention_heads
    rms_norm_eps: PositiveFloat = 1e-6
    rope_theta: PositiveFloat | None = None  # transformers 4's place for it
    rope_parameters: RopeParameters | None = None  # transformers 5's
    model_type: str | None = None
    tie_word_embeddings: bool = False  # lm_head is the embedding (and may be absent from the weights)
    kv_lora_rank: PositiveInt | None = None  # set: multi-head latent attention (DeepSeek-V3, Kimi-K2.5)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def drafter_attention(self) -> tuple[int, int, int]:
        """(heads, kv heads, head size) of the drafter's one Llama attention layer.

        A target with ordinary attention: its own. An MLA target has no per-head size a Llama layer can copy: its
        config's head_dim, where transformers writes one, is the rope part (64 in DeepSeek-V3), and hidden over
        heads is 56 (DeepSeek-V3, 128 heads) or 112 (Kimi-K2.5, 64 heads), sizes attention kernels are not built
        for. Its drafter gets heads of MLA_DRAFTER_HEAD_DIM, hidden / 128 of them (56 at hidden 7168), and
        MLA_DRAFTER_KV_HEADS key/value heads (as many as divide the heads)."""
        if self.kv_lora_rank is None:
            return self.num_attention_heads, self.kv_heads, self.dim
        dim = min(MLA_DRAFTER_HEAD_DIM, self.hidden_size)
        heads = self.hidden_size // dim
        return heads, math.gcd(heads, MLA_DRAFTER_KV_HEADS), dim

    @property
    def theta(self) -> float:
        """RoPE's base: rope_parameters' first, then the top-level field, then transformers' default."""
        nested = self.rope_parameters.rope_theta if self.rope_parameters else None
        return nested if nested is not None else self.rope_theta or DEFAULT_ROPE_THETA


class DecoderSizes(HFFields):
    """The sizes the weights' own shapes show (eagle3_core/targets/weights.py checks them against the
    safetensors headers before anything loads); vocab_size is optional here as transformers has defaults."""

    hidden_size: PositiveInt
    num_hidden_layers: PositiveInt
    vocab_size: PositiveInt | None = None


Fields = TypeVar("Fields", bound=HFFields)


class Multimodal(HFFields, Generic[Fields]):
    text_config: Fields


def read_language_fields(model_dir: Path, fields: type[Fields]) -> tuple[Fields, str]:
    """`fields` of the language model in `model_dir`'s config.json (its `text_config` where it has one), and
    the prefix that names them in the file ('text_config.' or '')."""
    path = Path(model_dir) / CONFIG_FILE
    outer = read_json_object(path, TargetError)
    try:
        if TEXT_CONFIG in outer:
            wrapper: type[Multimodal[Fields]] = Multimodal[fields]  # type: ignore[valid-type]
            return wrapper.model_validate(outer).text_config, f"{TEXT_CONFIG}."
        return fields.model_validate(outer), ""
    except ValidationError as err:
        raise TargetError(validation_message(path, err)) from None


def read_text_config(model_dir: Path) -> TextConfig:
    """The language model's config in `model_dir`'s config.json (its `text_config` where it has one)."""
    return read_language_fields(model_dir, TextConfig)[0]
