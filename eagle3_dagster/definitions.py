"""The Dagster code location: `dagster dev -m eagle3_dagster.definitions` (or workspace.yaml)."""

import dagster as dg

from eagle3_dagster.defs.automation import automation_sensor
from eagle3_dagster.defs.data.assets import conversations, hidden_states, regenerated
from eagle3_dagster.defs.data.checks import SHARD_CHECKS
from eagle3_dagster.defs.data.convert import convert_job
from eagle3_dagster.defs.data.sensors import inbox_sensor
from eagle3_dagster.defs.data.store import store_sensor
from eagle3_dagster.defs.drafter.assets import drafter_checkpoint, drafter_export, vocab_mapping
from eagle3_dagster.defs.drafter.checks import vocab_coverage
from eagle3_dagster.defs.evaluation.assets import drafter_current, drafter_eval, not_worse_than_current
from eagle3_dagster.defs.onpolicy.assets import drafter_refined, onpolicy_records
from eagle3_dagster.defs.resources import default_resources
from eagle3_dagster.defs.schedules import nightly_schedule

defs = dg.Definitions(
    assets=[
        conversations,
        regenerated,
        hidden_states,
        vocab_mapping,
        drafter_checkpoint,
        onpolicy_records,
        drafter_refined,
        drafter_export,
        drafter_eval,
        drafter_current,
    ],
    asset_checks=[*SHARD_CHECKS, vocab_coverage, not_worse_than_current],
    jobs=[convert_job],
    sensors=[automation_sensor, inbox_sensor, store_sensor],
    schedules=[nightly_schedule],
    resources=default_resources(),
)
