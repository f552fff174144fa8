"""A real `dagster dev` (webserver, daemon, code server) for end-to-end tests, on 127.0.0.1 and a free port.

    with dagster_dev(dagster_home(tmp_path), config_path) as dev:
        dev.graphql("{ version }")
        dev.url("/assets")

or, as a fixture: `dagster_dev_factory(home, config_path)` starts one that is stopped at teardown (import it
into the test module with `# noqa: F401` and name it as a parameter with `# noqa: F811`, as
tests/e2e/test_ui.py does). `dev.graphql(query, variables)` returns a query's data (a launchPartitionBackfill
mutation, a run's status). The server runs in its own process group and is stopped by its PID: SIGTERM to the
group, then SIGKILL after a grace period, so the daemon and the code server it started go with it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import free_port

REPO = Path(__file__).resolve().parent.parent
WORKSPACE = REPO / "workspace.yaml"
DAGSTER = Path(sys.executable).parent / "dagster"

LOCATION_QUERY = """
query Locations {
  workspaceOrError {
    __typename
    ... on Workspace {
      locationEntries {
        name
        loadStatus
        locationOrLoadError { __typename ... on PythonError { message stack } }
      }
    }
    ... on PythonError { message }
  }
}
"""


class DagsterDevError(RuntimeError):
    """The server did not come up, died, or answered a GraphQL query with errors."""


def dagster_home(directory: Path) -> Path:
    """A DAGSTER_HOME in `directory` holding a copy of the repository's dagster.yaml (as the CLI makes one)."""
    home = directory / ".dagster"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    return home


class DagsterDev:
    """One `dagster dev` subprocess: its base URL, a GraphQL helper, its log, and stop()."""

    def __init__(self, proc: subprocess.Popen[bytes], base_url: str, log_path: Path, home: Path) -> None:
        self.proc = proc
        self.base_url = base_url
        self.log_path = log_path
        self.home = home
        self.stopped = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def url(self, path: str = "/") -> str:
        return self.base_url + (path if path.startswith("/") else "/" + path)

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def graphql(
        self, query: str, variables: Mapping[str, Any] | None = None, timeout: float = 60.0
    ) -> dict[str, Any]:
        """POST a query to /graphql; returns its `data`, raises DagsterDevError on a transport or GraphQL error."""
        body = json.dumps({"query": query, "variables": dict(variables or {})}).encode()
        request = urllib.request.Request(
            self.url("/graphql"), data=body, headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                payload = json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise DagsterDevError(f"GraphQL HTTP {err.code}: {err.read()[:2000]!r}") from err
        if payload.get("errors"):
            raise DagsterDevError(f"GraphQL errors: {json.dumps(payload['errors'])[:4000]}")
        data: dict[str, Any] = payload["data"]
        return data

    def _check_alive(self, waiting_for: str) -> None:
        if self.proc.poll() is not None:
            raise DagsterDevError(
                f"dagster dev exited with {self.proc.returncode} while waiting for {waiting_for}; "
                f"its log ({self.log_path}):\n{self.log_tail()}"
            )

    def wait_until_ready(self, timeout: float = 180.0, wait_for_locations: bool = True) -> None:
        """Until the webserver answers `{ version }` and (by default) every code location has loaded."""
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        while time.monotonic() < deadline:
            self._check_alive("the webserver")
            try:
                self.graphql("{ version }", timeout=5)
                break
            except (OSError, DagsterDevError) as err:
                last_error = repr(err)
            time.sleep(0.5)
        else:
            raise DagsterDevError(
                f"dagster dev at {self.base_url} did not answer within {timeout:.0f} s ({last_error}); "
                f"its log ({self.log_path}):\n{self.log_tail()}"
            )
        while wait_for_locations and time.monotonic() < deadline:
            self._check_alive("the code location")
            workspace = self.graphql(LOCATION_QUERY, timeout=30)["workspaceOrError"]
            if workspace["__typename"] != "Workspace":
                raise DagsterDevError(f"workspace failed to load: {workspace}")
            entries = workspace["locationEntries"]
            for entry in entries:
                loaded = entry["locationOrLoadError"]
                if loaded is not None and loaded["__typename"] == "PythonError":
                    raise DagsterDevError(
                        f"code location {entry['name']} failed to load: {loaded['message']}\n{loaded['stack']}"
                    )
            if entries and all(
                e["loadStatus"] == "LOADED" and e["locationOrLoadError"] is not None for e in entries
            ):
                return
            time.sleep(0.5)
        if wait_for_locations:
            raise DagsterDevError(
                f"the code locations of dagster dev at {self.base_url} did not load within {timeout:.0f} s; "
                f"its log ({self.log_path}):\n{self.log_tail()}"
            )

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM to the process group (webserver, daemon, code server), SIGKILL to what is left after `grace`."""
        if self.stopped:
            return
        self.stopped = True
        pgid = self.proc.pid  # start_new_session: the group's id is the leader's PID
        with suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _group_alive(pgid) and time.monotonic() < deadline:
            self.proc.poll()  # reap the leader, or its zombie keeps the group alive
            time.sleep(0.2)
        if _group_alive(pgid):
            with suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a member we may not signal still exists
        return True
    return True


def start_dagster_dev(
    home: Path,
    config_path: Path,
    *,
    workspace: Path = WORKSPACE,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 180.0,
    wait_for_locations: bool = True,
) -> DagsterDev:
    """Start `dagster dev -h 127.0.0.1 -p PORT -w WORKSPACE` with DAGSTER_HOME=home and EAGLE3_CONFIG set, and
    wait until it answers GraphQL (and its code locations are loaded). Its output goes to home/dagster-dev.log.
    The caller stops it with stop() (or use dagster_dev() / dagster_dev_factory, which do)."""
    port = port or free_port()
    log_path = home / "dagster-dev.log"
    process_env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "EAGLE3_CONFIG": str(config_path),
        "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [str(DAGSTER), "dev", "-h", "127.0.0.1", "-p", str(port), "-w", str(workspace)],
            cwd=REPO,
            env=process_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    dev = DagsterDev(proc, f"http://127.0.0.1:{port}", log_path, home)
    try:
        dev.wait_until_ready(timeout=timeout, wait_for_locations=wait_for_locations)
    except BaseException:
        dev.stop(grace=5)
        raise
    return dev


@contextmanager
def dagster_dev(home: Path, config_path: Path, **kwargs: Any) -> Iterator[DagsterDev]:
    """start_dagster_dev(), stopped on leaving the block."""
    dev = start_dagster_dev(home, config_path, **kwargs)
    try:
        yield dev
    finally:
        dev.stop()


@pytest.fixture
def dagster_dev_factory() -> Iterator[Callable[..., DagsterDev]]:
    """Starts `dagster dev` servers (same arguments as start_dagster_dev); each is stopped at teardown."""
    started: list[DagsterDev] = []

    def start(home: Path, config_path: Path, **kwargs: Any) -> DagsterDev:
        dev = start_dagster_dev(home, config_path, **kwargs)
        started.append(dev)
        return dev

    yield start
    for dev in reversed(started):
        dev.stop()
