"""One rank of two (gloo, under torchrun): DistributedMuon beside torch's Muon on the same losses, over
FSDP's row shards and over whole matrices as under DDP. `python -m torch.distributed.run --standalone
--nproc-per-node 2 tests/distributed_muon_ranks.py OUT.json`; rank 0 writes what the test asserts to OUT.json.

Every rank computes the same loss, so FSDP's averaged gradient is each rank's own gradient exactly, and
every optimizer sees the same gradients bit for bit. The last matrix has 7 rows, which two ranks cannot
split evenly."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from eagle3_core.train.distributed import init_world
from eagle3_core.train.muon import DistributedMuon
from eagle3_core.train.sharding import (
    copy_whole_into,
    load_whole_optimizer_state,
    shard_module,
    whole,
    whole_optimizer_state,
)

FSDP_SETTINGS: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
DDP_SETTINGS: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "nesterov": False}  # torch's other branches
STEPS = 3  # then a resume from the whole state, and one more step


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 96, bias=False), nn.Tanh(), nn.Linear(96, 96, bias=False), nn.Tanh(),
        nn.Linear(96, 7, bias=False),
    )  # fmt: skip


def step(module: nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    inputs = torch.randn(16, 64, generator=torch.Generator().manual_seed(n))
    module(inputs).square().mean().backward()
    for group in optimizer.param_groups:
        group["lr"] = 0.02 * (n + 1)  # as the schedule sets it, step by step
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def largest_difference(ours: list[torch.Tensor], torchs: list[torch.Tensor]) -> float:
    return max(float((whole(a) - b).abs().max()) for a, b in zip(ours, torchs, strict=True))


def momentum(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[torch.Tensor]:
    return [optimizer.state[p]["momentum_buffer"] for p in module.parameters()]


def weights(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach() for p in module.parameters()]


def per_rank(value: int) -> list[int]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def fsdp(world: Any) -> dict[str, Any]:
    reference = model()
    reference_muon = torch.optim.Muon(reference.parameters(), **FSDP_SETTINGS)
    sharded = shard_module(model(), world)
    ours = DistributedMuon(sharded.parameters(), **FSDP_SETTINGS)
    for n in range(STEPS):
        step(reference, reference_muon, n)
        step(sharded, ours, n)
    saved = whole_optimizer_state(ours, world)
    report = {
        "weights": largest_difference(weights(sharded), weights(reference)),
        "momentum": largest_difference(momentum(ours, sharded), momentum(reference_muon, reference)),
        "momentum_rows": [[int(m.to_local().shape[0]), int(m.shape[0])] for m in momentum(ours, sharded)],
        "saved_momentum_equal": world.is_main
        and all(
            torch.equal(saved["state"][i]["momentum_buffer"], m)
            for i, m in enumerate(momentum(reference_muon, reference))
        ),
        "orthogonalised": per_rank(ours.orthogonalised_here),
    }
    # a resume: fresh shards loaded from the whole weights and optimizer state, as a checkpoint has them
    resumed = shard_module(model(), world)
    for param, value in zip(resumed.parameters(), weights(reference), strict=True):
        copy_whole_into(param, value)
    resumed_muon = DistributedMuon(resumed.parameters(), **FSDP_SETTINGS)
    load_whole_optimizer_state(resumed_muon, reference_muon.state_dict())
    step(reference, reference_muon, STEPS)
    step(resumed, resumed_muon, STEPS)
    report["resumed_weights"] = largest_difference(weights(resumed), weights(reference))
    return report


def ddp() -> dict[str, Any]:
    """Whole matrices on every rank, their gradients alike on every rank (as DDP's averaging leaves them)."""
    reference, replica = model(), model()
    reference_muon = torch.optim.Muon(reference.parameters(), **DDP_SETTINGS)
    ours = DistributedMuon(replica.parameters(), **DDP_SETTINGS)
    for n in range(STEPS):
        step(reference, reference_muon, n)
        step(replica, ours, n)
    return {
        "weights": largest_difference(weights(replica), weights(reference)),
        "momentum": largest_difference(momentum(ours, replica), momentum(reference_muon, reference)),
        "orthogonalised": per_rank(ours.orthogonalised_here),
    }


def main(out: Path) -> None:
    world = init_world("cpu")
    report = {"fsdp": fsdp(world), "ddp": ddp()}
    if world.is_main:
        out.write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
