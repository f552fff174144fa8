"""Advisory locks on store files: one writer at a time for the ledger (ingest) and for each shard's output;
and one builder at a time in the target cache (`directory_lock`).

A lock is an `flock` on a lock file that is never deleted (deleting it would let two processes lock two
different files of the same name). The kernel drops the lock when its holder dies, so a crashed writer never
leaves the store locked. The holder writes its PID into the file, for the message the next caller gets.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from eagle3_core.errors import StoreBusyError


@dataclass(frozen=True)
class LockAttempt:
    acquired: bool
    holder: int | None  # when not acquired: the PID the holder recorded (None if it recorded none)


def lock_holder(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else None


def _record_pid(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # a full disk: the lock is the flock, held all the same; only the busy message loses the PID


@contextmanager
def exclusive_lock(path: Path) -> Iterator[LockAttempt]:
    """Try once (never wait) to lock `path` for the block; the attempt says whether it was acquired."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield LockAttempt(False, lock_holder(path))
            return
        _record_pid(fd)
        try:
            yield LockAttempt(True, None)
        finally:
            os.ftruncate(fd, 0)  # before unlocking: the next holder's PID is never followed by a stale one
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextmanager
def writer_lock(path: Path, what: str) -> Iterator[None]:
    """Hold `path` for the block, or raise StoreBusyError naming `what` and the holder's PID."""
    with exclusive_lock(path) as attempt:
        if not attempt.acquired:
            holder = (
                f"pid {attempt.holder}" if attempt.holder is not None else "a process that recorded no pid"
            )
            raise StoreBusyError(
                f"{what} is being written by another process ({holder}; lock {path}); "
                "wait for it to finish, or stop it, then run again"
            )
        yield


@contextmanager
def directory_lock(directory: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    """Hold an flock on `directory` itself for the block, waiting (after calling `on_wait`) while another
    process holds it. The target cache's builds (the toy, the GGUF targets) take it: two builds would only
    halve each other's speed, and the loser of a race would redo the winner's work. Locking the directory
    leaves no lock file in it."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
