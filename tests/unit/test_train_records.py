"""The training run's own files as typed records: a checkpoint's state.json and the metric log's rows. Each
writes the bytes the dict writer wrote before it and refuses a torn or wrong file with one line naming the
file and the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_core.errors import RecordError
from eagle3_core.store.records import STEP_KEY, CheckpointState, RunProgress, TrainRow, ValRow
from eagle3_core.train.checkpoint import STATE, load_checkpoint, save_checkpoint
from eagle3_core.train.distributed import World
from eagle3_core.train.loss import TTTStats
from eagle3_core.train.run_dir import METRICS, MetricsLog, read_metrics


def _optimizer_state() -> dict[str, Any]:
    """A real AdamW state_dict: its param groups hold tuples (betas), None (foreach, fused) and bools."""
    weight = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.AdamW([weight], lr=1e-3, weight_decay=0.01, betas=(0.9, 0.95))
    weight.grad = torch.ones(3, 4)
    opt.step()
    return opt.state_dict()


def _progress_dict() -> dict[str, Any]:
    """What the trainer put in a checkpoint's state before records, key for key, in its order."""
    return {
        "tokens": 1234,
        "interval_sums": [[2.5, 1.25], [3.0, 2.0], [3.0, 1.0], [4.0, 4.0]],
        "interval_tokens": 56,
        "metrics_bytes": 789,
        "rng_cpu": torch.get_rng_state().tolist(),
    }


def test_a_checkpoint_state_writes_the_bytes_the_dict_writer_wrote_then_its_checksums(tmp_path: Path) -> None:
    weights, optimizer = {"fc.weight": torch.randn(3, 4)}, _optimizer_state()
    path = save_checkpoint(tmp_path, 7, weights, optimizer, RunProgress(**_progress_dict()), keep=2)
    before = {**_progress_dict(), "step": 7, "param_groups": optimizer["param_groups"]}
    written = json.loads((path / STATE).read_text())
    assert list(written) == [*before, "files", "checksum"]  # what the dict writer wrote, then the checksums
    today = json.dumps({**before, "files": written["files"], "checksum": written["checksum"]}, indent=1)
    assert (path / STATE).read_text() == today
    ckpt = load_checkpoint(path)
    assert ckpt.verified and ckpt.state.files is not None
    assert ckpt.state.files["drafter.safetensors"].bytes == (path / "drafter.safetensors").stat().st_size
    assert ckpt.step == 7 and ckpt.state.tokens == 1234 and ckpt.state.interval_sums[3] == [4.0, 4.0]
    assert torch.equal(torch.tensor(ckpt.state.rng_cpu, dtype=torch.uint8), torch.get_rng_state())
    assert ckpt.optimizer["param_groups"][0]["betas"] == [0.9, 0.95]
    assert CheckpointState.read(path / STATE).dump() == json.loads(today)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"tokens": 1, "interval_sums": [[0.0]], "interval_tok', "not valid JSON"),  # torn mid-write
        (json.dumps({**_progress_dict(), "step": 7}), "param_groups: Field required"),
        (json.dumps({**_progress_dict(), "metrics_bytes": "x", "step": 7, "param_groups": []}), "metrics_bytes:"),
        (json.dumps({**_progress_dict(), "interval_sums": [[0.0, "a"]], "step": 7, "param_groups": []}),
         "interval_sums[0][1]:"),
    ],
)  # fmt: skip
def test_a_torn_or_wrong_state_is_one_line_naming_the_file_and_field(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / STATE
    path.write_text(text)
    with pytest.raises(RecordError, match="^" + re.escape(f"{path}: {expected}")) as err:
        CheckpointState.read(path)
    assert "\n" not in str(err.value)


def _train_row_dict(step: int = 4) -> dict[str, Any]:
    """A log interval's row as the trainer wrote it before records (two TTT steps), key for key, in its order."""
    return {
        "kind": "train",
        "step": step,
        "epoch": 0,
        "lr": 0.0003,
        "loss": 2.104166,
        "loss_0": 1.5,
        "acc_0": 0.5,
        "full_acc_0": 0.5,
        "loss_1": 2.25,
        "acc_1": 0.25,
        "full_acc_1": 0.125,
        "tau_1": 1.5,
        "tau_2": 1.625,
        "counted": 96,
        "tokens": 4096,
        "tokens_per_s": 1234.5,
        "elapsed_s": 3.21,
    }


def _val_row_dict(step: int = 4) -> dict[str, Any]:
    figures = {k: v for k, v in _train_row_dict().items() if STEP_KEY.fullmatch(k) or k == "counted"}
    return {"kind": "val", "step": step, **figures}


def test_metric_log_rows_write_the_bytes_the_dict_writer_wrote(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / METRICS, World(0, 1, torch.device("cpu")))
    train, val = TrainRow.model_validate(_train_row_dict()), ValRow.model_validate(_val_row_dict())
    log.write(train)
    log.write(val)
    today = "".join(json.dumps(row) + "\n" for row in (_train_row_dict(), _val_row_dict()))
    assert (tmp_path / METRICS).read_text() == today
    assert read_metrics(tmp_path) == [train, val]
    assert train.acc == [0.5, 0.25] and train.tau_at(2) == 1.625 and train.tau_at(3) is None
    # a GPU run's row adds its peak at the end; a CPU run's (above) leaves the field out
    on_gpu = TrainRow.model_validate({**_train_row_dict(), "peak_gpu_gib": 80.7})
    assert json.dumps(on_gpu.dump()) == json.dumps({**_train_row_dict(), "peak_gpu_gib": 80.7})
    # the summary's `val`: the row's figures alone, flat, as the trainer took them from the dict
    assert val.metrics().flat() == {k: v for k, v in _val_row_dict().items() if k not in ("kind", "step")}


def test_the_figures_tttstats_measures_are_a_rows_figures() -> None:
    stats = TTTStats(torch.tensor([[3.0, 4.5], [2.0, 1.0], [2.0, 0.5], [4.0, 2.0]], dtype=torch.float64))
    metrics = stats.metrics()
    assert metrics.step_losses == [0.75, 2.25] and metrics.acc == [0.5, 0.5] and metrics.counted == 4
    assert metrics.tau == [round(stats.tau(1), 6), round(stats.tau(2), 6)]
    row = ValRow(step=2, **dict(metrics))
    per_step = [f"{family}_{k}" for k in (0, 1) for family in ("loss", "acc", "full_acc")]
    assert list(row.dump()) == ["kind", "step", *per_step, "tau_1", "tau_2", "counted"]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"kind": "train", "step": 4, "epo', "not valid JSON"),  # a line torn by a crash mid-append
        ("[1, 2]", "expected a JSON object, got list"),
        (
            json.dumps({**_train_row_dict(), "kind": "test"}),
            "kind: expected one of ['al', 'train', 'val'], got 'test'",
        ),
        (json.dumps({k: v for k, v in _train_row_dict().items() if k != "acc_1"}), "acc_1: Field required"),
        (json.dumps({**_train_row_dict(), "acc_1": "high"}), "acc_1: Input should be a number, got 'high'"),
        (json.dumps({**_train_row_dict(), "tau_3": 1.7}), "tau_3: beyond the 2 TTT steps"),
        (json.dumps({k: v for k, v in _train_row_dict().items() if k != "tokens"}), "tokens: Field required"),
        (json.dumps({**_val_row_dict(), "lr": 0.1}), "lr: Extra inputs are not permitted"),
        # a flipped bit, a planted line: named like a torn one, never a traceback
        ('{"kind": "tr\udcffain"}', "not UTF-8 text (invalid start byte at byte 12)"),
        ("[" * 100_000 + "]" * 100_000, "not readable JSON: arrays or objects nested too deeply"),
    ],
)
def test_a_torn_or_wrong_metric_row_is_one_line_naming_the_file_line_and_field(
    tmp_path: Path, line: str, expected: str
) -> None:
    text = json.dumps(_train_row_dict(2)) + "\n" + line + "\n"
    (tmp_path / METRICS).write_bytes(text.encode("utf-8", "surrogateescape"))  # \udcff: the byte 0xff
    with pytest.raises(RecordError, match="^" + re.escape(f"{tmp_path / METRICS} line 2: {expected}")) as err:
        read_metrics(tmp_path)
    assert "\n" not in str(err.value)


def test_a_resume_cuts_the_metric_log_back_and_never_pads_it(tmp_path: Path) -> None:
    """`cut_to` drops the rows after a checkpoint, a torn one with them; a log already shorter than the
    checkpoint recorded (cut by hand) stays as it is, never padded with NUL bytes no reader can parse."""
    log = MetricsLog(tmp_path / METRICS, World(0, 1, torch.device("cpu")))
    first, second = (TrainRow.model_validate(_train_row_dict(step)) for step in (1, 2))
    log.write(first)
    checkpointed = log.durable_size()
    log.write(second)
    with open(tmp_path / METRICS, "a") as f:
        f.write('{"kind": "val", "st')  # torn by a kill
    log.cut_to(checkpointed)
    assert read_metrics(tmp_path) == [first]
    log.cut_to(checkpointed + 500)
    assert (tmp_path / METRICS).stat().st_size == checkpointed and read_metrics(tmp_path) == [first]
