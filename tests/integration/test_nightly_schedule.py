"""The nightly retraining schedule: 02:00 UTC unless the config says otherwise (read when the code location
loads), and, evaluated against a real instance, a request for the drafter half whenever a shard was
extracted since the drafter was last trained."""

import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.definitions.schedule_definition import ScheduleExecutionData

from eagle3_dagster.definitions import defs
from eagle3_dagster.defs import schedules
from eagle3_dagster.defs.data.assets import CONVERTED_TAG
from eagle3_dagster.defs.orchestration import orchestration_settings
from eagle3_dagster.defs.schedules import build_nightly_schedule
from tests.conftest import REPO, write_config

DRAFTER_HALF = {
    "vocab_mapping", "drafter_checkpoint", "drafter_refined", "drafter_export", "drafter_eval", "drafter_current"
}  # fmt: skip


def test_it_runs_at_0200_utc_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the code location built its schedule from the settings of this environment
    loaded = defs.resolve_schedule_def("eagle3_nightly")
    expected = build_nightly_schedule(orchestration_settings())
    assert (loaded.cron_schedule, loaded.execution_timezone) == (
        expected.cron_schedule,
        expected.execution_timezone,
    )
    monkeypatch.setenv("EAGLE3_CONFIG", str(tmp_path / "absent.yaml"))  # a project without a config yet
    schedule = build_nightly_schedule(orchestration_settings())
    assert (schedule.cron_schedule, schedule.execution_timezone) == ("0 2 * * *", "UTC")
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    write_config(tmp_path, "store: store\n")  # a config without an orchestration section
    monkeypatch.setenv("EAGLE3_CONFIG", str(tmp_path / "eagle3.yaml"))
    assert orchestration_settings().nightly_cron == "0 2 * * *"


def test_the_code_location_follows_the_config(tmp_path: Path) -> None:
    config = write_config(
        tmp_path,
        "orchestration:\n  nightly_cron: '30 4 * * 1-5'\n  nightly_timezone: Europe/Paris\n"
        "  nightly_enabled: false\n  inbox: inbox\n  inbox_interval_seconds: 45\n",
    )
    probe = (
        "import json\nfrom eagle3_dagster.definitions import defs\n"
        "s = defs.resolve_schedule_def('eagle3_nightly'); i = defs.resolve_sensor_def('eagle3_inbox')\n"
        "print(json.dumps([s.cron_schedule, s.execution_timezone, s.default_status.value,"
        " i.default_status.value, i.minimum_interval_seconds]))\n"
    )
    env = {**os.environ, "EAGLE3_CONFIG": str(config)}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        "30 4 * * 1-5",
        "Europe/Paris",
        "STOPPED",
        "RUNNING",  # the inbox is set: its sensor starts running
        45,
    ]


def _evaluate(instance: dg.DagsterInstance) -> ScheduleExecutionData:
    schedule = defs.resolve_schedule_def("eagle3_nightly")
    with dg.build_schedule_context(instance_ref=instance.get_ref()) as context:
        return schedule.evaluate_tick(context)


def _land(
    instance: dg.DagsterInstance, asset: str, partition: str | None = None, tags: dict[str, str] | None = None
) -> None:
    instance.report_runless_asset_event(
        dg.AssetMaterialization(asset_key=asset, partition=partition, tags=tags)
    )


def test_it_requests_the_drafter_half_when_a_shard_was_extracted_since_the_last_training(
    instance: dg.DagsterInstance,
) -> None:
    assert _evaluate(instance).skip_message == (
        "no shard has been extracted yet (hidden_states has no materialization)"
    )
    instance.add_dynamic_partitions("shards", ["t-00000", "t-00001"])
    _land(instance, "hidden_states", "t-00000")
    [request] = _evaluate(instance).run_requests or []
    assert request.asset_selection is None  # the whole job: the drafter half and its checks

    schedule = defs.resolve_schedule_def("eagle3_nightly")
    job = defs.resolve_job_def(schedule.job_name)
    graph = defs.resolve_asset_graph()
    assert {k.to_user_string() for k in job.asset_layer.executable_asset_keys} == DRAFTER_HALF
    checks = {(c.asset_key.to_user_string(), c.name) for c in dg.AssetSelection.all().resolve_checks(graph)}
    selected = {(c.asset_key.to_user_string(), c.name) for c in job.asset_layer.asset_graph.asset_check_keys}
    assert ("drafter_eval", "not_worse_than_current") in selected
    assert selected == {c for c in checks if c[0] in DRAFTER_HALF}

    _land(instance, "drafter_checkpoint")  # trained: nothing new the next night
    skipped = _evaluate(instance)
    assert skipped.run_requests == [] and skipped.skip_message == (
        "no shard extracted since the drafter was last trained"
    )
    _land(instance, "hidden_states", "t-00001")  # the inbox brought a shard during the day
    assert len(_evaluate(instance).run_requests or []) == 1


def test_a_shard_converted_to_another_store_dtype_is_not_new_data(
    instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job eagle3_convert_shards re-materializes hidden_states with the same samples in another dtype: a
    backfill converting a store must not start a night of training on it, while an extraction still does."""
    instance.add_dynamic_partitions("shards", ["t-00000", "t-00001", "t-00002"])
    _land(instance, "hidden_states", "t-00000")
    _land(instance, "drafter_checkpoint")
    monkeypatch.setattr(schedules, "PAGE", 2)  # more conversions than a page: every page is read
    for key in ("t-00000", "t-00001", "t-00000", "t-00001", "t-00000"):
        _land(instance, "hidden_states", key, tags={CONVERTED_TAG: "fp8_e4m3"})
    assert _evaluate(instance).skip_message == "no shard extracted since the drafter was last trained"
    _land(instance, "hidden_states", "t-00002")  # then an extraction, under the conversions
    for key in ("t-00000", "t-00001", "t-00000"):
        _land(instance, "hidden_states", key, tags={CONVERTED_TAG: "fp8_e4m3"})
    assert len(_evaluate(instance).run_requests or []) == 1
