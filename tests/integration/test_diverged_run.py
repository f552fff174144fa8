"""A run that diverges (train.lr 1e6 on the toy target: the loss is NaN from step 3, the weights from the
update of step 2) is stopped in one line naming the step, keeps only checkpoints whose weights are finite,
and leaves no final drafter to export or promote; the same store trains at a sane lr as a new run.

Before, it logged `loss nan` at every step, "finished", and its NaN weights were exported and promoted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_cli.steps import main
from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.steps.data import extract_step
from eagle3_core.steps.drafter import vocab_step
from eagle3_core.store.layout import StoreLayout
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.train.checkpoint import WEIGHTS, list_checkpoints
from tests.conftest import write_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN = (
    "train: {{draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, max_steps: 4, lr: {lr}, log_every: 1, "
    "eval_every: 100, checkpoint_every: {every}, keep_checkpoints: 10, val_fraction: 0.15, seed: 7}}\n"
)


def _config(project: Path, target: Path, lr: str, every: int = 1) -> Path:
    return write_config(
        project,
        f"store: store\ndata: {{dataset: t, holdout_fraction: 0.0, shard_size: 60, sources: [{{kind: chitchat, "
        f"limit: 30}}]}}\ntarget: {{path: {target}}}\nregenerate: {{enabled: false}}\n"
        "extract: {store_dtype: float32}\ntokenize: {max_seq_len: 256}\n" + TRAIN.format(lr=lr, every=every),
    )


@pytest.fixture(scope="module")
def diverging(tmp_path_factory: pytest.TempPathFactory, toy_target_dir: Path) -> Path:
    """An extracted store of the toy target (one shard of 30 conversations), its vocab mapping built, and a
    config that trains it at train.lr 1e6."""
    config = _config(tmp_path_factory.mktemp("diverged") / "project", toy_target_dir, "1e6")
    cfg = load_config(config)
    target = TransformersTarget(toy_target_dir, cfg.target)
    for key in ingest(cfg).all_shards:
        extract_step(cfg, key, target)
    target.close()
    vocab_step(cfg)
    return config


@pytest.mark.parametrize(
    ("every", "said"),
    [
        # a checkpoint every step: the update of step 2 made the weights NaN (its loss was finite)
        (1, "the weights are not finite after step 2 (input_norm.weight holds 384 NaN of 384 values)"),
        # a checkpoint every 3 steps: step 3's loss is NaN, logged before any checkpoint
        (3, "the loss is not finite at step 3"),
    ],
)
def test_a_run_whose_loss_is_not_finite_stops_in_one_line_and_keeps_its_finite_checkpoints(
    diverging: Path,
    toy_target_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    every: int,
    said: str,
) -> None:
    shutil.copytree(diverging.parent, tmp_path / "project")
    diverging = _config(tmp_path / "project", toy_target_dir, "1e6", every)
    layout = StoreLayout(diverging.parent / "store")
    code = main(["--config", str(diverging), "train"])
    out = capsys.readouterr()
    assert code == 2, out.out + out.err
    assert "Traceback" not in out.out + out.err
    [line] = [line for line in out.out.splitlines() if line.startswith("error:")]
    [run_dir] = list(layout.drafter_runs.iterdir())
    assert line.startswith(
        f"error: run {run_dir.name} diverged: {said}; stopped, without a final drafter ("
    ), line
    assert "train.lr (1000000.0)" in line and "starts a new run" in line, line
    kept = list_checkpoints(run_dir)
    assert [step for step, _ in kept] == ([1] if every == 1 else [])
    assert ("its checkpoints up to step 1 are kept" if kept else "it saved no checkpoint") in line, line
    for _, checkpoint in kept:  # none holds the diverged weights
        weights = load_file(str(checkpoint / WEIGHTS))
        assert all(bool(torch.isfinite(t).all()) for t in weights.values()), checkpoint
    assert not (run_dir / "final").exists() and not layout.drafter_latest.exists()

    code = main(["--config", str(diverging), "export"])  # nothing to export
    assert code == 2 and not layout.exports.exists(), capsys.readouterr().out

    # what the line says to do: a lower lr is a new run, trained from step 0, that finishes
    _config(diverging.parent, toy_target_dir, "0.003")
    assert main(["--config", str(diverging), "train"]) == 0, capsys.readouterr().out
    finished = json.loads(layout.drafter_latest.read_text())["run"]
    assert finished != run_dir.name and (layout.drafter_runs / finished / "final").is_dir()
