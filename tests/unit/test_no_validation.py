"""A run without validation samples reports "no validation samples", never an accuracy of 0 or a tau of 1."""

from pathlib import Path

import dagster as dg
import pytest

from eagle3_cli import steps as cli
from eagle3_core.steps import drafter
from eagle3_core.steps.common import StepResult
from eagle3_core.store.records import RunSummary, TTTMetrics
from tests.conftest import write_config
from tests.records import summary_dict


def _summary(steps: int, acc: list[float] | None = None, tau: list[float] | None = None) -> RunSummary:
    """What `drafter.drafter_checkpoint_step` records: no validation metrics at all when nothing was measured."""
    measured = (
        None
        if acc is None
        else TTTMetrics(
            step_losses=[2.0] * steps, acc=acc, full_acc=acc, tau=tau or [1.0] * steps, counted=96
        )
    )
    train_config = {**summary_dict()["train_config"], "ttt_steps": steps}
    return RunSummary(
        **{
            **summary_dict(),
            "val": measured,
            "val_samples": 9 if measured else 0,
            "train_config": train_config,
        }
    )


def test_the_cli_summary_says_no_validation_samples(capsys: pytest.CaptureFixture[str]) -> None:
    cli.print_training(_summary(3))
    out = capsys.readouterr().out
    assert "no validation samples" in out
    assert "acc_" not in out and "tau" not in out and "nan" not in out


def test_the_cli_summary_prints_measured_accuracy_and_tau(capsys: pytest.CaptureFixture[str]) -> None:
    cli.print_training(_summary(3, [0.5, 0.25, 0.125], [1.5, 1.62, 1.66]))
    out = capsys.readouterr().out
    assert "acc_0 0.500  acc_1 0.250  acc_2 0.125" in out and "tau(3) 1.66" in out
    assert "no validation samples" not in out


def test_the_drafter_asset_metadata_copes_with_no_validation_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from eagle3_dagster.defs.drafter.assets import drafter_checkpoint
    from eagle3_dagster.defs.resources import Eagle3Resource

    summary = _summary(2)
    result = StepResult("drafter_checkpoint", tmp_path, {"run": summary.run}, record=summary)
    monkeypatch.setattr(drafter, "drafter_checkpoint_step", lambda cfg, log: result)
    config = write_config(tmp_path / "p", "store: store\n")
    out = drafter_checkpoint(dg.build_asset_context(), Eagle3Resource(config_path=str(config)))
    assert isinstance(out, dg.MaterializeResult) and out.metadata is not None
    accuracy = out.metadata["accuracy"]
    assert isinstance(accuracy, dg.MarkdownMetadataValue) and accuracy.md_str == "no validation samples"
