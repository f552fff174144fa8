"""A real full disk for a test: Python code run in a child process that sees a small tmpfs mounted over a
directory, in a user and mount namespace of its own (`unshare --map-root-user --mount`), so no root and no
change to the machine: the mount ends with the child. Writes there fail as they do on a full disk, with the
errors the kernel and the libraries really raise (OSError ENOSPC from Python, safetensors' own error).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, in_ci

# What safetensors' save_file raises when the disk fills under it, as tests/unit/test_disk.py sees on a real
# full disk (the errno only in its text), for tests that make one writer fail that way.
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _can_unshare() -> str | None:
    """Why a namespace cannot be made here, or None if it can."""
    if shutil.which("unshare") is None:
        return "no unshare command (util-linux)"
    probe = subprocess.run(["unshare", "--map-root-user", "--mount", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"user namespaces refused: {probe.stderr.strip()}"


def on_a_full_disk(code: str, directory: Path, size: str = "256k") -> subprocess.CompletedProcess[str]:
    """Run `code` (Python, from the repository root) with a `size` tmpfs mounted over `directory` (emptied
    for the child: what the parent put there is hidden, and what the child writes vanishes with it)."""
    reason = _can_unshare()
    if reason is not None:
        if in_ci():
            pytest.fail(f"a real full disk is needed in CI: {reason}")
        pytest.skip(f"cannot make a full disk without root here: {reason}")
    directory.mkdir(parents=True, exist_ok=True)
    mount = f'mount -t tmpfs -o size={size} tmpfs "$1" && shift && exec "$@"'
    command = ["unshare", "--map-root-user", "--mount", "sh", "-c", mount, "sh", str(directory)]
    return subprocess.run(
        [*command, sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
