"""bench/vs_speculators_gpu.py at its tiny size on the CPU: a warm-up run (both trainers compiling at once), then
the timed run on the shards it left: both trainers on the same shards, the numbers the GPU run reports, and the
lean loss against the plain one on a real batch."""

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_the_gpu_bench_runs_both_trainers_on_the_same_shards_and_reports_the_ratios(tmp_path: Path) -> None:
    out, warm = tmp_path / "result.json", tmp_path / "warm.json"
    common = [
        sys.executable, "-m", "bench.vs_speculators_gpu", "--device", "cpu", "--tiny", "--ttt", "3",
        "--steps", "3", "--workdir", str(tmp_path / "work"),
    ]  # fmt: skip
    done = subprocess.run(
        [*common, "--warm-only", "--results", str(warm)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warmed = json.loads(warm.read_text())["widths"]["64"]["ttt3"]
    failed = {name: run["error"] for name, run in warmed.items() if "error" in run}
    assert not failed, (
        f"{failed}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    )  # the traceback, when CI fails
    assert warmed["eagle3"]["steps"] == 3 and warmed["speculators"]["steps"] == 1  # the warm-up steps only
    assert "tokens_per_s" not in warmed["eagle3"] and "error" not in warmed["speculators"]

    command = [*common, "--check-lean", "--results", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "reusing training set" in done.stdout  # the shards the warm-up left, not new ones
    row = json.loads(out.read_text())["widths"]["64"]["ttt3"]
    eagle3, speculators = row["eagle3"], row["speculators"]
    assert eagle3["steps"] == 3 and eagle3["tokens_per_s"] > 0 and eagle3["flops_per_token"] > 0
    assert speculators["steps"] == 3 and speculators["tokens_per_s"] > 0
    assert row["speed_ratio"] == round(eagle3["tokens_per_s"] / speculators["tokens_per_s"], 2)
    lean = eagle3["lean_vs_plain"]
    assert lean["loss_rel_diff"] < 1e-5 and lean["acc_lean"] == lean["acc_plain"]
    assert 0 < lean["grad_rel_diff_max"] < 1e-2  # bf16 products, rounded at different points
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())  # shards removed
