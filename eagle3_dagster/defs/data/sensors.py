"""The inbox sensor: conversation files dropped in `orchestration.inbox` become shards, their partitions are
added and one run per shard is requested (conversations -> regenerated -> hidden_states).

The core (`eagle3_core.data.inbox`) decides which files are new and makes each one's shards exactly once.
The cursor is the highest shard index handed to Dagster: every tick hands over the inbox shards above it,
including shards a tick made but died before returning, so none is skipped; a run is keyed by its shard,
so a tick replayed after a crash never doubles a run. Starts running by default when the inbox is set.
"""

from collections.abc import Sequence

import dagster as dg

from eagle3_core.config import OrchestrationConfig
from eagle3_core.data.inbox import InboxReport, ingest_inbox, shard_index
from eagle3_dagster.defs.data.assets import SHARD_ASSETS
from eagle3_dagster.defs.orchestration import orchestration_settings
from eagle3_dagster.defs.partitions import shards
from eagle3_dagster.defs.resources import Eagle3Resource

SENSOR_NAME = "eagle3_inbox"
SHARD_JOB = "eagle3_shard"
ADD_BATCH = 1000  # keys per add request: one huge add hits SQLite's variable limit (dagster #16260)
# Ingest starts no new shard after this long, well inside the 60 s the daemon waits for a sensor tick;
# the file it stopped in is continued by the next tick.
TICK_BUDGET_SECONDS = 40.0

shard_job = dg.define_asset_job(
    SHARD_JOB,
    selection=SHARD_ASSETS,
    description="One shard through conversations -> regenerated -> hidden_states.",
)


def add_requests(keys: Sequence[str], batch: int = ADD_BATCH) -> list[dg.AddDynamicPartitionsRequest]:
    return [shards.build_add_request(list(keys[i : i + batch])) for i in range(0, len(keys), batch)]


def run_key(shard: str) -> str:
    return f"inbox:{shard}"


def build_inbox_sensor(settings: OrchestrationConfig) -> dg.SensorDefinition:
    @dg.sensor(
        name=SENSOR_NAME,
        job=shard_job,
        minimum_interval_seconds=settings.inbox_interval_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING
        if settings.inbox is not None
        else dg.DefaultSensorStatus.STOPPED,
        description="New conversation files in orchestration.inbox become shards: adds their partitions "
        "and requests one run per shard (running by default when the inbox is set).",
    )
    def eagle3_inbox(context: dg.SensorEvaluationContext, eagle3: Eagle3Resource) -> dg.SensorResult:
        cfg = eagle3.config()
        if cfg.orchestration.inbox is None:
            return dg.SensorResult(skip_reason="orchestration.inbox is not set in the config")
        report = ingest_inbox(cfg, max_seconds=TICK_BUDGET_SECONDS, log=context.log.debug)
        _log_report(context, report)
        if report.busy:
            return dg.SensorResult(skip_reason="another process is ingesting the inbox")
        done = -1 if context.cursor is None else int(context.cursor)
        todo = [k for k in report.inbox_shards if shard_index(k) > done]
        if not todo:
            return dg.SensorResult(skip_reason=_nothing_new(report))
        keys = [a.key for a in SHARD_ASSETS]
        return dg.SensorResult(
            dynamic_partitions_requests=add_requests(todo),
            run_requests=[
                dg.RunRequest(run_key=run_key(k), partition_key=k, asset_selection=keys) for k in todo
            ],
            cursor=str(shard_index(todo[-1])),
        )

    return eagle3_inbox


def _log_report(context: dg.SensorEvaluationContext, report: InboxReport) -> None:
    if report.new_shards:
        context.log.info(
            f"{len(report.new_shards)} new shard(s) from {report.ingested or report.unfinished}; "
            f"rejected rows {report.rejected or 0}"
            + (f"; cut before an empty turn {report.truncated}" if report.truncated else "")
        )
    for name, twin in report.same_as.items():
        context.log.info(f"{name}: same bytes as {twin}, already ingested; not read again")
    for rows in report.unsharded:
        context.log.info(rows.describe())
    for name, why in {**report.refused, **report.failed}.items():
        context.log.warning(f"{name}: {why}")
    if report.unfinished:
        context.log.info(f"{report.unfinished}: time budget reached; continued on the next tick")


def _nothing_new(report: InboxReport) -> str:
    parts = [f"no new file in {report.inbox}"]
    if report.waiting:
        parts.append(
            f"waiting for {len(report.waiting)} file(s) still being written: {sorted(report.waiting)}"
        )
    if report.ignored:
        parts.append(f"ignored {sorted(report.ignored)}: not .jsonl/.json/.parquet")
    if report.duplicates_skipped:
        parts.append(f"{report.duplicates_skipped} duplicate row(s) skipped, no shard written")
    parts.extend(f"refused {name}: {why}" for name, why in sorted(report.refused.items()))
    if report.failed:
        parts.append(f"failed (retried next tick): {sorted(report.failed)}")
    return "; ".join(parts)


inbox_sensor = build_inbox_sensor(orchestration_settings())
