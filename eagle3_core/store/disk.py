"""A full disk, said in one line wherever eagle3 writes (shards, checkpoints, exports, the metric log); and the
preflight that refuses to start a large write the disk cannot hold (`disk_preflight`: shards, exports).

Python's writes raise OSError with ENOSPC or EDQUOT; safetensors' writer (Rust) raises its own
SafetensorError, whose text ends "... No space left on device (os error 28)" and whose errno is nowhere else.
Both are recognised here, once, and turned into a DiskSpaceError whose message the writer composes: what it
was writing, what it needs, what is free, and what state it left.
"""

from __future__ import annotations

import errno
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from eagle3_core.errors import DiskSpaceError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
RUST_OS_ERROR = re.compile(r"(?P<reason>[^:]*) \(os error (?P<code>\d+)\)$")


def full_disk_reason(err: BaseException) -> str | None:
    """The system's words for it ("No space left on device") if `err` is a full disk or quota, else None."""
    if isinstance(err, OSError):
        return (err.strerror or str(err)) if err.errno in DISK_FULL else None
    if isinstance(err, SafetensorError) and (found := RUST_OS_ERROR.search(str(err))):
        return found["reason"].strip() if int(found["code"]) in DISK_FULL else None
    return None


def free_bytes(path: Path) -> int:
    """Free bytes on the disk that holds `path` (or its nearest existing parent)."""
    return shutil.disk_usage(next(p for p in (path, *path.parents) if p.exists())).free


@contextmanager
def full_disk_is_one_line(on: Path, say: Callable[[str, int], str]) -> Iterator[None]:
    """A full disk or quota under the block becomes a DiskSpaceError with the message `say(reason, free)`,
    `free` being the bytes free on the disk holding `on`; any other error passes unchanged."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        reason = full_disk_reason(err)
        if reason is None:
            raise
        raise DiskSpaceError(say(reason, free_bytes(on))) from err


def disk_preflight(directory: Path, needed: int, headroom: float, what: str) -> None:
    """DiskSpaceError, naming both numbers, when the disk that holds `directory` (or its nearest existing
    parent: nothing is created here) has less than `headroom` times `needed` bytes (the writer's estimate)
    free; called before anything is written, so a refused writer leaves the store as it was."""
    free = free_bytes(directory)
    if free < headroom * needed:
        raise DiskSpaceError(
            f"{what} needs about {needed:,} bytes ({needed / 2**30:.2f} GiB) and {directory} has {free:,} bytes "
            f"({free / 2**30:.2f} GiB) free; refusing to start below {headroom}x the estimate "
            f"({int(headroom * needed):,} bytes). Free space or move the store."
        )
