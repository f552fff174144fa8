"""The drafter pointers (latest.json, current.json, the current link) are relative to the store: a copied or
moved store points at its own drafters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from eagle3_core.config import load_config
from eagle3_core.steps.drafter import latest_final
from eagle3_core.steps.evaluation import promote_step, read_current
from eagle3_core.store.atomic import atomic_write_json
from eagle3_core.store.layout import StoreLayout
from tests.conftest import write_config
from tests.records import evaluated_run


def _store_with_an_evaluated_run(project: Path) -> Path:
    config = write_config(project, "store: store\ntarget: {path: toy}\n")
    evaluated_run(StoreLayout(project / "store"), "r1")
    return config


def test_pointers_hold_paths_relative_to_the_store(tmp_path: Path) -> None:
    config = _store_with_an_evaluated_run(tmp_path / "a")
    promote_step(load_config(config))
    layout = StoreLayout(tmp_path / "a" / "store")
    assert json.loads(layout.drafter_latest.read_text())["final"] == "drafter/runs/r1/final"
    assert json.loads(layout.drafter_current.read_text())["export_dir"] == "drafter/export/r1"
    assert not Path(layout.drafter_current_link.readlink()).is_absolute()


def test_a_moved_store_points_at_its_own_drafters(tmp_path: Path) -> None:
    config = _store_with_an_evaluated_run(tmp_path / "a")
    promote_step(load_config(config))
    shutil.move(tmp_path / "a", tmp_path / "b")
    moved = StoreLayout(tmp_path / "b" / "store")
    assert latest_final(moved) == moved.drafter_runs / "r1" / "final"
    current = read_current(moved)
    assert current is not None
    assert moved.from_pointer(current.export_dir) == moved.exports / "r1"
    assert (moved.drafter_current_link / "sglang").resolve() == (moved.exports / "r1" / "sglang").resolve()
    assert not (tmp_path / "a").exists()


def test_an_absolute_pointer_from_an_older_store_is_still_read(tmp_path: Path) -> None:
    layout = StoreLayout(tmp_path / "store")
    final = layout.drafter_runs / "r0" / "final"
    final.mkdir(parents=True)
    (final / "summary.json").write_text("{}")
    atomic_write_json(layout.drafter_latest, {"run": "r0", "final": str(final.resolve())})
    assert latest_final(layout) == final.resolve()
