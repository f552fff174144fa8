"""The conformance suite: eagle3's SGLang-facing code against SGLang 0.5.23's released Python code.

The code runs in a child process whose path puts `make sglang-env`'s directory (the real SGLang modules) and
the torchvision stand-in before the project's own virtual environment, so the main test process never
imports SGLang. Without that directory the tests skip, saying why, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

SGLANG_ENV = REPO / ".cache" / "sglang-0.5.23"
STUBS = Path(__file__).resolve().parent / "stubs"

Probe = Callable[..., Any]


@pytest.fixture(scope="session")
def sglang_probe() -> Probe:
    """probe(script, *args): run tests/conformance/<script> beside SGLang's code; its stdout's last line as JSON."""
    if not (SGLANG_ENV / ".installed").exists():
        why = f"SGLang 0.5.23's code is not installed at {SGLANG_ENV}: run `make sglang-env`"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)

    def probe(script: str, *args: str) -> Any:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(STUBS), str(SGLANG_ENV), str(REPO)])}
        done = subprocess.run(
            [sys.executable, str(Path(__file__).parent / script), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return probe
