"""Muon's optimizer step on several ranks: torch.optim.Muon (every rank orthogonalises every matrix) against
DistributedMuon (train/muon.py: each matrix orthogonalised by one rank, the result broadcast), side by side
in one run on the same matrices and gradients.

    python -m bench.muon_step                      # CPU: 2 gloo ranks, the drafter's matrices at hidden 1024
    python -m bench.muon_step --hidden 7168 --nproc 8   # a GPU host: NCCL, Kimi-K2.5's widths

The matrices are those Muon updates in the drafter eagle3 makes at the given widths (fc and the decoder
layer's), with Kimi-K2.5's proportions by default (intermediate 18432/7168 of the hidden size, heads of 128,
a key/value head for every 7 query heads, rounded). Each step's gradients are random, alike on every rank
(as DDP's averaging leaves them); the step's time is the slowest rank's. The two optimizers end on the same
weights bit for bit, which the record says. Results: bench/results/muon_step_<device>_x<ranks>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench._common import device_label
from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.train.distributed import init_world
from eagle3_core.train.muon import DistributedMuon
from eagle3_core.train.optim import MUON_WEIGHT_DECAY, muon_split

REPO = Path(__file__).resolve().parent.parent
OPTIMIZERS = {"torch.optim.Muon": torch.optim.Muon, "DistributedMuon": DistributedMuon}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="the results file (default: bench/results/...)")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)  # a rank's record file
    return p.parse_args(argv)


def drafter_config(hidden: int) -> DrafterConfig:
    """The drafter at `hidden` with Kimi-K2.5's proportions (7168: intermediate 18432, 56 heads over 8)."""
    heads = max(7, hidden // 128 // 7 * 7)
    return DrafterConfig(
        target_hidden_size=hidden, hidden_size=hidden, intermediate_size=hidden * 18432 // 7168,
        num_heads=heads, num_kv_heads=heads // 7, head_dim=128, target_vocab_size=64, draft_vocab_size=64,
        norm_before_fc=True, norm_output=True,
    )  # fmt: skip


def matrix_shapes(hidden: int) -> list[torch.Size]:
    with torch.device("meta"):
        drafter = Eagle3Drafter(drafter_config(hidden))
    return [p.shape for p in muon_split(drafter)[0]]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def timed_steps(name: str, shapes: list[torch.Size], args: argparse.Namespace, device: torch.device) -> Any:
    """(seconds of each timed step, the final weights) for one optimizer."""
    params = [
        nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(device) * 0.02)
        for i, s in enumerate(shapes)
    ]
    optimizer = OPTIMIZERS[name](
        params, lr=1e-3, weight_decay=MUON_WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw"
    )
    seconds = []
    for step in range(args.warmup + args.steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i)).to(device)
        synchronize(device)
        started = time.perf_counter()
        optimizer.step()
        synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        if dist.is_initialized():
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
        if step >= args.warmup:
            seconds.append(float(elapsed))
    return seconds, [p.detach().cpu() for p in params]


def worker(args: argparse.Namespace) -> None:
    world = init_world(args.device)
    if world.device.type == "cuda":
        torch.cuda.set_device(world.device)
    shapes = matrix_shapes(args.hidden)
    seconds, weights = {}, {}
    for name in OPTIMIZERS:
        seconds[name], weights[name] = timed_steps(name, shapes, args, world.device)
        if world.device.type == "cuda":
            torch.cuda.empty_cache()
    torchs, ours = (weights[n] for n in OPTIMIZERS)
    record = {
        "matrices": [list(s) for s in shapes],
        "parameters": sum(s.numel() for s in shapes),
        "step_seconds": seconds,
        "median_step_seconds": {n: round(statistics.median(s), 6) for n, s in seconds.items()},
        "weights_equal": all(torch.equal(a, b) for a, b in zip(torchs, ours, strict=True)),
    }
    if world.is_main:
        assert args.worker is not None
        args.worker.write_text(json.dumps(record))
    if dist.is_initialized():
        dist.destroy_process_group()


def results_path(args: argparse.Namespace, device: str) -> Path:
    if args.out is not None:
        return args.out
    name = device_label(device)
    return REPO / "bench" / "results" / f"muon_step_{name}_x{args.nproc}.json"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    record_file = REPO / ".cache" / "muon_step" / "rank0.json"
    record_file.parent.mkdir(parents=True, exist_ok=True)
    record_file.unlink(missing_ok=True)
    env = dict(os.environ)
    if not cuda:  # the host's cores shared out over the ranks
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.nproc))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        "-m", "bench.muon_step", f"--hidden={args.hidden}", f"--device={'cuda' if cuda else 'cpu'}",
        f"--warmup={args.warmup}", f"--steps={args.steps}", f"--worker={record_file}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env)
    if done.returncode != 0:
        print(f"torchrun exited {done.returncode} (its log is above)", file=sys.stderr)
        return 1
    record = json.loads(record_file.read_text())
    medians = record["median_step_seconds"]
    results = {
        "what": "Muon's optimizer step on several ranks: torch.optim.Muon (every rank orthogonalises every "
        "matrix) against DistributedMuon (each matrix orthogonalised by one rank), the same matrices and "
        "gradients; the slowest rank's step time, median of the timed steps",
        "command": " ".join(["python -m bench.muon_step", *(argv if argv is not None else sys.argv[1:])]),
        "device": device,
        "torch": torch.__version__,
        "ranks": args.nproc,
        "hidden": args.hidden,
        "warmup": args.warmup,
        "steps": args.steps,
        **record,
        "torch_over_distributed": round(medians["torch.optim.Muon"] / medians["DistributedMuon"], 3),
    }
    path = results_path(args, device)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(
        f"{args.nproc} ranks on {device}, {record['parameters'] / 1e6:.1f}M parameters in "
        f"{len(record['matrices'])} matrices: torch.optim.Muon {medians['torch.optim.Muon']:.3f} s a step, "
        f"DistributedMuon {medians['DistributedMuon']:.3f} s ({results['torch_over_distributed']}x); "
        f"weights equal: {record['weights_equal']}; {path}"
    )
    return 0 if record["weights_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
