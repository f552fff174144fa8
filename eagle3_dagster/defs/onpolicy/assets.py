"""The on-policy half (eagle3_core/steps/onpolicy.py, docs/onpolicy.md), between the offline drafter and its
export: onpolicy_records, one partition per shard (the shard's training prompts rolled out with the offline
drafter), and drafter_refined (the drafter trained further on them, in rounds), which drafter_export follows.

drafter_refined runs after drafter_checkpoint and rolls out any shard whose records are missing itself,
reporting each as a materialization of its onpolicy_records partition; materializing the partitions first
(a backfill, resumed by its missing partitions after a crash) spreads the rollouts over runs. With
onpolicy.enabled false both are quick no-ops and the offline drafter is exported as it is.
"""

import dagster as dg

from eagle3_core.steps import onpolicy
from eagle3_core.steps.common import StepResult
from eagle3_dagster.defs.automation import after_its_parent
from eagle3_dagster.defs.data.assets import hidden_states
from eagle3_dagster.defs.drafter.assets import drafter_checkpoint
from eagle3_dagster.defs.metadata import step_metadata
from eagle3_dagster.defs.partitions import shards
from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource

RECORDS = dg.AssetKey("onpolicy_records")


@dg.asset(
    partitions_def=shards,
    group_name="onpolicy",
    deps=[hidden_states, drafter_checkpoint],
    pool="gpu",
    kinds={"pytorch", "safetensors"},
)
def onpolicy_records(
    context: dg.AssetExecutionContext, eagle3: Eagle3Resource, target: TargetResource
) -> dg.MaterializeResult:
    """The shard's training prompts decoded with the offline drafter through the target, with the target's
    states at every position and which drafts it rejected: one record shard, lineage to the drafter by run."""
    cfg = eagle3.config()
    if not cfg.onpolicy.enabled:
        return dg.MaterializeResult(metadata={"skipped": "onpolicy.enabled is false"})
    result = onpolicy.records_step(cfg, context.partition_key, target.get(context.log), context.log.debug)
    return dg.MaterializeResult(metadata=step_metadata(result))


@dg.asset(
    group_name="onpolicy",
    deps=[dg.AssetDep(onpolicy_records, partition_mapping=dg.AllPartitionMapping()), drafter_checkpoint],
    pool="gpu",
    kinds={"pytorch"},
    # after the offline drafter, whether or not the record partitions were materialized first: it makes those
    # that are missing
    automation_condition=after_its_parent(ignoring=dg.AssetSelection.assets(RECORDS)),
)
def drafter_refined(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """The offline drafter trained further on its own rollouts mixed with the offline shards, in rounds while
    the measured acceptance length rises; the drafter export publishes (the offline one when disabled)."""

    def recorded(result: StepResult) -> None:
        if not result.metadata.get("skipped"):
            context.log_event(
                dg.AssetMaterialization(RECORDS, partition=result.key, metadata=step_metadata(result))
            )

    result = onpolicy.refine_step(eagle3.config(), context.log.info, on_record=recorded)
    return dg.MaterializeResult(metadata=step_metadata(result))
