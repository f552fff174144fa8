"""The orchestration settings read when the code location loads: which sensor and schedule start running by
default, the inbox sensor's interval, and the nightly cron. Everything else is read at each tick."""

import os
from pathlib import Path

from eagle3_core.config import OrchestrationConfig, load_config
from eagle3_dagster.defs.resources import DEFAULT_CONFIG


def orchestration_settings(config_path: str | Path | None = None) -> OrchestrationConfig:
    """From `config_path`, else $EAGLE3_CONFIG, else eagle3.yaml; the defaults where that file is absent (a
    code location loaded before a project exists still loads). An invalid file is refused, naming the field."""
    path = Path(config_path or os.environ.get("EAGLE3_CONFIG", DEFAULT_CONFIG))
    if not path.exists():
        return OrchestrationConfig()
    return load_config(path).orchestration
