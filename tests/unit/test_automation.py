"""The drafter half's automation, evaluated tick by tick against a real instance (the conftest's): training
is requested once, when the last shard lands, never while one is missing, and not again for a hand re-run."""

import dagster as dg
import pytest

from eagle3_dagster.definitions import defs
from eagle3_dagster.defs.partitions import shards

SHARDS = ["t-00000", "t-00001", "t-00002"]
DRAFTER_HALF = [
    "vocab_mapping",
    "drafter_checkpoint",
    "drafter_refined",
    "drafter_export",
    "drafter_eval",
    "drafter_current",
]
TRAINING = dg.AssetSelection.all()  # as the sensor targets it: assets and their checks
pytestmark = pytest.mark.filterwarnings("ignore:Specifying a partitions_def:dagster.PreviewWarning")


def _land(instance: dg.DagsterInstance, asset: str, partition: str | None = None) -> None:
    if asset == "hidden_states":
        assert partition is not None
        _shard_run(instance, partition, passed=True)
        return
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=asset, partition=partition))


_GRAPH = defs.resolve_asset_graph()
BLOCKING_SHARD_CHECKS = sorted(
    key.name
    for key in _GRAPH.asset_check_keys
    if key.asset_key == dg.AssetKey("hidden_states") and _GRAPH.get_check_spec(key).blocking
)


def _shard_run(instance: dg.DagsterInstance, partition: str, passed: bool) -> None:
    """A shard lands as its run lands it: hidden_states materialized, then its blocking checks evaluated (in a
    run: Dagster records one runless evaluation per check and partition, so a re-run could not be reported)."""

    @dg.asset(key="hidden_states", partitions_def=shards)
    def stub() -> None:
        pass

    def check(name: str) -> dg.AssetChecksDefinition:
        @dg.asset_check(asset="hidden_states", name=name, partitions_def=shards, blocking=True)
        def stub_check() -> dg.AssetCheckResult:
            return dg.AssetCheckResult(passed=passed)

        return stub_check

    checks = [check(name) for name in BLOCKING_SHARD_CHECKS]
    dg.materialize([stub, *checks], partition_key=partition, instance=instance, raise_on_error=False)


def _check(instance: dg.DagsterInstance, passed: bool) -> None:
    evaluation = dg.AssetCheckEvaluation(
        asset_key=dg.AssetKey("drafter_eval"), check_name="not_worse_than_current", passed=passed
    )
    instance.report_runless_asset_event(evaluation)


def _tick(instance: dg.DagsterInstance, cursor: object = None) -> dg.EvaluateAutomationConditionsResult:
    return dg.evaluate_automation_conditions(
        defs=defs, instance=instance, asset_selection=TRAINING, cursor=cursor
    )  # type: ignore[arg-type]


def test_training_is_requested_once_when_the_last_shard_lands_and_not_for_a_hand_rerun(
    instance: dg.DagsterInstance,
) -> None:
    instance.add_dynamic_partitions("shards", SHARDS)
    result = _tick(instance)
    assert result.total_requested == 0  # nothing extracted yet
    for shard in SHARDS[:-1]:
        _land(instance, "hidden_states", shard)
        result = _tick(instance, result.cursor)
        assert result.total_requested == 0  # a shard is still missing
    _land(instance, "hidden_states", SHARDS[-1])
    result = _tick(instance, result.cursor)
    # training, export and evaluation in one tick; promotion waits for the evaluation's blocking check
    assert {name: result.get_num_requested(dg.AssetKey(name)) for name in DRAFTER_HALF} == {
        **dict.fromkeys(DRAFTER_HALF, 1),
        "drafter_current": 0,
    }
    result = _tick(instance, result.cursor)
    assert result.total_requested == 0  # still missing (the run failed, or is running): no request loop
    for name in DRAFTER_HALF[:-1]:
        _land(instance, name)
    _check(instance, passed=True)
    result = _tick(instance, result.cursor)
    assert result.get_num_requested(dg.AssetKey("drafter_current")) == 1 and result.total_requested == 1
    _land(instance, "drafter_current")
    result = _tick(instance, result.cursor)
    assert result.total_requested == 0  # trained: not requested again on the next tick
    _land(instance, "hidden_states", SHARDS[0])  # one shard re-run by hand
    result = _tick(instance, result.cursor)
    assert result.total_requested == 0


def test_a_new_shard_that_is_not_extracted_yet_holds_training_back(instance: dg.DagsterInstance) -> None:
    instance.add_dynamic_partitions("shards", SHARDS[:2])
    result = _tick(instance)
    _land(instance, "hidden_states", SHARDS[0])
    instance.add_dynamic_partitions("shards", SHARDS[2:])  # the inbox brought another shard meanwhile
    _land(instance, "hidden_states", SHARDS[1])
    result = _tick(instance, result.cursor)
    assert result.total_requested == 0
    _land(instance, "hidden_states", SHARDS[2])
    assert _tick(instance, result.cursor).get_num_requested(dg.AssetKey("drafter_checkpoint")) == 1


def test_the_automation_sensor_runs_by_default() -> None:
    [sensor] = [s for s in defs.sensors or [] if s.name == "eagle3_automation"]
    assert sensor.default_status == dg.DefaultSensorStatus.RUNNING


def test_a_drafter_the_gate_refused_is_not_promoted(instance: dg.DagsterInstance) -> None:
    instance.add_dynamic_partitions("shards", SHARDS[:1])
    _land(instance, "hidden_states", SHARDS[0])
    result = _tick(instance)
    for name in DRAFTER_HALF[:-1]:
        _land(instance, name)
    _check(instance, passed=False)
    result = _tick(instance, result.cursor)
    assert result.get_num_requested(dg.AssetKey("drafter_current")) == 0


def test_the_shard_checks_that_training_waits_on_are_blocking() -> None:
    assert BLOCKING_SHARD_CHECKS == ["shard_complete", "shard_integrity"]


def test_a_shard_failing_a_blocking_check_holds_training_back_until_it_passes(
    instance: dg.DagsterInstance,
) -> None:
    instance.add_dynamic_partitions("shards", SHARDS[:1])
    _shard_run(instance, SHARDS[0], passed=False)
    result = _tick(instance)
    assert result.get_num_requested(dg.AssetKey("drafter_checkpoint")) == 0
    assert result.get_num_requested(dg.AssetKey("vocab_mapping")) == 0
    _shard_run(instance, SHARDS[0], passed=True)  # re-materialized, now whole
    result = _tick(instance, result.cursor)
    assert result.get_num_requested(dg.AssetKey("drafter_checkpoint")) == 1


def test_one_failing_shard_among_passing_ones_holds_training_back(instance: dg.DagsterInstance) -> None:
    instance.add_dynamic_partitions("shards", SHARDS)
    for shard in SHARDS:
        _shard_run(instance, shard, passed=shard != SHARDS[1])
    result = _tick(instance)
    assert result.get_num_requested(dg.AssetKey("drafter_checkpoint")) == 0
