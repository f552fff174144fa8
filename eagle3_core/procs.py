"""Which process is which, from Linux's /proc: a PID alone is reused, a PID with its start time is not.

Used wherever eagle3 records a process to find it again after a crash: the managed SGLang server's PID file,
the runner tag of in-process Dagster runs, a toy-target build's lock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcStat:
    state: str  # R, S, D, Z (zombie), ...
    pgrp: int
    start_ticks: int  # field 22: clock ticks after boot; with the PID it names one process for good


def proc_stat(pid: int) -> ProcStat | None:
    """The process's state, group and start time from /proc/<pid>/stat; None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    # the command name (field 2) may hold spaces and parentheses: the other fields start after the last ')'
    rest = raw[raw.rindex(")") + 2 :].split()
    return ProcStat(state=rest[0], pgrp=int(rest[2]), start_ticks=int(rest[19]))


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
