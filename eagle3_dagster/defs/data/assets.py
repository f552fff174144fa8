"""The data half: conversations -> regenerated -> hidden_states, one partition per shard."""

import dagster as dg

from eagle3_core.steps import data
from eagle3_dagster.defs.metadata import step_metadata
from eagle3_dagster.defs.partitions import shards
from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource


@dg.asset(partitions_def=shards, group_name="data", kinds={"json"})
def conversations(context: dg.AssetExecutionContext, eagle3: Eagle3Resource) -> dg.MaterializeResult:
    """Normalised, deduplicated conversations of one shard, with its rejected rows counted by reason."""
    result = data.conversations_step(eagle3.config(), context.partition_key)
    return dg.MaterializeResult(metadata=step_metadata(result))


@dg.asset(partitions_def=shards, group_name="data", deps=[conversations], pool="gpu", kinds={"pytorch"})
def regenerated(
    context: dg.AssetExecutionContext, eagle3: Eagle3Resource, target: TargetResource
) -> dg.MaterializeResult:
    """Every assistant turn of the shard replaced by the target's own reply."""
    cfg = eagle3.config()
    if not cfg.regenerate.enabled:
        return dg.MaterializeResult(metadata={"skipped": "regenerate.enabled is false"})
    # Through a server, the target's weights are never loaded here (the resource loads them on first use).
    loaded = None if cfg.regenerate.server is not None else target.get(context.log)
    result = data.regenerate_step(cfg, context.partition_key, loaded, context.log.debug)
    return dg.MaterializeResult(metadata=step_metadata(result))


@dg.asset(
    partitions_def=shards, group_name="data", deps=[regenerated], pool="gpu", kinds={"pytorch", "safetensors"}
)
def hidden_states(
    context: dg.AssetExecutionContext, eagle3: Eagle3Resource, target: TargetResource
) -> dg.MaterializeResult:
    """The shard's aux-layer and final hidden states from the target, one safetensors file."""
    result = data.extract_step(
        eagle3.config(), context.partition_key, target.extraction_target(context.log), context.log.debug
    )
    return dg.MaterializeResult(metadata=step_metadata(result))


# One shard, start to end: what a shard run, a backfill and the inbox sensor materialize.
SHARD_ASSETS = [conversations, regenerated, hidden_states]
