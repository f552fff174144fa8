"""drafter_eval and the promotion gate: the exported drafter measured by real speculative decoding.

`eval_step` loads the newest export exactly as an engine would (the exported directory, nothing from
training), decodes the held-out prompts and every configured prompt file with and without it, and writes
`export/<run>/eval/report-<format>.json` (one per export format measured) with the pictures. When a drafter
is already promoted it is measured again on the same prompts in the same run, so the gate compares two
measurements taken the same way, prompt by prompt. Beside the report it writes the serving recommendation,
`serving-<format>.json` (the K to draft at each batch size, from the acceptance measured and the step costs
timed on the same device; evaluate/serving_k.py) and SGLang's adaptive table from it,
`sglang-adaptive-<format>.json`, which `eagle3 serve-command` prints the engines' arguments from.

`promote_step` moves the `current` pointer to the new run only if the gate passed: the lower end of the
paired-bootstrap 95% interval of AL(new) - AL(promoted) at `gate_k` is at least -`promotion_tolerance`. A
worse drafter is refused once the prompts show it, and two drafters within noise of each other promote the
newer one only when the noise is smaller than the tolerance.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch

from eagle3_core.config import DrafterVariant, Eagle3Config, without_url_passwords
from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.errors import Eagle3Error, ExportError
from eagle3_core.evaluate.measure import (
    DecodeSettings,
    Measurement,
    PromptRun,
    attention_without_cudnn,
    bootstrap_al_interval,
    measure,
    paired_al_difference,
    pooled_runs_al,
)
from eagle3_core.evaluate.plots import acceptance_bars, serving_curves, training_curves
from eagle3_core.evaluate.prompts import EvalPrompt, PromptSet, encode, file_prompts, heldout_prompts
from eagle3_core.evaluate.selection import ALSelector
from eagle3_core.evaluate.serving_k import (
    recommend,
    serving_file,
    sglang_adaptive_config,
    sglang_config_file,
)
from eagle3_core.evaluate.step_costs import measure_step_costs
from eagle3_core.export import FORMATS, check_complete_export, check_finite_export
from eagle3_core.export.common import FormatName
from eagle3_core.export.versions import carried_from
from eagle3_core.steps.common import Log, StepResult, quiet
from eagle3_core.steps.drafter import latest_final, latest_summary
from eagle3_core.store.atomic import atomic_write_json
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.promotion import promote, read_current
from eagle3_core.store.records import (
    CategoryMeasurement,
    DrafterCurrent,
    DrafterDirReport,
    EvalReport,
    GateDecision,
    RunSummary,
    ServingRecommendation,
    SetMeasurement,
)
from eagle3_core.targets.graphed import UnsupportedTargetError, choose_target_step, runs_graphed
from eagle3_core.targets.resolve import target_dir
from eagle3_core.train.run_dir import SUMMARY, read_metrics


class PromotionRefused(Eagle3Error):
    """The gate did not pass: the new drafter measured worse than the promoted one."""


@dataclass(frozen=True)
class Incumbent:
    """The promoted drafter as the gate sees it: its rounds on the same prompts, or why it has none."""

    run: str
    runs: list[PromptRun] | None
    reason: str = ""


@dataclass
class Target:
    model: Any
    tokenizer: Any
    aux_layer_ids: tuple[int, int, int]
    eos_ids: set[int]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def load_target(cfg: Eagle3Config, log: Log) -> Target:
    """The target as extraction loads it (device, dtype and aux layers from the same config)."""
    from eagle3_core.targets.hf import TransformersTarget
    from eagle3_core.targets.regenerate import eos_token_ids

    loaded = TransformersTarget(target_dir(cfg, log=log), cfg.target)
    model = loaded.model.eval()
    return Target(
        model, loaded.tokenizer, loaded.info.aux_layer_ids, set(eos_token_ids(model, loaded.tokenizer))
    )


def load_exported(export_dir: Path, fmt: str, target: Target) -> tuple[Any, torch.Tensor]:
    """(drafter on the target's device and dtype, d2t) from an export directory, checked against the target."""
    from eagle3_core.export import load_export, validate_export

    validate_export(export_dir, fmt)  # type: ignore[arg-type]
    embed = target.model.get_input_embeddings().weight.detach().float().cpu()
    loaded = load_export(export_dir, fmt, embed)  # type: ignore[arg-type]
    if loaded.info.aux_layer_ids != target.aux_layer_ids:
        raise ExportError(
            f"{export_dir}: the drafter reads aux layers {list(loaded.info.aux_layer_ids)} but the target is "
            f"configured with {list(target.aux_layer_ids)}; it would be served with the wrong hidden states"
        )
    dtype = next(target.model.parameters()).dtype
    return loaded.drafter.to(target.device, dtype).eval(), loaded.d2t.to(target.device)


def configured_prompt_sets(cfg: Eagle3Config) -> list[PromptSet]:
    """The held-out set, then each prompt file. The first set is the one the gate compares and the page leads
    with; without held-out conversations (data.holdout_fraction 0, or a store too small to hold any out at
    it) that is the first prompt file."""
    ev = cfg.evaluate
    system = cfg.data.system_prompt
    files = [
        file_prompts(cfg.resolve(f), limit=ev.max_prompts, system_prompt=system) for f in ev.prompt_files
    ]
    try:
        heldout = heldout_prompts(
            cfg.store_root,
            per_conversation=ev.per_conversation,
            limit=ev.max_prompts,
            holdout_fraction=cfg.data.holdout_fraction,
        )
        sets = [heldout, *files]
    except Eagle3Error:
        if not files:
            raise
        sets = files
    seen: set[str] = set()
    for s in sets:  # two files with one stem (or a file called heldout) keep apart in the report
        base, n = s.name, 1
        while s.name in seen:
            n += 1
            s.name = f"{base}_{n}"
        seen.add(s.name)
    return sets


def encode_fitting(tokenizer: Any, prompts: PromptSet, room: int) -> list[tuple[EvalPrompt, list[int]]]:
    """(prompt, token ids) of the prompts that leave room for the reply within the context extraction used;
    the others are kept in `prompts.rejected` as too_long."""
    ids = []
    for p in prompts.prompts:
        encoded = encode(tokenizer, p.messages)
        if len(encoded) <= room:
            ids.append((p, encoded))
        elif not any(r["id"] == p.id for r in prompts.rejected):
            prompts.rejected.append(
                {"id": p.id, "reason": "too_long", "detail": f"{len(encoded)} > {room} tokens"}
            )
    return ids


def _measure_set(
    target: Target,
    drafter: Any,
    d2t: torch.Tensor,
    name: str,
    ids: list[list[int]],
    settings: DecodeSettings,
    log: Log,
) -> Measurement:
    every = max(1, len(ids) // 4)

    def progress(done: int, total: int) -> None:
        if done % every == 0 or done == total:
            log(f"{name}: {done}/{total} prompts decoded (K={list(settings.ks)})")

    return measure(target.model, drafter, d2t, target.aux_layer_ids, ids, target.eos_ids, settings, progress)


def _measure_sets(
    cfg: Eagle3Config,
    target: Target,
    drafter: Any,
    d2t: torch.Tensor,
    sets: list[PromptSet],
    settings: DecodeSettings,
    log: Log,
) -> tuple[dict[str, list[tuple[EvalPrompt, list[int]]]], dict[str, Measurement]]:
    """Each set's prompts that fit beside a reply, and the drafter measured on them."""
    room = cfg.tokenize.max_seq_len - cfg.evaluate.max_new_tokens
    fitting = {s.name: encode_fitting(target.tokenizer, s, room) for s in sets}
    measured = {
        name: _measure_set(target, drafter, d2t, name, [ids for _, ids in kept], settings, log)
        for name, kept in fitting.items()
    }
    return fitting, measured


def _rounded(interval: tuple[float, float]) -> list[float]:
    return [round(x, 4) for x in interval]


class TrainingProbe:
    """The acceptance length of the drafter being trained (train.al_every; train/selection.py), measured as
    drafter_eval measures its export: the weights rounded to the export's dtype, then put in the target's
    device and dtype as an export is loaded; the first `train.al_prompts` held-out prompts that fit (the set
    drafter_eval leads with); evaluate's seed and temperature at `evaluate.gate_k`, at most
    `train.al_max_new_tokens` new tokens. The target is loaded at the first measurement (a finished run loads
    none); the target alone is never decoded (acceptance needs only the speculative rounds)."""

    def __init__(
        self,
        cfg: Eagle3Config,
        model_dir: Path,
        prompts: list[list[int]],
        d2t: torch.Tensor,
        log: Log,
        further: list[list[int]] | None = None,
    ) -> None:
        from eagle3_core.steps.drafter import export_dtype

        ev, tr = cfg.evaluate, cfg.train
        self.cfg, self.log, self.d2t = cfg, log, d2t
        self.k, self.prompts, self.ids = ev.gate_k, len(prompts), prompts
        self.further = further or []  # the next held-out prompts, for `confirm`
        self.confirm_prompts = len(self.further)
        self.export_dtype = export_dtype(cfg, model_dir)
        self.settings = DecodeSettings((ev.gate_k,), tr.al_max_new_tokens, ev.temperature, ev.seed)
        described = json.dumps([asdict(self.settings), ev.target_step, prompts, str(self.export_dtype)])
        self.fingerprint = hashlib.sha256(described.encode()).hexdigest()[:16]
        self.target: Target | None = None

    def measure(self, drafter: Eagle3Drafter) -> list[PromptRun]:
        return self._decode(drafter, self.ids)

    def confirm(self, drafter: Eagle3Drafter) -> list[PromptRun]:
        return self._decode(drafter, self.further)

    def _decode(self, drafter: Eagle3Drafter, ids: list[list[int]]) -> list[PromptRun]:
        t = self._target()
        exported = self._as_exported(drafter, t)
        d2t = self.d2t.to(t.device)
        measured = measure(t.model, exported, d2t, t.aux_layer_ids, ids, t.eos_ids, self.settings,
                           target_alone=False)  # fmt: skip
        return measured.runs[self.k]

    def _target(self) -> Target:
        if self.target is None:
            t = self.target = load_target(self.cfg, self.log)
            # the target's step as drafter_eval takes it, so the AL here is the one drafter_eval measures
            graphed = runs_graphed(self.cfg.evaluate.target_step, t.model, t.aux_layer_ids, t.device.type)
            self.settings = replace(self.settings, graphed_target=graphed)
        return self.target

    def _as_exported(self, drafter: Eagle3Drafter, t: Target) -> Eagle3Drafter:
        """A copy of `drafter` as an export of it loads: its weights rounded to the export dtype, with the
        target's embedding, in the target's device and dtype."""
        from eagle3_core.train.run_dir import drafter_state, load_drafter_state

        embed = t.model.get_input_embeddings().weight.detach().float().cpu()
        state = {n: w.detach().to("cpu", self.export_dtype) for n, w in drafter_state(drafter).items()}
        exported = Eagle3Drafter(drafter.cfg, embed)
        load_drafter_state(exported, state, Path("the drafter in training"))
        return exported.to(t.device, next(t.model.parameters()).dtype).eval()


def training_probe(cfg: Eagle3Config, d2t: torch.Tensor, log: Log) -> TrainingProbe | None:
    """The probe train.al_every asks for (None when it is None), with its prompts encoded by the target's
    tokenizer. Without held-out prompts or prompt files to measure on, Eagle3Error naming the settings."""
    from transformers import AutoTokenizer

    tr = cfg.train
    if tr.al_every is None:
        return None
    try:
        primary = configured_prompt_sets(cfg)[0]
    except Eagle3Error as err:
        if "al_every" in tr.model_fields_set:  # asked for: an error; the default says so and measures nothing
            raise Eagle3Error(
                f"train.al_every: {err}; set train.al_every: null to train without measuring acceptance"
            ) from None
        log(f"acceptance length not measured during training, the run keeps its last weights: {err}")
        return None
    model_dir = target_dir(cfg, log=log)
    if (crowded := target_crowds_training(model_dir)) is not None:
        if "al_every" in tr.model_fields_set:
            raise Eagle3Error(
                f"train.al_every: {crowded}; set train.al_every: null and measure with drafter_eval"
            )
        log(f"acceptance length not measured during training, the run keeps its last weights: {crowded}")
        return None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    room = cfg.tokenize.max_seq_len - tr.al_max_new_tokens
    fitting = [encoded for _, encoded in encode_fitting(tokenizer, primary, room)]
    ids, further = fitting[: tr.al_prompts], fitting[tr.al_prompts : tr.al_prompts + tr.al_confirm_prompts]
    if not ids:
        raise Eagle3Error(
            f"train.al_every: none of the {len(primary.prompts)} {primary.name} prompts fits in "
            f"tokenize.max_seq_len {cfg.tokenize.max_seq_len} beside train.al_max_new_tokens {tr.al_max_new_tokens}"
        )
    log(
        f"acceptance length measured during training on {len(ids)} {primary.name} prompts at K={cfg.evaluate.gate_k}"
    )
    return TrainingProbe(cfg, model_dir, ids, d2t, log, further)


def training_selector(cfg: Eagle3Config, d2t: torch.Tensor, log: Log) -> ALSelector | None:
    """What `train_drafter` is given as its selector for these settings: the acceptance length measured every
    train.al_every steps and the weights train.keep chooses (None where nothing is measured: the run keeps
    its last weights)."""
    probe = training_probe(cfg, d2t, log)
    return ALSelector(probe, cfg.train, log) if probe is not None else None


TARGET_SHARE = 0.25  # of the GPU's memory the target's weights may take beside training


def target_crowds_training(model_dir: Path) -> str | None:
    """Why the target cannot be loaded beside training on this process's GPU (None when it can, or on a CPU):
    its weights would take more than TARGET_SHARE of the device's memory, where training needs the rest."""
    if not torch.cuda.is_available():
        return None
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if weights <= TARGET_SHARE * total:
        return None
    return (
        f"the target's weights ({weights / 2**30:.1f} GiB) would take more than {TARGET_SHARE:.0%} of the GPU's "
        f"{total / 2**30:.0f} GiB beside training"
    )


def gate_decision(
    k: int, run: str, candidate: list[PromptRun], incumbent: Incumbent | None, tolerance: float
) -> GateDecision:
    """Promote when the lower 95% bound of AL(candidate) - AL(incumbent), paired over the same prompts, is at
    least -tolerance; also when nothing (or nothing measurable) is promoted, or the candidate is the promoted run.
    """
    al = pooled_runs_al(candidate, k)
    base: dict[str, Any] = {
        "k": k,
        "candidate_run": run,
        "candidate_al": al,
        "candidate_ci95": _rounded(bootstrap_al_interval(candidate)),
        "tolerance": tolerance,
        "prompts": len(candidate),
        "current_run": incumbent.run if incumbent else None,
    }
    if math.isnan(al):
        return GateDecision(
            passed=False,
            reason="no verification round was measured (every reply ended at once)",
            current_al=None,
            **base,
        )
    if incumbent is None:
        return GateDecision(passed=True, reason="no drafter is promoted yet", current_al=None, **base)
    if incumbent.run == run:
        return GateDecision(passed=True, reason="this run is the promoted one", current_al=None, **base)
    if incumbent.runs is None:
        return GateDecision(passed=True, reason=incumbent.reason, current_al=None, **base)
    current_al = pooled_runs_al(incumbent.runs, k)
    diff = paired_al_difference(candidate, incumbent.runs)
    low, high = diff.ci95
    passed = low >= -tolerance
    reason = (
        f"AL {al:.3f} against the promoted {current_al:.3f} at K={k} on the same {len(candidate)} prompts: "
        f"difference {diff.difference:+.3f} (95% CI {low:+.3f} to {high:+.3f}); its lower bound is "
        f"{'at least' if passed else 'below'} -{tolerance}"
    )
    return GateDecision(
        passed=passed,
        reason=reason,
        current_al=current_al,
        current_ci95=_rounded(bootstrap_al_interval(incumbent.runs)),
        difference=round(diff.difference, 4),
        difference_ci95=_rounded(diff.ci95),
        **base,
    )


def _current_on_same_prompts(
    cfg: Eagle3Config,
    layout: StoreLayout,
    target: Target,
    name: str,
    ids: list[list[int]],
    run: str,
    settings: DecodeSettings,
    log: Log,
) -> Incumbent | None:
    """The promoted drafter's rounds at gate_k on these prompts, measured now (None when nothing is promoted)."""
    current = read_current(layout)
    if current is None:
        return None
    if current.run == run:
        return Incumbent(run, None, "this run is the promoted one")
    export_dir = layout.from_pointer(current.export_dir) / cfg.evaluate.export_format
    try:
        drafter, d2t = load_exported(export_dir, cfg.evaluate.export_format, target)
    except (ExportError, FileNotFoundError, ValueError) as err:
        # a promoted drafter this target cannot run (deleted, or for another target) cannot hold a new one back
        return Incumbent(current.run, None, f"the promoted drafter cannot be measured: {err}")
    log(f"measuring the promoted drafter {current.run} on the same prompts")
    k = cfg.evaluate.gate_k
    at_k = replace(settings, ks=(k,))
    return Incumbent(current.run, _measure_set(target, drafter, d2t, name, ids, at_k, log).runs[k])


def newest_export(layout: StoreLayout) -> tuple[Path, RunSummary, Path]:
    """The newest run's final checkpoint, summary and export (both formats, as the gate measures only what
    can be promoted); Eagle3Error when it is not exported yet."""
    final = latest_final(layout)
    summary = RunSummary.read(final / SUMMARY)
    export_root = layout.exports / summary.run
    if not export_root.exists():
        raise Eagle3Error(
            f"{export_root}: run {summary.run} is not exported yet (materialize drafter_export, or `eagle3 export`)"
        )
    check_complete_export(export_root)
    return final, summary, export_root


def eval_step(cfg: Eagle3Config, log: Log = quiet) -> StepResult:
    """Measure the newest export on the held-out prompts and prompt files; write report-<format>.json and PNGs."""
    ev = cfg.evaluate
    layout = StoreLayout(cfg.store_root)
    final, summary, export_root = newest_export(layout)
    run = summary.run
    target_dir(cfg, log=log)  # a broken target is named first, as every command that loads it does
    # then, before the weights are loaded, a store with no prompt to measure on
    sets = configured_prompt_sets(cfg)
    target = load_target(cfg, log)
    drafter, d2t = load_exported(export_root / ev.export_format, ev.export_format, target)
    ks = tuple(sorted(set(ev.ks)))
    settings = _decode_settings(cfg, ks, target, log)
    fitting, measured = _measure_sets(cfg, target, drafter, d2t, sets, settings, log)
    encoded = {name: [ids for _, ids in kept] for name, kept in fitting.items()}  # the incumbent's too
    primary = sets[0].name
    heldout = measured[primary]
    current = _current_on_same_prompts(cfg, layout, target, primary, encoded[primary], run, settings, log)
    gate = gate_decision(ev.gate_k, run, heldout.runs[ev.gate_k], current, ev.promotion_tolerance)
    out = layout.export_eval(run)
    reported = set_reports(sets, fitting, measured)
    serving = serving_recommendation(cfg, run, target, drafter, primary, reported[primary], log)
    pictures = _pictures(
        out,
        ev.export_format,
        f"{run} ({ev.export_format} export): per-position acceptance, {primary} prompts",
        heldout,
        final.parent,
        summary,
        cfg.train.ttt_steps,
    )
    if serving.unmeasured is None:
        pictures["serving"] = serving_curves(
            serving,
            out / f"serving-{ev.export_format}.png",
            f"drafter {run}: tokens/s at each K and batch size",
        )
    report = EvalReport(
        run=run,
        export_dir=layout.pointer_path(export_root),
        format=ev.export_format,
        device=str(target.device),
        dtype=str(next(target.model.parameters()).dtype).removeprefix("torch."),
        **_recorded(settings),
        tau={str(k): summary.tau(k) for k in ks},
        primary=primary,
        sets=reported,
        gate=gate,
        pictures={name: str(p) for name, p in pictures.items()},
    )
    write_serving(out, serving)  # before the report: a report is never beside an older run's recommendation
    report.write(report_file(out, ev.export_format))
    log(
        f"drafter {run}: AL {heldout.acceptance[ev.gate_k].acceptance_length:.3f} at K={ev.gate_k} on "
        f"{heldout.prompts} {primary} prompts; gate {'passed' if gate.passed else 'refused'}: {gate.reason}"
    )
    meta = _metadata(report, gate.passed, ev.gate_k) | serving_metadata(serving)
    return StepResult("drafter_eval", out, meta, record=report, extra_records=(serving,))


def serving_recommendation(
    cfg: Eagle3Config,
    run: str,
    target: Target,
    drafter: Eagle3Drafter,
    prompt_set: str,
    measured: SetMeasurement,
    log: Log,
) -> ServingRecommendation:
    """The K to draft at each of evaluate.serving_batch_sizes (evaluate/serving_k.py): from the acceptance
    measured on `prompt_set` at the largest evaluated K, and the steps' costs measured on the target's device
    now; `unmeasured`, saying why, where there is nothing to measure them with."""
    ev = cfg.evaluate
    k = max(ev.ks)
    at_k = measured.at(k)
    facts: dict[str, Any] = {
        "run": run,
        "format": ev.export_format,
        "device": str(target.device),
        "dtype": str(next(target.model.parameters()).dtype).removeprefix("torch."),
        "prompt_set": prompt_set,
        "temperature": ev.temperature,
        "measured_k": k,
        "per_position": at_k.per_position,
        "context_tokens": ev.serving_context_tokens,
        "repeats": ev.serving_repeats,
    }
    why = None
    if not ev.serving_batch_sizes:
        why = "evaluate.serving_batch_sizes is empty"
    elif not at_k.rounds:
        why = f"no verification round was measured at K={k} on the {prompt_set} prompts"
    else:
        try:
            with attention_without_cudnn():
                costs = measure_step_costs(
                    target.model, drafter, target.aux_layer_ids, ev.serving_batch_sizes, k,
                    ev.serving_context_tokens, ev.serving_repeats, log,
                )  # fmt: skip
        except UnsupportedTargetError as err:
            why = f"the step costs are timed with the batched target step, which does not compute this one ({err})"
    if why is not None:
        log(f"no serving recommendation: {why}")
        return ServingRecommendation(**facts, costs=[], by_batch=[], unmeasured=why)
    recommendation = ServingRecommendation(**facts, costs=costs, by_batch=recommend(at_k.per_position, costs))
    log(f"serving recommendation, K by batch size: {recommendation.best_k()}")
    return recommendation


def write_serving(eval_dir: Path, recommendation: ServingRecommendation) -> None:
    """The recommendation, and SGLang's adaptive table from it (removed when nothing was measured), in the
    export's eval/ directory, each file written atomically."""
    recommendation.write(serving_file(eval_dir, recommendation.format))
    table = sglang_config_file(eval_dir, recommendation.format)
    if recommendation.unmeasured is None:
        atomic_write_json(table, sglang_adaptive_config(recommendation))
    else:
        table.unlink(missing_ok=True)


def serving_metadata(recommendation: ServingRecommendation) -> dict[str, Any]:
    """The K chosen at each batch size as flat numbers (serving_k_b<batch size>), or why none was."""
    if recommendation.unmeasured is not None:
        return {"serving": f"not measured: {recommendation.unmeasured}"}
    return {f"serving_k_b{b}": k for b, k in recommendation.best_k().items()}


def eval_prompt_file_step(cfg: Eagle3Config, prompts_file: Path, log: Log = quiet) -> StepResult:
    """Measure the newest export (the one `eval_step` measures, in `evaluate.export_format`) on one prompt
    file, into a report of that file's own beside its evaluation (`report_file`); no gate: a prompt file
    chosen at the command line does not promote."""
    ev = cfg.evaluate
    layout = StoreLayout(cfg.store_root)
    _, summary, export_root = newest_export(layout)
    sets = [file_prompts(prompts_file, limit=ev.max_prompts, system_prompt=cfg.data.system_prompt)]
    target = load_target(cfg, log)
    drafter, d2t = load_exported(export_root / ev.export_format, ev.export_format, target)
    ks = tuple(sorted(set(ev.ks)))
    settings = _decode_settings(cfg, ks, target, log)
    fitting, measured = _measure_sets(cfg, target, drafter, d2t, sets, settings, log)
    out = layout.export_eval(summary.run)
    report = DrafterDirReport(
        run=summary.run,
        drafter_dir=str((export_root / ev.export_format).resolve()),
        format=ev.export_format,
        variant=drafter.cfg.model_dump(include=set(DrafterVariant.model_fields)),
        aux_layer_ids=list(target.aux_layer_ids),
        device=str(target.device),
        dtype=str(next(target.model.parameters()).dtype).removeprefix("torch."),
        **_recorded(settings),
        tau={str(k): summary.tau(k) for k in ks},
        primary=sets[0].name,
        sets=set_reports(sets, fitting, measured),
    )
    report.write(report_file(out, ev.export_format, prompts_file))
    return StepResult("drafter_eval", out, _metadata(report, None, ev.gate_k), record=report)


def _recorded(settings: DecodeSettings) -> dict[str, Any]:
    """How a report records the decoding: its settings (one prompt at a time) and the target's step."""
    return {
        "settings": {**asdict(settings), "batch_size": 1},
        "target_step": "graphed" if settings.graphed_target else "eager",
    }


def _decode_settings(cfg: Eagle3Config, ks: tuple[int, ...], target: Target, log: Log) -> DecodeSettings:
    """How an evaluation decodes, with the target's step chosen once (evaluate.target_step) and logged."""
    ev = cfg.evaluate
    graphed, why = choose_target_step(ev.target_step, target.model, target.aux_layer_ids, target.device.type)
    log(f"the target's step: {'graphed' if graphed else 'eager'} ({why})")
    return DecodeSettings(ks, ev.max_new_tokens, ev.temperature, ev.seed, graphed_target=graphed)


def report_file(eval_dir: Path, fmt: str, prompts_file: Path | None = None) -> Path:
    """Each export format's measurement in its own file, and a drafter directory's measurement on one prompt
    file (`eagle3 eval --drafter DIR --prompts FILE`) in a file of that prompt set's own, named by its stem
    and a digest of its resolved path: measuring one never overwrites another's, measuring it again replaces
    only it."""
    if prompts_file is None:
        return eval_dir / f"report-{fmt}.json"
    resolved = Path(prompts_file).resolve()
    digest = hashlib.sha256(os.fsencode(resolved)).hexdigest()[:10]
    stem = re.sub(r"[^\w.-]", "_", resolved.stem)  # a name to show and to list, whatever the file is called
    return eval_dir / f"report-{fmt}-{stem}-{digest}.json"


def set_reports(
    sets: list[PromptSet],
    fitting: dict[str, list[tuple[EvalPrompt, list[int]]]],
    measured: dict[str, Measurement],
) -> dict[str, SetMeasurement]:
    """Each prompt set's measurement as the report holds it: per K, per prompt (named), per category."""
    out: dict[str, SetMeasurement] = {}
    for s in sets:
        prompts = [p for p, _ in fitting[s.name]]
        m = measured[s.name]
        out[s.name] = SetMeasurement(
            prompts=m.prompts,
            device=m.device,
            target_tokens_per_s=round(m.target.tokens_per_s, 2),
            by_k={str(k): m.k_measurement(k, prompts) for k in m.runs},
            rejected=s.reject_counts,
            by_category=by_category(prompts, m),
        )
    return out


def by_category(
    prompts: list[EvalPrompt], measured: Measurement
) -> dict[str, dict[str, CategoryMeasurement]] | None:
    """{category: {K: AL, its interval, prompts}} when the prompts carry a category, else None."""
    categories = sorted({p.category for p in prompts if p.category is not None})
    if not categories:
        return None
    out: dict[str, dict[str, CategoryMeasurement]] = {}
    for category in categories:
        picked = [i for i, p in enumerate(prompts) if p.category == category]
        out[category] = {
            str(k): CategoryMeasurement(
                prompts=len(picked),
                acceptance_length=round(pooled_runs_al([runs[i] for i in picked], k), 4),
                al_ci95=_rounded(bootstrap_al_interval([runs[i] for i in picked])),
            )
            for k, runs in measured.runs.items()
        }
    return out


def eval_drafter_dir_step(
    cfg: Eagle3Config,
    drafter_dir: Path,
    fmt: FormatName | Literal["auto"] = "auto",
    prompts_file: Path | None = None,
    log: Log = quiet,
) -> StepResult:
    """Measure any EAGLE-3 drafter directory (SGLang or speculators/vLLM format, from any trainer) against the
    configured target, on the held-out prompts and prompt files, or on one prompt file.

    The target is run with the drafter's own aux layers (from its config), as its engine would serve it; the
    report goes to `store/eval/drafters/<dir>-<digest>/report-<format>.json` (one prompt file's to a file of
    its own, `report_file`), never into the drafter's dir.
    """
    from eagle3_core.export import detect_format, load_drafter_dir

    ev = cfg.evaluate
    chosen: FormatName = detect_format(drafter_dir) if fmt == "auto" else fmt
    target = load_target(cfg, log)
    embed = target.model.get_input_embeddings().weight.detach().float().cpu()
    loaded = load_drafter_dir(
        drafter_dir,
        chosen,
        embed,
        target_num_layers=int(target.model.config.num_hidden_layers),
        target_architectures=tuple(target.model.config.architectures or ()),
    )
    dtype = next(target.model.parameters()).dtype
    drafter, d2t = loaded.drafter.to(target.device, dtype).eval(), loaded.d2t.to(target.device)
    aux = tuple(loaded.info.aux_layer_ids)
    if aux != target.aux_layer_ids:
        log(
            f"{drafter_dir}: the drafter reads aux layers {list(aux)} (the target is configured with "
            f"{list(target.aux_layer_ids)}); measuring with the drafter's own"
        )
    served = Target(target.model, target.tokenizer, aux, target.eos_ids)  # type: ignore[arg-type]
    sets = (
        [file_prompts(prompts_file, limit=ev.max_prompts, system_prompt=cfg.data.system_prompt)]
        if prompts_file is not None
        else configured_prompt_sets(cfg)
    )
    ks = tuple(sorted(set(ev.ks)))
    settings = _decode_settings(cfg, ks, served, log)
    fitting, measured = _measure_sets(cfg, served, drafter, d2t, sets, settings, log)
    primary = sets[0].name
    out = StoreLayout(cfg.store_root).drafter_dir_eval(drafter_dir)
    report = DrafterDirReport(
        run=Path(drafter_dir).resolve().name,
        drafter_dir=str(Path(drafter_dir).resolve()),
        format=chosen,
        variant=loaded.drafter.cfg.model_dump(include=set(DrafterVariant.model_fields)),
        aux_layer_ids=list(aux),
        device=str(target.device),
        dtype=str(dtype).removeprefix("torch."),
        **_recorded(settings),
        tau={str(k): None for k in ks},  # another trainer's drafter: no training estimate to set beside it
        primary=primary,
        sets=set_reports(sets, fitting, measured),
    )
    report.write(report_file(out, chosen, prompts_file))
    return StepResult("drafter_eval", out, _metadata(report, None, ev.gate_k), record=report)


def _pictures(
    out: Path,
    fmt: str,
    title: str,
    heldout: Measurement,
    run_dir: Path,
    summary: RunSummary,
    steps: int,
) -> dict[str, Path]:
    bars = acceptance_bars(
        {k: a.per_position for k, a in heldout.acceptance.items()},
        {k: a.acceptance_length for k, a in heldout.acceptance.items()},
        out / f"acceptance-{fmt}.png",
        f"drafter {title}",
    )
    curves = training_curves(
        read_metrics(run_dir), steps, out / "training_curves.png", f"drafter {summary.run}: training"
    )
    return {"acceptance": bars, "training_curves": curves}


def _metadata(report: EvalReport | DrafterDirReport, gate_passed: bool | None, gate_k: int) -> dict[str, Any]:
    """Flat numbers for the asset page and the CLI: held-out AL, acceptance rate, speedup and tau per K."""
    heldout = report.sets[report.primary]
    meta: dict[str, Any] = {
        "run": report.run,
        "prompt_set": report.primary,
        "prompts": heldout.prompts,
        "device": report.device,
        "target_step": report.target_step,
        "target_tokens_per_s": heldout.target_tokens_per_s,
    }
    for k, r in heldout.by_k.items():
        meta[f"al_k{k}"] = r.acceptance_length
        meta[f"al_k{k}_ci95_low"], meta[f"al_k{k}_ci95_high"] = r.al_ci95
        meta[f"acceptance_rate_k{k}"] = r.acceptance_rate
        meta[f"speedup_k{k}"] = r.speedup
        tau = report.tau[k]
        meta[f"tau_k{k}"] = tau if tau is not None else -1.0
        if r.greedy_mismatches is not None:
            meta[f"greedy_mismatches_k{k}"] = r.greedy_mismatches
    meta["per_position"] = json.dumps({k: r.per_position for k, r in heldout.by_k.items()})
    for name, s in report.sets.items():
        if name != report.primary:
            meta[f"{name}_al_k{gate_k}"] = s.at(gate_k).acceptance_length
            meta[f"{name}_speedup_k{gate_k}"] = s.at(gate_k).speedup
    meta["gate_passed"] = gate_passed
    return meta


def read_report(cfg: Eagle3Config) -> EvalReport:
    """The newest run's evaluation report (written by eval_step)."""
    layout = StoreLayout(cfg.store_root)
    run = latest_summary(layout).run
    path = report_file(layout.export_eval(run), cfg.evaluate.export_format)
    if not path.exists():
        raise Eagle3Error(
            f"{path}: drafter {run} is not evaluated yet (materialize drafter_eval, or `eagle3 eval`)"
        )
    return EvalReport.read(path)


def promote_step(cfg: Eagle3Config, log: Log = quiet) -> StepResult:
    """Point `current` at the newest evaluated run, if its gate passed on the export there now and that export
    is complete and finite; PromotionRefused, or ExportError naming what is missing or not finite, otherwise."""
    layout = StoreLayout(cfg.store_root)
    report = read_report(cfg)
    path = report_file(layout.export_eval(report.run), cfg.evaluate.export_format)
    measured_on = carried_from(path)
    if measured_on is not None:  # carried into a new version by an export of other bytes (export/versions.py)
        raise PromotionRefused(
            f"drafter {report.run} is not promoted: its evaluation {path} was measured on {measured_on}, the "
            "export before the one it holds now; evaluate it again (`eagle3 eval --promote`, or materialize "
            "drafter_eval)"
        )
    gate = report.gate
    if not gate.passed:
        raise PromotionRefused(f"drafter {gate.candidate_run} is not promoted: {gate.reason}")
    export_root = layout.exports / report.run
    check_complete_export(export_root)  # never promote what cannot be served in both formats
    check_finite_export(export_root, "not promoted")  # nor a diverged run's NaN weights
    record = DrafterCurrent(
        run=report.run,
        export_dir=layout.pointer_path(export_root),
        acceptance_length=gate.candidate_al,
        k=gate.k,
        promoted_at=datetime.now(UTC).isoformat(timespec="seconds"),
        replaced=gate.current_run,
    )
    promote(layout, record, tuple(FORMATS))  # one rename: the record and the drafter served move together
    log(
        f"promoted drafter {report.run} (AL {gate.candidate_al:.3f} at K={gate.k}): {layout.drafter_current_link}"
    )
    return StepResult(
        "drafter_current",
        layout.drafter_current_link,
        {
            "run": report.run,
            "acceptance_length": round(gate.candidate_al, 4),
            "k": gate.k,
            "replaced": gate.current_run or "",
            "serve_sglang": str(layout.drafter_current_link / "sglang"),
        },
    )


def sglang_bench_step(cfg: Eagle3Config, url: str, concurrency: int, log: Log = quiet) -> StepResult:
    """The held-out prompts (and prompt files) sent to a running SGLang server; AL and throughput it reports.

    The prompts are the ones `eval_step` decodes, tokenized here with the target's chat template and sent as
    ids, so the served drafter and the measured export see the same inputs.
    """
    from transformers import AutoTokenizer

    from eagle3_core.engines.sglang_client import benchmark_sglang

    ev = cfg.evaluate
    tokenizer = AutoTokenizer.from_pretrained(target_dir(cfg, log=log, weights=False))
    shown = without_url_passwords(url)  # what is logged and recorded; the requests go to `url`
    meta: dict[str, Any] = {"url": shown, "max_new_tokens": ev.max_new_tokens, "temperature": ev.temperature}
    for prompts in configured_prompt_sets(cfg):
        ids = [encode(tokenizer, p.messages) for p in prompts.prompts]
        log(f"{prompts.name}: {len(ids)} prompts to {shown} ({concurrency} in flight)")
        bench = benchmark_sglang(
            url, ids, max_new_tokens=ev.max_new_tokens, temperature=ev.temperature, concurrency=concurrency
        )
        meta.update(
            {f"{prompts.name}_{k.removeprefix('sglang_')}": v for k, v in bench.as_metadata().items()}
        )
    out = StoreLayout(cfg.store_root).sglang_bench
    atomic_write_json(out, meta)
    return StepResult("sglang_bench", out, meta)
