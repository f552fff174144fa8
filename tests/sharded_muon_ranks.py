"""One rank of two (gloo, under torchrun): ShardedMuon over the row shards `fully_shard` makes, beside torch's
Muon over the whole matrices, on the same losses. `python -m torch.distributed.run --standalone
--nproc-per-node 2 tests/sharded_muon_ranks.py OUT.json`; rank 0 writes what the test asserts to OUT.json.

Every rank computes the same loss, so FSDP's averaged gradient is each rank's own gradient exactly, and the
two optimizers see the same gradients bit for bit. The second matrix has 7 rows, which two ranks cannot
split evenly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from eagle3_core.train.distributed import init_world
from eagle3_core.train.sharding import (
    ShardedMuon,
    copy_whole_into,
    load_whole_optimizer_state,
    shard_module,
    whole,
    whole_optimizer_state,
)

SETTINGS = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
STEPS = 3  # then a resume from the whole state, and one more step


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=False), nn.Tanh(), nn.Linear(96, 7, bias=False))


def step(module: nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    inputs = torch.randn(16, 64, generator=torch.Generator().manual_seed(n))
    module(inputs).square().mean().backward()
    for group in optimizer.param_groups:
        group["lr"] = SETTINGS["lr"] * (n + 1)  # as the schedule sets it, step by step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def largest_difference(sharded: nn.Module, reference: nn.Module) -> float:
    return max(
        float((whole(a.detach()) - b.detach()).abs().max())
        for a, b in zip(sharded.parameters(), reference.parameters(), strict=True)
    )


def main(out: Path) -> None:
    world = init_world("cpu")
    reference = model()
    reference_muon = torch.optim.Muon(reference.parameters(), **SETTINGS)  # type: ignore[arg-type]
    sharded = shard_module(model(), world)
    sharded_muon = ShardedMuon(sharded.parameters(), **SETTINGS)
    for n in range(STEPS):
        step(reference, reference_muon, n)
        step(sharded, sharded_muon, n)
    momentum = [sharded_muon.state[p]["momentum_buffer"] for p in sharded.parameters()]
    reference_momentum = [reference_muon.state[p]["momentum_buffer"] for p in reference.parameters()]
    saved = whole_optimizer_state(sharded_muon, world)
    report = {
        "weights": largest_difference(sharded, reference),
        "momentum": max(
            float((whole(m) - r).abs().max()) for m, r in zip(momentum, reference_momentum, strict=True)
        ),
        "momentum_rows": [[int(m.to_local().shape[0]), int(m.shape[0])] for m in momentum],
        "saved_momentum_equal": world.is_main
        and all(
            torch.equal(saved["state"][i]["momentum_buffer"], r) for i, r in enumerate(reference_momentum)
        ),
    }

    # a resume: fresh shards loaded from the whole weights and the whole optimizer state, as a checkpoint has them
    resumed = shard_module(model(), world)
    for param, value in zip(resumed.parameters(), reference.parameters(), strict=True):
        copy_whole_into(param, value.detach())
    resumed_muon = ShardedMuon(resumed.parameters(), **SETTINGS)
    load_whole_optimizer_state(resumed_muon, reference_muon.state_dict())
    step(reference, reference_muon, STEPS)
    step(resumed, resumed_muon, STEPS)
    report["resumed_weights"] = largest_difference(resumed, reference)
    if world.is_main:
        out.write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
