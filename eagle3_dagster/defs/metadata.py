"""Turning a core step's flat result into Dagster metadata."""

from __future__ import annotations

from typing import Any

import dagster as dg

from eagle3_core.pipeline import StepResult


def step_metadata(result: StepResult) -> dict[str, Any]:
    meta: dict[str, Any] = {"path": dg.MetadataValue.path(str(result.path))}
    for key, value in result.metadata.items():
        meta[key] = value if isinstance(value, (int, float, str, bool)) else dg.MetadataValue.json(value)
    return meta
