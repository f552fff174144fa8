"""A run without validation samples reports "no validation samples", never an accuracy of 0 or a tau of 1."""

import json
from pathlib import Path

import dagster as dg
import pytest

from eagle3_cli import steps as cli
from eagle3_core import drafting
from eagle3_core.pipeline import StepResult
from eagle3_core.store.records import RunSummary
from tests.conftest import write_config
from tests.records import summary_dict


def _metadata(acc: list[float | None], **val: float) -> dict[str, object]:
    """What `drafting.train_step` reports: no `val_*` keys and null accuracies when nothing was measured."""
    return {
        "run": "r1",
        "steps": 4,
        "tokens": 1000,
        "seconds": 1.5,
        "val_samples": 0 if all(a is None for a in acc) else 9,
        "acc_per_position": json.dumps(acc),
        **val,
    }


def test_the_cli_summary_says_no_validation_samples(capsys: pytest.CaptureFixture[str]) -> None:
    cli.print_training(_metadata([None, None, None]), ttt_steps=3)
    out = capsys.readouterr().out
    assert "no validation samples" in out
    assert "acc_" not in out and "tau" not in out and "nan" not in out


def test_the_cli_summary_prints_measured_accuracy_and_tau(capsys: pytest.CaptureFixture[str]) -> None:
    cli.print_training(_metadata([0.5, 0.25, 0.125], val_tau_3=1.66), ttt_steps=3)
    out = capsys.readouterr().out
    assert "acc_0 0.500  acc_1 0.250  acc_2 0.125" in out and "tau(3) 1.66" in out
    assert "no validation samples" not in out


def test_the_drafter_asset_metadata_copes_with_no_validation_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_dagster.defs.drafter.assets import drafter_checkpoint
    from eagle3_dagster.defs.resources import Eagle3Resource

    summary = RunSummary(**{**summary_dict(), "val": {}, "val_samples": 0})
    result = StepResult("drafter_checkpoint", tmp_path, _metadata([None, None]), record=summary)
    monkeypatch.setattr(drafting, "train_step", lambda cfg, log: result)
    config = write_config(tmp_path / "p", "store: store\n")
    out = drafter_checkpoint(dg.build_asset_context(), Eagle3Resource(config_path=str(config)))
    assert isinstance(out, dg.MaterializeResult) and out.metadata is not None
    accuracy = out.metadata["accuracy"]
    assert isinstance(accuracy, dg.MarkdownMetadataValue) and accuracy.md_str == "no validation samples"
