"""Synthetic training inputs for the training benches, made the way the pipeline makes real ones.

A random-weight Llama target, shards of hidden states extracted from it by the real extraction path
(TransformersTarget + the streamed shard writer, bf16 storage, the header facts `steps.data.extract_step`
writes), and a vocab mapping counted from those shards. Built once per spec under a root directory and
reused when its marker is there, so DDP workers (and a second run) read what the first process built.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from bench._common import extract_to_shard, random_sequences, save_random_target
from eagle3_core.config import TargetConfig, TrainConfig
from eagle3_core.conventions import AUX_LAYER_CONVENTION
from eagle3_core.draft.vocab import VocabMapping, build_vocab_mapping, load_vocab_mapping, save_vocab_mapping
from eagle3_core.steps.data import length_batches
from eagle3_core.store.records import ShardFacts
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.train.data import Batch, Prefetcher, Rows, SampleRef, TrainingData
from eagle3_core.train.schedule import packs, resolve_batching, row_width, schedule
from eagle3_core.train.trainer import Setup, train_step

Log = Callable[[str], None]
MARKER = "training_set.json"


@dataclass(frozen=True)
class DataSpec:
    hidden: int
    layers: int
    vocab: int
    intermediate: int
    draft_vocab: int  # K
    shards: int
    samples_per_shard: int
    min_len: int
    max_len: int  # sample lengths are uniform in [min_len, max_len)
    device: Literal["cpu", "cuda"]  # where the target runs during extraction
    extract_batch_tokens: int = 16384
    prompt_share: float = 0.0  # each sample's first share of tokens is loss-masked, as a chat's prompt is
    store_dtype: str = "bfloat16"  # extract.store_dtype of the shards
    heads: int | None = None  # the target's attention heads (None: save_random_target's default)
    kv_heads: int | None = None

    @classmethod
    def from_args(
        cls, args: Any, *, intermediate: int, device: Literal["cpu", "cuda"], **rest: Any
    ) -> DataSpec:
        """The spec of a bench's shared flags (--hidden --layers --vocab --k --samples-per-shard --min-len
        --max-len); `rest`: the other fields (two shards unless given)."""
        return cls(
            hidden=args.hidden,
            layers=args.layers,
            vocab=args.vocab,
            intermediate=intermediate,
            draft_vocab=args.k,
            samples_per_shard=args.samples_per_shard,
            min_len=args.min_len,
            max_len=args.max_len,
            device=device,
            **{"shards": 2, **rest},
        )

    def key(self) -> str:
        # fields left unset stay out, so a spec without them keeps the key (and the data) it had before them
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TrainingSet:
    target_dir: Path
    shard_paths: list[Path]
    mapping_dir: Path
    tokens: int
    samples: int

    def mapping(self) -> VocabMapping:
        return load_vocab_mapping(self.mapping_dir)


def intermediate_for(hidden: int) -> int:
    """The Llama MLP ratio, rounded to 64: 5632 at hidden 2048."""
    return max(64, round(hidden * 2.75 / 64) * 64)


def shard_metadata(target: TransformersTarget) -> ShardFacts:
    """The header facts the trainer checks, as `steps.data.extract_step` records them."""
    info = target.info
    return ShardFacts(
        target=info.facts(),
        tokenizer_fingerprint=target.tokenizer_fingerprint,
        aux_layer_ids=list(info.aux_layer_ids),
        aux_layer_convention=AUX_LAYER_CONVENTION,
        final_state_convention=info.final_state_convention,
    )


def _extract_shards(
    target: TransformersTarget, spec: DataSpec, shard_dir: Path, log: Log
) -> tuple[list[Path], int]:
    shard_dir.mkdir(parents=True, exist_ok=True)
    paths, tokens = [], 0
    for n in range(spec.shards):
        seqs = random_sequences(spec.samples_per_shard, spec.min_len, spec.max_len, spec.vocab, seed=100 + n)
        order = length_batches([len(s) for s in seqs], spec.extract_batch_tokens, 64)
        batches = [[seqs[i] for i in b] for b in order]
        path = shard_dir / f"train-{n:05d}.safetensors"
        seconds = extract_to_shard(
            target,
            batches,
            path,
            facts=shard_metadata(target),
            first_id=n * spec.samples_per_shard,
            prompt_share=spec.prompt_share,
            store_dtype=spec.store_dtype,
        )
        shard_tokens = sum(len(s) for s in seqs)
        log(f"  shard {path.name}: {len(seqs)} samples, {shard_tokens:,} tokens in {seconds:.1f}s")
        paths.append(path)
        tokens += shard_tokens
    return paths, tokens


def _build(root: Path, spec: DataSpec, log: Log) -> dict[str, Any]:
    shutil.rmtree(root, ignore_errors=True)
    started = time.perf_counter()
    target_dir = save_random_target(
        root / "target",
        hidden=spec.hidden,
        layers=spec.layers,
        vocab=spec.vocab,
        intermediate=spec.intermediate,
        init_device=spec.device,
        dtype=torch.bfloat16 if spec.device == "cuda" else torch.float32,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
    )
    log(f"  random target saved ({time.perf_counter() - started:.0f}s)")
    target = TransformersTarget(target_dir, TargetConfig(device=spec.device))
    try:
        paths, tokens = _extract_shards(target, spec, root / "shards", log)
        fingerprint = target.tokenizer_fingerprint
    finally:
        target.close()
    mapping = build_vocab_mapping(paths, spec.vocab, spec.draft_vocab, tokenizer_fingerprint=fingerprint)
    save_vocab_mapping(mapping, root / "vocab_mapping")
    return {
        "spec": asdict(spec),
        "shards": [p.name for p in paths],
        "tokens": tokens,
        "samples": spec.shards * spec.samples_per_shard,
        "build_s": round(time.perf_counter() - started, 1),
    }


def training_set(workdir: Path, spec: DataSpec, log: Log = print) -> TrainingSet:
    """The training set for `spec` under workdir/data-<key>, built unless an earlier run left it whole."""
    root = workdir / f"data-{spec.key()}"
    marker = root / MARKER
    if marker.exists():
        log(f"reusing training set {root}")
    else:
        log(
            f"building training set {root} (target hidden {spec.hidden}, {spec.layers} layers, vocab {spec.vocab})"
        )
        info = _build(root, spec, log)
        marker.write_text(json.dumps(info, indent=1) + "\n")  # last: a crashed build is rebuilt next time
    info = json.loads(marker.read_text())
    return TrainingSet(
        root / "target",
        [root / "shards" / name for name in info["shards"]],
        root / "vocab_mapping",
        info["tokens"],
        info["samples"],
    )


def sync(device: torch.device) -> None:
    """Wait for the GPU, so that a host timer read next covers the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Per-step seconds without synchronising between steps (which would hide the host's run-ahead):
    CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        if not self.cuda:
            return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:], strict=False)]


@dataclass(frozen=True)
class Plan:
    """One epoch's batches as the trainer plans them for one process, under a resolved config."""

    cfg: TrainConfig  # batching resolved
    batches: list[Rows]
    width: int | None  # the packed row width; None when padded

    def first(self, n: int) -> list[Rows]:
        """The first n batches, the epoch cycled if it is shorter."""
        return [self.batches[i % len(self.batches)] for i in range(n)]

    def prefetcher(self, data: TrainingData, refs: list[SampleRef], pin: bool) -> Prefetcher:
        """A Prefetcher of this plan's batches, with the config's loader settings, as the trainer builds one."""
        cfg = self.cfg
        return Prefetcher(
            data,
            refs,
            cfg.max_len,
            threads=cfg.loader_threads,
            depth=cfg.prefetch_batches,
            pin=pin,
            width=self.width,
            ttt_steps=cfg.ttt_steps,
        )

    def lengths(self, refs: list[SampleRef], batches: list[Rows]) -> list[int]:
        """The lengths (cut to max_len) of the samples in `batches`."""
        return [min(refs[i].length, self.cfg.max_len) for rows in batches for row in rows for i in row]


def training_plan(refs: list[SampleRef], cfg: TrainConfig, attention: Literal["sdpa", "flex"]) -> Plan:
    cfg = resolve_batching(cfg, attention)
    one_epoch = cfg.model_copy(update={"epochs": 1, "max_steps": None})
    return Plan(
        cfg, [rows for _, rows in schedule(refs, one_epoch, 1)], row_width(cfg, 1) if packs(cfg) else None
    )


def load_batches(data: TrainingData, refs: list[SampleRef], plan: Plan, n: int, pin: bool) -> list[Batch]:
    """The first n batches of the plan (cycled if the epoch is shorter), held in memory for the training timer."""
    chosen = plan.first(n)
    prefetch = plan.prefetcher(data, refs, pin)
    try:
        return list(prefetch(chosen))
    finally:
        prefetch.close()


def time_training(s: Setup, batches: list[Batch], warmup: int) -> dict[str, Any]:
    """Tokens/s of train_step over batches[warmup:], after the warm-up steps (where flex attention compiles).

    The host timer spans all timed steps, the device synchronised at both ends; per-step times come from
    CUDA events, so a recompile or a slow outlier shows without slowing the run down.
    """
    device = s.world.device
    warm = StepClock(device)
    warm.mark()
    for batch in batches[:warmup]:
        train_step(s, batch.to(device), s.cfg.lr)
        warm.mark()
    timed, clock = batches[warmup:], StepClock(device)
    sync(device)
    t0 = time.perf_counter()
    clock.mark()
    for batch in timed:
        train_step(s, batch.to(device), s.cfg.lr)
        clock.mark()
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(b.tokens for b in timed)
    steps = clock.seconds()
    steady = steady_steps(steps)
    return {
        "tokens": tokens,
        "steps": len(timed),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(sum(timed[i].tokens for i in steady) / sum(steps[i] for i in steady), 1),
        "all_steps_tokens_per_s": round(tokens / seconds, 1),
        "compile_steps": [i for i in range(len(steps)) if i not in steady],
        "step_s": [round(x, 3) for x in steps],
        "median_step_s": round(statistics.median(steps), 3),
        "warmup_steps": warmup,
        "warmup_step_s": [round(x, 2) for x in warm.seconds()],
        "attention": s.attention,
        "precision": "bf16 autocast" if s.autocast_bf16 else "float32",
    }


def steady_steps(seconds: list[float]) -> list[int]:
    """The steps that did not compile: all but those over 3x the median (a batch of a shape not seen yet
    compiles once, for seconds; a steady step varies by a few percent)."""
    median = statistics.median(seconds)
    return [i for i, x in enumerate(seconds) if x <= 3 * median]


def guarded(what: str, fn: Callable[[], dict[str, Any]], log: Log) -> dict[str, Any]:
    """fn's result, or its error: one failing part (an OOM, a compile error) still leaves the others' numbers."""
    try:
        return fn()
    except Exception as err:
        traceback.print_exc()
        log(f"{what} FAILED: {type(err).__name__}: {str(err)[:300]}")
        return {"error": f"{type(err).__name__}: {str(err)[:500]}"}
