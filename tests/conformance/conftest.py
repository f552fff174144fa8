"""The conformance suite: eagle3's SGLang-facing code against SGLang 0.5.23's released Python code.

The code runs in a child process whose path puts `make sglang-env`'s directory (the real SGLang modules) and
the torchvision stand-in before the project's own virtual environment, so the main test process never
imports SGLang. Without that directory the tests skip, saying why, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
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
    env = sglang_env()
    log = tmp_path_factory.mktemp("sglang-probe") / "probe_host.log"
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
