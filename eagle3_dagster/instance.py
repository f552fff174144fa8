"""Opening the project's Dagster instance, its creation serialised across processes.

Dagster creates a SQLite instance's databases (runs, event index, schedules) the first time it opens them, and
does not guard that against a second process: two commands opening a new instance at once (two `eagle3
materialize`, a first `eagle3 status` beside `eagle3 ui`) both create the tables and both stamp the alembic
version, leaving runs.db with two heads that every later open fails on. Every eagle3 entry point opens the
instance here, holding an flock on a file in DAGSTER_HOME: the second waits until the first one's storage is
whole, then opens it as it stands. The kernel drops the lock when its holder dies, so a killed command never
leaves the instance locked.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where an instance is opened: the CLI takes the lock before it needs Dagster
    import dagster as dg

INSTANCE_LOCK = ".eagle3-instance.lock"  # in DAGSTER_HOME; never deleted (a new file would be a second lock)


def instance_lock_path(home: Path) -> Path:
    return home / INSTANCE_LOCK


@contextmanager
def instance_lock(home: Path) -> Iterator[None]:
    """Hold the instance's lock for the block, waiting for another holder (an open takes a second or two)."""
    fd = os.open(instance_lock_path(home), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def open_instance() -> dg.DagsterInstance:
    """The instance in $DAGSTER_HOME, created (or opened) while no other eagle3 process creates it."""
    import dagster as dg

    home = os.environ.get("DAGSTER_HOME")
    if not home:
        return dg.DagsterInstance.get()  # raises Dagster's own error, naming DAGSTER_HOME
    with instance_lock(Path(home)):
        return dg.DagsterInstance.get()
