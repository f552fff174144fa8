"""The serving recommendation (evaluate/serving_k.py): the K that maximises tokens/s at each batch size, from
acceptance and step costs given here, never from what a model happens to generate or a clock happens to read;
its record, the engines' tables, the costs' timing on a tiny target, and the evaluation's step that writes it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_core.config import config_from_dict
from eagle3_core.errors import ConfigError, RecordError
from eagle3_core.evaluate.serving_k import (
    VLLM_LAST_BATCH_SIZE,
    best_k,
    expected_tokens_per_round,
    k_by_batch_size,
    recommend,
    recommendation_lines,
    recommendation_markdown,
    round_seconds,
    serving_file,
    sglang_adaptive_config,
    sglang_config_file,
    vllm_per_batch_size,
)
from eagle3_core.store.atomic import atomic_write_json
from eagle3_core.store.records import KMeasurement, ServingRecommendation, SetMeasurement, StepCosts

PER_POSITION = [0.8, 0.6, 0.3]  # unconditional: 80% of rounds accept draft 1, 60% drafts 1-2, 30% all three


def costs(batch: int, target_s: list[float], drafter_s: float) -> StepCosts:
    return StepCosts(batch_size=batch, target_s=target_s, drafter_s=drafter_s)


# at batch 1 a forward costs the same at every width (reading the weights dominates) and a draft is cheap; at
# batch 64 every token of width is paid for in full
MEMORY_BOUND = costs(1, [0.010, 0.010, 0.010, 0.010], 0.001)
COMPUTE_BOUND = costs(64, [0.1, 0.2, 0.3, 0.4], 0.01)


def recommendation(
    batches: list[StepCosts], per_position: list[float] | None = None, **change: Any
) -> ServingRecommendation:
    per_position = per_position or PER_POSITION
    fields: dict[str, Any] = {
        "run": "r1",
        "format": "sglang",
        "device": "cpu",
        "dtype": "float32",
        "prompt_set": "heldout",
        "temperature": 0.0,
        "measured_k": len(per_position),
        "per_position": per_position,
        "context_tokens": 128,
        "repeats": 3,
        "costs": batches,
        "by_batch": recommend(per_position, batches),
    }
    return ServingRecommendation(**{**fields, **change})


def test_a_round_commits_one_token_and_the_accepted_drafts() -> None:
    # per_position is unconditional (acceptance.py): E_K adds its first K entries to the target's own token
    assert expected_tokens_per_round(PER_POSITION, 1) == pytest.approx(1.8)
    assert expected_tokens_per_round(PER_POSITION, 3) == pytest.approx(2.7)
    with pytest.raises(
        ValueError, match=re.escape("K=4 needs acceptance at positions 1..4; 3 were measured")
    ):
        expected_tokens_per_round(PER_POSITION, 4)
    # K drafter steps and one verification of width K + 1
    assert round_seconds(COMPUTE_BOUND, 2) == pytest.approx(2 * 0.01 + 0.3)


def test_where_width_is_free_the_longest_draft_pays_most() -> None:
    choice = recommend(PER_POSITION, [MEMORY_BOUND])[0]
    assert choice.plain_tokens_per_s == pytest.approx(100.0)
    # 1.8 / 0.011, 2.4 / 0.012, 2.7 / 0.013 tokens a second
    assert choice.tokens_per_s == pytest.approx([163.636, 200.0, 207.692], abs=1e-3)
    assert choice.k == 3


def test_the_best_k_changes_when_the_drafter_costs_more() -> None:
    dearer = costs(1, MEMORY_BOUND.target_s, 0.004)
    choice = recommend(PER_POSITION, [dearer])[0]
    # 1.8 / 0.014, 2.4 / 0.018, 2.7 / 0.022: the third draft no longer pays for its step
    assert choice.tokens_per_s == pytest.approx([128.571, 133.333, 122.727], abs=1e-3)
    assert choice.k == 2


def test_where_every_token_of_width_is_paid_for_plain_decoding_wins() -> None:
    choice = recommend(PER_POSITION, [COMPUTE_BOUND])[0]
    assert choice.plain_tokens_per_s == pytest.approx(640.0)
    assert choice.tokens_per_s == pytest.approx([64 * 1.8 / 0.21, 64 * 2.4 / 0.32, 64 * 2.7 / 0.43], abs=1e-3)
    assert choice.k == 0


def test_a_drafter_that_is_never_accepted_never_pays() -> None:
    assert recommend([0.0, 0.0, 0.0], [MEMORY_BOUND])[0].k == 0


def test_best_k_prefers_the_shorter_draft_on_a_tie_and_needs_to_beat_plain_decoding() -> None:
    assert best_k(100.0, [150.0, 150.0, 120.0]) == 1
    assert best_k(100.0, [100.0, 90.0]) == 0  # as fast as plain decoding is not faster
    assert best_k(100.0, []) == 0


def test_the_engines_tables_say_the_k_chosen_at_each_batch_size() -> None:
    middle = costs(16, [0.02, 0.021, 0.03, 0.04], 0.002)
    r = recommendation([MEMORY_BOUND, middle, COMPUTE_BOUND])
    assert r.best_k() == {1: 3, 16: 1, 64: 0}
    assert k_by_batch_size(r) == "1:3 16:1 64:0"
    # SGLang 0.5.23: a batch goes to the largest key at or below its size; one candidate pins the K there
    assert sglang_adaptive_config(r) == {
        "1": {"candidate_steps": [3]},
        "16": {"candidate_steps": [1]},
        "64": {"candidate_steps": [0]},
    }
    # vLLM: inclusive ranges from 1, each measured size's K up to the next one's, the last one's beyond it
    assert vllm_per_batch_size(r) == [[1, 15, 3], [16, 63, 1], [64, VLLM_LAST_BATCH_SIZE, 0]]
    assert serving_file(Path("e"), "sglang") == Path("e/serving-sglang.json")
    assert sglang_config_file(Path("e"), "speculators") == Path("e/sglang-adaptive-speculators.json")


def test_the_figures_are_printed_and_tabled_with_what_they_come_from() -> None:
    r = recommendation([MEMORY_BOUND, COMPUTE_BOUND])
    lines = recommendation_lines(r)
    assert lines[0].startswith(
        "from acceptance measured on the heldout prompts (rounds of K=3, temperature 0), step"
    )
    assert (
        lines[1] == "  batch 1: K=3, 207.7 tokens/s against 100.0 plain (2.08x); at K=1..3: 163.6 200.0 207.7"
    )
    assert lines[2].startswith("  batch 64: K=0, 640.0 tokens/s against 640.0 plain (1.00x)")
    table = recommendation_markdown(r)
    assert "| 1 | 3 | 100.0 | 207.7 | 2.08x | 163.6 200.0 207.7 |" in table
    assert "| 64 | 0 | 640.0 | 640.0 | 1.00x |" in table
    unmeasured = recommendation([], costs=[], by_batch=[], unmeasured="evaluate.serving_batch_sizes is empty")
    assert recommendation_markdown(unmeasured) == (
        "No serving recommendation: evaluate.serving_batch_sizes is empty."
    )


def test_the_record_reads_back_as_written(tmp_path: Path) -> None:
    r = recommendation([MEMORY_BOUND, COMPUTE_BOUND])
    path = serving_file(tmp_path, "sglang")
    r.write(path)
    assert ServingRecommendation.read(path) == r
    assert json.loads(path.read_text())["by_batch"][0] == {
        "batch_size": 1,
        "k": 3,
        "plain_tokens_per_s": 100.0,
        "tokens_per_s": [163.636, 200.0, 207.692],
    }


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"by_batch": lambda d: d[1:]}, "by_batch: batch sizes [64] must start at 1 and increase"),
        ({"costs": lambda d: d[:1]}, "costs: batch sizes [1] are not [1, 64]"),
        ({"by_batch": lambda d: [{**d[0], "k": 4}, d[1]]}, "by_batch[0].k: 4 is not in 0..3"),
        ({"costs": lambda d: [{**d[0], "target_s": [0.1]}, d[1]]}, "costs[0].target_s: has 1 widths, not 4"),
        ({"per_position": lambda d: d[:2]}, "per_position: has 2 positions, not measured_k 3"),
        (
            {"costs": lambda d: [{**d[0], "drafter_s": 0}, d[1]]},
            "costs[0].drafter_s: Input should be greater than 0",
        ),
        ({"unmeasured": lambda _: "no target"}, "unmeasured: is set, but costs or by_batch are not empty"),
    ],
)
def test_a_damaged_recommendation_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, change: dict[str, Any], said: str
) -> None:
    data = recommendation([MEMORY_BOUND, COMPUTE_BOUND]).dump()
    ((name, edit),) = change.items()
    data[name] = edit(data[name])
    path = tmp_path / "serving-sglang.json"
    atomic_write_json(path, data)
    with pytest.raises(RecordError) as err:
        ServingRecommendation.read(path)
    assert str(err.value).startswith(f"{path}: {said}") and "\n" not in str(err.value)


@pytest.mark.parametrize("sizes", [[4, 16], [1, 4, 4], [1, 16, 4]])
def test_the_batch_sizes_start_at_one_and_increase(tmp_path: Path, sizes: list[int]) -> None:
    with pytest.raises(ConfigError, match=re.escape("evaluate.serving_batch_sizes")):
        config_from_dict({"store": "s", "evaluate": {"serving_batch_sizes": sizes}}, tmp_path)
    assert config_from_dict({"store": "s", "evaluate": {"serving_batch_sizes": []}}, tmp_path)


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    from eagle3_core.evaluate.plots import serving_curves

    out = serving_curves(recommendation([MEMORY_BOUND, COMPUTE_BOUND]), tmp_path / "serving.png", "t")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_the_eval_page_shows_the_table_and_the_plot(tmp_path: Path) -> None:
    import dagster as dg

    from eagle3_core.evaluate.plots import serving_curves
    from eagle3_core.steps.common import StepResult
    from eagle3_core.store.records import EvalReport
    from eagle3_dagster.defs.metadata import eval_metadata
    from tests.records import report_dict

    r = recommendation([MEMORY_BOUND, COMPUTE_BOUND])
    pictures = {name: tmp_path / f"{name}.png" for name in ("acceptance", "training_curves")}
    for picture in pictures.values():
        picture.write_bytes(b"\x89PNG")
    pictures["serving"] = serving_curves(r, tmp_path / "serving.png", "t")
    report = EvalReport(**{**report_dict(), "pictures": {k: str(v) for k, v in pictures.items()}})
    meta = eval_metadata(StepResult("drafter_eval", tmp_path, {}, record=report, extra_records=(r,)))
    assert isinstance(meta["serving_k"], dg.MarkdownMetadataValue)
    assert "| 1 | 3 | 100.0 | 207.7 | 2.08x |" in meta["serving_k"].md_str
    assert meta["serving_plot"].md_str.startswith(
        "![tokens/s at each K and batch size](data:image/png;base64,"
    )
    # an evaluation without one (a drafter directory's) shows neither
    plain = eval_metadata(StepResult("drafter_eval", tmp_path, {}, record=report))
    assert "serving_k" not in plain and "serving_plot" not in plain


# ---- measured costs, and the evaluation's step ----------------------------------------------------------------
def tiny_target_and_drafter() -> tuple[Any, Any]:
    from tests.helpers import random_drafter, tiny_family_model

    return tiny_family_model("llama"), random_drafter(torch.arange(64), seed=0)[0]


def test_the_costs_are_timed_at_each_batch_size_and_width() -> None:
    from eagle3_core.evaluate.step_costs import measure_step_costs

    model, drafter = tiny_target_and_drafter()
    said: list[str] = []
    measured = measure_step_costs(model, drafter, (1, 2, 3), [1, 3], 2, 16, 2, said.append)
    assert [c.batch_size for c in measured] == [1, 3]
    assert all(len(c.target_s) == 3 and min(c.target_s) > 0 and c.drafter_s > 0 for c in measured)
    assert said[0].startswith("step costs at batch 1: target ") and "ms at width 1..3, drafter" in said[0]


def measured_set(per_position: list[float], rounds: int = 10) -> SetMeasurement:
    at_k = KMeasurement(
        k=len(per_position), rounds=rounds, acceptance_length=1 + sum(per_position), acceptance_rate=0.5,
        al_ci95=[1.0, 3.0], per_position=per_position, tokens_per_s=1.0, speedup=1.0,
        speedup_statistic="median", per_prompt=[],
    )  # fmt: skip
    return SetMeasurement(prompts=2, device="cpu", target_tokens_per_s=1.0, by_k={"3": at_k}, rejected={})


def test_the_evaluation_recommends_from_its_acceptance_and_the_costs_it_timed(tmp_path: Path) -> None:
    from eagle3_core.steps.evaluation import Target, serving_metadata, serving_recommendation, write_serving

    model, drafter = tiny_target_and_drafter()
    evaluate = {"ks": [1, 3], "gate_k": 3, "serving_batch_sizes": [1, 2], "serving_repeats": 1}
    cfg = config_from_dict({"store": "s", "evaluate": evaluate}, tmp_path)
    target = Target(model, None, (1, 2, 3), set())
    r = serving_recommendation(
        cfg, "r1", target, drafter, "heldout", measured_set(PER_POSITION), lambda _: None
    )
    assert r.unmeasured is None and (r.measured_k, r.per_position, r.dtype) == (3, PER_POSITION, "float64")
    assert [c.batch_size for c in r.costs] == [1, 2] and all(len(c.target_s) == 4 for c in r.costs)
    assert r.by_batch == recommend(
        PER_POSITION, r.costs
    )  # the K from the costs it measured, as the maths says
    write_serving(tmp_path, r)
    assert ServingRecommendation.read(serving_file(tmp_path, "sglang")) == r
    assert json.loads(sglang_config_file(tmp_path, "sglang").read_text()) == sglang_adaptive_config(r)
    assert serving_metadata(r) == {"serving_k_b1": r.by_batch[0].k, "serving_k_b2": r.by_batch[1].k}

    # nothing to time the costs with: said in one line, and no SGLang table is left behind
    model.config.model_type = "gemma"  # a family the batched step does not compute
    unmeasured = serving_recommendation(
        cfg, "r1", target, drafter, "heldout", measured_set(PER_POSITION), lambda _: None
    )
    assert "does not compute this one" in (unmeasured.unmeasured or "") and "model_type 'gemma'" in (
        unmeasured.unmeasured or ""
    )
    write_serving(tmp_path, unmeasured)
    assert not sglang_config_file(tmp_path, "sglang").exists()
    assert serving_metadata(unmeasured)["serving"].startswith("not measured: the step costs are timed")
    no_rounds = serving_recommendation(
        cfg, "r1", target, drafter, "heldout", measured_set(PER_POSITION, rounds=0), lambda _: None
    )
    assert no_rounds.unmeasured == "no verification round was measured at K=3 on the heldout prompts"
    off = cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"serving_batch_sizes": []})})
    none = serving_recommendation(off, "r1", target, drafter, "heldout", measured_set(PER_POSITION), print)
    assert none.unmeasured == "evaluate.serving_batch_sizes is empty" and none.costs == []
