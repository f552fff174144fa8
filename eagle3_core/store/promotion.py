"""The promoted drafter: one symlink, `drafter/current`, is the whole promotion.

It links a promotion directory, `drafter/promotions/<run>-<time>-<pid>/`, written whole before the link moves:

    current.json     the DrafterCurrent record (run, its export, the AL the gate measured, what it replaced)
    sglang           -> ../../export/<run>/sglang
    speculators      -> ../../export/<run>/speculators

so moving `current` (one rename of a new symlink over the old) changes the record and the drafter served
together, and a crash leaves the one promotion or the other, never a link naming one drafter and a record
another. `drafter/current.json` is a fixed symlink to `current/current.json`, for people and tools; eagle3
itself reads the record through the link (`read_current`).

A store promoted before promotion directories has `current` linking `export/<run>` and a plain
`current.json` written after the link (so a crash between the two left them naming different runs). It is
read as it is, the link deciding which drafter is promoted, and upgraded by the next promotion: first the
same promotion is republished as a promotion directory, then the new one.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from eagle3_core.errors import RecordError
from eagle3_core.store.atomic import atomic_symlink, atomic_versioned_directory
from eagle3_core.store.layout import PROMOTION_RECORD, StoreLayout
from eagle3_core.store.locks import writer_lock
from eagle3_core.store.records import DrafterCurrent


def read_current(layout: StoreLayout) -> DrafterCurrent | None:
    """The promoted drafter's record, as the `current` link gives it; None when nothing is promoted."""
    if layout.current_record.is_file():
        return DrafterCurrent.read(layout.current_record)
    return _before_promotion_directories(layout)


def _before_promotion_directories(layout: StoreLayout) -> DrafterCurrent | None:
    """A store promoted by an eagle3 without promotion directories: the link to export/<run> decides the
    run, the plain current.json gives the rest where it names the same run."""
    link, plain = layout.drafter_current_link, layout.drafter_current
    record = DrafterCurrent.read(plain) if plain.is_file() and not plain.is_symlink() else None
    if not link.is_symlink():
        return record
    target = Path(os.readlink(link))
    if target.parent.name != layout.exports.name:
        raise RecordError(
            f"{link}: links {target}, which holds no {PROMOTION_RECORD} (removed by hand?); remove the link "
            "and promote again (`eagle3 eval --promote`)"
        )
    run = target.name
    if record is not None and record.run == run:
        return record
    # the older promotion moved the link, then was cut short before its record: the link says what is
    # served; what the gate measured of that drafter was never recorded (AL NaN, K 0)
    return DrafterCurrent(
        run=run,
        export_dir=layout.pointer_path(layout.exports / run),
        acceptance_length=float("nan"),
        k=record.k if record is not None else 0,
        promoted_at=datetime.fromtimestamp(link.lstat().st_mtime, UTC).isoformat(timespec="seconds"),
        replaced=record.run if record is not None else None,
    )


def promote(layout: StoreLayout, record: DrafterCurrent, formats: Sequence[str]) -> None:
    """Make `record`'s run the promoted drafter in one rename; `formats` are the export's subdirectories
    the promotion directory links. StoreBusyError if another promotion is under way."""
    with writer_lock(layout.promotion_lock, f"the promoted drafter ({layout.drafter_current_link})"):
        if not layout.current_record.is_file():
            before = _before_promotion_directories(layout)
            if before is not None:  # the same promotion first, as a directory: every step stays consistent
                _publish(layout, before, formats)
        _publish(layout, record, formats)


def _publish(layout: StoreLayout, record: DrafterCurrent, formats: Sequence[str]) -> None:
    export = layout.from_pointer(record.export_dir)
    with atomic_versioned_directory(layout.drafter_current_link, layout.promotions, record.run) as staging:
        record.write(staging / PROMOTION_RECORD)
        for name in formats:
            # relative (staging is where the directory will be, depth for depth): a moved store stays whole
            os.symlink(os.path.relpath(export / name, staging), staging / name)
    fixed = os.path.relpath(layout.current_record, layout.drafter_current.parent)
    if not (layout.drafter_current.is_symlink() and os.readlink(layout.drafter_current) == fixed):
        atomic_symlink(layout.drafter_current, layout.current_record)
