"""Two eagle3 commands opening a new project's Dagster instance at once: its creation is serialised.

Dagster creates a SQLite instance's databases on first open; two processes doing so at once both stamp the
alembic version, and runs.db is left with two heads that every later command fails on. The commands run in
forked children of this process (the CLI already imported, so they reach the instance together), released
by one barrier: real processes, real SQLite files, no import time to spread them apart.
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import sys
import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path

import pytest

from eagle3_cli import ops as ops_cli
from eagle3_cli.main import main
from eagle3_dagster.materialize import materialize_shards
from tests.conftest import write_config

pytestmark = pytest.mark.filterwarnings("ignore:Specifying a partitions_def:dagster.PreviewWarning")
FORK = multiprocessing.get_context("fork")


def _command(barrier: Barrier, argv: list[str]) -> None:
    barrier.wait()
    sys.exit(main(argv))


def _at_once(argv: list[str], n: int) -> list[int | None]:
    """`eagle3 ARGV` in `n` processes released together; their exit codes."""
    barrier = FORK.Barrier(n)
    procs = [FORK.Process(target=_command, args=(barrier, argv)) for _ in range(n)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    return [proc.exitcode for proc in procs]


def _alembic_heads(database: Path) -> list[str]:
    with sqlite3.connect(database) as db:
        return [row[0] for row in db.execute("SELECT version_num FROM alembic_version")]


def test_first_commands_at_once_create_one_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def status(config: Path) -> list[str]:
        # the instance: .dagster beside each config (a command run here sets DAGSTER_HOME for this process)
        monkeypatch.delenv("DAGSTER_HOME", raising=False)
        monkeypatch.delenv("EAGLE3_CONFIG", raising=False)
        return ["--config", str(config), "status", "--json"]

    # once here first: what the command imports is imported before the fork, so the children start together
    assert main(status(write_config(tmp_path / "warm", "store: store\n"))) == 0
    for attempt in range(3):  # the race is lost in most attempts, not all: a few fresh projects
        config = write_config(tmp_path / f"project{attempt}", "store: store\n")
        codes = _at_once(status(config), 3)
        output = capfd.readouterr()
        assert codes == [0, 0, 0], output.out[-2000:] + output.err[-4000:]
        for database in ("history/runs.db", "history/runs/index.db", "schedules/schedules.db"):
            assert len(_alembic_heads(config.parent / ".dagster" / database)) == 1, database
        assert main(status(config)) == 0  # a later command opens it


def _waiting_on_flock(pid: int, lock: Path) -> bool:
    """Whether process `pid` is blocked waiting for an flock on `lock` (the kernel lists waiters with '->')."""
    inode = f":{os.stat(lock).st_ino} "
    with open("/proc/locks") as locks:
        return any("-> FLOCK" in line and f" {pid} " in line and inode in line for line in locks)


def _eventually(condition: Callable[[], bool], seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _exec_stands_in(argv: str, args: list[str], env: dict[str, str]) -> None:
    """`eagle3 ui` ends by replacing itself with `dagster dev`: here the child just exits, the instance made."""
    os._exit(0)


ENTRY_POINTS: dict[str, Callable[[Path], object]] = {
    "status": lambda config: main(["--config", str(config), "status"]),
    "materialize": lambda config: main(["--config", str(config), "materialize", "--missing", "--in-process"]),
    "ui": lambda config: main(["--config", str(config), "ui", "--port", "3999"]),
    "materialize_shards (demo)": lambda config: materialize_shards([]),
}


def _entry_point(name: str, config: Path, locked: Event) -> None:
    locked.wait()
    code = ENTRY_POINTS[name](config)
    sys.exit(code if isinstance(code, int) else 0)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_each_entry_point_creates_the_instance_under_the_lock(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While another process holds the instance lock (as one creating the instance does), the command waits
    for it and has created nothing; once it is released, it creates the instance and succeeds."""
    from eagle3_dagster.instance import instance_lock, instance_lock_path

    config = write_config(tmp_path, "store: store\n")
    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text((ops_cli.REPO_ROOT / "dagster.yaml").read_text())
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("EAGLE3_CONFIG", str(config))
    monkeypatch.setattr(ops_cli.os, "execvpe", _exec_stands_in)  # the forked child inherits it
    locked = FORK.Event()
    # forked before the lock is taken: a child forked while it is held would hold it too (flock locks belong
    # to the open file, which the child inherits) and wait on itself
    child = FORK.Process(target=_entry_point, args=(name, config, locked))
    child.start()
    with instance_lock(home):
        locked.set()
        assert _eventually(lambda: _waiting_on_flock(child.pid or 0, instance_lock_path(home))), (
            f"{name} did not wait for the instance lock (exit code {child.exitcode})"
        )
        assert child.is_alive() and not (home / "history").exists()
    child.join(120)
    assert child.exitcode == 0
    assert _alembic_heads(home / "history" / "runs.db") == _alembic_heads(home / "schedules" / "schedules.db")
    assert len(_alembic_heads(home / "history" / "runs.db")) == 1
