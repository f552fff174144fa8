"""The data loader's tokens/s against the drafter training's, measured side by side in one run.

Goal (the issue's): the loader delivers at least 5x the tokens per second that training consumes, so that
training never waits for data. Both count real (unpadded) tokens of the same length-bucketed batches.

Loader: a `Prefetcher` over one epoch of the trainer's planned batches with the TrainConfig's loader_threads and
prefetch_batches (memory-mapped reads, every sample's digest checked, padding into batches; pinned memory
on a GPU host, as the trainer does), several rounds, median. Training: `build_setup` + `train_step` on batches of
the same plan held in memory, after warm-up steps (flex attention compiles in them), GPU synchronised before
each timer read. The data: a random-weight Llama target, shards extracted from it by the real extraction
path (bf16 storage), a vocab mapping counted from them.

    python -m bench.train_throughput                  # CPU-sized, this machine (about 2 minutes)
    python -m bench.train_throughput --device cuda --suffix h200 --hidden 2048 --layers 16 --vocab 32000 \
        --k 32000 --max-len 2048 --samples-per-shard 64 --batch-tokens 16384 --warmup 3 --steps 10 --fed \
        --workdir .cache/bench-gpu                    # the same data as bench/gpu_train.py's, reused
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: import `bench` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._training import (
    DataSpec,
    Plan,
    TrainingSet,
    intermediate_for,
    load_batches,
    sync,
    time_training,
    training_plan,
    training_set,
)
from eagle3_core.config import TrainConfig
from eagle3_core.targets.head import load_target_head
from eagle3_core.train.data import SampleRef, TrainingData
from eagle3_core.train.distributed import World, pick_device
from eagle3_core.train.trainer import Setup, build_setup, drafter_config_for, train_step

GOAL = 5.0
RESULTS = Path(__file__).resolve().parent / "results"
LOADER_ROUNDS = 3


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--k", type=int, default=4096, help="draft vocabulary size")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--samples-per-shard", type=int, default=16)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument(
        "--max-len", type=int, default=1024, help="sample lengths are uniform in [min-len, max-len)"
    )
    p.add_argument(
        "--batch-tokens", type=int, default=2048, help="padded tokens per step (TrainConfig.batch_tokens)"
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed training steps first")
    p.add_argument("--steps", type=int, default=3, help="timed training steps")
    p.add_argument(
        "--fed",
        action="store_true",
        help="also time train_step fed by a Prefetcher, as the trainer runs it (time spent waiting)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--attention", choices=["auto", "sdpa", "flex"], default="auto")
    p.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="intra-op threads; default 1 on CPU (on a small shared machine, intra-op threads waiting for "
        "busy cores stalled every op: 13 s a step against 0.5 s with one), torch's default on GPU",
    )
    p.add_argument("--loader-threads", type=int, default=None, help="default: TrainConfig's")
    p.add_argument(
        "--workdir", type=Path, default=None, help="keep (and reuse) the data here; default: a temp dir"
    )
    p.add_argument(
        "--store-dtypes", default="bfloat16",
        help="extract.store_dtype of the shards, comma-separated: each measured in turn in this run, on the "
        "same samples (e.g. bfloat16,fp8_e4m3: FP8 shards beside bf16 ones)",
    )  # fmt: skip
    p.add_argument("--suffix", default="", help="results file bench/results/train_throughput_<suffix>.json")
    args = p.parse_args()
    args.store_dtypes = [d.strip() for d in args.store_dtypes.split(",") if d.strip()]
    return args


def train_config(args: argparse.Namespace) -> TrainConfig:
    extra = {} if args.loader_threads is None else {"loader_threads": args.loader_threads}
    return TrainConfig(
        draft_vocab_size=args.k,
        batch_tokens=args.batch_tokens,
        max_len=args.max_len,
        device=args.device,
        attention=args.attention,
        precision=args.precision,
        **extra,
    )


def data_spec(args: argparse.Namespace, device: torch.device, store_dtype: str) -> DataSpec:
    return DataSpec.from_args(
        args,
        intermediate=intermediate_for(args.hidden),
        device="cuda" if device.type == "cuda" else "cpu",
        shards=args.shards,
        store_dtype=store_dtype,
    )


def time_loader(data: TrainingData, refs: list[SampleRef], plan: Plan, pin: bool) -> dict[str, Any]:
    """One epoch through the Prefetcher, LOADER_ROUNDS times; the median round's rate."""
    seconds, tokens, padded = [], 0, 0
    cfg = plan.cfg
    prefetch = plan.prefetcher(data, refs, pin)
    try:
        for _ in range(LOADER_ROUNDS):
            tokens, padded = 0, 0
            t0 = time.perf_counter()
            for batch in prefetch(plan.batches):
                tokens += batch.tokens
                padded += batch.input_ids.numel()
            seconds.append(time.perf_counter() - t0)
    finally:
        prefetch.close()
    median = statistics.median(seconds)
    return {
        "tokens": tokens,
        "padded_tokens": padded,
        "batches": len(plan.batches),
        "batching": cfg.batching,
        "rounds_s": [round(s, 3) for s in seconds],
        "tokens_per_s": round(tokens / median, 1),
        "threads": cfg.loader_threads,
        "depth": cfg.prefetch_batches,
    }


def time_fed_training(
    s: Setup, data: TrainingData, refs: list[SampleRef], plan: Plan, steps: int, pin: bool
) -> dict[str, Any]:
    """train_step fed by a Prefetcher as `trainer._train` feeds it: tokens/s and the time spent waiting for a batch
    (loader threads and the training loop share the GIL and the host's cores)."""
    cfg, device = s.cfg, s.world.device
    prefetch = plan.prefetcher(data, refs, pin)
    batches = iter(prefetch(plan.first(steps)))
    tokens, waited = 0, 0.0
    try:
        sync(device)
        t0 = time.perf_counter()
        while True:
            w0 = time.perf_counter()
            batch = next(batches, None)
            waited += time.perf_counter() - w0
            if batch is None:
                break
            train_step(s, batch.to(device), cfg.lr)
            tokens += batch.tokens
        sync(device)
        seconds = time.perf_counter() - t0
    finally:
        prefetch.close()
    return {
        "tokens": tokens,
        "steps": steps,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "waiting_for_data_s": round(waited, 3),
    }


def measure(
    ts: TrainingSet, cfg: TrainConfig, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    data = TrainingData(ts.shard_paths)
    try:
        refs = data.refs
        plan = training_plan(refs, cfg, "flex" if device.type == "cuda" else "sdpa")
        pin = device.type == "cuda"
        loader = time_loader(data, refs, plan, pin)
        batches = load_batches(data, refs, plan, args.warmup + args.steps, pin)
        mapping = ts.mapping()
        s = build_setup(
            World(0, 1, device),
            plan.cfg,
            data,
            load_target_head(ts.target_dir),
            mapping,
            drafter_config_for(ts.target_dir, mapping.draft_vocab_size),
        )
        training = time_training(s, batches, args.warmup)
        if device.type == "cuda":
            training["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        fed = time_fed_training(s, data, refs, plan, args.steps, pin) if args.fed else None
    finally:
        data.close()
    return {"loader": loader, "training": training, "fed": fed}


def report(result: dict[str, Any]) -> None:
    loader, training = result["loader"], result["training"]
    print(
        f"[{result['store_dtype']}] data: {result['data']['tokens']:,} tokens in {result['data']['samples']} "
        f"samples, {loader['batches']} batches/epoch (batch_tokens {result['train_config']['batch_tokens']}, "
        f"real/padded {loader['tokens'] / loader['padded_tokens']:.2f})"
    )
    print(f"{'':28}{'tokens/s':>12}  detail")
    print(
        f"{'loader (Prefetcher)':28}{loader['tokens_per_s']:>12,.0f}  {loader['threads']} threads, depth "
        f"{loader['depth']}, median of {LOADER_ROUNDS} epochs {loader['rounds_s']}s"
    )
    print(
        f"{'training (train_step)':28}{training['tokens_per_s']:>12,.0f}  {result['device']}, "
        f"{training['attention']}, {training['precision']}, {training['steps']} steps after "
        f"{training['warmup_steps']} warm-up, {training['seconds']}s"
    )
    if result["fed"]:
        fed = result["fed"]
        print(
            f"{'training fed by the loader':28}{fed['tokens_per_s']:>12,.0f}  {fed['steps']} steps, "
            f"{fed['waiting_for_data_s']}s of {fed['seconds']}s waiting for a batch"
        )
    print(
        f"loader / training = {result['ratio']:.1f}x (goal >= {GOAL:.0f}x): {'PASS' if result['pass'] else 'FAIL'}"
    )


def measure_dtype(
    args: argparse.Namespace, device: torch.device, store_dtype: str, tmp: Path
) -> dict[str, Any]:
    """The loader and the trainer on shards stored in `store_dtype`."""
    cfg = train_config(args)
    ts = training_set(args.workdir or tmp, data_spec(args, device, store_dtype))
    result: dict[str, Any] = {
        "store_dtype": store_dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "data": {
            "tokens": ts.tokens,
            "samples": ts.samples,
            "shard_bytes_per_token": round(sum(p.stat().st_size for p in ts.shard_paths) / ts.tokens, 1),
        },
        "args": {k: v for k, v in vars(args).items() if k != "workdir"},
        "train_config": cfg.model_dump(),
        **measure(ts, cfg, device, args),
    }
    result["ratio"] = round(result["loader"]["tokens_per_s"] / result["training"]["tokens_per_s"], 2)
    result["pass"] = result["ratio"] >= GOAL
    return result


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    device = pick_device(args.device)
    if args.torch_threads or device.type == "cpu":
        torch.set_num_threads(args.torch_threads or 1)
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure_dtype(args, device, dtype, Path(tmp)) for dtype in args.store_dtypes]
    for result in results:
        report(result)
    # one dtype: the file as before; several: one entry each, measured in this run on the same samples
    out_value: dict[str, Any] = (
        results[0] if len(results) == 1 else {"store_dtypes": {r["store_dtype"]: r for r in results}}
    )
    out_value["wall_s"] = round(time.perf_counter() - started, 1)
    print(f"wall time {out_value['wall_s']}s")
    out = RESULTS / f"train_throughput{'_' + args.suffix if args.suffix else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(out_value, indent=1, default=str) + "\n")
    if not all(r["pass"] for r in results):
        sys.exit("FAIL")


if __name__ == "__main__":
    main()
