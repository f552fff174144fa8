"""A run gives its GPUs back before it ends: memory is freed and waited for, or the run fails saying so."""

import pytest

from eagle3_core.targets.gpu_memory import GpuMemoryNotReleased, held_bytes, release_gpu_memory


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_waits_until_the_allocator_holds_nothing() -> None:
    held = [3 << 30, 1 << 30, 0]  # what the probe reads after each free
    frees: list[int] = []
    clock = FakeClock()
    waited = release_gpu_memory(
        timeout_s=10,
        poll_s=0.5,
        probe=lambda: held.pop(0),
        free=lambda: frees.append(1),
        clock=clock,
        sleep=clock.sleep,
    )
    assert waited == 1.0 and len(frees) == 3 and held == []


def test_memory_still_referenced_fails_with_the_amount() -> None:
    clock = FakeClock()
    with pytest.raises(GpuMemoryNotReleased, match=r"512 MiB of GPU memory still held 2 s after"):
        release_gpu_memory(
            timeout_s=2,
            poll_s=0.5,
            probe=lambda: 512 << 20,
            free=lambda: None,
            clock=clock,
            sleep=clock.sleep,
        )
    assert clock.now == 2.0


def test_without_a_gpu_nothing_is_held_and_nothing_waits() -> None:
    assert held_bytes() == 0
    release_gpu_memory(timeout_s=0)  # would raise if the probe read anything held
