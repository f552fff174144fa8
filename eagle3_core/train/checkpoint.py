"""Training checkpoints: one directory per step, written under a temporary name, fsynced and renamed.

A checkpoint directory that exists is complete, so resuming means taking the newest one; a crash mid-write
leaves only a temporary directory, removed when the resumed run saves that step again. Everything is
safetensors or JSON:

    step-00000200/
      drafter.safetensors     trainable weights (the frozen target embedding is not repeated)
      optimizer.safetensors   AdamW moments and step counts, one tensor per (parameter, field)
      state.json              the run's progress, step, optimizer hyper-parameters (store.records.CheckpointState)
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3_core.store.atomic import atomic_directory
from eagle3_core.store.records import CheckpointState, RunProgress

CHECKPOINT_DIR = re.compile(r"^step-(\d{8})$")
WEIGHTS = "drafter.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # an optimizer state_dict
    state: CheckpointState

    @property
    def step(self) -> int:
        return self.state.step


def _flatten_optimizer(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    tensors = {
        f"state.{index}.{field}": value.detach().cpu().contiguous()
        for index, fields in state_dict["state"].items()
        for field, value in fields.items()
    }
    return tensors, state_dict["param_groups"]


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, field = name.split(".", 2)
        state.setdefault(int(index), {})[field] = value
    return {"state": state, "param_groups": groups}


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_DIR.match(p.name)) and p.is_dir()
    ]
    return sorted(found)


def save_checkpoint(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    progress: RunProgress,
    keep: int,
) -> Path:
    final = checkpoints_dir(run_dir) / f"step-{step:08d}"
    opt_tensors, groups = _flatten_optimizer(optimizer_state)
    state = CheckpointState(**dict(progress), step=step, param_groups=groups)
    # replace: the same step saved again (a resumed run re-reaching it) replaces it whole
    with atomic_directory(final, replace=True) as temp:
        save_file({n: t.detach().cpu().contiguous() for n, t in weights.items()}, str(temp / WEIGHTS))
        save_file(opt_tensors, str(temp / OPTIMIZER))
        (temp / STATE).write_text(json.dumps(state.dump(), indent=1))
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path) -> Checkpoint:
    state = CheckpointState.read(path / STATE)  # RecordError naming the file and the field
    optimizer = _unflatten_optimizer(load_file(str(path / OPTIMIZER)), state.param_groups)
    return Checkpoint(path, load_file(str(path / WEIGHTS)), optimizer, state)


def latest_checkpoint(run_dir: Path) -> Checkpoint | None:
    found = list_checkpoints(run_dir)
    return load_checkpoint(found[-1][1]) if found else None
