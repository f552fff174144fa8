"""Turning a core step's result into Dagster metadata: its flat numbers, and tables drawn from its record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_core.evaluate.plots import markdown_image
from eagle3_core.evaluate.serving_k import recommendation_markdown
from eagle3_core.steps.common import StepResult
from eagle3_core.steps.drafter import accuracy_markdown
from eagle3_core.store.records import (
    CategoryMeasurement,
    EvalReport,
    GateDecision,
    KMeasurement,
    RunSummary,
    ServingRecommendation,
)


def step_metadata(result: StepResult) -> dict[str, Any]:
    meta: dict[str, Any] = {"path": dg.MetadataValue.path(str(result.path))}
    for key, value in result.metadata.items():
        meta[key] = value if isinstance(value, (int, float, str, bool)) else dg.MetadataValue.json(value)
    return meta


def training_metadata(result: StepResult) -> dict[str, Any]:
    """A training step's numbers and its last validation's accuracy per TTT position, as a table."""
    table = accuracy_markdown(result.record_as(RunSummary))
    meta = {**step_metadata(result), "accuracy": dg.MetadataValue.md(table)}
    if "al_curve" in result.metadata:  # acceptance measured during training (train.al_every)
        curve = Path(result.metadata["al_curve"])
        meta["al_curve"] = dg.MetadataValue.md(markdown_image(curve, "acceptance length during training"))
    return meta


def eval_metadata(result: StepResult) -> dict[str, Any]:
    """An evaluation as the asset page shows it: its numbers, tables, the acceptance plot, training curves, the
    gate and the serving recommendation, drawn from the records the step returned (not read back from files)."""
    report = result.record_as(EvalReport)
    pictures = {name: Path(p) for name, p in report.pictures.items()}
    by_category = any(s.by_category for s in report.sets.values())
    return {
        **step_metadata(result),
        "acceptance_table": dg.MetadataValue.md(acceptance_table(report)),
        "acceptance_plot": dg.MetadataValue.md(
            markdown_image(pictures["acceptance"], "per-position acceptance")
        ),
        "training_curves": dg.MetadataValue.md(
            markdown_image(pictures["training_curves"], "training curves")
        ),
        "gate": dg.MetadataValue.md(gate_table(report.gate)),
        **({"acceptance_by_category": dg.MetadataValue.md(category_table(report))} if by_category else {}),
        **serving_metadata(result.extra_record(ServingRecommendation), pictures.get("serving")),
    }


def serving_metadata(recommendation: ServingRecommendation | None, plot: Path | None) -> dict[str, Any]:
    """The serving recommendation as a table (or why there is none) and its plot of tokens/s at each K."""
    if recommendation is None:
        return {}
    meta: dict[str, Any] = {"serving_k": dg.MetadataValue.md(recommendation_markdown(recommendation))}
    if plot is not None:
        meta["serving_plot"] = dg.MetadataValue.md(markdown_image(plot, "tokens/s at each K and batch size"))
    return meta


def gate_table(gate: GateDecision) -> str:
    """The promotion decision with both drafters' intervals and the paired difference's."""

    def interval(ci: list[float] | None) -> str:
        return "" if not ci else f" ({ci[0]:.3f} to {ci[1]:.3f})"

    rows = [
        f"**{'promote' if gate.passed else 'refuse'}**: {gate.reason}",
        "",
        f"| drafter | AL at K={gate.k} (95% CI) |",
        "|---|---|",
        f"| new {gate.candidate_run} | {gate.candidate_al:.3f}{interval(gate.candidate_ci95)} |",
    ]
    if gate.current_al is not None:
        rows.append(f"| promoted {gate.current_run} | {gate.current_al:.3f}{interval(gate.current_ci95)} |")
        rows.append(f"| difference (paired) | {gate.difference:+.3f}{interval(gate.difference_ci95)} |")
    return "\n".join(rows)


def al_cell(measured: KMeasurement | CategoryMeasurement) -> str:
    """A measured AL with its 95% interval, as both acceptance tables show it."""
    low, high = measured.al_ci95
    return f"{measured.acceptance_length:.3f} ({low:.2f}-{high:.2f})"


def category_table(report: EvalReport) -> str:
    rows = ["| prompts | category | K | AL (95% CI) | prompts |", "|---|---|---|---|---|"]
    for name, measured in report.sets.items():
        for category, by_k in (measured.by_category or {}).items():
            for k, r in by_k.items():
                rows.append(f"| {name} | {category} | {k} | {al_cell(r)} | {r.prompts} |")
    return "\n".join(rows)


def acceptance_table(report: EvalReport) -> str:
    rows = [
        "| prompts | K | AL (95% CI) | tau(K) | acceptance rate | median speedup | tokens/s | per position |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, measured in report.sets.items():
        for k, r in measured.by_k.items():
            tau = report.tau.get(k)
            rows.append(
                f"| {name} ({measured.prompts}) | {k} | {al_cell(r)} | "
                f"{'n/a' if tau is None else f'{tau:.3f}'} | {r.acceptance_rate:.3f} | {r.speedup:.2f}x | "
                f"{r.tokens_per_s:.1f} (target {measured.target_tokens_per_s:.1f}) | "
                f"{' '.join(f'{a:.2f}' for a in r.per_position)} |"
            )
    return "\n".join(rows)


def gate_metadata(gate: GateDecision) -> dict[str, Any]:
    """The promotion gate's figures as check metadata (the difference only where it was measured)."""
    difference = (
        {
            "difference": gate.difference,
            "difference_ci95_low": gate.difference_ci95[0],
            "difference_ci95_high": gate.difference_ci95[1],
        }
        if gate.difference is not None and gate.difference_ci95 is not None
        else {}
    )
    return {
        "k": gate.k,
        "candidate_run": gate.candidate_run,
        "candidate_al": round(gate.candidate_al, 4),
        "current_run": gate.current_run or "",
        "current_al": -1.0 if gate.current_al is None else round(gate.current_al, 4),
        "tolerance": gate.tolerance,
        "prompts": gate.prompts,
        **difference,
    }
