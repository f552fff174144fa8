"""Records as eagle3 writes them, for tests that need a finished run (or an evaluation) without training one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from eagle3_core.config import TrainConfig, load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import RunProgress, RunSummary, ServingRecommendation, ShardFacts, StepCosts
from tests.conftest import FIXTURES, write_config


def summary_dict(run: str = "r1") -> dict[str, Any]:
    """final/summary.json as the trainer wrote it before records, key for key, in its order."""
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
        "selection": None,
        "gpu_memory": None,
    }


def write_summary(final: Path, run: str = "r1") -> Path:
    final.mkdir(parents=True, exist_ok=True)
    RunSummary(**summary_dict(run)).write(final / "summary.json")
    return final / "summary.json"


def gate_dict(run: str = "r1", **change: Any) -> dict[str, Any]:
    """A gate decision as `dataclasses.asdict` wrote it before records, in its field order."""
    return {
        "passed": True,
        "k": 3,
        "candidate_run": run,
        "candidate_al": 2.5,
        "current_run": None,
        "current_al": None,
        "tolerance": 0.05,
        "reason": "no drafter is promoted yet",
        "candidate_ci95": [2.25, 2.75],
        "current_ci95": None,
        "difference": None,
        "difference_ci95": None,
        "prompts": 8,
        **change,
    }


def set_dict() -> dict[str, Any]:
    """One prompt set's measurement as the evaluation step writes it (one K, one prompt), key for key."""
    per_prompt = {"al": 2.5, "rounds": 4, "accepted": 6, "speedup": 1.8, "id": "p0", "category": "chat"}
    by_k = {
        "k": 3,
        "rounds": 4,
        "acceptance_length": 2.5,
        "acceptance_rate": 0.5,
        "accept_0": 0.75,
        "accept_1": 0.5,
        "accept_2": 0.25,
        "al_ci95": [2.25, 2.75],
        "per_position": [0.75, 0.5, 0.25],
        "tokens_per_s": 40.0,
        "speedup": 1.8,
        "speedup_statistic": "median over prompts of the per-prompt ratio",
        "per_prompt": [per_prompt],
    }
    return {
        "prompts": 1,
        "device": "cpu",
        "target_tokens_per_s": 22.0,
        "by_k": {"3": by_k},
        "rejected": {"too_long": 0},
        "by_category": {"chat": {"3": {"prompts": 1, "acceptance_length": 2.5, "al_ci95": [2.5, 2.5]}}},
    }


def report_dict(run: str = "r1", export_dir: str = "drafter/export/r1", **gate: Any) -> dict[str, Any]:
    """export/<run>/eval/report-<format>.json as the evaluation step writes it (first written as a dict before
    records; target_step since evaluate.target_step)."""
    return {
        "run": run,
        "export_dir": export_dir,
        "format": "sglang",
        "device": "cpu",
        "dtype": "float32",
        "settings": {"ks": (3,), "max_new_tokens": 64, "temperature": 0.0, "seed": 0, "batch_size": 1},
        "target_step": "eager",
        "tau": {"3": 2.75},
        "primary": "heldout",
        "sets": {"heldout": set_dict()},
        "gate": gate_dict(run, **gate),
        "pictures": {"acceptance": "/s/acceptance-sglang.png", "training_curves": "/s/training_curves.png"},
    }


def trained_run(layout: StoreLayout, target_dir: Path, run: str, seed: int = 0) -> Path:
    """Run `run` finished and made the latest, as training leaves it (final/ and latest.json), with a random
    drafter for the target at `target_dir`: what export and evaluation read, without training one."""
    from eagle3_core.draft.vocab import build_vocab_mapping
    from eagle3_core.export import ExportTarget
    from eagle3_core.store.atomic import atomic_write_json
    from eagle3_core.targets.head import load_target_head
    from eagle3_core.train.run_dir import drafter_state, write_final
    from tests.exports import drafter_config, random_drafter

    target = ExportTarget.from_model_dir(target_dir, (2, 4, 5), "post_norm")
    drafter = random_drafter(drafter_config(target, 64), load_target_head(target_dir).embed, seed=seed)
    shard = _token_shard(layout.root / "vocab-shard")
    mapping = build_vocab_mapping([shard], target.vocab_size, 64, tokenizer_fingerprint="t" * 64)
    summary = RunSummary(
        **{
            **summary_dict(run),
            "drafter_config": drafter.cfg.model_dump(),
            "vocab_mapping": mapping.fingerprint,
        }
    )
    final = write_final(layout.drafter_runs / run, drafter_state(drafter), drafter.cfg, mapping, summary)
    atomic_write_json(layout.drafter_latest, {"run": run, "final": layout.pointer_path(final)})
    return final


def _token_shard(directory: Path) -> Path:
    """A hidden-state shard of one sample, tokens 0..99 each once, all in the loss: what a vocab mapping of
    K <= 100 (the 100 tie, the lowest ids taken) is built from."""
    import torch

    from eagle3_core.store.shards import ShardWriter

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "t-00000.safetensors"
    facts = ShardFacts(tokenizer_fingerprint="t" * 64)
    with ShardWriter(
        path, sample_ids=["s" * 64], lengths=[100], hidden_size=4, store_dtype="float32", facts=facts
    ) as w:
        w.write_sample(
            0,
            torch.arange(100, dtype=torch.int32),
            torch.ones(100, dtype=torch.uint8),
            torch.zeros(100, 12),
            torch.zeros(100, 4),
        )
        w.finalize()
    return path


def evaluated_run(layout: StoreLayout, run: str, seed: int = 0) -> None:
    """Run `run` finished, made the latest, exported (a tiny drafter, tests/exports.py) and evaluated with its
    gate passed, as the steps leave it: what `promote_step` promotes."""
    from eagle3_core.steps.evaluation import report_file
    from eagle3_core.store.atomic import atomic_write_json
    from eagle3_core.store.records import EvalReport
    from tests.exports import write_tiny_export

    final = layout.drafter_runs / run / "final"
    write_summary(final, run)
    atomic_write_json(layout.drafter_latest, {"run": run, "final": layout.pointer_path(final)})
    write_tiny_export(layout.exports / run, seed)
    report = EvalReport(**report_dict(run, layout.pointer_path(layout.exports / run)))
    report.write(report_file(layout.export_eval(run), "sglang"))


# a serving recommendation's acceptance, and step costs that make its K 3 at batch 1 (a forward costs the same
# at any width, a draft is cheap), 1 at batch 16, 0 at batch 64 (every token of width is paid in full)
SERVING_PER_POSITION = [0.8, 0.6, 0.3]
SERVING_COSTS: list[dict[str, Any]] = [
    {"batch_size": 1, "target_s": [0.010, 0.010, 0.010, 0.010], "drafter_s": 0.001},
    {"batch_size": 16, "target_s": [0.02, 0.021, 0.03, 0.04], "drafter_s": 0.002},
    {"batch_size": 64, "target_s": [0.1, 0.2, 0.3, 0.4], "drafter_s": 0.01},
]


def serving_recommendation(
    costs: list[dict[str, Any]] | None = None, per_position: list[float] | None = None, **change: Any
) -> ServingRecommendation:
    """export/<run>/eval/serving-sglang.json as the evaluation writes it, from the acceptance and step costs
    given (SERVING_PER_POSITION and SERVING_COSTS by default); `change` overrides fields."""
    from eagle3_core.evaluate.serving_k import recommend

    per_position = SERVING_PER_POSITION if per_position is None else per_position
    steps = [StepCosts(**c) for c in (SERVING_COSTS if costs is None else costs)]
    fields: dict[str, Any] = {
        "run": "r1", "format": "sglang", "device": "cuda:0", "dtype": "bfloat16", "prompt_set": "heldout",
        "temperature": 0.0, "measured_k": len(per_position), "per_position": per_position, "context_tokens": 128, "repeats": 3,
        "costs": steps, "by_batch": recommend(per_position, steps),
    }  # fmt: skip
    return ServingRecommendation(**{**fields, **change})


def run_progress(tokens: int = 0, steps: int = 3) -> RunProgress:
    """A checkpoint's progress as the trainer records it: an empty log interval of `steps` TTT steps."""
    return RunProgress(
        tokens=tokens,
        interval_sums=[[0.0] * steps for _ in range(4)],
        interval_tokens=0,
        metrics_bytes=0,
        rng_cpu=[0, 1, 255],
    )


def ingest_bad_rows(tmp_path: Path) -> StoreLayout:
    """fixtures/bad_rows.jsonl ingested into a store under tmp_path as dataset t (shard t-00000): what the
    golden files in fixtures/records/ were made from by the dict writers."""
    shutil.copy(FIXTURES / "bad_rows.jsonl", tmp_path / "rows.jsonl")
    config = "store: store\ndata:\n  dataset: t\n  shard_size: 256\n  sources: [{path: rows.jsonl}]\n"
    cfg = load_config(write_config(tmp_path, config))
    ingest(cfg)
    return StoreLayout(cfg.store_root)


def write_shard(root: Path, key: str, *, skip: int = 0, failed: int = 0, dropped: int = 0) -> Path:
    """The hidden-state shard of conversation shard `key`'s training rows, written by the store's own writer as
    extraction would write it (hidden size 4, no model): the first `dropped` are dropped at tokenisation
    (counted), the next `failed` marked failed, the last `skip` lost uncounted."""
    import torch

    from eagle3_core.store.records import ConversationRow, ShardFacts, read_rows
    from eagle3_core.store.shards import ShardWriter

    hidden = 4
    layout = StoreLayout(root)
    rows = read_rows(layout.conversations(key), ConversationRow.model_validate)
    train = [r.id for r in rows if r.split == "train"]
    gone, kept = train[:dropped], train[dropped : len(train) - skip]
    lengths = [3 + i for i in range(len(kept))]
    facts = ShardFacts(tokenizer_fingerprint="a" * 64, dropped=dict.fromkeys(gone, "template: test"))
    with ShardWriter(
        layout.hidden_states(key),
        sample_ids=kept,
        lengths=lengths,
        hidden_size=hidden,
        store_dtype="float32",
        facts=facts,
    ) as w:
        for i, n in enumerate(lengths):
            if i < failed:
                w.mark_failed(i, "test")
                continue
            ids = torch.arange(n, dtype=torch.int32) % 7
            states = torch.randn(n, 3 * hidden), torch.randn(n, hidden)
            w.write_sample(i, ids, torch.ones(n, dtype=torch.uint8), *states)
        w.finalize({"dropped": len(gone)})
    return layout.hidden_states(key)


# A JSON file damaged each way the shared reader (store/atomic.py `read_json_object`) names in one line: the
# bytes written, and what the line must say. Nested past Python's recursion limit, json's parser recurses
# against it and raises RecursionError, which no caller expects.
DEEP = 100_000
DAMAGED_JSON: dict[str, tuple[bytes, str]] = {
    "nested too deeply": (
        b'{"architectures": ["X"], "x": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        "nested too deeply for Python's parser",
    ),
    "not UTF-8": (b'{"architectures": ["\xff"]}', "not UTF-8 text (invalid start byte at byte 20)"),
    "not JSON": (
        b'{"architectures": ["X"],\n "hidden_size": 8,,}',
        "not valid JSON: Expecting property name",
    ),
    "a list": (b'[{"architectures": ["X"]}]', "expected a JSON object, got list"),
}
