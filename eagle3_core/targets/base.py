"""The one seam every target backend plugs into: hidden states for a batch of token sequences.

Layer convention (docs/design.md, section 6): aux layer `k` is the residual stream entering decoder layer `k`
(0-based), which is `output_hidden_states[k]` in transformers. The final state is recorded with its
convention: `post_norm` (after the model's final norm, what enters `lm_head`) or `pre_norm`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from eagle3_core.errors import ConfigError

if TYPE_CHECKING:  # annotations only: the target directory is checked (targets/resolve.py) without torch
    import torch

AUX_LAYER_CONVENTION = "input_of_layer"  # aux k = output_hidden_states[k] = the output of layer k-1
FinalStateConvention = Literal["pre_norm", "post_norm"]


def default_aux_layer_ids(num_layers: int, where: str = "") -> tuple[int, int, int]:
    """(2, L//2, L-3): the layers EAGLE, SGLang and vLLM all default to.

    `where`: what says the target has `num_layers` layers (its config.json), for the message.
    """
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or min(ids) < 0:
        raise ConfigError(
            f"a target with {num_layers} layers{_of(where)} has no three distinct default aux layers "
            f"{list(ids)}; set target.aux_layer_ids to three distinct layers in [0, {num_layers - 1}]"
        )
    return ids


def check_aux_layer_ids(ids: Sequence[int], num_layers: int, where: str = "") -> tuple[int, int, int]:
    """`ids` as a triple, once they are three distinct layers of a target with `num_layers` layers.

    ConfigError is a ValueError: callers that report another error kind (an export's) catch ValueError.
    """
    if len(ids) != 3 or len(set(ids)) != 3:
        raise ConfigError(f"target.aux_layer_ids must be three distinct layers, got {list(ids)}")
    if list(ids) != sorted(ids):  # the engines concatenate the aux states in layer order
        raise ConfigError(f"target.aux_layer_ids must be in ascending layer order, got {list(ids)}")
    if not all(0 <= k < num_layers for k in ids):
        raise ConfigError(
            f"target.aux_layer_ids {list(ids)} must lie in [0, {num_layers - 1}]: "
            f"the target has {num_layers} layers{_of(where)}"
        )
    return (ids[0], ids[1], ids[2])


def _of(where: str) -> str:
    return f" ({where})" if where else ""


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

    def as_metadata(self) -> dict[str, object]:
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "compute_dtype": self.dtype,
        }


@dataclass(frozen=True)
class HiddenStates:
    aux: torch.Tensor  # [T, 3H]: aux layers concatenated in aux_layer_ids order
    last: torch.Tensor  # [T, H]: the final state, under TargetInfo.final_state_convention


@dataclass(frozen=True)
class SampleFailure:
    """A sample the backend could not produce states for; it is counted and kept out of the shard."""

    reason: str


class TargetBackend(Protocol):
    info: TargetInfo

    def hidden_states(
        self, batch: Sequence[Sequence[int]], dtype: torch.dtype | None = None
    ) -> list[HiddenStates | SampleFailure]:
        """States for each token sequence of the batch, in order; exactly len(seq) rows each, on the CPU.

        `dtype`: the dtype to return (the shard's storage dtype), so the cast happens once, where it is cheapest.
        """
        ...
