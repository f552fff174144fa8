"""Resources: the run's configuration (the same pydantic config and YAML file as the CLI's), the target, and
the SGLang server a run manages."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr

from eagle3_core.config import Eagle3Config, load_config
from eagle3_core.engines.sglang_server import Purpose, SGLangServer, launch_command
from eagle3_core.store.layout import StoreLayout
from eagle3_core.targets.base import ExtractionTarget
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.targets.resolve import open_extraction_target, target_dir

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
    _extractor: ExtractionTarget | None = PrivateAttr(default=None)  # target.backend sglang_*

    def get(self, log: Any = None) -> TransformersTarget:
        if self._target is None:
            cfg = self.eagle3.config()
            say = log.info if log is not None else print
            self._target = TransformersTarget(target_dir(cfg, log=say), cfg.target)
        return self._target

    def extraction_target(self, log: Any = None) -> ExtractionTarget:
        """What computes the hidden states: the in-process target, or SGLang when `target.backend` says so."""
        cfg = self.eagle3.config()
        if cfg.target.backend.kind == "transformers":
            return self.get(log)
        if self._extractor is None:
            self._extractor = open_extraction_target(cfg, log=log.info if log is not None else print)
        return self._extractor

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        """Give the GPUs back before the run ends, so the next run in the `gpu` pool finds them free."""
        if self._extractor is not None:
            self._extractor.close()
            self._extractor = None
        if self._target is not None:
            waited = self._target.close()
            self._target = None
            if context.log is not None:
                context.log.info(f"target released; GPU memory given back after {waited:.1f} s")


class SGLangServerResource(dg.ConfigurableResource):
    """An SGLang server this run starts (`sglang` section of the config) and always stops.

    Setup reaps a server that a crashed run left on this host (Dagster runs no teardown after SIGKILL; the
    PID file in the store says what was left). Teardown stops this run's server (SIGTERM, SIGKILL after the
    grace period) and waits until its GPU memory is released, failing the run if it is not.
    """

    eagle3: Eagle3Resource
    _server: SGLangServer | None = PrivateAttr(default=None)

    def _make(self, context: dg.InitResourceContext | None) -> SGLangServer:
        cfg = self.eagle3.config()
        log = context.log.info if context is not None and context.log is not None else print
        return SGLangServer(cfg.sglang, StoreLayout(cfg.store_root), log=log)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._server = self._make(context)
        self._server.reap_stale()

    def launch(
        self,
        model_path: str | Path,
        purpose: Purpose,
        drafter_dir: str | Path | None = None,
        aux_layer_ids: Sequence[int] | None = None,
    ) -> str:
        """Start the server for `purpose` (extract or serve) and wait until it is healthy; its URL.

        Extraction with `aux_layer_ids` loads the capture hooks, so the server returns the aux states too."""
        if self._server is None:
            self._server = self._make(None)
        argv = launch_command(
            self.eagle3.config(), model_path, purpose, drafter_dir, aux_layer_ids=aux_layer_ids
        )
        return self._server.launch(argv)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._server is not None:
            self._server.stop()


def default_resources() -> dict[str, Any]:
    eagle3 = Eagle3Resource(config_path=os.environ.get("EAGLE3_CONFIG", DEFAULT_CONFIG))
    return {"eagle3": eagle3, "target": TargetResource(eagle3=eagle3)}
