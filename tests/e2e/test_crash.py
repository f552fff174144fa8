"""A real extraction killed with SIGKILL mid-shard leaves no visible shard; the next run writes it whole."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.shards import ShardReader
from eagle3_core.store.stats import store_stats, verify_shard
from tests.conftest import write_config
from tests.e2e.test_cli import eagle3


def test_sigkill_mid_extraction_then_resume(tmp_path: Path, toy_target_dir: Path) -> None:
    config = write_config(
        tmp_path,
        # two shards (50 and 25 rows, ~32k tokens): the kill lands 20 samples into the first, with ~30 to go
        f"store: store\ndata: {{dataset: k, shard_size: 50, sources: [{{kind: chitchat, limit: 75}}]}}\n"
        f"target: {{path: {toy_target_dir}}}\nregenerate: {{enabled: false}}\n"
        "extract: {max_batch_tokens: 1024, max_batch_size: 4}\n",
    )
    assert eagle3(config, "ingest").returncode == 0
    layout = StoreLayout(tmp_path / "store")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eagle3_cli.main",
            "--config",
            str(config),
            "extract",
            "--shard",
            "k-00000",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # kill it once a few batches are on disk
        if "samples extracted" in line and int(line.split(":")[1].split("/")[0]) >= 20:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not layout.hidden_states("k-00000").exists()
    temps = [p for p in layout.hidden_states_dir.iterdir() if ".tmp-" in p.name]
    assert len(temps) == 1 and not verify_shard(temps[0]).ok
    assert store_stats(layout.root).shards == []

    resumed = eagle3(config, "extract")  # every shard not done, k-00000 included
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    names = sorted(p.name for p in layout.hidden_states_dir.iterdir())
    assert names[:2] == ["k-00000.json", "k-00000.safetensors"]
    assert not any(".tmp-" in n for n in names)  # the stale temporary was cleaned
    with ShardReader(layout.hidden_states("k-00000")) as shard:
        assert shard.verify() == []
        train_ids = {
            line.split('"id":"')[1].split('"')[0]
            for line in layout.conversations("k-00000").read_text().splitlines()
            if '"split":"train"' in line
        }
        assert set(shard.sample_ids) <= train_ids
        assert len(shard) + len(shard.meta.dropped or {}) == len(train_ids)  # none lost, none doubled
