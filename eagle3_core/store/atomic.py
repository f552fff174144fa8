"""Atomic files: write to a temporary name in the same directory, fsync, rename, fsync the directory.

A file that exists under its final name is complete; a crash leaves at most a temporary file, which the
next writer of the same name removes (`remove_stale_temps`). Where two processes may write the same name
(a shard), the writer holds its lock first (eagle3_core/store/locks.py), so it never removes a live one's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TEMP_MARK = ".tmp-"


def temp_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove temporaries that an earlier (crashed) writer of `path` left behind."""
    removed = []
    for stale in path.parent.glob(f".{path.name}{TEMP_MARK}*"):
        stale.unlink(missing_ok=True)
        removed.append(stale)
    return removed


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


def atomic_write_text(path: Path, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    with atomic_open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")


def read_json_object(path: Path, error: type[Exception]) -> dict[str, Any]:
    """A JSON file that must hold an object; anything else raises `error` naming the file and the problem."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
