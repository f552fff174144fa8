"""Exports of a trained drafter that SGLang and vLLM/speculators load as-is, validated against their key sets;
and the loading of any EAGLE-3 drafter directory in either format, ours or another trainer's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import torch

from eagle3_core.errors import ExportError
from eagle3_core.export.common import (
    CONFIG_FILE,
    ExportFormat,
    ExportInfo,
    ExportTarget,
    FormatName,
    LoadedExport,
    check_export,
    load,
    read_config_file,
)
from eagle3_core.export.sglang import ARCHITECTURE as SGLANG_ARCHITECTURE
from eagle3_core.export.sglang import SGLANG, export_sglang, written_layer_ids
from eagle3_core.export.speculators import SPECULATORS, export_speculators

FORMATS: dict[FormatName, ExportFormat] = {"sglang": SGLANG, "speculators": SPECULATORS}


def _format(fmt: FormatName) -> ExportFormat:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return FORMATS[fmt]


def detect_format(directory: Path) -> FormatName:
    """The format of a drafter directory, from its config.json: `speculators_model_type` -> speculators,
    architectures [LlamaForCausalLMEagle3] -> sglang; anything else is an ExportError."""
    where = f"{directory} (drafter directory)"
    config = read_config_file(Path(directory), where)
    if "speculators_model_type" in config:
        return "speculators"
    if config.get("architectures") == [SGLANG_ARCHITECTURE]:
        return "sglang"
    raise ExportError(
        f"{where}: {CONFIG_FILE} is neither a speculators config (speculators_model_type) nor an SGLang "
        f"EAGLE-3 one (architectures [{SGLANG_ARCHITECTURE!r}]); its architectures are "
        f"{config.get('architectures')!r}"
    )


def validate_export(out_dir: Path, fmt: FormatName | Literal["auto"]) -> None:
    """Raise ExportError unless `out_dir` is a complete, self-consistent drafter directory in `fmt`.

    Our own exports are held to their exact layout; a drafter from another trainer to what its engine loads.
    """
    check_export(_format(detect_format(out_dir) if fmt == "auto" else fmt), Path(out_dir))


def load_drafter_dir(
    path: Path,
    fmt: FormatName | Literal["auto"] = "auto",
    embed_weight: torch.Tensor | None = None,
    *,
    target_num_layers: int | None = None,
    target_architectures: Sequence[str] = (),
) -> LoadedExport:
    """Rebuild our drafter from any EAGLE-3 drafter directory: (drafter, d2t, t2d, info), aux layer ids in the
    project convention, the drafter in the directory's dtype and with the variant its engine runs.

    `fmt` "auto" reads it from config.json (`detect_format`). `embed_weight`: the target's embedding; required
    for SGLang (it gives the drafter the target's) and for a speculators directory without one, optional
    otherwise (when given, the two must be equal). `target_num_layers`: only for a config that names no aux
    layers, whose engines then default to (2, L//2, L-3). `target_architectures`: for a drafter made
    elsewhere, the target's (SGLang numbers aux layers by model).
    """
    path = Path(path)
    chosen = detect_format(path) if fmt == "auto" else fmt
    return load(
        _format(chosen),
        path,
        embed_weight,
        target_num_layers=target_num_layers,
        target_architectures=target_architectures,
    )


def load_export(out_dir: Path, fmt: FormatName, embed_weight: torch.Tensor | None = None) -> LoadedExport:
    """`load_drafter_dir` in a given format: our exports and other trainers' alike."""
    return load_drafter_dir(out_dir, fmt, embed_weight)


__all__ = [
    "ExportInfo",
    "ExportTarget",
    "FormatName",
    "LoadedExport",
    "detect_format",
    "export_sglang",
    "export_speculators",
    "load_drafter_dir",
    "load_export",
    "validate_export",
    "written_layer_ids",
]
