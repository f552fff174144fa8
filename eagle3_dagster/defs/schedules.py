"""The nightly retraining: the drafter half (vocab_mapping -> drafter_checkpoint -> drafter_export ->
drafter_eval -> drafter_current, with their checks) on every shard present, by default at 02:00 UTC.

The cron, its time zone and whether it starts running come from `orchestration` in the config, read when
the code location loads. A night with no shard extracted since the drafter was last trained is skipped:
training is keyed by its data, so it would only find its own finished run and measure it again. A shard
re-encoded in another store dtype (job eagle3_convert_shards) is not new data: the same samples, so it
retrains nothing by itself (a backfill converting a store would otherwise start hours of training, on a mix
of old and new shards, the first night it runs); the next training, nightly or by hand, reads it as it is.
"""

import dagster as dg

from eagle3_core.config import OrchestrationConfig
from eagle3_dagster.defs.data.assets import CONVERTED_TAG, hidden_states
from eagle3_dagster.defs.drafter.assets import drafter_checkpoint, drafter_export, vocab_mapping
from eagle3_dagster.defs.evaluation.assets import drafter_current, drafter_eval
from eagle3_dagster.defs.onpolicy.assets import drafter_refined
from eagle3_dagster.defs.orchestration import orchestration_settings

SCHEDULE_NAME = "eagle3_nightly"
RETRAIN_JOB = "eagle3_retrain"
PAGE = 1000  # materializations read at a time when looking for an extraction among conversions

DRAFTER_HALF = [
    vocab_mapping,
    drafter_checkpoint,
    drafter_refined,
    drafter_export,
    drafter_eval,
    drafter_current,
]

# AssetSelection.assets takes the selected assets' checks with them: not_worse_than_current gates promotion.
retrain_job = dg.define_asset_job(
    RETRAIN_JOB,
    selection=dg.AssetSelection.assets(*DRAFTER_HALF),
    description="The drafter half on every shard present: vocabulary, training, export, evaluation, promotion.",
)


def build_nightly_schedule(settings: OrchestrationConfig) -> dg.ScheduleDefinition:
    @dg.schedule(
        name=SCHEDULE_NAME,
        cron_schedule=settings.nightly_cron,
        execution_timezone=settings.nightly_timezone,
        job=retrain_job,
        default_status=dg.DefaultScheduleStatus.RUNNING
        if settings.nightly_enabled
        else dg.DefaultScheduleStatus.STOPPED,
        description=f"Retrains the drafter on every shard present ({settings.nightly_cron}, "
        f"{settings.nightly_timezone}); skipped when no shard was extracted since the last training.",
    )
    def eagle3_nightly(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        if _newest_materialization(context.instance, hidden_states.key) is None:
            return dg.SkipReason("no shard has been extracted yet (hidden_states has no materialization)")
        trained = _newest_materialization(context.instance, drafter_checkpoint.key)
        if not _extracted_since(context.instance, trained):
            return dg.SkipReason("no shard extracted since the drafter was last trained")
        return dg.RunRequest()

    return eagle3_nightly


def _extracted_since(instance: dg.DagsterInstance, after: int | None) -> bool:
    """Whether hidden_states has a materialization after storage id `after` (any, when None) that is not a
    re-encoding of a shard in another store dtype (tagged CONVERTED_TAG)."""
    records = dg.AssetRecordsFilter(asset_key=hidden_states.key, after_storage_id=after)
    cursor = None
    while True:
        page = instance.fetch_materializations(records, limit=PAGE, cursor=cursor)
        if any(not _converted(r.asset_materialization) for r in page.records):
            return True
        if not page.has_more:
            return False
        cursor = page.cursor


def _converted(materialization: dg.AssetMaterialization | None) -> bool:
    return materialization is not None and CONVERTED_TAG in (materialization.tags or {})


def _newest_materialization(instance: dg.DagsterInstance, key: dg.AssetKey) -> int | None:
    """The storage id of the asset's newest materialization (any partition); ids only grow, so they order
    events across assets where timestamps from different processes might not."""
    records = instance.fetch_materializations(key, limit=1).records
    return records[0].storage_id if records else None


nightly_schedule = build_nightly_schedule(orchestration_settings())
