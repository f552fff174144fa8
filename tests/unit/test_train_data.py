"""Batch planning, the validation split and checkpoints: the pieces that make a resumed run exact."""

import gc
import itertools
import math
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle3_core.config import TrainConfig
from eagle3_core.errors import ConfigError, Eagle3Error, ShardCorruptError
from eagle3_core.store.atomic import TEMP_MARK
from eagle3_core.store.shards import ShardWriter
from eagle3_core.train.checkpoint import latest_checkpoint, list_checkpoints, save_checkpoint
from eagle3_core.train.data import SampleRef, TrainingData, is_validation, plan_epoch, plan_validation
from eagle3_core.train.schedule import (
    AUTO_BUDGET_RANGE,
    AUTO_MIN_STEPS,
    batch_budget,
    check_batch_tokens,
    learning_rate,
    resolve_batch_tokens,
    schedule,
)


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


def _padded(refs: list[SampleRef], batch: list[int], max_len: int) -> int:
    return len(batch) * max(min(refs[i].length, max_len) for i in batch)


def test_every_batch_has_a_sample_for_each_rank_and_none_is_dropped() -> None:
    refs = [SampleRef(0, i, 300, f"{i:064x}") for i in range(301)]  # 37 full batches of 8, 5 left over
    batches = plan_epoch(refs, batch_tokens=2400, max_len=300, seed=0, epoch=0, min_batch=8)
    assert min(len(b) for b in batches) >= 8
    assert max(_padded(refs, b, 300) for b in batches) <= 2400
    seen = Counter(i for b in batches for i in b)
    assert set(seen) == set(range(301))
    assert sum(seen.values()) - 301 == 3  # the last batch is filled up from the one before


@pytest.mark.parametrize("min_batch", [1, 2, 3, 8])
@pytest.mark.parametrize("budget", [2048, 5000, 16384])
def test_no_batch_exceeds_the_token_budget(min_batch: int, budget: int) -> None:
    g = torch.Generator().manual_seed(budget + min_batch)
    lengths = torch.randint(1, 1200, (2500,), generator=g).tolist()  # > 1 chunk, some cut by max_len
    refs = [SampleRef(0, i, n, f"{i:064x}") for i, n in enumerate(lengths)]
    max_len = min(1000, budget // min_batch)
    for epoch in range(3):
        batches = plan_epoch(refs, budget, max_len, seed=5, epoch=epoch, min_batch=min_batch)
        assert max(_padded(refs, b, max_len) for b in batches) <= budget
        assert min(len(b) for b in batches) >= min_batch
        seen = Counter(i for b in batches for i in b)
        assert set(seen) == set(range(len(refs))) and sum(seen.values()) - len(refs) < min_batch


def test_an_epoch_has_as_many_steps_as_the_budget_gives() -> None:
    refs = [SampleRef(0, i, 300, f"{i:064x}") for i in range(2500)]  # cut to 256: 8 a batch
    assert len(plan_epoch(refs, 2048, 256, seed=0, epoch=0)) == math.ceil(2500 / 8)
    # 1024-token samples at batch_tokens 2048: 2 a step (a fixed minimum of 8 made it 8 a step, 8192 tokens)
    long = [SampleRef(0, i, 1024, f"{i:064x}") for i in range(100)]
    steps = schedule(long, TrainConfig(batch_tokens=2048, max_len=1024, epochs=2), world=2)
    assert len(steps) == 2 * 50 and all(len(b) == 2 for _, b in steps)


def test_one_and_two_processes_plan_the_same_global_batches() -> None:
    refs = _refs(700)  # up to 299 tokens
    for budget in (600, 2048):  # 2 samples of the longest fit, then 6
        cfg = TrainConfig(batch_tokens=budget, max_len=300, epochs=2, seed=3)
        one = schedule(refs, cfg, world=1)
        assert one == schedule(refs, cfg, world=2)
        assert min(len(b) for _, b in one) >= 2
        assert max(_padded(refs, b, 300) for _, b in one) <= budget


def test_a_sample_that_cannot_fit_once_per_process_is_refused_with_the_smallest_budget() -> None:
    refs = [*_refs(20), SampleRef(0, 20, 3000, "f" * 64)]
    with pytest.raises(ConfigError, match=r"train\.batch_tokens=2048 .* train\.batch_tokens >= 3000"):
        schedule(refs, TrainConfig(batch_tokens=2048, max_len=4096), world=1)
    with pytest.raises(ConfigError, match=r"train\.batch_tokens=2048 .* train\.batch_tokens >= 4000"):
        check_batch_tokens(refs, TrainConfig(batch_tokens=2048, max_len=2000), world=2)
    assert check_batch_tokens(refs, TrainConfig(batch_tokens=2048, max_len=1024), world=2) == 1024
    with pytest.raises(ValueError, match="within 2048 tokens"):
        plan_epoch(refs, 2048, 4096, seed=0, epoch=0)


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


def _shard(path: Path, lengths: list[int]) -> Path:
    with ShardWriter(
        path,
        sample_ids=[f"{path.stem}-{i}".ljust(64, "0") for i in range(len(lengths))],
        lengths=lengths,
        hidden_size=4,
        store_dtype="float32",
        metadata={},
    ) as w:
        for i, n in enumerate(lengths):
            ids, mask = torch.arange(n, dtype=torch.int32), torch.ones(n, dtype=torch.uint8)
            w.write_sample(i, ids, mask, torch.randn(n, 12), torch.randn(n, 4))
        w.finalize()
    return path


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_closing_while_a_tensor_views_a_shard_mapping_does_not_raise(tmp_path: Path) -> None:
    data = TrainingData([_shard(tmp_path / "a.safetensors", [5, 6])])
    reader = data.readers[0]
    view = torch.frombuffer(reader._raw("input_ids", 0, 5), dtype=torch.int32)
    mapping = weakref.ref(reader._mm)
    data.close()  # BufferError: cannot close exported pointers exist, before
    assert reader._file.closed and view.tolist() == [0, 1, 2, 3, 4]
    del view, reader
    gc.collect()
    assert mapping() is None  # unmapped with its last view


def test_an_error_while_loading_is_not_replaced_by_the_close_in_a_finally(tmp_path: Path) -> None:
    path = _shard(tmp_path / "a.safetensors", [5, 6, 7])
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0xFF  # in the last sample's hidden states
    path.write_bytes(bytes(blob))
    data = TrainingData([path])
    with pytest.raises(ShardCorruptError, match="fails its checksum") as raised:
        try:
            data.load_batch(data.refs, max_len=16)
        finally:
            data.close()  # the error's traceback still holds the copy's view of the mapping
    assert raised.value.__context__ is None


def _uniform(n: int, length: int) -> list[SampleRef]:
    return [SampleRef(0, i, length, f"{i:064x}") for i in range(n)]


@pytest.mark.parametrize(
    ("samples", "length", "epochs", "budget"),
    [
        (930, 340, 1, 1024),  # the benchmark's split: 316,200 tokens / 300 steps = 1,054
        (930, 340, 2, 2048),  # twice the tokens, twice the budget
        (100_000, 2000, 2, 16384),  # large data: the top of the range
        (40, 100, 1, 1024),  # tiny data: the bottom of the range
    ],
)
def test_auto_batch_tokens_is_the_largest_power_of_two_that_keeps_300_steps(
    samples: int, length: int, epochs: int, budget: int
) -> None:
    refs = _uniform(samples, length)
    cfg = TrainConfig(max_len=4096, epochs=epochs)
    assert cfg.batch_tokens == "auto"
    resolved = resolve_batch_tokens(cfg, refs, [], world=1)
    assert resolved.batch_tokens == budget and AUTO_BUDGET_RANGE[0] <= budget <= AUTO_BUDGET_RANGE[1]
    if AUTO_BUDGET_RANGE[0] < budget < AUTO_BUDGET_RANGE[1]:  # not clamped: the run keeps its steps
        assert len(schedule(refs, resolved, world=1)) >= AUTO_MIN_STEPS


def test_auto_batch_tokens_holds_the_longest_sample_once_per_rank_and_a_number_is_kept() -> None:
    train, val = _uniform(50, 100), [SampleRef(0, 99, 3000, "f" * 64)]
    cfg = TrainConfig(max_len=4096)
    assert resolve_batch_tokens(cfg, train, val, world=2).batch_tokens == 6000
    assert resolve_batch_tokens(cfg.model_copy(update={"max_len": 1000}), train, val, 2).batch_tokens == 2000
    explicit = TrainConfig(batch_tokens=512)
    assert resolve_batch_tokens(explicit, train, val, world=2) is explicit
    with pytest.raises(Eagle3Error, match="still auto"):
        batch_budget(cfg)
