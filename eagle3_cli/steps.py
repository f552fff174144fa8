"""The `eagle3` command's steps: every command that needs no Dagster instance.

`eagle3_cli.main` adds the commands that run through Dagster (demo, status, materialize, ui) and
is the console script; these commands work the same from either.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

from eagle3_core.config import Eagle3Config, load_config, without_url_passwords
from eagle3_core.errors import ConfigError, Eagle3Error, RecordError
from eagle3_core.evaluate.serving_k import k_by_batch_size
from eagle3_core.steps.common import StepResult
from eagle3_core.store.layout import StoreLayout, check_shard_key
from eagle3_core.store.records import DrafterDirReport, EvalReport, RunSummary, ServingRecommendation

console = Console(highlight=False, width=None if sys.stdout.isatty() else 132)
Command = Callable[[argparse.Namespace], int]


def _config(args: argparse.Namespace) -> Eagle3Config:
    return load_config(args.config)


# The steps report progress as "what: done/total unit" lines (chat-00003: 320/489 samples extracted), some with
# details after a semicolon (chat-00003: 12/40 samples regenerated; 1834 new tokens, 55.2 tokens/s, ETA 1m31s)
_PROGRESS_LINE = re.compile(
    r"^(?P<task>.+?): (?P<done>\d+)/(?P<total>\d+) (?P<unit>[^/;]+)(?:; (?P<detail>.*))?$"
)


class ProgressLog:
    """The steps' log: in a terminal, progress lines drive a live bar per task; elsewhere (CI, pipes, the
    Dagster logs) every line is printed, so a log file keeps the whole history."""

    def __init__(self, out: Console) -> None:
        self.console = out
        self.bars: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, message: str) -> None:
        match = _PROGRESS_LINE.match(message)
        if match is None or not self.console.is_terminal:
            # escaped: a step's message is text, and its brackets ([redacted api key], a list) are shown
            self.console.print(f"[dim]{escape(message)}[/dim]")
            return
        if self.bars is None:
            self.bars = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[detail]}"),
                console=self.console,
            )
            self.bars.start()
        name = f"{match['task']} ({match['unit']})"
        done, total = int(match["done"]), int(match["total"])
        detail = escape(match["detail"] or "")
        if name not in self.tasks:
            self.tasks[name] = self.bars.add_task(name, total=total, detail=detail)
        self.bars.update(self.tasks[name], completed=done, total=total, detail=detail)
        if all(task.finished for task in self.bars.tasks):
            self.bars.stop()
            self.bars, self.tasks = None, {}


progress_log = ProgressLog(console)


def cmd_ingest(args: argparse.Namespace) -> int:
    from eagle3_core.data.ingest import ingest

    cfg = _config(args)
    report = ingest(cfg, log=progress_log)
    console.print(
        f"ingest: {report.rows_read} new rows -> {len(report.new_shards)} new shards "
        f"({sum(s.samples for s in report.new_shards)} samples); {len(report.all_shards)} shards in the store; "
        f"rejected: {report.rejected or 'none'}"
        + (f"; kept in part (cut before an empty turn): {report.truncated}" if report.truncated else "")
    )
    return 0


def cmd_toy_target(args: argparse.Namespace) -> int:
    from eagle3_core.toy.build import ToyTargetReport, build_toy_target, ensure_toy_target

    if args.out:
        report = build_toy_target(Path(args.out), args.size, args.seed, log=progress_log)
        console.print(f"toy target {args.size} -> {args.out}: held-out loss {report.heldout_loss:.3f}")
        return 0
    cfg = _config(args) if Path(args.config).exists() else Eagle3Config()
    path = ensure_toy_target(cfg.cache_root, args.size, args.seed, log=progress_log)
    info = ToyTargetReport.of_target(path)
    console.print(f"toy target {args.size}: {path} (held-out loss {info.heldout_loss:.3f})")
    return 0


def _keys(cfg: Eagle3Config, requested: Sequence[str] | None) -> list[str]:
    """The shards a `--shard` names (each a shard key the store knows), or every shard when none is named:
    the one check of `--shard` for every command that takes it, before any path is built from a key."""
    from eagle3_core.data.ingest import Ledger

    for key in requested or ():
        try:
            check_shard_key(key)
        except ValueError as err:
            raise ConfigError(f"--shard: {err}") from None
    known = Ledger.load(StoreLayout(cfg.store_root).ledger, cfg.data.dataset, cfg.data.shard_size).shard_keys
    if not requested:
        return known
    unknown = sorted(set(requested) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown shard(s) {unknown}; the store has {len(known)} shards (run `eagle3 ingest`)"
        )
    return list(requested)


def _done(cfg: Eagle3Config, step_name: str, key: str) -> bool:
    from eagle3_core.store.stats import shard_done

    if step_name == "regenerate":
        return StoreLayout(cfg.store_root).regenerated(key).exists()
    return shard_done(cfg.store_root, key)  # the shard and its manifest: one without the other is not done


def _run_shards(args: argparse.Namespace, step_name: str) -> int:
    from eagle3_core.steps import data
    from eagle3_core.targets.hf import TransformersTarget
    from eagle3_core.targets.resolve import target_dir

    cfg = _config(args)
    keys = [k for k in _keys(cfg, args.shard) if args.force or args.shard or not _done(cfg, step_name, k)]
    if not keys:
        console.print(f"{step_name}: nothing to do (every shard is done; --force to redo)")
        return 0
    through_server = step_name == "regenerate" and cfg.regenerate.server is not None
    # regenerating through a server needs only the tokenizer, which the server path loads itself
    target = None if through_server else TransformersTarget(target_dir(cfg, log=progress_log), cfg.target)
    for key in keys:
        if step_name == "regenerate":
            result = data.regenerate_step(cfg, key, target, progress_log)
        else:
            assert target is not None
            result = data.extract_step(cfg, key, target, progress_log)
        console.print(
            f"{step_name} {key}: "
            + ", ".join(f"{k}={v}" for k, v in result.metadata.items() if isinstance(v, int | float))
        )
    if target is not None:
        target.close()
    return 0


def cmd_regenerate(args: argparse.Namespace) -> int:
    return _run_shards(args, "regenerate")


def cmd_extract(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if cfg.target.backend.kind == "transformers":
        return _run_shards(args, "extract")
    # target.backend sglang_*: the states come from SGLang (eagle3_core/targets/sglang.py)
    from eagle3_core.steps import data
    from eagle3_core.targets.resolve import open_extraction_target

    keys = [k for k in _keys(cfg, args.shard) if args.force or args.shard or not _done(cfg, "extract", k)]
    if not keys:
        console.print("extract: nothing to do (every shard is done; --force to redo)")
        return 0
    target = open_extraction_target(cfg, log=progress_log)
    try:
        for key in keys:
            result = data.extract_step(cfg, key, target, progress_log)
            console.print(
                f"extract {key}: "
                + ", ".join(f"{k}={v}" for k, v in result.metadata.items() if isinstance(v, int | float))
            )
    finally:
        target.close()
    return 0


def print_stats(cfg: Eagle3Config, max_rows: int = 40) -> None:
    from eagle3_core.store.stats import COLUMNS, HEADERS, store_stats

    stats = store_stats(cfg.store_root)
    table = Table(title=f"hidden-state shards in {cfg.store_root}")
    table.add_column("shard")
    for header in HEADERS:
        table.add_column(header, justify="right")
    shown = (
        stats.shards
        if len(stats.shards) <= max_rows
        else stats.shards[: max_rows // 2] + stats.shards[-max_rows // 2 :]
    )
    for i, row in enumerate(shown):
        if len(shown) < len(stats.shards) and i == max_rows // 2:
            table.add_row(f"... {len(stats.shards) - len(shown)} more", *([""] * len(COLUMNS)))
        table.add_row(row.key, *(f"{row.values[c]:,}" for c in COLUMNS))
    table.add_row("total", *(f"{stats.totals[c]:,}" for c in COLUMNS), style="bold")
    console.print(table)
    per_token = stats.bytes_per_token()
    if per_token:
        console.print(
            "bytes per token: " + ", ".join(f"{n:,.0f} in {dtype}" for dtype, n in per_token.items())
        )
    rejected = ", ".join(f"{k}={v}" for k, v in stats.rejected.items()) or "none"
    truncated = sum(stats.truncated.values())
    console.print(
        f"conversations: {stats.conversations:,} accepted ({stats.heldout:,} held out for evaluation"
        + (f", {truncated:,} kept in part: cut before an empty turn" if truncated else "")
        + f"), rejected rows: {sum(stats.rejected.values()):,} "
        f"({rejected}); disk free: {stats.disk_free / 2**30:.1f} GiB"
    )


def cmd_stats(args: argparse.Namespace) -> int:
    from eagle3_core.store.stats import store_stats

    cfg = _config(args)
    if args.json:
        stats = store_stats(cfg.store_root)
        print(
            json.dumps(
                {
                    "shards": {r.key: r.values for r in stats.shards},
                    "totals": stats.totals,
                    "rejected": stats.rejected,
                    "truncated": stats.truncated,
                    "conversations": stats.conversations,
                },
                indent=1,
            )
        )
    else:
        print_stats(cfg, max_rows=10**9 if args.all else 40)
    return 0


def _repair_manifest(cfg: Eagle3Config, shard: Path) -> None:
    """Rewrite a shard's manifest from its header, holding the shard's writer lock: an extraction of the
    shard at work is left alone (StoreBusyError), its temporary files untouched."""
    from eagle3_core.store.locks import writer_lock
    from eagle3_core.store.shards import manifest_from_header

    key = shard.stem
    layout = StoreLayout(cfg.store_root)
    with writer_lock(layout.writer_lock("hidden_states", key), f"hidden-state shard {key}"):
        manifest_from_header(shard).write(layout.hidden_states_manifest(key))


def cmd_verify(args: argparse.Namespace) -> int:
    from eagle3_core.store.stats import verify_store

    cfg = _config(args)
    results = verify_store(cfg.store_root, _keys(cfg, args.shard) if args.shard else None)
    bad = 0
    for r in results:
        if r.ok:
            console.print(f"[green]ok[/green]      {r.path.name}")
            continue
        if args.repair and all("manifest" in p for p in r.problems):
            _repair_manifest(cfg, r.path)
            console.print(f"[yellow]repaired[/yellow] {r.path.name}: manifest rewritten from the header")
            continue
        bad += 1
        for p in r.problems:
            console.print(f"[red]BAD[/red]     {p}")
    console.print(f"verify: {len(results) - bad}/{len(results)} shards ok")
    return 1 if bad else 0


def cmd_convert_shards(args: argparse.Namespace) -> int:
    from eagle3_core.store.convert import convert_store

    cfg = _config(args)
    keys = _keys(cfg, args.shard) if args.shard else None
    done = convert_store(cfg.store_root, args.to, keys, cfg.extract.disk_headroom, progress_log)
    before, after = sum(c.bytes_before for c in done), sum(c.bytes_after for c in done)
    console.print(
        f"convert-shards: {len(done)} shard(s) re-encoded in {args.to}"
        + (f", {before:,} -> {after:,} bytes ({after / before:.1%})" if before else "")
    )
    return 0


def cmd_vocab(args: argparse.Namespace) -> int:
    from eagle3_core.steps.drafter import vocab_step

    result = vocab_step(_config(args), progress_log)
    console.print("vocab mapping: " + ", ".join(f"{k}={v}" for k, v in result.metadata.items()))
    return 0


def print_training(summary: RunSummary) -> None:
    from eagle3_core.steps.drafter import accuracy_per_position

    steps = int(summary.train_config["ttt_steps"])
    acc = accuracy_per_position(summary, steps)
    console.print(
        f"drafter: run {summary.run}, {summary.steps} steps, {summary.tokens:,} tokens, {summary.seconds} s"
    )
    if (chosen := summary.selection) is not None:
        low, high = chosen.difference_ci95
        console.print(
            f"kept step {chosen.kept_step} of {chosen.measured_steps}: AL {chosen.kept_al:.3f} against "
            f"{chosen.last_al:.3f} at the last step {chosen.last_step} (K={chosen.k}, {chosen.prompts} held-out "
            f"prompts; difference {chosen.difference:+.3f}, 95% CI {low:+.3f} to {high:+.3f})"
        )
    if all(a is None for a in acc):  # nothing was measured: no accuracy or tau to print, not 0 and 1
        console.print(
            "validation: no validation samples"
            if summary.val_samples == 0
            else f"validation: nothing measured on {summary.val_samples} validation samples"
        )
        return
    console.print(
        "validation accuracy per position: "
        + "  ".join(f"acc_{k} {a:.3f}" for k, a in enumerate(acc) if a is not None)
    )
    taus = ", ".join(f"tau({k}) {_or_nan(summary.tau(k)):.2f}" for k in sorted({3, steps}))
    console.print(f"estimated acceptance length: {taus}")


def cmd_train(args: argparse.Namespace) -> int:
    from eagle3_core.steps.drafter import dry_run_step, launch_training, lead_process, vocab_step

    if args.dry_run:
        cfg = _config(args)
        if not args.no_vocab:
            vocab_step(cfg, progress_log)
        dry_run_step(cfg, progress_log)
        console.print("dry run: both exports of the drafter as initialised are valid; nothing was trained")
        return 0

    def train(log: Callable[[str], None]) -> StepResult:
        return launch_training(
            Path(args.config), log, args.nproc, with_vocab=not args.no_vocab, nodes=args.nodes,
            rendezvous=args.rendezvous,
        )  # fmt: skip

    if args.pipes:
        return _report_through_pipes(train)
    result = train(progress_log)
    if lead_process():
        print_training(result.record_as(RunSummary))
    return 0


def _report_through_pipes(train: Callable[[Callable[[str], None]], StepResult]) -> int:
    """`eagle3 train --pipes`: the training a Dagster Pipes client started, its log lines and its result (the
    checkpoint page's numbers, accuracy table and AL curve) reported back to that run."""
    from dagster_pipes import open_dagster_pipes

    from eagle3_core.evaluate.plots import markdown_image
    from eagle3_core.steps.drafter import accuracy_markdown

    with open_dagster_pipes() as pipes:
        result = train(pipes.log.info)
        metadata: dict[str, Any] = {"path": {"raw_value": str(result.path), "type": "path"}}
        for key, value in result.metadata.items():
            metadata[key] = value if isinstance(value, (int, float, str, bool)) else json.dumps(value)
        metadata["accuracy"] = {"raw_value": accuracy_markdown(result.record_as(RunSummary)), "type": "md"}
        if "al_curve" in result.metadata:
            image = markdown_image(Path(result.metadata["al_curve"]), "acceptance length during training")
            metadata["al_curve"] = {"raw_value": image, "type": "md"}
        pipes.report_asset_materialization(metadata=metadata)
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    from eagle3_core.steps.onpolicy import records_step
    from eagle3_core.targets.hf import TransformersTarget
    from eagle3_core.targets.resolve import target_dir

    cfg = _config(args)
    keys = [p.stem for p in StoreLayout(cfg.store_root).hidden_state_shards()]
    keys = _keys(cfg, args.shard) if args.shard else keys
    if not keys:
        raise Eagle3Error("no hidden-state shards to roll out the prompts of (run `eagle3 extract`)")
    target = TransformersTarget(target_dir(cfg, log=progress_log), cfg.target)
    try:
        for key in keys:
            result = records_step(cfg, key, target, progress_log)
            console.print(
                f"rollout {key}: "
                + ", ".join(f"{k}={v}" for k, v in result.metadata.items() if isinstance(v, int | float))
            )
    finally:
        target.close()
    return 0


def cmd_refine(args: argparse.Namespace) -> int:
    from eagle3_core.steps.onpolicy import refine_step

    cfg = _config(args)
    if not cfg.onpolicy.enabled:
        raise ConfigError("onpolicy.enabled is false: set it to refine the drafter on its own rollouts")
    result = refine_step(cfg, progress_log)
    meta = result.metadata
    console.print(
        f"on-policy refinement of {meta['base_run']}: {meta['rounds']} round(s), drafter {meta['run']} "
        f"({meta['stopped']})"
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from eagle3_core.steps.drafter import export_step

    result = export_step(_config(args), progress_log)
    said = "exported" if result.metadata["written"] else "unchanged"
    console.print(f"{said}: {result.metadata['sglang_dir']}  {result.metadata['speculators_dir']}")
    return 0


def print_evaluation(report: EvalReport | DrafterDirReport, ks: Sequence[int]) -> None:
    primary = report.sets[report.primary]
    console.print(
        f"drafter {report.run}: measured on {primary.prompts} {report.primary.replace('heldout', 'held-out')} "
        f"prompts ({report.device}, batch 1; target alone {primary.target_tokens_per_s} tokens/s)"
    )
    for k in ks:
        r = primary.at(k)
        accepts = "  ".join(f"{a:.2f}" for a in r.per_position)
        low, high = r.al_ci95
        tau = report.tau[str(k)]
        console.print(
            f"  K={k}: AL {r.acceptance_length:.2f} (95% CI {low:.2f}-{high:.2f}; "
            f"training estimate tau({k}) {'n/a' if tau is None else f'{tau:.2f}'}), acceptance rate "
            f"{r.acceptance_rate:.2f}, {speedup_text(r.speedup, report.device)}; per position {accepts}"
        )


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value


def speedup_text(median: float, device: str) -> str:
    """The median per-prompt speedup, said plainly where drafting cannot pay (a tiny target on a CPU)."""
    text = f"speedup {median:.2f}x (median over prompts)"
    if device.startswith("cpu") and median < 1.0:
        return (
            f"{text}: no speedup is expected on a CPU, where a target this small costs about what a drafter "
            "round does; speculative decoding pays where the target's forward is memory-bound (a GPU)"
        )
    return text


def print_other_reports(written: Path, gate_k: int) -> None:
    """The drafter's other measurements, kept beside the one just written (other prompt files, formats)."""
    for path in sorted(written.parent.glob("report-*.json")):
        if path == written:
            continue
        try:
            other = DrafterDirReport.read(path)
        except RecordError as err:  # this measurement is written; an old unreadable one is only named
            console.print(f"  kept: {path.name}: unreadable ({escape(str(err))})", soft_wrap=True)
            continue
        measured = [(name, s.by_k.get(str(gate_k))) for name, s in other.sets.items()]
        sets = ", ".join(f"{name} AL {m.acceptance_length:.2f}" for name, m in measured if m is not None)
        at = f"{sets} at K={gate_k}" if sets else f"not measured at K={gate_k}"
        console.print(f"  kept: {path.name} ({other.format}): {escape(at)}", soft_wrap=True)


def cmd_eval(args: argparse.Namespace) -> int:
    from eagle3_core.steps.evaluation import (
        eval_drafter_dir_step,
        eval_prompt_file_step,
        eval_step,
        promote_step,
        report_file,
    )

    cfg = _config(args)
    prompts = Path(args.prompts) if args.prompts else None
    if args.drafter:
        if args.promote:
            raise ConfigError(
                "--promote takes the pipeline's own export; a --drafter directory is only measured"
            )
        result = eval_drafter_dir_step(cfg, Path(args.drafter), args.format, prompts, progress_log)
        report = result.record_as(DrafterDirReport)
        print_evaluation(report, sorted(set(cfg.evaluate.ks)))
        written = report_file(result.path, report.format, prompts)
        console.print(f"report: {escape(str(written))}", soft_wrap=True)
        print_other_reports(written, cfg.evaluate.gate_k)
        return 0
    if prompts is not None:  # the pipeline's newest export, on this file alone
        if args.promote:
            raise ConfigError(
                "--promote gates on the held-out prompts and evaluate.prompt_files; a --prompts file is "
                "only measured"
            )
        result = eval_prompt_file_step(cfg, prompts, progress_log)
        report = result.record_as(DrafterDirReport)
        print_evaluation(report, sorted(set(cfg.evaluate.ks)))
        written = report_file(result.path, report.format, prompts)
        console.print(f"report: {escape(str(written))}", soft_wrap=True)
        return 0
    result = eval_step(cfg, progress_log)
    print_evaluation(result.record_as(EvalReport), sorted(set(cfg.evaluate.ks)))
    serving = result.extra_record(ServingRecommendation)
    if serving is not None:
        said = serving.unmeasured or f"K by batch size {k_by_batch_size(serving)} (`eagle3 serve-command`)"
        console.print(f"serving recommendation: {escape(said)}", soft_wrap=True)
    if args.promote:
        promoted = promote_step(cfg, progress_log)
        console.print(f"promoted: {promoted.metadata['serve_sglang']}")
    return 0


def cmd_bench_sglang(args: argparse.Namespace) -> int:
    from eagle3_core.steps.evaluation import sglang_bench_step

    result = sglang_bench_step(_config(args), args.url, args.concurrency, progress_log)
    console.print("sglang: " + ", ".join(f"{k}={v}" for k, v in result.metadata.items()))
    return 0


def cmd_serve_command(args: argparse.Namespace) -> int:
    from eagle3_core.steps.serving import serve_commands

    commands = serve_commands(_config(args), Path(args.export) if args.export else None)
    if args.json:
        print(json.dumps(commands, indent=1))
        return 0
    # plain print, not rich: the lines must reach the terminal unwrapped and with their brackets, to be pasted
    if commands["sglang_adaptive_config"]:
        print(f"drafter: {commands['drafter']} ({commands['which']}); {commands['serving']}")
    else:
        print(f"drafter: {commands['drafter']} ({commands['which']}); K={commands['k']} (evaluate.gate_k)")
        print(commands["serving"])
    if commands["figures"]:
        print(commands["figures"])
    if commands["sglang_adaptive_config"]:
        print(f"SGLang's adaptive table: {commands['sglang_adaptive_config']}")
    print(f"\nSGLang:\n{commands['sglang']}\n\nvLLM:\n{commands['vllm']}")
    return 0


def add_core_commands(sub: argparse._SubParsersAction) -> None:
    def add(name: str, fn: Command, help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(fn=fn)
        return p

    add("ingest", cmd_ingest, "Read the configured sources into conversation shards (new data only).")
    p = add(
        "toy-target", cmd_toy_target, "Build (or find cached) the small chat target the demo and tests use."
    )
    p.add_argument("--size", choices=["xs", "m"], default="xs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="Build into this directory instead of the cache.")
    for name, fn, text in (
        ("regenerate", cmd_regenerate, "Replace assistant turns with the target's replies, shard by shard."),
        ("extract", cmd_extract, "Extract hidden states into safetensors shards."),
    ):
        p = add(name, fn, text)
        p.add_argument(
            "--shard", action="append", help="Only this shard (repeatable); default: shards not done."
        )
        p.add_argument("--force", action="store_true", help="Redo shards that are already done.")
    p = add(
        "convert-shards",
        cmd_convert_shards,
        "Re-encode the store's hidden-state shards in another dtype (fp8_e4m3: about half the bytes of "
        "bfloat16), shard by shard, atomically; a rerun converts only what is left.",
    )
    p.add_argument("--to", required=True, choices=["fp8_e4m3", "bfloat16", "float16", "float32"])
    p.add_argument("--shard", action="append", help="Only this shard (repeatable); default: every shard.")
    add("vocab", cmd_vocab, "Build the draft vocabulary over every shard (reused when nothing changed).")
    p = add("train", cmd_train, "Train the drafter on every shard; resumes a run that was cut short.")
    p.add_argument(
        "--nproc", type=int, help="DDP processes (GPUs) through torchrun (default: train.processes)."
    )
    p.add_argument("--nodes", type=int, help="Nodes the run spans (default: train.nodes).")
    p.add_argument(
        "--rendezvous", help="host:port of the c10d rendezvous every node joins (default: train.rendezvous)."
    )
    p.add_argument("--no-vocab", action="store_true", help="Use the saved vocab mapping as it is.")
    p.add_argument(
        "--pipes",
        action="store_true",
        help="Report to the Dagster run that started this through Pipes (orchestration.training: pipes).",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Only export the drafter as initialised in both formats and validate them (every run does this "
        "before its first step), then stop.",
    )
    p = add(
        "rollout",
        cmd_rollout,
        "On-policy records: each shard's training prompts decoded with the newest offline drafter through the "
        "target, what the target computed recorded (shards already recorded with these settings are kept).",
    )
    p.add_argument("--shard", action="append", help="Only this shard (repeatable); default: every shard.")
    add(
        "refine",
        cmd_refine,
        "On-policy refinement (onpolicy section): the drafter trained further on its own rollouts, in rounds "
        "while the measured acceptance length rises; rolls out what a round lacks first.",
    )
    add("export", cmd_export, "Write the newest drafter in SGLang and vLLM/speculators formats, validated.")
    p = add(
        "eval",
        cmd_eval,
        "Measure the exported drafter by speculative decoding (AL, speedup) on held-out prompts.",
    )
    p.add_argument("--promote", action="store_true", help="Then promote it to `current` if the gate passes.")
    p.add_argument(
        "--drafter",
        help="Measure this EAGLE-3 drafter directory instead (SGLang or speculators/vLLM format, any trainer).",
    )
    p.add_argument(
        "--format",
        choices=["auto", "sglang", "speculators"],
        default="auto",
        help="The --drafter directory's format (auto: from its config.json).",
    )
    p.add_argument(
        "--prompts",
        help="Measure on this prompt file (JSONL) only (the newest export, or --drafter's directory); each "
        "file's report is kept apart.",
    )
    p = add(
        "bench-sglang",
        cmd_bench_sglang,
        "AL and throughput from a running SGLang server with EAGLE-3 enabled.",
    )
    p.add_argument("--url", required=True, help="The server, e.g. http://127.0.0.1:30000")
    p.add_argument("--concurrency", type=int, default=1)
    p = add(
        "serve-command",
        cmd_serve_command,
        "Print the SGLang and vLLM commands that serve the promoted (else the newest exported) drafter, with "
        "the K its evaluation measured best at each batch size.",
    )
    p.add_argument("--export", help="Serve this export directory (store/drafter/export/<run>) instead.")
    p.add_argument("--json", action="store_true", help="The commands as JSON.")
    p = add("stats", cmd_stats, "Shard statistics from manifests alone (opens no tensor file).")
    p.add_argument("--json", action="store_true")
    p.add_argument("--all", action="store_true", help="One row per shard even when there are many.")
    p = add(
        "verify", cmd_verify, "Check every shard's checksums; exit 1 if any shard is corrupt or truncated."
    )
    p.add_argument("--shard", action="append")
    p.add_argument(
        "--repair", action="store_true", help="Rewrite missing or stale manifests from shard headers."
    )


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    parser = argparse.ArgumentParser(
        prog="eagle3", description="Train EAGLE-3 drafters for your own target model."
    )
    parser.add_argument(
        "--config", "-c", default="eagle3.yaml", help="The run's YAML file (default: eagle3.yaml)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_core_commands(sub)
    return parser, sub


def run(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> int:
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except (Eagle3Error, FileNotFoundError) as err:
        # one line however long (soft_wrap), and the message's brackets printed, not read as markup; a URL in
        # it without its password, whoever wrote the message
        console.print(f"[red]error:[/red] {escape(without_url_passwords(str(err)))}", soft_wrap=True)
        return 2


def main(argv: Sequence[str] | None = None) -> int:
    parser, _ = build_parser()
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
