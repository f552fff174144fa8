"""Atomic files, directories and symlinks: write under a temporary name in the same directory, fsync,
rename, fsync the directory.

A file (or directory) that exists under its final name is complete; a crash leaves at most a temporary,
`.NAME.tmp-PID`, which the next writer of the same name removes (`remove_stale_temps`). Where two processes
may write the same name (a shard, a toy target), the writer holds its lock first
(eagle3_core/store/locks.py; the toy build's lock), so it never removes a live one's.

A directory that is published again and again under one name while readers use it (a run's export, the
promoted drafter) is an immutable version behind a symlink (`atomic_versioned_directory`): a symlink can be
replaced in one rename, a directory cannot, so the name always gives a whole version.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

TEMP_MARK = ".tmp-"
ASIDE_MARK = ".old-"  # a replaced directory, moved aside until the new one is in place


def temp_path_for(path: Path, mark: str = TEMP_MARK) -> Path:
    return path.with_name(f".{path.name}{mark}{os.getpid()}")


def remove_stale_temps(path: Path, marks: tuple[str, ...] = (TEMP_MARK,)) -> list[Path]:
    """Remove temporaries (files or directories) that an earlier (crashed) writer of `path` left behind."""
    removed = []
    for mark in marks:
        for stale in path.parent.glob(f".{path.name}{mark}*"):
            _remove(stale)
            removed.append(stale)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory is fsynced so that a rename in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(temp: Path, final: Path) -> None:
    """Rename a fully written and fsynced temporary file to its final name, durably."""
    os.replace(temp, final)
    fsync_path(final.parent)


def write_temp(path: Path, data: bytes) -> Path:
    """`data` written and fsynced under `path`'s temporary name, for the caller to `commit` when its other
    files are ready too (a shard's manifest goes in before the shard: eagle3_core/store/shards.py)."""
    temp = temp_path_for(path)
    try:
        with open(temp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return temp


@contextmanager
def atomic_open(path: Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO[Any]]:
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)
    temp = temp_path_for(path)
    enc = None if "b" in mode else encoding
    try:
        with open(temp, mode, encoding=enc) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        commit(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _fsync_tree(directory: Path) -> None:
    """fsync every file and directory under `directory`, the directory itself last."""
    for root, dirs, files in os.walk(directory, topdown=False):
        for name in [*files, *dirs]:
            if not os.path.islink(path := os.path.join(root, name)):
                fsync_path(Path(path))
    fsync_path(directory)


@contextmanager
def atomic_directory(final: Path, *, replace: bool = False) -> Iterator[Path]:
    """A fresh empty directory beside `final` for the body to fill; once the body returns, fsynced whole and
    renamed to `final`. If the body raises, the temporary is removed and `final` is left as it was.

    replace=False: `final` must not exist when the body is done; if another writer put it there meanwhile,
    FileExistsError, and `final` stays as that writer made it.
    replace=True: an existing `final` is moved aside (`.NAME.old-PID`), the new one renamed in, then the old
    one deleted; a directory cannot be swapped in one rename, so `final` is always the old whole directory,
    the new whole one, or (for the instant between the two renames, or after a crash there) absent.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(final, (TEMP_MARK, ASIDE_MARK))
    temp = temp_path_for(final)
    temp.mkdir()
    try:
        yield temp
        _fsync_tree(temp)
        (_swap_in if replace else _rename_new)(temp, final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    if replace:
        shutil.rmtree(temp_path_for(final, ASIDE_MARK), ignore_errors=True)


def _swap_in(temp: Path, final: Path) -> None:
    old = temp_path_for(final, ASIDE_MARK)
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(temp, final)
    except BaseException:
        if old.exists():  # the old one back: a failed write leaves `final` as it was
            os.replace(old, final)
        raise


def _rename_new(temp: Path, final: Path) -> None:
    # rename(2) replaces an empty directory silently, so `final` is looked for first; one that another
    # writer renamed in after the look holds its files and makes the rename fail
    if not final.exists():
        try:
            os.rename(temp, final)
            return
        except OSError:
            if not final.exists():
                raise
    raise FileExistsError(f"{final}: already exists (written by another writer meanwhile)")


def atomic_symlink(link: Path, target: Path) -> None:
    """Point `link` at `target` (stored relative to the link's directory) atomically: a new link under a
    temporary name, renamed over the old one."""
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(link)
    temp = temp_path_for(link)
    try:
        os.symlink(os.path.relpath(target, link.parent), temp)
        commit(temp, link)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def version_name(label: str = "") -> str:
    """A new version's name: `label`, the time to the microsecond (versions sort by age) and the writer's PID."""
    stamp = f"{datetime.now(UTC):%Y%m%dT%H%M%S%fZ}-{os.getpid()}"
    return f"{label}-{stamp}" if label else stamp


def keep_only_linked(link: Path, versions: Path) -> list[Path]:
    """Remove everything in `versions` but the version `link` resolves to: the versions it no longer names,
    a version a crashed writer renamed in but never linked, and crashed writers' temporaries. The caller
    holds `link`'s lock, so no live writer's temporary is among them."""
    if not versions.is_dir():
        return []
    served = Path(link).resolve()
    removed = [entry for entry in sorted(versions.iterdir()) if entry.resolve() != served]
    for entry in removed:
        _remove(entry)
    return removed


@contextmanager
def atomic_versioned_directory(link: Path, versions: Path, label: str = "") -> Iterator[Path]:
    """A new version of the directory published at `link`: the body fills a fresh directory; once it returns,
    it is fsynced whole, renamed into `versions` under a new name (`version_name`), and `link`, a symlink to
    it, replaces the old link in one rename. Then the versions `link` no longer names are removed.

    `link` is never absent nor partial: a reader finds the old version whole until the rename, the new one
    whole after it; a crash anywhere leaves the old one linked, and the next writer removes what the crash
    left in `versions`. If the body raises, nothing is published and `link` is left as it was. The caller
    holds `link`'s lock (eagle3_core/store/locks.py): the leftovers are cleared without asking whose they are.

    A store written before versions has a plain directory at `link`: it is moved into `versions` and the link
    put in its place, two renames between which `link` is absent, once per such directory.
    """
    link, versions = Path(link), Path(versions)
    keep_only_linked(link, versions)
    final = versions / version_name(label)
    with atomic_directory(final) as temp:
        yield temp
    if link.is_dir() and not link.is_symlink():
        _link_over_plain_directory(link, final, versions / version_name("before-versions"))
    else:
        atomic_symlink(link, final)
    keep_only_linked(link, versions)


def _link_over_plain_directory(link: Path, final: Path, aside: Path) -> None:
    """`link`, a plain directory, moved to `aside` and a symlink to `final` put in its place; if the link
    cannot be made (a full disk), the directory goes back."""
    os.rename(link, aside)
    try:
        atomic_symlink(link, final)
    except BaseException:
        os.rename(aside, link)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def json_text(obj: Any) -> str:
    """A JSON file's text as eagle3 writes them all: one-space indents, UTF-8 as is, a final newline."""
    return json.dumps(obj, indent=1, ensure_ascii=False) + "\n"


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json_text(obj))


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with atomic_open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")


def read_json_object(path: Path, error: type[Exception]) -> dict[str, Any]:
    """A JSON file that must hold an object; anything else raises `error` naming the file and the problem."""
    return json_object(path.read_bytes(), path, error)


def json_object(raw: bytes, where: Path | str, error: type[Exception]) -> dict[str, Any]:
    """`raw` (a file's bytes, or one line of a JSONL file) as the JSON object it must hold; anything else
    raises `error` naming `where` and the problem: not UTF-8, not JSON, nested too deeply, not an object."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        at = f"line {e.lineno} column {e.colno}" if e.lineno > 1 else f"column {e.colno}"
        raise error(f"{where}: not valid JSON: {e.msg} at {at}") from e
    except RecursionError:
        # json's parser recurses once per nested array or object; no file eagle3 reads nests this deep
        raise error(
            f"{where}: not readable JSON: arrays or objects nested too deeply for Python's parser"
        ) from None
    if not isinstance(data, dict):
        raise error(f"{where}: expected a JSON object, got {type(data).__name__}")
    return data


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
