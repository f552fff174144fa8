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
from eagle3_core.store.records import CheckpointState
from eagle3_core.train.checkpoint import STATE, load_checkpoint, save_checkpoint


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


def test_a_checkpoint_state_writes_the_bytes_the_dict_writer_wrote(tmp_path: Path) -> None:
    from eagle3_core.store.records import RunProgress

    weights, optimizer = {"fc.weight": torch.randn(3, 4)}, _optimizer_state()
    path = save_checkpoint(tmp_path, 7, weights, optimizer, RunProgress(**_progress_dict()), keep=2)
    today = json.dumps({**_progress_dict(), "step": 7, "param_groups": optimizer["param_groups"]}, indent=1)
    assert (path / STATE).read_text() == today
    ckpt = load_checkpoint(path)
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
