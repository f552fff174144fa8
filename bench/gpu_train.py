"""Drafter training on GPUs: tokens/s and peak memory per precision and attention, flex against SDPA, DDP.

    python -m bench.gpu_train --all        # everything below, in this order (about 8 minutes on 2 H200s)
    python -m bench.gpu_train --variants   # one GPU: fp32 + sdpa, bf16 autocast + sdpa, bf16 autocast + flex
                                           # (compiled; warm-up steps untimed), peak memory of each, and the
                                           # draft logits of flex against sdpa (ttt_forward, 7 steps, bf16 and fp32)
    python -m bench.gpu_train --ddp        # train_drafter (flex, bf16) on 1 GPU here, then on 2 GPUs through
                                           # torchrun + NCCL; tokens/s of both, their final validation compared
    torchrun --standalone --nproc-per-node 2 bench/gpu_train.py --ddp   # one DDP run alone (what --ddp spawns)
    python -m bench.gpu_train --all --device cpu --tiny                 # smoke test on CPU (gloo), tiny sizes

The data: a random-weight Llama target (hidden 2048, 16 layers, vocab 32000), shards extracted from it by the
real extraction path (bf16 storage, lengths 64..2048), a K=32000 vocab mapping; built once under --workdir
and reused. Results go to bench/results/gpu_train_h200.json (a CPU run writes into --workdir instead); a
partial run (--variants or --ddp) updates its part of the file.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file (python or torchrun): import `bench` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._training import (
    DataSpec,
    TrainingSet,
    guarded,
    intermediate_for,
    load_batches,
    time_training,
    training_plan,
    training_set,
)
from eagle3_core.config import TrainConfig
from eagle3_core.draft.model import AttentionBackend
from eagle3_core.store.records import TrainRow
from eagle3_core.targets.head import TargetHead, load_target_head
from eagle3_core.train.data import Batch, TrainingData
from eagle3_core.train.distributed import World, exit_worker, pick_device
from eagle3_core.train.memory import gib
from eagle3_core.train.run_dir import read_metrics
from eagle3_core.train.schedule import schedule
from eagle3_core.train.trainer import build_setup, drafter_config_for, new_drafter, train_drafter

REPO = Path(__file__).resolve().parents[1]
STARTED = time.perf_counter()
# name -> (TrainConfig.precision, TrainConfig.attention)
VARIANTS: dict[str, tuple[str, str]] = {
    "fp32_sdpa": ("float32", "sdpa"),
    "bf16_sdpa": ("bfloat16", "sdpa"),
    "bf16_flex": ("bfloat16", "flex"),
}
SIZES = {  # the target and data; --tiny is for a CPU smoke test of the script itself
    "full": {
        "hidden": 2048,
        "layers": 16,
        "vocab": 32000,
        "k": 32000,
        "min_len": 64,
        "max_len": 2048,
        "samples_per_shard": 64,
        "batch_tokens": 16384,
        "warmup": 3,
        "steps": 8,
        "ddp_steps": 30,
    },
    "tiny": {
        "hidden": 128,
        "layers": 8,
        "vocab": 512,
        "k": 256,
        "min_len": 16,
        "max_len": 160,
        "samples_per_shard": 24,
        "batch_tokens": 640,
        "warmup": 1,
        "steps": 2,
        "ddp_steps": 8,
    },
}
# How close the 2-process run's final validation must be to the 1-process run's (same global batches; only
# the reduction order and bf16 rounding differ).
AGREE = {"loss_rel": 0.02, "acc_abs": 0.02}


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {msg}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--all", action="store_true", help="--variants, then --ddp")
    mode.add_argument("--variants", action="store_true", help="single-GPU variants and the flex/sdpa check")
    mode.add_argument(
        "--ddp", action="store_true", help="DDP 2 GPUs vs 1 (a worker when torchrun started us)"
    )
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke test)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cuda")
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench-gpu")
    p.add_argument(
        "--out", type=Path, default=None, help="default bench/results/gpu_train_h200.json on a GPU"
    )
    p.add_argument("--nproc", type=int, default=2, help="DDP processes")
    for name in SIZES["full"]:
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {SIZES['full'][name]}"
        )
    args = p.parse_args()
    args.workdir = args.workdir.resolve()  # run records hold paths under it; any cwd reads them back
    for name, value in SIZES["tiny" if args.tiny else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ---- data and config -----------------------------------------------------------------------------------------
def data_spec(args: argparse.Namespace, device: torch.device) -> DataSpec:
    return DataSpec.from_args(
        args, intermediate=intermediate_for(args.hidden), device="cuda" if device.type == "cuda" else "cpu"
    )


def base_config(args: argparse.Namespace, device: torch.device) -> TrainConfig:
    return TrainConfig(
        draft_vocab_size=args.k,
        batch_tokens=args.batch_tokens,
        max_len=args.max_len,
        device="cuda" if device.type == "cuda" else "cpu",
    )


def ddp_config(args: argparse.Namespace, device: torch.device) -> TrainConfig:
    """A short run through the real trainer: flex + bf16, logged every few steps, validated once at the end.

    epochs is only a ceiling (max_steps ends the run; this small set needs a few epochs for it).
    """
    return base_config(args, device).model_copy(
        update={
            "attention": training_attention("flex", device),
            "precision": "bfloat16",
            "max_steps": args.ddp_steps,
            "epochs": 100,
            "log_every": max(1, args.ddp_steps // 6),
            "eval_every": 10**6,
            "checkpoint_every": 10**6,
            "val_fraction": 0.1,
            "seed": 0,
        }
    )


def training_attention(attention: str, device: torch.device) -> str:
    """flex has no backward on CPU (torch raises NotImplementedError): a CPU smoke test trains with sdpa."""
    return "sdpa" if device.type == "cpu" else attention


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- single GPU: variants ------------------------------------------------------------------------------------
def run_variant(
    name: str,
    ts: TrainingSet,
    data: TrainingData,
    head: TargetHead,
    batches: list[Batch],
    cfg: TrainConfig,
    device: torch.device,
    warmup: int,
) -> dict[str, Any]:
    precision, attention = VARIANTS[name]
    if training_attention(attention, device) != attention:
        return {"skipped": f"{attention} has no backward on {device.type}"}
    cfg = cfg.model_copy(update={"precision": precision, "attention": attention})
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mapping = ts.mapping()
    dcfg = drafter_config_for(ts.target_dir, mapping.draft_vocab_size)
    out = guarded(
        f"variant {name}",
        lambda: time_training(
            build_setup(World(0, 1, device), cfg, data, head, mapping, dcfg), batches, warmup
        ),
        log,
    )
    if device.type == "cuda":
        out["peak_allocated_gib"] = gib(torch.cuda.max_memory_allocated(device))
        out["peak_reserved_gib"] = gib(torch.cuda.max_memory_reserved(device))
    return out


def errors(results: Any, where: str = "") -> list[str]:
    """Every part of the results that failed, by its path."""
    if not isinstance(results, dict):
        return []
    own = [f"{where}: {results['error']}"] if "error" in results else []
    return own + [e for k, v in results.items() for e in errors(v, f"{where}/{k}")]


def diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    a, b = a.float(), b.float()
    err = (a - b).abs().max().item()
    return {
        "max_abs": err,
        "max_rel": err / max(b.abs().max().item(), 1e-30),
        "top1_agree": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
    }


def compare_attention(
    ts: TrainingSet, head: TargetHead, batch: Batch, device: torch.device, steps: int
) -> dict[str, Any]:
    """Draft logits of ttt_forward under flex and under sdpa, same weights and batch, bf16 autocast and fp32."""
    mapping = ts.mapping()
    drafter = new_drafter(drafter_config_for(ts.target_dir, mapping.draft_vocab_size), head, mapping, seed=0)
    drafter = drafter.to(device).eval()
    batch = batch.to(device)
    out: dict[str, Any] = {"batch_shape": list(batch.input_ids.shape), "steps": steps}
    for name, bf16 in (("bf16", True), ("fp32", False)):
        aux = batch.aux if bf16 else batch.aux.float()
        ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
        logits: dict[AttentionBackend, list[torch.Tensor]] = {}
        with torch.no_grad(), ctx:
            for attention in ("sdpa", "flex"):
                logits[attention] = drafter.ttt_forward(aux, batch.input_ids, steps, attention)
        per_step = [diff(f, s) for f, s in zip(logits["flex"], logits["sdpa"], strict=True)]
        out[name] = {
            "max_abs_diff": max(d["max_abs"] for d in per_step),
            "max_rel_diff": max(d["max_rel"] for d in per_step),
            "min_top1_agreement": min(d["top1_agree"] for d in per_step),
            "per_step": per_step,
        }
        del logits
    return out


def variants(args: argparse.Namespace, ts: TrainingSet, device: torch.device) -> dict[str, Any]:
    cfg = base_config(args, device)
    data = TrainingData(ts.shard_paths)
    head = load_target_head(ts.target_dir)
    results: dict[str, Any] = {}
    try:
        # padded, as these variants were measured (and flex_vs_sdpa compares rows of one sample each)
        plan = training_plan(data.refs, cfg.model_copy(update={"batching": "pad"}), "sdpa")
        batches = load_batches(data, data.refs, plan, args.warmup + args.steps, pin=device.type == "cuda")
        log(
            f"{len(batches)} batches of {sum(b.tokens for b in batches) / len(batches):,.0f} real tokens on average"
        )
        for name in VARIANTS:
            log(f"variant {name}: {args.warmup} warm-up + {args.steps} timed steps")
            results[name] = run_variant(name, ts, data, head, batches, cfg, device, args.warmup)
            free_memory(device)
            log(f"  {summary_line(results[name])}")
        log("flex against sdpa: draft logits of ttt_forward")
        longest = max(batches, key=lambda b: b.input_ids.shape[1])
        results["flex_vs_sdpa"] = guarded(
            "flex vs sdpa",
            lambda: compare_attention(ts, head, last_rows(longest, 4), device, cfg.ttt_steps),
            log,
        )
        for p in ("bf16", "fp32") if "error" not in results["flex_vs_sdpa"] else ():
            r = results["flex_vs_sdpa"][p]
            log(
                f"  {p}: max abs diff {r['max_abs_diff']:.3g}, max rel diff {r['max_rel_diff']:.3g}, "
                f"top-1 agreement >= {r['min_top1_agreement']:.4f}"
            )
    finally:
        data.close()
        free_memory(device)
    return results


def last_rows(batch: Batch, n: int) -> Batch:
    """The last (longest: a batch is sorted by length) n samples of a batch: a long sequence, little memory."""
    return Batch(
        batch.input_ids[-n:],
        batch.loss_mask[-n:],
        batch.aux[-n:],
        batch.last[-n:],
        int((batch.loss_mask[-n:] > 0).sum()),
    )


def summary_line(r: dict[str, Any]) -> str:
    if "error" in r or "skipped" in r:
        return f"FAILED: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
    memory = f", peak {r['peak_allocated_gib']} GiB" if "peak_allocated_gib" in r else ""
    return (
        f"{r['tokens_per_s']:,.0f} tokens/s ({r['steps']} steps, median {r['median_step_s']}s a step, "
        f"warm-up {r['warmup_step_s']}s){memory}"
    )


# ---- DDP -----------------------------------------------------------------------------------------------------
def steady_rate(run_dir: Path, from_step: int | None = None) -> dict[str, Any]:
    """Tokens/s from the run's own log, from the row of `from_step` on (default: the end of the first log
    interval), so that compilation and start-up are left out."""
    train = [r for r in read_metrics(run_dir) if isinstance(r, TrainRow)]
    timed = [r for r in train if from_step is None or r.step >= from_step]
    first, last = timed[0], timed[-1]
    rate = (last.tokens - first.tokens) / max(last.elapsed_s - first.elapsed_s, 1e-9)
    return {
        "tokens_per_s": round(rate, 1),
        "from_step": first.step,
        "to_step": last.step,
        "train_loss": [r.loss for r in train],
        "interval_tokens_per_s": [r.tokens_per_s for r in train],
    }


def run_record(result: Any, world: int, from_step: int | None = None) -> dict[str, Any]:
    return {
        "world_size": world,
        "run_dir": str(result.run_dir),
        "steps": result.steps,
        "tokens": result.tokens,
        "seconds": result.seconds,
        "val": result.val,
        **steady_rate(result.run_dir, from_step),
    }


def ddp_worker(args: argparse.Namespace, device: torch.device) -> None:
    """One rank of a torchrun launch: the trainer's own DDP path; rank 0 writes the run's record."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ts = wait_for_training_set(args, device, rank)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")[:8]  # a fresh run directory per launch
    result = train_drafter(
        ts.shard_paths,
        ts.target_dir,
        ts.mapping(),
        args.workdir / "runs" / f"ddp{world}-{run_id}",
        ddp_config(args, device),
        log=log,
    )
    if rank == 0:
        (args.workdir / f"ddp-{world}.json").write_text(
            json.dumps(run_record(result, world), indent=1) + "\n"
        )


def wait_for_training_set(args: argparse.Namespace, device: torch.device, rank: int) -> TrainingSet:
    """Rank 0 builds the data if no earlier run did; the others wait for its marker (no process group yet)."""
    spec = data_spec(args, device)
    marker = args.workdir / f"data-{spec.key()}" / "training_set.json"
    deadline = time.monotonic() + 1800
    while rank != 0 and not marker.exists():
        if time.monotonic() > deadline:
            sys.exit(f"rank {rank}: no training set at {marker.parent} after 30 minutes")
        time.sleep(2)
    return training_set(args.workdir, spec, log if rank == 0 else (lambda _: None))


def spawn_ddp(args: argparse.Namespace) -> dict[str, Any]:
    """torchrun with --nproc processes running this script's --ddp worker; their rank 0's record."""
    out = args.workdir / f"ddp-{args.nproc}.json"
    out.unlink(missing_ok=True)
    passed = [a for a in sys.argv[1:] if a not in ("--all", "--variants", "--ddp")]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        str(Path(__file__).resolve()),
        "--ddp",
        *passed,
    ]
    log(f"spawning: {' '.join(cmd)}")
    subprocess.run(cmd, check=True)
    record: dict[str, Any] = json.loads(out.read_text())
    return record


def agreement(one: dict[str, Any], many: dict[str, Any]) -> dict[str, Any]:
    """The final validation metrics and the final weights of the two runs, side by side."""
    v1, v2 = one["val"], many["val"]
    loss_rel = max(abs(v1[k] - v2[k]) / max(abs(v1[k]), 1e-9) for k in v1 if k.startswith("loss_"))
    acc_abs = max(abs(v1[k] - v2[k]) for k in v1 if k.startswith(("acc_", "full_acc_")))
    tau_abs = max(abs(v1[k] - v2[k]) for k in v1 if k.startswith("tau_"))
    train_loss_abs = max(abs(a - b) for a, b in zip(one["train_loss"], many["train_loss"], strict=False))
    return {
        "val_loss_max_rel_diff": loss_rel,
        "val_acc_max_abs_diff": acc_abs,
        "val_tau_max_abs_diff": tau_abs,
        "val_counted_equal": v1["counted"] == v2["counted"],
        "train_loss_max_abs_diff": train_loss_abs,
        "final_weights": weight_diff(Path(one["run_dir"]), Path(many["run_dir"])),
        "tolerance": AGREE,
        "agree": loss_rel <= AGREE["loss_rel"]
        and acc_abs <= AGREE["acc_abs"]
        and v1["counted"] == v2["counted"],
    }


def weight_diff(a: Path, b: Path) -> dict[str, float]:
    from safetensors.torch import load_file

    wa, wb = (load_file(str(d / "final" / "drafter.safetensors")) for d in (a, b))
    worst = max(((wa[n] - wb[n]).abs().max() / wa[n].abs().max().clamp(min=1e-30)).item() for n in wa)
    return {"max_rel_diff_per_tensor": worst}


def same_global_batches(ts: TrainingSet, cfg: TrainConfig, world: int) -> bool:
    """Whether the schedule for `world` ranks is the 1-rank schedule (a batch needs >= world samples)."""
    data = TrainingData(ts.shard_paths)
    try:
        refs = data.split(cfg.val_fraction, cfg.max_val_samples)[0]
        return schedule(refs, cfg, 1) == schedule(refs, cfg, world)
    finally:
        data.close()


def ddp(args: argparse.Namespace, ts: TrainingSet, device: torch.device) -> dict[str, Any]:
    cfg = ddp_config(args, device)
    shutil.rmtree(
        args.workdir / "runs", ignore_errors=True
    )  # fresh runs: a finished run would just be returned
    same = same_global_batches(ts, cfg, args.nproc)
    log(
        f"DDP: train_drafter {cfg.max_steps} steps ({cfg.attention}, bf16), 1 process here; same global batches for "
        f"{args.nproc}: {same}"
    )
    one = run_record(
        train_drafter(
            ts.shard_paths, ts.target_dir, ts.mapping(), args.workdir / "runs" / "single", cfg, log=log
        ),
        1,
    )
    free_memory(device)
    log(f"  1 process: {one['tokens_per_s']:,.0f} tokens/s (steps {one['from_step']}-{one['to_step']})")
    many = guarded("DDP run", lambda: spawn_ddp(args), log)
    if "error" in many:
        return {"processes": args.nproc, "one": one, "many": many}
    log(
        f"  {args.nproc} processes: {many['tokens_per_s']:,.0f} tokens/s (steps {many['from_step']}-{many['to_step']})"
    )
    agree = agreement(one, many)
    log(
        f"  speed-up {many['tokens_per_s'] / one['tokens_per_s']:.2f}x; final validation: loss rel diff "
        f"{agree['val_loss_max_rel_diff']:.2e}, acc abs diff {agree['val_acc_max_abs_diff']:.2e}, "
        f"agree: {agree['agree']}"
    )
    return {
        "processes": args.nproc,
        "same_global_batches": same,
        "one": one,
        "many": many,
        "speedup": round(many["tokens_per_s"] / one["tokens_per_s"], 3),
        "agreement": agree,
        "train_config": cfg.model_dump(),
    }


# ---- the run -------------------------------------------------------------------------------------------------
def write_results(path: Path, update: dict[str, Any]) -> None:
    """Merge this run's parts into the results file (a --ddp run keeps an earlier --variants run's part)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old | update, indent=1, default=str) + "\n")
    log(f"results in {path}")


def main() -> None:
    args = parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        sys.exit(
            "bench/gpu_train.py needs a CUDA device (for a smoke test of the script: --device cpu --tiny)"
        )
    device = pick_device(args.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cpu":
        torch.set_num_threads(1)  # a small shared CPU box: see bench/train_throughput.py --torch-threads
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.ddp and "WORLD_SIZE" in os.environ:
        ddp_worker(args, device)
        exit_worker(0)  # its record is written: no finalization to abort it (see exit_worker)
    ts = training_set(args.workdir, data_spec(args, device), log)
    update: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "data": {"tokens": ts.tokens, "samples": ts.samples, "spec": asdict(data_spec(args, device))},
        "sizes": {k: getattr(args, k) for k in SIZES["full"]},
    }
    if args.out is None:  # only a GPU run writes into bench/results
        cuda = device.type == "cuda"
        args.out = (
            REPO / "bench" / "results" / "gpu_train_h200.json"
            if cuda
            else args.workdir / "gpu_train_cpu.json"
        )
    if args.all or args.variants:
        update["variants"] = variants(args, ts, device)
        write_results(args.out, update)  # now too: a later failure keeps these numbers
    if args.all or args.ddp:
        update["ddp"] = guarded("DDP", lambda: ddp(args, ts, device), log)
    update["wall_s"] = round(time.perf_counter() - STARTED, 1)
    write_results(args.out, update)
    failed = errors(update)
    if failed:
        sys.exit("FAILED parts:\n  " + "\n  ".join(failed))


if __name__ == "__main__":
    main()
