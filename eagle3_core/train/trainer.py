"""The EAGLE-3 trainer: training-time test over memory-mapped shards, checkpointed, resumable, DDP-ready.

One optimizer step, top to bottom:

    batch   = the next length-bucketed batch (loaded and padded by background threads)
    teacher = log_softmax(target lm_head(last hidden)[..., t2d])        # no grad; the target is frozen
    logits  = drafter.ttt_forward(aux, input_ids, steps)               # steps x [B, T, V_draft]
    loss    = sum_k 0.8**k * soft_CE(logits[k], teacher shifted k+1)   # over loss-masked, draftable entries
    AdamW step with the cosine-with-warmup learning rate, gradients clipped

A run lives in one directory: `metrics.jsonl`, `checkpoints/step-*` and, when it has finished, `final/`.
Running again with the same inputs resumes from the newest checkpoint; the batch order, the optimizer and the
metric log continue exactly where they stopped (the log is cut back to what the checkpoint had seen).
Under torchrun every rank takes its share of each global batch and rank 0 writes; the loss is normalised by
the global count, so N processes take the same steps as one process given the whole batch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from eagle3_core.config import DrafterVariant, TrainConfig
from eagle3_core.draft.model import AttentionBackend, DrafterConfig, Eagle3Drafter
from eagle3_core.draft.target_head import TargetHead, load_target_head
from eagle3_core.draft.vocab import VocabMapping, load_vocab_mapping, save_vocab_mapping
from eagle3_core.errors import ConfigError, Eagle3Error
from eagle3_core.store.atomic import TEMP_MARK, atomic_write_json, fsync_path
from eagle3_core.train.checkpoint import latest_checkpoint, save_checkpoint
from eagle3_core.train.data import Batch, Prefetcher, SampleRef, TrainingData, plan_epoch, plan_validation
from eagle3_core.train.distributed import World, close_world, init_world
from eagle3_core.train.loss import (
    TTTStats,
    TTTTargets,
    chunked_ttt_targets,
    default_chunk_tokens,
    lean_ttt_loss,
)
from eagle3_core.train.memory import MemoryEstimate, check_training_memory, estimate_training_memory
from eagle3_core.train.optim import build_optimizer

Log = Callable[[str], None]
FINAL = "final"
METRICS = "metrics.jsonl"
# Settings that change how a run is watched, not what it computes: changing them keeps the run (and resumes it).
OPERATIONAL = {
    "log_every",
    "keep_checkpoints",
    "prefetch_batches",
    "loader_threads",
    "device",
    "processes",
    "compile",
}
TIMING_FIELDS = ("tokens_per_s", "elapsed_s")  # the only metric fields a resumed run may not reproduce
BATCH_PLAN = 2  # 2: batches keep to train.batch_tokens (1 held at least 8 samples whatever their length)


# ---- the drafter's shape, from the target's config --------------------------------------------------------
def drafter_config_for(
    target_dir: Path, draft_vocab_size: int, variant: DrafterVariant | None = None
) -> DrafterConfig:
    """One decoder layer shaped like the target's (what SGLang and SpecForge configure by default)."""
    raw = json.loads((target_dir / "config.json").read_text())
    cfg = raw.get("text_config", raw)
    rope = cfg.get("rope_parameters") or {}
    heads = int(cfg["num_attention_heads"])
    return DrafterConfig(
        target_hidden_size=int(cfg["hidden_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=cfg.get("head_dim") or int(cfg["hidden_size"]) // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        target_vocab_size=int(cfg["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        **(variant or DrafterVariant()).model_dump(),
    )


def new_drafter(cfg: DrafterConfig, head: TargetHead, mapping: VocabMapping, seed: int) -> Eagle3Drafter:
    """A fresh drafter: the target's embedding (frozen), and lm_head/norm started from the target's own rows.

    Starting the draft head from the target's head rows of the draft vocabulary (and the final norm from the
    target's) gives the drafter the target's output space on step one; every other weight is random.
    """
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, head.embed.float())
    with torch.no_grad():
        drafter.lm_head.weight.copy_(head.lm_head.float()[mapping.draft_to_target])
        if head.final_norm is not None:
            drafter.norm.weight.copy_(head.final_norm.float())
    return drafter


def trainable_state(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in drafter.named_parameters() if p.requires_grad}


def load_trainable_state(drafter: Eagle3Drafter, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Load saved trainable weights; anything but the (shared, frozen) embedding missing or extra is an error."""
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if unexpected or set(missing) != {"embed_tokens.weight"}:
        raise Eagle3Error(
            f"{where}: drafter weights do not match (missing {missing}, unexpected {unexpected})"
        )


@dataclass(frozen=True)
class WarmStart:
    """The trained drafter a run starts from (train.init_from: current): its run and its trainable weights."""

    final_dir: Path
    run: str
    weights: dict[str, torch.Tensor]


def warm_start(final_dir: Path, mapping: VocabMapping, dcfg: DrafterConfig) -> WarmStart:
    """The weights of a finished run, refused unless it is bound to this vocab mapping and has this shape.

    Another mapping puts other tokens on the lm_head rows (and d2t), and another shape cannot load; either
    would start the run from a drafter that is not the one it claims to continue.
    """
    from safetensors.torch import load_file

    summary = json.loads((final_dir / "summary.json").read_text())
    run = summary["run"]
    if summary["vocab_mapping"] != mapping.fingerprint:
        raise Eagle3Error(
            f"train.init_from current: the promoted drafter {run} was trained with vocab mapping "
            f"{summary['vocab_mapping'][:12]} and this run has {mapping.fingerprint[:12]} (its lm_head rows "
            "would be other tokens); set train.init_from: scratch"
        )
    theirs = DrafterConfig(**summary["drafter_config"])
    if theirs != dcfg:
        changed = {k: [v, getattr(dcfg, k)] for k, v in theirs.model_dump().items() if getattr(dcfg, k) != v}
        raise Eagle3Error(
            f"train.init_from current: the promoted drafter {run} has another shape or variant "
            f"({', '.join(f'{k} {a} -> {b}' for k, (a, b) in changed.items())}); set train.init_from: scratch"
        )
    return WarmStart(final_dir, run, load_file(str(final_dir / "drafter.safetensors")))


# ---- the run's identity and schedule -----------------------------------------------------------------------
def run_id(
    train: TrainConfig,
    mapping: VocabMapping,
    target_fingerprint: str,
    drafter: DrafterConfig,
    warm_from: str | None = None,
) -> str:
    """Same data, mapping, target, settings and starting weights -> same run directory, so running again
    resumes it."""
    identity = {
        "train": train.model_dump(exclude=OPERATIONAL),
        "mapping": mapping.fingerprint,
        "target": target_fingerprint,
        "drafter": drafter.model_dump(),
        # the batch planner's version: a run checkpointed under another plan cannot resume exactly
        "batch_plan": BATCH_PLAN,
        "warm_from": warm_from,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def learning_rate(step: int, total: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_ratio of the steps, then cosine or linear decay to zero."""
    warmup = max(1, round(cfg.warmup_ratio * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


SHARED_RANKS = 8  # the plan is the same for every world size up to this many ranks, as the budget allows
# batch_tokens: auto. On a small data set the number of optimizer steps decides the drafter (docs/recipe.md:
# 80 steps of 4,096 tokens lose 0.22 AL at K=3 to 326 of 1,024); on a large one, steps of 16,384 tokens keep a
# GPU busy and still leave thousands of steps.
AUTO_MIN_STEPS = 300
AUTO_BUDGET_RANGE = (1024, 16384)


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


def check_batch_tokens(refs: Sequence[SampleRef], cfg: TrainConfig, world: int) -> int:
    """The longest sample after the max_len cut; refused unless it fits once per rank in batch_tokens."""
    longest = max(min(r.length, cfg.max_len) for r in refs)
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


def schedule(refs: list[SampleRef], cfg: TrainConfig, world: int) -> list[tuple[int, list[int]]]:
    """(epoch, batch) for every optimizer step of the run, fixed by the seed (and by the world size only
    beyond `global_batch_floor`, so 1 and 2 processes see the same global batches)."""
    min_batch = global_batch_floor(refs, cfg, world)
    steps = [
        (e, b)
        for e in range(cfg.epochs)
        for b in plan_epoch(refs, batch_budget(cfg), cfg.max_len, cfg.seed, e, min_batch)
    ]
    return steps[: cfg.max_steps] if cfg.max_steps is not None else steps


# ---- the metric log ------------------------------------------------------------------------------------------
class MetricsLog:
    """Append-only JSONL, written by rank 0; a checkpoint records its size, a resume cuts it back to that."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def durable_size(self) -> int:
        if not self.enabled or not self.path.exists():
            return 0
        with open(self.path, "rb+") as f:
            os.fsync(f.fileno())
            return f.seek(0, os.SEEK_END)

    def cut_to(self, size: int) -> None:
        if self.enabled and self.path.exists():
            with open(self.path, "rb+") as f:
                f.truncate(size)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / METRICS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- one step ------------------------------------------------------------------------------------------------
@dataclass
class Setup:
    world: World
    cfg: TrainConfig
    data: TrainingData
    head: TargetHead
    mapping: VocabMapping
    drafter: Eagle3Drafter
    model: nn.Module  # the drafter, or its DDP wrapper
    optimizer: torch.optim.Optimizer
    t2d: torch.Tensor
    attention: AttentionBackend
    autocast_bf16: bool
    convention: str

    def autocast(self) -> Any:
        if not self.autocast_bf16:
            return nullcontext()
        return torch.autocast(self.world.device.type, dtype=torch.bfloat16)


def teacher_targets(s: Setup, batch: Batch) -> TTTTargets:
    def target_logits(last: torch.Tensor) -> torch.Tensor:
        return s.head.logits(last, s.convention)  # type: ignore[arg-type]

    chunk = default_chunk_tokens(s.head.lm_head.shape[0])
    with torch.no_grad(), s.autocast():
        return chunked_ttt_targets(target_logits, batch.last, batch.loss_mask, s.t2d, s.cfg.ttt_steps, chunk)


def _loss(
    s: Setup, batch: Batch, model: nn.Module, targets: TTTTargets, normalizer: torch.Tensor | None
) -> tuple[torch.Tensor, TTTStats]:
    """The TTT loss of `model` (the drafter, or its DDP wrapper) on one batch, and its statistics."""
    aux = batch.aux if s.autocast_bf16 else batch.aux.float()
    with s.autocast():
        states: list[torch.Tensor] = model(aux, batch.input_ids, s.cfg.ttt_steps, s.attention, "states")
    dtype = torch.bfloat16 if s.autocast_bf16 else torch.float32
    return lean_ttt_loss(
        states, s.drafter.lm_head.weight, targets, s.cfg.step_weight, normalizer, s.cfg.loss, dtype
    )


def train_step(s: Setup, batch: Batch, lr: float) -> TTTStats:
    targets = teacher_targets(s, batch)
    # Normalise by the count over all ranks (times the world size, as DDP averages gradients), so the step
    # equals one process's step on the whole global batch.
    normalizer = s.world.sum(targets.counts()) / s.world.size
    loss, stats = _loss(s, batch, s.model, targets, normalizer)
    loss.backward()
    if s.cfg.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(s.drafter.parameters(), s.cfg.grad_clip)
    for group in s.optimizer.param_groups:
        group["lr"] = lr
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return stats


def validate(s: Setup, refs: list[SampleRef], prefetch: Prefetcher) -> TTTStats:
    """TTT statistics over this rank's share of the validation batches, summed over ranks."""
    batches = plan_validation(refs, batch_budget(s.cfg), s.cfg.max_len)[s.world.rank :: s.world.size]
    total = TTTStats.zeros(s.cfg.ttt_steps)
    s.drafter.eval()
    with torch.no_grad():
        for batch in prefetch(batches):
            batch = batch.to(s.world.device)
            _, stats = _loss(s, batch, s.drafter, teacher_targets(s, batch), None)
            total = total + stats
    s.drafter.train()
    return TTTStats(s.world.sum(total.sums.to(s.world.device)).cpu())


def _validate_and_log(
    s: Setup, refs: list[SampleRef], prefetch: Prefetcher, step: int, metrics: MetricsLog, log: Log
) -> None:
    """A validation record and log line; none without anything to measure (an accuracy of 0 and tau of
    1 would read as a measured drafter)."""
    if not refs:
        log(f"validation at step {step}: no validation samples")
        return
    val = validate(s, refs, prefetch)
    if val.counted[0] == 0:
        log(f"validation at step {step}: no loss-masked tokens in the {len(refs)} validation samples")
        return
    metrics.write({"kind": "val", "step": step, **val.report()})
    log(
        f"validation at step {step}: acc_0 {val.acc[0]:.3f} tau_3 {val.tau(3):.2f} "
        f"tau_{s.cfg.ttt_steps} {val.tau(s.cfg.ttt_steps):.2f}"
    )


# ---- the run -------------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path
    steps: int
    tokens: int
    seconds: float
    val: dict[str, float]
    resumed_from: int | None
    drafter_config: DrafterConfig
    summary: dict[str, Any] = field(default_factory=dict)


def numerics(cfg: TrainConfig, device: torch.device) -> tuple[bool, AttentionBackend]:
    """(bf16 autocast?, the attention backend) a run on `device` uses."""
    cuda = device.type == "cuda"
    bf16 = cfg.precision == "bfloat16" or (cfg.precision == "auto" and cuda)
    attention: AttentionBackend = (
        "flex" if cfg.attention == "flex" or (cfg.attention == "auto" and cuda) else "sdpa"
    )
    if attention == "flex" and not cuda:
        raise Eagle3Error(
            "train.attention 'flex' needs a GPU (torch has no flex attention backward on CPU); use sdpa"
        )
    return bf16, attention


@dataclass(frozen=True)
class DeviceMemory:
    """A GPU's free and total bytes when the run starts, and the estimate of the run's peak."""

    free: int
    total: int
    estimate: MemoryEstimate
    where: str


def device_memory(
    cfg: TrainConfig, dcfg: DrafterConfig, world: World, refs: Sequence[SampleRef]
) -> DeviceMemory | None:
    """The memory facts of a GPU run (None on CPU, where host memory is not estimated)."""
    if world.device.type != "cuda":
        return None
    bf16, attention = numerics(cfg, world.device)
    longest = max((min(r.length, cfg.max_len) for r in refs), default=0)
    estimate = estimate_training_memory(
        dcfg, cfg.ttt_steps, world.size, 2 if bf16 else 4, longest if attention == "sdpa" else 0
    )
    free, total = torch.cuda.mem_get_info(world.device)
    return DeviceMemory(free, total, estimate, f"{torch.cuda.get_device_name(world.device)} ({world.device})")


def build_setup(
    world: World,
    cfg: TrainConfig,
    data: TrainingData,
    head: TargetHead,
    mapping: VocabMapping,
    dcfg: DrafterConfig,
    warm: WarmStart | None = None,
) -> Setup:
    cuda = world.device.type == "cuda"
    bf16, attention = numerics(cfg, world.device)
    head_dtype = torch.bfloat16 if bf16 else torch.float32
    head = TargetHead(
        head.embed,
        head.lm_head.to(world.device, head_dtype),
        None if head.final_norm is None else head.final_norm.to(world.device, head_dtype),
        head.rms_norm_eps,
    )
    drafter = new_drafter(dcfg, head, mapping, cfg.seed)
    if warm is not None:
        load_trainable_state(drafter, warm.weights, warm.final_dir)
    drafter = drafter.to(world.device)
    if cfg.compile == "on" or (cfg.compile == "auto" and cuda):
        compile_layer(drafter)
    model: nn.Module = drafter
    if world.distributed:
        model = DistributedDataParallel(drafter, device_ids=[world.device] if cuda else None)
    optimizer = build_optimizer(drafter, cfg)
    return Setup(
        world,
        cfg,
        data,
        head,
        mapping,
        drafter,
        model,
        optimizer,
        mapping.t2d.to(world.device),
        attention,
        bf16,
        data.facts["final_state_convention"],
    )


def compile_layer(drafter: Eagle3Drafter) -> None:
    """torch.compile the per-step pieces around attention (dynamic shapes: batch lengths vary), in place.

    Attention itself stays as it is (flex attention is compiled on its own); what fuses here are the
    norms, the concatenation, RoPE, the residuals and the MLP's gate, which run eagerly as a dozen
    memory-bound kernels per step, each keeping its own output for backward."""
    layer = drafter.midlayer
    layer.qkv = torch.compile(layer.qkv, dynamic=True)  # type: ignore[method-assign]
    layer.finish = torch.compile(layer.finish, dynamic=True)  # type: ignore[method-assign]
    drafter.step_out = torch.compile(drafter.step_out, dynamic=True)  # type: ignore[method-assign]
    drafter.features = torch.compile(drafter.features, dynamic=True)  # type: ignore[method-assign]


def _check_inputs(data: TrainingData, mapping: VocabMapping, dcfg: DrafterConfig) -> None:
    facts = data.facts
    if facts["tokenizer_fingerprint"] != mapping.tokenizer_fingerprint:
        raise Eagle3Error("the vocab mapping was built for another tokenizer than the shards'; rebuild it")
    if mapping.target_vocab_size != dcfg.target_vocab_size:
        raise Eagle3Error(
            f"vocab mapping over {mapping.target_vocab_size} ids, target vocab {dcfg.target_vocab_size}"
        )
    if facts["hidden_size"] != dcfg.target_hidden_size:
        raise Eagle3Error(
            f"shards hold hidden size {facts['hidden_size']}, the target has {dcfg.target_hidden_size}"
        )
    if facts["final_state_convention"] not in ("pre_norm", "post_norm"):
        raise Eagle3Error(f"shards record no final-state convention ({facts['final_state_convention']!r})")


def _write_final(
    run_dir: Path, drafter: Eagle3Drafter, mapping: VocabMapping, summary: dict[str, Any]
) -> Path:
    """final/: weights, drafter config, the vocab mapping it is bound to, and the summary; whole or absent."""
    from safetensors.torch import save_file

    final = run_dir / FINAL
    temp = run_dir / f"{FINAL}{TEMP_MARK}{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    save_file(
        {n: t.cpu().contiguous() for n, t in trainable_state(drafter).items()},
        str(temp / "drafter.safetensors"),
    )
    atomic_write_json(temp / "drafter_config.json", drafter.cfg.model_dump())
    save_vocab_mapping(mapping, temp / "vocab_mapping")
    atomic_write_json(temp / "summary.json", summary)
    fsync_path(temp)
    temp.rename(final)
    fsync_path(run_dir)
    return final


def _result_from_final(run_dir: Path, resumed_from: int | None) -> TrainResult:
    summary = json.loads((run_dir / FINAL / "summary.json").read_text())
    return TrainResult(
        run_dir,
        run_dir / FINAL,
        summary["steps"],
        summary["tokens"],
        summary["seconds"],
        summary["val"],
        resumed_from,
        DrafterConfig(**summary["drafter_config"]),
        summary,
    )


def train_drafter(
    shard_paths: list[Path],
    target_dir: Path,
    mapping: VocabMapping,
    runs_dir: Path,
    cfg: TrainConfig,
    log: Log = print,
    init_from: Path | None = None,
) -> TrainResult:
    """Train (or resume, or return the finished) run for these shards, target, mapping and settings.

    `init_from`: a finished run's final/ directory to start from (warm start) instead of fresh weights.
    """
    world = init_world(cfg.device)
    data = TrainingData(shard_paths)
    try:
        return _train(
            world,
            data,
            target_dir,
            mapping,
            runs_dir,
            cfg,
            log if world.is_main else (lambda _: None),
            init_from,
        )
    finally:
        data.close()
        close_world(world)


def _train(
    world: World,
    data: TrainingData,
    target_dir: Path,
    mapping: VocabMapping,
    runs_dir: Path,
    cfg: TrainConfig,
    log: Log,
    init_from: Path | None,
) -> TrainResult:
    dcfg = drafter_config_for(target_dir, mapping.draft_vocab_size, cfg.variant)
    _check_inputs(data, mapping, dcfg)
    warm = warm_start(init_from, mapping, dcfg) if init_from is not None else None
    train_refs, val_refs = data.split(cfg.val_fraction, cfg.max_val_samples)
    memory = device_memory(cfg, dcfg, world, data.refs)
    ceiling = memory.estimate.largest_batch_tokens(memory.free) if memory else None
    cfg = resolve_batch_tokens(cfg, train_refs, val_refs, world.size, ceiling)
    if memory is not None:  # the preflight: refused here, before anything is allocated
        check_training_memory(memory.estimate, batch_budget(cfg), memory.free, memory.total, memory.where)
    run_dir = runs_dir / run_id(
        cfg, mapping, str(data.facts["target_fingerprint"]), dcfg, warm.run if warm else None
    )
    if (run_dir / FINAL / "summary.json").exists():
        log(f"run {run_dir.name} already finished; nothing to train")
        return _result_from_final(run_dir, None)
    check_batch_tokens(data.refs, cfg, world.size)  # validation batches keep to the budget too
    plan = schedule(train_refs, cfg, world.size)
    run_dir.mkdir(parents=True, exist_ok=True)
    s = build_setup(world, cfg, data, load_target_head(target_dir), mapping, dcfg, warm)
    if warm is not None:
        log(f"starting from the weights of run {warm.run} ({warm.final_dir})")
    metrics = MetricsLog(run_dir / METRICS, world.is_main)

    step, tokens, interval, interval_tokens = 0, 0, TTTStats.zeros(cfg.ttt_steps, world.device), 0
    resumed_from = None
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        load_trainable_state(s.drafter, ckpt.weights, ckpt.path)
        s.optimizer.load_state_dict(ckpt.optimizer)
        torch.set_rng_state(torch.tensor(ckpt.state["rng_cpu"], dtype=torch.uint8))
        step, tokens, resumed_from = ckpt.step, ckpt.state["tokens"], ckpt.step
        if world.is_main:  # the saved sums are over all ranks already: one rank carries them on
            interval = TTTStats(
                torch.tensor(ckpt.state["interval_sums"], dtype=torch.float64, device=world.device)
            )
            interval_tokens = ckpt.state["interval_tokens"]
        metrics.cut_to(ckpt.state["metrics_bytes"])
        log(f"resuming run {run_dir.name} from step {step}")
    elif world.is_main:
        metrics.cut_to(0)  # a run that never checkpointed starts its log afresh
    world.barrier()

    log(
        f"training run {run_dir.name}: {len(train_refs)} samples "
        f"({f'{len(val_refs)} validation' if val_refs else 'no validation samples'}), {len(plan)} steps, "
        f"{world.size} process(es) on {world.device}, attention {s.attention}, "
        f"{'bf16 autocast' if s.autocast_bf16 else 'float32'}"
    )
    pin = world.device.type == "cuda"
    prefetch = Prefetcher(
        data, train_refs, cfg.max_len, threads=cfg.loader_threads, depth=cfg.prefetch_batches, pin=pin
    )
    val_prefetch = Prefetcher(
        data, val_refs, cfg.max_len, threads=cfg.loader_threads, depth=cfg.prefetch_batches, pin=pin
    )
    started = time.perf_counter()
    interval_started = started
    try:
        local_batches = [batch[world.rank :: world.size] for _, batch in plan[step:]]
        for batch in prefetch(local_batches):
            epoch = plan[step][0]
            lr = learning_rate(step, len(plan), cfg)
            interval = interval + train_step(s, batch.to(world.device), lr)
            interval_tokens += batch.tokens
            step += 1
            if step % cfg.log_every == 0 or step == len(plan):
                now = time.perf_counter()
                reduced, n = _reduce_interval(world, interval, interval_tokens)
                tokens += n
                weighted = sum(cfg.step_weight**k * x for k, x in enumerate(reduced.step_losses))
                metrics.write(
                    {
                        "kind": "train",
                        "step": step,
                        "epoch": epoch,
                        "lr": lr,
                        "loss": round(weighted, 6),
                        **reduced.report(),
                        "tokens": tokens,
                        "tokens_per_s": round(n / max(now - interval_started, 1e-9), 1),
                        "elapsed_s": round(now - started, 2),
                    }
                )
                log(
                    f"step {step}/{len(plan)} loss {weighted:.3f} acc_0 {reduced.acc[0]:.3f} "
                    f"tau_{cfg.ttt_steps} {reduced.tau(cfg.ttt_steps):.2f} {n / max(now - interval_started, 1e-9):,.0f} tok/s"
                )
                interval, interval_tokens, interval_started = (
                    TTTStats.zeros(cfg.ttt_steps, world.device),
                    0,
                    now,
                )
            if step % cfg.eval_every == 0 or step == len(plan):
                _validate_and_log(s, val_refs, val_prefetch, step, metrics, log)
            if step % cfg.checkpoint_every == 0 or step == len(plan):
                _checkpoint(s, run_dir, step, tokens, interval, interval_tokens, metrics)
    finally:
        prefetch.close()
        val_prefetch.close()
    seconds = time.perf_counter() - started
    final_val = [r for r in read_metrics(run_dir) if r["kind"] == "val"] if world.is_main else []
    val_report = {k: v for k, v in final_val[-1].items() if k not in ("kind", "step")} if final_val else {}
    summary = {
        "run": run_dir.name,
        "steps": step,
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "val": val_report,
        "drafter_config": dcfg.model_dump(),
        "vocab_mapping": mapping.fingerprint,
        "target_fingerprint": data.facts["target_fingerprint"],
        "aux_layer_ids": data.facts["aux_layer_ids"],
        "aux_layer_convention": data.facts["aux_layer_convention"],
        "final_state_convention": data.facts["final_state_convention"],
        "train_samples": len(train_refs),
        "val_samples": len(val_refs),
        "world_size": world.size,
        "attention": s.attention,
        "bf16": s.autocast_bf16,
        "train_config": cfg.model_dump(),
        "warm_from": warm.run if warm else None,
    }
    if world.is_main:
        _write_final(run_dir, s.drafter, mapping, summary)
        log(f"run {run_dir.name} finished: {run_dir / FINAL}")
    world.barrier()
    return TrainResult(
        run_dir, run_dir / FINAL, step, tokens, round(seconds, 2), val_report, resumed_from, dcfg, summary
    )


def _reduce_interval(world: World, interval: TTTStats, tokens: int) -> tuple[TTTStats, int]:
    """The interval's statistics and token count summed over ranks (on the CPU), leaving the local ones as they are."""
    sums = world.sum(interval.sums.clone()).cpu()
    n = world.sum(torch.tensor([tokens], dtype=torch.float64, device=world.device))
    return TTTStats(sums), int(n.item())


def _checkpoint(
    s: Setup,
    run_dir: Path,
    step: int,
    tokens: int,
    interval: TTTStats,
    interval_tokens: int,
    metrics: MetricsLog,
) -> None:
    # Every rank's interval sums go into the checkpoint, summed, so a resumed run logs the same interval.
    reduced, n = _reduce_interval(s.world, interval, interval_tokens)
    if s.world.is_main:
        state = {
            "tokens": tokens,
            "interval_sums": reduced.sums.tolist(),
            "interval_tokens": n,
            "metrics_bytes": metrics.durable_size(),
            "rng_cpu": torch.get_rng_state().tolist(),
        }
        save_checkpoint(
            run_dir, step, trainable_state(s.drafter), s.optimizer.state_dict(), state, s.cfg.keep_checkpoints
        )
    s.world.barrier()


def load_trained(final_dir: Path, embed: torch.Tensor) -> tuple[Eagle3Drafter, VocabMapping, dict[str, Any]]:
    """The drafter of a finished run (with the target's embedding), the mapping it is bound to, its summary."""
    from safetensors.torch import load_file

    summary = json.loads((final_dir / "summary.json").read_text())
    mapping = load_vocab_mapping(final_dir / "vocab_mapping", expected_fingerprint=summary["vocab_mapping"])
    drafter = Eagle3Drafter(DrafterConfig(**summary["drafter_config"]), embed.float())
    load_trainable_state(drafter, load_file(str(final_dir / "drafter.safetensors")), final_dir)
    return drafter, mapping, summary
