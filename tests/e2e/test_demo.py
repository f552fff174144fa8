"""`eagle3 demo`, the command `make demo` runs, end to end on a small slice of its data: every stage through
Dagster, then the summary the README describes, ending with the `eagle3 ui` line that test_ui.py runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_cli.main import DEMO_CONFIG
from tests.conftest import CACHE

pytestmark = pytest.mark.slow

EAGLE3 = Path(sys.executable).parent / "eagle3"


def test_the_demo_runs_every_stage_and_reports_al_with_its_interval(
    tmp_path: Path, toy_target_dir: Path
) -> None:
    workdir = tmp_path / "demo"
    workdir.mkdir()
    config = DEMO_CONFIG.format(limit=80, shard_size=40)
    assert "cache: ../.cache/eagle3" in config
    # the demo's own config, with the test suite's cache (the toy target is built once per machine)
    (workdir / "eagle3.yaml").write_text(config.replace("cache: ../.cache/eagle3", f"cache: {CACHE}"))
    result = subprocess.run(
        [str(EAGLE3), "demo", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "COLUMNS": "400", "HF_HUB_OFFLINE": "1"},  # one summary line a line
    )
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert toy_target_dir.name in out
    assert re.search(r"2 shards \(2 new\)", out), out
    for k in (3, 7):
        line = re.search(rf"K={k}: AL (\d+\.\d+) \(95% CI (\d+\.\d+)-(\d+\.\d+);", out)
        assert line, out[-4000:]
        al, low, high = map(float, line.groups())
        assert low <= al <= high
        assert re.search(rf"K={k}: .*speedup \d+\.\d+x \(median over prompts\)", out)
    assert "promoted (gate: passed)" in out
    # the figures say whose they are, and where a real model's are and how to reproduce them
    assert "The figures below are the toy target's" in out
    assert "These are the toy target's figures" in out and "eagle3 demo --target smollm2" in out
    assert f"{EAGLE3} --config {workdir / 'eagle3.yaml'} ui" in out
    assert (workdir / "store" / "drafter" / "current" / "sglang" / "config.json").is_file()
