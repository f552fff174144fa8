"""FSDP2 (train.sharding: fsdp): the drafter's weights, gradients and optimizer state sharded over the ranks
with torch's `fully_shard`, and saved and loaded whole, so that a checkpoint does not depend on the sharding
(a run saved under FSDP resumes under DDP, on another number of ranks, and the other way).

The unit sharded is the TTT loss module as a whole (the drafter and the loss that reads its head's weight):
its parameters rest sharded, one shard a rank, and are gathered for the forward and again for the backward;
gradients are reduce-scattered, averaged as DDP averages them; AdamW's moments live on each rank's shard.
Muon orthogonalises the update of a whole matrix (Newton-Schulz over its singular values), which a row shard
cannot do: run on the shards it gives another update (15% off on a 96x64 matrix over two ranks, against 1.5%
for bfloat16's own rounding). So Muon (train/muon.py, DistributedMuon) keeps its momentum on each rank's
shard, as AdamW's moments are, gathers each matrix's update whole on the one rank that orthogonalises it,
and each rank applies its rows of the result.

Every function here that gathers is a collective: each rank calls it, in the same order. What is
gathered to be saved goes to rank 0's host memory, one tensor at a time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from eagle3_core.train.distributed import World


def shard_module(module: nn.Module, world: World) -> nn.Module:
    """`module` sharded in place over the world's ranks (one FSDP unit), and returned."""
    mesh = init_device_mesh(world.device.type, (world.size,))
    # resharded after every forward, the root too (its default keeps a root's weights gathered for the
    # backward): a validation forward, which has no backward, would otherwise leave them gathered
    fully_shard(module, mesh=mesh, reshard_after_forward=True)
    return module


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (gathered from every rank), or the tensor itself when it is not sharded."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def on_lead_cpu(tensor: torch.Tensor, world: World) -> torch.Tensor | None:
    """The whole of `tensor` in rank 0's host memory (None on the other ranks): gathered one tensor at a time,
    so a device holds one whole tensor beside its shards, never the whole model and its state."""
    gathered = whole(tensor)
    return gathered.cpu() if world.is_main else None


def whole_state(tensors: dict[str, torch.Tensor], world: World) -> dict[str, torch.Tensor]:
    """`tensors` whole, in rank 0's host memory; empty on the other ranks."""
    kept = {name: on_lead_cpu(t, world) for name, t in tensors.items()}
    return {name: t for name, t in kept.items() if t is not None}


def shard_like(like: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value`, a whole tensor every rank holds alike, as `like` is laid out: this rank's shard of it, on
    `like`'s device in `value`'s dtype, when `like` is sharded (no communication), else `value` itself."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def copy_whole_into(param: torch.Tensor, value: torch.Tensor) -> None:
    """`param` (sharded or not) set from the whole `value`."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            shard = shard_like(param, value)
            assert isinstance(shard, DTensor)  # laid out as `param` is
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(value)


def whole_optimizer_state(optimizer: torch.optim.Optimizer, world: World) -> dict[str, Any]:
    """The optimizer's state_dict with every state tensor gathered whole into rank 0's host memory (the
    format DDP saves); empty on the other ranks."""
    saved = optimizer.state_dict()
    state = {
        i: {k: on_lead_cpu(v, world) if torch.is_tensor(v) else v for k, v in entry.items()}
        for i, entry in saved["state"].items()
    }
    return {"state": state, "param_groups": saved["param_groups"]} if world.is_main else {}


def load_whole_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """A whole optimizer state (as `whole_optimizer_state` or DDP saved it) loaded into an optimizer whose
    parameters may be sharded: each state tensor of a parameter's shape is cut to that parameter's shard."""
    params = [p for group in optimizer.param_groups for p in group["params"]]

    def placed(i: int, value: Any) -> Any:
        param = params[i]
        if torch.is_tensor(value) and isinstance(param, DTensor) and value.shape == param.shape:
            return shard_like(param, value)
        return value

    state = {i: {k: placed(int(i), v) for k, v in s.items()} for i, s in saved["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": saved["param_groups"]})
