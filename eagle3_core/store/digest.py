"""sha256 digests of files and of whole directories (a built target's fingerprint)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

BLOCK = 1 << 20


def _update_from_file(digest: Any, path: Path) -> None:
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            digest.update(block)


def file_sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes, read in blocks (a multi-GB file never sits in memory)."""
    digest = hashlib.sha256()
    _update_from_file(digest, path)
    return digest.hexdigest()


def directory_fingerprint(directory: Path, *, exclude: str) -> str:
    """sha256 over the names and bytes of the directory's files (not its subdirectories), by name, except
    `exclude` (the report that records this fingerprint)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file() and p.name != exclude):
        digest.update(path.name.encode() + b"\0")
        _update_from_file(digest, path)
    return digest.hexdigest()
