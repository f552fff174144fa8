"""Exports of a trained drafter that SGLang and vLLM/speculators load as-is, validated against their key sets;
and the loading of any EAGLE-3 drafter directory in either format, ours or another trainer's.

A run's export is published whole (`publish_export`): both formats in one directory, each validated, then
linked in one rename, so a crash or a full disk leaves the previous export or none, never one format alone.
Exporting the same bytes again publishes nothing; a new version carries the previous one's evaluation
(export/versions.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.errors import ExportError
from eagle3_core.export.common import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    ExportFormat,
    ExportInfo,
    ExportTarget,
    FormatName,
    LoadedExport,
    check_export,
    export_bytes,
    export_contents,
    load,
    read_config_file,
)
from eagle3_core.export.sglang import ARCHITECTURE as SGLANG_ARCHITECTURE
from eagle3_core.export.sglang import SGLANG, export_sglang, written_layer_ids
from eagle3_core.export.speculators import SPECULATORS, SpeculatorsFormat, export_speculators
from eagle3_core.export.versions import carry_eval, contents_digest, version_digest, write_digest
from eagle3_core.finite import nonfinite_tensor
from eagle3_core.store.atomic import atomic_versioned_directory, keep_only_linked
from eagle3_core.store.disk import disk_preflight, full_disk_is_one_line

FORMATS: dict[FormatName, ExportFormat] = {"sglang": SGLANG, "speculators": SPECULATORS}
# free disk an export needs, over its estimated size: room for the filesystem's own overhead, as a shard's
# default (`extract.disk_headroom`) leaves it
EXPORT_DISK_HEADROOM = 1.5


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


def check_complete_export(export_dir: Path) -> None:
    """ExportError, in one line naming what is missing or wrong, unless `export_dir` holds both formats, each a
    valid export: a drafter is served and promoted as the pair. (An export cut short by an eagle3 that wrote
    the formats one after the other holds `sglang/` alone.)"""
    export_dir = Path(export_dir)
    missing = [f"{name}/{CONFIG_FILE}" for name in FORMATS if not (export_dir / name / CONFIG_FILE).is_file()]
    if missing:
        raise ExportError(
            f"{export_dir}: incomplete export: no {' and no '.join(missing)}; export it again "
            "(`eagle3 export`, or materialize drafter_export), which writes both formats or neither"
        )
    for name, fmt in FORMATS.items():
        check_export(fmt, export_dir / name)


def check_finite_export(export_dir: Path, refused: str) -> None:
    """ExportError, in one line naming the weights file and the tensor, unless every weight of both formats in
    `export_dir` (ours: WEIGHTS_FILE each) is finite; `refused` says what is not done ("not promoted"). An
    eagle3 before the export's own check exported a diverged run's NaN weights."""
    for name in FORMATS:
        weights = Path(export_dir) / name / WEIGHTS_FILE
        with safe_open(str(weights), framework="pt") as f:
            bad = nonfinite_tensor((key, f.get_tensor(key)) for key in sorted(f.keys()))
        if bad is not None:
            raise ExportError(
                f"{weights}: {bad}: {refused}: weights that are not finite draft nothing (a diverged training "
                "run? train it again with a lower train.lr, then export it)"
            )


def publish_export(
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: ExportTarget,
    link: Path,
    versions: Path,
    *,
    dtype: torch.dtype,
    speculative_tokens: int,
) -> PublishedExport:
    """Both formats of the drafter in one new version directory in `versions`, each validated while hidden,
    then published at `link` (`export/<run>`) in one rename (store/atomic.py `atomic_versioned_directory`).
    The caller holds the run's export lock.

    What would be written is compared first with what `link` holds (export/versions.py, by digest): the same
    bytes publish nothing, and the version stays as it is, its evaluation with it. Other bytes (the run's
    weights changed, another dtype, an eagle3 that writes otherwise) make a new version that carries the
    previous one's eval/, marked as measured on it. Weights that are not finite are refused in one line naming
    the tensor, before anything is written.

    `link` stays the previous export, whole, until that rename: a crash, or any error, before it publishes
    nothing. A disk with less than EXPORT_DISK_HEADROOM times the export's size free is refused before anything
    is written, and a full disk under the writes is a DiskSpaceError saying so.
    """
    keep_only_linked(link, versions)  # what crashed exports left is cleared first: its space counts as free
    formats: dict[FormatName, ExportFormat] = {
        "sglang": SGLANG,
        "speculators": SpeculatorsFormat(speculative_tokens),
    }
    digest = contents_digest(
        (name, export_contents(fmt, drafter, mapping, target, dtype, str(link)))
        for name, fmt in formats.items()
    )
    before = version_digest(link, formats) if link.exists() else None
    if before == digest:
        return PublishedExport(link, written=False)
    needed = sum(export_bytes(fmt, drafter, mapping, dtype) for fmt in formats.values())
    disk_preflight(versions, needed, EXPORT_DISK_HEADROOM, f"the export of {link} (sglang and speculators)")
    with _disk_full_said(link, versions), atomic_versioned_directory(link, versions) as staging:
        export_sglang(drafter, mapping, target, staging / "sglang", dtype=dtype)
        export_speculators(
            drafter,
            mapping,
            target,
            staging / "speculators",
            dtype=dtype,
            speculative_tokens=speculative_tokens,
        )
        check_complete_export(staging)
        write_digest(staging, digest)
        # what the version replaced was measured to be is kept (the promoted drafter's report and pictures)
        carried = carry_eval(link, staging, before) if link.exists() else []
    return PublishedExport(link, written=True, carried=tuple(carried))


@dataclass(frozen=True)
class PublishedExport:
    """What `publish_export` did: `link` written anew (False: it held these bytes already, and is as it was),
    and the eval/ files the new version carried from the one it replaced."""

    link: Path
    written: bool
    carried: tuple[str, ...] = ()


def _disk_full_said(link: Path, versions: Path) -> AbstractContextManager[None]:
    """A full disk or quota while exporting -> DiskSpaceError naming the export and the free space left."""

    def say(reason: str, free: int) -> str:
        return (
            f"{link}: the disk filled up while exporting ({reason}); nothing was published, {link} is as it "
            f"was. {versions} has {free:,} bytes ({free / 2**30:.2f} GiB) free: free space, then export again"
        )

    return full_disk_is_one_line(versions, say)


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
    "PublishedExport",
    "check_complete_export",
    "check_finite_export",
    "detect_format",
    "export_sglang",
    "export_speculators",
    "load_drafter_dir",
    "load_export",
    "publish_export",
    "validate_export",
    "written_layer_ids",
]
