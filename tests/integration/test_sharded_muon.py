"""ShardedMuon (train/sharding.py) on two real gloo ranks under torchrun, against torch's Muon on whole matrices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_sharded_muon_updates_as_whole_muon_does_from_momentum_shards_and_resumes_from_a_whole_state(
    tmp_path: Path,
) -> None:
    """Three steps, the learning rate changed at each: the weights and momentum equal torch.optim.Muon's on the
    whole matrices bit for bit; each rank holds only its rows of the momentum (7 rows as 4 and 3); the state
    gathered to be saved equals Muon's own; and a run resumed from that whole state steps on equal again."""
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(REPO / "tests" / "sharded_muon_ranks.py"), str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["weights"] == 0.0 and report["momentum"] == 0.0, report
    assert report["momentum_rows"] == [[48, 96], [4, 7]], report  # rank 0's rows of each matrix
    assert report["saved_momentum_equal"] is True
    assert report["resumed_weights"] == 0.0, report
