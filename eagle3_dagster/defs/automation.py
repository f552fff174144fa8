"""When the drafter half runs by itself: training once every shard is done, then export, evaluation, promotion.

`vocab_mapping` and `drafter_checkpoint` are requested once they are missing and no shard is missing or in
progress (a run that died at shard 97 of 146 trains only after the missing shards are materialized), and
only if the shards' blocking checks pass. A shard re-run by hand does not retrain: the nightly schedule
retrains on everything present. Downstream of the checkpoint, each asset follows its parent (`eager`).
"""

import dagster as dg

AC = dg.AutomationCondition


def when_every_shard_is_done() -> dg.AutomationCondition:
    """Missing, and its inputs became ready (every shard present, none in progress, blocking checks passed)
    since it was last requested or updated. Dagster's `on_missing` would not do: it never fires for an asset
    that was already missing when the sensor first looked, which a drafter always is. A failed run is not
    retried in a loop: the inputs must become ready anew (or the asset be launched by hand)."""
    ready = ~AC.any_deps_missing() & ~AC.any_deps_in_progress() & every_blocking_check_passed()
    became_ready = ready.newly_true().since(AC.newly_requested() | AC.newly_updated())
    return (AC.missing() & ~AC.in_progress() & ready & became_ready).with_label("once every shard is done")


def every_blocking_check_passed() -> dg.AutomationCondition:
    """No dependency has a blocking check that failed (or never ran) on any of its partitions.

    Dagster's `all_deps_blocking_checks_passed` counts a partitioned dependency's checks as passed once any one
    partition passes them, so one corrupt shard among good ones would not hold training back.
    """
    failed = AC.any_checks_match(~AC.check_passed() & ~AC.will_be_requested(), blocking_only=True)
    return ~AC.any_deps_match(failed).with_label("a dependency's blocking check failed")


def after_its_parent(ignoring: dg.AssetSelection | None = None) -> dg.AutomationCondition:
    """Eager on its dependencies, their blocking checks passed; `ignoring`: dependencies that neither request
    it nor hold it back (missing, in progress or failing a check)."""
    condition = AC.eager() & AC.all_deps_blocking_checks_passed()
    if ignoring is not None:
        condition = condition.ignore(ignoring)
    return condition.with_label("after its parent, checks passed")


automation_sensor = dg.AutomationConditionSensorDefinition(
    "eagle3_automation",
    target=dg.AssetSelection.all(),
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Evaluates the assets' automation conditions (runs by default, unlike Dagster's own).",
)
