"""Promotion is one step: the `current` link and the record it holds move together (store/promotion.py).

A promotion SIGKILLed at each of its renames, through the CLI's step and through Dagster, leaves the old
promotion or the new one, whole: the record eagle3 reads, `drafter/current.json` and the drafter
`current/sglang` serves all name one run, and the next promotion works and clears what the crash left. A store
promoted by an older eagle3 (a link to export/<run>, a plain current.json) is read and upgraded; an
incomplete export is never promoted.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
from pathlib import Path

import pytest

from eagle3_core.config import load_config
from eagle3_core.errors import ExportError, RecordError
from eagle3_core.steps.evaluation import promote_step, read_current
from eagle3_core.steps.serving import serve_commands
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import DrafterCurrent
from tests.conftest import write_config
from tests.kill import (
    every_crash_point,
    hidden_leftovers,
    promote_latest,
    promote_through_dagster,
    run_killed_at_call,
)
from tests.records import evaluated_run


def served_run(layout: StoreLayout) -> str | None:
    """The run whose export `current/sglang` is, as a server given that path loads it."""
    served = (layout.drafter_current_link / "sglang").resolve()
    runs = [p.name for p in layout.exports.iterdir() if (p / "sglang").resolve() == served]
    return runs[0] if runs else None


def promoted_by_an_older_eagle3(layout: StoreLayout, run: str) -> None:
    """What eagle3 wrote before promotion directories: the link to export/<run>, then a plain current.json."""
    layout.drafter_current_link.symlink_to(Path("export") / run)
    DrafterCurrent(
        run=run,
        export_dir=layout.pointer_path(layout.exports / run),
        acceptance_length=2.5,
        k=3,
        promoted_at="2025-01-01T00:00:00+00:00",
        replaced=None,
    ).write(layout.drafter_current)


def store_to_promote(project: Path, before: str) -> Path:
    """r1 promoted (by this eagle3, or by an older one), r2 the latest, evaluated, its gate passed."""
    config = write_config(project, "store: store\n")
    layout = StoreLayout(project / "store")
    evaluated_run(layout, "r1", seed=1)
    if before == "this eagle3":
        promote_step(load_config(config))
    else:
        promoted_by_an_older_eagle3(layout, "r1")
    evaluated_run(layout, "r2", seed=2)
    return config


def check_one_promotion_then_the_next(config: Path, when: str) -> None:
    """The store a crash left: the drafter served, the record the gate reads and current.json name one run;
    then the next promotion works and clears what the crash left."""
    layout = StoreLayout(config.parent / "store")
    served = served_run(layout)
    assert served in ("r1", "r2"), f"{when}: current/sglang serves {served}"
    current = read_current(layout)
    assert current is not None and current.run == served, f"{when}: the gate reads {current}, {served} served"
    on_disk = DrafterCurrent.read(layout.drafter_current)  # what people and tools read
    assert on_disk.run == served, f"{when}: current.json names {on_disk.run}, {served} served"
    assert serve_commands(load_config(config))["which"].startswith("promoted")

    promote_latest(config)
    assert served_run(layout) == "r2" and read_current(layout).run == "r2", when  # type: ignore[union-attr]
    assert DrafterCurrent.read(layout.drafter_current).run == "r2"
    assert hidden_leftovers(layout.root / "drafter") == [], when


@pytest.mark.parametrize("before", ["this eagle3", "an older eagle3"])
def test_a_promotion_killed_at_any_rename_leaves_one_promotion_whole(tmp_path: Path, before: str) -> None:
    pristine, work = tmp_path / "pristine", tmp_path / "work"
    store_to_promote(pristine, before)

    def reset() -> None:
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine, work, symlinks=True)

    def check(n: int) -> None:
        check_one_promotion_then_the_next(work / "eagle3.yaml", f"killed at rename {n}")

    points = every_crash_point(promote_latest, (work / "eagle3.yaml",), reset, check)
    assert points >= 2  # at least the new promotion written, and the link moved


def test_a_dagster_promotion_killed_as_it_writes_the_record_leaves_one_promotion_whole(
    tmp_path: Path,
) -> None:
    """drafter_current, materialized by Dagster, killed as it writes the promotion record (an older eagle3 had
    moved `current` by then, so the gate read the record of the drafter it replaced)."""
    config = store_to_promote(tmp_path, "this eagle3")
    code = run_killed_at_call(
        "eagle3_core.store.records:DrafterCurrent.write", promote_through_dagster, config
    )
    assert code == -signal.SIGKILL
    check_one_promotion_then_the_next(config, "killed writing the record")


def test_a_store_promoted_by_an_older_eagle3_is_read_then_upgraded(tmp_path: Path) -> None:
    config = write_config(tmp_path, "store: store\n")
    layout = StoreLayout(tmp_path / "store")
    evaluated_run(layout, "r1", seed=1)
    promoted_by_an_older_eagle3(layout, "r1")
    assert read_current(layout) == DrafterCurrent.read(layout.drafter_current)

    evaluated_run(layout, "r2", seed=2)
    promote_step(load_config(config))
    current = read_current(layout)
    assert current is not None and current.run == "r2"
    assert (
        layout.drafter_current.is_symlink() and os.readlink(layout.drafter_current) == "current/current.json"
    )
    assert layout.drafter_current_link.resolve().parent == layout.promotions.resolve()
    [promotion] = layout.promotions.iterdir()  # the one `current` links; r1's, as a directory, is gone
    assert served_run(layout) == "r2" and promotion.name.startswith("r2-")


def test_an_older_promotion_cut_short_is_read_as_its_link_says(tmp_path: Path) -> None:
    """An older eagle3 killed between its link and its record: the link (written first) is what is served."""
    config = write_config(tmp_path, "store: store\n")
    layout = StoreLayout(tmp_path / "store")
    evaluated_run(layout, "r1", seed=1)
    promoted_by_an_older_eagle3(layout, "r1")
    evaluated_run(layout, "r2", seed=2)
    layout.drafter_current_link.unlink()
    layout.drafter_current_link.symlink_to(Path("export") / "r2")

    current = read_current(layout)
    assert current is not None and (current.run, current.replaced) == ("r2", "r1")
    assert current.export_dir == "drafter/export/r2" and math.isnan(current.acceptance_length)
    promote_step(load_config(config))  # promoted again, now as one step
    assert read_current(layout).run == "r2" == served_run(layout)  # type: ignore[union-attr]
    assert read_current(layout).acceptance_length == 2.5  # type: ignore[union-attr]


def test_an_incomplete_export_is_never_promoted(tmp_path: Path) -> None:
    """An export cut short by an older eagle3 (sglang/ alone): refused in one line naming what is missing."""
    config = write_config(tmp_path, "store: store\n")
    layout = StoreLayout(tmp_path / "store")
    evaluated_run(layout, "r1", seed=1)
    promote_step(load_config(config))
    evaluated_run(layout, "r2", seed=2)
    shutil.rmtree(layout.exports / "r2" / "speculators")

    with pytest.raises(ExportError) as refused:
        promote_step(load_config(config))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{layout.exports / 'r2'}: incomplete export")
    assert "no speculators/config.json" in message
    assert read_current(layout).run == "r1" == served_run(layout)  # type: ignore[union-attr]
    # nor served as the newest export when nothing is promoted
    shutil.rmtree(layout.drafter_current_link.resolve())
    layout.drafter_current_link.unlink()
    layout.drafter_current.unlink()
    os.utime(layout.exports / "r1" / "sglang" / "config.json", (1, 1))  # r2's half is the newer
    assert serve_commands(load_config(config))["drafter"] == str(layout.exports / "r1")


@pytest.mark.parametrize("promoted_before", [False, True])
def test_an_export_whose_weights_are_not_finite_is_never_promoted(
    tmp_path: Path, promoted_before: bool
) -> None:
    """A diverged run's export (written by an eagle3 that exported NaN weights), its gate passed because
    nothing was promoted yet: refused in one line naming the file and the tensor."""
    import torch
    from safetensors.torch import load_file, save_file

    config = write_config(tmp_path, "store: store\n")
    layout = StoreLayout(tmp_path / "store")
    if promoted_before:
        evaluated_run(layout, "r1", seed=1)
        promote_step(load_config(config))
    evaluated_run(layout, "r2", seed=2)
    weights = layout.exports / "r2" / "speculators" / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["fc.weight"][0, :2] = torch.tensor([float("nan"), float("inf")])
    save_file(tensors, str(weights), metadata={"format": "pt"})

    with pytest.raises(ExportError) as refused:
        promote_step(load_config(config))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{weights}: fc.weight holds 1 NaN and 1 infinite"), (
        message
    )
    assert "not promoted" in message, message
    current = read_current(layout)
    assert (current.run if current else None) == ("r1" if promoted_before else None)
    if promoted_before:
        assert served_run(layout) == "r1"


def test_a_link_to_a_removed_promotion_says_what_to_do(tmp_path: Path) -> None:
    layout = StoreLayout(tmp_path / "store")
    layout.promotions.mkdir(parents=True)
    layout.drafter_current_link.symlink_to(Path("promotions") / "gone")
    with pytest.raises(RecordError, match=r"holds no current\.json .* remove the link and promote again"):
        read_current(layout)
