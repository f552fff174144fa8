"""One process or many: the rank, the world and the device, from torchrun's environment when it set one."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NoReturn, TypeVar

import torch
import torch.distributed as dist

from eagle3_core.errors import Eagle3Error

T = TypeVar("T")


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor summed over ranks (in place), or itself on one process."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def max(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor's most over ranks (in place), or itself on one process."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def from_main(self, value: int) -> int:
        """Rank 0's `value`, on every rank (what the other ranks pass is ignored): a decision rank 0 took alone."""
        if not self.distributed:
            return value
        shared = torch.tensor([value if self.is_main else 0], dtype=torch.int64, device=self.device)
        return int(self.sum(shared).item())


def on_main(world: World, what: str, fn: Callable[[], T]) -> T | None:
    """`fn()` on rank 0 (None on the other ranks, which wait for it). When it raises, every rank raises: rank 0
    its error, the others an Eagle3Error saying rank 0 stopped while `what`, so that no rank waits forever in
    a collective for a rank that has stopped."""
    if world.is_main:
        try:
            result = fn()
        except BaseException:
            world.from_main(1)
            raise
        world.from_main(0)
        return result
    if world.from_main(0):
        raise Eagle3Error(f"rank 0 stopped while {what} (its error says why)")
    return None


def pick_device(preference: Literal["auto", "cpu", "cuda"], local_rank: int = 0) -> torch.device:
    if preference == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device is 'cuda' but torch sees no GPU")
    if preference == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def init_world(preference: Literal["auto", "cpu", "cuda"]) -> World:
    """Join the process group torchrun describes (NCCL on GPUs, gloo on CPU), or run alone."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(preference, local_rank)
    if size == 1:
        return World(0, 1, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if device.type == "cuda":  # bound to this rank's GPU: collectives never guess the device
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return World(dist.get_rank(), dist.get_world_size(), device)


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int) -> NoReturn:
    """End a torchrun worker whose work is written (or whose error is printed) without the interpreter's
    finalization. A process group that DDP's or FSDP's state still references outlives
    destroy_process_group, and destroyed during finalization with gloo's threads alive it can abort the
    process (SIGABRT, "terminate called without an active exception": once in this project's CI, after an
    FSDP run had finished and written its result), which torchrun reports as a failed run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
