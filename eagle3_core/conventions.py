"""The conventions every room shares, in one place (docs/design.md, section 2): how aux layers and the final
state are named, the default aux layers and the one check of a choice of them, and why a row can be rejected.

Imported by config, store, data, targets, draft and export; imports nothing of eagle3 but its errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from eagle3_core.errors import ConfigError

AUX_LAYER_CONVENTION = "input_of_layer"  # aux k = output_hidden_states[k] = the output of layer k-1
FinalStateConvention = Literal["pre_norm", "post_norm"]

# Why a conversation row was rejected; every reason is counted and the row kept with its location.
REJECT_REASONS = (
    "invalid_utf8",
    "malformed_json",
    "wrong_shape",
    "unknown_role",
    "empty_content",
    "no_assistant_turn",
    "duplicate",
)


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


def check_aux_layer_ids(
    ids: Sequence[int], num_layers: int | None = None, where: str = ""
) -> tuple[int, int, int]:
    """`ids` as a triple, once they are three distinct layers >= 0 in ascending order (the engines concatenate
    the aux states in layer order, so another order would feed fc its inputs permuted), and below
    `num_layers` when the target's layer count is known.

    ConfigError is a ValueError: callers that report another error kind (an export's) catch ValueError.
    """
    if len(ids) != 3 or len(set(ids)) != 3:
        raise ConfigError(f"target.aux_layer_ids must be three distinct layers, got {list(ids)}")
    if min(ids) < 0:
        raise ConfigError(f"target.aux_layer_ids must be >= 0, got {list(ids)}")
    if list(ids) != sorted(ids):
        raise ConfigError(
            f"target.aux_layer_ids must be in ascending layer order, got {list(ids)}; write {sorted(ids)}"
        )
    if num_layers is not None and max(ids) >= num_layers:
        raise ConfigError(
            f"target.aux_layer_ids {list(ids)} must lie in [0, {num_layers - 1}]: "
            f"the target has {num_layers} layers{_of(where)}"
        )
    return (ids[0], ids[1], ids[2])


def _of(where: str) -> str:
    return f" ({where})" if where else ""
