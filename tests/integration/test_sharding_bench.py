"""bench/sharding.py at its tiny size on the CPU (gloo): each head trained under DDP and under FSDP through
train_drafter, one rank in a process group of one (so fully_shard really shards), in two invocations whose
runs merge into one file; then the default head again on two ranks as two torchrun agents ("nodes", c10d on
127.0.0.1), against the one-rank runs."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def _bench(*args: str, timeout: float = 300) -> str:
    """`python -m bench.sharding ARGS`'s output; on a timeout the whole process group (torchrun's agents and
    ranks too) is killed, not left behind."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.sharding", *args], cwd=REPO, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(
            f"bench.sharding {' '.join(args)}: no end within {timeout} s\n{out[-3000:]}"
        ) from None
    assert proc.returncode == 0, out[-6000:]
    return out


def test_the_sharding_bench_trains_each_head_under_ddp_and_a_real_fsdp_and_merges_its_parts(
    tmp_path: Path,
) -> None:
    out = tmp_path / "sharding.json"
    common = ["--device", "cpu", "--tiny", "--workdir", str(tmp_path / "work")]
    logs = [_bench(*common, "--out", str(out), "--heads", heads) for heads in ("default", "full")]
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

    # two ranks as two nodes, against the one-rank runs: the same global batches, so the same losses
    # (validation under FSDP included, whose forwards every rank must run alike), and how tokens/s scaled
    nodes = tmp_path / "sharding_x2_2nodes.json"
    log = _bench(*common, "--out", str(nodes), "--heads", "default", "--nproc", "2", "--nodes", "2",
                 "--reference", str(out))  # fmt: skip
    assert "default-fsdp, node 1: --nnodes=2 --rdzv-backend=c10d" in log
    two = json.loads(nodes.read_text())
    assert (two["nproc"], two["nodes"], set(two["runs"])) == (2, 2, {"default-ddp", "default-fsdp"})
    assert all(run["setup"]["world_size"] == 2 for run in two["runs"].values())
    against = two["against_reference"]
    assert (against["file"], against["nproc"], set(against["runs"])) == (str(out), 1, set(two["runs"]))
    for name, c in against["runs"].items():
        assert c["train_loss_max_rel_diff"] < 1e-3 and c["val_loss_0_rel_diff"] < 1e-3, name
        # both rounded to 3 places: tokens/s over one rank's, per rank
        assert abs(c["scaling_efficiency"] - c["tokens_per_s_over_reference"] / 2) <= 1e-3, name
