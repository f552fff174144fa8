"""One knob at a time: eagle3's recipe ablated on bench/vs_speculators.py's data, prompts and evaluator.

    python -m bench.ablations                          # every ablation below, one process each
    python -m bench.ablations --jobs 8 --device cuda   # on a GPU host: eight at once
    python -m bench.ablations --only baseline,norms    # a few of them

Every ablation is the baseline plus the overrides its row names (TrainConfig fields, dotted for nested
ones). Each trains afresh on the same shards with the matched settings of the benchmark (epochs, TTT length,
draft vocabulary, max length), is rounded to bf16 and decoded on the same held-out prompts; its AL is set
beside the baseline's with the paired-bootstrap 95% interval of the difference. Results go to
bench/results/ablations_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import vs_speculators
from eagle3_core.config import TrainConfig

# name -> overrides of the baseline; "baseline" is TrainConfig's defaults (what a user gets)
TUNED: dict[str, Any] = {"batch_tokens": 4096, "lr": 1e-3}  # more, larger steps than the defaults give
NORMS: dict[str, Any] = {"variant": {"norm_before_fc": True, "norm_output": True}}
ABLATIONS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "batch_tokens_4096": {"batch_tokens": 4096},
    "lr_1e-3": {"lr": 1e-3},
    "norms": NORMS,
    "tuned": TUNED,
    "tuned+norms": {**TUNED, **NORMS},
    "tuned+norm_output": {**TUNED, "variant": {"norm_output": True}},
    "tuned+fc_norm+norm_output": {**TUNED, "variant": {"fc_norm": True, "norm_output": True}},
    "tuned+norms+muon": {**TUNED, **NORMS, "optimizer": "muon", "schedule": "linear"},
    "tuned+norms+linear": {**TUNED, **NORMS, "schedule": "linear"},
    "tuned+norms+step_weight_1": {**TUNED, **NORMS, "step_weight": 1.0},
    "tuned+norms+lk_hybrid": {**TUNED, **NORMS, "loss": "lk_hybrid"},
    "tuned+norms+batch_2048": {**TUNED, **NORMS, "batch_tokens": 2048},
    "tuned+norms+lr_3e-3": {**TUNED, **NORMS, "lr": 3e-3},
    "tuned+norms+norm_before_residual": {
        **TUNED,
        "variant": {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
    },
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.ablations", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=vs_speculators.DEFAULT_WORKDIR)
    p.add_argument(
        "--toy-cache",
        type=Path,
        default=vs_speculators.TOY_CACHE,
        help="where the toy target is built or found",
    )
    p.add_argument("--train-conversations", type=int, default=1000)
    p.add_argument("--heldout-prompts", type=int, default=100)
    p.add_argument("--per-conversation", type=int, default=2)
    p.add_argument("--holdout-fraction", type=float, default=0.02)
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--chitchat-rows", type=int, default=None)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=1024)
    p.add_argument("--ks", default="1,3,5,7")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="decoding temperature (speculative sampling above 0, seeded; lossless either way)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--jobs", type=int, default=1, help="ablations run at once, each in its own process")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--only", default="", help="comma-separated ablation names (default: all)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="add an ablation: NAME={json overrides}",
    )
    p.add_argument("--reference", default="baseline", help="the row every other is compared with, paired")
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args(argv)
    args.ks = tuple(int(k) for k in args.ks.split(","))
    return args


def chosen(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    table = dict(ABLATIONS)
    for item in args.set:
        name, _, raw = item.partition("=")
        table[name] = json.loads(raw)
    names = [n for n in args.only.split(",") if n] or list(table)
    missing = [n for n in names if n not in table]
    if missing:
        raise SystemExit(f"unknown ablations {missing}: choose from {list(table)}")
    return {n: table[n] for n in dict.fromkeys([args.reference, *names])}


def one(job: tuple[str, dict[str, Any], argparse.Namespace, str]) -> dict[str, Any]:
    """Train and measure one ablation (in its own process); its per-prompt rounds come back."""
    from eagle3_core.evaluate.measure import DecodeSettings
    from eagle3_core.train.run_dir import load_trained

    name, overrides, args, device = job
    torch.set_num_threads(args.threads)
    spec = vs_speculators.DataSpec(
        args.train_conversations, args.holdout_fraction, args.shard_size, args.chitchat_rows, args.max_len,
        "xs", device,
    )  # fmt: skip
    data = vs_speculators.build_data(spec, args.workdir, args.toy_cache, lambda _: None)
    mapping = vs_speculators.vocab_mapping(data, args.draft_vocab, lambda _: None)
    cfg = TrainConfig.model_validate(
        {
            **overrides,
            "epochs": args.epochs,
            "ttt_steps": args.ttt_steps,
            "draft_vocab_size": args.draft_vocab,
            "max_len": args.max_len,
            "device": device,
            "precision": "float32",
        }
    )
    started = time.perf_counter()
    result, _ = vs_speculators.run_eagle3(
        cfg, data, mapping, args.workdir / "ablations" / name, lambda _: None
    )
    train_s = time.perf_counter() - started
    target, embed, ids = vs_speculators.evaluation_inputs(data, args, lambda _: None)
    drafter, drafter_mapping, _ = load_trained(result.final_dir, embed)
    decode = DecodeSettings(args.ks, args.max_new_tokens, args.temperature, 0)
    measured = vs_speculators.measure_drafter(
        target, vs_speculators.bf16_rounded(drafter), drafter_mapping.d2t, ids, decode, name, lambda _: None
    )
    return {
        "name": name,
        "overrides": overrides,
        "steps": result.steps,
        "train_s": round(train_s, 1),
        "val": result.val,
        "runs": {k: [list(r.accepted) for r in runs] for k, runs in measured.runs.items()},
        "greedy_mismatches": measured.greedy_mismatches,
    }


def summarise(results: list[dict[str, Any]], ks: Sequence[int], reference: str) -> list[dict[str, Any]]:
    from eagle3_core.evaluate.measure import (
        PathTiming,
        PromptRun,
        bootstrap_al_interval,
        paired_al_difference,
        pooled_runs_al,
    )

    def runs(r: dict[str, Any], k: int) -> list[PromptRun]:
        return [PromptRun(tuple(a), PathTiming(), PathTiming()) for a in r["runs"][k]]

    base = next(r for r in results if r["name"] == reference)
    rows = []
    for r in results:
        row: dict[str, Any] = {
            "name": r["name"],
            "overrides": r["overrides"],
            "steps": r["steps"],
            "train_s": r["train_s"],
        }
        for k in ks:
            mine = runs(r, k)
            row[f"al_k{k}"] = round(pooled_runs_al(mine, k), 4)
            row[f"al_k{k}_ci95"] = [round(x, 4) for x in bootstrap_al_interval(mine)]
            row[f"vs_reference_k{k}"] = paired_al_difference(mine, runs(base, k)).as_dict()
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = vs_speculators.resolve_device(args.device)
    args.workdir = args.workdir.resolve()
    table = chosen(args)
    spec = vs_speculators.DataSpec(
        args.train_conversations, args.holdout_fraction, args.shard_size, args.chitchat_rows, args.max_len,
        "xs", device,
    )  # fmt: skip
    # once, before the workers read it
    data = vs_speculators.build_data(spec, args.workdir, args.toy_cache, print)
    vs_speculators.vocab_mapping(data, args.draft_vocab, print)
    jobs = [(name, overrides, args, device) for name, overrides in table.items()]
    started = time.perf_counter()
    # spawn: the parent has used CUDA (extraction), which a forked child cannot re-initialise
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=spawn) as pool:
        results = list(pool.map(one, jobs))
    rows = summarise(results, args.ks, args.reference)
    for row in rows:
        cells = "  ".join(
            f"K={k} {row[f'al_k{k}']:.3f} ({row[f'vs_reference_k{k}']['difference']:+.3f} "
            f"[{row[f'vs_reference_k{k}']['ci95'][0]:+.3f},{row[f'vs_reference_k{k}']['ci95'][1]:+.3f}])"
            for k in args.ks
        )
        print(f"{row['name']:>20}  steps {row['steps']:>5}  train {row['train_s']:>7.1f}s  {cells}")
    out = args.results or vs_speculators.RESULTS / f"ablations_{vs_speculators.device_label(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "device": vs_speculators.device_label(device),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "seconds": round(time.perf_counter() - started, 1),
        "reference": args.reference,
        "rows": rows,
        "per_prompt": {r["name"]: r["runs"] for r in results},
        "cpu_count": os.cpu_count(),
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
