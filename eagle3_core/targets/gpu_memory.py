"""Giving the GPUs back: a run that held the target must not end while its memory is still reserved.

Extraction and training share the `gpu` pool one run at a time, so the next run starts as soon as this one
ends; memory still cached by this process's allocator (or held by a tensor someone kept) would make that
run fail with out-of-memory on a GPU that looks free. `release_gpu_memory` collects garbage, empties the
allocator's cache, and waits until this process holds no GPU memory, or says what is still held. The CUDA
context itself (a few hundred MB) goes with the process, which ends with the run.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch

from eagle3_core.errors import Eagle3Error


class GpuMemoryNotReleased(Eagle3Error):
    """GPU memory was still held when a run was about to give its GPUs back."""


def held_bytes() -> int:
    """GPU memory reserved by this process's PyTorch allocator, over every visible device."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    return sum(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count()))


def _empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        # cuBLAS keeps its workspaces in the caching allocator, and empty_cache alone leaves them reserved
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


def release_gpu_memory(
    timeout_s: float = 60.0,
    poll_s: float = 0.25,
    probe: Callable[[], int] = held_bytes,
    free: Callable[[], None] = _empty_cache,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Free and wait until `probe()` reports 0 bytes held; the seconds waited. Raises after `timeout_s`."""
    start = clock()
    while True:
        free()
        held = probe()
        if held == 0:
            return clock() - start
        if clock() - start >= timeout_s:
            raise GpuMemoryNotReleased(
                f"{held / 2**20:.0f} MiB of GPU memory still held {timeout_s:.0f} s after the target was "
                "released: a tensor on the GPU is still referenced, so the next run in the `gpu` pool would "
                "not get it; the run fails here instead"
            )
        sleep(poll_s)
