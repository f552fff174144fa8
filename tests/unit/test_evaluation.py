"""Prompt files, the promotion gate's decision and the evaluation settings, without a model."""

import codecs
import math
import os
import random
import warnings
from pathlib import Path
from typing import Any

import pytest

from eagle3_core.config import config_from_dict
from eagle3_core.errors import ConfigError, Eagle3Error
from eagle3_core.evaluate.measure import PathTiming, PromptRun
from eagle3_core.evaluate.plots import acceptance_bars, markdown_image, training_curves
from eagle3_core.evaluate.prompts import encode, file_prompts
from eagle3_core.steps.evaluation import Incumbent, gate_decision
from eagle3_core.store.records import MetricsRow, TrainRow, ValRow
from tests.conftest import FIXTURES


def test_a_prompt_file_in_every_format_keeps_bad_rows_with_their_reason() -> None:
    prompts = file_prompts(FIXTURES / "prompts.jsonl", limit=100)
    assert [p.id for p in prompts.prompts] == [
        "prompts.jsonl:1",
        "prompts.jsonl:2",
        "prompts.jsonl:3",
        "prompts.jsonl:4",
    ]
    mt_bench, plain, with_reply, sharegpt = (p.messages for p in prompts.prompts)
    assert mt_bench == [{"role": "user", "content": "Write a short note to a friend about your weekend."}]
    assert plain == [{"role": "user", "content": "hello how are you today"}]
    # a full conversation is a prompt for its last reply: the trailing assistant turn is dropped
    assert with_reply == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "what did you do this weekend"},
    ]
    assert sharegpt[-1]["role"] == "user"
    assert prompts.reject_counts == {
        "malformed_json": 1,
        "unknown_role": 1,
        "empty_content": 1,
        "wrong_shape": 1,
    }
    assert {r["id"] for r in prompts.rejected} == {f"prompts.jsonl:{n}" for n in (5, 6, 7, 8)}


def test_a_prompt_file_stops_at_the_limit_and_an_unusable_one_is_an_error(tmp_path: Path) -> None:
    assert len(file_prompts(FIXTURES / "prompts.jsonl", limit=2).prompts) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\nnot json\n')
    with pytest.raises(Eagle3Error, match="no usable prompt"):
        file_prompts(bad, limit=10)
    with pytest.raises(Eagle3Error, match="no such prompt file"):
        file_prompts(tmp_path / "missing.jsonl", limit=10)


def test_a_prompt_row_nested_too_deeply_is_one_rejected_row(tmp_path: Path) -> None:
    """json's parser recurses once per nested array: a row of 100,000 `[` was a RecursionError traceback."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "first"}\n' + "[" * 100_000 + '\n{"prompt": "second"}\n')
    prompts = file_prompts(path, limit=10)
    assert [p.id for p in prompts.prompts] == ["prompts.jsonl:1", "prompts.jsonl:3"]
    [rejected] = prompts.rejected
    assert (rejected["id"], rejected["reason"]) == ("prompts.jsonl:2", "malformed_json")
    assert "nested too deeply" in rejected["detail"]


def test_a_prompt_file_whose_name_is_not_utf8_is_named_as_ingest_names_it_and_its_report_reads_back(
    tmp_path: Path,
) -> None:
    """Linux allows any bytes in a file name but "/" and NUL. A prompt file whose name is not UTF-8 is named
    as ingest names such a source (`stored_name`: `\\xNN` per byte), so its set's name and prompt ids are
    JSON-safe and the report holding them is written and read back (it raised UnicodeEncodeError)."""
    from eagle3_core.evaluate.measure import Measurement
    from eagle3_core.steps.evaluation import report_file, set_reports
    from eagle3_core.store.records import DrafterDirReport

    path = tmp_path / os.fsdecode(b"caf\xe9.jsonl")  # Latin-1 bytes, as a file from an old system is named
    path.write_bytes((FIXTURES / "prompts.jsonl").read_bytes())
    prompts = file_prompts(path, limit=100)
    stored = "caf\\xe9.jsonl"
    assert codecs.escape_decode(stored.encode())[0] == b"caf\xe9.jsonl"  # the escape reads back to the bytes
    assert prompts.name == "caf\\xe9"
    ids = [f"{stored}:{n}" for n in (1, 2, 3, 4)]
    assert [p.id for p in prompts.prompts] == ids
    assert {r["id"] for r in prompts.rejected} == {f"{stored}:{n}" for n in (5, 6, 7, 8)}

    fitting = {prompts.name: [(p, [1]) for p in prompts.prompts]}
    measured = {prompts.name: Measurement(len(ids), {3: _runs([2.0, 2.5, 3.0, 1.5])})}
    report = DrafterDirReport(
        run="drafter",
        drafter_dir=str(tmp_path / "drafter"),
        format="sglang",
        aux_layer_ids=[1, 2, 3],
        device="cpu",
        dtype="float32",
        settings={"ks": [3]},
        tau={"3": None},
        primary=prompts.name,
        sets=set_reports([prompts], fitting, measured),
    )
    out = report_file(tmp_path / "eval", "sglang", path)
    report.write(out)
    back = DrafterDirReport.read(out)
    assert back.primary == "caf\\xe9" and list(back.sets) == ["caf\\xe9"]
    assert [p.id for p in back.sets["caf\\xe9"].at(3).per_prompt] == ids
    assert back.sets["caf\\xe9"].rejected == prompts.reject_counts


def _runs(per_prompt_al: list[float], rounds: int = 20, k: int = 3) -> list[PromptRun]:
    """One PromptRun per prompt with `rounds` rounds whose accepted counts give that prompt's AL."""
    runs = []
    for al in per_prompt_al:
        total = round((al - 1) * rounds)
        accepted = [min(k, max(0, total - k * i)) for i in range(rounds)]
        runs.append(PromptRun(tuple(accepted), PathTiming(), PathTiming()))
    return runs


def _prompt_als(seed: int, n: int = 60) -> list[float]:
    """Prompts differ a lot from one another (what a paired comparison cancels)."""
    g = random.Random(seed)
    return [1.5 + 2.0 * g.random() for _ in range(n)]


def test_the_paired_gate_refuses_a_worse_challenger() -> None:
    base = _prompt_als(0)
    decision = gate_decision(3, "new", _runs([a - 0.3 for a in base]), Incumbent("old", _runs(base)), 0.05)
    assert not decision.passed and "below -0.05" in decision.reason
    assert decision.difference == pytest.approx(-0.3, abs=0.02)
    assert decision.difference_ci95 is not None and decision.difference_ci95[1] < 0
    assert decision.candidate_ci95 is not None and decision.current_ci95 is not None


def test_the_paired_gate_promotes_a_better_challenger_and_a_tie_within_tolerance() -> None:
    base = _prompt_als(1)
    better = gate_decision(3, "new", _runs([a + 0.2 for a in base]), Incumbent("old", _runs(base)), 0.05)
    assert better.passed and better.difference_ci95 is not None and better.difference_ci95[0] > 0
    tie = gate_decision(3, "new", _runs(base), Incumbent("old", _runs(base)), 0.05)
    assert tie.passed and tie.difference == 0 and tie.difference_ci95 == [0.0, 0.0]
    # a tie with noise: half the prompts 0.1 better, half 0.1 worse, in random order: the interval straddles 0
    offsets = [0.1, -0.1] * (len(base) // 2)
    random.Random(2).shuffle(offsets)
    noisy = gate_decision(
        3,
        "new",
        _runs([a + o for a, o in zip(base, offsets, strict=True)]),
        Incumbent("old", _runs(base)),
        0.05,
    )
    assert noisy.difference_ci95 is not None
    assert noisy.difference_ci95[0] < 0 < noisy.difference_ci95[1] and noisy.passed


def test_pairing_tells_apart_what_the_two_separate_intervals_cannot() -> None:
    """A challenger 0.1 better on every prompt: the separate intervals overlap, the paired one is above 0."""
    base = _prompt_als(3)
    challenger, incumbent = _runs([a + 0.1 for a in base]), _runs(base)
    decision = gate_decision(3, "new", challenger, Incumbent("old", incumbent), 0.0)
    assert decision.candidate_ci95 is not None and decision.current_ci95 is not None
    assert decision.candidate_ci95[0] < decision.current_ci95[1]  # overlapping
    assert decision.difference_ci95 is not None and decision.difference_ci95[0] > 0 and decision.passed


@pytest.mark.parametrize(
    ("incumbent", "passed", "reason"),
    [
        (None, True, "no drafter is promoted yet"),
        (Incumbent("new", None, "this run is the promoted one"), True, "this run is the promoted one"),
        (Incumbent("old", None, "the promoted drafter cannot be measured: gone"), True, "gone"),
    ],
)
def test_the_gate_without_an_incumbent_to_measure(
    incumbent: Incumbent | None, passed: bool, reason: str
) -> None:
    decision = gate_decision(3, "new", _runs([2.0] * 5), incumbent, tolerance=0.05)
    assert decision.passed is passed and reason in decision.reason and decision.current_al is None


def test_a_candidate_without_rounds_is_refused() -> None:
    empty = [PromptRun((), PathTiming(), PathTiming())]
    decision = gate_decision(3, "new", empty, None, tolerance=0.05)
    assert not decision.passed and "no verification round" in decision.reason
    assert math.isnan(decision.candidate_al)


def test_gate_k_must_be_one_of_the_measured_ks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gate_k"):
        config_from_dict({"evaluate": {"ks": [5, 7], "gate_k": 3}}, tmp_path)
    assert config_from_dict({"evaluate": {"ks": [5], "gate_k": 5}}, tmp_path).evaluate.gate_k == 5


def test_the_pictures_are_png_files_that_markdown_can_inline(tmp_path: Path) -> None:
    bars = acceptance_bars(
        {3: [0.7, 0.5, 0.3], 7: [0.7, 0.5, 0.3, 0.2, 0.1, 0.1, 0.0]},
        {3: 2.5, 7: 2.9},
        tmp_path / "a.png",
        "t",
    )

    def figures(loss: float, acc: list[float]) -> dict[str, Any]:
        return {"step_losses": [loss] * 3, "acc": acc, "full_acc": acc, "tau": [1.5] * 3, "counted": 9}

    timing = {"epoch": 0, "lr": 1e-3, "loss": 1.0, "tokens": 10, "tokens_per_s": 1.0, "elapsed_s": 1.0}
    records: list[MetricsRow] = [
        TrainRow(step=s, **timing, **figures(5 - s / 10, [0.1 * s / 10] * 3)) for s in range(1, 11)
    ]
    records.append(ValRow(step=10, **figures(4.2, [0.5, 0.4, 0.3])))
    curves = training_curves(records, 3, tmp_path / "c.png", "t")
    for path in (bars, curves):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert markdown_image(path, "x").startswith("![x](data:image/png;base64,iVBOR")


def test_a_run_without_rows_draws_a_note_instead_of_an_empty_legend(tmp_path: Path) -> None:
    """A run killed before its first metric row still gets its pictures, saying there is nothing to draw,
    without matplotlib's warning about a legend of nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        curves = training_curves([], 3, tmp_path / "c.png", "t")
        bars = acceptance_bars({}, {}, tmp_path / "a.png", "t")
    for path in (curves, bars):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_held_out_conversations_the_first_prompt_file_leads(tmp_path: Path) -> None:
    from eagle3_core.steps.evaluation import configured_prompt_sets

    cfg = config_from_dict(
        {"store": "store", "evaluate": {"prompt_files": [str(FIXTURES / "prompts.jsonl")]}}, tmp_path
    )
    assert [s.name for s in configured_prompt_sets(cfg)] == ["prompts"]
    bare = config_from_dict({"store": "store"}, tmp_path)
    with pytest.raises(Eagle3Error, match="no conversations to hold out prompts from"):
        configured_prompt_sets(bare)


def test_prompt_sets_keep_distinct_names_and_prompts_too_long_for_a_reply_are_kept_aside(
    tmp_path: Path,
) -> None:
    from eagle3_core.steps.evaluation import configured_prompt_sets, encode_fitting
    from eagle3_core.toy.tokenizer import train_tokenizer
    from tests.helpers import CORPUS

    copy = tmp_path / "other" / "prompts.jsonl"
    copy.parent.mkdir()
    copy.write_bytes((FIXTURES / "prompts.jsonl").read_bytes())
    files = [str(FIXTURES / "prompts.jsonl"), str(copy)]
    sets = configured_prompt_sets(
        config_from_dict({"store": "store", "evaluate": {"prompt_files": files}}, tmp_path)
    )
    assert [s.name for s in sets] == ["prompts", "prompts_2"]

    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    prompts = sets[0]
    lengths = [len(encode(tokenizer, p.messages)) for p in prompts.prompts]
    room = sorted(lengths)[1]  # the two shortest fit
    kept = encode_fitting(tokenizer, prompts, room)
    ids = [i for _, i in kept]
    assert len(ids) == sum(n <= room for n in lengths) and all(len(i) <= room for i in ids)
    assert [p.id for p, _ in kept] == [
        p.id for p, n in zip(prompts.prompts, lengths, strict=True) if n <= room
    ]
    too_long = [r for r in prompts.rejected if r["reason"] == "too_long"]
    assert len(too_long) == len(lengths) - len(ids) > 0
    encode_fitting(tokenizer, prompts, room)  # measuring the same set again records nothing twice
    assert len([r for r in prompts.rejected if r["reason"] == "too_long"]) == len(too_long)


def test_each_prompt_file_of_a_drafter_directory_has_a_report_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`eagle3 eval --drafter DIR --prompts FILE`: measuring another file never overwrites a file's report;
    measuring the same file again (however its path is spelled) replaces only its own."""
    from eagle3_core.steps.evaluation import report_file

    out = tmp_path / "eval"
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    mine = report_file(out, "sglang", Path("prompts.jsonl"))
    assert mine == report_file(out, "sglang", tmp_path / "b" / ".." / "a" / "prompts.jsonl")
    assert mine.parent == out and mine.name.startswith("report-sglang-prompts-")
    others = {
        report_file(out, "sglang"),  # the configured sets: held-out and evaluate.prompt_files
        report_file(out, "speculators", Path("prompts.jsonl")),
        report_file(out, "sglang", tmp_path / "b" / "prompts.jsonl"),  # another file of the same name
        report_file(out, "sglang", Path("mt-bench [v2].jsonl")),
    }
    assert len(others) == 4 and mine not in others
    assert report_file(out, "sglang", Path("mt-bench [v2].jsonl")).name.startswith(
        "report-sglang-mt-bench__v2_-"
    )
