"""bench/real_model.py's bookkeeping: the workers' prompts merged back in order, and the report's pooled AL,
paired differences and seed spread computed from rounds constructed here."""

from __future__ import annotations

import pytest

from bench.real_model import merge_workers, set_sizes, summarise


def test_merge_puts_each_workers_prompts_back_in_order() -> None:
    # worker w decoded prompts w, w + n, ...: 5 prompts over 2 workers
    parts = [
        {"a|0.0|s": {"1": [["p0"], ["p2"], ["p4"]], "mismatches": {"1": 1}}},
        {"a|0.0|s": {"1": [["p1"], ["p3"]], "mismatches": {"1": 2}}},
    ]
    merged = merge_workers(parts, 2, {"s": 5})
    assert merged["a|0.0|s"]["1"] == [["p0"], ["p1"], ["p2"], ["p3"], ["p4"]]
    assert merged["a|0.0|s"]["mismatches"] == {"1": 3}


def test_set_sizes_come_from_the_plan_or_are_counted_from_the_workers_rows() -> None:
    parts = [
        {
            "a|0.0|s": {"1": [["p0"], ["p2"], ["p4"]], "mismatches": {}},
            "a|0.0|t": {"1": [["q0"]], "mismatches": {}},
        },
        {"a|0.0|s": {"1": [["p1"], ["p3"]], "mismatches": {}}, "a|0.0|t": {"1": [["q1"]], "mismatches": {}}},
    ]
    assert set_sizes(parts, {}) == {"s": 5, "t": 2}
    assert set_sizes(parts, {"s": {"prompts": 6}}) == {"s": 6, "t": 2}  # the plan's count wins


def _rows(accepted: list[list[int]], reply_tokens: int) -> list[list[object]]:
    # [accepted per round, spec tokens, spec s, target tokens, target s]
    return [[a, reply_tokens, 1.0, reply_tokens, 2.0] for a in accepted]


def test_summary_pools_rounds_pairs_seeds_and_reports_reply_lengths() -> None:
    runs = {f"{t}-{s}": {"trainer": t, "seed": s} for t in ("eagle3", "speculators") for s in (0, 1)}
    # K=2; eagle3 seed 0 accepts 2 drafts every round, seed 1 one; speculators none and one
    accepted = {"eagle3-0": [2, 2], "eagle3-1": [1, 1], "speculators-0": [0, 0], "speculators-1": [1, 1]}
    decoded = {
        f"{name}|0.0|chat": {"2": _rows([a, a, a], reply_tokens=n), "mismatches": {"2": 0}}
        for name, a in accepted.items()
        for n in [10]
    }
    decoded["eagle3-0|0.0|chat"]["2"][2][3] = 30  # one longer target reply
    report = summarise(decoded, runs, ks=[2])
    row = report["al"]["0.0|chat"]["2"]
    assert row["eagle3-0"]["al"] == 3.0 and row["eagle3-1"]["al"] == 2.0
    assert row["speculators-0"]["al"] == 1.0 and row["speculators-1"]["al"] == 2.0
    assert row["eagle3-0"]["per_position"] == [1.0, 1.0]
    assert row["eagle3-0"]["greedy_mismatches"] == 0
    assert row["eagle3 seed spread"] == 1.0 and row["speculators seed spread"] == 1.0
    pairs = report["eagle3_minus_speculators"]["0.0|chat"]["2"]
    assert pairs["seed 0"]["difference"] == pytest.approx(2.0)
    assert pairs["seed 1"]["difference"] == pytest.approx(0.0)
    assert pairs["seed 0"]["prompts"] == 3
    lengths = report["target_reply_tokens"]["0.0|chat"]
    assert (lengths["min"], lengths["median"], lengths["max"]) == (10, 10, 30)


def test_each_named_recipe_is_paired_with_speculators_of_its_seed() -> None:
    runs = {
        "eagle3-0": {"trainer": "eagle3", "recipe": "eagle3", "seed": 0},
        "eagle3-muon-0": {"trainer": "eagle3", "recipe": "eagle3-muon", "seed": 0},
        "speculators-0": {"trainer": "speculators", "seed": 0},
    }
    accepted = {"eagle3-0": [1, 1], "eagle3-muon-0": [2, 1], "speculators-0": [0, 1]}
    decoded = {
        f"{name}|0.7|chat": {"2": _rows([a, a], reply_tokens=5), "mismatches": {}}
        for name, a in accepted.items()
    }
    pairs = summarise(decoded, runs, ks=[2])["eagle3_minus_speculators"]["0.7|chat"]["2"]
    assert set(pairs) == {"seed 0", "eagle3-muon seed 0"}
    assert pairs["seed 0"]["difference"] == pytest.approx(0.5)  # AL 2.0 against 1.5
    assert pairs["eagle3-muon seed 0"]["difference"] == pytest.approx(1.0)  # AL 2.5 against 1.5
    # a recipe is also paired with eagle3's defaults of its seed (FP8 shards against bf16 ones, say)
    against = summarise(decoded, runs, ks=[2])["recipe_minus_eagle3_defaults"]["0.7|chat"]["2"]
    assert set(against) == {"eagle3-muon seed 0"}
    assert against["eagle3-muon seed 0"]["difference"] == pytest.approx(0.5)  # AL 2.5 against 2.0
