"""bench/real_model.py end to end at a tiny size on the toy target: the data stage through the `eagle3`
commands, eagle3's trainer, its drafter decoded by two worker processes, and the report (speculators' trainer
on the same shards is tests/integration/test_vs_speculators_bench.py's; the pairing of seeds and their spread,
tests/unit/test_real_model_report.py's). The assertions hold whatever the toy says (its replies differ by CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.real_model import main
from eagle3_core.store.shards import ShardReader
from tests.conftest import CACHE

pytestmark = pytest.mark.slow


def test_the_headline_bench_at_a_tiny_size(toy_target_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}?"}) + "\n" for i in range(3)))
    results = tmp_path / "report.json"
    argv = [
        "--stage", "all", "--workdir", str(tmp_path / "work"), "--cache", str(CACHE), "--target", "toy",
        "--chitchat-rows", "80", "--holdout-fraction", "0.1", "--shard-size", "40", "--regen-batch", "8",
        "--regen-max-new-tokens", "8", "--max-len", "256", "--seeds", "0",
        "--eagle3-set", "epochs=1", "--eagle3-set", "ttt_steps=1", "--eagle3-set", "draft_vocab_size=512",
        "--eagle3-set", "al_prompts=2",
        "--skip-speculators", "--prompt-file", str(prompts), "--prompts-per-source", "3",
        "--per-conversation", "1", "--ks", "1,2", "--temperatures", "0,0.7", "--max-new-tokens", "8",
        "--eval-workers", "2", "--target-step", "graphed", "--results", str(results),
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(results.read_text())
    data = report["data"]
    assert set(data["seconds"]) == {"ingest", "regenerate", "extract", "stats"}
    assert data["samples"]["samples"] > 0 and data["samples"]["tokens"] > 0
    runs = report["train"]["runs"]
    assert set(runs) == {"eagle3-0"}
    assert all(r["process_wall_s"] > 0 for r in runs.values())
    # eagle3 at its defaults measures AL during training (its last step at least), on 2 held-out prompts that
    # the evaluation then leaves out, the kept weights having been chosen on them (evaluate.per_conversation
    # 2 there against 1 here: the first prompt of one conversation is in both)
    during = runs["eagle3-0"]["al_during_training"]
    assert during["measured_steps"][-1] == runs["eagle3-0"]["steps"] and len(during["prompt_ids"]) == 2
    assert during["seconds"] > 0 and during["selection"]["kept_step"] in during["measured_steps"]
    assert report["eval"]["prompt_sets"]["heldout"]["measured_during_training"] == 1
    assert report["eval"]["prompt_sets"]["questions"]["prompts"] == 3
    assert report["eval"]["target_step"] == "graphed"  # the engine-like step, run eagerly on a CPU
    # the speedup stage: both target steps, every K, the same greedy output as the target alone
    speedup = report["speedup"]
    assert speedup["prompts"] == 3 and set(speedup["eagle3-0"]) == {"eager", "graphed"}
    for step in ("eager", "graphed"):
        for k in ("1", "2"):
            row = speedup["eagle3-0"][step][k]
            assert (
                row["greedy_mismatches"] == 0 and row["median_speedup"] > 0 and row["target_tokens_per_s"] > 0
            )
    for key in ("0.0|heldout", "0.0|questions", "0.7|heldout", "0.7|questions"):
        for k in ("1", "2"):
            row = report["al"][key][k]
            for name in runs:
                assert row[name]["al"] == pytest.approx(1 + sum(row[name]["per_position"]), abs=1e-3)
                if key.startswith("0.0"):
                    assert row[name]["greedy_mismatches"] == 0  # float32 greedy verification is lossless
        lengths = report["target_reply_tokens"][key]
        assert lengths["max"] <= 8  # the target alone stops at --max-new-tokens

    # a second call finds every stage done and redoes nothing but the evaluation
    record = tmp_path / "work" / "train" / "runs" / "eagle3-0.json"
    before = record.read_text()
    assert main([*argv[:1], "eval", *argv[2:]]) == 0
    assert record.read_text() == before

    # the evaluation in batches (evaluate/batched.py, whose rounds tests/integration/test_batched_specdec.py
    # checks against one prompt at a time in float64): every table filled, greedy replies the target's own
    assert main([*argv[:1], "eval", *argv[2:], "--eval-batch", "2", "--eval-workers", "1"]) == 0
    batched = json.loads(results.read_text())
    assert batched["eval"]["target_step"] == "batched, 2 prompts at once"
    assert set(batched["al"]) == set(report["al"])
    for key in ("0.0|heldout", "0.0|questions"):
        for k in ("1", "2"):
            row = batched["al"][key][k]["eagle3-0"]
            assert row["greedy_mismatches"] == 0
            assert row["al"] == pytest.approx(1 + sum(row["per_position"]), abs=1e-3)
    assert main([*argv[:1], "eval", *argv[2:]]) == 0  # back to one prompt at a time, for what follows

    # --prepare builds what runs started at once share, and trains nothing
    assert main([*argv[:1], "train", *argv[2:], "--prepare", "--seeds", "5"]) == 0
    assert not (tmp_path / "work" / "train" / "runs" / "eagle3-5.json").exists()

    # an evaluation cut short: the report keeps what every worker finished, and only that
    full = json.loads(results.read_text())["al"]
    assert main([*argv[:1], "report", *argv[2:]]) == 0  # every worker finished: the same table, whole
    whole = json.loads(results.read_text())
    assert whole["eval"]["partial"] is False and whole["al"] == full
    worker = tmp_path / "work" / "eval" / "worker-1.json"
    decoded = json.loads(worker.read_text())
    del decoded["eagle3-0|0.7|questions"]  # worker 1 was stopped before its last prompt set
    worker.write_text(json.dumps(decoded))
    assert main([*argv[:1], "report", *argv[2:]]) == 0
    partial = json.loads(results.read_text())
    assert partial["eval"]["partial"] is True
    assert set(partial["al"]) == set(full) - {"0.7|questions"}
    assert all(partial["al"][key] == full[key] for key in partial["al"])

    # FP8 shards beside bf16 ones: --prepare converts a copy of the store (`eagle3 convert-shards`), and a
    # recipe trains on it; a run asking for them before --prepare is refused in one line
    fp8 = [*argv[:1], "train", *argv[2:], "--store-dtype", "fp8_e4m3"]
    assert main([*fp8, "--recipe", "fp8"]) == 2
    assert main([*fp8, "--prepare"]) == 0
    assert main([*fp8, "--recipe", "fp8"]) == 0
    state = json.loads((tmp_path / "work" / "train" / "state.json").read_text())["converted"]["fp8_e4m3"]
    assert state["bytes_after"] < 0.6 * state["bytes_before"]
    for path in state["shards"]:
        with ShardReader(Path(path)) as shard:
            assert shard.meta.store_dtype == "fp8_e4m3" and not shard.verify()
    record = json.loads((tmp_path / "work" / "train" / "runs" / "eagle3-fp8-0.json").read_text())
    assert record["store_dtype"] == "fp8_e4m3" and record["steps"] > 0
    with ShardReader(Path(data["shards"][0])) as shard:
        assert shard.meta.store_dtype != "fp8_e4m3"  # the extracted store is left as it was

    # on-policy refinement of eagle3's run: its rollouts once (--prepare), a recipe trained on them with the
    # offline shards, and the control (the same continued training without records); each is a run the
    # evaluation decodes and pairs with eagle3's defaults
    onpolicy = [*argv[:1], "onpolicy", *argv[2:], "--onpolicy-set", "k=2", "--onpolicy-set", "batch_size=4",
                "--onpolicy-set", "max_new_tokens=8", "--onpolicy-set", "epochs=1"]  # fmt: skip
    assert main([*onpolicy, "--prepare"]) == 0
    assert not (tmp_path / "work" / "train" / "runs" / "eagle3-onpolicy-0.json").exists()
    assert main([*onpolicy, "--recipe", "ew4", "--onpolicy-set", "loss.error_weight=4"]) == 0
    assert main([*onpolicy, "--no-records"]) == 0
    runs = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "work" / "train" / "runs").glob("*.json")}
    refined, control = runs["eagle3-onpolicy-ew4-0"], runs["eagle3-onpolicy-control-0"]
    assert refined["refined_from"] == control["refined_from"] == "eagle3-0"
    assert refined["rollouts"]["samples"] > 0 and refined["rollouts"]["seconds"] > 0
    assert refined["onpolicy"]["loss"]["error_weight"] == 4 and control["rollouts"] is None
    assert main([*argv[:1], "eval", *argv[2:]]) == 0
    paired = json.loads(results.read_text())["recipe_minus_eagle3_defaults"]["0.0|heldout"]["1"]
    assert {"eagle3-onpolicy-ew4 seed 0", "eagle3-onpolicy-control seed 0"} <= set(paired)

    # the evaluation of chosen runs only, and each side's GPU seconds from the stages' own records
    assert main([*argv[:1], "eval", *argv[2:], "--eval-runs", "eagle3-onpolicy-ew4-0"]) == 0
    only = json.loads(results.read_text())
    assert {name for row in only["al"]["0.0|heldout"].values() for name in row} == {"eagle3-onpolicy-ew4-0"}
    seconds = only["gpu_seconds"]
    shared = seconds["shared_data"]
    assert shared == pytest.approx(data["seconds"]["regenerate"] + data["seconds"]["extract"], abs=0.11)
    ew4 = seconds["eagle3-onpolicy-ew4-0"]
    assert (
        ew4["train"] == runs["eagle3-0"]["process_wall_s"]
        and ew4["rollouts"] == refined["rollouts"]["seconds"]
    )
    assert ew4["refine"] == refined["process_wall_s"]
    assert ew4["total"] == pytest.approx(shared + ew4["train"] + ew4["rollouts"] + ew4["refine"], abs=0.11)
    assert main([*argv[:1], "eval", *argv[2:], "--eval-runs", "eagle3-9"]) == 2  # no such run: one line
