"""A real PostgreSQL server for a test: Debian's binaries, a throwaway cluster on 127.0.0.1 and a free port.

`initdb` and `pg_ctl` refuse to run as root; as root they run as the `postgres` user (created by Debian's
package) on a data directory it owns. The server is stopped by its PID, and its directory removed, on exit.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_core.procs import pid_alive
from tests.fakes import free_port

PG_ROOT = Path("/usr/lib/postgresql")
PREFERRED_MAJOR = "15"  # Debian bookworm's postgresql


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    password: str
    db_name: str
    pid: int
    data_dir: Path

    def dsn(self, db_name: str | None = None) -> str:
        return (
            f"host={self.host} port={self.port} user={self.user} password={self.password} "
            f"dbname={db_name or self.db_name}"
        )

    def dagster_env(self) -> dict[str, str]:
        """The variables docker/dagster.yaml reads its credentials from."""
        return {
            "DAGSTER_POSTGRES_USER": self.user,
            "DAGSTER_POSTGRES_PASSWORD": self.password,
            "DAGSTER_POSTGRES_HOST": self.host,
            "DAGSTER_POSTGRES_DB": self.db_name,
            "DAGSTER_POSTGRES_PORT": str(self.port),
        }


def postgres_bin_dir() -> Path | None:
    """Debian's server binaries (`/usr/lib/postgresql/<major>/bin`), version 15 first; None if not installed."""
    if not PG_ROOT.is_dir():
        return None
    majors = sorted((p.name for p in PG_ROOT.iterdir() if (p / "bin" / "initdb").is_file()), reverse=True)
    if PREFERRED_MAJOR in majors:
        majors.remove(PREFERRED_MAJOR)
        majors.insert(0, PREFERRED_MAJOR)
    return PG_ROOT / majors[0] / "bin" if majors else None


def _as_server_user(command: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(_as_server_user(command), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"{what} exited with {done.returncode}: {done.stdout}\n{done.stderr}")


def _stop(bin_dir: Path, data_dir: Path, pid: int) -> None:
    with contextlib.suppress(subprocess.SubprocessError, OSError):
        subprocess.run(
            _as_server_user(
                [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-m", "fast", "-w", "-t", "30", "stop"]
            ),
            capture_output=True,
            timeout=60,
        )
    deadline = time.monotonic() + 10
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def create_database(dsn: str, name: str) -> None:
    """CREATE DATABASE `name` on the server `dsn` reaches (psycopg2, outside a transaction as it must be)."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE DATABASE "{name}"')
    finally:
        conn.close()


def assert_postgres_queued_and_pooled(instance: Any) -> None:
    """What both deployment instance files (docker/dagster.yaml, docker/k8s/dagster.yaml) give: PostgreSQL
    storages, the queued coordinator, GPU-pool granularity run at 1, run monitoring that frees slots."""
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

    assert isinstance(instance.run_storage, PostgresRunStorage)
    assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
    assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
    assert type(instance.run_coordinator).__name__ == "QueuedRunCoordinator"
    pools = instance.get_concurrency_config().pool_config
    assert pools.pool_granularity is not None and pools.pool_granularity.value == "run"
    assert pools.default_pool_limit == 1
    assert instance.run_monitoring_enabled
    assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] == 300


@contextlib.contextmanager
def running_postgres(
    bin_dir: Path, user: str = "dagster", db_name: str = "dagster", attempts: int = 3
) -> Iterator[PostgresServer]:
    """Start a fresh cluster with password authentication, create `db_name`, yield it, stop it by its PID."""
    base = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))
    if os.geteuid() == 0:
        server_user = pwd.getpwnam("postgres")
        os.chown(base, server_user.pw_uid, server_user.pw_gid)
    password = os.urandom(12).hex()
    data_dir = base / "data"
    pid: int | None = None
    try:
        pwfile = base / "pwfile"
        pwfile.write_text(password + "\n")
        if os.geteuid() == 0:
            os.chown(pwfile, server_user.pw_uid, server_user.pw_gid)
        _run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data_dir),
                "-U",
                user,
                f"--pwfile={pwfile}",
                "--auth=scram-sha-256",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ],
            "initdb",
        )
        for attempt in range(attempts):
            port = free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -p {port} -c unix_socket_directories='{base}' "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            )
            command = [str(bin_dir / "pg_ctl"), "-D", str(data_dir), "-l", str(base / "server.log")]
            try:
                _run([*command, "-o", options, "-w", "-t", "60", "start"], "pg_ctl start")
                break
            except RuntimeError:
                if attempt == attempts - 1:
                    log = (base / "server.log").read_text(errors="replace")[-4000:]
                    raise RuntimeError(
                        f"PostgreSQL did not start on 127.0.0.1; its log ends:\n{log}"
                    ) from None
        pid = int((data_dir / "postmaster.pid").read_text().split()[0])

        create_database(
            f"host=127.0.0.1 port={port} user={user} password={password} dbname=postgres", db_name
        )
        yield PostgresServer("127.0.0.1", port, user, password, db_name, pid, data_dir)
    finally:
        if pid is not None:
            _stop(bin_dir, data_dir, pid)
        shutil.rmtree(base, ignore_errors=True)
