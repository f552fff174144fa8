"""Which process is which, from Linux's /proc: a PID alone is reused, a PID with its start time is not.

Used wherever eagle3 records a process to find it again after a crash: the managed SGLang server's PID file,
the runner tag of in-process Dagster runs, a toy-target build's lock.

A PID read from a file is signalled only once the process is shown to be the one eagle3 started
(`StartedProcess.mismatch`): its start time, its process group, its command line, and a marker eagle3 put in
its environment when it started it. The start time and the command line of any process are public (/proc);
the marker is not, so a file written by someone else (or planted) never gets another process signalled.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The variable eagle3 sets in the environment of a process it starts and may signal later, to a random value
# it records beside the PID: /proc/<pid>/environ is readable by the process's owner only.
MARKER_ENV = "EAGLE3_PROCESS_MARKER"


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


def proc_cmdline(pid: int) -> list[str] | None:
    """The process's command line (argv as it was executed); None if there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    return [arg.decode(errors="surrogateescape") for arg in raw.split(b"\0")[:-1]]


def proc_has_marker(pid: int, marker: str) -> bool:
    """Whether the process's environment holds MARKER_ENV=`marker` (False: it does not, it is gone, or its
    environment is not ours to read, i.e. another user's process)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (OSError, ProcessLookupError):
        return False
    return f"{MARKER_ENV}={marker}".encode() in raw.split(b"\0")


def new_marker() -> str:
    return secrets.token_hex(16)


def marked_environment(marker: str) -> dict[str, str]:
    """This process's environment plus the marker: the `env` of a process eagle3 starts and may signal."""
    return {**os.environ, MARKER_ENV: marker}


def command_matches(cmdline: Sequence[str], command: Sequence[str]) -> bool:
    """Whether /proc's `cmdline` is the `command` eagle3 executed. A script run through its `#!` line shows
    its interpreter first and the script's resolved path in argv[0]'s place, so argv[0] is compared by name."""
    if not command or len(cmdline) < len(command):
        return False
    ran = cmdline[len(cmdline) - len(command) :]
    return list(ran[1:]) == list(command[1:]) and Path(ran[0]).name == Path(command[0]).name


@dataclass(frozen=True)
class StartedProcess:
    """What eagle3 records of a process it started as the leader of its own process group (setsid)."""

    pid: int
    start_ticks: int
    command: Sequence[str]
    marker: str | None  # None: recorded by an eagle3 that set no marker; such a record proves nothing

    def mismatch(self) -> str | None:
        """Why the running process `pid` is not this one (None: it is). A process that is gone is a mismatch
        too: only the one eagle3 started is ever signalled through a record."""
        if self.marker is None:
            return "the record has no process marker (written by an older eagle3, or not by eagle3)"
        stat = proc_stat(self.pid)
        if stat is None or stat.state in ("Z", "X", "x"):
            return f"no process {self.pid} is running"
        if stat.start_ticks != self.start_ticks:
            return f"process {self.pid} started at another time (its PID was reused)"
        if stat.pgrp != self.pid:
            return f"process {self.pid} does not lead its own process group"
        if not command_matches(proc_cmdline(self.pid) or [], self.command):
            return f"process {self.pid} runs another command than the recorded one"
        if not proc_has_marker(self.pid, self.marker):
            return f"process {self.pid} does not carry the marker eagle3 started it with"
        return None
