"""The statistics of a measurement: AL's bootstrap interval over prompts and the median per-prompt speedup."""

from __future__ import annotations

import math

import pytest

from eagle3_core.evaluate.measure import (
    Measurement,
    PathTiming,
    PromptRun,
    bootstrap_al_interval,
    median_speedup,
)


def _run(accepted: list[int], spec_s: float = 1.0, target_s: float = 1.0, tokens: int = 10) -> PromptRun:
    return PromptRun(tuple(accepted), PathTiming(tokens, spec_s), PathTiming(tokens, target_s))


def test_the_interval_holds_the_pooled_al_and_narrows_with_more_prompts() -> None:
    few = [_run([3, 0, 2]), _run([1, 1]), _run([3, 3, 3]), _run([0, 0, 1, 0])]
    many = few * 25
    pooled = 1 + sum(sum(r.accepted) for r in few) / sum(len(r.accepted) for r in few)
    for runs in (few, many):
        low, high = bootstrap_al_interval(runs)
        assert low <= pooled <= high
    assert (
        bootstrap_al_interval(many)[1] - bootstrap_al_interval(many)[0]
        < (bootstrap_al_interval(few)[1] - bootstrap_al_interval(few)[0]) / 3
    )
    assert bootstrap_al_interval(many) == bootstrap_al_interval(many)  # seeded: one measurement, one interval


def test_identical_prompts_give_a_point_interval() -> None:
    low, high = bootstrap_al_interval([_run([2, 2])] * 10)
    assert low == high == pytest.approx(3.0)


def test_the_interval_resamples_prompts_not_rounds() -> None:
    """One prompt with many short rounds and one with few long ones: resampling rounds would give a narrow
    interval; resampling the two prompts spans from one prompt's AL to the other's."""
    low, high = bootstrap_al_interval([_run([0] * 50), _run([4] * 5)])
    assert low == pytest.approx(1.0) and high == pytest.approx(5.0)


def test_no_prompts_give_no_interval() -> None:
    assert all(math.isnan(x) for x in bootstrap_al_interval([]))


def test_the_speedup_is_the_median_of_per_prompt_ratios() -> None:
    runs = [_run([1], spec_s=2.0), _run([1], spec_s=1.0), _run([1], spec_s=0.5), _run([1], spec_s=0.01)]
    # ratios 0.5, 1, 2, 100: one prompt that a burst of load slowed on the target side does not pull it up
    assert median_speedup(runs) == pytest.approx(1.5)
    untimed = _run([1], spec_s=0.0)
    assert median_speedup([untimed]) != median_speedup([untimed])  # nan: nothing was timed


def test_a_measurement_reports_its_interval_speedup_and_per_prompt_results() -> None:
    runs = {3: [_run([3, 1], spec_s=0.5), _run([0, 0, 2], spec_s=1.0)]}
    by_k = Measurement(prompts=2, runs=runs).k_measurement(3)
    assert by_k.acceptance_length == pytest.approx(1 + 6 / 5)
    assert by_k.al_ci95[0] <= by_k.acceptance_length <= by_k.al_ci95[1]
    assert by_k.speedup == pytest.approx(1.5)  # the median of 2.0 and 1.0
    assert [p.al for p in by_k.per_prompt] == [3.0, pytest.approx(5 / 3, abs=1e-4)]
    assert [p.rounds for p in by_k.per_prompt] == [2, 3]


def test_a_speedup_below_one_on_a_cpu_is_explained_not_printed_bare() -> None:
    from eagle3_cli.steps import speedup_text

    assert speedup_text(1.58, "cuda") == "speedup 1.58x (median over prompts)"
    assert speedup_text(1.2, "cpu") == "speedup 1.20x (median over prompts)"
    explained = speedup_text(0.39, "cpu")
    assert explained.startswith("speedup 0.39x (median over prompts): no speedup is expected on a CPU")
    assert speedup_text(0.9, "cuda") == "speedup 0.90x (median over prompts)"  # on a GPU it is a finding
