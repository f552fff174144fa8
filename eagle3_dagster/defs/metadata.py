"""Turning a core step's result into Dagster metadata: its flat numbers, and tables drawn from its record."""

from __future__ import annotations

from typing import Any, TypeVar

import dagster as dg

from eagle3_core.drafting import accuracy_per_position
from eagle3_core.pipeline import StepResult
from eagle3_core.store.records import Record, RunSummary

R = TypeVar("R", bound=Record)


def step_metadata(result: StepResult) -> dict[str, Any]:
    meta: dict[str, Any] = {"path": dg.MetadataValue.path(str(result.path))}
    for key, value in result.metadata.items():
        meta[key] = value if isinstance(value, (int, float, str, bool)) else dg.MetadataValue.json(value)
    return meta


def record_of(result: StepResult, kind: type[R]) -> R:
    if not isinstance(result.record, kind):
        raise TypeError(f"step {result.key} returned no {kind.__name__} (got {type(result.record).__name__})")
    return result.record


def training_metadata(result: StepResult) -> dict[str, Any]:
    """A training step's numbers and its last validation's accuracy per TTT position, as a table."""
    summary = record_of(result, RunSummary)
    acc = accuracy_per_position(summary, int(summary.train_config["ttt_steps"]))
    rows = "\n".join(f"| {k} | {a:.3f} |" for k, a in enumerate(acc) if a is not None)
    table = "| position | val acc |\n|---|---|\n" + rows if rows else "no validation samples"
    return {**step_metadata(result), "accuracy": dg.MetadataValue.md(table)}
