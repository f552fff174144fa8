"""Acceptance measured one prompt at a time against many at once, side by side in one run.

    python -m bench.batched_eval --config .cache/al_selection/eagle3.yaml     # its trained SmolLM2 drafter, CPU
    python -m bench.batched_eval --config eagle3.yaml --batch 64 --prompts 128  # on a GPU

The project's target and newest drafter decode its held-out prompts greedily: `measure` one prompt at a time
(on a GPU with the target's step and the drafter's round as CUDA graphs, the evaluator's fastest batch-1
path), then `measure_acceptance`, `--batch` prompts at once (evaluate/batched.py). It prints the wall time of
each, their ratio, and whether every prompt's rounds agree (greedy: they must, up to argmax ties of the
device's rounding), and writes bench/results/batched_eval_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: import `bench` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import load_config
from eagle3_core.evaluate.measure import DecodeSettings, measure, measure_acceptance
from eagle3_core.evaluate.prompts import heldout_prompts
from eagle3_core.steps.drafter import latest_final
from eagle3_core.steps.evaluation import encode_fitting, load_target
from eagle3_core.store.layout import StoreLayout
from eagle3_core.train.run_dir import load_trained

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="a project with a trained drafter")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def _timed(fn: Any) -> tuple[Any, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    value = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return value, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config)
    target = load_target(cfg, lambda _m: None)
    final = latest_final(StoreLayout(cfg.store_root))
    embed = target.model.get_input_embeddings().weight.detach().float().cpu()
    drafter, mapping, _ = load_trained(final, embed)
    drafter = drafter.to(target.device, next(target.model.parameters()).dtype).eval()
    d2t = mapping.d2t.to(target.device)
    prompts = heldout_prompts(cfg.store_root, per_conversation=1, limit=args.prompts)
    room = cfg.tokenize.max_seq_len - args.max_new_tokens
    ids = [encoded for _, encoded in encode_fitting(target.tokenizer, prompts, room)]
    gpu = target.device.type == "cuda"
    one = DecodeSettings((args.k,), args.max_new_tokens, graphed_target=gpu)
    # batch 1 times each prompt against the target alone as well: only its drafted paths are compared here
    alone, alone_s = _timed(
        lambda: measure(target.model, drafter, d2t, target.aux_layer_ids, ids, target.eos_ids, one)
    )
    many, many_s = _timed(
        lambda: measure_acceptance(
            target.model, drafter, d2t, target.aux_layer_ids, ids, target.eos_ids, one, args.batch
        )
    )
    spec_s = sum(r.spec.seconds for r in alone.runs[args.k])

    def rounds(runs: list[Any]) -> dict[str, int]:
        return {"rounds": sum(len(r.accepted) for r in runs), "accepted": sum(sum(r.accepted) for r in runs)}

    same = sum(a.accepted == b.accepted for a, b in zip(alone.runs[args.k], many.runs[args.k], strict=True))
    result = {
        "device": torch.cuda.get_device_name() if gpu else "cpu",
        "torch": torch.__version__,
        "drafter": str(final),
        "prompts": len(ids),
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "batch": args.batch,
        "one_at_a_time": {"al": round(alone.acceptance[args.k].acceptance_length, 4),
                          **rounds(alone.runs[args.k]),
                          "speculative_s": round(spec_s, 2), "wall_s_with_target_alone": round(alone_s, 2)},
        "batched": {"al": round(many.acceptance[args.k].acceptance_length, 4), **rounds(many.runs[args.k]),
                    "wall_s": round(many_s, 2)},
        "speculative_s_over_batched_s": round(spec_s / many_s, 2),
        "prompts_with_the_same_rounds": same,
    }  # fmt: skip
    out = args.out or REPO / "bench" / "results" / f"batched_eval_{'gpu' if gpu else 'cpu'}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
