"""Whether the target may be loaded beside training for the in-training measurement (train.al_every): its
weights against the GPU's memory, with the GPU constructed here (a sparse weights file, a device of a given
size), so the rule is checked on a machine without one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3_core.steps.evaluation import TARGET_SHARE, target_crowds_training

GIB = 2**30


def _gpu(monkeypatch: pytest.MonkeyPatch, total: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: SimpleNamespace(total_memory=total))


def _weights(directory: Path, size: int) -> Path:
    directory.mkdir()
    with open(directory / "model-00001-of-00001.safetensors", "wb") as f:
        f.truncate(size)  # sparse: the size without the bytes
    return directory


def test_a_target_that_fits_beside_training_is_loaded_and_one_that_does_not_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _gpu(monkeypatch, 140 * GIB)
    small = _weights(tmp_path / "small", int(TARGET_SHARE * 140 * GIB) - 1)
    assert target_crowds_training(small) is None
    big = _weights(tmp_path / "big", 2000 * GIB)  # a 1T-parameter target in bf16
    reason = target_crowds_training(big)
    assert reason is not None and "2000.0 GiB" in reason and "140 GiB" in reason


def test_on_a_cpu_the_target_is_always_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert target_crowds_training(_weights(tmp_path / "big", 2000 * GIB)) is None
