"""bench/vs_speculators.py end to end at a tiny size: both trainers on the same samples, both drafters measured.

Tiny: 24 conversations, one epoch, one TTT step, 3 prompts of 8 new tokens; speculators' real trainer runs
in its child process (with the CPU rebinds) and its checkpoint is loaded through eagle3's export loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.vs_speculators import main, parse_args, run
from eagle3_core.errors import Eagle3Error
from tests.conftest import CACHE

pytest.importorskip("speculators.train.trainer")

pytestmark = pytest.mark.slow


def _argv(workdir: Path, results: Path, *extra: str) -> list[str]:
    return [
        "--workdir", str(workdir), "--toy-cache", str(CACHE), "--results", str(results),
        "--chitchat-rows", "300", "--shard-size", "30", "--train-conversations", "24",
        "--holdout-fraction", "0.05", "--heldout-prompts", "3", "--per-conversation", "1",
        "--epochs", "1", "--ttt-steps", "1", "--ks", "1,2", "--max-new-tokens", "8", *extra,
    ]  # fmt: skip


def test_both_trainers_on_the_same_samples_then_an_ablation_reusing_speculators(
    toy_target_dir: Path, tmp_path: Path
) -> None:
    results = tmp_path / "vs.json"
    assert main(_argv(tmp_path / "work", results)) == 0
    report = json.loads(results.read_text())
    data, spec, eagle3 = report["data"], report["speculators"], report["eagle3"]
    # the same samples: speculators' split is eagle3's (its ratio lands exactly on eagle3's training count)
    assert data["train_samples"] + data["val_samples"] == data["samples"] >= 24
    flags = spec["flags"]
    ratio = float(flags[flags.index("--train-data-ratio") + 1])
    assert int(data["samples"] * ratio) == data["train_samples"]
    for flag, value in (("--epochs", "1"), ("--ttt-steps", "1"), ("--total-seq-len", "512")):
        assert flags[flags.index(flag) + 1] == value
    assert eagle3["train_config"]["epochs"] == 1 and eagle3["train_config"]["ttt_steps"] == 1
    assert spec["training"]["steps"] > 0 and eagle3["training"]["steps"] > 0
    assert spec["training"]["tokens"] == eagle3["training"]["tokens"] == data["train_tokens"]
    for k in ("1", "2"):
        row = report["comparison"][k]
        for who in ("eagle3", "speculators"):
            assert len(row[f"{who}_per_position"]) == int(k)
            # AL is 1 + the per-position acceptances, each counted over the same rounds
            assert row[f"{who}_al"] == pytest.approx(1 + sum(row[f"{who}_per_position"]), abs=1e-3)
            # greedy verification in float32: each drafter leaves the target's output as it is
            assert report[who]["measurement"]["by_k"][k]["greedy_mismatches"] == 0
        diff = row["eagle3_minus_speculators"]
        assert diff["difference"] == pytest.approx(row["eagle3_al"] - row["speculators_al"], abs=2e-4)
        assert diff["ci95"][0] <= diff["difference"] <= diff["ci95"][1]
        assert diff["prompts"] == report["eval"]["prompts"] == 3

    # an ablation: speculators' run is reused, eagle3 retrains with the override
    again = run(
        parse_args(_argv(tmp_path / "work", results, "--skip-speculators", "--eagle3-set", "lr=3e-4"))
    )
    assert again["speculators"]["reused"] is True
    assert again["speculators"]["run_dir"] == spec["run_dir"]
    assert again["eagle3"]["train_config"]["lr"] == 3e-4
    assert again["comparison"]["1"]["speculators_al"] == report["comparison"]["1"]["speculators_al"]

    # bench/ablations.py on the same data: one row beside the baseline, paired on the same prompts
    from bench import ablations

    tiny = _argv(tmp_path / "work", tmp_path / "ablations.json")
    tiny = [a for a in tiny if a not in ("--ks", "1,2")]
    assert ablations.main([*tiny, "--ks", "2", "--only", "tuned"]) == 0
    table = json.loads((tmp_path / "ablations.json").read_text())
    assert [r["name"] for r in table["rows"]] == ["baseline", "tuned"]
    base, tuned = table["rows"]
    assert base["vs_reference_k2"]["difference"] == 0 and tuned["overrides"] == ablations.TUNED
    lo, hi = tuned["vs_reference_k2"]["ci95"]
    assert lo <= tuned["vs_reference_k2"]["difference"] <= hi
    assert tuned["steps"] > 0 and len(table["per_prompt"]["tuned"]["2"]) == 3  # each prompt's rounds

    # other inputs have no cached speculators run: refused, not silently trained or reused
    with pytest.raises(Eagle3Error, match="--skip-speculators"):
        run(parse_args(_argv(tmp_path / "work", results, "--skip-speculators", "--ttt-steps", "2")))
