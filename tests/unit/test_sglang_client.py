"""Parsing SGLang `/generate` responses and the acceptance-length arithmetic, on hand-written fixtures."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import pytest

from eagle3_core.engines.sglang_client import (
    RequestResult,
    SGLangBenchmark,
    SGLangError,
    benchmark_sglang,
    parse_generate_response,
)
from eagle3_core.errors import Eagle3Error
from tests.conftest import FIXTURES

SPEC = ("generate_spec_length.json", "generate_spec_stop.json", "generate_spec_hard.json")


def load(name: str) -> Any:
    return json.loads((FIXTURES / "sglang" / name).read_text())


def test_a_speculative_response_is_read_field_by_field() -> None:
    r = parse_generate_response(load("generate_spec_length.json"))
    assert r.text.startswith(" Sure. A binary search")
    assert (r.prompt_tokens, r.completion_tokens, r.verify_steps) == (42, 128, 40)
    assert r.latency_s == 1.5 and r.finish_reason == "length"
    assert r.acceptance_length == 3.2  # 128 tokens over 40 verify steps
    assert r.server_accept_length == 3.2 and r.server_accept_rate == 0.725  # 87 of 120 drafts
    assert r.accept_histogram == (4, 6, 9, 21)


def test_the_older_format_has_no_optional_fields() -> None:
    r = parse_generate_response(load("generate_spec_old_format.json"))
    assert (r.completion_tokens, r.verify_steps, r.finish_reason) == (10, 4, "stop")
    assert r.acceptance_length == 2.5
    assert r.server_accept_length is None and r.server_accept_rate is None and r.accept_histogram is None


def test_acceptance_length_is_pooled_over_requests_not_averaged() -> None:
    results = tuple(parse_generate_response(load(name)) for name in SPEC)
    assert [r.acceptance_length for r in results] == [3.2, 2.85, 2.4]
    bench = SGLangBenchmark(results=results, wall_s=2.0, concurrency=2)
    assert (bench.requests, bench.completion_tokens, bench.verify_steps) == (3, 281, 100)
    assert bench.acceptance_length == 2.81  # 281 / 100, while the mean of the ratios is 2.8167
    assert bench.output_tokens_per_s == 140.5  # 281 tokens / 2 s
    assert math.isclose(bench.mean_latency_s, 1.2)  # (1.5 + 0.75 + 1.35) / 3
    assert bench.accept_histogram == (17, 24, 23, 36)
    assert sum(bench.accept_histogram) == bench.verify_steps


def test_metadata_is_rounded() -> None:
    results = tuple(parse_generate_response(load(name)) for name in SPEC)
    meta = SGLangBenchmark(results=results, wall_s=3.0, concurrency=1).as_metadata()
    assert meta == {
        "sglang_requests": 3,
        "sglang_concurrency": 1,
        "sglang_completion_tokens": 281,
        "sglang_verify_steps": 100,
        "sglang_acceptance_length": 2.81,
        "sglang_output_tokens_per_s": 93.67,  # 281 / 3
        "sglang_mean_latency_s": 1.2,
        "sglang_wall_s": 3.0,
    }


def test_pooled_histogram_needs_every_request_to_report_one() -> None:
    results = (
        parse_generate_response(load(SPEC[0])),
        parse_generate_response(load("generate_spec_old_format.json")),
    )
    assert SGLangBenchmark(results=results, wall_s=1.0, concurrency=1).accept_histogram is None


def test_a_server_without_speculative_decoding_is_named() -> None:
    with pytest.raises(
        SGLangError, match=r"not running speculative decoding.*--speculative-algorithm EAGLE3"
    ):
        parse_generate_response(load("generate_no_spec.json"))


def test_zero_verify_steps_for_a_long_answer_is_refused() -> None:
    obj = load("generate_spec_stop.json")
    obj["meta_info"]["spec_verify_ct"] = 0
    with pytest.raises(SGLangError, match=r"spec_verify_ct = 0 for 57 completion tokens"):
        parse_generate_response(obj)


@pytest.mark.parametrize("drop_field", [False, True])
def test_a_one_token_answer_needs_no_verify_step(drop_field: bool) -> None:
    # the prefill forward makes the first token; recent SGLang then leaves spec_verify_ct out altogether
    obj = load("generate_spec_stop.json")
    obj["meta_info"].update(completion_tokens=1, spec_verify_ct=0)
    if drop_field:
        del obj["meta_info"]["spec_verify_ct"]
    r = parse_generate_response(obj)
    assert r.verify_steps == 0 and math.isnan(r.acceptance_length)


@pytest.mark.parametrize("field", ["completion_tokens", "prompt_tokens", "e2e_latency", "finish_reason"])
def test_a_missing_field_is_named(field: str) -> None:
    obj = load("generate_spec_hard.json")
    del obj["meta_info"][field]
    with pytest.raises(SGLangError, match=rf"meta_info\.{field}"):
        parse_generate_response(obj)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("completion_tokens", "96"),
        ("completion_tokens", -1),
        ("spec_verify_ct", 40.0),
        ("spec_verify_ct", True),
        ("prompt_tokens", None),
        ("e2e_latency", "1.35"),
        ("e2e_latency", float("nan")),
        ("finish_reason", "stop"),
    ],
)
def test_a_garbled_field_is_named(field: str, value: object) -> None:
    obj = load("generate_spec_hard.json")
    obj["meta_info"][field] = value
    with pytest.raises(SGLangError, match=rf"meta_info\.{field}"):
        parse_generate_response(obj)


def test_garbled_optional_fields_are_ignored() -> None:
    obj = load("generate_spec_hard.json")
    obj["meta_info"].update(
        spec_accept_length=None, spec_accept_rate="0.45", spec_correct_drafts_histogram={}
    )
    r = parse_generate_response(obj)
    assert r.server_accept_length is None and r.server_accept_rate is None
    assert r.accept_histogram == (10, 13, 9, 8)  # from the older alias spec_accept_histogram
    assert r.acceptance_length == 2.4


def test_an_aborted_request_is_an_error() -> None:
    with pytest.raises(SGLangError, match="aborted the request: Abort in waiting queue"):
        parse_generate_response(load("generate_abort.json"))


@pytest.mark.parametrize("name", ["error_context_length.json", "error_validation.json"])
def test_an_error_body_gives_its_message(name: str) -> None:
    body = load(name)
    message = body["error"]["message"] if "error" in body else body["message"]
    with pytest.raises(SGLangError) as info:
        parse_generate_response(body)
    assert message in str(info.value)


@pytest.mark.parametrize("obj", [[], "text", {"text": "hi"}, {"text": "hi", "meta_info": []}])
def test_a_response_that_is_not_a_generate_answer(obj: object) -> None:
    with pytest.raises(SGLangError, match=r"not a JSON object|no meta_info"):
        parse_generate_response(obj)


def test_sglang_errors_are_user_facing_errors() -> None:
    assert issubclass(SGLangError, Eagle3Error)  # the CLI prints them without a traceback


@pytest.mark.parametrize(
    ("prompts", "kwargs"),
    [
        ([], {}),
        ([[]], {}),
        ([[1, 2.0]], {}),
        ([[1, 2]], {"max_new_tokens": 0}),
        ([[1, 2]], {"concurrency": 0}),
        ([[1, 2]], {"temperature": -0.1}),
        ([[1, 2]], {"timeout_s": 0}),
    ],
)
def test_bad_arguments_are_refused_before_any_request(
    prompts: list[list[Any]], kwargs: dict[str, Any]
) -> None:
    args = {"max_new_tokens": 8} | kwargs
    with pytest.raises(ValueError):
        benchmark_sglang("http://127.0.0.1:9", prompts, **args)  # nothing listens on port 9


def test_request_result_is_immutable() -> None:
    r = parse_generate_response(copy.deepcopy(load(SPEC[0])))
    assert isinstance(r, RequestResult)
    with pytest.raises(AttributeError):
        r.verify_steps = 1  # type: ignore[misc]
