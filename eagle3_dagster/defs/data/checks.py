"""Checks of the data half, one evaluation per shard (partitioned like the assets they check).

`shard_complete` and `shard_integrity` are blocking: a shard that fails either fails its run, and training's
automation waits on them (re-materialize the shard; a checks-only run needs its partition given as the
`dagster/partition` tag, since Dagster 1.13 takes a run's partitions definition from its assets only).
`reject_rate` only warns: a source with many bad rows deserves a look, not a stopped pipeline.
"""

import warnings

import dagster as dg

from eagle3_core.store import checks
from eagle3_core.store.checks import CheckVerdict
from eagle3_dagster.defs.data.assets import conversations, hidden_states
from eagle3_dagster.defs.partitions import shards
from eagle3_dagster.defs.resources import Eagle3Resource

# Partitioned checks are a preview in Dagster 1.13, and the only way to keep one verdict per shard (an
# unpartitioned check on a partitioned asset keeps only the latest shard's): taken knowingly, not warned on every load.
warnings.filterwarnings(
    "ignore", message="Specifying a partitions_def on an AssetCheckSpec", category=dg.PreviewWarning
)


def check_result(verdict: CheckVerdict, severity: dg.AssetCheckSeverity) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(
        passed=verdict.passed, severity=severity, description=verdict.reason, metadata=dict(verdict.figures)
    )


@dg.asset_check(
    asset=hidden_states,
    partitions_def=shards,
    blocking=True,
    description="Shard file and manifest present, no unfinished write, every training conversation accounted for",
)
def shard_complete(context: dg.AssetCheckExecutionContext, eagle3: Eagle3Resource) -> dg.AssetCheckResult:
    verdict = checks.shard_complete(eagle3.config().store_root, context.partition_key)
    return check_result(verdict, dg.AssetCheckSeverity.ERROR)


@dg.asset_check(
    asset=hidden_states,
    partitions_def=shards,
    blocking=True,
    description="Every sample's digest and the whole-shard checksum match the bytes on disk",
)
def shard_integrity(context: dg.AssetCheckExecutionContext, eagle3: Eagle3Resource) -> dg.AssetCheckResult:
    verdict = checks.shard_integrity(eagle3.config().store_root, context.partition_key)
    return check_result(verdict, dg.AssetCheckSeverity.ERROR)


@dg.asset_check(
    asset=conversations,
    partitions_def=shards,
    description="Share of the shard's source rows rejected at ingest, at most checks.max_reject_rate",
)
def reject_rate(context: dg.AssetCheckExecutionContext, eagle3: Eagle3Resource) -> dg.AssetCheckResult:
    cfg = eagle3.config()
    verdict = checks.reject_rate(
        cfg.store_root, context.partition_key, cfg.checks.max_reject_rate, cfg.checks.reject_rate_ignores
    )
    return check_result(verdict, dg.AssetCheckSeverity.WARN)


SHARD_CHECKS = [reject_rate, shard_complete, shard_integrity]
