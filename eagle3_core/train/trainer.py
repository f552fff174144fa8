"""The EAGLE-3 trainer: training-time test over memory-mapped shards, checkpointed, resumable, DDP-ready.

One optimizer step, top to bottom (`train_step`):

    batch   = the next length-bucketed batch (loaded and padded by background threads)
    teacher = the target's lm_head(last hidden) over the draft vocabulary    # no grad; the target is frozen
    states  = drafter.ttt_states(aux, input_ids, steps)                      # steps x [B, T, H]
    loss    = sum_k w**k * soft_CE(lm_head(states[k]), teacher shifted k+1)  # chunked: train/loss.py
    AdamW step with the warmup-then-decay learning rate, gradients clipped

The run (`train_drafter`): plan the steps (train/schedule.py), check the GPU can hold them (train/memory.py),
find the run's directory (train/run_dir.py) and hold it, resume from its newest intact checkpoint
(train/checkpoint.py), loop, write `final/`. The batch order, the optimizer and the metric log continue
exactly where a checkpoint stopped (the log is cut back to what it had seen). Under torchrun every rank takes
its share of each global batch and rank 0 writes; the loss is normalised by the global count, so N processes
take the same steps as one process given the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from eagle3_core.config import DrafterVariant, RecordLoss, TrainConfig
from eagle3_core.conventions import FinalStateConvention
from eagle3_core.draft.model import AttentionBackend, DrafterConfig, Eagle3Drafter, Packing
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.errors import Eagle3Error, TrainingDivergedError
from eagle3_core.finite import nonfinite_tensor
from eagle3_core.store.records import ALRow, GpuMemory, RunProgress, RunSummary, TrainRow, ValRow
from eagle3_core.targets.head import TargetHead, load_target_head
from eagle3_core.targets.model_config import read_text_config
from eagle3_core.train.checkpoint import (
    Checkpoint,
    checkpoint_dir,
    full_disk_stops_the_run,
    list_checkpoints,
    load_checkpoint,
    resume_checkpoint,
    save_checkpoint,
)
from eagle3_core.train.data import (
    Batch,
    Prefetcher,
    Rows,
    SampleRef,
    TrainingData,
    plan_packed_validation,
    plan_validation,
)
from eagle3_core.train.distributed import World, close_world, init_world, on_main
from eagle3_core.train.loss import (
    TTTStats,
    TTTTargets,
    chunked_ttt_targets,
    default_chunk_tokens,
    lean_ttt_loss,
    record_weights,
)
from eagle3_core.train.memory import (
    MemoryEstimate,
    check_training_memory,
    estimate_training_memory,
    gib,
)
from eagle3_core.train.optim import build_optimizer
from eagle3_core.train.run_dir import (
    FINAL,
    METRICS,
    SUMMARY,
    MetricsLog,
    TrainResult,
    drafter_state,
    finished_result,
    load_drafter_state,
    read_metrics,
    run_id,
    run_lock,
    write_final,
)
from eagle3_core.train.schedule import (
    batch_budget,
    check_batch_tokens,
    learning_rate,
    packs,
    resolve_batch_tokens,
    resolve_batching,
    row_width,
    schedule,
)
from eagle3_core.train.selection import RunSelector
from eagle3_core.train.sharding import (
    copy_whole_into,
    load_whole_optimizer_state,
    shard_module,
    whole_optimizer_state,
    whole_state,
)

Log = Callable[[str], None]


# ---- the drafter's shape, from the target's config --------------------------------------------------------
def drafter_config_for(
    target_dir: Path, draft_vocab_size: int, variant: DrafterVariant | None = None
) -> DrafterConfig:
    """One decoder layer shaped like the target's (what SGLang and SpecForge configure by default)."""
    cfg = read_text_config(target_dir)  # TargetError naming the file and the field
    heads, kv_heads, head_dim = cfg.drafter_attention()
    return DrafterConfig(
        target_hidden_size=cfg.hidden_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.theta,
        target_vocab_size=cfg.vocab_size,
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

    summary = RunSummary.read(final_dir / SUMMARY)
    run = summary.run
    if summary.vocab_mapping != mapping.fingerprint:
        raise Eagle3Error(
            f"train.init_from current: the promoted drafter {run} was trained with vocab mapping "
            f"{summary.vocab_mapping[:12]} and this run has {mapping.fingerprint[:12]} (its lm_head rows "
            "would be other tokens); set train.init_from: scratch"
        )
    theirs = DrafterConfig(**summary.drafter_config)
    if theirs != dcfg:
        changed = {k: [v, getattr(dcfg, k)] for k, v in theirs.model_dump().items() if getattr(dcfg, k) != v}
        raise Eagle3Error(
            f"train.init_from current: the promoted drafter {run} has another shape or variant "
            f"({', '.join(f'{k} {a} -> {b}' for k, (a, b) in changed.items())}); set train.init_from: scratch"
        )
    return WarmStart(final_dir, run, load_file(str(final_dir / "drafter.safetensors")))


# ---- one step ------------------------------------------------------------------------------------------------
@dataclass
class Setup:
    world: World
    cfg: TrainConfig
    data: TrainingData
    head: TargetHead
    mapping: VocabMapping
    drafter: Eagle3Drafter
    loss: nn.Module  # the drafter's TTT loss (TTTLoss), sharded under FSDP: what validation runs
    model: nn.Module  # `loss`, or its DDP wrapper: what a training step runs
    optimizer: torch.optim.Optimizer
    sharded: bool  # train.sharding fsdp: weights and optimizer state are gathered whole to be saved
    t2d: torch.Tensor
    attention: AttentionBackend
    autocast_bf16: bool
    convention: FinalStateConvention
    records: RecordLoss | None = None  # how on-policy record samples count (None: as offline ones)

    def autocast(self) -> Any:
        if not self.autocast_bf16:
            return nullcontext()
        return torch.autocast(self.world.device.type, dtype=torch.bfloat16)


def teacher_targets(s: Setup, batch: Batch) -> TTTTargets:
    def target_logits(last: torch.Tensor) -> torch.Tensor:
        return s.head.logits(last, s.convention)

    chunk = default_chunk_tokens(s.head.lm_head.shape[0])
    doc, drafted = (batch.packing.doc, batch.packing.drafted) if batch.packing is not None else (None, None)
    with torch.no_grad(), s.autocast():
        targets = chunked_ttt_targets(
            target_logits, batch.last, batch.loss_mask, s.t2d, s.cfg.ttt_steps, chunk, doc, drafted
        )
        if batch.draft_steps is not None and s.records is not None:
            targets = record_weights(targets, batch.draft_steps, s.records)
        return targets


class TTTLoss(nn.Module):
    """The drafter's TTT forward and its loss as one module: what DDP or FSDP wraps, so that the head's weight
    the loss reads is inside the wrapped forward (FSDP gathers it there)."""

    def __init__(self, drafter: Eagle3Drafter, cfg: TrainConfig, attention: AttentionBackend, bf16: bool):
        super().__init__()
        self.drafter, self.cfg, self.attention, self.bf16 = drafter, cfg, attention, bf16

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        packing: Packing | None,
        targets: TTTTargets,
        normalizer: torch.Tensor | None,
    ) -> tuple[torch.Tensor, TTTStats]:
        autocast = torch.autocast(aux.device.type, dtype=torch.bfloat16) if self.bf16 else nullcontext()
        with autocast:
            states = self.drafter(aux, input_ids, self.cfg.ttt_steps, self.attention, "states", packing)
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        return lean_ttt_loss(
            states,
            self.drafter.lm_head.weight,
            targets,
            self.cfg.step_weight,
            normalizer,
            self.cfg.loss,
            dtype,
            teacher_top_k=self.cfg.teacher_top_k,
        )


def _loss(
    s: Setup, batch: Batch, model: nn.Module, targets: TTTTargets, normalizer: torch.Tensor | None
) -> tuple[torch.Tensor, TTTStats]:
    """The TTT loss of `model` (a TTTLoss, or its DDP wrapper) on one batch, and its statistics."""
    aux = batch.aux if s.autocast_bf16 else batch.aux.float()
    loss, stats = model(aux, batch.input_ids, batch.packing, targets, normalizer)
    return loss, stats


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
    plan = validation_plan(refs, s.cfg, s.world.size)
    batches, measured = rank_validation_batches(plan, s.world.rank, s.world.size, s.sharded)
    total = TTTStats.zeros(s.cfg.ttt_steps)
    s.drafter.eval()
    with torch.no_grad():
        for i, batch in enumerate(prefetch(batches)):
            batch = batch.to(s.world.device)
            _, stats = _loss(s, batch, s.loss, teacher_targets(s, batch), None)
            if i < measured:
                total = total + stats
    s.drafter.train()
    return TTTStats(s.world.sum(total.sums.to(s.world.device)).cpu())


def rank_validation_batches(plan: list[Rows], rank: int, world: int, sharded: bool) -> tuple[list[Rows], int]:
    """(the batches `rank` runs, how many of them it measures): whole batches dealt round the ranks. Under
    FSDP every forward gathers the weights from every rank, so a rank dealt fewer batches than another would
    wait forever at the other's extra forward: it runs as many as the most dealt, the extra ones batches of
    the plan whose statistics it drops."""
    batches = plan[rank::world]
    measured = len(batches)
    if sharded:
        batches = batches + plan[: -(-len(plan) // world) - measured]
    return batches, measured


def validation_plan(refs: Sequence[SampleRef], cfg: TrainConfig, world: int) -> list[Rows]:
    """The validation batches, whole batches dealt to ranks: packed rows of a rank's width, or padded."""
    if packs(cfg):
        return plan_packed_validation(refs, row_width(cfg, world), cfg.max_len)
    return [[[i] for i in batch] for batch in plan_validation(refs, batch_budget(cfg), cfg.max_len)]


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
    metrics.write(ValRow(step=step, **dict(val.metrics())))
    taus = " ".join(f"tau_{k} {val.tau(k):.2f}" for k in sorted({3, s.cfg.ttt_steps}) if k <= s.cfg.ttt_steps)
    log(f"validation at step {step}: acc_0 {val.acc[0]:.3f} {taus}")


# ---- the setup -----------------------------------------------------------------------------------------------
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
    sharded: MemoryEstimate | None = None  # the same run under train.sharding fsdp, when it is DDP over ranks


def device_memory(
    cfg: TrainConfig, dcfg: DrafterConfig, world: World, refs: Sequence[SampleRef]
) -> DeviceMemory | None:
    """The memory facts of a GPU run (None on CPU, where host memory is not estimated)."""
    if world.device.type != "cuda":
        return None
    bf16, attention = numerics(cfg, world.device)
    longest = max((min(r.length, cfg.max_len) for r in refs), default=0)
    if cfg.batching == "pack" and cfg.batch_tokens != "auto":  # an SDPA query sees its whole row
        longest = row_width(cfg, world.size)

    def estimate(sharded: bool) -> MemoryEstimate:
        return estimate_training_memory(
            dcfg, cfg.ttt_steps, world.size, 2 if bf16 else 4, longest if attention == "sdpa" else 0,
            sharded=sharded,
        )  # fmt: skip

    fsdp = cfg.sharding == "fsdp"
    free, total = torch.cuda.mem_get_info(world.device)
    where = f"{torch.cuda.get_device_name(world.device)} ({world.device})"
    offered = estimate(True) if world.distributed and not fsdp else None  # what a refusal may offer instead
    return DeviceMemory(free, total, estimate(fsdp), where, offered)


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
        load_drafter_state(drafter, warm.weights, warm.final_dir)
    drafter.lm_head.weight.requires_grad_(cfg.head == "trained")
    drafter = drafter.to(world.device)
    sharded = cfg.sharding == "fsdp" and world.distributed
    if cfg.compile == "on" or (cfg.compile == "auto" and cuda and not sharded):
        compile_layer(drafter)
    loss: nn.Module = TTTLoss(drafter, cfg, attention, bf16)
    model = loss
    if sharded:
        # the optimizer is built after: its parameters are the shards
        model = loss = shard_module(loss, world)
    elif world.distributed:
        model = DistributedDataParallel(loss, device_ids=[world.device] if cuda else None)
    optimizer = build_optimizer(drafter, cfg)
    return Setup(
        world,
        cfg,
        data,
        head,
        mapping,
        drafter,
        loss,
        model,
        optimizer,
        sharded,
        mapping.t2d.to(world.device),
        attention,
        bf16,
        data.facts.trained_from().final_state_convention,
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
    facts.trained_from()  # what the summary will record: refused now, not after training
    if facts.tokenizer_fingerprint != mapping.tokenizer_fingerprint:
        raise Eagle3Error("the vocab mapping was built for another tokenizer than the shards'; rebuild it")
    if mapping.target_vocab_size != dcfg.target_vocab_size:
        raise Eagle3Error(
            f"vocab mapping over {mapping.target_vocab_size} ids, target vocab {dcfg.target_vocab_size}"
        )
    if facts.hidden_size != dcfg.target_hidden_size:
        raise Eagle3Error(
            f"shards hold hidden size {facts.hidden_size}, the target has {dcfg.target_hidden_size}"
        )


# ---- the run -------------------------------------------------------------------------------------------------
def train_drafter(
    shard_paths: list[Path],
    target_dir: Path,
    mapping: VocabMapping,
    runs_dir: Path,
    cfg: TrainConfig,
    log: Log = print,
    init_from: Path | None = None,
    selector: RunSelector | None = None,
    records: RecordLoss | None = None,
) -> TrainResult:
    """Train (or resume, or return the finished) run for these shards, target, mapping and settings.

    `init_from`: a finished run's final/ directory to start from (warm start) instead of fresh weights.
    `selector`: measures the acceptance length during training and keeps the best weights (train.al_every,
    train.keep; evaluate/selection.py), given on rank 0 alone.
    `records`: how the samples of on-policy record shards count in the loss (onpolicy.loss); part of the
    run's identity.
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
            selector if world.is_main else None,
            records,
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
    selector: RunSelector | None,
    records: RecordLoss | None = None,
) -> TrainResult:
    dcfg = drafter_config_for(target_dir, mapping.draft_vocab_size, cfg.variant)
    _check_inputs(data, mapping, dcfg)
    warm = warm_start(init_from, mapping, dcfg) if init_from is not None else None
    train_refs, val_refs = data.split(cfg.val_fraction, cfg.max_val_samples)
    cfg, memory = _fit_batch_tokens(cfg, dcfg, world, data.refs, train_refs, val_refs)
    run_dir = runs_dir / run_id(
        cfg, mapping, str(data.facts.target_fingerprint), dcfg, warm.run if warm else None, records
    )
    if (run_dir / FINAL / SUMMARY).exists():
        return _finished(run_dir, log)
    check_batch_tokens(data.refs, cfg, world.size)  # validation batches keep to the budget too
    plan = schedule(train_refs, cfg, world.size)
    with run_lock(world, run_dir):  # one trainer per run directory, from its resume to its final/
        if (run_dir / FINAL / SUMMARY).exists():  # finished by the trainer that held it a moment ago
            return _finished(run_dir, log)
        return _run(
            world, data, target_dir, mapping, cfg, dcfg, warm, run_dir, plan, train_refs, val_refs, log,
            selector, memory, records,
        )  # fmt: skip


def _finished(run_dir: Path, log: Log) -> TrainResult:
    log(f"run {run_dir.name} already finished; nothing to train")
    return finished_result(run_dir, None)


def _run(
    world: World,
    data: TrainingData,
    target_dir: Path,
    mapping: VocabMapping,
    cfg: TrainConfig,
    dcfg: DrafterConfig,
    warm: WarmStart | None,
    run_dir: Path,
    plan: list[tuple[int, Rows]],
    train_refs: list[SampleRef],
    val_refs: list[SampleRef],
    log: Log,
    selector: RunSelector | None,
    memory: DeviceMemory | None,
    records: RecordLoss | None = None,
) -> TrainResult:
    """The run in `run_dir`, which this trainer holds: resume, train every step left, write final/ (with the
    weights the selector kept, if it kept other than the last)."""
    if memory is not None:  # the peak a run reports is its own, whatever this process ran before
        torch.cuda.reset_peak_memory_stats(world.device)
    s = build_setup(world, cfg, data, load_target_head(target_dir), mapping, dcfg, warm)
    s.records = records
    if warm is not None:
        log(f"starting from the weights of run {warm.run} ({warm.final_dir})")
    metrics = MetricsLog(run_dir / METRICS, world)
    progress = _resume(s, run_dir, metrics, log, selector)
    if plan and progress.step == len(plan):
        # cut short after its last checkpoint, before final/: the choice is made from what that checkpoint
        # saved of it, or, where it saved no measurement of the last step, by measuring it again (with the
        # confirmation); the last step's row is in the log already
        end_due = selector is not None and selector.end_due(progress.step)
        _measure_al(s, selector, metrics, progress.step, wanted=end_due, row=False)
    if warm is not None and progress.step == 0:
        # the weights started from are a candidate too: a run that only makes them worse keeps them
        _measure_al(s, selector, metrics, 0, wanted=selector is not None)
    log(
        f"training run {run_dir.name}: {len(train_refs)} samples "
        f"({f'{len(val_refs)} validation' if val_refs else 'no validation samples'}), {len(plan)} steps, "
        f"{world.size} process(es) on {world.device}{', FSDP' if s.sharded else ''}, attention {s.attention}, "
        f"{'bf16 autocast' if s.autocast_bf16 else 'float32'}"
        + (
            ", train.sharding fsdp: one process shards nothing"
            if cfg.sharding == "fsdp" and not s.sharded
            else ""
        )
    )
    started = time.perf_counter()
    _loop(s, plan, train_refs, val_refs, run_dir, metrics, progress, log, selector)
    seconds = round(time.perf_counter() - started, 2)
    gpu = _gpu_memory(world, memory, batch_budget(cfg))
    if gpu is not None:
        log(
            f"GPU memory: peak {gpu.peak_gib:.1f} GiB (the most of any rank), the preflight's estimate "
            f"{gpu.estimate_gib:.1f} GiB, {gpu.free_at_start_gib:.1f} GiB free at the start"
        )
    summary = _summary(
        s, run_dir, progress, seconds, dcfg, len(train_refs), len(val_refs), warm, selector, gpu
    )
    weights = _weights(s)  # every rank gathers, under FSDP; rank 0 alone writes final/
    if selector is not None and (kept := selector.kept_weights()) is not None:
        weights = kept
        log(_selection_line(summary))
    on_main(world, "writing the final drafter", lambda: _write_final(s, weights, run_dir, summary, log))
    return TrainResult(
        run_dir,
        run_dir / FINAL,
        progress.step,
        progress.tokens,
        seconds,
        summary.val.flat() if summary.val else {},
        progress.resumed_from,
        dcfg,
        summary,
    )


def _weights(s: Setup) -> dict[str, torch.Tensor]:
    """The drafter's weights as a run saves them, whole on rank 0 (under FSDP every rank calls this, as it
    gathers, and the others get none)."""
    state = drafter_state(s.drafter)
    return whole_state(state, s.world) if s.sharded else state


def _write_final(
    s: Setup, weights: dict[str, torch.Tensor], run_dir: Path, summary: RunSummary, log: Log
) -> None:
    needed = sum(t.nbytes for t in weights.values())
    with full_disk_stops_the_run(run_dir, "the final drafter", needed):
        write_final(run_dir, weights, s.drafter.cfg, s.mapping, summary)
    log(f"run {run_dir.name} finished: {run_dir / FINAL}")


def _fit_batch_tokens(
    cfg: TrainConfig,
    dcfg: DrafterConfig,
    world: World,
    refs: Sequence[SampleRef],
    train_refs: Sequence[SampleRef],
    val_refs: Sequence[SampleRef],
) -> tuple[TrainConfig, DeviceMemory | None]:
    """`cfg` with its batching and batch_tokens resolved (auto keeps to what the GPU holds), refused on a GPU
    whose free memory cannot hold the run (the preflight, before anything is allocated); and the GPU's memory
    facts the preflight went by (None on CPU)."""
    cfg = resolve_batching(cfg, numerics(cfg, world.device)[1])
    memory = device_memory(cfg, dcfg, world, refs)
    ceiling = memory.estimate.largest_batch_tokens(memory.free) if memory else None
    cfg = resolve_batch_tokens(cfg, train_refs, val_refs, world.size, ceiling)
    if memory is not None:
        check_training_memory(
            memory.estimate, batch_budget(cfg), memory.free, memory.total, memory.where, memory.sharded
        )
    return cfg, memory


def gpu_peak_gib(world: World) -> float | None:
    """The most GPU memory any rank has allocated since its count was last reset, in GiB; None on CPU. Every
    rank calls it (a collective)."""
    if world.device.type != "cuda":
        return None
    peak = torch.tensor([float(torch.cuda.max_memory_allocated(world.device))], device=world.device)
    return gib(world.max(peak).item())


def _gpu_memory(world: World, memory: DeviceMemory | None, batch_tokens: int) -> GpuMemory | None:
    """A GPU run's peak beside what the preflight estimated for it at `batch_tokens` (every rank calls it)."""
    peak = gpu_peak_gib(world)
    if memory is None or peak is None:
        return None
    return GpuMemory(
        device=memory.where,
        free_at_start_gib=gib(memory.free),
        estimate_gib=gib(memory.estimate.peak(batch_tokens)),
        peak_gib=peak,
    )


@dataclass
class Progress:
    """Where a run stands: steps taken, tokens logged, and the open log interval (this rank's sums)."""

    step: int
    tokens: int
    interval: TTTStats
    interval_tokens: int
    resumed_from: int | None = None
    interval_started: float = 0.0
    # the first step (since this process started) whose loss was not finite, -1 for none: a tensor on the
    # device, updated without a sync each step and read where the run logs or checkpoints (`_stop_if_diverged`)
    first_nonfinite: torch.Tensor | None = None


NO_CHECKPOINT = -1


def _resume_point(world: World, run_dir: Path, log: Log) -> Checkpoint | None:
    """The checkpoint every rank resumes from: rank 0 picks the newest that verifies (setting damaged ones
    aside, refusing when none is left), the other ranks load the step it picked."""
    picked = on_main(world, "choosing the checkpoint to resume from", lambda: resume_checkpoint(run_dir, log))
    step = world.from_main(picked.step if picked is not None else NO_CHECKPOINT)
    if world.is_main or step == NO_CHECKPOINT:
        return picked
    return load_checkpoint(checkpoint_dir(run_dir, step))


def _load_weights(s: Setup, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Whole saved weights into the drafter, sharded or not (the checks `load_drafter_state` makes)."""
    if not s.sharded:
        load_drafter_state(s.drafter, weights, where)
        return
    params = drafter_state(s.drafter)
    if params.keys() != weights.keys():
        raise Eagle3Error(
            f"{where}: drafter weights do not match (missing {sorted(params.keys() - weights.keys())}, "
            f"unexpected {sorted(weights.keys() - params.keys())})"
        )
    for name, param in params.items():
        copy_whole_into(param, weights[name])


def _resume(
    s: Setup, run_dir: Path, metrics: MetricsLog, log: Log, selector: RunSelector | None = None
) -> Progress:
    """The progress of the newest intact checkpoint, with the drafter, optimizer and RNG it saved loaded, and
    the selector (rank 0's) given what it saved; a fresh start (and a fresh metric log) without one."""
    world, steps = s.world, s.cfg.ttt_steps
    ckpt = _resume_point(world, run_dir, log)
    progress = Progress(0, 0, TTTStats.zeros(steps, world.device), 0)
    if ckpt is not None:
        _load_weights(s, ckpt.weights, ckpt.path)
        if s.sharded:
            load_whole_optimizer_state(s.optimizer, ckpt.optimizer)
        else:
            s.optimizer.load_state_dict(ckpt.optimizer)
        saved = ckpt.state
        torch.set_rng_state(torch.tensor(saved.rng_cpu, dtype=torch.uint8))
        progress = Progress(ckpt.step, saved.tokens, progress.interval, 0, resumed_from=ckpt.step)
        if world.is_main:  # the saved sums are over all ranks already: one rank carries them on
            sums = torch.tensor(saved.interval_sums, dtype=torch.float64, device=world.device)
            progress.interval, progress.interval_tokens = TTTStats(sums), saved.interval_tokens
        metrics.cut_to(saved.metrics_bytes)
        log(f"resuming run {run_dir.name} from step {ckpt.step}")
    elif world.is_main:
        metrics.cut_to(0)  # a run that never checkpointed starts its log afresh
    if selector is not None:
        selector.resume(
            run_dir,
            progress.step,
            ckpt.extra if ckpt is not None else None,
            ckpt.weights if ckpt is not None else None,
        )
    world.barrier()
    return progress


def _loop(
    s: Setup,
    plan: list[tuple[int, Rows]],
    train_refs: list[SampleRef],
    val_refs: list[SampleRef],
    run_dir: Path,
    metrics: MetricsLog,
    progress: Progress,
    log: Log,
    selector: RunSelector | None = None,
) -> None:
    """Every planned step from progress.step on: train, and log, validate, measure the acceptance length and
    checkpoint on their steps."""
    cfg, world = s.cfg, s.world
    pin = world.device.type == "cuda"
    width = row_width(cfg, world.size) if packs(cfg) else None
    prefetch, val_prefetch = (
        Prefetcher(
            s.data,
            refs,
            cfg.max_len,
            threads=cfg.loader_threads,
            depth=cfg.prefetch_batches,
            pin=pin,
            width=width,
            ttt_steps=cfg.ttt_steps,
        )
        for refs in (train_refs, val_refs)
    )
    started = progress.interval_started = time.perf_counter()
    try:
        local_batches = [batch[world.rank :: world.size] for _, batch in plan[progress.step :]]
        for batch in prefetch(local_batches):
            epoch = plan[progress.step][0]
            lr = learning_rate(progress.step, len(plan), cfg)
            stats = train_step(s, batch.to(world.device), lr)
            progress.interval = progress.interval + stats
            progress.interval_tokens += batch.tokens
            progress.step += 1
            _note_nonfinite(progress, stats)
            last = progress.step == len(plan)
            saves = progress.step % cfg.checkpoint_every == 0 or last
            if saves or progress.step % cfg.log_every == 0:  # nothing diverged is logged, measured or saved
                _stop_if_diverged(s, progress, run_dir, weights=saves)
            if progress.step % cfg.log_every == 0 or last:
                _log_interval(s, progress, epoch, lr, len(plan), started, metrics, log)
            if progress.step % cfg.eval_every == 0 or last:
                _validate_and_log(s, val_refs, val_prefetch, progress.step, metrics, log)
            elapsed = time.perf_counter() - started
            due = selector is not None and selector.due(progress.step, len(plan), elapsed)
            _measure_al(s, selector, metrics, progress.step, wanted=due)
            if progress.step % cfg.checkpoint_every == 0 or last:
                _checkpoint(s, run_dir, progress, metrics, selector)
    finally:
        prefetch.close()
        val_prefetch.close()


def _note_nonfinite(progress: Progress, stats: TTTStats) -> None:
    """Keep the step just taken as the first whose loss is not finite, if it is (on the device: no sync)."""
    bad = ~torch.isfinite(stats.sums[0]).all()
    first = progress.first_nonfinite
    if first is None:
        first = torch.full((), -1, dtype=torch.int64, device=stats.sums.device)
    progress.first_nonfinite = torch.where(bad & (first < 0), progress.step, first)


def _stop_if_diverged(s: Setup, progress: Progress, run_dir: Path, weights: bool) -> None:
    """TrainingDivergedError, on every rank, when a step's loss was not finite on any rank, or (`weights`: at a
    checkpoint) the weights are not: before the step is logged, measured or checkpointed, so every checkpoint
    kept holds finite weights. The message names the first such step and what to do: a lower train.lr, which
    is another run (the run id follows the settings)."""
    world, cfg = s.world, s.cfg
    local = int(progress.first_nonfinite.item()) if progress.first_nonfinite is not None else -1
    never = 1 << 62  # the least first step over the ranks, as a max of negatives
    first = -int(world.max(torch.tensor([-(local if local >= 0 else never)], device=world.device)).item())
    what = f"the loss is not finite at step {first}" if first != never else None
    if what is None and weights:
        bad = nonfinite_tensor(
            (name, p.to_local() if isinstance(p, DTensor) else p)
            for name, p in drafter_state(s.drafter).items()
        )
        if world.max(torch.tensor([int(bad is not None)], device=world.device)).item():
            what = f"the weights are not finite after step {progress.step} ({bad or 'on another rank'})"
    if what is None:
        return
    kept = [step for step, _ in list_checkpoints(run_dir)]
    saved = f"its checkpoints up to step {kept[-1]} are kept" if kept else "it saved no checkpoint"
    raise TrainingDivergedError(
        f"run {run_dir.name} diverged: {what}; stopped, without a final drafter ({saved}, their weights finite). "
        f"Lower train.lr ({cfg.lr}) and train again: that starts a new run from step 0 (the run id follows the "
        f"settings), and {run_dir} can be removed"
    )


def _measure_al(
    s: Setup, selector: RunSelector | None, metrics: MetricsLog, step: int, wanted: bool, row: bool = True
) -> None:
    """Where rank 0 `wanted` it (its selector found the step due), the acceptance length measured on rank 0
    (the other ranks wait for it at their next collective) and logged (`row`: to metrics.jsonl too)."""
    world = s.world
    if not world.from_main(int(wanted)):
        return
    drafter = s.drafter
    if s.sharded:  # every rank gathers the weights; rank 0 measures a whole copy
        weights = _weights(s)
        if world.is_main:  # its embedding stays unset: the probe puts in the target's own, as an export does
            drafter = Eagle3Drafter(s.drafter.cfg)
            load_drafter_state(drafter, weights, Path("the drafter in training"))

    def measure() -> ALRow:
        assert selector is not None  # due on rank 0 only where it has one
        return selector.measure(drafter, step)

    measured = on_main(world, f"measuring the acceptance length at step {step}", measure)
    if row:
        metrics.write(measured)


def _selection_line(summary: RunSummary) -> str:
    chosen = summary.selection
    if chosen is None:
        return "keeping the last step's weights"
    low, high = chosen.difference_ci95
    return (
        f"keeping step {chosen.kept_step}'s weights: AL {chosen.kept_al:.3f} against {chosen.last_al:.3f} at the "
        f"last step {chosen.last_step} (K={chosen.k}, {chosen.prompts} prompts; difference "
        f"{chosen.difference:+.3f}, 95% CI {low:+.3f} to {high:+.3f})"
    )


def _log_interval(
    s: Setup,
    progress: Progress,
    epoch: int,
    lr: float,
    total_steps: int,
    started: float,
    metrics: MetricsLog,
    log: Log,
) -> None:
    """The interval's record (summed over ranks) and log line; the next interval starts empty."""
    cfg = s.cfg
    now = time.perf_counter()
    reduced, n = _reduce_interval(s.world, progress.interval, progress.interval_tokens)
    progress.tokens += n
    weighted = sum(cfg.step_weight**k * x for k, x in enumerate(reduced.step_losses))
    tokens_per_s = n / max(now - progress.interval_started, 1e-9)
    metrics.write(
        TrainRow(
            step=progress.step,
            epoch=epoch,
            lr=lr,
            loss=round(weighted, 6),
            **dict(reduced.metrics()),
            tokens=progress.tokens,
            tokens_per_s=round(tokens_per_s, 1),
            elapsed_s=round(now - started, 2),
            peak_gpu_gib=gpu_peak_gib(s.world),
        )
    )
    log(
        f"step {progress.step}/{total_steps} loss {weighted:.3f} acc_0 {reduced.acc[0]:.3f} "
        f"tau_{cfg.ttt_steps} {reduced.tau(cfg.ttt_steps):.2f} {tokens_per_s:,.0f} tok/s"
    )
    progress.interval = TTTStats.zeros(cfg.ttt_steps, s.world.device)
    progress.interval_tokens, progress.interval_started = 0, now


def _summary(
    s: Setup,
    run_dir: Path,
    progress: Progress,
    seconds: float,
    dcfg: DrafterConfig,
    train_samples: int,
    val_samples: int,
    warm: WarmStart | None,
    selector: RunSelector | None = None,
    gpu: GpuMemory | None = None,
) -> RunSummary:
    """final/summary.json: what the run was trained from and with, its last validation, and which measured
    step's weights it kept."""
    facts = s.data.facts.trained_from()
    rows = read_metrics(run_dir) if s.world.is_main else []
    final_val = [r for r in rows if isinstance(r, ValRow)]
    measured = [r.step for r in rows if isinstance(r, ALRow)]
    return RunSummary(
        run=run_dir.name,
        steps=progress.step,
        tokens=progress.tokens,
        seconds=seconds,
        val=final_val[-1].metrics() if final_val else None,
        drafter_config=dcfg.model_dump(),
        vocab_mapping=s.mapping.fingerprint,
        target_fingerprint=facts.target_fingerprint,
        aux_layer_ids=facts.aux_layer_ids,
        aux_layer_convention=facts.aux_layer_convention,
        final_state_convention=facts.final_state_convention,
        train_samples=train_samples,
        val_samples=val_samples,
        world_size=s.world.size,
        attention=s.attention,
        bf16=s.autocast_bf16,
        train_config=s.cfg.model_dump(),
        warm_from=warm.run if warm else None,
        selection=selector.selection(measured) if selector is not None else None,
        gpu_memory=gpu,
    )


def _reduce_interval(world: World, interval: TTTStats, tokens: int) -> tuple[TTTStats, int]:
    """The interval's statistics and token count summed over ranks (on the CPU), leaving the local ones as they are."""
    sums = world.sum(interval.sums.clone()).cpu()
    n = world.sum(torch.tensor([tokens], dtype=torch.float64, device=world.device))
    return TTTStats(sums), int(n.item())


def _checkpoint(
    s: Setup, run_dir: Path, progress: Progress, metrics: MetricsLog, selector: RunSelector | None = None
) -> None:
    # Every rank's interval sums go into the checkpoint, summed, so a resumed run logs the same interval.
    reduced, n = _reduce_interval(s.world, progress.interval, progress.interval_tokens)
    # under FSDP every rank gathers what rank 0 saves, whole: the format DDP saves
    weights = _weights(s) if s.sharded else {}
    optimizer_state = whole_optimizer_state(s.optimizer, s.world) if s.sharded else {}

    def save() -> None:
        state = RunProgress(
            tokens=progress.tokens,
            interval_sums=reduced.sums.tolist(),
            interval_tokens=n,
            metrics_bytes=metrics.durable_size(),
            rng_cpu=torch.get_rng_state().tolist(),
        )
        save_checkpoint(
            run_dir,
            progress.step,
            weights if s.sharded else drafter_state(s.drafter),
            optimizer_state if s.sharded else s.optimizer.state_dict(),
            state,
            s.cfg.keep_checkpoints,
            # what the choice of the kept weights stands on at this step, so it survives any kill (rank 0's)
            selector.saved(progress.step) if selector is not None else None,
        )

    on_main(s.world, f"saving the checkpoint of step {progress.step}", save)
