"""drafter_eval (measured AL and speedup of the export) and drafter_current (the promoted drafter), gated by
a blocking check: a drafter that measured worse than the promoted one stops the run before promotion."""

import json
from pathlib import Path
from typing import Any

import dagster as dg

from eagle3_core import evaluation
from eagle3_core.evaluate.plots import markdown_image
from eagle3_dagster.defs.automation import after_its_parent
from eagle3_dagster.defs.drafter.assets import drafter_export
from eagle3_dagster.defs.metadata import step_metadata
from eagle3_dagster.defs.resources import Eagle3Resource


@dg.asset(
    group_name="evaluation",
    deps=[drafter_export],
    pool="gpu",
    kinds={"pytorch"},
    automation_condition=after_its_parent(),
)
def drafter_eval(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """The exported drafter run by speculative decoding on held-out prompts: AL, per position, speedup."""
    cfg = eagle3.config()
    result = evaluation.eval_step(cfg, context.log.info)
    report = json.loads(evaluation.report_file(result.path, cfg.evaluate.export_format).read_text())
    return dg.MaterializeResult(metadata={**step_metadata(result), **report_metadata(report)})


def report_metadata(report: dict[str, Any]) -> dict[str, Any]:
    """An evaluation report as the asset page shows it: tables, the acceptance plot, training curves, the gate."""
    pictures = {name: Path(p) for name, p in report["pictures"].items()}
    by_category = any("by_category" in s for s in report["sets"].values())
    return {
        "acceptance_table": dg.MetadataValue.md(acceptance_table(report)),
        "acceptance_plot": dg.MetadataValue.md(
            markdown_image(pictures["acceptance"], "per-position acceptance")
        ),
        "training_curves": dg.MetadataValue.md(
            markdown_image(pictures["training_curves"], "training curves")
        ),
        "gate": dg.MetadataValue.md(gate_table(report["gate"])),
        **({"acceptance_by_category": dg.MetadataValue.md(category_table(report))} if by_category else {}),
    }


def gate_table(gate: dict[str, Any]) -> str:
    """The promotion decision with both drafters' intervals and the paired difference's."""

    def interval(ci: list[float] | None) -> str:
        return "" if not ci else f" ({ci[0]:.3f} to {ci[1]:.3f})"

    rows = [
        f"**{'promote' if gate['passed'] else 'refuse'}**: {gate['reason']}",
        "",
        f"| drafter | AL at K={gate['k']} (95% CI) |",
        "|---|---|",
        f"| new {gate['candidate_run']} | {gate['candidate_al']:.3f}{interval(gate.get('candidate_ci95'))} |",
    ]
    if gate.get("current_al") is not None:
        rows.append(
            f"| promoted {gate['current_run']} | {gate['current_al']:.3f}{interval(gate.get('current_ci95'))} |"
        )
        rows.append(
            f"| difference (paired) | {gate['difference']:+.3f}{interval(gate.get('difference_ci95'))} |"
        )
    return "\n".join(rows)


def category_table(report: dict[str, Any]) -> str:
    rows = ["| prompts | category | K | AL (95% CI) | prompts |", "|---|---|---|---|---|"]
    for name, measured in report["sets"].items():
        for category, by_k in measured.get("by_category", {}).items():
            for k, r in by_k.items():
                rows.append(
                    f"| {name} | {category} | {k} | {r['acceptance_length']:.3f} "
                    f"({r['al_ci95'][0]:.2f}-{r['al_ci95'][1]:.2f}) | {r['prompts']} |"
                )
    return "\n".join(rows)


def acceptance_table(report: dict[str, Any]) -> str:
    rows = [
        "| prompts | K | AL (95% CI) | tau(K) | acceptance rate | median speedup | tokens/s | per position |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, measured in report["sets"].items():
        for k, r in measured["by_k"].items():
            tau = report["tau"].get(k)
            rows.append(
                f"| {name} ({measured['prompts']}) | {k} | {r['acceptance_length']:.3f} "
                f"({r['al_ci95'][0]:.2f}-{r['al_ci95'][1]:.2f}) | "
                f"{'n/a' if tau is None else f'{tau:.3f}'} | {r['acceptance_rate']:.3f} | {r['speedup']:.2f}x | "
                f"{r['tokens_per_s']:.1f} (target {measured['target_tokens_per_s']:.1f}) | "
                f"{' '.join(f'{a:.2f}' for a in r['per_position'])} |"
            )
    return "\n".join(rows)


@dg.asset_check(
    asset=drafter_eval,
    blocking=True,
    description="AL at gate_k, paired with the promoted drafter's on the same prompts: the lower 95% bound of "
    "the difference is at least -promotion_tolerance",
)
def not_worse_than_current(eagle3: Eagle3Resource) -> dg.AssetCheckResult:
    gate = evaluation.gate_of(evaluation.read_report(eagle3.config()))
    return dg.AssetCheckResult(
        passed=gate.passed,
        severity=dg.AssetCheckSeverity.ERROR,
        description=gate.reason,
        metadata=gate_metadata(gate),
    )


def gate_metadata(gate: evaluation.GateDecision) -> dict[str, Any]:
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


@dg.asset(
    group_name="evaluation",
    deps=[drafter_eval],
    kinds={"safetensors"},
    automation_condition=after_its_parent(),
)
def drafter_current(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """The promoted drafter: `store/drafter/current` points at its export (serve current/sglang)."""
    return dg.MaterializeResult(
        metadata=step_metadata(evaluation.promote_step(eagle3.config(), context.log.info))
    )
