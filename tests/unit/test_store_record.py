"""The store is the truth: shards written outside Dagster (here by the store's own writer, as `eagle3 extract`
writes them) are recorded in the instance, not made again; a damaged or deleted one is not taken as made.

Through the console script's main() on the CLI's own instance, and through the sensor `eagle3_store` ticked
as the daemon ticks it, then the automation evaluated on what it recorded."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.sensor_definition import SensorExecutionData

from eagle3_cli.main import main
from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.store import checks
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import ShardManifest
from eagle3_dagster.definitions import defs
from eagle3_dagster.defs.resources import Eagle3Resource
from tests.conftest import write_config
from tests.records import write_shard

pytestmark = pytest.mark.filterwarnings("ignore:Specifying a partitions_def:dagster.PreviewWarning")
HIDDEN_STATES = dg.AssetKey("hidden_states")
BLOCKING = [
    dg.AssetCheckKey(HIDDEN_STATES, "shard_complete"),
    dg.AssetCheckKey(HIDDEN_STATES, "shard_integrity"),
]


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, list[str]]:
    """Three ingested shards (no model: regeneration off); the instance is the CLI's, .dagster beside it."""
    config = write_config(
        tmp_path,
        "store: store\ndata: {dataset: s, shard_size: 4, holdout_fraction: 0.0, "
        "sources: [{kind: chitchat, limit: 16}]}\nregenerate: {enabled: false}\n",
    )
    keys = ingest(load_config(config)).all_shards
    assert len(keys) == 3, keys
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    monkeypatch.delenv("EAGLE3_CONFIG", raising=False)
    return config, keys


def _flip_a_byte(shard: Path) -> None:
    """Damage the shard's tensor bytes (its end), not its size: only its digests can tell."""
    raw = bytearray(shard.read_bytes())
    raw[-8] ^= 0x10
    shard.write_bytes(bytes(raw))


def _states(config: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, tuple[str, bool]]:
    capsys.readouterr()
    assert main(["--config", str(config), "status", "--json"]) == 0
    return {r["key"]: (r["state"], r["registered"]) for r in json.loads(capsys.readouterr().out)["shards"]}


def test_materialize_missing_records_what_the_store_holds_and_runs_only_the_rest(
    project: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config, [whole, damaged, absent] = project
    root = config.parent / "store"
    for key in (whole, damaged):
        write_shard(root, key)  # "eagle3 extract", outside Dagster
    _flip_a_byte(StoreLayout(root).hidden_states(damaged))
    assert _states(config, capsys) == {
        whole: ("unrecorded", False),
        damaged: ("unrecorded", False),  # status reads no shard's bytes: materialize checks them
        absent: ("missing", False),
    }

    ran: list[str] = []  # what materialize would extract: each shard's run, stood in for (no model here)
    monkeypatch.setattr("eagle3_dagster.materialize.materialize_shard", lambda key, _: ran.append(key))
    assert main(["--config", str(config), "materialize", "--missing", "--in-process"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ran == [damaged, absent]
    assert f"1 shard(s) the store holds recorded as materialized, not run again: {whole}" in out
    assert f"{damaged}: not recorded, it will be made again: " in out and "fails its checksum" in out

    with dg.DagsterInstance.from_config(str(config.parent / ".dagster")) as instance:
        assert instance.get_dynamic_partitions("shards") == [whole, damaged, absent]
        assert instance.get_materialized_partitions(HIDDEN_STATES) == {whole}
        for asset in ("conversations", "regenerated", "hidden_states"):
            [record] = instance.fetch_materializations(dg.AssetKey(asset), limit=10).records
            assert record.partition_key == whole and record.run_id == ""  # runless
            assert record.asset_materialization is not None
            assert record.asset_materialization.tags == {
                "eagle3/recorded_from": "store"
            }  # as the UI shows it
        shard = ShardManifest.read(StoreLayout(root).hidden_states_manifest(whole))
        metadata = record.asset_materialization.metadata
        assert (metadata["samples"].value, metadata["bytes"].value) == (shard.counts.samples, shard.bytes)
        for check in BLOCKING:
            [evaluation] = instance.event_log_storage.get_asset_check_execution_history(check, limit=10)
            assert evaluation.partition == whole
            assert evaluation.status.value == "SUCCEEDED"

    assert _states(config, capsys)[whole] == ("materialized", True)
    StoreLayout(root).hidden_states(whole).unlink()  # the store lost it: missing, whatever the instance says
    assert _states(config, capsys)[whole] == ("missing", True)
    ran.clear()
    assert main(["--config", str(config), "materialize", "--missing", "--in-process"]) == 0
    assert ran == [whole, damaged, absent]


def _tick(instance: dg.DagsterInstance, config: Path, cursor: str | None) -> SensorExecutionData:
    sensor = defs.resolve_sensor_def("eagle3_store")
    resources = {"eagle3": Eagle3Resource(config_path=str(config))}
    with dg.build_sensor_context(
        instance_ref=instance.get_ref(), definitions=defs, resources=resources, cursor=cursor
    ) as context:
        return sensor.evaluate_tick(context)


def _training_requested(instance: dg.DagsterInstance) -> int:
    result = dg.evaluate_automation_conditions(
        defs=defs, instance=instance, asset_selection=dg.AssetSelection.all()
    )
    return result.get_num_requested(dg.AssetKey("drafter_checkpoint"))


def test_the_store_sensor_records_shards_and_the_automation_trains_on_them(
    project: tuple[Path, list[str]], instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, keys = project
    root = config.parent / "store"
    for key in keys:
        write_shard(root, key)
    _flip_a_byte(StoreLayout(root).hidden_states(keys[1]))
    assert instance.get_materialized_partitions(HIDDEN_STATES) == set()

    first = _tick(instance, config, cursor=None)
    assert instance.get_dynamic_partitions("shards") == keys  # every shard of the store is a partition
    assert instance.get_materialized_partitions(HIDDEN_STATES) == {keys[0], keys[2]}  # what a backfill skips
    assert first.skip_message and f"{keys[1]} not recorded" in first.skip_message
    assert _training_requested(instance) == 0  # a shard is still missing

    read: list[str] = []  # the damaged file, unchanged, is not read again on the next tick
    verify = checks.shard_integrity
    monkeypatch.setattr(checks, "shard_integrity", lambda root, key: read.append(key) or verify(root, key))
    second = _tick(instance, config, cursor=first.cursor)
    assert read == [] and instance.get_materialized_partitions(HIDDEN_STATES) == {keys[0], keys[2]}

    write_shard(root, keys[1])  # extracted again, outside Dagster
    _tick(instance, config, cursor=second.cursor)
    assert read == [keys[1]]
    assert instance.get_materialized_partitions(HIDDEN_STATES) == set(keys)
    assert _training_requested(instance) == 1  # the recorded checks pass the automation's gate
