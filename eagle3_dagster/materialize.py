"""Running the shard assets in process against the instance in $DAGSTER_HOME (the demo and the CLI)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import dagster as dg

from eagle3_core.config import Eagle3Config
from eagle3_core.procs import pid_alive, proc_stat
from eagle3_core.store.held import held_shard
from eagle3_dagster.defs.data.assets import SHARD_ASSETS, hidden_states
from eagle3_dagster.defs.data.checks import SHARD_CHECKS
from eagle3_dagster.defs.data.store import add_shard_partitions, record_store_shards
from eagle3_dagster.defs.resources import default_resources
from eagle3_dagster.instance import open_instance

QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}  # the CLI prints its own progress
# The process that runs an in-process run, as "host:pid:start": a run whose process is gone (killed) stays
# STARTED in the instance for ever; `eagle3 status` shows it as interrupted and `eagle3 materialize` fails it.
RUNNER_TAG = "eagle3/runner"


def runner_tag() -> str:
    pid = os.getpid()
    stat = proc_stat(pid)
    return f"{socket.gethostname()}:{pid}:{stat.start_ticks if stat else ''}"


def runner_alive(tag: str) -> bool | None:
    """Whether the process named by a run's RUNNER_TAG still runs; None when it ran on another host."""
    host, pid, started = tag.rsplit(":", 2)
    if host != socket.gethostname():
        return None
    if started:
        stat = proc_stat(int(pid))
        return stat is not None and str(stat.start_ticks) == started
    return pid_alive(int(pid))


def missing_shards(instance: dg.DagsterInstance, cfg: Eagle3Config, keys: list[str]) -> list[str]:
    """Those of `keys` the instance has not materialized, or whose shard the store no longer holds (the store
    is the truth: a shard deleted or truncated since its run is missing)."""
    done = instance.get_materialized_partitions(hidden_states.key)
    return [k for k in keys if k not in done or held_shard(cfg.store_root, k) is None]


def materialize_shards(
    keys: list[str], instance: dg.DagsterInstance | None = None, log: Callable[[str], None] = print
) -> list[str]:
    """One run per missing shard through conversations -> regenerated -> hidden_states; returns the keys run.
    What the store already holds whole is recorded first (eagle3_dagster/defs/data/store.py), not run."""
    instance = instance or open_instance()
    cfg = default_resources()["eagle3"].config()
    add_shard_partitions(instance, keys)
    record = record_store_shards(instance, cfg)
    if record.recorded or record.refused:
        log(record.describe())
    todo = missing_shards(instance, cfg, keys)
    for i, key in enumerate(todo, start=1):
        log(f"run {i}/{len(todo)}: shard {key}")
        materialize_shard(key, instance)
    return todo


def materialize_shard(key: str, instance: dg.DagsterInstance) -> None:
    """One run, in this process, of conversations -> regenerated -> hidden_states and the shard checks."""
    result = dg.materialize(
        [*SHARD_ASSETS, *SHARD_CHECKS],
        partition_key=key,
        instance=instance,
        resources=default_resources(),
        run_config=QUIET,
        tags={RUNNER_TAG: runner_tag()},
    )
    if not result.success:
        raise RuntimeError(f"the run for shard {key} failed; see the Dagster UI for its logs")


def materialize_drafter(instance: dg.DagsterInstance | None = None) -> dict[str, dict[str, Any]]:
    """One run: vocab_mapping -> drafter_checkpoint -> drafter_refined -> drafter_export -> drafter_eval ->
    drafter_current.

    Returns each asset's metadata values, and the promotion check's under "not_worse_than_current". A drafter
    the gate refuses fails the run at the check (drafter_current is not materialized) and raises here.
    """
    from eagle3_dagster.defs.drafter.checks import vocab_coverage
    from eagle3_dagster.defs.evaluation.assets import not_worse_than_current
    from eagle3_dagster.defs.schedules import DRAFTER_HALF

    instance = instance or open_instance()
    result = dg.materialize(
        [*SHARD_ASSETS, *DRAFTER_HALF, vocab_coverage, not_worse_than_current],
        selection=DRAFTER_HALF,
        instance=instance,
        resources=default_resources(),
        run_config=QUIET,
        tags={RUNNER_TAG: runner_tag()},
        raise_on_error=False,
    )
    values = {
        event.asset_key.path[-1]: {k: v.value for k, v in event.metadata.items()}
        for event in (
            e.step_materialization_data.materialization for e in result.get_asset_materialization_events()
        )
    }
    for evaluation in result.get_asset_check_evaluations():
        values[evaluation.check_name] = {
            "passed": evaluation.passed,
            **{k: v.value for k, v in evaluation.metadata.items()},
        }
    gate = values.get("not_worse_than_current")
    if gate is not None and not gate["passed"]:
        raise RuntimeError(
            f"drafter {gate['candidate_run']} was not promoted: AL {gate['candidate_al']} at K={gate['k']} "
            f"against the promoted {gate['current_run']}'s {gate['current_al']} (tolerance {gate['tolerance']})"
        )
    if not result.success:
        raise RuntimeError("the drafter run failed; see the Dagster UI for its logs")
    return values
