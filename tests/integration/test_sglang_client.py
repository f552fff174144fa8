"""The SGLang benchmark client against a real HTTP server on loopback that answers with recorded responses."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from eagle3_core.engines.sglang_client import SGLangError, benchmark_sglang
from tests.conftest import FIXTURES
from tests.fakes import FakeHandler, FakeHTTPServer, free_port

SPEC = ("generate_spec_length.json", "generate_spec_stop.json", "generate_spec_hard.json")


def load(name: str) -> Any:
    return json.loads((FIXTURES / "sglang" / name).read_text())


@dataclass
class FakeSGLang:
    """What the server answers and what it received. A response is picked by the prompt's length."""

    url: str = ""
    responses: dict[int, Any] = field(default_factory=dict)  # len(input_ids) -> /generate response
    received: list[dict[str, Any]] = field(default_factory=list)  # request bodies, in arrival order
    content_types: list[str] = field(default_factory=list)
    status: int = 200
    error_body: bytes = b""
    delay_s: float = 0.0
    barrier: threading.Barrier | None = None  # set: requests must arrive this many at a time
    default: Any = None  # the answer to a prompt of any other length (its prompt_tokens set to match)
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeSGLangHandler(FakeHandler):
    server: FakeHTTPServer[FakeSGLang]

    def do_POST(self) -> None:
        fake = self.server.state
        body = self.json_body()
        with fake.lock:
            fake.received.append(body)
            fake.content_types.append(self.headers.get("Content-Type", ""))
        if self.path != "/generate":
            return self.reply(404, b'{"detail":"Not Found"}')
        if fake.barrier is not None:
            try:
                fake.barrier.wait()  # the barrier's own timeout
            except threading.BrokenBarrierError:
                return self.reply(500, b"requests did not overlap")
        time.sleep(fake.delay_s)
        if fake.status != 200:
            return self.reply(fake.status, fake.error_body)
        n = len(body["input_ids"])
        response = fake.responses.get(n) or {
            **fake.default,
            "meta_info": {**fake.default["meta_info"], "prompt_tokens": n},
        }
        self.reply(200, response)


@pytest.fixture
def sglang() -> Iterator[FakeSGLang]:
    fake = FakeSGLang(
        responses={load(n)["meta_info"]["prompt_tokens"]: load(n) for n in SPEC}
    )  # 42, 17, 64 tokens
    with FakeHTTPServer(FakeSGLangHandler, fake) as server:
        fake.url = server.url
        yield fake


def prompts(n: int) -> list[list[int]]:
    """n distinct prompts whose lengths cycle through the fixtures' prompt_tokens (42, 17, 64)."""
    lengths = (42, 17, 64)
    return [[1000 * i + j for j in range(lengths[i % 3])] for i in range(n)]


def test_the_client_sends_our_tokens_and_sampling_params_exactly(sglang: FakeSGLang) -> None:
    ps = prompts(3)
    benchmark_sglang(sglang.url + "/", ps, max_new_tokens=128, temperature=0.7)  # a trailing / is fine
    assert sglang.received == [
        {"input_ids": p, "sampling_params": {"temperature": 0.7, "max_new_tokens": 128}} for p in ps
    ]
    assert sglang.content_types == ["application/json"] * 3


def test_acceptance_length_and_throughput_from_the_served_responses(sglang: FakeSGLang) -> None:
    sglang.delay_s = 0.05  # one request at a time: the benchmark lasts at least 3 x 50 ms
    bench = benchmark_sglang(sglang.url, prompts(3), max_new_tokens=128)
    assert [r.completion_tokens for r in bench.results] == [128, 57, 96]
    assert [r.verify_steps for r in bench.results] == [40, 20, 40]
    assert bench.acceptance_length == 2.81  # 281 tokens over 100 verify steps
    assert bench.wall_s >= 0.15
    assert bench.output_tokens_per_s == pytest.approx(281 / bench.wall_s)
    assert bench.output_tokens_per_s <= 281 / 0.15
    meta = bench.as_metadata()
    assert meta["sglang_acceptance_length"] == 2.81 and meta["sglang_completion_tokens"] == 281
    assert meta["sglang_verify_steps"] == 100 and meta["sglang_requests"] == 3
    assert meta["sglang_mean_latency_s"] == 1.2  # the server's e2e_latency, not our wall clock


def test_concurrent_requests_send_every_prompt_exactly_once(sglang: FakeSGLang) -> None:
    sglang.barrier = threading.Barrier(
        3, timeout=10
    )  # a request waits for two others: only overlapping requests pass
    ps = prompts(9)
    bench = benchmark_sglang(sglang.url, ps, max_new_tokens=64, concurrency=3)
    sent = [body["input_ids"] for body in sglang.received]
    assert len(sent) == 9
    assert sorted(map(tuple, sent)) == sorted(map(tuple, ps))
    assert [r.prompt_tokens for r in bench.results] == [len(p) for p in ps]  # results in prompt order
    assert bench.completion_tokens == 3 * 281 and bench.acceptance_length == 2.81
    assert bench.concurrency == 3


def test_one_request_at_a_time_would_not_pass_the_overlap_check(sglang: FakeSGLang) -> None:
    # the check the concurrency test relies on does catch sequential requests
    sglang.barrier = threading.Barrier(2, timeout=0.2)
    with pytest.raises(SGLangError, match=r"HTTP 500.*requests did not overlap"):
        benchmark_sglang(sglang.url, prompts(2), max_new_tokens=64, concurrency=1, timeout_s=30)


def test_a_bad_request_gives_the_status_and_sglangs_message(sglang: FakeSGLang) -> None:
    sglang.status = 400
    sglang.error_body = (FIXTURES / "sglang" / "error_context_length.json").read_bytes()
    with pytest.raises(SGLangError, match=r"HTTP 400 .*Requested token count exceeds the model's maximum"):
        benchmark_sglang(sglang.url, prompts(2), max_new_tokens=256)


def test_a_validation_error_gives_its_message(sglang: FakeSGLang) -> None:
    sglang.status = 400
    sglang.error_body = (FIXTURES / "sglang" / "error_validation.json").read_bytes()
    with pytest.raises(SGLangError, match=r"HTTP 400 .*validation error for GenerateReqInput"):
        benchmark_sglang(sglang.url, prompts(1), max_new_tokens=8)


def test_a_server_crash_gives_the_status_and_body(sglang: FakeSGLang) -> None:
    sglang.status, sglang.error_body = 500, b"Internal Server Error"
    with pytest.raises(SGLangError, match=r"/generate answered HTTP 500 .*: Internal Server Error"):
        benchmark_sglang(sglang.url, prompts(4), max_new_tokens=8, concurrency=2)


def test_a_server_without_speculative_decoding_is_named(sglang: FakeSGLang) -> None:
    sglang.responses = {17: load("generate_no_spec.json")}
    with pytest.raises(SGLangError, match="not running speculative decoding"):
        benchmark_sglang(sglang.url, [list(range(17))], max_new_tokens=64)


def test_only_one_token_answers_cannot_measure_anything(sglang: FakeSGLang) -> None:
    one = load("generate_spec_stop.json")
    one["meta_info"] = {k: v for k, v in one["meta_info"].items() if not k.startswith("spec_")}
    one["meta_info"]["completion_tokens"] = 1
    sglang.responses = {17: one}
    with pytest.raises(SGLangError, match=r"no verify step \(spec_verify_ct\) in any response"):
        benchmark_sglang(sglang.url, [list(range(17))] * 2, max_new_tokens=1)


def test_a_server_that_counts_other_prompt_tokens_is_refused(sglang: FakeSGLang) -> None:
    sglang.responses = {5: load("generate_spec_length.json")}  # says 42 prompt tokens
    with pytest.raises(SGLangError, match="counted 42 prompt tokens for a prompt of 5 input_ids"):
        benchmark_sglang(sglang.url, [[1, 2, 3, 4, 5]], max_new_tokens=128)


def test_an_unreachable_server_names_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # a port that was free a moment ago: nothing listens there
    with pytest.raises(SGLangError, match=rf"server at {url}/generate is unreachable"):
        benchmark_sglang(url, prompts(1), max_new_tokens=8, timeout_s=5)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # unreachable: nothing listens on a port that was free a moment ago
        (
            "http://bench:pw-Xq81secret@127.0.0.1:{port}",
            "server at http://bench:***@127.0.0.1:{port}/generate",
        ),
        # a password with "/" unescaped: httpx cannot parse it, and the message hides it whole
        (
            "http://bench:pw/Xq81secret@127.0.0.1:{port}",
            "http://bench:***@127.0.0.1:{port}/generate is not a URL",
        ),
    ],
)
def test_a_password_in_the_url_is_never_in_the_error(url: str, shown: str) -> None:
    port = free_port()
    with pytest.raises(SGLangError) as err:
        benchmark_sglang(url.format(port=port), prompts(1), max_new_tokens=8, timeout_s=5)
    assert shown.format(port=port) in str(err.value) and "Xq81secret" not in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__  # nor in a traceback's chain


def test_a_server_that_does_not_answer_in_time(sglang: FakeSGLang) -> None:
    sglang.delay_s = 1.0
    with pytest.raises(SGLangError, match=r"did not answer within 0.2 s"):
        benchmark_sglang(sglang.url, prompts(1), max_new_tokens=8, timeout_s=0.2)


def test_bench_sglang_sends_the_held_out_prompts_of_the_store_and_records_the_result(
    sglang: FakeSGLang, tmp_path: Path, toy_target_dir: Path
) -> None:
    from transformers import AutoTokenizer

    from eagle3_core.config import load_config
    from eagle3_core.data.ingest import ingest
    from eagle3_core.evaluate.prompts import encode, heldout_prompts
    from eagle3_core.steps.evaluation import sglang_bench_step
    from tests.conftest import write_config

    config = write_config(
        tmp_path,
        "store: store\ndata: {dataset: t, holdout_fraction: 0.2, sources: [{kind: chitchat, limit: 60}]}\n"
        f"target: {{path: {toy_target_dir}}}\nevaluate: {{max_prompts: 5, max_new_tokens: 64}}\n",
    )
    cfg = load_config(config)
    ingest(cfg)
    sglang.default = load(SPEC[0])
    result = sglang_bench_step(cfg, sglang.url, concurrency=2)
    tokenizer = AutoTokenizer.from_pretrained(toy_target_dir)
    expected = [
        encode(tokenizer, p.messages)
        for p in heldout_prompts(cfg.store_root, per_conversation=2, limit=5).prompts
    ]
    assert len(expected) == 5
    assert sorted(r["input_ids"] for r in sglang.received) == sorted(expected)
    assert all(r["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 64} for r in sglang.received)
    assert result.metadata["heldout_requests"] == 5
    assert result.metadata["heldout_acceptance_length"] == 3.2  # 128 tokens over 40 verify steps, each answer
    assert json.loads(result.path.read_text()) == result.metadata
