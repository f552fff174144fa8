"""What the trainer asks of whatever chooses the weights a run keeps by measured acceptance length
(train.al_every, train.keep): evaluate/selection.py's ALSelector, given to `train_drafter` on rank 0."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.store.records import ALRow, ALSelection
from eagle3_core.train.checkpoint import Extra

BEST = "best"  # runs/<run>/best/: the kept weights and their measurement, whole or absent


class RunSelector(Protocol):
    def resume(
        self,
        run_dir: Path,
        step: int,
        saved: dict[str, Extra] | None = None,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Bind to the run in `run_dir`, resumed from `step` (0: started afresh): `saved`, what `saved` gave the
        checkpoint of `step` (None: it has none), and `weights`, the checkpoint's drafter weights."""
        ...

    def saved(self, step: int) -> dict[str, Extra]:
        """The files the checkpoint of `step` keeps for the selector, by name (train/checkpoint.py `extra`)."""
        ...

    def end_due(self, step: int) -> bool:
        """Whether a run resumed at its last step, `step`, measures it again to choose its weights (its
        checkpoint saved no measurement of it)."""
        ...

    def due(self, step: int, total: int, elapsed: float) -> bool:
        """Whether to measure at `step` of `total`; `elapsed`: seconds since training started in this process."""
        ...

    def measure(self, drafter: Eagle3Drafter, step: int) -> ALRow: ...

    def kept_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights the run ends with when they are not the last step's (None: the last step's)."""
        ...

    def selection(self, measured_steps: list[int]) -> ALSelection | None: ...
