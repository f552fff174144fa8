"""Muon over several ranks: each matrix orthogonalised once, by one rank, instead of on every rank.

torch.optim.Muon orthogonalises the update of every matrix (Newton-Schulz: five rounds of matrix products
in bfloat16) on every rank, so under DDP each rank repeats all of it: at Kimi-K2.5's widths about 120 TFLOP
a step, at least 0.12 s at an H200's dense bfloat16 peak, beside training steps of about a second at
16,384 tokens (not measured on GPUs yet). `DistributedMuon` gives each matrix an owner (the largest first,
each to the rank with the least work so far), which alone orthogonalises it; the ranks orthogonalise at
once, then each result is broadcast in bfloat16, as Muon makes it, and every rank applies it to its
weights: whole under DDP, its own rows under FSDP, where the update is gathered whole for the owner. On
2 CPU ranks the step is 1.9x faster (bench/muon_step.py).

The momentum stays where torch.optim.Muon keeps it (whole under DDP, each rank's shard under FSDP, under
the same state key), so a checkpoint moves between the two and between numbers of ranks. Every operation is
torch.optim.Muon's own, in its order, so the weights and momentum are Muon's bit for bit
(tests/integration/test_distributed_muon.py, against the installed torch).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from eagle3_core.train.sharding import shard_like, whole


def orthogonalised(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """The update's nearest semi-orthogonal matrix, roughly (Newton-Schulz, Jordan et al. 2024), in bfloat16:
    torch.optim.Muon's iteration, operation for operation."""
    a, b, c = coefficients
    x = update.bfloat16()
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T  # [short, long]: the Gram matrix is the smaller one
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate torch.optim.Muon applies to a matrix of `shape` (its `adjust_lr_fn`)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def newton_schulz_work(shape: torch.Size) -> int:
    """Multiply-adds of one Newton-Schulz round on a matrix of `shape`, up to a constant: 2 m^2 n + m^3."""
    short, long = sorted(shape[:2])
    return 2 * short * short * long + short**3


def owners(shapes: list[torch.Size], ranks: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the least loaded rank (the same
    on every rank: it depends on the shapes alone)."""
    load, owner = [0] * ranks, [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-newton_schulz_work(shapes[i]), i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + newton_schulz_work(shapes[i])
    return owner


class DistributedMuon(torch.optim.Muon):
    """torch.optim.Muon whose orthogonalisations are shared out over the default process group's ranks (the
    module docstring). On one rank it is torch.optim.Muon."""

    def __init__(self, params: Iterable[nn.Parameter], **settings: Any) -> None:
        super().__init__(params, **settings)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.ranks = dist.get_world_size() if distributed else 1
        matrices = [p for group in self.param_groups for p in group["params"]]
        self.owner = dict(zip(matrices, owners([p.shape for p in matrices], self.ranks), strict=True))
        self.orthogonalised_here = 0  # matrices this rank has orthogonalised, over all steps

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:  # as torch's optimizers take one: the loss, computed again
            with torch.enable_grad():
                loss = closure()
        # in passes, so that the ranks orthogonalise at once: had each matrix been orthogonalised and
        # broadcast in turn, every rank would wait for each owner in turn, and the work would not be shared
        matrices = [
            (param, group)
            for group in self.param_groups
            for param in group["params"]
            if param.grad is not None  # alike on every rank: DDP and FSDP average every gradient
        ]
        owned = self._owned_updates(matrices)
        orthogonal = {
            param: orthogonalised(owned.pop(param), group["ns_coefficients"], group["ns_steps"], group["eps"])
            for param, group in matrices
            if param in owned
        }
        self.orthogonalised_here += len(orthogonal)
        for param, group in matrices:
            self._apply(param, self._from_owner(param, orthogonal.pop(param, None)), group)
        return loss

    def _owned_updates(
        self, matrices: list[tuple[torch.Tensor, dict[str, Any]]]
    ) -> dict[torch.Tensor, torch.Tensor]:
        """Every matrix's momentum stepped, and the whole updates of those this rank orthogonalises. Under
        FSDP each update is gathered whole, a collective every rank takes part in, and kept by its owner."""
        owned = {}
        for param, group in matrices:
            assert param.grad is not None
            update = whole(self._momentum(param, param.grad, group))
            if self.owner[param] == self.rank:
                owned[param] = update
        return owned

    def _momentum(self, param: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The momentum-smoothed update, whole or this rank's shard as `param` is (Nesterov's by default)."""
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
        buffer = state["momentum_buffer"]
        buffer.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer

    def _from_owner(self, param: torch.Tensor, orthogonal: torch.Tensor | None) -> torch.Tensor:
        """The whole orthogonalised update [rows, cols] in bfloat16, on every rank: its owner's, broadcast."""
        if orthogonal is None:
            orthogonal = torch.empty(param.shape, dtype=torch.bfloat16, device=param.device)
        orthogonal = orthogonal.contiguous()
        if self.ranks > 1:
            dist.broadcast(orthogonal, src=self.owner[param])
        return orthogonal

    def _apply(self, param: torch.Tensor, orthogonal: torch.Tensor, group: dict[str, Any]) -> None:
        lr = group["lr"]
        weights = param.to_local() if isinstance(param, DTensor) else param
        weights.mul_(1 - lr * group["weight_decay"])
        rows = shard_like(param, orthogonal)  # this rank's rows under FSDP, in bfloat16 as Muon adds them
        rows = rows.to_local() if isinstance(rows, DTensor) else rows
        weights.add_(rows, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
