"""Training checkpoints: one directory per step, written under a temporary name, fsynced and renamed, and
checked against their checksums before a run resumes from them.

    step-00000200/
      drafter.safetensors     trainable weights (the frozen target embedding is not repeated)
      optimizer.safetensors   AdamW moments and step counts, one tensor per (parameter, field)
      state.json              the run's progress, step, optimizer hyper-parameters, and the checksums
                              (store.records.CheckpointState)
      selection.json, ...     what the run's selector keeps at the step (`extra`: evaluate/selection.py),
                              recorded and verified like the others

A checkpoint directory under its final name was written whole: a crash mid-write leaves only a temporary
directory, removed when the resumed run saves that step again. Its bytes can still be lost or changed later
(a truncated copy, a flipped bit), so state.json records each tensor file's size and the sha256 of its
tensors (store.shards.tensors_digest, the shards' hash) and a checksum of its own fields. A resume takes the
newest checkpoint that verifies (`resume_checkpoint`); a newer one that does not is reported in one line
naming the file and what is wrong, and set aside: renamed `step-00000200.<reason>`, never deleted nor
pruned. When none verifies, the run is refused, not started over: that would throw away the run's progress
and rewrite its metric log for a fault the user has not seen; moving the set-aside checkpoints out of the
directory is how to start it over. A checkpoint an earlier eagle3 wrote without checksums resumes unverified,
with a line saying so (refusing it would strand every run in progress at the upgrade).

A full disk while a checkpoint is written is a DiskSpaceError naming the directory and its free space; the
temporary directory is removed and the earlier checkpoints are untouched, so the run resumes from them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3_core.errors import CheckpointCorruptError, RecordError
from eagle3_core.store.atomic import atomic_directory, fsync_path
from eagle3_core.store.disk import full_disk_is_one_line
from eagle3_core.store.records import CheckpointFile, CheckpointState, RunProgress
from eagle3_core.store.shards import tensors_digest

CHECKPOINT_DIR = re.compile(r"^step-(\d{8})$")
SET_ASIDE_DIR = re.compile(r"^step-\d{8}\.")  # step-00000200.truncated, step-00000200.checksum.2, ...
WEIGHTS = "drafter.safetensors"
OPTIMIZER = "optimizer.safetensors"
STATE = "state.json"

# a file a checkpoint keeps for another part of the run: tensors (a .safetensors file) or bytes (any other)
Extra = bytes | dict[str, torch.Tensor]


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]  # an optimizer state_dict
    state: CheckpointState
    extra: dict[str, Extra] = field(default_factory=dict)  # its other files, verified: see save_checkpoint

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def verified(self) -> bool:
        """Whether its files were checked against checksums (False: written by an eagle3 that recorded none)."""
        return self.state.checksum is not None


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


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return checkpoints_dir(run_dir) / f"step-{step:08d}"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := CHECKPOINT_DIR.match(p.name)) and p.is_dir()
    ]
    return sorted(found)


def set_aside_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoints a resume found damaged and renamed out of the way, by name."""
    root = checkpoints_dir(run_dir)
    return sorted(p for p in root.iterdir() if SET_ASIDE_DIR.match(p.name)) if root.is_dir() else []


# ---- writing -------------------------------------------------------------------------------------------------
def state_checksum(state: CheckpointState) -> str:
    """sha256 of a state's fields but `checksum` itself, as canonical JSON (what a reader parses back from the
    file hashes alike, tuples having become lists)."""
    body = state.model_dump(exclude={"checksum"})
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> CheckpointFile:
    save_file(tensors, path)
    return CheckpointFile(bytes=path.stat().st_size, sha256=tensors_digest(tensors))


def _write_extra(path: Path, content: Extra) -> CheckpointFile:
    if isinstance(content, bytes):
        path.write_bytes(content)
        return CheckpointFile(bytes=len(content), sha256=hashlib.sha256(content).hexdigest())
    return _write_tensors(path, {n: t.detach().cpu().contiguous() for n, t in content.items()})


def full_disk_stops_the_run(run_dir: Path, writing: str, needed: int) -> AbstractContextManager[None]:
    """A full disk or quota under the block is a DiskSpaceError naming the directory, what it needed and what
    is free, and the step the run will resume from (the block's own writes are atomic: nothing half-written
    is left)."""

    def say(reason: str, free: int) -> str:
        earlier = list_checkpoints(run_dir)
        resume = f"it resumes from step {earlier[-1][0]}" if earlier else "it has no checkpoint: step 0"
        return (
            f"{run_dir}: the disk filled up while writing {writing} ({reason}); it needs about "
            f"{needed:,} bytes ({needed / 2**30:.2f} GiB) and the disk has {free:,} bytes "
            f"({free / 2**30:.2f} GiB) free. Nothing was half-written: free space, then train again ({resume})"
        )

    return full_disk_is_one_line(run_dir, say)


def save_checkpoint(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    progress: RunProgress,
    keep: int,
    extra: dict[str, Extra] | None = None,
) -> Path:
    """The checkpoint of `step`, whole under its final name or absent. `extra`: further files by name, written
    inside it (so they are the step's whatever is killed when), recorded in state.json's `files` and verified
    at every load like the weights: tensors (a name ending .safetensors) by their digest, bytes by theirs."""
    final = checkpoint_dir(run_dir, step)
    weights = {n: t.detach().cpu().contiguous() for n, t in weights.items()}
    opt_tensors, groups = _flatten_optimizer(optimizer_state)
    needed = sum(t.nbytes for t in (*weights.values(), *opt_tensors.values()))
    needed += sum(
        len(c) if isinstance(c, bytes) else sum(t.nbytes for t in c.values()) for c in (extra or {}).values()
    )
    # replace: the same step saved again (a resumed run re-reaching it) replaces it whole
    with (
        full_disk_stops_the_run(run_dir, f"the checkpoint of step {step}", needed),
        atomic_directory(final, replace=True) as temp,
    ):
        files = {
            WEIGHTS: _write_tensors(temp / WEIGHTS, weights),
            OPTIMIZER: _write_tensors(temp / OPTIMIZER, opt_tensors),
        }
        for name, content in (extra or {}).items():
            files[name] = _write_extra(temp / name, content)
        state = CheckpointState(**dict(progress), step=step, param_groups=groups, files=files)
        state = state.model_copy(update={"checksum": state_checksum(state)})
        (temp / STATE).write_text(json.dumps(state.dump(), indent=1))
    for _, old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ---- reading -------------------------------------------------------------------------------------------------
def _read_state(path: Path) -> CheckpointState:
    if not path.exists():
        raise CheckpointCorruptError(f"{path}: missing", "incomplete")
    try:
        state = CheckpointState.read(path)
    except RecordError as err:  # not UTF-8, not JSON, a field missing or mistyped: it names file and field
        raise CheckpointCorruptError(str(err), "unreadable") from None
    if state.checksum is not None and (state.files is None or state.checksum != state_checksum(state)):
        raise CheckpointCorruptError(
            f"{path}: fails its checksum (its content changed after it was written)", "checksum"
        )
    return state


def _read_tensors(path: Path, recorded: CheckpointFile | None) -> dict[str, torch.Tensor]:
    """A tensor file, checked against what its checkpoint recorded of it (None: recorded nothing)."""
    if not path.exists():
        raise CheckpointCorruptError(f"{path}: missing", "incomplete")
    size = path.stat().st_size
    if recorded is not None and size != recorded.bytes:
        what = "truncated" if size < recorded.bytes else "longer than written"
        raise CheckpointCorruptError(
            f"{path}: {what} ({size:,} bytes on disk, {recorded.bytes:,} written)",
            "truncated" if size < recorded.bytes else "size",
        )
    try:
        tensors = load_file(str(path))
    except SafetensorError as err:
        raise CheckpointCorruptError(
            f"{path}: not a readable safetensors file ({err})", "unreadable"
        ) from None
    if recorded is not None and (digest := tensors_digest(tensors)) != recorded.sha256:
        raise CheckpointCorruptError(
            f"{path}: fails its checksum (its tensors hash to {digest[:12]}, {recorded.sha256[:12]} was "
            "recorded when it was written)",
            "checksum",
        )
    return tensors


def load_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at `path`, every file checked against the checksums its state.json recorded (a checkpoint
    written without them loads unverified); CheckpointCorruptError naming the file and what is wrong."""
    state = _read_state(path / STATE)
    files = state.files or {}
    weights = _read_tensors(path / WEIGHTS, files.get(WEIGHTS))
    tensors = _read_tensors(path / OPTIMIZER, files.get(OPTIMIZER))
    try:
        optimizer = _unflatten_optimizer(tensors, state.param_groups)
    except ValueError as err:  # a tensor name not `state.<index>.<field>` (only in an unverified file)
        raise CheckpointCorruptError(
            f"{path / OPTIMIZER}: a tensor name is not eagle3's ({err})", "unreadable"
        ) from None
    extra = {name: _read_extra(path / name, recorded) for name, recorded in files.items() if name not in CORE}
    return Checkpoint(path, weights, optimizer, state, extra)


CORE = (WEIGHTS, OPTIMIZER)


def _read_extra(path: Path, recorded: CheckpointFile) -> Extra:
    """A further file a checkpoint recorded (save_checkpoint's `extra`), checked against its record."""
    if path.suffix == ".safetensors":
        return _read_tensors(path, recorded)
    if not path.exists():
        raise CheckpointCorruptError(f"{path}: missing", "incomplete")
    content = path.read_bytes()
    if len(content) != recorded.bytes:
        what = "truncated" if len(content) < recorded.bytes else "longer than written"
        raise CheckpointCorruptError(
            f"{path}: {what} ({len(content):,} bytes on disk, {recorded.bytes:,} written)",
            "truncated" if len(content) < recorded.bytes else "size",
        )
    if hashlib.sha256(content).hexdigest() != recorded.sha256:
        raise CheckpointCorruptError(
            f"{path}: fails its checksum (its content changed after it was written)", "checksum"
        )
    return content


def set_aside(path: Path, reason: str) -> Path:
    """Rename a damaged checkpoint out of the resumable ones, its reason in its name (step-00000200.truncated;
    .2, .3 when that name is taken): kept for a look, never loaded nor pruned again."""
    aside, n = path.with_name(f"{path.name}.{reason}"), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}.{reason}.{n}")
    os.rename(path, aside)
    fsync_path(path.parent)
    return aside


def resume_checkpoint(run_dir: Path, log: Callable[[str], None]) -> Checkpoint | None:
    """The newest checkpoint of the run that verifies, or None when the run has none (it never checkpointed).

    Each newer one that does not verify is reported in a line and set aside. When none is left to resume from
    but some were set aside, CheckpointCorruptError: the run is refused, not silently started over.
    """
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            ckpt = load_checkpoint(path)
        except CheckpointCorruptError as err:
            aside = set_aside(path, err.reason)
            log(f"{err}; the checkpoint of step {step} is set aside as {aside.name}")
            continue
        if not ckpt.verified:
            log(
                f"{path}: written by an earlier eagle3 without checksums, so it cannot be verified; "
                "resuming from it as it is"
            )
        return ckpt
    if damaged := set_aside_checkpoints(run_dir):
        root = checkpoints_dir(run_dir)
        raise CheckpointCorruptError(
            f"{root}: no intact checkpoint to resume run {run_dir.name} from (set aside: "
            f"{', '.join(p.name for p in damaged)}); to train the run again from step 0, move them out of {root}",
            "none",
        )
    return None
