"""Exports of a trained drafter that SGLang and vLLM/speculators load as-is, validated against their key sets."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_core.errors import ExportError
from eagle3_core.export.common import (
    ExportFormat,
    ExportInfo,
    ExportTarget,
    FormatName,
    LoadedExport,
    check_export,
    load,
)
from eagle3_core.export.sglang import SGLANG, export_sglang
from eagle3_core.export.speculators import SPECULATORS, export_speculators

FORMATS: dict[FormatName, ExportFormat] = {"sglang": SGLANG, "speculators": SPECULATORS}


def _format(fmt: FormatName) -> ExportFormat:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def validate_export(out_dir: Path, fmt: FormatName) -> None:
    """Raise ExportError unless `out_dir` is a complete, self-consistent export in `fmt` (works on any directory)."""
    check_export(_format(fmt), Path(out_dir))


def load_export(out_dir: Path, fmt: FormatName, embed_weight: torch.Tensor | None = None) -> LoadedExport:
    """Rebuild our drafter from an export: (drafter, d2t, t2d, info), aux layer ids in the project convention.

    `embed_weight`: the target's embedding; required for SGLang (it shares the target's), optional for
    speculators (the export carries it; when given, the two must be equal).
    """
    return load(_format(fmt), Path(out_dir), embed_weight)


__all__ = [
    "ExportInfo",
    "ExportTarget",
    "FormatName",
    "LoadedExport",
    "export_sglang",
    "export_speculators",
    "load_export",
    "validate_export",
]
