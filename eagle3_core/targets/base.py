"""The one seam every target backend plugs into: hidden states for a batch of token sequences.

Layer convention (docs/design.md, section 6): aux layer `k` is the residual stream entering decoder layer `k`
(0-based), which is `output_hidden_states[k]` in transformers. The final state is recorded with its
convention: `post_norm` (after the model's final norm, what enters `lm_head`) or `pre_norm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from eagle3_core.conventions import FinalStateConvention
from eagle3_core.store.records import TargetFacts

if TYPE_CHECKING:  # annotations only: the target directory is checked (targets/resolve.py) without torch
    import torch


@dataclass(frozen=True)
class TargetInfo:
    name: str
    fingerprint: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    aux_layer_ids: tuple[int, int, int]
    final_state_convention: FinalStateConvention
    dtype: str
    device: str

    def facts(self) -> TargetFacts:
        """The target as a shard's header records it."""
        return TargetFacts(
            name=self.name,
            fingerprint=self.fingerprint,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            vocab_size=self.vocab_size,
            compute_dtype=self.dtype,
        )


@dataclass(frozen=True)
class HiddenStates:
    """A sample's states, in a float dtype or, with their scales, already FP8 (store/fp8.py `quantize`'s
    scheme: a float32 scale per token and layer block, laid out as an FP8 shard stores them: shards.SCALES).
    """

    aux: torch.Tensor  # [T, 3H]: aux layers concatenated in aux_layer_ids order
    last: torch.Tensor  # [T, H]: the final state, under TargetInfo.final_state_convention
    aux_scales: torch.Tensor | None = None  # [T, 3] float32 when aux is FP8
    last_scales: torch.Tensor | None = None  # [T, 1] float32 when last is FP8


@dataclass(frozen=True)
class SampleFailure:
    """A sample the backend could not produce states for; it is counted and kept out of the shard."""

    reason: str


class ExtractionTarget(Protocol):
    """What extraction needs of a target, whichever backend (`target.backend`) computes the states: its info,
    the tokenizer the chat template and loss mask come from (always the target directory's) and its
    fingerprint, the states, and a way to let go of what it holds.

    `quantizes_on_device`: whether `hidden_states` takes `dtype=torch.float8_e4m3fn`, to quantise the states
    where they are computed (half the bytes to copy to the host, no work on the writer's CPU threads).
    """

    info: TargetInfo
    tokenizer: Any
    tokenizer_fingerprint: str
    quantizes_on_device: bool

    def hidden_states(
        self, batch: Sequence[Sequence[int]], dtype: torch.dtype | None = None
    ) -> list[HiddenStates | SampleFailure]:
        """States for each token sequence of the batch, in order; exactly len(seq) rows each, on the CPU.

        `dtype`: the dtype to return (the shard's storage dtype), so the cast happens once, where it is cheapest.
        float8_e4m3fn, only where `quantizes_on_device`: FP8 states with their scales, quantised from bfloat16
        as the shard writer would; a sample whose states hold NaN or inf comes back as the writer's failure.
        """
        ...

    def close(self, timeout_s: float = 60.0) -> float:
        """Release what the target holds (GPU memory, an engine); the seconds waited for the memory to return."""
        ...
