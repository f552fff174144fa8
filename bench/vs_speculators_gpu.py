"""eagle3's trainer against vllm-project/speculators 0.9.0's on one GPU, on identical shards, at real widths.

    python -m bench.vs_speculators_gpu                                  # hidden 4096 and 7168, TTT 3 and 7
    python -m bench.vs_speculators_gpu --hidden 4096 --ttt 7 --skip-speculators
    python -m bench.vs_speculators_gpu --device cpu --tiny --skip-speculators   # a smoke test of the script

For each width: a random-weight Llama target (vocab 32,000) saved in bf16, shards extracted from it by the real
extraction path (bf16, lengths 256..2048), a draft vocabulary of 32,000 counted from them, and the same states
converted to speculators' offline layout. Then for each TTT length both trainers train on about 16k tokens a
step (eagle3: train.batch_tokens; speculators: --total-seq-len), bf16, flex attention, their default recipes
otherwise:
- eagle3: its train_step on the planned batches, warm-up steps untimed (flex compiles there), CUDA-event step
  times, torch's peak allocated memory;
- speculators: `speculators train` in a child process with --max-steps and --log-freq 1; tokens/s from its own
  step timer (its log's profile: tokens over the step's wall time), the steps after the same warm-up; its
  peak allocated memory over the run and the largest memory it logs after a forward.
Tokens are the real (unpadded) tokens of a step for both. MFU counts the drafter's forward and backward
(3x its forward FLOPs) and the teacher's head, against the H200's dense bf16 peak of 989 TFLOP/s; recomputation
is not counted as useful work. `--prompt-share S` loss-masks each sample's first share S of tokens, as a
chat's prompt is (default 0: every token counts). eagle3 then drafts only from the entries a loss reads
(`drafted_share` of them) while speculators computes every entry; MFU is still counted on the whole step's
work, what speculators does, so it reads as the speed of the whole step. Results: bench/results/vs_speculators_gpu_h200.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._speculators import (
    SpeculatorsSettings,
    train_speculators,
    write_offline_dataset,
    write_vocab_files,
)
from bench._training import (
    DataSpec,
    TrainingSet,
    guarded,
    intermediate_for,
    load_batches,
    steady_steps,
    time_training,
    training_plan,
    training_set,
)
from eagle3_core.config import TrainConfig
from eagle3_core.draft.model import DrafterConfig, Packing
from eagle3_core.errors import ConfigError
from eagle3_core.targets.head import TargetHead, load_target_head
from eagle3_core.train.data import Batch, TrainingData
from eagle3_core.train.distributed import World
from eagle3_core.train.loss import TTTStats, lean_ttt_loss, ttt_loss
from eagle3_core.train.memory import gib
from eagle3_core.train.trainer import (
    Setup,
    build_setup,
    drafter_config_for,
    teacher_targets,
    train_drafter,
    train_step,
)

REPO = Path(__file__).resolve().parents[1]
PEAK_BF16_FLOPS = 989e12  # H200 SXM, dense bf16
STARTED = time.perf_counter()
SIZES = {
    "full": {"vocab": 32000, "k": 32000, "layers": 8, "samples": 128, "min_len": 256, "max_len": 2048},
    "tiny": {"vocab": 512, "k": 256, "layers": 8, "samples": 48, "min_len": 16, "max_len": 160},
}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--ttt", type=lambda s: [int(x) for x in s.split(",")], default=[3, 7])
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke test of the script)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--skip-speculators", action="store_true")
    p.add_argument(
        "--warm-only",
        action="store_true",
        help="only compile: every trainer's warm-up at once (speculators in children beside eagle3), nothing "
        "timed, so that a timed run after it, on the same machine with the same TORCHINDUCTOR_CACHE_DIR, "
        "finds its kernels compiled",
    )
    p.add_argument(
        "--compile",
        type=lambda s: s.split(","),
        default=["auto"],
        help="eagle3's train.compile values to run, comma-separated (auto,off to see what compiling gives)",
    )
    p.add_argument(
        "--batching",
        type=lambda s: s.split(","),
        default=["auto"],
        help="eagle3's train.batching values to run, comma-separated (pack,pad to see what packing gives)",
    )
    p.add_argument("--profile", action="store_true", help="print eagle3's top CUDA kernels over 2 steps")
    p.add_argument("--check-lean", action="store_true", help="the lean loss against the plain one, one batch")
    p.add_argument(
        "--check-attention",
        action="store_true",
        help="flex attention's loss and gradients against SDPA's, float32, one batch's first 4,096 entries",
    )
    p.add_argument(
        "--check-preflight",
        type=int,
        default=0,
        metavar="TOKENS",
        help="first, train_drafter at TTT 7 with batch_tokens=TOKENS, which the GPU cannot hold: the refusal, "
        "its time and the memory allocated by then",
    )
    p.add_argument("--speculators-loss", choices=["fused", "eager"], default="eager")
    p.add_argument(
        "--prompt-share",
        type=float,
        default=0.0,
        help="each sample's first share of tokens loss-masked, as a chat's prompt is (default 0: all count)",
    )
    p.add_argument("--keep-data", action="store_true", help="keep each width's shards (default: removed)")
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench-gpu")
    p.add_argument("--results", type=Path, default=None)
    for name, value in SIZES["full"].items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    args = p.parse_args()
    for name, value in SIZES["tiny" if args.tiny else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.hidden is None:
        args.hidden = [64] if args.tiny else [4096, 7168]
    if args.tiny:
        args.batch_tokens = min(args.batch_tokens, 640)
    if args.warm_only:
        args.keep_data = True  # the timed run after it reads the same shards
    args.workdir = args.workdir.resolve()
    return args


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def guarded_run(what: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`guarded`, and the GPU's memory freed after: an OOM in one run still leaves the others' numbers."""
    try:
        return guarded(what, fn, log)
    finally:
        free_memory()


# ---- the FLOP count ------------------------------------------------------------------------------------------
def flops_per_token(dcfg: DrafterConfig, ttt: int, mean_context: float) -> float:
    """Useful FLOPs per token of one training step: 3x the drafter's forward over `ttt` steps, plus the
    teacher's head (forward only). `mean_context`: the keys a query attends to on average (T/2 causal)."""
    h, hq, hkv = dcfg.hidden_size, dcfg.num_heads * dcfg.dim, dcfg.num_kv_heads * dcfg.dim
    per_step = 2 * (
        2 * h * (hq + 2 * hkv) + hq * h + 3 * h * dcfg.intermediate_size + h * dcfg.draft_vocab_size
    )
    attention = 4 * hq * mean_context
    features = 2 * dcfg.num_aux * dcfg.target_hidden_size * h
    forward = features + ttt * (per_step + attention)
    teacher = 2 * dcfg.target_hidden_size * dcfg.target_vocab_size
    return 3 * forward + teacher


def drafted_share(batches: list[Batch]) -> float:
    """The share of a packed batch's entries eagle3 drafts from (the rest only give step 0's keys); 1 padded."""
    packed = [b.packing for b in batches if b.packing is not None and b.packing.drafted is not None]
    if not packed:
        return 1.0
    return round(sum(p.drafted.numel() for p in packed) / sum(p.doc.numel() for p in packed), 3)  # type: ignore[union-attr]


def mean_context(lengths: list[int]) -> float:
    """Keys per query under a causal mask, averaged over tokens: sum(T^2/2) / sum(T)."""
    return sum(n * (n + 1) / 2 for n in lengths) / max(1, sum(lengths))


# ---- eagle3 --------------------------------------------------------------------------------------------------
def eagle3_run(
    args: argparse.Namespace,
    ts: TrainingSet,
    head: TargetHead,
    ttt: int,
    compile_mode: str = "auto",
    batching: str = "auto",
) -> dict[str, Any]:
    device = torch.device(args.device)
    cfg = TrainConfig(
        compile=compile_mode,  # type: ignore[arg-type]
        batching=batching,  # type: ignore[arg-type]
        draft_vocab_size=args.k,
        batch_tokens=args.batch_tokens,
        max_len=args.max_len,
        ttt_steps=ttt,
        precision="bfloat16",
        attention="flex" if device.type == "cuda" else "sdpa",
        device=args.device,
    )
    data = TrainingData(ts.shard_paths)
    try:
        mapping = ts.mapping()
        dcfg = drafter_config_for(ts.target_dir, mapping.draft_vocab_size, cfg.variant)
        plan = training_plan(data.refs, cfg, cfg.attention)  # type: ignore[arg-type]
        n = args.warmup + args.steps
        batches = load_batches(data, data.refs, plan, n, pin=device.type == "cuda")
        free_memory()
        s = build_setup(World(0, 1, device), plan.cfg, data, head, mapping, dcfg)
        if args.warm_only:
            return warm_up(s, batches[: args.warmup])
        result = time_training(s, batches, args.warmup)
        if device.type == "cuda":
            result["peak_allocated_gib"] = gib(torch.cuda.max_memory_allocated(device))
        result["batching"] = plan.cfg.batching
        result["drafted_share"] = drafted_share(batches[args.warmup :])
        result["drafted_entries"] = [
            b.packing.drafted.shape[1]
            for b in batches
            if b.packing is not None and b.packing.drafted is not None
        ]
        lengths = plan.lengths(data.refs, plan.first(n)[args.warmup :])
        result["flops_per_token"] = flops_per_token(dcfg, ttt, mean_context(lengths))
        if args.profile and device.type == "cuda":
            profile_steps(s, batches[args.warmup : args.warmup + 2])
        if args.check_attention:  # on a few samples: SDPA holds every step's [M, T] scores
            few = first_entries(batches[args.warmup], 4096)
            result["flex_vs_sdpa"] = guarded_run("flex vs sdpa", partial(flex_vs_sdpa, s, few))
            log(f"  flex vs sdpa: {result['flex_vs_sdpa']}")
        if args.check_lean:  # on a few samples: the plain form holds every step's logits
            few = first_entries(batches[args.warmup], 8192)
            result["lean_vs_plain"] = guarded_run("lean vs plain", partial(lean_vs_plain, s, few))
        del s
        return result
    finally:
        data.close()


def preflight_run(args: argparse.Namespace, ts: TrainingSet, root: Path) -> dict[str, Any]:
    """The real entry point, train_drafter, asked for a run the GPU cannot hold: it must refuse before
    anything is allocated or a run directory made, with the estimate, the free memory and what fits."""
    runs = root / "preflight-runs"
    cfg = TrainConfig(
        draft_vocab_size=args.k,
        batch_tokens=args.check_preflight,
        max_len=args.max_len,
        ttt_steps=7,
        precision="bfloat16",
        attention="flex",
        device=args.device,
    )
    free_memory()
    started = time.perf_counter()
    try:
        train_drafter(ts.shard_paths, ts.target_dir, ts.mapping(), runs, cfg, log=log)
    except ConfigError as refused:
        return {
            "refused": str(refused),
            "seconds": round(time.perf_counter() - started, 2),
            "peak_allocated_gib": gib(torch.cuda.max_memory_allocated()),
            "run_dirs_made": sorted(p.name for p in runs.iterdir()) if runs.exists() else [],
        }
    return {"error": f"batch_tokens={args.check_preflight} was not refused"}


def warm_up(s: Setup, batches: list[Batch]) -> dict[str, Any]:
    """The warm-up steps alone (where everything compiles), timed only as a whole."""
    started = time.perf_counter()
    for batch in batches:
        train_step(s, batch.to(s.world.device), s.cfg.lr)
    if s.world.device.type == "cuda":
        torch.cuda.synchronize(s.world.device)
    return {"warm_s": round(time.perf_counter() - started, 1), "steps": len(batches)}


def first_entries(batch: Batch, n: int) -> Batch:
    """A smaller batch for the plain loss (which holds every step's logits): its first rows of at most n
    padded entries in all, or the first n entries of a packed row (n a multiple of flex's block)."""
    if batch.packing is None:
        rows = max(1, n // batch.input_ids.shape[1])
        return Batch(batch.input_ids[:rows], batch.loss_mask[:rows], batch.aux[:rows], batch.last[:rows], 0)
    p = batch.packing
    cut = (slice(None), slice(0, n))
    return Batch(
        batch.input_ids[cut],
        batch.loss_mask[cut],
        batch.aux[cut],
        batch.last[cut],
        0,
        Packing(p.doc[cut], p.positions[cut]),
    )


def profile_steps(s: Setup, batches: list[Batch]) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for batch in batches:
            train_step(s, batch.to(s.world.device), s.cfg.lr)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30), flush=True)


def loss_and_grads(s: Setup, loss_of: Callable[[], tuple[torch.Tensor, TTTStats]]) -> dict[str, Any]:
    """One backward of loss_of(): the loss, its statistics and every parameter's gradient (float32 copies)."""
    s.drafter.zero_grad(set_to_none=True)
    loss, stats = loss_of()
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in s.drafter.named_parameters() if p.grad is not None}
    s.drafter.zero_grad(set_to_none=True)
    return {"loss": float(loss.detach()), "stats": stats, "grads": grads}


def compared(names: tuple[str, str], want: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """Two `loss_and_grads` results side by side: losses, top-1 agreement, gradients' relative differences."""
    rel = {
        n: float((got["grads"][n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in want["grads"].items()
    }
    reference, other = names
    return {
        f"loss_{reference}": want["loss"],
        f"loss_{other}": got["loss"],
        "loss_rel_diff": abs(got["loss"] - want["loss"]) / abs(want["loss"]),
        f"acc_{reference}": want["stats"].acc,
        f"acc_{other}": got["stats"].acc,
        "grad_rel_diff_max": max(rel.values()),
        "grad_rel_diff": rel,
    }


def flex_vs_sdpa(s: Setup, batch: Batch) -> dict[str, Any]:
    """One batch's loss and gradients with flex attention (compiled: the prefix by flex, the chain merged
    through its log-sum-exp) and with SDPA (dense masks), in float32 without autocast, so that what differs
    is the attention path and not bf16 rounding."""
    batch = batch.to(s.world.device)
    targets = teacher_targets(s, batch)

    def loss_with(attention: str) -> tuple[torch.Tensor, TTTStats]:
        states = s.drafter(
            batch.aux.float(), batch.input_ids, s.cfg.ttt_steps, attention, "states", batch.packing
        )
        return lean_ttt_loss(states, s.drafter.lm_head.weight, targets, s.cfg.step_weight)

    sdpa = loss_and_grads(s, partial(loss_with, "sdpa"))
    return compared(("sdpa", "flex"), sdpa, loss_and_grads(s, partial(loss_with, "flex")))


def lean_vs_plain(s: Setup, batch: Batch) -> dict[str, Any]:
    """One batch's loss, statistics and gradients by the lean loss and by the plain one (whole logits)."""
    batch = batch.to(s.world.device)
    targets = teacher_targets(s, batch)

    def states() -> list[torch.Tensor]:
        with s.autocast():
            return s.drafter(
                batch.aux, batch.input_ids, s.cfg.ttt_steps, s.attention, "states", batch.packing
            )

    def plain() -> tuple[torch.Tensor, TTTStats]:
        with s.autocast():
            return ttt_loss([s.drafter.lm_head(x) for x in states()], targets, s.cfg.step_weight)

    def lean() -> tuple[torch.Tensor, TTTStats]:
        weight = s.drafter.lm_head.weight
        return lean_ttt_loss(states(), weight, targets, s.cfg.step_weight, None, "kl", torch.bfloat16)

    return compared(("plain", "lean"), loss_and_grads(s, plain), loss_and_grads(s, lean))


# ---- speculators ---------------------------------------------------------------------------------------------
def speculators_settings(
    args: argparse.Namespace, ts: TrainingSet, head: TargetHead, ttt: int, root: Path
) -> SpeculatorsSettings:
    """speculators' flags for `ttt` steps on the training set, its offline layout written first (or reused)."""
    if head.final_norm is None:
        raise RuntimeError("the random target has no final norm")
    offline = write_offline_dataset(
        ts.shard_paths,
        head.final_norm,
        root / "speculators",
        val_fraction=0.1,  # only speculators validates here; it needs both splits
        max_val=512,
        states_dtype=torch.bfloat16,
        log=log,
    )
    d2t, t2d = write_vocab_files(ts.mapping(), root / "speculators-vocab")
    gpu = args.device == "cuda"
    steps = 1 if args.warm_only else args.warmup + args.steps
    return SpeculatorsSettings(
        verifier=ts.target_dir,
        data=offline.root,
        d2t=d2t,
        t2d=t2d,
        draft_vocab_size=args.k,
        epochs=1,
        ttt_steps=ttt,
        total_seq_len=args.batch_tokens,
        train_data_ratio=offline.train_data_ratio,
        target_layer_ids=offline.aux_layer_ids,
        hidden_states_dtype="bfloat16" if gpu else "float32",
        loss_implementation=args.speculators_loss,
        num_workers=8 if gpu else 0,
        draft_attn_impl="simple_flex_attention" if gpu else "sdpa",
        extra=("--max-steps", str(steps), "--log-freq", "1"),
    )


def speculators_run(
    args: argparse.Namespace, ts: TrainingSet, head: TargetHead, ttt: int, root: Path
) -> dict[str, Any]:
    settings = speculators_settings(args, ts, head, ttt, root)
    if args.warm_only:
        started = time.perf_counter()
        train_speculators(settings, root / f"speculators-run-ttt{ttt}", log)
        return {"warm_s": round(time.perf_counter() - started, 1), "steps": 1}
    result = train_speculators(settings, root / f"speculators-run-ttt{ttt}", log)
    profiles = [r["profile"] for r in result["train_steps"] if r.get("profile")]
    timed = profiles[args.warmup :]
    if not timed:
        raise RuntimeError(f"speculators logged {len(profiles)} timed steps, none after the warm-up")
    seconds = [p["step_ms"] / 1000 for p in timed]
    tokens = [p["tokens_per_s"] * s for p, s in zip(timed, seconds, strict=True)]
    steady = steady_steps(seconds)  # the same rule as eagle3's: a step that compiled is not a steady one
    after_forward = [p.get("memory_mb", {}).get("fwd", 0.0) for p in profiles]
    peak = result.get("peak_allocated_bytes")
    return {
        "steps": len(timed),
        "tokens": round(sum(tokens)),
        "tokens_per_s": round(sum(tokens[i] for i in steady) / sum(seconds[i] for i in steady), 1),
        "all_steps_tokens_per_s": round(sum(tokens) / sum(seconds), 1),
        "compile_steps": [i for i in range(len(seconds)) if i not in steady],
        "median_step_s": round(statistics.median(seconds), 3),
        "warmup_step_s": [round(p["step_ms"] / 1000, 2) for p in profiles[: args.warmup]],
        "peak_allocated_gib": gib(peak) if peak else None,
        "max_memory_after_forward_gib": gib(max(after_forward) * 2**20),
        "loss_implementation": args.speculators_loss,
    }


# ---- the comparison ------------------------------------------------------------------------------------------
def compare(eagle3: dict[str, Any], spec: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "tokens_per_s" in eagle3 and "flops_per_token" in eagle3:
        achieved = eagle3["tokens_per_s"] * eagle3["flops_per_token"]
        out["eagle3_tflops"] = round(achieved / 1e12, 1)
        out["eagle3_mfu"] = round(achieved / PEAK_BF16_FLOPS, 3)
        if spec and "tokens_per_s" in spec:
            out["speculators_mfu"] = round(
                spec["tokens_per_s"] * eagle3["flops_per_token"] / PEAK_BF16_FLOPS, 3
            )
    if spec and "tokens_per_s" in spec and "tokens_per_s" in eagle3:
        out["speed_ratio"] = round(eagle3["tokens_per_s"] / spec["tokens_per_s"], 2)
    if spec and spec.get("peak_allocated_gib") and eagle3.get("peak_allocated_gib"):
        out["memory_ratio"] = round(eagle3["peak_allocated_gib"] / spec["peak_allocated_gib"], 2)
    return out


def run_width(
    args: argparse.Namespace, hidden: int, save: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    spec = DataSpec(
        hidden=hidden,
        layers=args.layers,
        vocab=args.vocab,
        intermediate=intermediate_for(hidden),
        draft_vocab=args.k,
        shards=2,
        samples_per_shard=args.samples // 2,
        min_len=args.min_len,
        max_len=args.max_len,
        device=args.device,
        prompt_share=args.prompt_share,
    )
    ts = training_set(args.workdir, spec, log)
    head = load_target_head(ts.target_dir)
    root = ts.target_dir.parent
    rows: dict[str, Any] = {"data": {"tokens": ts.tokens, "samples": ts.samples, "spec": spec.__dict__}}
    try:
        if args.check_preflight and args.device == "cuda":
            rows["preflight"] = guarded_run("preflight", partial(preflight_run, args, ts, root))
            log(f"  preflight: {rows['preflight']}")
            save(rows)
        if args.warm_only:
            rows.update(warm_width(args, ts, head, root))
            save(rows)
            return rows
        for ttt in args.ttt:
            runs = {}
            for mode in args.compile:
                for batching in args.batching:
                    name = f"compile {mode}, batching {batching}"
                    log(f"hidden {hidden}, TTT {ttt}: eagle3 ({name})")
                    runs[name] = guarded_run(
                        "eagle3", partial(eagle3_run, args, ts, head, ttt, mode, batching)
                    )
                    log(f"  eagle3: {line(runs[name])}")
            eagle3 = next(iter(runs.values()))
            spec_result = None
            # eagle3's row first: speculators' first step can compile past a command's time limit
            rows[f"ttt{ttt}"] = {"eagle3": eagle3, "eagle3_variants": runs, "speculators": None}
            save(rows)
            if not args.skip_speculators:
                log(f"hidden {hidden}, TTT {ttt}: speculators")
                spec_result = guarded_run("speculators", partial(speculators_run, args, ts, head, ttt, root))
                log(f"  speculators: {line(spec_result)}")
            rows[f"ttt{ttt}"] = {
                "eagle3": eagle3,
                "eagle3_variants": runs,
                "speculators": spec_result,
                **compare(eagle3, spec_result),
            }
            log(f"  {json.dumps(compare(eagle3, spec_result))}")
            save(rows)
    finally:
        if not args.keep_data:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def warm_width(args: argparse.Namespace, ts: TrainingSet, head: TargetHead, root: Path) -> dict[str, Any]:
    """--warm-only: every TTT length's speculators warm-up at once (each a child process, waited on by a
    thread), and eagle3's in this process meanwhile. Compiling is mostly host work, so on a 16-core host
    they overlap; the speculators layout is written once before the children start."""
    from concurrent.futures import ThreadPoolExecutor

    rows: dict[str, Any] = {}
    with ThreadPoolExecutor(max_workers=len(args.ttt)) as pool:
        pending = {}
        if not args.skip_speculators:
            speculators_settings(args, ts, head, args.ttt[0], root)  # the shared layout, before the children
            for ttt in args.ttt:
                run = partial(speculators_run, args, ts, head, ttt, root)
                pending[ttt] = pool.submit(guarded, f"speculators warm-up, TTT {ttt}", run, log)
        for ttt in args.ttt:
            log(f"warming eagle3 up, TTT {ttt}")
            rows[f"ttt{ttt}"] = {"eagle3": guarded_run("eagle3", partial(eagle3_run, args, ts, head, ttt))}
            log(f"  eagle3 warm-up: {rows[f'ttt{ttt}']['eagle3']}")
        for ttt, future in pending.items():
            rows[f"ttt{ttt}"]["speculators"] = future.result()
            log(f"  speculators warm-up, TTT {ttt}: {rows[f'ttt{ttt}']['speculators']}")
    return rows


def line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"FAILED {r['error'][:200]}"
    return f"{r['tokens_per_s']:,.0f} tokens/s, median step {r['median_step_s']}s, peak {r.get('peak_allocated_gib')} GiB"


def main() -> int:
    args = parse_args()
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "widths": {},
    }
    out = args.results or (
        REPO / "bench" / "results" / "vs_speculators_gpu_h200.json"
        if args.device == "cuda"
        else args.workdir / "vs_speculators_gpu.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows: dict[str, Any], hidden: int) -> None:  # after every row: a run cut short keeps its rows
        results["widths"][str(hidden)] = rows
        out.write_text(json.dumps(results, indent=1) + "\n")

    for hidden in args.hidden:
        run_width(args, hidden, partial(save, hidden=hidden))
    log(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
