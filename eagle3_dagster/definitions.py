"""The Dagster code location: `dagster dev -m eagle3_dagster.definitions` (or workspace.yaml)."""

import dagster as dg

from eagle3_dagster.defs.data.assets import conversations, hidden_states, regenerated
from eagle3_dagster.defs.resources import default_resources

defs = dg.Definitions(
    assets=[conversations, regenerated, hidden_states],
    resources=default_resources(),
)
