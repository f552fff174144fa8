"""Which model directory a config means: a Hugging Face directory, or the toy target eagle3 builds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from eagle3_core.config import Eagle3Config


def target_dir(cfg: Eagle3Config, log: Callable[[str], None] = print) -> Path:
    if cfg.target.path == "toy":
        from eagle3_core.toy.build import ensure_toy_target

        return ensure_toy_target(cfg.cache_root, cfg.target.toy.size, cfg.target.toy.seed, log=log)
    path = cfg.resolve(cfg.target.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.path: {path} is not a Hugging Face model directory (no config.json)")
    return path
