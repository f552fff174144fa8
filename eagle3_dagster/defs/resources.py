"""Resources: the run's configuration (the same pydantic config and YAML file as the CLI's) and the target."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr

from eagle3_core.config import Eagle3Config, load_config
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.targets.resolve import target_dir

DEFAULT_CONFIG = "eagle3.yaml"


class Eagle3Resource(dg.ConfigurableResource):
    """Where the run's `eagle3.yaml` is; every asset reads its configuration from there."""

    config_path: str = DEFAULT_CONFIG
    overrides: str = Field(
        default="",
        description="YAML merged over the config file for this run (e.g. 'train: {epochs: 1}'), validated by "
        "the same pydantic model as the CLI's: a bad value fails the run with the field named.",
    )

    def config(self) -> Eagle3Config:
        return load_config(self.config_path, self.overrides)

    def resolved_path(self) -> Path:
        return Path(self.config_path).resolve()


class TargetResource(dg.ConfigurableResource):
    """The target model, loaded once per run on first use and released when the run ends."""

    eagle3: Eagle3Resource
    _target: TransformersTarget | None = PrivateAttr(default=None)

    def get(self, log: Any = None) -> TransformersTarget:
        if self._target is None:
            cfg = self.eagle3.config()
            say = log.info if log is not None else print
            self._target = TransformersTarget(target_dir(cfg, log=say), cfg.target)
        return self._target

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """Give the GPUs back before the run ends, so the next run in the `gpu` pool finds them free."""
        if self._target is not None:
            waited = self._target.close()
            self._target = None
            if context.log is not None:
                context.log.info(f"target released; GPU memory given back after {waited:.1f} s")


def default_resources() -> dict[str, Any]:
    eagle3 = Eagle3Resource(config_path=os.environ.get("EAGLE3_CONFIG", DEFAULT_CONFIG))
    return {"eagle3": eagle3, "target": TargetResource(eagle3=eagle3)}
