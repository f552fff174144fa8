"""Prompt files, the promotion gate's decision and the evaluation settings, without a model."""

import math
from pathlib import Path

import pytest

from eagle3_core.config import config_from_dict
from eagle3_core.errors import ConfigError, Eagle3Error
from eagle3_core.evaluate.plots import acceptance_bars, markdown_image, training_curves
from eagle3_core.evaluate.prompts import encode, file_prompts
from eagle3_core.evaluation import gate_decision
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


@pytest.mark.parametrize(
    ("candidate", "current", "passed", "reason"),
    [
        (2.1, None, True, "no drafter is promoted yet"),
        (2.1, {"run": "new", "acceptance_length": 9.0}, True, "this run is the promoted one"),
        (2.1, {"run": "old", "acceptance_length": 2.0}, True, ">= the promoted"),
        (1.96, {"run": "old", "acceptance_length": 2.0}, True, ">= the promoted"),  # within the tolerance
        (1.94, {"run": "old", "acceptance_length": 2.0}, False, "below the promoted"),
        (math.nan, None, False, "no verification round"),
        (1.5, {"run": "old", "acceptance_length": None, "reason": "cannot be measured: gone"}, True, "gone"),
    ],
)
def test_the_gate_promotes_unless_the_new_drafter_measured_worse(
    candidate: float, current: dict | None, passed: bool, reason: str
) -> None:
    decision = gate_decision(3, "new", candidate, current, tolerance=0.05)
    assert decision.passed is passed
    assert reason in decision.reason
    assert decision.current_al == (current or {}).get("acceptance_length")


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
    records = [
        {"kind": "train", "step": s, "loss_0": 5 - s / 10, **{f"acc_{k}": 0.1 * s / 10 for k in range(3)}}
        for s in range(1, 11)
    ] + [{"kind": "val", "step": 10, "loss_0": 4.2, "acc_0": 0.5, "acc_1": 0.4, "acc_2": 0.3}]
    curves = training_curves(records, 3, tmp_path / "c.png", "t")
    for path in (bars, curves):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert markdown_image(path, "x").startswith("![x](data:image/png;base64,iVBOR")


def test_without_held_out_conversations_the_first_prompt_file_leads(tmp_path: Path) -> None:
    from eagle3_core.evaluation import _prompt_sets

    cfg = config_from_dict(
        {"store": "store", "evaluate": {"prompt_files": [str(FIXTURES / "prompts.jsonl")]}}, tmp_path
    )
    assert [s.name for s in _prompt_sets(cfg)] == ["prompts"]
    bare = config_from_dict({"store": "store"}, tmp_path)
    with pytest.raises(Eagle3Error, match="no held-out conversations"):
        _prompt_sets(bare)


def test_prompt_sets_keep_distinct_names_and_prompts_too_long_for_a_reply_are_kept_aside(
    tmp_path: Path,
) -> None:
    from eagle3_core.evaluation import _prompt_sets, encode_fitting
    from eagle3_core.toy.tokenizer import train_tokenizer
    from tests.helpers import CORPUS

    copy = tmp_path / "other" / "prompts.jsonl"
    copy.parent.mkdir()
    copy.write_bytes((FIXTURES / "prompts.jsonl").read_bytes())
    files = [str(FIXTURES / "prompts.jsonl"), str(copy)]
    sets = _prompt_sets(config_from_dict({"store": "store", "evaluate": {"prompt_files": files}}, tmp_path))
    assert [s.name for s in sets] == ["prompts", "prompts_2"]

    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    prompts = sets[0]
    lengths = [len(encode(tokenizer, p.messages)) for p in prompts.prompts]
    room = sorted(lengths)[1]  # the two shortest fit
    ids = encode_fitting(tokenizer, prompts, room)
    assert len(ids) == sum(n <= room for n in lengths) and all(len(i) <= room for i in ids)
    too_long = [r for r in prompts.rejected if r["reason"] == "too_long"]
    assert len(too_long) == len(lengths) - len(ids) > 0
    encode_fitting(tokenizer, prompts, room)  # measuring the same set again records nothing twice
    assert len([r for r in prompts.rejected if r["reason"] == "too_long"]) == len(too_long)
