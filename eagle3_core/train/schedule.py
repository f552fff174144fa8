"""What a run steps through: the token budget of a step, the batches of every step, the learning rate.

The plan is fixed by the seed and the data alone (and by the world size only beyond `global_batch_floor`), so a
resumed run replays the batches it would have seen and 1 and 2 processes take the same global steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from eagle3_core.config import TrainConfig
from eagle3_core.draft.model import FLEX_BLOCK
from eagle3_core.errors import ConfigError, Eagle3Error
from eagle3_core.train.data import Rows, SampleRef, plan_epoch, plan_packed_epoch


def learning_rate(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine or linear decay to zero, or constant."""
    warmup = max(1, round(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


SHARED_RANKS = 8  # the plan is the same for every world size up to this many ranks, as the budget allows
# batch_tokens: auto. On a small data set the number of optimizer steps decides the drafter (docs/recipe.md:
# 80 steps of 4,096 tokens lose 0.22 AL at K=3 to 326 of 1,024); on a large one, steps of 8,192 tokens (what
# the recipe was measured with on SmolLM2, and speculators' packed step) still leave thousands of steps.
AUTO_MIN_STEPS = 300
AUTO_BUDGET_RANGE = (1024, 8192)


def auto_batch_tokens(
    train_refs: Sequence[SampleRef],
    val_refs: Sequence[SampleRef],
    cfg: TrainConfig,
    world: int,
    ceiling: int | None = None,
) -> int:
    """The largest power of two in AUTO_BUDGET_RANGE (and at most `ceiling`, what fits the device) whose run
    takes at least AUTO_MIN_STEPS optimizer steps, counted on unpadded tokens; raised to the longest sample
    (validation too) once per rank if that is more."""
    low, high = AUTO_BUDGET_RANGE
    if ceiling is not None and ceiling > 0:
        high = min(high, _power_of_two_at_most(ceiling))
        low = min(low, high)
    per_step = sum(min(r.length, cfg.max_len) for r in train_refs) * cfg.epochs // AUTO_MIN_STEPS
    budget = min(high, max(low, _power_of_two_at_most(per_step)))
    longest = max((min(r.length, cfg.max_len) for r in [*train_refs, *val_refs]), default=0)
    return max(budget, longest * world)


def _power_of_two_at_most(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def resolve_batch_tokens(
    cfg: TrainConfig,
    train_refs: Sequence[SampleRef],
    val_refs: Sequence[SampleRef],
    world: int,
    ceiling: int | None = None,
) -> TrainConfig:
    """`cfg` with batch_tokens a number: auto is resolved from the data (and the device's `ceiling`), a
    number is kept."""
    if cfg.batch_tokens != "auto":
        return cfg
    budget = auto_batch_tokens(train_refs, val_refs, cfg, world, ceiling)
    return cfg.model_copy(update={"batch_tokens": budget})


def batch_budget(cfg: TrainConfig) -> int:
    """The step's token budget of a resolved config (resolve_batch_tokens)."""
    if cfg.batch_tokens == "auto":
        raise Eagle3Error("train.batch_tokens is still auto: resolve it from the training split first")
    return cfg.batch_tokens


def resolve_batching(cfg: TrainConfig, attention: Literal["sdpa", "flex"]) -> TrainConfig:
    """`cfg` with batching pack or pad: auto packs under flex attention (a GPU), and pads otherwise."""
    if cfg.batching != "auto":
        return cfg
    return cfg.model_copy(update={"batching": "pack" if attention == "flex" else "pad"})


def packs(cfg: TrainConfig) -> bool:
    """Whether a resolved config (resolve_batching) packs its batches."""
    if cfg.batching == "auto":
        raise Eagle3Error("train.batching is still auto: resolve it from the attention backend first")
    return cfg.batching == "pack"


def row_width(cfg: TrainConfig, world: int) -> int:
    """A packed row's entries: each rank's share of batch_tokens, down to a multiple of flex's block."""
    return batch_budget(cfg) // world // FLEX_BLOCK * FLEX_BLOCK


def check_batch_tokens(refs: Sequence[SampleRef], cfg: TrainConfig, world: int) -> int:
    """The longest sample after the max_len cut; refused unless it fits once per rank in batch_tokens (in a
    packed row of its share, when packing)."""
    longest = max(min(r.length, cfg.max_len) for r in refs)
    if packs(cfg) and longest > row_width(cfg, world):
        need = -(-longest // FLEX_BLOCK) * FLEX_BLOCK * world
        raise ConfigError(
            f"train.batch_tokens={cfg.batch_tokens} cannot hold one sample per process: the longest sample "
            f"has {longest} tokens (train.max_len={cfg.max_len}), a packed row per process holds "
            f"{row_width(cfg, world)}, and {world} process(es) need train.batch_tokens >= {need}"
        )
    if longest * world > batch_budget(cfg):
        raise ConfigError(
            f"train.batch_tokens={cfg.batch_tokens} cannot hold one sample per process: the longest sample "
            f"has {longest} tokens (train.max_len={cfg.max_len}) and {world} process(es) need "
            f"train.batch_tokens >= {longest * world}"
        )
    return longest


def global_batch_floor(refs: Sequence[SampleRef], cfg: TrainConfig, world: int) -> int:
    """Samples every global batch holds at least: one per rank, and otherwise as many as fit the budget
    up to SHARED_RANKS, a number that does not depend on the world size, so that 1 and 2 processes (and
    any up to SHARED_RANKS that the budget admits) plan the same global batches."""
    longest = check_batch_tokens(refs, cfg, world)
    if len(refs) < world:
        raise Eagle3Error(f"{len(refs)} training samples cannot give each of {world} processes one")
    return max(world, min(SHARED_RANKS, batch_budget(cfg) // longest, len(refs)))


def schedule(refs: list[SampleRef], cfg: TrainConfig, world: int) -> list[tuple[int, Rows]]:
    """(epoch, batch rows) for every optimizer step of the run, fixed by the seed. Padded, by the world size
    only beyond `global_batch_floor` (1 and 2 processes see the same global batches); packed, a row per
    process.

    Epochs are planned one at a time, each from (seed, epoch) alone, and only until train.max_steps is
    reached: `epochs: 1000000, max_steps: 30` plans the epochs its 30 steps reach (what it plans and keeps
    is bounded by max_steps, not epochs x data), and those steps are the first 30 of any longer run."""
    if packs(cfg):
        check_batch_tokens(refs, cfg, world)
        width = row_width(cfg, world)

        def epoch_steps(e: int) -> list[Rows]:
            return plan_packed_epoch(refs, width, world, cfg.max_len, cfg.seed, e)
    else:
        min_batch = global_batch_floor(refs, cfg, world)
        budget = batch_budget(cfg)

        def epoch_steps(e: int) -> list[Rows]:
            return [[[i] for i in b] for b in plan_epoch(refs, budget, cfg.max_len, cfg.seed, e, min_batch)]

    steps: list[tuple[int, Rows]] = []
    for e in range(cfg.epochs):
        if cfg.max_steps is not None and len(steps) >= cfg.max_steps:
            break
        planned = epoch_steps(e)
        if not planned:  # no samples: no epoch has a step
            break
        steps.extend((e, b) for b in planned)
    return steps[: cfg.max_steps] if cfg.max_steps is not None else steps
