"""Records as eagle3 writes them, for tests that need a finished run (or an evaluation) without training one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_core.config import TrainConfig
from eagle3_core.store.records import RunSummary


def summary_dict(run: str = "r1") -> dict[str, Any]:
    """final/summary.json as train/trainer.py `_summary` wrote it before records, key for key, in its order."""
    return {
        "run": run,
        "steps": 4,
        "tokens": 1000,
        "seconds": 1.5,
        "val": {"loss_0": 2.5, "acc_0": 0.5, "full_acc_0": 0.5, "tau_1": 1.5, "counted": 96},
        "drafter_config": {"hidden_size": 16, "num_heads": 4},
        "vocab_mapping": "f" * 64,
        "target_fingerprint": "t" * 64,
        "aux_layer_ids": [2, 4, 5],
        "aux_layer_convention": "input_of_layer",
        "final_state_convention": "post_norm",
        "train_samples": 90,
        "val_samples": 10,
        "world_size": 1,
        "attention": "sdpa",
        "bf16": False,
        "train_config": TrainConfig().model_dump(),
        "warm_from": None,
    }


def write_summary(final: Path, run: str = "r1") -> Path:
    final.mkdir(parents=True, exist_ok=True)
    RunSummary(**summary_dict(run)).write(final / "summary.json")
    return final / "summary.json"
