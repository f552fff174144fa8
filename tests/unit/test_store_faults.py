"""Faults a store meets: a flipped byte before training, bad --shard names, a full disk at every write and
rename of a shard, and two writers of one shard. Shards are real ones, written by ShardWriter."""

import errno
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from eagle3_cli.steps import main
from eagle3_core.config import load_config
from eagle3_core.errors import DiskSpaceError, ShardCorruptError, StoreBusyError
from eagle3_core.steps import data, drafter
from eagle3_core.store import shards as shards_module
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.locks import exclusive_lock, writer_lock
from eagle3_core.store.records import ShardFacts, TargetFacts
from eagle3_core.store.shards import ShardReader, ShardWriter
from eagle3_core.store.stats import require_intact, shard_done, store_stats, verify_shard
from tests.conftest import write_config

H = 8
KEY = "t-00000"
LENGTHS = [5, 9, 3]


def _rows(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
        torch.ones(n, dtype=torch.uint8),
        torch.randn(n, 3 * H, generator=g),
        torch.randn(n, H, generator=g),
    )


def _write(path: Path, seed: int = 0) -> None:
    with ShardWriter(
        path,
        sample_ids=[f"{seed:04x}{i:04x}" + "a" * 56 for i in range(len(LENGTHS))],
        lengths=LENGTHS,
        hidden_size=H,
        store_dtype="float32",
        facts=ShardFacts(tokenizer_fingerprint="f" * 64, target=TargetFacts(vocab_size=100)),
    ) as w:
        for i, n in enumerate(LENGTHS):
            w.write_sample(i, *_rows(n, seed + i))
        w.finalize()


def _flip_in_hidden_states(path: Path, sample: int) -> None:
    """One bit of sample `sample`'s last hidden states, past its input ids and loss mask."""
    with ShardReader(path) as r:
        first = int(r._offsets[r._index[sample]])
        entry = r.header["last_hidden_states"]
        position = r._data_start + entry["data_offsets"][0] + first * 4 * H + 3
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x10
    path.write_bytes(bytes(raw))


def _project(tmp_path: Path, shards: int = 2) -> tuple[Path, StoreLayout]:
    config = write_config(tmp_path, "store: store\ndata: {dataset: t}\n")
    layout = StoreLayout(tmp_path / "store")
    for i in range(shards):
        _write(layout.hidden_states(f"t-{i:05d}"), seed=10 * i)
    return config, layout


def _temps(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp-" in p.name)


def _error_line(out: str) -> str:
    """The CLI's error: one line (progress lines may come before it), no traceback."""
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and out.strip().splitlines()[-1] == errors[0], out
    assert "Traceback" not in out
    return errors[0]


# ---- 1. a flipped byte is refused before anything is built or trained ----------------------------------
@pytest.mark.parametrize("argv", [["train"], ["train", "--no-vocab"], ["vocab"]])
def test_a_flipped_byte_refuses_training_before_the_vocab_or_a_run_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    config, layout = _project(tmp_path)
    _flip_in_hidden_states(layout.hidden_states("t-00001"), sample=1)
    assert main(["--config", str(config), *argv]) == 2
    line = _error_line(capsys.readouterr().out)
    assert "t-00001" in line and "sample 1 (000a0001aaaa) fails its checksum" in line
    assert "eagle3 verify" in line and "eagle3 extract --shard t-00001 --force" in line
    assert not layout.vocab_mapping.exists() and not (layout.root / "drafter").exists()


def test_the_training_step_itself_refuses_so_the_dagster_asset_does_too(tmp_path: Path) -> None:
    config, layout = _project(tmp_path)
    _flip_in_hidden_states(layout.hidden_states("t-00000"), sample=0)
    with pytest.raises(ShardCorruptError, match=r"shard t-00000 is damaged: .*sample 0"):
        drafter.drafter_checkpoint_step(load_config(config), log=lambda _: None)
    assert not (layout.root / "drafter").exists()


def test_a_shard_found_intact_is_checked_again_once_its_bytes_change(tmp_path: Path) -> None:
    _, layout = _project(tmp_path, shards=1)
    path = layout.hidden_states(KEY)
    require_intact([path])
    _flip_in_hidden_states(path, sample=2)
    with pytest.raises(ShardCorruptError, match="sample 2"):
        require_intact([path])


def test_a_shard_without_its_manifest_is_refused_with_the_repair_command(tmp_path: Path) -> None:
    _, layout = _project(tmp_path, shards=1)
    layout.hidden_states_manifest(KEY).unlink()
    with pytest.raises(ShardCorruptError, match=r"manifest missing.*eagle3 verify --repair"):
        require_intact([layout.hidden_states(KEY)])


def test_a_reader_that_refused_a_sample_still_closes(tmp_path: Path) -> None:
    path = tmp_path / f"{KEY}.safetensors"
    _write(path)
    _flip_in_hidden_states(path, sample=0)
    reader = ShardReader(path)
    out = {
        "input_ids": torch.empty(LENGTHS[0], dtype=torch.int32),
        "loss_mask": torch.empty(LENGTHS[0], dtype=torch.uint8),
        "aux_hidden_states": torch.empty(LENGTHS[0], 3 * H),
        "last_hidden_states": torch.empty(LENGTHS[0], H),
    }
    with pytest.raises(ShardCorruptError) as raised:
        reader.copy_sample_into(0, out)
    with pytest.raises(ShardCorruptError):
        reader.sample(0)
    assert raised.traceback  # the failing frames are alive; they must not pin the mapping
    reader.close()  # no BufferError


# ---- 2. --shard must be a shard key of the store ---------------------------------------------------------
@pytest.mark.parametrize("command", ["verify", "extract", "regenerate"])
@pytest.mark.parametrize("name", ["../x", "t-00000/../../etc", "t-0", "T-00000"])
def test_a_shard_name_that_is_not_a_key_is_one_line_of_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, name: str
) -> None:
    config, _ = _project(tmp_path, shards=0)
    assert main(["--config", str(config), command, "--shard", name]) == 2
    line = _error_line(capsys.readouterr().out)
    assert "--shard" in line and repr(name) in line and "is not a shard key" in line


@pytest.mark.parametrize("command", ["verify", "extract", "regenerate"])
def test_a_well_formed_but_unknown_shard_is_one_line_of_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    config, _ = _project(tmp_path, shards=0)
    assert main(["--config", str(config), command, "--shard", "t-00042"]) == 2
    assert "unknown shard(s) ['t-00042']" in _error_line(capsys.readouterr().out)


# ---- 3. the disk runs out at the preallocation, or under a write -----------------------------------------
def _fds() -> list[str]:
    return sorted(os.listdir("/proc/self/fd"))


def _full(code: int) -> Callable[..., Any]:
    def fail(*_: object) -> Any:
        raise OSError(code, os.strerror(code))

    return fail


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_at_preallocation_is_a_disk_space_error_leaving_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    whole = tmp_path / "whole" / f"{KEY}.safetensors"
    _write(whole)
    store = tmp_path / "store"
    before = _fds()
    monkeypatch.setattr(os, "posix_fallocate", _full(code))
    with pytest.raises(DiskSpaceError) as raised:
        _write(store / f"{KEY}.safetensors")
    assert _fds() == before
    assert list(store.iterdir()) == []
    message = str(raised.value)
    assert f"shard {KEY}: the disk filled up while reserving its space ({os.strerror(code)})" in message
    needed = f"{whole.stat().st_size:,}"
    assert re.search(rf"needs {needed} bytes .* {store} has [\d,]+ bytes .* free", message), message


def test_a_full_disk_under_a_row_write_is_a_disk_space_error_leaving_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / f"{KEY}.safetensors"
    real, calls = os.pwrite, [0]

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls[0] += 1
        if calls[0] == 5:  # a row of the first sample
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data, offset)

    before = _fds()
    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(DiskSpaceError, match=f"shard {KEY}: the disk filled up while writing the shard"):
        _write(path)
    assert _fds() == before and list(tmp_path.iterdir()) == []


def test_a_short_write_is_completed_not_left_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / f"{KEY}.safetensors"
    real = os.pwrite

    def half(fd: int, data: Any, offset: int) -> int:  # what pwrite may do when the disk is nearly full
        view = memoryview(data).cast("B")
        return real(fd, view[: max(1, len(view) // 2)], offset)

    monkeypatch.setattr(os, "pwrite", half)
    _write(path)
    monkeypatch.undo()
    assert verify_shard(path).ok


# ---- 4. a shard is whole with its manifest, or absent ----------------------------------------------------
class Crash(BaseException):
    """The process dies here: none of the writer's cleanup runs (the kernel still closes its files)."""


POINTS = [  # every call by which a shard's files are written, synced, removed or renamed
    (os, "pwrite"),
    (os, "fsync"),
    (os, "unlink"),
    (os, "replace"),
    (shards_module, "write_temp"),
    (shards_module, "fsync_path"),
]


def _armed(monkeypatch: pytest.MonkeyPatch, n: int | None, error: BaseException) -> list[str]:
    """Make the n-th call of any point raise `error` (n None: only record the calls, by name)."""
    seen: list[str] = []

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen.append(name)
            if len(seen) == n:
                raise error
            return real(*args, **kwargs)

        return wrapped

    for owner, name in POINTS:
        monkeypatch.setattr(owner, name, counting(name, getattr(owner, name)))
    return seen


def _crash_abort(self: ShardWriter) -> None:
    if self._fd >= 0:
        os.close(self._fd)
        self._fd = -1


def _check_whole_or_absent(root: Path, allowed: set[bytes]) -> None:
    """What every reader sees: the shard with its manifest, verified and one of `allowed`, or nothing."""
    layout = StoreLayout(root)
    shard, manifest = layout.hidden_states(KEY), layout.hidden_states_manifest(KEY)
    done = shard_done(root, KEY)
    assert shard.exists() == done  # never a shard without its manifest
    assert [r.key for r in store_stats(root).shards] == ([KEY] if done else [])
    assert layout.hidden_state_shards() == ([shard] if done else [])
    if done:
        assert verify_shard(shard).ok and shard.read_bytes() in allowed
        assert json.loads(manifest.read_text())["bytes"] == shard.stat().st_size


@pytest.mark.parametrize("redo", [False, True], ids=["new", "redo"])
@pytest.mark.parametrize("mode", ["disk_full", "crash"])
def test_a_fault_at_any_write_or_rename_leaves_the_shard_whole_or_absent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str, redo: bool
) -> None:
    reference = tmp_path / "reference" / f"{KEY}.safetensors"
    _write(reference.with_name("t-00001.safetensors"), seed=1)
    old = reference.with_name("t-00001.safetensors").read_bytes()
    with monkeypatch.context() as m:
        points = _armed(m, None, Crash())
        _write(reference)
    new = reference.read_bytes()
    assert {"pwrite", "fsync", "unlink", "replace", "write_temp", "fsync_path"} <= set(points)
    for n, point in enumerate(points, 1):
        path = tmp_path / f"{n}" / "hidden_states" / f"{KEY}.safetensors"
        if redo:
            _write(path, seed=1)
        before = _fds()
        error = Crash() if mode == "crash" else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with monkeypatch.context() as m, pytest.raises((Crash, DiskSpaceError)):
            if mode == "crash":
                m.setattr(ShardWriter, "abort", _crash_abort)
            _armed(m, n, error)
            _write(path)
        assert _fds() == before, (n, point)
        if mode == "disk_full":  # an error, not a crash: the writer removed everything it made
            assert _temps(path.parent) == [], (n, point)
        _check_whole_or_absent(path.parent.parent, {old, new} if redo else {new})
        _write(path)  # the next run completes the shard and clears what the fault left
        assert shard_done(path.parent.parent, KEY) and path.read_bytes() == new
        assert _temps(path.parent) == []


# ---- 5. one writer per shard -------------------------------------------------------------------------------
HOLDER = """
import sys
from pathlib import Path
from eagle3_core.store.locks import writer_lock
lock, temp = Path(sys.argv[1]), Path(sys.argv[2])
with writer_lock(lock, "test"):
    temp.write_bytes(b"a live extraction's rows")
    print("held", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def held_by_another_process(tmp_path: Path) -> Iterator[tuple[StoreLayout, Path, int]]:
    """(layout, the holder's live temporary shard file, its pid) while a process holds t-00000's locks."""
    layout = StoreLayout(tmp_path / "store")
    temp = layout.hidden_states_dir / f".{KEY}.safetensors.tmp-999999"
    temp.parent.mkdir(parents=True)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(layout.writer_lock(stage, KEY)), str(temp)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for stage in ("hidden_states", "regenerated")
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    yield layout, temp, procs[0].pid
    for proc in procs:
        proc.communicate("\n", timeout=30)


def test_a_second_extraction_of_a_shard_is_refused_naming_the_holder(
    tmp_path: Path, held_by_another_process: tuple[StoreLayout, Path, int]
) -> None:
    layout, temp, pid = held_by_another_process
    cfg = load_config(write_config(tmp_path, "store: store\n"))
    with pytest.raises(StoreBusyError, match=rf"hidden-state shard {KEY} is being written by .*pid {pid}"):
        data.extract_step(cfg, KEY, cast(Any, None))  # refused before the target is used
    with pytest.raises(StoreBusyError, match=f"regenerated shard {KEY}"):
        data.regenerate_step(cfg, KEY, None)
    assert temp.read_bytes() == b"a live extraction's rows"  # the holder's temporary file is untouched
    assert not layout.hidden_states(KEY).exists()


def test_repairing_a_manifest_is_refused_while_the_shard_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], held_by_another_process: tuple[StoreLayout, Path, int]
) -> None:
    layout, temp, pid = held_by_another_process
    elsewhere = tmp_path / "elsewhere" / f"{KEY}.safetensors"
    _write(elsewhere)  # not in the store: a writer there would remove the holder's temporary file
    elsewhere.rename(layout.hidden_states(KEY))  # a shard whose manifest is missing
    config = write_config(tmp_path, "store: store\n")
    assert main(["--config", str(config), "verify", "--repair"]) == 2
    assert f"pid {pid}" in capsys.readouterr().out
    assert not layout.hidden_states_manifest(KEY).exists() and temp.exists()


def test_a_lock_is_free_again_once_its_holder_is_gone(tmp_path: Path) -> None:
    lock = tmp_path / ".locks" / "x.lock"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), str(tmp_path / "t")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    with exclusive_lock(lock) as attempt:
        assert not attempt.acquired and attempt.holder == proc.pid
    proc.kill()
    proc.wait()
    with writer_lock(lock, "x"), exclusive_lock(lock) as inner:  # a second open file is a second locker
        assert not inner.acquired and inner.holder == os.getpid()
