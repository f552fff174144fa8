"""`eagle3 status` and `eagle3 materialize`'s choices, on a real (temporary) instance and a store of manifests:
each shard's state, its figures, the table, which shards run, the backfill request against the installed
GraphQL schema, and the `dagster dev` command line."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test
from graphql import parse, validate
from graphql.execution.values import get_variable_values
from rich.console import Console

from eagle3_cli import ops as ops_cli
from eagle3_cli.ops import (
    BACKFILL,
    LAUNCH_BACKFILL,
    OperationError,
    ShardStatus,
    backfill_params,
    classify,
    fail_interrupted_runs,
    instance_home,
    shard_statuses,
    shards_to_run,
    status_table,
    totals,
    ui_command,
)
from eagle3_core.config import Eagle3Config, load_config
from eagle3_core.store.records import ConversationManifest, ShardCounts, ShardManifest
from eagle3_dagster.defs.partitions import shards
from eagle3_dagster.materialize import RUNNER_TAG, add_shard_partitions, runner_alive, runner_tag
from tests.conftest import REPO, write_config

pytestmark = pytest.mark.filterwarnings("ignore:Specifying a partitions_def:dagster.PreviewWarning")


def _store(tmp_path: Path, extracted: dict[str, int], ingested: dict[str, int]) -> Eagle3Config:
    """Conversation manifests for `ingested` (key -> rejected rows) and hidden-state manifests for `extracted`
    (key -> samples), as ingest and extraction write them."""
    cfg = load_config(write_config(tmp_path, "store: store\n"))
    (cfg.store_root / "conversations").mkdir(parents=True)
    (cfg.store_root / "hidden_states").mkdir()
    for key, rejected in ingested.items():
        ConversationManifest(
            key=key,
            source="rows.jsonl",
            lines=[1, 10 + rejected],
            samples=10,
            train_samples=10,
            heldout_samples=0,
            assistant_turns=10,
            rejected={"duplicate": rejected},
            sample_ids=[f"{key}-{i}" for i in range(10)],
        ).write(cfg.store_root / "conversations" / f"{key}.json")
    for key, samples in extracted.items():
        ShardManifest(
            key=key,
            file=f"{key}.safetensors",
            bytes=1000 * samples,
            schema="eagle3.hidden_states/1",
            store_dtype="bfloat16",
            hidden_size=4,
            num_aux=3,
            counts=ShardCounts(samples=samples, tokens=100 * samples, loss_tokens=50 * samples, failed=1),
            sample_ids=[f"{key}-{i}" for i in range(samples + 1)],
            lengths=[100] * (samples + 1),
            failed={f"{key}-{samples}": "test"},
            checksum="0" * 64,
            header_checksum="0" * 64,
        ).write(cfg.store_root / "hidden_states" / f"{key}.json")
        # a manifest counts with its shard, of the size it records
        (cfg.store_root / "hidden_states" / f"{key}.safetensors").write_bytes(b"\0" * (1000 * samples))
    return cfg


def _dead_runner() -> str:
    """A runner tag of this host whose process has exited."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return f"{socket.gethostname()}:{proc.pid}:1"


def _shard_run(instance: dg.DagsterInstance, key: str, fail: bool) -> None:
    @dg.asset(key="hidden_states", partitions_def=shards)
    def stub() -> None:
        if fail:
            raise RuntimeError("extraction failed")

    dg.materialize([stub], partition_key=key, instance=instance, raise_on_error=False)


def test_classify() -> None:
    assert classify("MATERIALIZED", False, held=True) == "materialized"
    assert classify("IN_PROGRESS", False, held=False) == "in progress"
    assert classify("FAILED", False, held=False) == "failed"
    assert classify(None, False, held=False) == "missing"
    assert classify("IN_PROGRESS", True, held=False) == "interrupted"
    # the store is the truth: a shard it holds that the instance does not know, one it lost that the instance
    # has as materialized
    assert classify(None, False, held=True) == classify("FAILED", False, held=True) == "unrecorded"
    assert classify("MATERIALIZED", False, held=False) == "missing"


def test_runner_tag_names_a_live_or_dead_process() -> None:
    assert runner_alive(runner_tag()) is True
    assert runner_alive(_dead_runner()) is False
    assert runner_alive(f"{socket.gethostname()}:{os.getpid()}:1") is False  # same PID, another start time
    assert runner_alive("another-host:1:1") is None  # cannot tell: not ours to fail


def test_each_shard_state_from_the_instance_and_figures_from_the_store(
    tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    keys = ["s-00000", "s-00001", "s-00002", "s-00003", "s-00004"]
    cfg = _store(tmp_path, extracted={"s-00000": 8}, ingested=dict.fromkeys(keys, 2))
    add_shard_partitions(instance, keys[:4])  # s-00004 is in the store only
    _shard_run(instance, "s-00000", fail=False)
    _shard_run(instance, "s-00001", fail=True)
    dead = create_run_for_test(
        instance,
        status=dg.DagsterRunStatus.STARTED,
        tags={RUNNER_TAG: _dead_runner(), "dagster/partition": "s-00002"},
    )
    rows = {r.key: r for r in shard_statuses(cfg, instance)}
    assert {k: (r.state, r.registered) for k, r in rows.items()} == {
        "s-00000": ("materialized", True),
        "s-00001": ("failed", True),
        "s-00002": ("interrupted", True),
        "s-00003": ("missing", True),
        "s-00004": ("missing", False),
    }
    assert rows["s-00000"] == ShardStatus(
        "s-00000", "materialized", True, samples=8, tokens=800, rejected=2, errors=1, bytes=8000
    )
    assert rows["s-00003"].samples is None and rows["s-00003"].rejected == 2
    assert totals(list(rows.values())) == {
        "samples": 8,
        "tokens": 800,
        "rejected": 10,
        "errors": 1,
        "bytes": 8000,
    }

    # materialize --missing: the interrupted run is failed (its process is gone); then every shard not
    # materialized runs, the one materialized does not
    assert [r.run_id for r in fail_interrupted_runs(instance)] == [dead.run_id]
    assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.FAILURE  # type: ignore[union-attr]
    rows = {r.key: r for r in shard_statuses(cfg, instance)}
    assert rows["s-00002"].state == "missing"
    assert shards_to_run(list(rows.values()), None) == ["s-00001", "s-00002", "s-00003", "s-00004"]


def test_which_shards_run() -> None:
    rows = [
        ShardStatus("a-00000", "materialized", True),
        ShardStatus("a-00001", "in progress", True),
        ShardStatus("a-00002", "failed", True),
        ShardStatus("a-00003", "missing", False),
    ]
    assert shards_to_run(rows, None) == ["a-00002", "a-00003"]  # in progress: not launched twice
    assert shards_to_run(rows, ["a-00000", "a-00000"]) == ["a-00000"]  # asked for: run again
    with pytest.raises(OperationError, match="a-00009"):
        shards_to_run(rows, ["a-00009"])
    with pytest.raises(OperationError, match="in progress"):
        shards_to_run(rows, ["a-00001"])


def test_status_table() -> None:
    rows = [
        ShardStatus("a-00000", "materialized", True, samples=1200, tokens=5, rejected=0, errors=0, bytes=10),
        ShardStatus("a-00001", "missing", False, rejected=3),
    ]
    console = Console(record=True, width=200)
    console.print(status_table(rows, "shards"))
    text = console.export_text()
    assert "a-00000 │ materialized" in text and "1,200" in text
    assert "missing (no partition)" in text
    assert "total   │ 2 shards" in text
    many = [ShardStatus(f"a-{i:05d}", "missing", True) for i in range(100)]
    console = Console(record=True, width=200)
    console.print(status_table(many, "shards", max_rows=10))
    text = console.export_text()
    assert "... 90 more" in text and "a-00099" in text and "a-00050" not in text


def test_backfill_request_is_valid_for_the_installed_graphql_schema() -> None:
    from dagster_graphql.schema import create_schema

    schema = create_schema().graphql_schema
    for query in (LAUNCH_BACKFILL, BACKFILL):
        assert validate(schema, parse(query)) == []
    [operation] = parse(LAUNCH_BACKFILL).definitions
    params = backfill_params(["a-00000", "a-00001"])
    coerced = get_variable_values(schema, operation.variable_definitions, {"params": params})  # type: ignore[attr-defined]
    assert isinstance(coerced, dict), coerced  # a list of errors otherwise
    assert coerced["params"]["partitionNames"] == ["a-00000", "a-00001"]
    assert [a["path"] for a in params["assetSelection"]] == [
        ["conversations"],
        ["regenerated"],
        ["hidden_states"],
    ]
    assert params["runConfigData"] == {"execution": {"config": {"in_process": {}}}}


def test_instance_home_and_the_ui_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path / "project", "store: store\n")
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    home = instance_home(config)
    assert home == (tmp_path / "project" / ".dagster").resolve()
    assert (home / "dagster.yaml").read_text() == (REPO / "dagster.yaml").read_text()
    argv, env = ui_command(config, 3456)
    assert argv[1:] == ["dev", "-h", "127.0.0.1", "-p", "3456", "-w", str(REPO / "workspace.yaml")]
    assert Path(argv[0]).name == "dagster"
    assert env["DAGSTER_HOME"] == str(home) and env["EAGLE3_CONFIG"] == str(config.resolve())
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "elsewhere"))
    assert instance_home(config) == (tmp_path / "elsewhere").resolve()
    assert (tmp_path / "elsewhere").is_dir()


@contextmanager
def _closed_port() -> Iterator[int]:
    """A port nothing listens on (bound, never listening, for the block's duration)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def test_a_url_that_does_not_answer_is_refused() -> None:
    with _closed_port() as port:
        args = argparse.Namespace(in_process=False, url=f"http://127.0.0.1:{port}")
        with pytest.raises(OperationError, match="no Dagster webserver answers"):
            ops_cli.pick_webserver(args)
    assert ops_cli.pick_webserver(argparse.Namespace(in_process=True, url="http://x")) is None
