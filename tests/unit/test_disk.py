"""A full disk, on a real full disk (a small tmpfs in a namespace of the test's own): the errors Python and
safetensors really raise are both recognised (eagle3_core/store/disk.py), and a checkpoint saved there is one
DiskSpaceError line that leaves the earlier checkpoint whole."""

from __future__ import annotations

import errno
import json
from pathlib import Path

from safetensors import SafetensorError

from eagle3_core.store.disk import full_disk_reason
from tests.full_disk import on_a_full_disk

WRITERS = """
import json, torch
from pathlib import Path
from safetensors.torch import save_file
from eagle3_core.store.disk import full_disk_reason
disk = Path({disk!r})
said = {{}}
try:
    with open(disk / "plain.bin", "wb") as f:
        f.write(b"x" * (1 << 20))
        f.flush()
except OSError as err:
    said["python"] = [type(err).__name__, err.errno, full_disk_reason(err)]
try:
    save_file({{"a": torch.zeros(1 << 18)}}, str(disk / "tensors.safetensors"))
except Exception as err:
    said["safetensors"] = [type(err).__name__, str(err), full_disk_reason(err)]
print(json.dumps(said))
"""


def test_a_real_full_disk_is_recognised_from_python_and_from_safetensors(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    done = on_a_full_disk(WRITERS.format(disk=str(disk)), disk)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["python"] == ["OSError", errno.ENOSPC, "No space left on device"]
    kind, text, reason = said["safetensors"]
    assert kind == "SafetensorError" and text.endswith("(os error 28)")  # the errno only in its text
    assert reason == "No space left on device"


def test_other_errors_are_not_taken_for_a_full_disk() -> None:
    assert full_disk_reason(OSError(errno.EACCES, "Permission denied")) is None
    assert full_disk_reason(OSError("no errno")) is None
    assert (
        full_disk_reason(
            SafetensorError("Error while serializing: I/O error: Permission denied (os error 13)")
        )
        is None
    )
    assert full_disk_reason(SafetensorError("header too large")) is None
    assert full_disk_reason(ValueError("No space left on device (os error 28)")) is None
    assert full_disk_reason(OSError(errno.EDQUOT, "Disk quota exceeded")) == "Disk quota exceeded"


CHECKPOINTS = """
import json, torch
from pathlib import Path
from eagle3_core.errors import DiskSpaceError
from eagle3_core.train.checkpoint import checkpoint_dir, list_checkpoints, load_checkpoint, save_checkpoint
from tests.records import run_progress
run_dir = Path({disk!r}) / "run"

def save(step, rows):
    weight = torch.nn.Parameter(torch.randn(rows, 64))
    opt = torch.optim.AdamW([weight], lr=1e-3)
    weight.grad = torch.randn(rows, 64)
    opt.step()
    return save_checkpoint(run_dir, step, {{"fc.weight": weight}}, opt.state_dict(), run_progress(step), keep=3)

save(2, 8)  # a few KB: fits
said = {{}}
try:
    save(4, 4096)  # 1 MiB of weights and 2 MiB of moments on a 256 KiB disk
except DiskSpaceError as err:
    said["error"] = str(err)
said["left"] = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
said["verified"] = load_checkpoint(checkpoint_dir(run_dir, 2)).verified
print(json.dumps(said))
"""


def test_a_checkpoint_saved_on_a_real_full_disk_is_one_line_and_leaves_the_earlier_one(
    tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    done = on_a_full_disk(CHECKPOINTS.format(disk=str(disk)), disk)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    message = said["error"]
    assert "\n" not in message
    assert message.startswith(f"{disk / 'run'}: the disk filled up while writing the checkpoint of step 4 (")
    assert "No space left on device" in message and message.endswith("(it resumes from step 2)")
    assert said["left"] == ["step-00000002"] and said["verified"] is True  # no temporary, the earlier whole


METRIC_LOG = """
import json, os, torch
from pathlib import Path
from eagle3_core.store.records import TrainRow
from eagle3_core.train.distributed import World
from eagle3_core.train.run_dir import METRICS, MetricsLog, read_metrics
disk = Path({disk!r})
run_dir = disk / "run"
run_dir.mkdir()
log = MetricsLog(run_dir / METRICS, World(0, 1, torch.device("cpu")))

def row(step):
    return TrainRow(
        step=step, epoch=0, lr=0.0003, loss=2.104166, step_losses=[1.5, 2.25], acc=[0.5, 0.25],
        full_acc=[0.5, 0.125], tau=[1.5, 1.625], counted=96, tokens=4096 * step, tokens_per_s=1234.5,
        elapsed_s=3.21,
    )

log.write(row(1))  # the log's first page
filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
try:
    while True:  # every other page of the disk
        os.write(filler, bytes(4096))
except OSError:
    pass
said = {{}}
try:
    for step in range(2, 100):  # rows fill the first page; the one that crosses into a second fails
        log.write(row(step))
except Exception as err:
    said["error"] = [type(err).__name__, str(err), step]
try:
    said["logged"] = [r.step for r in read_metrics(run_dir)]
except Exception as err:
    said["logged"] = str(err)
said["size"] = (run_dir / METRICS).stat().st_size
print(json.dumps(said))
"""


def test_a_metric_row_appended_on_a_real_full_disk_is_one_line_and_leaves_whole_rows(tmp_path: Path) -> None:
    """The kernel writes what fits of the row (a short write), then refuses the rest: the row is cut back."""
    disk = tmp_path / "disk"
    done = on_a_full_disk(METRIC_LOG.format(disk=str(disk)), disk)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    kind, message, failed = said["error"]
    assert kind == "DiskSpaceError" and "\n" not in message and failed > 2
    assert message.startswith(
        f"{disk / 'run'}: the disk filled up while writing the train row of step {failed} to metrics.jsonl "
        "(No space left on device); it needs about "
    )
    assert message.endswith(
        "Nothing was half-written: free space, then train again (it has no checkpoint: step 0)"
    )
    assert said["logged"] == list(range(1, failed))  # whole rows only: the failed one is not there in part
    assert said["size"] <= 4096  # what the first page held
