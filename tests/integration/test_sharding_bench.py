"""bench/sharding.py at its tiny size on the CPU (gloo): each head trained under DDP and under FSDP through
train_drafter, one rank in a process group of one (so fully_shard really shards), in two invocations whose
runs merge into one file."""

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_the_sharding_bench_trains_each_head_under_ddp_and_a_real_fsdp_and_merges_its_parts(
    tmp_path: Path,
) -> None:
    out = tmp_path / "sharding.json"
    common = [
        sys.executable, "-m", "bench.sharding", "--device", "cpu", "--tiny", "--workdir", str(tmp_path / "work"),
        "--out", str(out),
    ]  # fmt: skip
    logs = []
    for heads in ("default", "full"):
        done = subprocess.run(
            [*common, "--heads", heads], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        logs.append(done.stdout)
    assert "reusing training set" in logs[1]  # the second invocation trains on the first's shards

    report = json.loads(out.read_text())
    runs = report["runs"]
    assert set(runs) == {"default-ddp", "default-fsdp", "full-ddp", "full-fsdp"}  # merged from both
    for name, run in runs.items():
        fsdp = name.endswith("fsdp")
        assert run["setup"] == {
            "sharded": fsdp,
            "model": "FSDPTTTLoss" if fsdp else "DistributedDataParallel",
            "world_size": 1,
            "layer_compiled": False,
        }, name
        assert run["steps"] == 4 and run["tokens_per_s"] > 0, name
        assert (run["from_step"], run["to_step"]) == (2, 4), name  # timed after the warm-up's 2 steps
        memory = run["memory"]
        assert set(memory["estimate_gib"]) == {"1", "2", "4", "8"}, name
        assert (memory["divided_bytes"] > 0) == fsdp, name  # only FSDP divides anything over the ranks
    assert runs["default-ddp"]["draft_vocab"] == 256 and runs["full-ddp"]["draft_vocab"] == 1000
    assert set(report["comparison"]) == {"default", "full"}
    for head, compared in report["comparison"].items():
        assert compared["train_loss_max_rel_diff"] < 1e-4, head  # float32: an FSDP step is a DDP step
        assert compared["fsdp_over_ddp_tokens_per_s"] > 0, head
