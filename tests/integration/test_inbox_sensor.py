"""The inbox sensor of the real code location, ticked against a real (temporary SQLite) instance the way the
daemon ticks it: a dropped file's shards are added as partitions with one run requested per shard, and a
later tick hands over nothing twice."""

import json
import os
from collections.abc import Iterable
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.sensor_definition import SensorExecutionData

from eagle3_core.config import load_config
from eagle3_core.data.inbox import ingest_inbox
from eagle3_dagster.definitions import defs
from eagle3_dagster.defs.data.sensors import add_requests
from eagle3_dagster.defs.resources import Eagle3Resource
from tests.conftest import write_config
from tests.parquet_files import unreadable_parquet

SHARD_ASSETS = [dg.AssetKey("conversations"), dg.AssetKey("regenerated"), dg.AssetKey("hidden_states")]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "inbox").mkdir()
    return write_config(
        tmp_path,
        "store: store\ndata: {dataset: t, shard_size: 2}\n"
        "orchestration: {inbox: inbox, inbox_min_age_seconds: 0}\n",
    )


def _drop(config: Path, name: str, rows: Iterable[int]) -> None:
    lines = [json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) for i in rows]
    (config.parent / "inbox" / name).write_text("".join(f"{line}\n" for line in lines))


def _tick(instance: dg.DagsterInstance, config: Path, cursor: str | None) -> SensorExecutionData:
    """One evaluation as the daemon runs it (run requests resolved against the job and the partitions), then
    the partitions added as the daemon adds them."""
    sensor = defs.resolve_sensor_def("eagle3_inbox")
    resources = {"eagle3": Eagle3Resource(config_path=str(config))}
    with dg.build_sensor_context(
        instance_ref=instance.get_ref(), definitions=defs, resources=resources, cursor=cursor
    ) as context:
        data = sensor.evaluate_tick(context)
    for request in data.dynamic_partitions_requests:
        assert isinstance(request, dg.AddDynamicPartitionsRequest)
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return data


def _added(data: SensorExecutionData) -> list[str]:
    return [k for r in data.dynamic_partitions_requests for k in r.partition_keys or []]


def test_a_dropped_file_adds_its_shards_and_one_run_each_and_a_second_tick_yields_nothing(
    project: Path, instance: dg.DagsterInstance
) -> None:
    _drop(project, "a.jsonl", range(5))
    first = _tick(instance, project, cursor=None)
    shards = ["t-00000", "t-00001", "t-00002"]
    assert _added(first) == shards
    assert instance.get_dynamic_partitions("shards") == shards
    assert [(r.partition_key, r.run_key) for r in first.run_requests] == [(k, f"inbox:{k}") for k in shards]
    assert all(r.asset_selection == SHARD_ASSETS for r in first.run_requests)
    assert all(r.tags["dagster/partition"] == r.partition_key for r in first.run_requests)

    second = _tick(instance, project, cursor=first.cursor)
    assert second.run_requests == [] and _added(second) == []
    assert second.skip_message and "no new file" in second.skip_message

    _drop(project, "b.jsonl", range(5, 7))  # only the new file's shard is handed over
    third = _tick(instance, project, cursor=second.cursor)
    assert _added(third) == ["t-00003"] and [r.partition_key for r in third.run_requests] == ["t-00003"]


def test_shards_a_dead_tick_made_are_handed_over_and_a_replayed_tick_repeats_its_run_keys(
    project: Path, instance: dg.DagsterInstance
) -> None:
    _drop(project, "a.jsonl", range(3))
    made = ingest_inbox(load_config(project)).new_keys  # a tick that died after ingesting, before returning
    assert made == ["t-00000", "t-00001"]
    first = _tick(instance, project, cursor=None)
    assert _added(first) == made
    # The daemon died before saving the cursor: the replay asks for the same runs under the same run keys,
    # which the daemon launches once.
    replay = _tick(instance, project, cursor=None)
    assert [r.run_key for r in replay.run_requests] == [r.run_key for r in first.run_requests]
    assert instance.get_dynamic_partitions("shards") == made


def test_partition_adds_are_batched() -> None:
    keys = [f"t-{i:05d}" for i in range(2500)]
    requests = add_requests(keys)
    assert [len(r.partition_keys or []) for r in requests] == [1000, 1000, 500]
    assert [k for r in requests for k in r.partition_keys or []] == keys


def test_without_an_inbox_the_sensor_skips(tmp_path: Path, instance: dg.DagsterInstance) -> None:
    config = write_config(tmp_path, "store: store\n")
    data = _tick(instance, config, cursor=None)
    assert data.run_requests == [] and data.skip_message == "orchestration.inbox is not set in the config"


def test_a_symbolic_link_in_the_inbox_is_refused_by_the_tick_and_its_target_never_read(
    project: Path, instance: dg.DagsterInstance
) -> None:
    secret = "sk-live-0123456789abcdef"
    target = project.parent / "secrets.env"
    target.write_text(f"API_KEY={secret}\n")
    (project.parent / "inbox" / "leak.jsonl").symlink_to(target)
    data = _tick(instance, project, cursor=None)
    assert data.run_requests == [] and _added(data) == []
    assert data.skip_message and "refused inbox/leak.jsonl: a symbolic link" in data.skip_message
    store = project.parent / "store"
    assert [p for p in store.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()] == []


def test_a_file_of_rows_already_sharded_requests_no_run(project: Path, instance: dg.DagsterInstance) -> None:
    _drop(project, "a.jsonl", range(2))
    first = _tick(instance, project, cursor=None)
    _drop(project, "b.jsonl", reversed(range(2)))  # the same conversations, other bytes
    second = _tick(instance, project, cursor=first.cursor)
    assert second.run_requests == [] and _added(second) == []
    assert second.skip_message and "2 duplicate row(s) skipped, no shard written" in second.skip_message


def test_a_file_name_that_is_not_utf8_is_ingested_by_the_tick_and_files_after_it_too(
    project: Path, instance: dg.DagsterInstance
) -> None:
    _drop(project, os.fsdecode(b"caf\xe9.jsonl"), range(2))  # Latin-1 bytes: a valid Linux name, not UTF-8
    _drop(project, "zeta.jsonl", range(2, 4))
    first = _tick(instance, project, cursor=None)
    assert _added(first) == ["t-00000", "t-00001"]
    assert [r.partition_key for r in first.run_requests] == ["t-00000", "t-00001"]
    ledger = json.loads((project.parent / "store" / "ledger.json").read_text())
    assert ledger["sources"]["inbox/caf\\xe9.jsonl"]["shards"] == ["t-00000"]
    assert ledger["sources"]["inbox/zeta.jsonl"]["shards"] == ["t-00001"]
    second = _tick(instance, project, cursor=first.cursor)
    assert second.run_requests == [] and second.skip_message and "no new file" in second.skip_message


def test_a_parquet_file_that_cannot_be_decoded_is_refused_by_the_tick_and_files_after_it_are_ingested(
    project: Path, instance: dg.DagsterInstance
) -> None:
    unreadable_parquet(project.parent / "inbox" / "broken.parquet", "unknown_time_zone")  # pytz's KeyError
    _drop(project, "zeta.jsonl", range(2))
    first = _tick(instance, project, cursor=None)
    assert _added(first) == ["t-00000"] and [r.partition_key for r in first.run_requests] == ["t-00000"]
    record = json.loads((project.parent / "store" / "inbox.json").read_text())["files"]
    assert record["inbox/broken.parquet"]["state"] == "refused"
    assert "inbox/broken.parquet: not readable as Parquet" in record["inbox/broken.parquet"]["reason"]
    second = _tick(instance, project, cursor=first.cursor)  # refused once: not read nor reported again
    assert second.run_requests == [] and second.skip_message
    assert "no new file" in second.skip_message and "broken.parquet" not in second.skip_message


def test_of_two_files_recorded_alike_the_tick_refuses_the_second_once_naming_both(
    project: Path, instance: dg.DagsterInstance
) -> None:
    _drop(project, "caf\\xe9.jsonl", range(2))  # a UTF-8 name spelling out the escape of the next one's byte
    _drop(project, os.fsdecode(b"caf\xe9.jsonl"), range(2, 4))
    first = _tick(instance, project, cursor=None)
    assert _added(first) == ["t-00000"]
    second = _tick(instance, project, cursor=first.cursor)  # neither file read nor reported again
    assert second.run_requests == [] and second.skip_message == f"no new file in {project.parent / 'inbox'}"
    record = json.loads((project.parent / "store" / "inbox.json").read_text())
    reason = record["clashes"]["inbox/caf\\xe9.jsonl"]["reason"]
    assert repr(b"caf\xe9.jsonl") in reason and repr(b"caf\\xe9.jsonl") in reason
