"""The conformance suite: eagle3's SGLang-facing code against SGLang 0.5.23's released Python code.

The code runs in a child process whose path puts `make sglang-env`'s directory (the real SGLang modules) and
the torchvision stand-in before the project's own virtual environment, so the main test process never
imports SGLang. Without that directory the tests skip, saying why, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

SGLANG_ENV = REPO / ".cache" / "sglang-0.5.23"
HERE = Path(__file__).resolve().parent
STUBS = HERE / "stubs"
# a probe in a child process was given 300 s: the import of SGLang, now done once, and the probe itself
PROBE_TIMEOUT_S = 300

Probe = Callable[..., Any]


def sglang_env() -> dict[str, str]:
    """The environment of a child process that imports SGLang's code (skips, or fails under CI=true, when
    `make sglang-env` has not installed it)."""
    if not (SGLANG_ENV / ".installed").exists():
        why = f"SGLang 0.5.23's code is not installed at {SGLANG_ENV}: run `make sglang-env`"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUBS), str(SGLANG_ENV), str(REPO)])}


@pytest.fixture(scope="session")
def sglang_probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probe]:
    """probe(script, *args): run tests/conformance/<script> beside SGLang's code; its stdout's last line as JSON.

    One child process (probe_host.py) imports SGLang once for the session and runs each probe in a fork of
    itself, as `python <script> args` would run it, so every probe starts from freshly imported modules."""
    work = tmp_path_factory.mktemp("sglang-probe")
    log = work / "probe_host.log"
    # probe_capture.py's DeepSeek prefills compile kernels: a cache of this session's own (test_sglang_live.py's
    # fixture says why)
    env = {**sglang_env(), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    with log.open("wb") as stderr:
        host = subprocess.Popen(
            [sys.executable, str(HERE / "probe_host.py")],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert host.stdin is not None and host.stdout is not None
    stdin, stdout = host.stdin, host.stdout

    def probe(script: str, *args: str) -> Any:
        stdin.write(json.dumps([str(HERE / script), *args]) + "\n")
        stdin.flush()
        ready, _, _ = select.select([stdout], [], [], PROBE_TIMEOUT_S)
        line = stdout.readline() if ready else ""
        assert line, f"no answer from probe_host.py for {script}; its log:\n{log.read_text()[-4000:]}"
        done = json.loads(line)
        assert done["returncode"] == 0, done["stdout"][-2000:] + done["stderr"][-4000:]
        return json.loads(done["stdout"].strip().splitlines()[-1])

    yield probe
    stdin.close()  # the host's loop ends; what is left of it is the interpreter's exit, not waited for
    host.kill()
    host.wait()


# Each engine's own budget, from its start line to its states: on an idle 2-core machine an engine takes 15-40 s;
# a loaded one (a second `make test` beside this one) several times that. Importing SGLang before the first
# engine has its own. An engine past its budget fails its own family's tests, and the others still run.
ENGINE_BUDGET_S = 420
IMPORT_BUDGET_S = 600
STARTING = "extracting through sglang.Engine: "  # live_extract.py's line as each engine starts


def run_engines(
    script: Path, jobs: dict[str, str], head: list[str], env: dict[str, str], log: Path
) -> dict[str, str]:
    """`script` (live_extract.py) over every job (name -> its model argument) in one child process, which imports SGLang
    once; an engine that overruns ENGINE_BUDGET_S (or fails) is recorded against its own name, the child is
    stopped, and a new one takes the jobs after it. Returns why each failed engine gave no states."""
    failures: dict[str, str] = {}
    pending = list(jobs)
    while pending:
        with log.open("ab") as stderr:
            child = subprocess.Popen(
                [sys.executable, str(script), *head, *(jobs[n] for n in pending)],
                cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
            )  # fmt: skip
        lines: queue.Queue[str] = queue.Queue()  # the child's lines as they come ("" at its end)
        threading.Thread(target=_forward, args=(child, lines), daemon=True).start()
        running: str | None = None
        started: list[str] = []
        deadline = time.monotonic() + IMPORT_BUDGET_S
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                child.kill()
                child.wait()
                what = (
                    f"engine {running} ran past its {ENGINE_BUDGET_S} s"
                    if running
                    else (f"importing SGLang ran past {IMPORT_BUDGET_S} s")
                )
                failures[running or pending[0]] = f"{what}; the engines' log ends:\n{_tail(log)}"
                break
            if line.startswith(STARTING):
                running = next(n for n in pending if jobs[n] == line[len(STARTING) :].strip())
                started.append(running)
                deadline = time.monotonic() + ENGINE_BUDGET_S
            elif line == "":
                if child.wait() != 0:
                    failed = running or pending[0]
                    failures[failed] = (
                        f"engine {failed} failed (exit {child.returncode}); the log ends:\n{_tail(log)}"
                    )
                break
        pending = [n for n in pending if n not in started and n not in failures]
    return failures


def _forward(child: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
    assert child.stdout is not None
    for line in child.stdout:
        lines.put(line)
    lines.put("")


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
