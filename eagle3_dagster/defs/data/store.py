"""The store is the truth: shards it holds that the instance does not know of are recorded, not made again.

A shard extracted outside Dagster (`eagle3 extract`, a copied store, an instance started afresh) is one the
instance never heard of: Dagster would take it as missing, and `eagle3 materialize --missing`, a backfill of
missing partitions or the automation would spend hours of GPU extracting it again. So before it plans,
`eagle3 materialize` records what the store holds, and the sensor `eagle3_store` does the same every minute:

- every shard of the store becomes a partition of `shards`;
- a shard the store holds (eagle3_core/store/held.py) whose hidden states the instance has not materialized,
  with no run of it in progress, is recorded when both blocking checks pass on it now, computed from the store
  (`shard_complete` from manifests and sizes, `shard_integrity` by reading its bytes once: the read a shard
  run's own check makes, far cheaper than an extraction). Recording is runless events: conversations,
  regenerated and hidden_states materialized, their metadata read from the manifests and tagged
  `eagle3/recorded_from: store`, then the two checks' evaluations against that materialization, which is what
  the automation's gate on blocking checks reads;
- a shard that fails a check is not recorded: it stays missing, and is extracted again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

# Dagster exports no public name for the pointer from a check evaluation to the materialization it checked;
# without it a runless evaluation does not count as evaluating the latest materialization (check_passed).
from dagster._core.definitions.asset_checks.asset_check_evaluation import (
    AssetCheckEvaluationTargetMaterializationData,
)

from eagle3_core.config import Eagle3Config
from eagle3_core.errors import StoreBusyError
from eagle3_core.steps.common import StepResult, quiet
from eagle3_core.steps.data import conversations_step, shard_figures
from eagle3_core.store import checks
from eagle3_core.store.checks import CheckVerdict
from eagle3_core.store.convert import finish_cut_conversion
from eagle3_core.store.held import held_shard, store_shard_keys
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import RegeneratedManifest, ShardManifest
from eagle3_dagster.defs.data.assets import conversations, hidden_states, regenerated
from eagle3_dagster.defs.data.checks import shard_complete, shard_integrity
from eagle3_dagster.defs.data.sensors import TICK_BUDGET_SECONDS
from eagle3_dagster.defs.metadata import step_metadata
from eagle3_dagster.defs.partitions import SHARDS, shards
from eagle3_dagster.defs.resources import Eagle3Resource

SENSOR_NAME = "eagle3_store"
RECORDED_TAG = "eagle3/recorded_from"
RECORDED = {RECORDED_TAG: "store"}
NOT_TO_RECORD = {dg.AssetPartitionStatus.MATERIALIZED, dg.AssetPartitionStatus.IN_PROGRESS}
# Both blocking checks of a shard, in the order a run evaluates them: the cheap one first.
BLOCKING_CHECKS: tuple[tuple[str, Callable[[Eagle3Config, str], CheckVerdict]], ...] = (
    (shard_complete.check_key.name, lambda cfg, key: checks.shard_complete(cfg.store_root, key)),
    (shard_integrity.check_key.name, lambda cfg, key: checks.shard_integrity(cfg.store_root, key)),
)


@dataclass
class StoreRecord:
    """What one pass over the store did."""

    added: list[str] = field(default_factory=list)  # new partitions
    recorded: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # held, but a check failed: why (it stays missing)
    # the damaged shards' files as they were found (file_identity), this pass's and the unchanged earlier ones
    refused_files: dict[str, str] = field(default_factory=dict)
    left: list[str] = field(default_factory=list)  # not looked at: the time budget ran out

    def describe(self) -> str:
        parts = [f"{len(self.added)} partition(s) added"] if self.added else []
        if self.recorded:
            parts.append(f"{len(self.recorded)} shard(s) recorded from the store: {', '.join(self.recorded)}")
        parts.extend(f"{key} not recorded: {why}" for key, why in self.refused.items())
        unchanged = sorted(set(self.refused_files) - set(self.refused))
        if unchanged:
            parts.append(f"{', '.join(unchanged)} still damaged (unchanged since found so; not read again)")
        if self.left:
            parts.append(f"{len(self.left)} shard(s) left for the next pass (time budget)")
        return "; ".join(parts) or "the instance knows every shard the store holds"


def add_shard_partitions(instance: dg.DagsterInstance, keys: list[str], batch: int = 1000) -> list[str]:
    """Register new shard keys as partitions, in batches (one huge add hits SQLite's variable limit)."""
    existing = set(instance.get_dynamic_partitions(SHARDS))
    new = [k for k in keys if k not in existing]
    for start in range(0, len(new), batch):
        instance.add_dynamic_partitions(SHARDS, new[start : start + batch])
    return new


def unrecorded_shards(instance: dg.DagsterInstance, cfg: Eagle3Config, keys: list[str]) -> list[str]:
    """Shards (registered partitions) the store holds that the instance has not materialized, with no run in
    progress (that run's own events will say what it made)."""
    status = instance.get_status_by_partition(hidden_states.key, keys, shards) or {}
    return [
        k for k in keys if status.get(k) not in NOT_TO_RECORD and held_shard(cfg.store_root, k) is not None
    ]


def file_identity(cfg: Eagle3Config, key: str) -> str | None:
    """The shard file as it is now (inode, size, modification time): a rewrite changes it. None: gone."""
    try:
        st = StoreLayout(cfg.store_root).hidden_states(key).stat()
    except FileNotFoundError:
        return None
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def record_store_shards(
    instance: dg.DagsterInstance,
    cfg: Eagle3Config,
    budget_seconds: float | None = None,
    refused_before: Mapping[str, str] | None = None,
    log: Callable[[str], None] = quiet,
) -> StoreRecord:
    """Add the store's shards as partitions and record those it holds whole that the instance does not know.

    With a budget, no shard is started once it is spent (the rest are left for the next pass).
    `refused_before` (key -> file identity, a previous pass's `refused_files`) names shards found damaged
    then: one whose file has not changed since is not read again (a sensor would re-read it every tick).
    """
    started = time.monotonic()
    keys = store_shard_keys(cfg.store_root)
    report = StoreRecord(added=add_shard_partitions(instance, keys))
    todo = unrecorded_shards(instance, cfg, keys)
    for i, key in enumerate(todo):
        if budget_seconds is not None and time.monotonic() - started > budget_seconds:
            report.left = todo[i:]
            break
        try:
            # a conversion killed between its renames: its manifest written from the shard's header, the
            # temporaries of a killed writer removed (the checks would take either for a damaged shard)
            if finish_cut_conversion(cfg.store_root, key):
                log(
                    f"{key}: finished what a writer killed mid-way left (temporaries, a conversion's manifest)"
                )
        except StoreBusyError:  # a writer is at work on it: its own run, or a later pass, records it
            log(f"{key}: being written by another process; not recorded now")
            continue
        identity = file_identity(cfg, key)
        if identity is None:  # deleted since it was listed: nothing to record
            continue
        if (refused_before or {}).get(key) == identity:
            report.refused_files[key] = identity
            continue
        log(f"{key}: in the store, unknown to the instance: checking it ({i + 1}/{len(todo)})")
        verdicts = verdicts_now(cfg, key)
        failed = [v for v in verdicts.values() if not v.passed]
        if failed:
            report.refused[key] = failed[0].reason
            report.refused_files[key] = identity
            log(f"{key}: not recorded, it will be made again: {failed[0].reason}")
            continue
        record_shard(instance, cfg, key, verdicts)
        report.recorded.append(key)
    return report


def verdicts_now(cfg: Eagle3Config, key: str) -> dict[str, CheckVerdict]:
    """The blocking checks' verdicts on the shard as the store holds it, stopping at the first that fails."""
    verdicts: dict[str, CheckVerdict] = {}
    for name, check in BLOCKING_CHECKS:
        verdicts[name] = check(cfg, key)
        if not verdicts[name].passed:
            break
    return verdicts


def record_shard(
    instance: dg.DagsterInstance, cfg: Eagle3Config, key: str, verdicts: dict[str, CheckVerdict]
) -> None:
    """The shard's assets materialized and its checks evaluated, as runless events of the instance."""
    for asset_key, metadata in stage_metadata(cfg, key).items():
        instance.report_runless_asset_event(
            dg.AssetMaterialization(
                asset_key=asset_key,
                partition=key,
                metadata=metadata,
                tags=RECORDED,
                description="recorded from the store: made outside Dagster, complete and verified",
            )
        )
    [latest] = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=hidden_states.key, asset_partitions=[key]), limit=1
    ).records
    target = AssetCheckEvaluationTargetMaterializationData(
        storage_id=latest.storage_id, run_id=latest.run_id, timestamp=latest.timestamp
    )
    for name, verdict in verdicts.items():
        instance.report_runless_asset_event(
            dg.AssetCheckEvaluation(
                asset_key=hidden_states.key,
                check_name=name,
                passed=verdict.passed,
                metadata=dict(verdict.figures),
                target_materialization_data=target,
                severity=dg.AssetCheckSeverity.ERROR,
                description=verdict.reason,
                blocking=True,
                partition=key,
            )
        )


def stage_metadata(cfg: Eagle3Config, key: str) -> dict[dg.AssetKey, dict[str, Any]]:
    """Each stage the store holds for the shard, with the metadata its asset would have reported (timings
    aside), read from its manifest. hidden_states last: what the checks point at is its latest event."""
    layout = StoreLayout(cfg.store_root)
    stages = {conversations.key: step_metadata(conversations_step(cfg, key))}
    if not cfg.regenerate.enabled:
        stages[regenerated.key] = {"skipped": "regenerate.enabled is false"}
    elif layout.regenerated(key).exists():  # written after its manifest: both are there
        manifest = RegeneratedManifest.read(layout.regenerated_manifest(key)).dump()
        figures = {k: v for k, v in manifest.items() if k != "key" and v is not None}
        stages[regenerated.key] = step_metadata(StepResult(key, layout.regenerated(key), figures))
    figures = shard_figures(ShardManifest.read(layout.hidden_states_manifest(key)))
    stages[hidden_states.key] = step_metadata(StepResult(key, layout.hidden_states(key), figures))
    return stages


@dg.sensor(
    name=SENSOR_NAME,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="The store is the truth: adds its shards as partitions of `shards`, and records as "
    "materialized the shards it holds whole (extracted outside Dagster) that the instance does not know, "
    "so that nothing extracts them again.",
)
def store_sensor(context: dg.SensorEvaluationContext, eagle3: Eagle3Resource) -> dg.SensorResult:
    """The cursor: the damaged shards' file identities, so an unchanged damaged file is read once, not every
    tick (a new file under its name, such as a re-extraction, is looked at again)."""
    refused_before = json.loads(context.cursor) if context.cursor else {}
    cfg = eagle3.config()
    report = record_store_shards(context.instance, cfg, TICK_BUDGET_SECONDS, refused_before)
    for key, why in report.refused.items():
        context.log.warning(f"{key} is not recorded: {why}")
    return dg.SensorResult(skip_reason=report.describe(), cursor=json.dumps(report.refused_files))
