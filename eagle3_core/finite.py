"""Whether weights hold only finite numbers. A diverged training run (train.lr far too large) turns its
drafter's weights to NaN or inf; such weights are never checkpointed, written as a run's final drafter,
exported or promoted (docs/store.md, the fault table)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

CHUNK = 1 << 24  # values checked at a time: a multi-GB tensor never gets a mask of its own size


def nonfinite_tensor(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """'NAME holds 2 NaN and 1 infinite of 4,096 values' for the first of `tensors` (name, tensor) that is not
    finite, in the order given; None when every one is. Integer and bool tensors are finite."""
    for name, tensor in tensors:
        if not tensor.is_floating_point():
            continue
        flat = tensor.detach().reshape(-1)
        if all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(CHUNK)):
            continue
        nan = sum(int(torch.isnan(chunk).sum()) for chunk in flat.split(CHUNK))
        inf = sum(int(torch.isinf(chunk).sum()) for chunk in flat.split(CHUNK))
        held = " and ".join([f"{nan:,} NaN"] * bool(nan) + [f"{inf:,} infinite"] * bool(inf))
        return f"{name} holds {held} of {flat.numel():,} values"
    return None
