"""Crash resume, end to end, against a real `dagster dev`.

`eagle3 materialize --missing` runs the shards in a subprocess (one Dagster run per shard, in process) and is
killed with SIGKILL while it extracts a later shard. Then, with `dagster dev` up on the same instance,
`eagle3 materialize --missing --url` marks the killed run failed (its process is gone), launches the
missing-partitions backfill through GraphQL `launchPartitionBackfill` and waits for it. The test checks,
from the instance's event log, that the backfill ran exactly the shards that were missing after the kill and
nothing else, that no shard file is partial and every shard verifies, that every training conversation is
accounted for once, and that the automation sensor then trained the drafter on its own.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pytest

from eagle3_cli.main import main
from eagle3_cli.ops import OperationError, Webserver
from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.shards import ShardReader
from eagle3_core.store.stats import verify_shard
from tests.conftest import REPO, write_config
from tests.dagster_dev import DagsterDev, dagster_dev_factory, dagster_home  # noqa: F401 (a fixture)

pytestmark = [pytest.mark.slow]

KILL_TIMEOUT_S = 240
BACKFILL_TIMEOUT_S = 300
AUTOMATION_TIMEOUT_S = 300
SHARD_ASSETS = ("conversations", "regenerated", "hidden_states")
MATERIALIZE_HERE = ("materialize", "--missing", "--in-process")


def _config(tmp_path: Path, target: Path) -> Path:
    """Chitchat without regeneration (rows without an assistant turn are rejected): four shards of up to 20,
    sequences cut at 256 tokens (a shard extracts in seconds), a few training steps, a tiny evaluation."""
    return write_config(
        tmp_path,
        "store: store\n"
        "data: {dataset: res, shard_size: 20, sources: [{kind: chitchat, limit: 150}]}\n"
        f"target: {{path: {target}}}\n"
        "regenerate: {enabled: false}\n"
        "tokenize: {max_seq_len: 256}\n"
        "extract: {max_batch_tokens: 512, max_batch_size: 2}\n"
        "train: {draft_vocab_size: 256, batch_tokens: 1024, max_len: 256, epochs: 1, max_steps: 3, "
        "log_every: 1, eval_every: 100, checkpoint_every: 100}\n"
        "evaluate: {ks: [1], gate_k: 1, max_prompts: 2, per_conversation: 1, max_new_tokens: 8}\n",
    )


def _eagle3(
    env: dict[str, str], config: Path, *args: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "eagle3_cli.main", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def _kill_mid_extraction(
    env: dict[str, str], config: Path, layout: StoreLayout, done_before_kill: int
) -> None:
    """Start `eagle3 materialize --missing --in-process`; SIGKILL it once `done_before_kill` shards are whole
    and the next one's temporary file is being written."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3_cli.main", "--config", str(config), *MATERIALIZE_HERE],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=REPO,
    )
    deadline = time.monotonic() + KILL_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"materialize ended ({proc.returncode}) before it could be killed"
            names = (
                [p.name for p in layout.hidden_states_dir.glob("*")]
                if layout.hidden_states_dir.exists()
                else []
            )
            whole = [n for n in names if n.endswith(".safetensors") and not n.startswith(".")]
            if len(whole) >= done_before_kill and any(".tmp-" in n for n in names):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.02)
        else:
            pytest.fail(f"no shard was mid-extraction within {KILL_TIMEOUT_S} s")
    finally:
        if proc.poll() is None and time.monotonic() >= deadline:
            proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _status(env: dict[str, str], config: Path) -> dict[str, str]:
    result = _eagle3(env, config, "status", "--json", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return {row["key"]: row["state"] for row in json.loads(result.stdout)["shards"]}


def _status_here(config: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """`eagle3 status --json` through the console script's main(), in this process (DAGSTER_HOME set by the
    caller): the same command as _status without another interpreter importing Dagster."""
    capsys.readouterr()
    assert main(["--config", str(config), "status", "--json"]) == 0
    return {row["key"]: row["state"] for row in json.loads(capsys.readouterr().out)["shards"]}


def _materialized_by_run(instance: dg.DagsterInstance, asset: str) -> dict[str, list[str]]:
    """Partition -> the runs that materialized it, from the event log."""
    records = instance.fetch_materializations(dg.AssetKey(asset), limit=1000).records
    by_partition: dict[str, list[str]] = {}
    for record in records:
        assert record.partition_key is not None
        by_partition.setdefault(record.partition_key, []).append(record.run_id)
    return by_partition


def _train_ids(layout: StoreLayout, key: str) -> set[str]:
    rows = [json.loads(line) for line in layout.conversations(key).read_text().splitlines()]
    return {r["id"] for r in rows if r["split"] == "train"}


def test_killed_shard_run_resumes_through_a_graphql_backfill_then_trains_by_automation(
    tmp_path: Path,
    toy_target_dir: Path,
    dagster_dev_factory: Callable[..., DagsterDev],  # noqa: F811 (the fixture imported above)
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started = time.monotonic()
    config = _config(tmp_path, toy_target_dir)
    report = ingest(load_config(config))
    keys = report.all_shards
    assert len(keys) == 4, keys
    layout = StoreLayout(tmp_path / "store")
    home = dagster_home(tmp_path)
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    monkeypatch.setenv("DAGSTER_HOME", str(home))  # for the in-process `eagle3 status`

    # 1. A real Dagster run per shard, in a subprocess, killed while the third shard is being extracted.
    _kill_mid_extraction(env, config, layout, done_before_kill=2)
    kill_time = time.time()
    whole = sorted(
        p.stem for p in layout.hidden_states_dir.glob("*.safetensors") if not p.name.startswith(".")
    )
    assert len(whole) == 2, whole
    states = _status(env, config)  # the real command once, as docs/orchestration.md runs it
    interrupted = [k for k, s in states.items() if s == "interrupted"]
    assert len(interrupted) == 1 and interrupted[0] not in whole, states
    # the killed shard left only its unfinished temporary file, which does not verify
    [temp] = [p for p in layout.hidden_states_dir.iterdir() if ".tmp-" in p.name]
    assert temp.name.startswith(f".{interrupted[0]}.safetensors") and not verify_shard(temp).ok
    missing = sorted(k for k in keys if k not in whole)
    assert {k: s for k, s in states.items() if k in missing} == {
        k: "interrupted" if k in interrupted else "missing" for k in missing
    }
    with dg.DagsterInstance.from_config(str(home)) as instance:
        before = _materialized_by_run(instance, "hidden_states")
        assert sorted(before) == whole
        [killed] = instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
        assert killed.tags["dagster/partition"] == interrupted[0]
    print(f"killed after {time.monotonic() - started:.0f} s; missing {missing}")

    # 2. dagster dev on the same instance; the missing shards through launchPartitionBackfill.
    dev = dagster_dev_factory(home, config)
    print(f"dagster dev up after {time.monotonic() - started:.0f} s")
    result = _eagle3(
        env, config, "materialize", "--missing", "--url", dev.base_url, "--wait", timeout=BACKFILL_TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout + result.stderr + dev.log_tail()
    assert f"run {killed.run_id} ({interrupted[0]}): process gone, marked failed" in " ".join(
        result.stdout.split()
    )
    backfill_id = result.stdout.split("backfill ")[1].split()[0]
    print(f"backfill {backfill_id} done after {time.monotonic() - started:.0f} s")

    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_run_by_id(killed.run_id).status == dg.DagsterRunStatus.FAILURE  # type: ignore[union-attr]
        backfill_runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        assert sorted(r.tags["dagster/partition"] for r in backfill_runs) == missing  # one run per shard
        assert all(r.status == dg.DagsterRunStatus.SUCCESS for r in backfill_runs)
        assert all("in_process" in json.dumps(r.run_config) for r in backfill_runs)
        # the GPU pool held: one shard run at a time
        spans = sorted(
            (r.start_time or 0, r.end_time or 0)
            for r in instance.get_run_records(filters=dg.RunsFilter(tags={"dagster/backfill": backfill_id}))
        )
        assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans)), spans
        backfill_run_ids = {r.run_id for r in backfill_runs}
        for asset in SHARD_ASSETS:
            after = _materialized_by_run(instance, asset)
            # exactly the missing shards ran again, each once, by the backfill; the whole ones not again
            rerun = {k: runs for k, runs in after.items() if set(runs) & backfill_run_ids}
            assert sorted(rerun) == missing, (asset, after)
            assert all(len(set(runs) & backfill_run_ids) == 1 for runs in rerun.values())
        assert _materialized_by_run(instance, "hidden_states") == {
            **before,
            **{k: [r.run_id for r in backfill_runs if r.tags["dagster/partition"] == k] for k in missing},
        }

    # A webserver on another instance is refused (its daemon would run the backfill against other state).
    other = dagster_home(tmp_path / "other")
    with (
        dg.DagsterInstance.from_config(str(other)) as elsewhere,
        pytest.raises(OperationError, match="another"),
    ):
        Webserver(dev.base_url).check_same_instance(elsewhere)

    # 3. No partial shard file; every shard verifies; every training conversation accounted for once.
    assert not [p for p in layout.hidden_states_dir.iterdir() if ".tmp-" in p.name]
    assert sorted(p.stem for p in layout.hidden_states_dir.glob("*.safetensors")) == sorted(keys)
    total_train = extracted = lost = 0
    for key in keys:
        assert verify_shard(layout.hidden_states(key)).ok, key
        train_ids = _train_ids(layout, key)
        with ShardReader(layout.hidden_states(key)) as shard:
            assert set(shard.sample_ids) <= train_ids
            assert len(shard) + len(shard.meta.dropped or {}) == len(train_ids), key
            extracted += len(shard)
            lost += len(shard.meta.dropped or {})
        total_train += len(train_ids)
    assert extracted + lost == total_train == sum(s.samples - s.heldout for s in report.new_shards)
    assert set(_status_here(config, capsys).values()) == {"materialized"}

    # 4. Training by automation: the sensor requests the drafter half once every shard is whole.
    deadline = time.monotonic() + AUTOMATION_TIMEOUT_S
    with dg.DagsterInstance.from_config(str(home)) as instance:
        while True:
            event = instance.get_latest_materialization_event(dg.AssetKey("drafter_checkpoint"))
            if event is not None:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"no drafter_checkpoint within {AUTOMATION_TIMEOUT_S} s:\n{dev.log_tail()}")
            time.sleep(2)
        run = instance.get_run_by_id(event.run_id)
        assert run is not None
        assert run.tags.get("dagster/from_automation_condition") == "true", run.tags
        assert run.tags.get("dagster/sensor_name") == "eagle3_automation", run.tags
        assert event.timestamp > kill_time
        vocab = instance.get_latest_materialization_event(dg.AssetKey("vocab_mapping"))
        assert vocab is not None and vocab.run_id == run.run_id
    print(f"trained by automation after {time.monotonic() - started:.0f} s")
