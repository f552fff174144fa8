"""The live SGLang engines' budgets (tests/conformance/conftest.py `run_engines`), shown with a stand-in for
live_extract.py that prints the same start line per engine: an engine that overruns its budget, and one that
fails, are each recorded against their own name, and every other engine still runs, the child started again
after each failure (the real script imports SGLang once per child)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conformance import conftest as conformance

STAND_IN = """
import sys, time
print("imported", flush=True)
for model in sys.argv[2:]:
    print("extracting through sglang.Engine: " + model, flush=True)
    if model == "slow":
        time.sleep(30)
    if model == "broken":
        sys.exit(3)
    open(sys.argv[1] + "/" + model, "w").close()
"""


def test_an_engine_past_its_budget_or_failing_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(conformance, "ENGINE_BUDGET_S", 2)
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    jobs = {name: name for name in ("a", "slow", "b", "broken", "c")}
    log = tmp_path / "engines.log"
    failures = conformance.run_engines(script, jobs, [str(tmp_path)], {**os.environ}, log)
    assert set(failures) == {"slow", "broken"}
    assert "engine slow ran past its 2 s" in failures["slow"]
    assert "engine broken failed (exit 3)" in failures["broken"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name in jobs) == ["a", "b", "c"]


def test_the_real_script_prints_the_start_line_the_budgets_go_by() -> None:
    assert f'print(f"{conformance.STARTING}{{model}}"' in (conformance.HERE / "live_extract.py").read_text()
