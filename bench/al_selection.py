"""Keeping the best measured drafter, not the last, on a real model run long enough to overfit.

    python -m bench.al_selection                      # SmolLM2-135M-Instruct on this CPU (about 15 minutes)
    python -m bench.al_selection --conversations 400 --epochs 40 --device cuda

SmolLM2's own greedy replies to a small set of chitchat conversations are regenerated and extracted (the
`eagle3` steps), and a drafter is trained on them for many epochs with the acceptance length measured during
training (`train.al_every`, `train.keep: best_al`, no overhead cap so that every due step is measured). Then
the kept weights (`final/`), the best measured step's (`best/`) and the last step's (its checkpoint) decode
the same further held-out prompts, ones the in-training measurement never saw, and the paired differences
against the last are reported with their 95% intervals: the kept weights should never be worse than the last
beyond noise, and when the run keeps its last step, the best measured one should not beat it there either.
The result goes to bench/results/al_selection_<device>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

if __package__ in (None, ""):  # run as a file: import `bench` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import load_config
from eagle3_core.evaluate.measure import DecodeSettings, measure, paired_al_difference, pooled_runs_al
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import ALRow, DrafterLatest, KeptRounds, RunSummary
from eagle3_core.train.run_dir import SUMMARY, load_drafter_state, load_trained, read_metrics

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=REPO / ".cache" / "al_selection")
    p.add_argument("--target", default="smollm2", help="target.path (toy: the tests' tiny run)")
    p.add_argument("--conversations", type=int, default=80)
    p.add_argument(
        "--holdout-fraction",
        type=float,
        default=0.3,
        help="share of the conversations held out (never trained on)",
    )
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=None, help="train.lr (default: eagle3's)")
    p.add_argument("--schedule", choices=["cosine", "linear", "constant"], default=None)
    p.add_argument("--al-every", type=int, default=10)
    p.add_argument("--al-prompts", type=int, default=12)
    p.add_argument(
        "--compare-prompts", type=int, default=24, help="further held-out prompts for kept vs last"
    )
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--confirm-prompts", type=int, default=32, help="train.al_confirm_prompts")
    p.add_argument(
        "--compare-run",
        type=Path,
        default=None,
        help="compare this finished run directory of --workdir's store instead of training (a run trained "
        "under other settings, e.g. before train.al_confirm_prompts existed)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def project(args: argparse.Namespace) -> Path:
    config = {
        "store": "store",
        "cache": str(REPO / ".cache" / "eagle3"),
        "data": {"dataset": "chat", "sources": [{"kind": "chitchat", "limit": args.conversations}],
                 "shard_size": args.conversations, "holdout_fraction": args.holdout_fraction},
        "target": {"path": args.target, "device": args.device},
        "regenerate": {"enabled": True, "temperature": 0.0, "max_new_tokens": 64, "max_turns": 1, "batch_size": 16},
        "tokenize": {"max_seq_len": 1024},
        "train": {"draft_vocab_size": 2048, "batch_tokens": 2048, "max_len": 1024, "epochs": args.epochs,
                  "device": args.device, "log_every": 10, "eval_every": 50, "checkpoint_every": 50,
                  "al_every": args.al_every, "al_prompts": args.al_prompts,
                  "al_max_new_tokens": args.max_new_tokens, "al_overhead": None, "keep": "best_al",
                  "al_confirm_prompts": args.confirm_prompts},
        "evaluate": {"gate_k": 3, "ks": [3], "per_conversation": 1, "temperature": 0.0,
                     "max_prompts": args.al_prompts + args.compare_prompts,
                     "max_new_tokens": args.max_new_tokens},
    }  # fmt: skip
    config["train"] |= {k: v for k, v in (("lr", args.lr), ("schedule", args.schedule)) if v is not None}
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / "eagle3.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def compare_with_last(
    config: Path, run_dir: Path, summary: RunSummary, rows: list[ALRow], args: argparse.Namespace
) -> Any:
    """The kept weights (`final/`) and the best measured step's (`best/`) against the last step's, decoded on
    the held-out prompts after the ones measured during training; and the second look train.al_confirm_prompts
    gives a lead within noise at the last step (best against last over the probe's prompts and the first
    --confirm-prompts further ones). The probe's prompts are decoded again: each step's AL on them must be its
    row's. Weights of one step are decoded once."""
    from safetensors.torch import load_file

    from eagle3_core.evaluate.prompts import heldout_prompts
    from eagle3_core.evaluate.selection import BEST_ROUNDS
    from eagle3_core.steps.evaluation import encode_fitting, load_target
    from eagle3_core.train.checkpoint import WEIGHTS, checkpoint_dir
    from eagle3_core.train.selection import BEST

    cfg = load_config(config)
    target = load_target(cfg, lambda _m: None)
    prompts = heldout_prompts(cfg.store_root, per_conversation=1, limit=cfg.evaluate.max_prompts)
    room = cfg.tokenize.max_seq_len - args.max_new_tokens
    ids = [encoded for _, encoded in encode_fitting(target.tokenizer, prompts, room)]
    embed = target.model.get_input_embeddings().weight.detach().float().cpu()
    kept, mapping, _ = load_trained(run_dir / "final", embed)
    chosen = summary.selection
    best_step = max(reversed(rows), key=lambda r: r.al).step  # ties: the later step
    if KeptRounds.read(run_dir / BEST / BEST_ROUNDS).step != best_step:
        sys.exit(f"{run_dir / BEST} does not hold the best measured step {best_step}")
    steps = {"kept": chosen.kept_step if chosen else summary.steps, "best_measured": best_step,
             "last": summary.steps}  # fmt: skip
    sources = {
        summary.steps: checkpoint_dir(run_dir, summary.steps) / WEIGHTS,
        best_step: run_dir / BEST / WEIGHTS,
    }
    dtype = next(target.model.parameters()).dtype
    settings = DecodeSettings((3,), args.max_new_tokens, 0.0, 0)
    runs: dict[int, Any] = {}
    for step in sorted(set(steps.values())):
        drafter = copy.deepcopy(kept)
        if step != steps["kept"]:
            load_drafter_state(drafter, load_file(str(sources[step])), sources[step].parent)
        d = drafter.to(target.device, dtype).eval()
        m = measure(target.model, d, mapping.d2t.to(target.device), target.aux_layer_ids, ids, target.eos_ids,
                    settings, target_alone=False)  # fmt: skip
        runs[step] = m.runs[3]
    measured = {r.step: r.al for r in rows}
    probe = {step: pooled_runs_al(r[: args.al_prompts], 3) for step, r in runs.items()}
    if any(abs(al - measured[step]) > 1e-3 for step, al in probe.items()):
        sys.exit(f"the probe's prompts decoded again gave {probe}, not the run's {measured}")
    further = {step: r[args.al_prompts :] for step, r in runs.items()}
    last = further[steps["last"]]
    upto = args.al_prompts + args.confirm_prompts
    look = paired_al_difference(runs[best_step][:upto], runs[steps["last"]][:upto])
    return {
        "prompts": len(last),
        "steps": steps,
        "al": {name: round(pooled_runs_al(further[step], 3), 4) for name, step in steps.items()},
        "minus_last": {
            name: paired_al_difference(further[step], last).as_dict()
            for name, step in steps.items()
            if name != "last"
        },
        "second_look": {
            "prompts": len(runs[best_step][:upto]),
            "best_minus_last": look.as_dict(),
            "would_keep": best_step if look.ci95[0] > 0 else steps["last"],
        },
    }


def main(argv: list[str] | None = None) -> None:
    from eagle3_cli.steps import main as eagle3

    args = parse_args(argv)
    torch.set_num_threads(2 if args.device == "cpu" else torch.get_num_threads())
    config = project(args)
    seconds: dict[str, float] = {}
    for command in (["ingest"], ["regenerate"], ["extract"], ["train"]) if args.compare_run is None else ():
        started = time.perf_counter()
        if eagle3(["--config", str(config), *command]) != 0:
            sys.exit(f"eagle3 {command[0]} failed")
        seconds[command[0]] = round(time.perf_counter() - started, 1)
    layout = StoreLayout(load_config(config).store_root)
    run_dir = args.compare_run or layout.from_pointer(DrafterLatest.read(layout.drafter_latest).final).parent
    summary = RunSummary.read(run_dir / "final" / SUMMARY)
    rows = [r for r in read_metrics(run_dir) if isinstance(r, ALRow)]
    started = time.perf_counter()
    comparison = compare_with_last(config, run_dir, summary, rows, args)
    seconds["compare"] = round(time.perf_counter() - started, 1)
    result = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
        "steps": summary.steps,
        "seconds": seconds,  # of this invocation: a rerun of a finished run only compares
        "training_loop_seconds": summary.seconds,  # the run's own, measuring included
        "al_during_training": [r.dump() for r in rows],
        "selection": summary.selection.dump() if summary.selection else None,
        "on_further_heldout_prompts": comparison,
    }
    out = (
        args.out
        or REPO / "bench" / "results" / f"al_selection_{'cpu' if args.device == 'cpu' else 'gpu'}.json"
    )
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        json.dumps(
            {k: result[k] for k in ("steps", "seconds", "selection", "on_further_heldout_prompts")}, indent=1
        )
    )


if __name__ == "__main__":
    main()
