"""Size presets of the toy target: the model shape and the training budget, in one frozen record.

`xs` is sized for CI and laptops: it builds end to end in about two minutes on two CPU cores. `m` is the
demo target for a GPU host (tens of millions of parameters, several epochs of chitchat).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

Positive = Annotated[int, Field(gt=0)]


class ToyPreset(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    vocab_size: Positive
    hidden_size: Positive
    num_layers: Annotated[int, Field(ge=8)]  # default aux layers (2, L//2, L-3) are distinct from L = 8 on
    num_heads: Positive
    num_kv_heads: Positive
    intermediate_size: Positive
    max_position_embeddings: Positive = 4096
    seq_len: Positive = Field(description="Training window; conversations are packed into windows of it.")
    batch_size: Positive
    steps: Positive
    lr: Annotated[float, Field(gt=0)]
    warmup_steps: Annotated[int, Field(ge=0)]
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    heldout_conversations: Positive | None = Field(
        default=None, description="Evaluate on the first N held-out conversations by sample id (None: all)."
    )

    @model_validator(mode="after")
    def _check_shape(self) -> ToyPreset:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError("seq_len must not exceed max_position_embeddings")
        return self


# One row a size, a column a field; every field not in the table keeps its default.
#   xs: steps and batch measured, not guessed: ~3,500 training tokens/s on two cores, so 170 steps of
#       4 x 512 tokens take ~100 s and leave ~15 s for imports, the tokenizer, data and evaluation.
#   m:  ~46M parameters; 1,200 steps of 16 x 1024 tokens is ~20M tokens, about six epochs of the training
#       split (75 s on one H200, held-out loss 3.21).
COLUMNS = (
    "name", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
    "seq_len", "batch_size", "steps", "lr", "warmup_steps",
)  # fmt: skip
TABLE: list[tuple[str | int | float, ...]] = [
    ("xs", 4096, 128, 8, 4, 2, 384, 512, 4, 170, 6e-3, 20),
    ("m", 8192, 512, 12, 8, 4, 1536, 1024, 16, 1200, 1e-3, 100),
]
PRESETS: dict[str, ToyPreset] = {
    str(row[0]): ToyPreset.model_validate(dict(zip(COLUMNS, row, strict=True))) for row in TABLE
}
XS, M = PRESETS["xs"], PRESETS["m"]


def get_preset(size: str) -> ToyPreset:
    try:
        return PRESETS[size]
    except KeyError:
        raise ValueError(f"unknown toy target size {size!r}; known: {sorted(PRESETS)}") from None
