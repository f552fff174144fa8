"""FSDP2 against DDP (train.sharding): peak memory per rank and tokens/s at hidden 7168, with the default
32,000-token draft head and with the full 163,840-token head.

    python -m bench.sharding                             # both heads, both shardings, on 1 GPU
    python -m bench.sharding --heads default             # the 32k head alone (a later run merges its part)
    python -m bench.sharding --heads full --sharding fsdp
    python -m bench.sharding --nproc 2                   # each run on 2 GPUs (a file of its own: ..._x2)
    python -m bench.sharding --nproc 2 --nodes 2         # as 2 torchrun agents ("nodes") of 1 GPU each
    python -m bench.sharding --heads default --batch-tokens 8192 --nproc 2 --reference FILE   # against 1 GPU
    python -m bench.sharding --device cpu --tiny         # smoke test on CPU (gloo), tiny sizes, into --workdir

Each (head, sharding) run is `train_drafter` (TTT 7, otherwise the defaults: Muon, bf16 autocast, flex
attention on a GPU) under torchrun with --nproc ranks, on the same data and global batches, for --warmup
untimed steps and --steps timed ones. Even one rank joins a process group of one, so that DDP wraps and
fully_shard really shards (the trainer alone trains one rank without a group, and without FSDP). Each run
reports tokens/s over the timed steps (the warm-up holds the first compilation and the recompilation that
torch's automatic dynamic shapes make at the second batch shape: on the H200 a warm-up of 4 left it in the
timed steps), every rank's torch.cuda.max_memory_allocated over the warm-up, the timed steps and the final
validation and save, and the memory preflight's estimate (train/memory.py) of the same run.

From the measured peaks, the per-rank peak at 2, 4 and 8 ranks (METHOD below), and FSDP's tokens/s over
DDP's per head. The data: a random-weight Llama target (hidden 7168, 8 layers, 56 heads of 128, 8 KV heads,
intermediate 18432, vocab 163,840: Kimi-K2.5's widths) and shards extracted from it by the real path (bf16),
built once under --workdir with vocab mappings for both heads. Results go to bench/results/sharding_<gpu>.json
(`_x<N>` after it for N ranks); a CPU run writes into --workdir. A run of some heads or shardings updates its
runs in the file and keeps the others'.

--nodes N starts each run as N torchrun agents on this host, meeting at a c10d rendezvous on 127.0.0.1, each
with --nproc / N ranks (on a GPU, its own slice of the devices), as N nodes of a cluster would (`_<N>nodes`
after the file's name). --reference FILE compares each run with the run of the same name in FILE (such as
bench/results/sharding_h100_default.json, one H100's runs at 8,192 tokens a step), made on the
same data and global batch: validation and training losses, and the scaling of tokens/s with the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a file (by torchrun): import `bench` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import device_label
from bench._training import DataSpec, TrainingSet, guarded, training_set
from bench.gpu_train import errors, free_memory, run_record
from eagle3_core.config import TrainConfig
from eagle3_core.draft.vocab import (
    VOCAB_INFO_FILE,
    build_vocab_mapping,
    load_vocab_mapping,
    save_vocab_mapping,
)
from eagle3_core.train import trainer
from eagle3_core.train.distributed import World, exit_worker, init_world, pick_device
from eagle3_core.train.memory import MemoryEstimate, estimate_training_memory, gib
from eagle3_core.train.trainer import build_setup, drafter_config_for, numerics, train_drafter

REPO = Path(__file__).resolve().parents[1]
STARTED = time.perf_counter()
SHARDINGS = ("ddp", "fsdp")
HEADS = ("default", "full")  # the draft vocabulary: --k (train.draft_vocab_size's default), or the target's
WORLDS = (2, 4, 8)  # the world sizes the measured peaks are carried to
SIZES = {  # --tiny: a CPU smoke test of the script itself
    "full": {
        "hidden": 7168,
        "layers": 8,  # the fewest with three distinct default aux layers is 7
        "attention_heads": 56,
        "kv_heads": 8,
        "intermediate": 18432,
        "vocab": 163840,
        "k": 32000,
        "samples_per_shard": 64,
        "min_len": 256,
        "max_len": 2048,
        "batch_tokens": 16384,
        "ttt": 7,
        "warmup": 8,
        "steps": 12,
        "log_every": 4,
        "val_percent": 5,  # train.val_fraction's default
    },
    "tiny": {
        "hidden": 64,
        "layers": 8,
        "attention_heads": 4,
        "kv_heads": 2,
        "intermediate": 128,
        "vocab": 1000,
        "k": 256,
        "samples_per_shard": 8,
        "min_len": 16,
        "max_len": 96,
        "batch_tokens": 384,
        "ttt": 7,
        "warmup": 2,
        "steps": 2,
        "log_every": 1,
        "val_percent": 25,  # a few of the 16 samples, so the runs validate
    },
}
METHOD = (
    "per-rank peak at W ranks = the measured peak at N ranks (the most of any rank's "
    "torch.cuda.max_memory_allocated) - D/N + D/W, where D is what the memory estimate (train/memory.py) "
    "says the sharding divides over the ranks: under FSDP the weights, gradients and AdamW moments of the "
    "sharded parameters and the frozen embedding (4 x the estimate's fixed bytes at 2 ranks less those at 4); "
    "under DDP nothing (every rank holds it all; a run of one rank still has DDP's gradient buckets, as it "
    "runs in a process group of one). Each rank keeps the tokens a rank held in the measured run (the global "
    "batch grows with W), so activations stay as measured. estimate_gib is the memory preflight's figure "
    "(train/memory.py); at 1 rank it counts neither DDP's buckets nor FSDP, as the trainer runs one rank "
    "unwrapped. estimate_as_run_gib is the estimate of the run as measured (at 1 rank: the 2-rank fixed bytes "
    "plus D/2, with one rank's tokens), and measured_over_estimate divides the measured peak by it."
)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - STARTED:6.1f}s] {msg}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--heads", default=",".join(HEADS), help="default (--k), full (the target's vocab), or both"
    )
    p.add_argument("--sharding", default=",".join(SHARDINGS), help="ddp, fsdp, or both")
    p.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) each run trains on")
    p.add_argument("--nodes", type=int, default=1, help="torchrun agents the ranks are split over (c10d)")
    p.add_argument("--reference", type=Path, help="a results file of the same runs to compare each run with")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="train.compile")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a CPU smoke test)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "bench-sharding")
    p.add_argument(
        "--out", type=Path, default=None, help="default bench/results/sharding_<gpu>.json on a GPU"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of one run (torchrun)
    for name, value in SIZES["full"].items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    args = p.parse_args(argv)
    args.workdir = args.workdir.resolve()
    for name, value in SIZES["tiny" if args.tiny else "full"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.warmup % args.log_every or args.steps % args.log_every:
        sys.exit(
            f"--warmup {args.warmup} and --steps {args.steps} must be multiples of --log-every {args.log_every}"
        )
    if args.nodes < 1 or args.nproc % args.nodes:
        sys.exit(f"--nodes {args.nodes}: the --nproc {args.nproc} ranks must split evenly over the nodes")
    args.heads, args.sharding = _choices(args.heads, HEADS), _choices(args.sharding, SHARDINGS)
    return args


def _choices(value: str, allowed: tuple[str, ...]) -> list[str]:
    chosen = [v for v in value.split(",") if v]
    if not chosen or set(chosen) - set(allowed):
        sys.exit(f"{value!r}: choose from {', '.join(allowed)}")
    return chosen


def sizes(args: argparse.Namespace) -> dict[str, int]:
    return {name: getattr(args, name) for name in SIZES["full"]}


# ---- data ----------------------------------------------------------------------------------------------------
def data_spec(args: argparse.Namespace) -> DataSpec:
    return DataSpec.from_args(
        args,
        intermediate=args.intermediate,
        device=args.device,
        heads=args.attention_heads,
        kv_heads=args.kv_heads,
    )


def draft_vocab(args: argparse.Namespace, head: str) -> int:
    return args.k if head == "default" else args.vocab


def mapping_dir(ts: TrainingSet, args: argparse.Namespace, head: str) -> Path:
    """The vocab mapping of `head`: the training set's own (K = --k), or one of K beside it, built once."""
    k = draft_vocab(args, head)
    if k == args.k:
        return ts.mapping_dir
    where = ts.mapping_dir.with_name(f"vocab_mapping_{k}")
    if not (where / VOCAB_INFO_FILE).exists():  # written last
        fingerprint = ts.mapping().tokenizer_fingerprint
        save_vocab_mapping(
            build_vocab_mapping(ts.shard_paths, args.vocab, k, tokenizer_fingerprint=fingerprint), where
        )
    return where


# ---- one run -------------------------------------------------------------------------------------------------
def train_config(args: argparse.Namespace, head: str, sharding: str) -> TrainConfig:
    """A short run: the defaults but TTT --ttt and the fixed global batch; logged every --log-every steps (a
    multiple of which --warmup must be, as the rate is timed from a log row), validated once at the end."""
    return TrainConfig(
        draft_vocab_size=draft_vocab(args, head),
        ttt_steps=args.ttt,
        sharding=sharding,  # type: ignore[arg-type]  # one of SHARDINGS
        compile=args.compile,
        batch_tokens=args.batch_tokens,
        max_len=args.max_len,
        max_steps=args.warmup + args.steps,
        val_fraction=args.val_percent / 100,
        epochs=1000,  # a ceiling: max_steps ends the run
        log_every=args.log_every,
        eval_every=10**6,
        checkpoint_every=10**6,
        keep_checkpoints=1,
        al_every=None,
        seed=0,
        device=args.device,
    )


@dataclass(frozen=True)
class GroupWorld(World):
    """A rank of a process group, even a group of one: the trainer wraps DDP and shards FSDP on it."""

    @property
    def distributed(self) -> bool:
        return True


def join_group(preference: Literal["auto", "cpu", "cuda"]) -> World:
    """The trainer's init_world, joining a process group of one rank too (torchrun --nproc-per-node 1)."""
    world = init_world(preference)
    if not dist.is_initialized():
        if world.device.type == "cuda":
            torch.cuda.set_device(world.device)
            dist.init_process_group("nccl", device_id=world.device)
        else:
            dist.init_process_group("gloo")
    return GroupWorld(world.rank, world.size, world.device)


def observe_setup() -> dict[str, Any]:
    """What the trainer built (filled in when train_drafter builds its Setup): whether it sharded, the module
    a step runs (FSDP's TTTLoss or DDP's wrapper), so a run shows it really ran under its sharding, and whether
    it compiled the layer (train.compile auto does not under FSDP)."""
    seen: dict[str, Any] = {}

    def build(*args: Any, **kwargs: Any) -> trainer.Setup:
        s = build_setup(*args, **kwargs)
        seen.update(
            sharded=s.sharded,
            model=type(s.model).__name__,
            world_size=s.world.size,
            layer_compiled="qkv" in vars(s.drafter.midlayer),  # compile_layer sets it on the instance
        )
        return s

    trainer.build_setup = build
    return seen


@dataclass
class PhasePeaks:
    """This rank's peak allocated memory per phase of a run: the warm-up's steps (compilation included), the
    timed steps, then the final validation and save, so that what sets the run's peak is known; and the
    most reserved in any phase. The peak statistics are reset where a phase ends."""

    allocated: dict[str, int] = field(default_factory=dict)
    reserved: int = 0

    def end(self, phase: str) -> None:
        self.allocated[phase] = torch.cuda.max_memory_allocated()
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()


def observe_peaks(warmup: int) -> PhasePeaks:
    """PhasePeaks filled in as train_drafter runs: the warm-up ends at step `warmup`, the timed steps at the
    final validation; the caller ends the last phase."""
    peaks = PhasePeaks()
    train_step, validate = trainer.train_step, trainer.validate
    calls = 0

    def step(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        if calls == warmup:
            peaks.end("warmup")
        calls += 1
        return train_step(*args, **kwargs)

    def validated(*args: Any, **kwargs: Any) -> Any:
        if "timed_steps" not in peaks.allocated:
            peaks.end("timed_steps")
        return validate(*args, **kwargs)

    trainer.train_step, trainer.validate = step, validated
    return peaks


def rank_file(args: argparse.Namespace, name: str, rank: int) -> Path:
    return args.workdir / "ranks" / f"{name}-rank{rank}.json"


def worker(args: argparse.Namespace) -> None:
    """One rank of one run under torchrun: train_drafter, then this rank's peak memory (and on rank 0 the
    run's record) into a file for the launching process."""
    (head,), (sharding,) = args.heads, args.sharding
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ts = training_set(args.workdir, data_spec(args), lambda _: None)  # the launching process built it
    trainer.init_world = join_group  # see join_group
    setup = observe_setup()
    cuda = torch.cuda.is_available() and args.device == "cuda"
    peaks = observe_peaks(args.warmup) if cuda else None
    name = f"{head}-{sharding}"
    result = train_drafter(
        ts.shard_paths,
        ts.target_dir,
        load_vocab_mapping(mapping_dir(ts, args, head)),
        args.workdir / "runs" / name,
        train_config(args, head, sharding),
        log=log,
    )
    record: dict[str, Any] = {"rank": rank, "setup": setup}
    if peaks is not None:
        peaks.end("validation_and_save")
        record["peak_allocated_by_phase"] = peaks.allocated
        record["peak_allocated"] = max(peaks.allocated.values())
        record["peak_reserved"] = peaks.reserved
    if rank == 0:
        record |= run_record(result, world, from_step=args.warmup)
    rank_file(args, name, rank).write_text(json.dumps(record, default=str) + "\n")


def launch(args: argparse.Namespace, head: str, sharding: str) -> list[dict[str, Any]]:
    """torchrun of --nproc ranks of this script's worker for one run; every rank's record, rank 0's first."""
    name = f"{head}-{sharding}"
    shutil.rmtree(args.workdir / "runs" / name, ignore_errors=True)  # a finished run would just be returned
    (args.workdir / "ranks").mkdir(parents=True, exist_ok=True)
    for rank in range(args.nproc):
        rank_file(args, name, rank).unlink(missing_ok=True)
    passed = [f"--{n.replace('_', '-')}={v}" for n, v in sizes(args).items()]
    worker_args = [
        str(Path(__file__).resolve()), "--worker", f"--heads={head}", f"--sharding={sharding}",
        f"--compile={args.compile}", f"--device={args.device}", f"--workdir={args.workdir}", *passed,
    ]  # fmt: skip
    try:
        codes = wait_for(start_agents(args, name, worker_args))
        if any(codes):
            raise RuntimeError(f"torchrun of run {name} exited {codes} (its log is above)")
        return [json.loads(rank_file(args, name, r).read_text()) for r in range(args.nproc)]
    finally:  # a checkpoint of the full head is 20 GB
        shutil.rmtree(args.workdir / "runs" / name, ignore_errors=True)


def start_agents(
    args: argparse.Namespace, name: str, worker_args: list[str]
) -> list[subprocess.Popen[bytes]]:
    """The torchrun agents of one run: one standalone agent of --nproc ranks, or --nodes agents of
    --nproc / --nodes ranks each meeting at a c10d rendezvous on 127.0.0.1, each on its own GPUs."""
    per_node = args.nproc // args.nodes
    if args.nodes == 1:
        launches = [["--standalone"]]
    else:
        rendezvous = [f"--nnodes={args.nodes}", "--rdzv-backend=c10d",
                      f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id=bench-{name}"]  # fmt: skip
        launches = [rendezvous] * args.nodes
    agents = []
    for node, launch in enumerate(launches):
        cmd = [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc-per-node={per_node}",
               *worker_args]  # fmt: skip
        env = dict(os.environ)
        if args.device == "cuda" and args.nodes > 1:  # each agent's ranks count their GPUs from 0
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * per_node + g) for g in range(per_node))
        log(f"run {name}{f', node {node}' if args.nodes > 1 else ''}: {' '.join(cmd[3:])}")
        agents.append(subprocess.Popen(cmd, env=env))
    return agents


def wait_for(agents: list[subprocess.Popen[bytes]]) -> list[int]:
    """The agents' exit codes; once one fails, the others are stopped (their ranks would wait for it)."""
    while any(a.poll() is None for a in agents):
        if any(a.returncode for a in agents):
            for a in agents:
                if a.poll() is None:
                    a.terminate()
            return [a.wait() for a in agents]
        time.sleep(0.5)
    return [a.returncode for a in agents]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- memory --------------------------------------------------------------------------------------------------
def estimates(
    args: argparse.Namespace, ts: TrainingSet, head: str, sharding: str
) -> dict[int, MemoryEstimate]:
    """The memory preflight's estimate of the run at each world size, as the trainer makes it."""
    cfg = train_config(args, head, sharding)
    bf16, attention = numerics(cfg, pick_device(args.device))
    dcfg = drafter_config_for(ts.target_dir, cfg.draft_vocab_size)
    keys = 0 if attention == "flex" else args.max_len  # SDPA: its weights grow with the longest sample
    return {
        w: estimate_training_memory(
            dcfg,
            cfg.ttt_steps,
            w,
            2 if bf16 else 4,
            keys,
            sharded=sharding == "fsdp",
        )
        for w in sorted({1, args.nproc, *WORLDS})
    }


def divided_bytes(est: dict[int, MemoryEstimate]) -> float:
    """What the sharding divides over the ranks, by the estimate: fixed(W) = D / W + the rest, for W > 1."""
    return 4 * (est[2].fixed - est[4].fixed)


def in_group_of_one(est: dict[int, MemoryEstimate], divided: float) -> MemoryEstimate:
    """The estimate of a run of one rank in a process group of one, which the trainer never makes (it trains
    one rank unwrapped) but this bench does: DDP's gradient buckets, or FSDP's whole share of what it divides,
    on top of the 2-rank run's fixed bytes (fixed(W) = D / W + the rest), with one rank's tokens."""
    return MemoryEstimate(est[2].fixed + divided / 2, est[1].per_token, est[1].per_run, 1)


def memory(
    args: argparse.Namespace, ranks: list[dict[str, Any]], est: dict[int, MemoryEstimate]
) -> dict[str, Any]:
    """The run's measured peaks, the estimate's, and the per-rank peaks carried to WORLDS (METHOD); keyed by
    world size as a string, as the JSON file keeps them."""
    n, per_rank_tokens, d = args.nproc, args.batch_tokens / args.nproc, divided_bytes(est)
    worlds = sorted({n, *WORLDS})
    out: dict[str, Any] = {
        "estimate_gib": {str(w): gib(est[w].peak(int(per_rank_tokens * w))) for w in worlds},
        "divided_bytes": round(d),
    }
    if "peak_allocated" not in ranks[0]:  # CPU: no device memory to measure
        return out
    peak = max(r["peak_allocated"] for r in ranks)
    as_run = est[n] if n > 1 else in_group_of_one(est, d)
    return out | {
        "peak_allocated_gib": gib(peak),
        "peak_allocated_gib_per_rank": [gib(r["peak_allocated"]) for r in ranks],
        "peak_allocated_gib_by_phase": {
            phase: gib(max(r["peak_allocated_by_phase"][phase] for r in ranks))
            for phase in ranks[0]["peak_allocated_by_phase"]
        },
        "peak_reserved_gib_per_rank": [gib(r["peak_reserved"]) for r in ranks],
        "estimate_as_run_gib": gib(as_run.peak(args.batch_tokens)),
        "measured_over_estimate": round(peak / as_run.peak(args.batch_tokens), 3),
        "per_rank_peak_gib": {str(w): gib(peak - d / n + d / w) for w in worlds},
    }


def run(args: argparse.Namespace, ts: TrainingSet, head: str, sharding: str) -> dict[str, Any]:
    started = time.perf_counter()
    ranks = launch(args, head, sharding)
    est = estimates(args, ts, head, sharding)
    dropped = ("rank", "peak_allocated", "peak_reserved", "run_dir")  # the run directory is removed
    record = {k: v for k, v in ranks[0].items() if k not in dropped}
    return {
        "head": head,
        "draft_vocab": draft_vocab(args, head),
        "sharding": sharding,
        **record,
        "memory": memory(args, ranks, est),
        "wall_s": round(time.perf_counter() - started, 1),
    }


# ---- the comparison ------------------------------------------------------------------------------------------
def compared(ddp: dict[str, Any], fsdp: dict[str, Any]) -> dict[str, Any]:
    """FSDP against DDP on one head: tokens/s, losses, per-rank peaks."""
    ratio = fsdp["tokens_per_s"] / ddp["tokens_per_s"]
    losses = zip(ddp["train_loss"], fsdp["train_loss"], strict=True)
    out: dict[str, Any] = {
        "fsdp_over_ddp_tokens_per_s": round(ratio, 3),
        "slowdown_pct": round(100 * (1 - ratio), 1),
        "train_loss_max_rel_diff": max(abs(a - b) / max(abs(a), 1e-9) for a, b in losses),
    }
    if ddp["val"] and fsdp["val"]:
        out["val_loss_0_rel_diff"] = abs(ddp["val"]["loss_0"] - fsdp["val"]["loss_0"]) / max(
            abs(ddp["val"]["loss_0"]), 1e-9
        )
    if "per_rank_peak_gib" in ddp["memory"]:
        d, f = ddp["memory"]["per_rank_peak_gib"], fsdp["memory"]["per_rank_peak_gib"]
        out["per_rank_peak_gib"] = {"ddp": d, "fsdp": f}
        out["fsdp_saves_gib"] = {w: round(d[w] - f[w], 2) for w in d}
    return out


def comparisons(runs: dict[str, Any]) -> dict[str, Any]:
    """compared() for each head with both runs whole."""
    out = {}
    for head in HEADS:
        ddp, fsdp = runs.get(f"{head}-ddp"), runs.get(f"{head}-fsdp")
        if ddp and fsdp and "error" not in ddp and "error" not in fsdp:
            out[head] = compared(ddp, fsdp)
    return out


def line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"FAILED: {r['error'][:200]}"
    m = r["memory"]
    peak = (
        f"peak {m['peak_allocated_gib']} GiB (estimate of the run as it ran {m['estimate_as_run_gib']}), "
        if "peak_allocated_gib" in m
        else ""
    )
    return f"{r['tokens_per_s']:,.0f} tokens/s (steps {r['from_step']}-{r['to_step']}), {peak}{r['wall_s']} s"


def report(comparison: dict[str, Any]) -> None:
    for head, c in comparison.items():
        log(f"{head} head: FSDP/DDP tokens/s {c['fsdp_over_ddp_tokens_per_s']} ({c['slowdown_pct']}% slower)")
        for sharding, peaks in c.get("per_rank_peak_gib", {}).items():
            log(f"  {sharding} per-rank peak GiB by ranks: {peaks}")


# ---- the results ---------------------------------------------------------------------------------------------
def results_path(args: argparse.Namespace, device: str) -> Path:
    if args.out is not None:
        return args.out
    if args.device == "cpu":
        return args.workdir / "sharding_cpu.json"
    name = device_label(device)
    ranks = f"_x{args.nproc}" if args.nproc > 1 else ""
    nodes = f"_{args.nodes}nodes" if args.nodes > 1 else ""
    return REPO / "bench" / "results" / f"sharding_{name}{ranks}{nodes}.json"


def earlier(path: Path, facts: dict[str, Any]) -> dict[str, Any]:
    """The runs of an earlier invocation with the same sizes, ranks and compile setting, else none."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    same = all(
        old.get(k, 1 if k == "nodes" else None) == facts[k] for k in ("sizes", "nproc", "nodes", "compile")
    )
    if not same:
        log(f"{path} holds runs of other sizes or ranks: starting afresh")
    return old.get("runs", {}) if same else {}


def against(run: dict[str, Any], ref: dict[str, Any], ranks: int, ref_ranks: int) -> dict[str, Any]:
    """One run against the run of the same name in a reference file (same data and global batch): how far
    its losses are from the reference's, and its tokens/s over the reference's scaled by the ranks (1.0: the
    ranks add up fully)."""
    losses = zip(run["train_loss"], ref["train_loss"], strict=True)
    out: dict[str, Any] = {
        "train_loss_max_rel_diff": max(abs(a - b) / max(abs(b), 1e-9) for a, b in losses),
        "tokens_per_s_over_reference": round(run["tokens_per_s"] / ref["tokens_per_s"], 3),
        "scaling_efficiency": round(run["tokens_per_s"] / ref["tokens_per_s"] * ref_ranks / ranks, 3),
    }
    if run["val"] and ref["val"]:
        out["val_loss_0_rel_diff"] = abs(run["val"]["loss_0"] - ref["val"]["loss_0"]) / max(
            abs(ref["val"]["loss_0"]), 1e-9
        )
    return out


def check_reference(path: Path, sizes_here: dict[str, int]) -> dict[str, Any]:
    """The reference file's results; it must exist and hold runs of these sizes (checked before any run)."""
    if not path.is_file():
        sys.exit(f"--reference {path}: no such results file")
    ref: dict[str, Any] = json.loads(path.read_text())
    if ref.get("sizes") != sizes_here:
        sys.exit(f"--reference {path}: its runs have other sizes than these ({ref.get('sizes')})")
    return ref


def against_reference(results: dict[str, Any], path: Path) -> dict[str, Any]:
    """against() for every run whole in both this invocation's results and the reference file at `path`."""
    ref = check_reference(path, results["sizes"])
    whole = {n: r for n, r in results["runs"].items() if "error" not in r}
    runs = {
        n: against(r, ref["runs"][n], results["nproc"], ref["nproc"])
        for n, r in whole.items()
        if "error" not in ref["runs"].get(n, {"error": "absent"})
    }
    return {"file": str(path), "nproc": ref["nproc"], "nodes": ref.get("nodes", 1), "runs": runs}


def write(path: Path, results: dict[str, Any], reference: Path | None = None) -> None:
    results["comparison"] = comparisons(results["runs"])
    if reference is not None:
        results["against_reference"] = against_reference(results, reference)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/sharding.py needs a CUDA device (a smoke test of the script: --device cpu --tiny)")
    if args.device == "cpu":
        torch.set_num_threads(1)  # a small shared CPU box
    if args.reference is not None and not args.worker:
        check_reference(args.reference, sizes(args))
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        exit_worker(0)  # its record is written: no finalization to abort it (see exit_worker)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    spec = data_spec(args)
    ts = training_set(args.workdir, spec, log)
    for head in args.heads:
        mapping_dir(ts, args, head)
    free_memory(pick_device(args.device))
    path = results_path(args, device)
    results: dict[str, Any] = {
        "device": device,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "nproc": args.nproc,
        "nodes": args.nodes,
        "compile": args.compile,
        "sizes": sizes(args),
        "data": {"tokens": ts.tokens, "samples": ts.samples, "spec": asdict(spec)},
        "method": METHOD,
    }
    results["runs"] = earlier(path, results)
    for head in args.heads:
        for sharding in args.sharding:
            name = f"{head}-{sharding}"
            results["runs"][name] = guarded(name, partial(run, args, ts, head, sharding), log)
            log(f"  {name}: {line(results['runs'][name])}")
            write(path, results, args.reference)  # now: a later failure keeps these numbers
    results["wall_s"] = round(time.perf_counter() - STARTED, 1)
    write(path, results, args.reference)
    report(results["comparison"])
    for name, c in results.get("against_reference", {}).get("runs", {}).items():
        log(f"{name} against {args.reference}: {c}")
    log(f"results in {path} (this invocation: {results['wall_s']} s)")
    failed = errors(results["runs"])
    if failed:
        print("FAILED parts:\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
