"""The drafter domain's steps over every complete shard of the store: vocab_mapping, drafter_checkpoint,
drafter_export.

Like the data domain's steps, each reads the store, writes atomically and returns a `StepResult` whose flat
metadata is what the CLI prints and Dagster shows. `launch_training` is where the drafter_checkpoint step is
started in this process or once per process under torchrun, for the CLI and the Dagster asset alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from eagle3_core.config import Eagle3Config, load_config
from eagle3_core.draft.vocab import (
    VocabMapping,
    build_vocab_mapping,
    coverage_of,
    load_vocab_mapping,
    mapping_fingerprint,
    save_vocab_mapping,
)
from eagle3_core.errors import Eagle3Error, StaleVocabMappingError
from eagle3_core.steps.common import Log, StepResult, quiet
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.locks import writer_lock
from eagle3_core.store.promotion import read_current
from eagle3_core.store.records import DrafterLatest, DrafterRefined, RunSummary
from eagle3_core.store.shards import read_shard_header
from eagle3_core.store.stats import require_intact
from eagle3_core.targets.resolve import target_dir
from eagle3_core.train.distributed import exit_worker
from eagle3_core.train.run_dir import FINAL, SUMMARY
from eagle3_core.train.trainer import train_drafter


def _shards(layout: StoreLayout) -> list[Path]:
    shards = layout.hidden_state_shards()
    if not shards:
        raise Eagle3Error(
            f"{layout.hidden_states_dir}: no hidden-state shards yet (materialize hidden_states)"
        )
    return shards


def torchrun_rank() -> int | None:
    """This process's rank when it is one of a torchrun launch (torchrun sets WORLD_SIZE and RANK in each
    process it starts), else None: the one reading of that environment for the steps and the CLI."""
    if "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ.get("RANK", "0"))


def lead_process() -> bool:
    """Whether this process reports for the run: the only one, or rank 0 of a torchrun launch."""
    return (torchrun_rank() or 0) == 0


def _intact_shards(layout: StoreLayout, log: Log) -> list[Path]:
    """Every shard, each checked against its checksums before anything reads it to build or train (a damaged
    one is refused now, not when training reaches its sample). Under torchrun each rank checks its share:
    a rank that refuses stops them all, before any of them gets past the process group."""
    shards = _shards(layout)
    rank, world = torchrun_rank() or 0, int(os.environ.get("WORLD_SIZE", "1"))
    require_intact(shards[rank::world], log if rank == 0 else quiet)
    return shards


def _tokenizer_and_vocab(shards: list[Path]) -> tuple[str, int]:
    meta = read_shard_header(shards[0])
    return str(meta.tokenizer_fingerprint), meta.target_vocab_size(shards[0])


def expected_mapping_fingerprint(cfg: Eagle3Config, shards: list[Path]) -> str:
    """The fingerprint a mapping built now would carry (from shard headers alone)."""
    tokenizer, vocab = _tokenizer_and_vocab(shards)
    return mapping_fingerprint(shards, vocab, cfg.train.draft_vocab_size, tokenizer_fingerprint=tokenizer)


def _previous(layout: StoreLayout) -> VocabMapping | None:
    try:
        return load_vocab_mapping(layout.vocab_mapping) if layout.vocab_mapping.exists() else None
    except (StaleVocabMappingError, ValueError, KeyError, FileNotFoundError):
        return None  # a torn or foreign mapping is simply rebuilt


def vocab_step(cfg: Eagle3Config, log: Log = quiet) -> StepResult:
    """Build the draft vocabulary over all shards, unless the saved one already has their fingerprint.

    When shards were added since the saved mapping, its coverage on the new shards is reported first: how
    well a drafter bound to the old mapping would serve the new data.
    """
    layout = StoreLayout(cfg.store_root)
    shards = _intact_shards(layout, log)
    tokenizer, vocab = _tokenizer_and_vocab(shards)
    expected = expected_mapping_fingerprint(cfg, shards)
    previous = _previous(layout)
    meta: dict[str, Any] = {}
    if previous is not None and previous.fingerprint == expected:
        mapping, meta["rebuilt"] = previous, False
    else:
        if previous is not None and previous.tokenizer_fingerprint == tokenizer:
            known = {key for key, _ in previous.shard_set}
            new = [p for p in shards if p.stem not in known]
            if new:
                meta["previous_coverage_on_new_shards"] = round(coverage_of(previous, new), 6)
                meta["new_shards"] = len(new)
        mapping = build_vocab_mapping(
            shards, vocab, cfg.train.draft_vocab_size, tokenizer_fingerprint=tokenizer
        )
        save_vocab_mapping(mapping, layout.vocab_mapping)
        meta["rebuilt"] = True
        log(f"vocab mapping: K={mapping.draft_vocab_size}, coverage {mapping.coverage:.4f}")
    meta.update(
        fingerprint=mapping.fingerprint,
        draft_vocab_size=mapping.draft_vocab_size,
        target_vocab_size=mapping.target_vocab_size,
        coverage=round(mapping.coverage, 6),
        counted_tokens=mapping.counted_tokens,
        distinct_tokens=mapping.distinct_tokens,
        padded=mapping.padded,
        shards=len(mapping.shard_set),
    )
    return StepResult("vocab_mapping", layout.vocab_mapping, meta)


def shards_and_mapping(cfg: Eagle3Config, layout: StoreLayout, log: Log) -> tuple[list[Path], VocabMapping]:
    """The store's shards, checked intact, and the vocab mapping built over exactly them."""
    shards = _intact_shards(layout, log)
    fingerprint = expected_mapping_fingerprint(cfg, shards)
    return shards, load_vocab_mapping(layout.vocab_mapping, expected_fingerprint=fingerprint)


def drafter_checkpoint_step(cfg: Eagle3Config, log: Log = print) -> StepResult:
    """A whole training run of the drafter on every shard with the current vocab mapping (resuming a run that
    was cut short), in this process; under torchrun every rank calls it (see `launch_training`)."""
    layout = StoreLayout(cfg.store_root)
    shards, mapping = shards_and_mapping(cfg, layout, log)
    selector = None
    if lead_process():
        from eagle3_core.steps.evaluation import training_selector  # evaluation reads this module's runs

        dry_run_export(cfg, shards, mapping, log)
        selector = training_selector(cfg, mapping.d2t, log)
    result = train_drafter(
        shards,
        target_dir(cfg, log=log),
        mapping,
        layout.drafter_runs,
        cfg.train,
        log=log,
        init_from=promoted_final(layout) if cfg.train.init_from == "current" else None,
        selector=selector,
    )
    if lead_process():
        pointer = DrafterLatest(run=result.run_dir.name, final=layout.pointer_path(result.final_dir))
        pointer.write(layout.drafter_latest)
    return _training_result(cfg, result.final_dir, result.resumed_from)


def dry_run_step(cfg: Eagle3Config, log: Log = print) -> StepResult:
    """`eagle3 train --dry-run`: the run's export checked (`dry_run_export`), and nothing trained."""
    layout = StoreLayout(cfg.store_root)
    seconds = dry_run_export(cfg, *shards_and_mapping(cfg, layout, log), log)
    return StepResult("dry_run", layout.run_dir, {"seconds": round(seconds, 2)})


def dry_run_export(cfg: Eagle3Config, shards: list[Path], mapping: VocabMapping, log: Log) -> float:
    """Before a run's first step, the drafter as initialised is exported in both formats into a scratch
    directory of the store, each written and validated as `export_step` writes it (every tensor, shape, dtype
    and config field an engine reads), then removed: an export the engines would refuse stops the run in
    seconds with the export's one-line error, not after hours of training. Its seconds."""
    from eagle3_core.export import ExportTarget, export_sglang, export_speculators
    from eagle3_core.targets.head import load_target_head
    from eagle3_core.train.trainer import drafter_config_for, new_drafter

    started = time.perf_counter()
    layout = StoreLayout(cfg.store_root)
    target = target_dir(cfg, log=log)
    header = read_shard_header(shards[0])
    if header.aux_layer_ids is None or header.final_state_convention is None:
        raise Eagle3Error(f"{shards[0]}: no aux_layer_ids or final_state_convention in its header")
    facts = ExportTarget.from_model_dir(target, header.aux_layer_ids, header.final_state_convention)
    head = load_target_head(target)
    dcfg = drafter_config_for(target, mapping.draft_vocab_size, cfg.train.variant)
    drafter = new_drafter(dcfg, head, mapping, cfg.train.seed)
    dtype = export_dtype(cfg, target)
    scratch = layout.run_dir / f"dry-run-{os.getpid()}"
    try:
        for name, export in (("sglang", export_sglang), ("speculators", export_speculators)):
            export(drafter, mapping, facts, scratch / name, dtype=dtype)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - started
    log(f"dry run: the drafter as initialised exports in both formats ({seconds:.1f} s)")
    return seconds


def launch_training(
    config_path: Path,
    log: Log = print,
    processes: int | None = None,
    *,
    with_vocab: bool = False,
    nodes: int | None = None,
    rendezvous: str | None = None,
) -> StepResult:
    """The drafter_checkpoint step as configured, the one place that decides how it runs, for the CLI and the
    Dagster asset alike: in this process when this process is already a torchrun rank (someone ran
    `torchrun eagle3 train`) or `processes` (default train.processes) is 1 on one node, else once per process
    under a torchrun this starts. `with_vocab` builds the vocab mapping first, once, before any rank starts
    (ranks only read it); a rank of a launch made elsewhere leaves it to whoever launched it. `nodes` and
    `rendezvous` stand in for train.nodes and train.rendezvous (a scheduler's job script knows them; they are
    no part of the run's identity). A `processes` below 1, a rendezvous that is not host:port, or a node
    rank (`node_rank`) not below the nodes is refused naming its flag or variable."""
    if processes is not None and processes < 1:  # 0 fell back to train.processes, -1 trained in one process
        raise Eagle3Error(f"--nproc: Input should be greater than 0 (got {processes})")
    cfg = load_config(config_path)
    if torchrun_rank() is not None:
        return drafter_checkpoint_step(cfg, log)
    launch = {k: v for k, v in (("nodes", nodes), ("rendezvous", rendezvous)) if v is not None}
    if launch:
        try:
            train = cfg.train.model_validate({**cfg.train.model_dump(), **launch})
        except ValidationError as err:
            first = err.errors()[0]
            message = first["msg"].removeprefix("Value error, ")
            raise Eagle3Error(f"--{first['loc'][0]}: {message}") from None
        cfg = cfg.model_copy(update={"train": train})
    multi_node = cfg.train.nodes > 1
    rank = None
    if multi_node:  # a rank is needed to choose who builds the vocab; one that is set is checked either way
        counted_by = "--nodes" if nodes is not None else "train.nodes"
        rank = (
            node_rank(cfg.train.nodes, counted_by)
            if with_vocab
            else given_node_rank(cfg.train.nodes, counted_by)
        )
    if with_vocab and (not multi_node or rank == 0):  # every node's ranks wait for node 0 to join
        vocab_step(cfg, log)
    processes = cfg.train.processes if processes is None else processes
    if processes > 1 or multi_node:
        return _torchrun_training(config_path, cfg, processes, log)
    return drafter_checkpoint_step(cfg, log)


NODE_RANK_VARIABLES = ("SLURM_NODEID", "JOB_COMPLETION_INDEX", "EAGLE3_NODE_RANK")


def node_rank(nodes: int, counted_by: str = "train.nodes") -> int:
    """This node's rank in a run of `nodes` > 1 (`given_node_rank`); Eagle3Error naming the variables when
    none is set."""
    rank = given_node_rank(nodes, counted_by)
    if rank is None:
        raise Eagle3Error(
            f"train.nodes > 1: this node's rank is unknown; set one of {', '.join(NODE_RANK_VARIABLES)}"
        )
    return rank


def given_node_rank(nodes: int, counted_by: str = "train.nodes") -> int | None:
    """This node's rank from the first of NODE_RANK_VARIABLES set (the scheduler's environment: Slurm's, a
    Kubernetes indexed job's; or EAGLE3_NODE_RANK), None when none is; Eagle3Error naming the variable when
    its value is not a rank from 0 to `nodes` - 1 (`counted_by` names where `nodes` came from)."""
    for name in NODE_RANK_VARIABLES:
        if (value := os.environ.get(name)) is not None:
            if not (value.isascii() and value.isdigit()):
                raise Eagle3Error(f"{name}={value!r}: a node rank is a non-negative integer")
            if int(value) >= nodes:
                raise Eagle3Error(
                    f"{name}={value}: this node's rank must be below {counted_by} ({nodes}), the nodes of the "
                    f"run (ranks 0 to {nodes - 1}); count every node of the job there"
                )
            return int(value)
    return None


def torchrun_command(config_path: Path, cfg: Eagle3Config, processes: int) -> list[str]:
    """torchrun for this node: standalone on one node; with train.nodes > 1 the c10d rendezvous at
    train.rendezvous, named after the store (every node shares it), so that the nodes of one run meet."""
    tr = cfg.train
    if tr.nodes == 1:
        launch = ["--standalone"]
    else:
        if not tr.rendezvous:
            raise Eagle3Error(
                "train.rendezvous: required with train.nodes > 1 (host:port of the c10d rendezvous)"
            )
        run = hashlib.sha256(str(cfg.store_root.resolve()).encode()).hexdigest()[:12]
        launch = [f"--nnodes={tr.nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={tr.rendezvous}",
                  f"--rdzv-id=eagle3-{run}"]  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc-per-node={processes}",
        f"--max-restarts={tr.max_restarts}", "-m", "eagle3_core.steps.drafter", str(config_path),
    ]  # fmt: skip


def _torchrun_training(config_path: Path, cfg: Eagle3Config, processes: int, log: Log) -> StepResult:
    """`drafter_checkpoint_step` once per process under torchrun (`torchrun_command`), then the run's result
    from the store. Each worker runs this module (`python -m eagle3_core.steps.drafter CONFIG`), which trains
    in its process."""
    command = torchrun_command(config_path, cfg, processes)
    log(" ".join(command))
    code = subprocess.call(command)
    if code != 0:
        raise Eagle3Error(
            f"torchrun training exited with status {code} (a rank or a node stopped: the output above says "
            "which); `eagle3 train` again resumes from the newest checkpoint"
            + (", started on every node" if cfg.train.nodes > 1 else "")
        )
    cfg = load_config(config_path)
    return _training_result(cfg, offline_final(StoreLayout(cfg.store_root)), None)


def _training_result(cfg: Eagle3Config, final: Path, resumed_from: int | None) -> StepResult:
    summary = RunSummary.read(final / SUMMARY)
    val, steps = summary.val, cfg.train.ttt_steps
    figures = {"acc_0": val.acc[0], "full_acc_0": val.full_acc[0]} if val else {}
    taus = {f"tau_{k}": summary.tau(k) for k in (3, steps)}
    meta: dict[str, Any] = {
        "run": summary.run,
        "steps": summary.steps,
        "tokens": summary.tokens,
        "seconds": summary.seconds,
        "resumed_from_step": resumed_from if resumed_from is not None else -1,
        "world_size": summary.world_size,
        "train_samples": summary.train_samples,
        "val_samples": summary.val_samples,
        "vocab_mapping": summary.vocab_mapping[:12],
        "acc_per_position": json.dumps(accuracy_per_position(summary, steps)),
        **{f"val_{name}": value for name, value in (figures | taus).items() if value is not None},
        **_selection_metadata(summary, final.parent),
        **gpu_memory_metadata(summary),
    }
    return StepResult("drafter_checkpoint", final, meta, record=summary)


def gpu_memory_metadata(summary: RunSummary) -> dict[str, Any]:
    """A GPU run's peak memory beside the preflight's estimate: how far a user may trust the estimate."""
    gpu = summary.gpu_memory
    if gpu is None:
        return {}
    return {"gpu_peak_gib": gpu.peak_gib, "gpu_estimate_gib": gpu.estimate_gib, "gpu": gpu.device}


def accuracy_markdown(summary: RunSummary) -> str:
    """The last validation's accuracy per TTT position as a markdown table (the checkpoint's asset page)."""
    acc = accuracy_per_position(summary, int(summary.train_config["ttt_steps"]))
    rows = "\n".join(f"| {k} | {a:.3f} |" for k, a in enumerate(acc) if a is not None)
    return "| position | val acc |\n|---|---|\n" + rows if rows else "no validation samples"


def pipes_command(config_path: Path) -> list[str]:
    """`eagle3 train --pipes` for this config, as a Dagster Pipes client starts it."""
    return [sys.executable, "-m", "eagle3_cli.steps", "--config", str(config_path), "train", "--pipes"]


def _selection_metadata(summary: RunSummary, run_dir: Path) -> dict[str, Any]:
    """The acceptance length measured during training: the kept step against the last, and the curve's
    picture (written beside the run's metric log) for the asset page."""
    from eagle3_core.evaluate.plots import acceptance_curve
    from eagle3_core.store.records import ALRow
    from eagle3_core.train.run_dir import read_metrics

    rows = [r for r in read_metrics(run_dir) if isinstance(r, ALRow)]
    if not rows:
        return {}
    chosen = summary.selection
    picture = acceptance_curve(
        rows, chosen.kept_step if chosen else None, run_dir / "acceptance_curve.png",
        f"drafter {summary.run}: acceptance length during training",
    )  # fmt: skip
    meta: dict[str, Any] = {"al_curve": str(picture), "al_last": rows[-1].al, "al_k": rows[-1].k}
    if chosen is not None:
        meta |= {
            "al_kept_step": chosen.kept_step,
            "al_kept": chosen.kept_al,
            "al_kept_minus_last": chosen.difference,
            "al_kept_minus_last_ci95": json.dumps(chosen.difference_ci95),
        }
    return meta


def accuracy_per_position(summary: RunSummary, steps: int) -> list[float | None]:
    """The last validation's top-1 accuracy at each TTT position (None where nothing was validated)."""
    measured = summary.val.acc if summary.val else []
    return [measured[k] if k < len(measured) else None for k in range(steps)]


def promoted_final(layout: StoreLayout) -> Path:
    """The finished training run of the promoted drafter (what train.init_from: current starts from)."""
    current = read_current(layout)  # through the `current` link, as the gate and serving read it
    if current is None:
        raise Eagle3Error("train.init_from is 'current' but no drafter is promoted yet; set it to 'scratch'")
    run = current.run
    final = layout.drafter_runs / run / FINAL
    if not (final / SUMMARY).exists():
        raise Eagle3Error(
            f"train.init_from current: the promoted run {run} has no finished drafter at {final}"
        )
    return final


def offline_final(layout: StoreLayout) -> Path:
    """The newest offline training run's final/ (drafter/latest.json: what drafter_checkpoint trained last)."""
    if not layout.drafter_latest.exists():
        raise Eagle3Error("no trained drafter yet (materialize drafter_checkpoint, or run `eagle3 train`)")
    final = layout.from_pointer(DrafterLatest.read(layout.drafter_latest).final)
    if not (final / SUMMARY).exists():
        raise Eagle3Error(f"{final}: the latest training run has no finished drafter")
    return final


def latest_final(layout: StoreLayout) -> Path:
    """The newest drafter's final/: the on-policy refinement's (drafter/refined.json) while the offline run it
    started from is still the newest, else the newest offline run's. What export, evaluation and promotion
    take."""
    final = offline_final(layout)
    if not layout.drafter_refined.exists():
        return final
    refined = DrafterRefined.read(layout.drafter_refined)
    if refined.base_run != DrafterLatest.read(layout.drafter_latest).run:
        return final  # the offline drafter was retrained since: the refinement is of an older one
    chosen = layout.from_pointer(refined.final)
    if not (chosen / SUMMARY).exists():
        raise Eagle3Error(f"{chosen}: drafter/refined.json names a run with no finished drafter")
    return chosen


def latest_summary(layout: StoreLayout) -> RunSummary:
    """The summary of the newest finished training run (what drafter_checkpoint materialized last)."""
    return RunSummary.read(latest_final(layout) / SUMMARY)


EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def export_dtype(cfg: Eagle3Config, target: Path) -> torch.dtype:
    """The dtype the drafter is exported in: `target.dtype` when it is set; under auto, the target checkpoint's
    own (float32 when its config.json declares none), so a float32 checkpoint gets a float32 drafter.

    Under `--dtype auto` SGLang takes the drafter's dtype from the drafter's config by the rule it applies to
    the target's (engines/sglang_models.py `serving_dtype`: float32 becomes float16), so the two are served in
    one dtype, which `fc` needs (it meets the target's states without a cast). Where the rule differs by
    architecture (a float32 Gemma is served in bfloat16, a float32 Llama-architecture drafter in float16),
    the drafter is exported in the dtype the target is served in. vLLM serves a drafter in the target's.
    """
    from eagle3_core.engines.sglang_models import serving_dtype
    from eagle3_core.targets.model_config import read_text_config

    # the fields as the file gives them (serving_dtype reads a config dict, as SGLang does)
    fields = read_text_config(target).model_dump(exclude_unset=True)
    target_served = serving_dtype(cfg.target.dtype, fields)
    name = target_served
    if cfg.target.dtype == "auto":
        own = str(fields.get("dtype") or fields.get("torch_dtype") or "float32")
        drafter_served = serving_dtype("auto", {"dtype": own, "model_type": "llama"})
        if own in EXPORT_DTYPES and drafter_served == target_served:
            name = own
    return EXPORT_DTYPES[name]


def export_step(cfg: Eagle3Config, log: Log = quiet) -> StepResult:
    """Both engine formats of the newest trained drafter, each validated, published together at
    export/<run>/{sglang,speculators}: the previous export of the run, whole, until both are written."""
    from eagle3_core.export import ExportTarget, publish_export, written_layer_ids
    from eagle3_core.targets.head import load_target_head
    from eagle3_core.train.run_dir import load_trained

    layout = StoreLayout(cfg.store_root)
    final = latest_final(layout)
    target = target_dir(cfg, log=log)
    drafter, mapping, summary = load_trained(final, load_target_head(target).embed)
    facts = ExportTarget.from_model_dir(target, summary.aux_layer_ids, summary.final_state_convention)
    out = layout.exports / summary.run
    with writer_lock(layout.export_lock(summary.run), f"the export of run {summary.run} ({out})"):
        published = publish_export(
            drafter,
            mapping,
            facts,
            out,
            layout.export_versions(summary.run),
            dtype=export_dtype(cfg, target),
            # vLLM's default draft length: the K the promotion gate measured, as the SGLang serve command uses
            speculative_tokens=cfg.evaluate.gate_k,
        )
    sglang, speculators = out / "sglang", out / "speculators"
    sglang_ids = written_layer_ids(sglang)
    if not published.written:
        log(
            f"run {summary.run}: the export is unchanged (the same bytes), kept as it is: {sglang} and {speculators}"
        )
    else:
        carried = f"; its evaluation carried over, measured on the export before: {out / 'eval'}"
        log(f"exported run {summary.run}: {sglang} and {speculators}{carried if published.carried else ''}")
    return StepResult(
        "drafter_export",
        out,
        {
            "run": summary.run,
            "sglang_dir": str(sglang),
            "speculators_dir": str(speculators),
            "aux_layer_ids_project": json.dumps(summary.aux_layer_ids),
            "aux_layer_ids_sglang": json.dumps(sglang_ids),
            "aux_layer_ids_vllm": json.dumps(summary.aux_layer_ids),
            "draft_vocab_size": mapping.draft_vocab_size,
            "final_state_convention": summary.final_state_convention,
            "written": published.written,  # False: the same bytes as the export already there, kept as it is
        },
    )


if __name__ == "__main__":  # one torchrun worker of `launch_training`
    try:
        drafter_checkpoint_step(load_config(Path(sys.argv[1])))
    except Eagle3Error as err:  # one line, as the CLI prints it: rank 0's (the other ranks stop with it)
        if lead_process():
            print(f"error: {err}", file=sys.stderr, flush=True)
        exit_worker(2)
    exit_worker(0)
