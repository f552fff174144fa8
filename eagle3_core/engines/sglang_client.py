"""Measured acceptance length and throughput of a drafter served by SGLang (EAGLE-3 speculative decoding).

The client sends held-out prompts, as token ids, to SGLang's native `/generate` endpoint and reads each
response's `meta_info`. With `--speculative-algorithm EAGLE3`, SGLang counts per request:

    completion_tokens   tokens generated
    spec_verify_ct      target verify forwards (one per speculative round)

Every verify step commits the drafts it accepted plus one bonus token (the target's own next token), so

    AL = completion_tokens / spec_verify_ct = (sum over rounds of (accepted + 1)) / rounds = 1 + accepted / rounds

which is docs/design.md's AL (section 6, `acceptance.py`). Like SGLang's own benchmarks, AL is pooled over requests,
sum(completion_tokens) / sum(spec_verify_ct), not a mean of per-request ratios: a long answer weighs as
many rounds as it ran. completion_tokens also counts the token that the prefill forward produces, which
needs no verify step, so a measured AL can exceed a drafter-only count by at most requests / verify steps.

Throughput is total completion tokens over the wall-clock time of the whole benchmark, so it includes
queueing and batching under the chosen concurrency.

Format read from sgl-project/sglang `python/sglang/srt/managers/tokenizer_manager.py` and
`python/sglang/srt/entrypoints/http_server.py` (see tests/fixtures/sglang/README.md for the commits).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeGuard

from eagle3_core.engines import http

_NOT_SPECULATIVE = (
    "the SGLang server is not running speculative decoding: its response has {what}. Start it with "
    "--speculative-algorithm EAGLE3 --speculative-draft-model-path <the exported drafter>"
)


class SGLangError(http.HttpError):
    """The SGLang server could not be reached, refused a request (`status`), or answered in an unexpected shape."""


@dataclass(frozen=True)
class RequestResult:
    """One `/generate` response. The `server_*` fields are SGLang's own figures, absent in older versions."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    verify_steps: int  # meta_info.spec_verify_ct
    latency_s: float  # meta_info.e2e_latency: the server's time from receipt to the last token
    finish_reason: str  # meta_info.finish_reason.type: "length" or "stop"
    server_accept_length: float | None = None  # meta_info.spec_accept_length
    server_accept_rate: float | None = None  # meta_info.spec_accept_rate: accepted / proposed drafts
    accept_histogram: tuple[int, ...] | None = None  # [i] = verify steps that accepted i drafts

    @property
    def acceptance_length(self) -> float:
        return self.completion_tokens / self.verify_steps if self.verify_steps else float("nan")


@dataclass(frozen=True)
class SGLangBenchmark:
    results: tuple[RequestResult, ...]  # in prompt order
    wall_s: float  # the whole benchmark, first request sent to last response read
    concurrency: int

    @property
    def requests(self) -> int:
        return len(self.results)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results)

    @property
    def verify_steps(self) -> int:
        return sum(r.verify_steps for r in self.results)

    @property
    def acceptance_length(self) -> float:
        return self.completion_tokens / self.verify_steps if self.verify_steps else float("nan")

    @property
    def output_tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def mean_latency_s(self) -> float:
        return sum(r.latency_s for r in self.results) / self.requests if self.results else float("nan")

    @property
    def accept_histogram(self) -> tuple[int, ...] | None:
        """Verify steps that accepted i drafts, summed over requests; None unless every request reported one."""
        hists = [r.accept_histogram for r in self.results]
        if not hists or any(h is None for h in hists):
            return None
        width = max(len(h) for h in hists if h is not None)
        return tuple(sum(h[i] for h in hists if h is not None and i < len(h)) for i in range(width))

    def as_metadata(self) -> dict[str, float | int]:
        return {
            "sglang_requests": self.requests,
            "sglang_concurrency": self.concurrency,
            "sglang_completion_tokens": self.completion_tokens,
            "sglang_verify_steps": self.verify_steps,
            "sglang_acceptance_length": round(self.acceptance_length, 4),
            "sglang_output_tokens_per_s": round(self.output_tokens_per_s, 2),
            "sglang_mean_latency_s": round(self.mean_latency_s, 4),
            "sglang_wall_s": round(self.wall_s, 3),
        }


def parse_generate_response(obj: object) -> RequestResult:
    """One non-streaming `/generate` response of a speculative-decoding server; SGLangError if it is not one."""
    if not isinstance(obj, dict):
        raise SGLangError(f"SGLang response is not a JSON object: {http.clip(obj)}")
    if "error" in obj or obj.get("object") == "error":  # SGLang's two error bodies
        raise SGLangError(f"SGLang answered with an error: {http.error_message(obj)}")
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise SGLangError(f"SGLang response has no meta_info object: {http.clip(obj)}")
    finish = _finish_type(meta)
    completion = _int(meta, "completion_tokens")
    verify = _verify_steps(meta, completion)
    text = obj.get("text", "")  # absent when the server runs with --skip-tokenizer-init
    if not isinstance(text, str):
        raise SGLangError(f"SGLang response field text is not a string: {http.clip(text)}")
    return RequestResult(
        text=text,
        prompt_tokens=_int(meta, "prompt_tokens"),
        completion_tokens=completion,
        verify_steps=verify,
        latency_s=_seconds(meta, "e2e_latency"),
        finish_reason=finish,
        server_accept_length=_optional_float(meta, "spec_accept_length"),
        server_accept_rate=_optional_float(meta, "spec_accept_rate"),
        accept_histogram=_optional_histogram(meta),
    )


def benchmark_sglang(
    base_url: str,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    concurrency: int = 1,
    timeout_s: float = 600.0,
) -> SGLangBenchmark:
    """Generate once per prompt (token ids, already chat-templated) with `concurrency` requests in flight."""
    _check_arguments(prompts, max_new_tokens, temperature, concurrency, timeout_s)
    url = base_url.rstrip("/") + "/generate"
    sampling = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(_generate, url, list(p), sampling, timeout_s) for p in prompts]
        try:
            results = tuple(f.result() for f in futures)
        except BaseException:
            for f in futures:  # the first failure ends the benchmark; queued prompts are not sent
                f.cancel()
            raise
    wall = time.perf_counter() - start
    bench = SGLangBenchmark(results=results, wall_s=wall, concurrency=concurrency)
    if bench.verify_steps == 0:
        # possible per request (a one-token answer), but over a whole benchmark it means no speculation
        raise SGLangError(_NOT_SPECULATIVE.format(what="no verify step (spec_verify_ct) in any response"))
    return bench


def _generate(
    url: str, prompt: list[int], sampling: dict[str, float | int], timeout_s: float
) -> RequestResult:
    result = parse_generate_response(
        _post_json(url, {"input_ids": prompt, "sampling_params": sampling}, timeout_s)
    )
    if result.prompt_tokens != len(prompt):
        # the server must score exactly our templated tokens; a different count means it changed the prompt
        raise SGLangError(
            f"SGLang counted {result.prompt_tokens} prompt tokens for a prompt of {len(prompt)} input_ids"
        )
    return result


def _post_json(url: str, body: dict[str, Any], timeout_s: float) -> object:
    return http.request_json("POST", url, body, timeout_s, who="SGLang", error=SGLangError)


def _check_arguments(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float,
    concurrency: int,
    timeout_s: float,
) -> None:
    if not prompts:
        raise ValueError("no prompts to benchmark")
    if any(
        len(p) == 0 or not all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts
    ):
        raise ValueError("every prompt must be a non-empty sequence of token ids (int)")
    if max_new_tokens < 1 or concurrency < 1:
        raise ValueError(
            f"max_new_tokens and concurrency must be >= 1, got {max_new_tokens} and {concurrency}"
        )
    if temperature < 0 or timeout_s <= 0:
        raise ValueError(f"temperature must be >= 0 and timeout_s > 0, got {temperature} and {timeout_s}")


def _finish_type(meta: dict[str, Any]) -> str:
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if not isinstance(finish, dict) or not isinstance(kind, str):
        raise SGLangError(f"SGLang response field meta_info.finish_reason has no type: {http.clip(finish)}")
    if kind == "abort":  # its counts cover a partial answer and would bias AL and throughput
        raise SGLangError(f"SGLang aborted the request: {finish.get('message', '(no message)')}")
    return kind


def _verify_steps(meta: dict[str, Any], completion: int) -> int:
    if "spec_verify_ct" not in meta:
        # Recent SGLang writes spec_* only once a verify step ran; a one-token answer (the prefill's token)
        # has none. Any longer answer without it came from a server that does not speculate.
        if completion <= 1:
            return 0
        raise SGLangError(_NOT_SPECULATIVE.format(what="no meta_info.spec_verify_ct"))
    verify = _int(meta, "spec_verify_ct")
    if verify == 0 and completion > 1:
        raise SGLangError(
            _NOT_SPECULATIVE.format(what=f"spec_verify_ct = 0 for {completion} completion tokens")
        )
    return verify


def _int(meta: dict[str, Any], key: str) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        what = "missing" if key not in meta else f"not a count: {http.clip(value)}"
        raise SGLangError(f"SGLang response field meta_info.{key} is {what}")
    return value


def _seconds(meta: dict[str, Any], key: str) -> float:
    value = meta.get(key)
    if not _is_number(value) or not math.isfinite(value) or value < 0:
        what = "missing" if key not in meta else f"not a duration: {http.clip(value)}"
        raise SGLangError(f"SGLang response field meta_info.{key} is {what}")
    return float(value)


def _optional_float(meta: dict[str, Any], key: str) -> float | None:
    # SGLang's own diagnostics: read when well-formed, never required, never fail a benchmark
    value = meta.get(key)
    return float(value) if _is_number(value) and math.isfinite(value) else None


def _optional_histogram(meta: dict[str, Any]) -> tuple[int, ...] | None:
    # spec_correct_drafts_histogram is the current name, spec_accept_histogram the older alias
    for key in ("spec_correct_drafts_histogram", "spec_accept_histogram"):
        value = meta.get(key)
        if (
            isinstance(value, list)
            and value
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        ):
            return tuple(value)
    return None


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
