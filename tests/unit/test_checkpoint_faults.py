"""A training checkpoint's faults. A truncated or changed file is caught by the checksums its state.json
records, named in one line, set aside (renamed, kept) and the previous checkpoint resumed; none left to resume
from is a one-line refusal, every time; a checkpoint from before checksums resumes unverified, with a line; a
full disk while one is saved is a DiskSpaceError that leaves nothing half-written and the earlier ones intact."""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError

from eagle3_core.errors import CheckpointCorruptError, DiskSpaceError
from eagle3_core.train import checkpoint
from eagle3_core.train.checkpoint import (
    OPTIMIZER,
    STATE,
    WEIGHTS,
    checkpoint_dir,
    list_checkpoints,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from tests.full_disk import SAFETENSORS_FULL
from tests.records import run_progress


def _save(run_dir: Path, step: int) -> Path:
    """A checkpoint of a real AdamW state (moments, a 0-d step count, tuple betas) at `step`."""
    torch.manual_seed(step)
    weight = torch.nn.Parameter(torch.randn(8, 16))
    opt = torch.optim.AdamW([weight], lr=1e-3, betas=(0.9, 0.95))
    weight.grad = torch.randn(8, 16)
    opt.step()
    return save_checkpoint(run_dir, step, {"fc.weight": weight}, opt.state_dict(), run_progress(step), keep=3)


def _flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _tensor_byte(path: Path) -> int:
    return path.stat().st_size - 1  # safetensors: the data comes last, so the last byte is a tensor's


def _state_digit(path: Path) -> int:
    """The offset of the first digit of state.json's `tokens` value: a flip of its low bit keeps valid JSON."""
    match = re.search(rb'"tokens": (\d)', path.read_bytes())
    assert match is not None
    return match.start(1)


@pytest.mark.parametrize(
    ("name", "offset"), [(WEIGHTS, _tensor_byte), (OPTIMIZER, _tensor_byte), (STATE, _state_digit)]
)
def test_one_flipped_bit_in_any_file_of_a_checkpoint_fails_its_checksum(
    tmp_path: Path, name: str, offset: Callable[[Path], int]
) -> None:
    path = _save(tmp_path, 2) / name
    _flip_bit(path, offset(path))
    with pytest.raises(CheckpointCorruptError) as raised:
        load_checkpoint(path.parent)
    assert str(raised.value).startswith(f"{path}: fails its checksum") and "\n" not in str(raised.value)
    assert raised.value.reason == "checksum"


@pytest.mark.parametrize("name", [WEIGHTS, OPTIMIZER])
def test_a_truncated_tensor_file_is_named_with_both_sizes(tmp_path: Path, name: str) -> None:
    path = _save(tmp_path, 2) / name
    size = path.stat().st_size
    os.truncate(path, size // 2)
    with pytest.raises(CheckpointCorruptError) as raised:
        load_checkpoint(path.parent)
    assert str(raised.value) == f"{path}: truncated ({size // 2:,} bytes on disk, {size:,} written)"


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    newest = _save(tmp_path, 4)
    written = (newest / WEIGHTS).stat().st_size
    os.truncate(newest / WEIGHTS, 100)
    said: list[str] = []
    ckpt = resume_checkpoint(tmp_path, said.append)
    assert ckpt is not None and ckpt.step == 2 and ckpt.verified
    assert said == [
        f"{newest / WEIGHTS}: truncated (100 bytes on disk, {written:,} written); "
        "the checkpoint of step 4 is set aside as step-00000004.truncated"
    ]
    aside = newest.with_name("step-00000004.truncated")
    # nothing lost: the damaged files are kept as they were, out of the way of resumes and of pruning
    assert sorted(p.name for p in aside.iterdir()) == sorted([WEIGHTS, OPTIMIZER, STATE])
    assert (aside / WEIGHTS).stat().st_size == 100
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]
    for step in (4, 6, 8, 10):  # the resumed run saves step 4 again, and on; keep=3 prunes, never the damaged
        _save(tmp_path, step)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [6, 8, 10] and aside.is_dir()


def test_no_intact_checkpoint_left_is_refused_in_one_line_every_time(tmp_path: Path) -> None:
    only = _save(tmp_path, 2)
    _flip_bit(only / WEIGHTS, _tensor_byte(only / WEIGHTS))
    root = tmp_path / "checkpoints"
    refusal = (
        f"{root}: no intact checkpoint to resume run {tmp_path.name} from (set aside: step-00000002.checksum); "
        f"to train the run again from step 0, move them out of {root}"
    )
    said: list[str] = []
    with pytest.raises(CheckpointCorruptError) as raised:
        resume_checkpoint(tmp_path, said.append)
    assert str(raised.value) == refusal
    assert len(said) == 1 and said[0].startswith(f"{only / WEIGHTS}: fails its checksum")
    with pytest.raises(CheckpointCorruptError) as again:  # not started over on the next attempt either
        resume_checkpoint(tmp_path, said.append)
    assert str(again.value) == refusal and len(said) == 1
    assert resume_checkpoint(tmp_path / "never-checkpointed", said.append) is None  # a fresh run starts


@pytest.mark.parametrize("name", ["selection.json", "selection.safetensors"])
def test_the_files_a_checkpoint_keeps_for_the_selector_are_verified_like_its_own(
    tmp_path: Path, name: str
) -> None:
    """`extra` files (the AL selection's, evaluate/selection.py `saved`) load back as written, checked against
    the sizes and digests state.json records: a flipped bit sets the checkpoint aside like any of its files."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 16))
    opt = torch.optim.AdamW([weight], lr=1e-3)
    extra = {
        "selection.json": b'{"best":null,"last":null}',
        "selection.safetensors": {"fc.weight": torch.ones(2)},
    }
    _save(tmp_path, 2)
    path = save_checkpoint(tmp_path, 4, {"fc.weight": weight}, opt.state_dict(), run_progress(4), 3, extra)
    ckpt = load_checkpoint(path)
    assert ckpt.extra["selection.json"] == extra["selection.json"]
    tensors = ckpt.extra["selection.safetensors"]
    assert isinstance(tensors, dict) and torch.equal(tensors["fc.weight"], torch.ones(2))
    assert (
        _save(tmp_path, 6).name == "step-00000006"
        and load_checkpoint(checkpoint_dir(tmp_path, 6)).extra == {}
    )

    _flip_bit(path / name, _tensor_byte(path / name))
    with pytest.raises(CheckpointCorruptError) as raised:
        load_checkpoint(path)
    assert (
        str(raised.value).startswith(f"{path / name}: fails its checksum")
        and raised.value.reason == "checksum"
    )


def test_a_checkpoint_written_without_checksums_resumes_unverified_with_a_line(tmp_path: Path) -> None:
    path = _save(tmp_path, 2)
    state = json.loads((path / STATE).read_text())
    # what eagle3 wrote before checkpoints carried checksums: the same files, state.json without the two fields
    legacy = {k: v for k, v in state.items() if k not in ("files", "checksum")}
    (path / STATE).write_text(json.dumps(legacy, indent=1))
    said: list[str] = []
    ckpt = resume_checkpoint(tmp_path, said.append)
    assert ckpt is not None and ckpt.step == 2 and not ckpt.verified
    assert said == [
        f"{path}: written by an earlier eagle3 without checksums, so it cannot be verified; resuming from it as it is"
    ]
    os.truncate(path / WEIGHTS, 100)  # unverified, yet a file that does not load is still caught
    with pytest.raises(CheckpointCorruptError, match="no intact checkpoint"):
        resume_checkpoint(tmp_path, said.append)
    assert said[-1].startswith(f"{path / WEIGHTS}: not a readable safetensors file (")
    assert (tmp_path / "checkpoints" / "step-00000002.unreadable").is_dir()


@pytest.mark.parametrize("name", [WEIGHTS, OPTIMIZER, STATE])
def test_a_full_disk_while_saving_is_one_line_and_leaves_the_earlier_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    _save(tmp_path, 2)
    real_save_file, real_write_text = checkpoint.save_file, Path.write_text

    def save_file(tensors: dict[str, torch.Tensor], path: Path) -> None:
        if Path(path).name != name:
            return real_save_file(tensors, path)
        Path(path).write_bytes(b"\0" * 100)  # part of it landed
        raise SafetensorError(SAFETENSORS_FULL)

    def write_text(path: Path, text: str, *args: Any, **kwargs: Any) -> int:
        if path.name != name:
            return real_write_text(path, text, *args, **kwargs)
        real_write_text(path, text[: len(text) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint, "save_file", save_file)
    monkeypatch.setattr(Path, "write_text", write_text)
    with pytest.raises(DiskSpaceError) as raised:
        _save(tmp_path, 4)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"{tmp_path}: the disk filled up while writing the checkpoint of step 4 (No space left on device); "
    )
    assert re.search(r"it needs about [\d,]+ bytes \(\d+\.\d\d GiB\) and the disk has [\d,]+ bytes", message)
    assert message.endswith("free space, then train again (it resumes from step 2)")
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002"]  # no temporary
    assert load_checkpoint(checkpoint_dir(tmp_path, 2)).verified
