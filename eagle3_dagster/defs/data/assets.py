"""The data half: conversations -> regenerated -> hidden_states, one partition per shard."""

import enum

import dagster as dg
from pydantic import Field

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


# The tag on a hidden_states materialization that re-encoded the shard the store held (its value: the new
# store dtype), not extracted it: the nightly schedule does not take it for new data.
CONVERTED_TAG = "eagle3/converted_to"


class StoreDtype(enum.Enum):
    """A store dtype: extract.store_dtype's choices (an enum, so that Dagster refuses any other at launch)."""

    bfloat16 = "bfloat16"
    float16 = "float16"
    float32 = "float32"
    fp8_e4m3 = "fp8_e4m3"


class HiddenStatesConfig(dg.Config):
    convert_to: StoreDtype | None = Field(
        default=None,
        description="Re-encode the shard the store holds in this store dtype instead of extracting it (eagle3 "
        "convert-shards for one shard; no target is loaded): a shard already in it is left as it is. "
        "None (the default): extract.",
    )


@dg.asset(
    partitions_def=shards, group_name="data", deps=[regenerated], pool="gpu", kinds={"pytorch", "safetensors"}
)
def hidden_states(
    context: dg.AssetExecutionContext,
    config: HiddenStatesConfig,
    eagle3: Eagle3Resource,
    target: TargetResource,
) -> dg.MaterializeResult:
    """The shard's aux-layer and final hidden states from the target, one safetensors file; with
    `convert_to`, the shard the store holds re-encoded in that store dtype (job eagle3_convert_shards)."""
    cfg, key = eagle3.config(), context.partition_key
    if config.convert_to is not None:
        result = data.convert_step(cfg, key, config.convert_to.value, context.log.info)
        tags = {CONVERTED_TAG: config.convert_to.value}
        return dg.MaterializeResult(metadata=step_metadata(result), tags=tags)
    result = data.extract_step(cfg, key, target.extraction_target(context.log), context.log.debug)
    return dg.MaterializeResult(metadata=step_metadata(result))


# One shard, start to end: what a shard run, a backfill and the inbox sensor materialize.
SHARD_ASSETS = [conversations, regenerated, hidden_states]
