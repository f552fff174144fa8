"""atomic_directory, atomic_symlink and atomic_versioned_directory (eagle3_core/store/atomic.py): a directory
under its final name is whole, whatever happens to its writer, and the next writer clears what a dead one left."""

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_core.store import atomic
from eagle3_core.store.atomic import (
    atomic_directory,
    atomic_symlink,
    atomic_versioned_directory,
    temp_path_for,
)

WRITER = """
import sys, time
from pathlib import Path
from eagle3_core.store.atomic import atomic_directory
final, replace = Path(sys.argv[1]), sys.argv[2] == "replace"
with atomic_directory(final, replace=replace) as temp:
    (temp / "sub").mkdir()
    (temp / "sub" / "half.bin").write_bytes(b"half of it")
    print(temp, flush=True)
    time.sleep(600)
"""


def _contents(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def _write_old(final: Path) -> None:
    with atomic_directory(final) as temp:
        (temp / "old.txt").write_text("the old one, whole")


@pytest.mark.parametrize("replace", [False, True])
def test_a_writer_killed_mid_write_leaves_no_partial_directory_and_the_next_one_clears_it(
    tmp_path: Path, replace: bool
) -> None:
    final = tmp_path / "out"
    if replace:
        _write_old(final)
    before = _contents(final) if replace else None
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(final), "replace" if replace else "new"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        temp = Path(proc.stdout.readline().strip())  # the child has written a file and is sleeping
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert temp == tmp_path / f".out.tmp-{proc.pid}" and (temp / "sub" / "half.bin").exists()
    if replace:
        assert _contents(final) == before
    else:
        assert not final.exists()

    with atomic_directory(final, replace=replace) as mine:
        assert not temp.exists()  # the dead writer's temporary is gone before the body runs
        (mine / "new.txt").write_text("whole")
    assert _contents(final) == {"new.txt": b"whole"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_body_writes_beside_final_and_everything_is_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "a" / "out"  # the parent is made
    synced: list[tuple[Path, bool]] = []  # (path, whether `final` existed when it was fsynced)
    real = atomic.fsync_path

    def record(path: Path) -> None:
        synced.append((Path(path), final.exists()))
        real(path)

    monkeypatch.setattr(atomic, "fsync_path", record)
    with atomic_directory(final) as temp:
        assert temp == temp_path_for(final) and temp.is_dir() and not any(temp.iterdir())
        (temp / "w.bin").write_bytes(b"w")
        (temp / "sub").mkdir()
        (temp / "sub" / "x.json").write_text("{}")
        assert not final.exists()
    assert _contents(final) == {"sub/x.json": b"{}", "w.bin": b"w"}
    before_rename = {p.relative_to(temp) for p, existed in synced if not existed and p != final.parent}
    assert before_rename == {Path("w.bin"), Path("sub"), Path("sub/x.json"), Path(".")}
    assert synced[-1] == (final.parent, True)  # the rename itself made durable
    assert sorted(p.name for p in final.parent.iterdir()) == ["out"]


@pytest.mark.parametrize("replace", [False, True])
def test_a_failing_body_leaves_final_as_it_was(tmp_path: Path, replace: bool) -> None:
    final = tmp_path / "out"
    if replace:
        _write_old(final)
    with pytest.raises(RuntimeError, match="body failed"), atomic_directory(final, replace=replace) as temp:
        (temp / "new.txt").write_text("half")
        raise RuntimeError("body failed")
    assert sorted(p.name for p in tmp_path.iterdir()) == (["out"] if replace else [])
    if replace:
        assert _contents(final) == {"old.txt": b"the old one, whole"}


def test_replace_swaps_the_whole_directory(tmp_path: Path) -> None:
    final = tmp_path / "out"
    _write_old(final)
    (tmp_path / ".out.old-999").mkdir()  # what a writer killed between its two renames leaves
    (tmp_path / ".other.tmp-999").mkdir()  # another name's: not this writer's to remove
    with atomic_directory(final, replace=True) as temp:
        (temp / "new.txt").write_text("new")
    assert _contents(final) == {"new.txt": b"new"}  # nothing of the old one is left in it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-999", "out"]


def test_a_failed_swap_puts_the_old_directory_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = tmp_path / "out"
    _write_old(final)
    real = os.replace

    def refuse_new(src: str | Path, dst: str | Path) -> None:
        if Path(src) == temp_path_for(final):
            raise OSError("rename refused")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", refuse_new)
    with pytest.raises(OSError, match="rename refused"), atomic_directory(final, replace=True) as temp:
        (temp / "new.txt").write_text("new")
    assert _contents(final) == {"old.txt": b"the old one, whole"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_without_replace_an_existing_directory_is_kept_and_refused(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(FileExistsError, match=str(final)), atomic_directory(final) as temp:
        (temp / "mine.txt").write_text("mine")
        final.mkdir()  # another writer renamed its (here empty) directory in first
        (final / "theirs.txt").write_text("theirs")
    assert _contents(final) == {"theirs.txt": b"theirs"}
    with pytest.raises(FileExistsError), atomic_directory(final):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_symlink_points_relative_and_swaps_without_touching_the_old_target(tmp_path: Path) -> None:
    a, b = tmp_path / "exports" / "r1", tmp_path / "exports" / "r2"
    for d in (a, b):
        d.mkdir(parents=True)
        (d / "id").write_text(d.name)
    link = tmp_path / "drafter" / "current"
    atomic_symlink(link, a)
    assert link.readlink() == Path("../exports/r1") and (link / "id").read_text() == "r1"
    (link.parent / ".current.tmp-999").symlink_to("nowhere")  # a dead promoter's temporary link
    atomic_symlink(link, b)
    assert link.readlink() == Path("../exports/r2") and (link / "id").read_text() == "r2"
    assert (a / "id").read_text() == "r1"  # the link was replaced, not the directory it pointed at
    assert sorted(p.name for p in link.parent.iterdir()) == ["current"]


def _publish(link: Path, versions: Path, text: str) -> Path:
    with atomic_versioned_directory(link, versions) as temp:
        (temp / "id").write_text(text)
    return link


def test_a_versioned_directory_is_published_by_swapping_a_relative_link(tmp_path: Path) -> None:
    link, versions = tmp_path / "export" / "r1", tmp_path / "versions" / "r1"
    _publish(link, versions, "one")
    first = link.resolve()
    assert link.is_symlink() and not Path(os.readlink(link)).is_absolute() and first.parent == versions
    _publish(link, versions, "two")
    assert (link / "id").read_text() == "two" and not first.exists()  # the old version removed after
    assert [p.name for p in versions.iterdir()] == [link.resolve().name]
    assert sorted(p.name for p in link.parent.iterdir()) == ["r1"]


def test_a_failed_version_leaves_the_link_and_the_next_writer_clears_what_a_dead_one_left(
    tmp_path: Path,
) -> None:
    link, versions = tmp_path / "export" / "r1", tmp_path / "versions" / "r1"
    _publish(link, versions, "one")
    with pytest.raises(RuntimeError, match="body failed"), atomic_versioned_directory(link, versions) as temp:
        (temp / "id").write_text("half")
        raise RuntimeError("body failed")
    assert (link / "id").read_text() == "one" and len(list(versions.iterdir())) == 1
    (versions / ".20990101T000000000000Z-999.tmp-999").mkdir()  # a dead writer's temporary
    (versions / "20990101T000000000000Z-999").mkdir()  # renamed in, never linked: it died before the link
    (link.parent / ".r1.tmp-999").symlink_to("nowhere")  # its temporary link
    _publish(link, versions, "two")
    assert (link / "id").read_text() == "two" and [p.name for p in versions.iterdir()] == [
        link.resolve().name
    ]
    assert sorted(p.name for p in link.parent.iterdir()) == ["r1"]


def test_a_plain_directory_from_before_versions_is_replaced_by_the_link(tmp_path: Path) -> None:
    link, versions = tmp_path / "export" / "r1", tmp_path / "versions" / "r1"
    link.mkdir(parents=True)
    (link / "id").write_text("plain")
    _publish(link, versions, "versioned")
    assert link.is_symlink() and (link / "id").read_text() == "versioned"
    assert [p.name for p in versions.iterdir()] == [link.resolve().name]  # the plain one removed after


def test_a_plain_directory_goes_back_when_its_link_cannot_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    link, versions = tmp_path / "export" / "r1", tmp_path / "versions" / "r1"
    link.mkdir(parents=True)
    (link / "id").write_text("plain")

    def full(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(atomic.os, "symlink", full)
    with pytest.raises(OSError, match="No space left"):
        _publish(link, versions, "versioned")
    assert not link.is_symlink() and (link / "id").read_text() == "plain"
