"""Batch planning, the validation split and checkpoints: the pieces that make a resumed run exact."""

import itertools
from pathlib import Path

import torch

from eagle3_core.config import TrainConfig
from eagle3_core.store.atomic import TEMP_MARK
from eagle3_core.train.checkpoint import latest_checkpoint, list_checkpoints, save_checkpoint
from eagle3_core.train.data import SampleRef, is_validation, plan_epoch, plan_validation
from eagle3_core.train.trainer import learning_rate


def _refs(n: int, seed: int = 0) -> list[SampleRef]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(5, 300, (n,), generator=g).tolist()
    return [SampleRef(i % 3, i, length, f"{i:064x}") for i, length in enumerate(lengths)]


def test_an_epoch_takes_every_sample_once_within_the_token_budget() -> None:
    refs = _refs(500)
    batches = plan_epoch(refs, batch_tokens=1024, max_len=256, seed=1, epoch=0)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(500))
    for b in batches:
        padded = len(b) * max(min(refs[i].length, 256) for i in b)
        assert padded <= 1024 or len(b) == 1


def test_plans_are_fixed_by_seed_and_epoch() -> None:
    refs = _refs(300)
    a = plan_epoch(refs, 2048, 256, seed=3, epoch=1)
    assert a == plan_epoch(refs, 2048, 256, seed=3, epoch=1)
    assert a != plan_epoch(refs, 2048, 256, seed=3, epoch=2)
    assert a != plan_epoch(refs, 2048, 256, seed=4, epoch=1)


def test_every_batch_has_a_sample_for_each_rank_and_none_is_dropped() -> None:
    refs = _refs(301)
    batches = plan_epoch(refs, batch_tokens=300, max_len=300, seed=0, epoch=0, min_batch=8)
    assert min(len(b) for b in batches) >= 8
    assert sorted(i for b in batches for i in b) == list(range(301))


def test_batches_group_similar_lengths() -> None:
    refs = _refs(1000)
    batches = plan_epoch(refs, 4096, 512, seed=0, epoch=0)
    padded = sum(len(b) * max(refs[i].length for i in b) for b in batches)
    assert padded < 1.15 * sum(r.length for r in refs)  # random batches would pad ~2x


def test_validation_batches_cover_the_split_in_a_fixed_order() -> None:
    refs = _refs(50)
    batches = plan_validation(refs, 1000, 256)
    assert sorted(i for b in batches for i in b) == list(range(50))
    assert batches == plan_validation(refs, 1000, 256)


def test_the_validation_split_is_fixed_by_sample_id_and_near_its_fraction() -> None:
    ids = [f"{i:064x}" for i in range(20000)]
    chosen = [s for s in ids if is_validation(s, 0.05)]
    assert 0.04 < len(chosen) / len(ids) < 0.06
    assert chosen == [s for s in ids if is_validation(s, 0.05)]
    assert not any(is_validation(s, 0.0) for s in ids[:100])


def test_learning_rate_warms_up_then_decays_to_zero() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_ratio=0.1)
    lrs = [learning_rate(s, 100, cfg) for s in range(100)]
    assert lrs[0] == 1e-4 and abs(lrs[9] - 1e-3) < 1e-12
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))
    assert lrs[-1] < 1e-5


def test_checkpoints_are_whole_or_absent_and_pruned(tmp_path: Path) -> None:
    w = {"fc.weight": torch.randn(3, 4)}
    opt = {
        "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(3, 4)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, w, opt, {"tokens": step}, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]
    (tmp_path / "checkpoints" / f"step-00000040{TEMP_MARK}999").mkdir()  # a save that died half-way
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 30 and ckpt.state["tokens"] == 30
    assert torch.equal(ckpt.weights["fc.weight"], w["fc.weight"])
    assert torch.equal(ckpt.optimizer["state"][0]["exp_avg"], opt["state"][0]["exp_avg"])
    assert ckpt.optimizer["param_groups"] == opt["param_groups"]
    save_checkpoint(tmp_path, 40, w, opt, {"tokens": 40}, keep=2)
    assert not any(TEMP_MARK in p.name for p in (tmp_path / "checkpoints").iterdir())
