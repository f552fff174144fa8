"""Batch planning, the validation split and checkpoints: the pieces that make a resumed run exact."""

import gc
import itertools
import math
import weakref
from collections import Counter
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from eagle3_core.config import TrainConfig
from eagle3_core.errors import ConfigError, Eagle3Error, ShardCorruptError
from eagle3_core.store.atomic import TEMP_MARK
from eagle3_core.store.records import conversation_id, reply_id
from eagle3_core.store.shards import ShardWriter
from eagle3_core.train.checkpoint import list_checkpoints, resume_checkpoint, save_checkpoint
from eagle3_core.train.data import (
    SampleRef,
    TrainingData,
    is_validation,
    plan_epoch,
    plan_packed_epoch,
    plan_packed_validation,
    plan_validation,
)
from eagle3_core.train.schedule import (
    AUTO_BUDGET_RANGE,
    AUTO_MIN_STEPS,
    batch_budget,
    check_batch_tokens,
    learning_rate,
    resolve_batch_tokens,
    resolve_batching,
    row_width,
    schedule,
)
from tests.records import run_progress


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
    steps = schedule(long, TrainConfig(batch_tokens=2048, max_len=1024, epochs=2, batching="pad"), world=2)
    assert len(steps) == 2 * 50 and all(len(b) == 2 for _, b in steps)


def test_one_and_two_processes_plan_the_same_global_batches() -> None:
    refs = _refs(700)  # up to 299 tokens
    for budget in (600, 2048):  # 2 samples of the longest fit, then 6
        cfg = TrainConfig(batch_tokens=budget, max_len=300, epochs=2, seed=3, batching="pad")
        one = schedule(refs, cfg, world=1)
        assert one == schedule(refs, cfg, world=2)
        assert all(len(row) == 1 for _, b in one for row in b)  # padded: a sample per row
        assert min(len(b) for _, b in one) >= 2
        assert max(_padded(refs, [i for (i,) in b], 300) for _, b in one) <= budget


def test_a_sample_that_cannot_fit_once_per_process_is_refused_with_the_smallest_budget() -> None:
    refs = [*_refs(20), SampleRef(0, 20, 3000, "f" * 64)]
    with pytest.raises(ConfigError, match=r"train\.batch_tokens=2048 .* train\.batch_tokens >= 3000"):
        schedule(refs, TrainConfig(batch_tokens=2048, max_len=4096, batching="pad"), world=1)
    with pytest.raises(ConfigError, match=r"train\.batch_tokens=2048 .* train\.batch_tokens >= 4000"):
        check_batch_tokens(refs, TrainConfig(batch_tokens=2048, max_len=2000, batching="pad"), world=2)
    padded = TrainConfig(batch_tokens=2048, max_len=1024, batching="pad")
    assert check_batch_tokens(refs, padded, world=2) == 1024
    # packed: a row per process of 2048 / 2 entries holds 1024; 1000 tokens need rows of 1024 (8 x 128)
    with pytest.raises(
        ConfigError, match=r"packed row per process holds 896, .* train\.batch_tokens >= 2048"
    ):
        check_batch_tokens(refs, TrainConfig(batch_tokens=2000, max_len=1000, batching="pack"), world=2)
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


@pytest.mark.parametrize("batches", [1, 3, 4, 5])
def test_under_fsdp_every_rank_runs_as_many_validation_forwards_and_each_batch_is_measured_once(
    batches: int,
) -> None:
    """FSDP gathers the weights in every forward: a rank dealt fewer validation batches than another would wait
    forever at the other's extra forward (seen: 2 ranks, 1 batch). Each rank runs as many as the most dealt,
    and the extra ones are not measured; DDP's ranks run what they are dealt."""
    from eagle3_core.train.trainer import rank_validation_batches

    plan = [[[i]] for i in range(batches)]
    for world in (1, 2, 4):
        sharded = [rank_validation_batches(plan, r, world, sharded=True) for r in range(world)]
        assert len({len(run) for run, _ in sharded}) == 1, (batches, world)
        measured = [b for run, n in sharded for b in run[:n]]
        assert sorted(measured) == plan  # each batch measured once, by one rank
        assert [rank_validation_batches(plan, r, world, sharded=False) for r in range(world)] == [
            (plan[r::world], len(plan[r::world])) for r in range(world)
        ]


def test_the_validation_split_is_fixed_by_sample_id_and_near_its_fraction() -> None:
    ids = [f"{i:064x}" for i in range(20000)]
    chosen = [s for s in ids if is_validation(s, 0.05)]
    assert 0.04 < len(chosen) / len(ids) < 0.06
    assert chosen == [s for s in ids if is_validation(s, 0.05)]
    assert not any(is_validation(s, 0.0) for s in ids[:100])


def test_every_reply_to_a_conversation_falls_on_the_side_of_the_split_its_conversation_does(
    tmp_path: Path,
) -> None:
    """regenerate.samples: a conversation's replies are samples of their own (`<id>~r`). Split by sample id,
    validation would measure replies to prompts the drafter trained on; split by conversation id, and capped in
    whole conversations, it never does."""
    conversations = [f"{i:064x}" for i in range(40)]
    ids = [reply_id(c, r) for c in conversations for r in range(3)]
    assert [is_validation(i, 0.3) for i in ids] == [is_validation(conversation_id(i), 0.3) for i in ids]
    held = [c for c in conversations if is_validation(c, 0.3)]
    assert 2 <= len(held) < len(conversations)  # both sides are there: the test can tell

    path = tmp_path / "train-00000.safetensors"
    with ShardWriter(path, sample_ids=ids, lengths=[4] * len(ids), hidden_size=4) as w:
        for i in range(len(ids)):
            w.write_sample(i, torch.arange(4, dtype=torch.int32), torch.ones(4, dtype=torch.uint8),
                           torch.zeros(4, 12), torch.zeros(4, 4))  # fmt: skip
        w.finalize()
    data = TrainingData([path])
    try:
        # uncapped; capped inside the third conversation; one conversation's worth
        for max_val in (512, 7, 3):
            train, val = data.split(0.3, max_val)
            sides = {conversation_id(r.sample_id) for r in val}, {conversation_id(r.sample_id) for r in train}
            assert not sides[0] & sides[1]  # no conversation on both sides
            assert sorted(r.sample_id for r in train + val) == sorted(ids)  # every sample on one side
            assert all(sum(conversation_id(r.sample_id) == c for r in val) == 3 for c in sides[0])  # whole
            assert len(val) == min(len(held), max_val // 3) * 3 and sides[0] <= set(held)
    finally:
        data.close()


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_learning_rate_warms_up_then_decays_to_zero(schedule: Literal["cosine", "linear"]) -> None:
    cfg = TrainConfig(lr=1e-3, warmup_ratio=0.1, schedule=schedule)
    lrs = [learning_rate(s, 100, cfg) for s in range(100)]
    assert lrs[0] == 1e-4 and abs(lrs[9] - 1e-3) < 1e-12
    assert lrs[10] == lrs[9] and all(a > b for a, b in itertools.pairwise(lrs[10:]))
    # the last step is one step short of zero: 1/90 of the peak on the line, far less on the cosine
    assert lrs[-1] == pytest.approx(1e-3 / 90) if schedule == "linear" else lrs[-1] < 1e-6


def test_a_constant_learning_rate_warms_up_then_stays_at_lr() -> None:
    cfg = TrainConfig(lr=1e-3, warmup_ratio=0.1, schedule="constant")
    lrs = [learning_rate(s, 100, cfg) for s in range(100)]
    assert lrs[0] == 1e-4 and all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert lrs[9:] == [1e-3] * 91


def test_checkpoints_are_whole_or_absent_and_pruned(tmp_path: Path) -> None:
    w = {"fc.weight": torch.randn(3, 4)}
    opt = {
        "state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.randn(3, 4)}},
        "param_groups": [{"lr": 0.1, "params": [0]}],
    }
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, w, opt, run_progress(step), keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]
    (tmp_path / "checkpoints" / f".step-00000040{TEMP_MARK}999").mkdir()  # a save that died half-way
    said: list[str] = []
    ckpt = resume_checkpoint(tmp_path, said.append)
    assert ckpt is not None and ckpt.step == 30 and ckpt.verified and said == [] and ckpt.state.tokens == 30
    assert torch.equal(ckpt.weights["fc.weight"], w["fc.weight"])
    assert torch.equal(ckpt.optimizer["state"][0]["exp_avg"], opt["state"][0]["exp_avg"])
    assert ckpt.optimizer["param_groups"] == opt["param_groups"]
    save_checkpoint(tmp_path, 40, w, opt, run_progress(40), keep=2)
    assert not any(TEMP_MARK in p.name for p in (tmp_path / "checkpoints").iterdir())


def _shard(path: Path, lengths: list[int]) -> Path:
    with ShardWriter(
        path,
        sample_ids=[f"{path.stem}-{i}".ljust(64, "0") for i in range(len(lengths))],
        lengths=lengths,
        hidden_size=4,
        store_dtype="float32",
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
        (100_000, 2000, 2, 8192),  # large data: the top of the range
        (40, 100, 1, 1024),  # tiny data: the bottom of the range
    ],
)
def test_auto_batch_tokens_is_the_largest_power_of_two_that_keeps_300_steps(
    samples: int, length: int, epochs: int, budget: int
) -> None:
    refs = _uniform(samples, length)
    cfg = TrainConfig(max_len=4096, epochs=epochs, batching="pad")
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


# ---- packed batches -------------------------------------------------------------------------------------------
def test_a_packed_epoch_takes_every_sample_once_in_full_rows_of_the_width() -> None:
    refs = _refs(1500)  # 5..299 tokens, more than one packing chunk
    width, cut = 2048, 256
    for world in (1, 2, 3):
        batches = plan_packed_epoch(refs, width, world, cut, seed=2, epoch=0)
        assert all(len(b) == world for b in batches)
        rows = [row for b in batches for row in b]
        assert sorted(i for row in rows for i in row) == list(range(1500))
        filled = [sum(min(refs[i].length, cut) for i in row) for row in rows]
        assert max(filled) <= width
        # first fit, longest first: all but the last rows of each chunk are nearly full
        assert sum(filled) / (len(rows) * width) > 0.95
        real = [row for row in rows if row]
        assert len(rows) - len(real) == -len(real) % world  # only the last batch is topped up
        assert all(all(b) for b in batches[:-1])
    assert plan_packed_epoch(refs, width, 1, cut, 2, 0) == plan_packed_epoch(refs, width, 1, cut, 2, 0)
    assert plan_packed_epoch(refs, width, 1, cut, 2, 0) != plan_packed_epoch(refs, width, 1, cut, 2, 1)
    with pytest.raises(ValueError, match="up to 299 tokens into rows of 256"):
        plan_packed_epoch(refs, 256, 1, 300, 0, 0)


def test_a_packed_schedule_gives_each_process_one_row_of_its_share() -> None:
    refs = _refs(400)
    cfg = TrainConfig(batch_tokens=2000, max_len=300, epochs=2, seed=1, batching="pack")
    assert row_width(cfg, 1) == 1920 and row_width(cfg, 2) == 896  # down to multiples of 128
    for world in (1, 2):
        steps = schedule(refs, cfg, world)
        assert [e for e, _ in steps] == sorted(e for e, _ in steps)
        for epoch in (0, 1):
            rows = [row for e, b in steps if e == epoch for row in b]
            assert sorted(i for row in rows for i in row) == list(range(400))
        assert all(len(b) == world for _, b in steps)
        assert max(sum(min(refs[i].length, 300) for i in row) for _, b in steps for row in b) <= row_width(
            cfg, world
        )
    with pytest.raises(Eagle3Error, match="batching is still auto"):
        schedule(refs, TrainConfig(batch_tokens=2000), 1)


def test_auto_batching_packs_under_flex_attention_and_pads_under_sdpa() -> None:
    cfg = TrainConfig()
    assert resolve_batching(cfg, "flex").batching == "pack"
    assert resolve_batching(cfg, "sdpa").batching == "pad"
    explicit = TrainConfig(batching="pad")
    assert resolve_batching(explicit, "flex") is explicit


def test_packed_validation_rows_cover_the_split_in_a_fixed_order() -> None:
    refs = _refs(60)
    batches = plan_packed_validation(refs, 1024, 256)
    assert all(len(b) == 1 for b in batches)
    assert sorted(i for (row,) in batches for i in row) == list(range(60))
    assert max(sum(min(refs[i].length, 256) for i in row) for (row,) in batches) <= 1024
    assert batches == plan_packed_validation(refs, 1024, 256)


def test_a_packed_row_holds_its_samples_back_to_back_then_zeros(tmp_path: Path) -> None:
    lengths = [7, 3, 5]
    path = tmp_path / "train-00000.safetensors"
    with ShardWriter(path, sample_ids=[f"{i:064x}" for i in range(3)], lengths=lengths, hidden_size=4) as w:
        for i, n in enumerate(lengths):
            ids = torch.arange(n, dtype=torch.int32) + 100 * (i + 1)
            states = torch.full((n, 16), float(i + 1))
            w.write_sample(i, ids, torch.ones(n, dtype=torch.uint8), states[:, :12], states[:, 12:])
        w.finalize()
    data = TrainingData([path])
    try:
        refs = data.refs
        batch = data.load_rows([[refs[0], refs[2]], [refs[1]], []], max_len=6, width=16)
        assert batch.tokens == 6 + 5 + 3 and batch.packing is not None
        assert batch.input_ids[0, :11].tolist() == [100, 101, 102, 103, 104, 105, 300, 301, 302, 303, 304]
        assert batch.packing.doc[0].tolist() == [0] * 6 + [1] * 5 + [2] * 5  # padding: one more sample
        assert batch.packing.positions[0, :11].tolist() == [*range(6), *range(5)]
        assert batch.input_ids[1, :3].tolist() == [200, 201, 202] and batch.packing.doc[1, 3:].eq(1).all()
        assert batch.aux[0, 6:11].eq(3).all() and batch.last[0, :6].eq(1).all()
        for row, used in ((0, 11), (1, 3), (2, 0)):
            assert not batch.input_ids[row, used:].any() and not batch.loss_mask[row, used:].any()
            assert not batch.aux[row, used:].any() and not batch.last[row, used:].any()
        padded = data.load_batch([refs[0], refs[1]], max_len=6)
        assert padded.packing is None and padded.input_ids.shape == (2, 6)
    finally:
        data.close()


def test_the_second_looks_size_is_no_part_of_the_runs_identity() -> None:
    """train.al_confirm_prompts is read once, at the last step's choice: a run resumed with another value (or
    by an eagle3 from before it) is the same run; the probe's own size, which every measurement reads, is not."""
    from types import SimpleNamespace

    from eagle3_core.draft.model import DrafterConfig
    from eagle3_core.train.run_dir import run_id

    drafter = DrafterConfig(
        target_hidden_size=16, hidden_size=16, intermediate_size=32, num_heads=2, num_kv_heads=1,
        target_vocab_size=64, draft_vocab_size=32,
    )  # fmt: skip
    mapping = SimpleNamespace(fingerprint="mapping")

    def identity(**train: object) -> str:
        return run_id(TrainConfig().model_copy(update=train), mapping, "target", drafter)  # type: ignore[arg-type]

    assert identity(al_confirm_prompts=0) == identity() == identity(al_confirm_prompts=64)
    assert identity(al_prompts=4) != identity()


@pytest.mark.parametrize("batching", ["pad", "pack"])
def test_max_steps_plans_only_the_epochs_it_reaches_and_the_same_batches(
    batching: Literal["pad", "pack"], monkeypatch: pytest.MonkeyPatch
) -> None:
    """epochs: 1000000 with max_steps: 30 plans the 30 steps, not a million epochs (issue 48): in well under a
    second and a few MiB, planning no epoch beyond the 30th, and the steps are those a run of two epochs
    (the same seed) takes first, so a resumed run replays the batches it would have seen."""
    import time
    import tracemalloc

    from eagle3_core.train import schedule as schedule_module

    refs = _refs(300, seed=4)  # 5..299 tokens: about 22 steps an epoch of 2048 tokens, padded or packed
    planned: list[str] = []  # an entry an epoch planned
    for name in ("plan_epoch", "plan_packed_epoch"):
        real = getattr(schedule_module, name)

        def counted(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            planned.append(_name)
            assert len(planned) <= 30, "planned more epochs than 30 steps can reach"  # fails fast
            return _real(*args, **kwargs)

        monkeypatch.setattr(schedule_module, name, counted)
    cfg = TrainConfig(batch_tokens=2048, max_len=300, seed=5, batching=batching, max_steps=30)
    tracemalloc.start()
    try:
        started = time.perf_counter()
        steps = schedule(refs, TrainConfig(**{**cfg.model_dump(), "epochs": 10**6}), world=2)
        seconds = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(steps) == 30 and seconds < 0.5 and peak < 8 * 2**20, (seconds, peak)
    assert len(planned) == 2  # 30 steps of about 22 an epoch: the first two epochs, no more
    two_epochs = cfg.model_copy(update={"epochs": 2})
    assert steps == schedule(refs, two_epochs, world=2)
    full = schedule(refs, two_epochs.model_copy(update={"max_steps": None}), world=2)
    assert len(full) > 30 and steps == full[:30] and {e for e, _ in steps} == {0, 1}
