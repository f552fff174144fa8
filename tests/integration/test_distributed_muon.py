"""DistributedMuon (train/muon.py) on two real gloo ranks under torchrun, against torch's Muon on whole
matrices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

STEPS, MATRICES = 3, 3  # tests/distributed_muon_ranks.py's


def test_distributed_muon_is_torchs_muon_bit_for_bit_with_each_matrix_orthogonalised_by_one_rank(
    tmp_path: Path,
) -> None:
    """Three steps, the learning rate changed at each, over FSDP's row shards and over whole matrices: the
    weights and momentum equal torch.optim.Muon's bit for bit; each matrix is orthogonalised once a step, by
    one rank (96x96 by rank 0, 96x64 and 7x96 by rank 1); under FSDP each rank holds only its rows of the
    momentum (7 rows as 4 and 3), the state gathered to be saved is Muon's own, and a run resumed from it
    steps on equal."""
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "distributed_muon_ranks.py"), str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    for layout in ("fsdp", "ddp"):
        assert report[layout]["weights"] == 0.0 and report[layout]["momentum"] == 0.0, (layout, report)
        assert report[layout]["orthogonalised"] == [STEPS, 2 * STEPS], (layout, report)
    fsdp = report["fsdp"]
    assert fsdp["momentum_rows"] == [[48, 96], [48, 96], [4, 7]], fsdp  # rank 0's rows of each matrix
    assert fsdp["saved_momentum_equal"] is True
    assert fsdp["resumed_weights"] == 0.0, fsdp
