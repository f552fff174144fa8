"""The OpenAI-compatible regeneration client against a small real HTTP server on 127.0.0.1.

The server is scripted per request (status, delay, reply), so retries, backoff, timeouts, non-retryable
errors, concurrency, the journal and resume are each exercised over real sockets.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from transformers import AutoTokenizer

from eagle3_core.config import RegenerateConfig, RegenerateServerConfig, config_from_dict
from eagle3_core.engines.openai_client import (
    ChatClient,
    RequestFailed,
    ServerRegenerationFailed,
    ServerRegenerator,
    backoff_delay,
    completions_endpoint,
)
from eagle3_core.errors import ConfigError
from eagle3_core.store.journal import RegenerationJournal, journal_fingerprint, journal_path
from eagle3_core.store.records import (
    ConversationRow,
    JournalEntry,
    RegeneratedRow,
    RegenerationError,
    reply_id,
)
from eagle3_core.targets.regenerate import request_seed
from tests.fakes import FakeHandler, FakeHTTPServer, free_port

SYSTEM = {"role": "system", "content": "be brief"}
Reply = tuple[int, Any, float, dict[str, str]]  # status, JSON body (or text), delay before answering, headers


def completion(content: str, finish: str = "stop", tokens: int | None = 5) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": "x",
        "object": "chat.completion",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}
        ],
    }
    if tokens is not None:
        out["usage"] = {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}
    return out


def echo(body: dict[str, Any]) -> Reply:
    """A reply naming the user turn it answers, so tests can tell which prompt got which answer."""
    return 200, completion(f"re: {body['messages'][-1]['content']}"), 0.0, {}


@dataclass
class FakeServer:
    script: Callable[[dict[str, Any], int], Reply] = lambda body, _n: echo(body)
    url: str = ""
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeChatHandler(FakeHandler):
    server: FakeHTTPServer[FakeServer]

    def do_POST(self) -> None:
        fake = self.server.state
        body = self.json_body()
        with fake.lock:
            fake.received.append(body)
            fake.headers.append(dict(self.headers))
            n = len(fake.received)
            fake.in_flight += 1
            fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
        try:
            if self.path != "/v1/chat/completions":
                return self.reply(404, {"detail": "Not Found"})
            status, payload, delay, headers = fake.script(body, n)
            time.sleep(delay)
            self.reply(status, payload, headers)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout under test)
            pass
        finally:
            with fake.lock:
                fake.in_flight -= 1


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    state = FakeServer()
    with FakeHTTPServer(FakeChatHandler, state) as server:
        state.url = server.url
        yield state


@pytest.fixture(scope="module")
def tokenizer(toy_target_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(toy_target_dir)


def server_cfg(url: str, **kw: Any) -> RegenerateServerConfig:
    defaults: dict[str, Any] = {
        "url": url,
        "concurrency": 4,
        "timeout_s": 5.0,
        "retries": 2,
        "backoff_s": 0.01,
    }
    return RegenerateServerConfig(**{**defaults, **kw})


def regen_cfg(url: str, server: dict[str, Any] | None = None, **kw: Any) -> RegenerateConfig:
    return RegenerateConfig(max_new_tokens=8, server=server_cfg(url, **(server or {})), **kw)


def samples(
    n: int, users: int = 1, edit: Callable[[list[dict[str, Any]]], object] = lambda _: None
) -> list[ConversationRow]:
    """`n` training conversations as a conversation shard holds them; `edit` changes their dicts first."""
    rows: list[dict[str, Any]] = [
        {
            "id": f"id-{i:02d}",
            "split": "train",
            "messages": [
                m
                for u in range(users)
                for m in (
                    {"role": "user", "content": f"user {i} turn {u}"},
                    {"role": "assistant", "content": "original"},
                )
            ],
            "source": {"file": "s.jsonl", "line": i + 1},
        }
        for i in range(n)
    ]
    edit(rows)
    return [ConversationRow.model_validate(row) for row in rows]


def complete(cfg: RegenerateServerConfig, body: dict[str, Any] | None = None) -> tuple[Any, int]:
    async def run() -> tuple[Any, int]:
        async with ChatClient(cfg) as client:
            reply = await client.complete(body or {"messages": [{"role": "user", "content": "hi"}]})
            return reply, client.retried

    return asyncio.run(run())


# ---- the client --------------------------------------------------------------------------------------------
def test_503_twice_then_200_is_retried_with_backoff(fake: FakeServer) -> None:
    fake.script = lambda body, n: (503, {"error": "busy"}, 0.0, {}) if n <= 2 else echo(body)
    started = time.perf_counter()
    reply, retried = complete(server_cfg(fake.url, backoff_s=0.1, retries=3))
    elapsed = time.perf_counter() - started
    assert reply.content == "re: hi" and reply.attempts == 3 and retried == 2
    assert len(fake.received) == 3
    assert elapsed >= 0.05 + 0.1  # two backoffs: >= 50% of 0.1 and of 0.2


def test_400_fails_at_once_without_retry(fake: FakeServer) -> None:
    fake.script = lambda body, n: (400, {"detail": "prompt too long"}, 0.0, {})
    with pytest.raises(RequestFailed) as err:
        complete(server_cfg(fake.url, retries=5))
    assert err.value.attempts == 1 and len(fake.received) == 1
    assert "HTTP 400" in err.value.reason and "prompt too long" in err.value.reason


def test_retries_spent_names_the_last_error(fake: FakeServer) -> None:
    fake.script = lambda body, n: (500, {"detail": "boom"}, 0.0, {})
    with pytest.raises(RequestFailed) as err:
        complete(server_cfg(fake.url, retries=2))
    assert len(fake.received) == 3
    assert "HTTP 500" in err.value.reason and "after 3 attempts" in err.value.reason


def test_a_timeout_is_retried_then_fails(fake: FakeServer) -> None:
    fake.script = lambda body, n: (*echo(body)[:2], 2.0, {})
    started = time.perf_counter()
    with pytest.raises(RequestFailed) as err:
        complete(server_cfg(fake.url, timeout_s=0.3, retries=1))
    assert time.perf_counter() - started < 1.5  # never waited for the 2 s answers
    assert err.value.reason == "timeout after 0.3 s (after 2 attempts)"


def test_a_slow_first_answer_times_out_and_the_retry_succeeds(fake: FakeServer) -> None:
    fake.script = lambda body, n: (*echo(body)[:2], 2.0 if n == 1 else 0.0, {})
    reply, retried = complete(server_cfg(fake.url, timeout_s=0.3, retries=1))
    assert reply.content == "re: hi" and retried == 1


def test_connection_refused_is_retried_then_fails() -> None:
    port = free_port()  # a port nothing listens on
    with pytest.raises(RequestFailed) as err:
        complete(server_cfg(f"http://127.0.0.1:{port}", retries=2))
    assert err.value.attempts == 3 and "ConnectError" in err.value.reason


def test_429_waits_at_least_retry_after(fake: FakeServer) -> None:
    fake.script = lambda body, n: (
        (429, {"error": "slow down"}, 0.0, {"Retry-After": "0.4"}) if n == 1 else echo(body)
    )
    started = time.perf_counter()
    reply, _ = complete(server_cfg(fake.url, backoff_s=0.0))
    assert reply.content == "re: hi" and time.perf_counter() - started >= 0.4


def test_backoff_is_exponential_jittered_and_capped() -> None:
    for retry in range(4):
        d = backoff_delay(1.0, retry)
        assert 0.5 * 2**retry <= d <= 2**retry
    assert backoff_delay(1.0, 20) == 60.0
    assert backoff_delay(0.0, 0, retry_after_s=3.0) == 3.0


def test_a_malformed_answer_fails_without_retry(fake: FakeServer) -> None:
    fake.script = lambda body, n: (200, {"unexpected": True}, 0.0, {})
    with pytest.raises(RequestFailed) as err:
        complete(server_cfg(fake.url))
    assert "not a chat completion" in err.value.reason and len(fake.received) == 1


def test_api_key_is_sent_from_the_named_variable(fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_TEST_KEY", "sekrit")
    complete(server_cfg(fake.url, api_key_env="EAGLE3_TEST_KEY"))
    assert fake.headers[0]["Authorization"] == "Bearer sekrit"
    monkeypatch.delenv("EAGLE3_TEST_KEY")
    with pytest.raises(ConfigError, match="EAGLE3_TEST_KEY is not set"):
        complete(server_cfg(fake.url, api_key_env="EAGLE3_TEST_KEY"))


SECRET = "sk-live/Zq9+eagle3=key"  # with characters that JSON encoders and URL quoting change


def test_a_key_the_server_echoes_is_in_no_reason_and_no_reply(
    fake: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 401 quoting the key back as `Bearer <key>`, with `/` escaped as some JSON encoders write it, and
    URL-quoted; one quoting it across the reason's clip at 300 characters; a 200 whose reply holds it."""
    monkeypatch.setenv("EAGLE3_TEST_KEY", SECRET)
    cfg = server_cfg(fake.url, api_key_env="EAGLE3_TEST_KEY", retries=0)
    forms = f"Bearer {SECRET}, {SECRET.replace('/', chr(92) + '/')}, {quote(SECRET, safe='')}"
    raw = '{"error": {"message": "bad key: ' + forms + '"}}'  # as that encoder wrote it, `\\/` and all
    fake.script = lambda body, n: (401, raw, 0.0, {})
    with pytest.raises(RequestFailed) as err:
        complete(cfg)
    assert fake.headers[0]["Authorization"] == f"Bearer {SECRET}"  # sent as it is
    assert err.value.reason == (
        'HTTP 401: {"error": {"message": "bad key: Bearer [redacted api key], [redacted api key], '
        '[redacted api key]"}}'
    )
    # the clip would have kept the key's first characters, had the key not been taken out first
    fake.script = lambda body, n: (401, {"error": {"message": f"{'x' * 260}Bearer {SECRET}"}}, 0.0, {})
    with pytest.raises(RequestFailed) as err:
        complete(cfg)
    assert err.value.reason.endswith("Bearer [redacted") and SECRET[:8] not in err.value.reason
    fake.script = lambda body, n: (200, completion(f"the key is {SECRET}"), 0.0, {})
    reply, _ = complete(cfg)
    assert reply.content == "the key is [redacted api key]"


@pytest.mark.parametrize("value", [f"{SECRET}\n", f"{SECRET} ", f"{SECRET}é"])
def test_a_key_no_header_can_carry_is_refused_without_showing_it(
    fake: FakeServer, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("EAGLE3_TEST_KEY", value)
    with pytest.raises(
        ConfigError, match=r"api_key_env: the environment variable EAGLE3_TEST_KEY holds"
    ) as err:
        complete(server_cfg(fake.url, api_key_env="EAGLE3_TEST_KEY"))
    assert "Zq9" not in str(err.value) and fake.received == []


def test_the_api_key_is_masked_wherever_it_is_printed() -> None:
    from eagle3_core.engines import http

    key = http.ApiKey(SECRET)
    assert "Zq9" not in repr(key) + str(key)
    client = http.async_client(1.0, 1, key)
    assert "Zq9" not in repr(dict(client.headers))  # set per request, not one of the client's headers
    asyncio.run(client.aclose())


@pytest.mark.parametrize(
    ("server", "field"),
    [
        ({"api_key": SECRET}, "regenerate.server.api_key"),  # the key where no field takes it
        ({"api_key_env": SECRET}, "regenerate.server.api_key_env"),  # the key where its variable's name goes
        ({"apikey": SECRET, "concurrency": 0}, "regenerate.server.apikey"),
    ],
)
def test_a_key_written_in_the_config_is_refused_and_never_echoed(server: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"regenerate": {"server": {"url": "http://h:1", **server}}}, Path("."))
    assert f"{field}: " in str(err.value) and "not shown" in str(err.value)
    assert "Zq9" not in str(err.value)


def test_endpoint_and_config() -> None:
    assert completions_endpoint("http://h:1") == "http://h:1/v1/chat/completions"
    assert completions_endpoint("http://h:1/v1/") == "http://h:1/v1/chat/completions"
    cfg = config_from_dict(
        {"regenerate": {"server": {"url": "http://127.0.0.1:30000", "concurrency": 8}}}, Path(".")
    )
    assert cfg.regenerate.server is not None and cfg.regenerate.server.concurrency == 8
    assert RegenerateConfig().server is None  # in process by default
    with pytest.raises(ConfigError, match=r"regenerate\.server\.url"):
        config_from_dict({"regenerate": {"server": {"url": "127.0.0.1:30000"}}}, Path("."))
    with pytest.raises(ConfigError, match=r"regenerate\.server\.concurency"):
        config_from_dict({"regenerate": {"server": {"url": "http://h:1", "concurency": 8}}}, Path("."))


# ---- regeneration ------------------------------------------------------------------------------------------
def test_each_turn_sees_the_conversation_so_far_as_in_process(fake: FakeServer, tokenizer: Any) -> None:
    def script(body: dict[str, Any], n: int) -> Reply:
        user = body["messages"][-1]["content"]
        if user.endswith("turn 1"):
            return 200, completion(f"  second\r\nreply to {user} ", finish="length", tokens=8), 0.0, {}
        return 200, completion(f"first reply to {user}", tokens=5), 0.0, {}

    fake.script = script
    convs = samples(2, users=2, edit=lambda rows: rows[0]["messages"].insert(0, SYSTEM))
    cfg = regen_cfg(fake.url, server={"model": "served-name"}, seed=7)
    result = ServerRegenerator(tokenizer, cfg, 256).regenerate(convs)

    first = next(b for b in fake.received if b["messages"][-1]["content"] == "user 0 turn 1")
    assert first["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "user 0 turn 0"},
        {"role": "assistant", "content": "first reply to user 0 turn 0"},  # the server's own reply
        {"role": "user", "content": "user 0 turn 1"},
    ]
    assert first["max_tokens"] == 8 and first["temperature"] == 0.0 and first["model"] == "served-name"
    assert "top_p" not in first  # greedy: top_p shapes nothing, as in process
    assert len({b["seed"] for b in fake.received}) == 4  # one seed per (sample, turn)
    assert [r.id for r in result.rows] == ["id-00", "id-01"]
    assert result.rows[0].dump() == {
        "id": "id-00",
        "source": {"file": "s.jsonl", "line": 1},
        "turns_regenerated": 2,
        "messages": first["messages"]
        + [{"role": "assistant", "content": "second\nreply to user 0 turn 1"}],  # normalised, as in process
        "stop": "complete",
        "finish_reasons": ["stop", "length"],  # the second came back cut: marked, not closed as finished
    }
    assert result.counts == {"replies": 4, "replies_cut_at_max_new_tokens": 2}
    assert result.new_tokens == 2 * (
        4 + 8
    )  # the end-of-turn token a server counts on "stop" is not a reply's


def test_empty_reply_and_context_limit_end_as_in_process(fake: FakeServer, tokenizer: Any) -> None:
    fake.script = lambda body, n: (200, completion("   "), 0.0, {})
    result = ServerRegenerator(tokenizer, regen_cfg(fake.url), 256).regenerate(samples(1))
    [row] = result.rows
    assert isinstance(row, RegenerationError) and row.error == "empty_reply" and row.messages == []
    assert result.counts == {"errors": 1, "stopped_empty_reply": 1}

    fake.received.clear()
    long = samples(1, edit=lambda rows: rows[0]["messages"][0].update(content="word " * 300))
    result = ServerRegenerator(tokenizer, regen_cfg(fake.url), 64).regenerate(long)
    [row] = result.rows
    assert isinstance(row, RegenerationError) and row.error == "context_limit"
    assert fake.received == []  # never sent


def test_a_400_is_an_error_row_with_its_reason(fake: FakeServer, tokenizer: Any) -> None:
    fake.script = lambda body, n: (
        (400, {"detail": "bad prompt"}, 0.0, {})
        if "user 1 " in body["messages"][-1]["content"]
        else echo(body)
    )
    cfg = regen_cfg(fake.url, server={"max_failed_fraction": 0.5})
    result = ServerRegenerator(tokenizer, cfg, 256).regenerate(samples(3))
    assert [r.id for r in result.rows] == ["id-00", "id-01", "id-02"]
    bad = result.rows[1]
    assert isinstance(bad, RegenerationError)
    assert bad.error.startswith("request_failed: HTTP 400") and "bad prompt" in bad.error
    assert bad.messages == [] and bad.turns_regenerated == 0
    assert result.counts["errors"] == 1 and result.counts["request_errors"] == 1
    assert sum("user 1 " in b["messages"][-1]["content"] for b in fake.received) == 1  # not retried


def test_concurrency_is_bounded(fake: FakeServer, tokenizer: Any) -> None:
    fake.script = lambda body, n: (*echo(body)[:2], 0.1, {})
    ServerRegenerator(tokenizer, regen_cfg(fake.url, server={"concurrency": 3}), 256).regenerate(samples(12))
    assert fake.max_in_flight == 3


def test_failures_past_the_threshold_fail_the_shard_and_a_rerun_requests_only_the_rest(
    fake: FakeServer, tokenizer: Any, tmp_path: Path
) -> None:
    healthy = threading.Event()

    def script(body: dict[str, Any], n: int) -> Reply:
        user = body["messages"][-1]["content"]
        if not healthy.is_set() and user.startswith(("user 3 ", "user 4 ")):
            return 503, {"error": "down"}, 0.0, {}
        return (*echo(body)[:2], 0.02, {})

    fake.script = script
    convs = samples(10, users=2)
    cfg = regen_cfg(fake.url, server={"concurrency": 2, "retries": 1, "max_failed_fraction": 0.0})
    fp = journal_fingerprint(cfg, 256, "tok", [s.id for s in convs], model=None)
    path = journal_path(tmp_path / "r-00000.jsonl")
    with pytest.raises(ServerRegenerationFailed, match=r"1 of 10 samples failed .*HTTP 503.*run again"):
        ServerRegenerator(tokenizer, cfg, 256).regenerate(convs, RegenerationJournal(path, fp))
    journaled = [json.loads(line)["id"] for line in path.read_text().splitlines()[1:]]
    assert "id-03" not in journaled and len(journaled) == len(set(journaled)) >= 2

    healthy.set()
    fake.received.clear()
    result = ServerRegenerator(tokenizer, cfg, 256).regenerate(convs, RegenerationJournal(path, fp))
    assert result.resumed == len(journaled) and result.requested == 10 - len(journaled)
    asked = {b["messages"][0]["content"].split(" turn")[0] for b in fake.received}
    assert asked == {f"user {i}" for i in range(10) if f"id-{i:02d}" not in journaled}  # only the missing
    assert [r.id for r in result.rows] == [s.id for s in convs]  # each once, in input order
    assert all(isinstance(r, RegeneratedRow) and r.turns_regenerated == 2 for r in result.rows)


def test_each_reply_is_a_conversation_of_requests_with_seeds_of_its_own(
    fake: FakeServer, tokenizer: Any
) -> None:
    """samples: 3 sends every turn of every reply as its own request, seeded `request_seed(seed, reply id,
    turn)`: the replies to one prompt are asked with different seeds, reply 0 with the seeds a run of one
    reply sends, and a second run with the same ones; the rows come by conversation, then reply."""
    convs = samples(2, users=2)
    cfg = regen_cfg(fake.url, seed=7, samples=3, temperature=0.7, top_p=0.9)
    result = ServerRegenerator(tokenizer, cfg, 256).regenerate(convs)
    ids = [reply_id(c.id, r) for c in convs for r in range(3)]
    assert (
        [r.id for r in result.rows] == ids == ["id-00", "id-00~1", "id-00~2", "id-01", "id-01~1", "id-01~2"]
    )
    assert all(isinstance(r, RegeneratedRow) and r.turns_regenerated == 2 for r in result.rows)
    assert (
        result.counts["replies"] == 12 and len(fake.received) == 12
    )  # 2 conversations x 3 replies x 2 turns
    seeds = [b["seed"] for b in fake.received]
    assert sorted(seeds) == sorted(request_seed(7, i, turn) for i in ids for turn in range(2))
    assert len(set(seeds)) == 12
    assert all(b["temperature"] == 0.7 and b["top_p"] == 0.9 for b in fake.received)

    fake.received.clear()
    ServerRegenerator(tokenizer, cfg, 256).regenerate(convs)
    assert sorted(b["seed"] for b in fake.received) == sorted(seeds)  # the same seeds again
    fake.received.clear()
    ServerRegenerator(tokenizer, cfg.model_copy(update={"samples": 1}), 256).regenerate(convs)
    assert {b["seed"] for b in fake.received} == {request_seed(7, c.id, t) for c in convs for t in range(2)}


def test_a_failed_reply_is_an_error_row_under_its_own_id_and_a_rerun_requests_only_it(
    fake: FakeServer, tokenizer: Any, tmp_path: Path
) -> None:
    """One reply of one conversation fails (the server refuses its seed) past the threshold: the journal keeps
    every other reply; the rerun asks for that reply alone and writes every reply once, in order."""
    convs = samples(3, users=2)
    cfg = regen_cfg(fake.url, seed=3, samples=2, temperature=1.0, server={"max_failed_fraction": 0.0})
    bad = request_seed(3, reply_id("id-01", 1), 0)
    healthy = threading.Event()

    def script(body: dict[str, Any], n: int) -> Reply:
        if body["seed"] == bad and not healthy.is_set():
            return 400, {"detail": "no"}, 0.5, {}  # refused after the others are done
        return (*echo(body)[:2], 0.01, {})

    fake.script = script
    fp = journal_fingerprint(cfg, 256, "tok", [s.id for s in convs], model=None)
    path = journal_path(tmp_path / "r-00000.jsonl")
    with pytest.raises(ServerRegenerationFailed, match=r"1 of 6 samples failed"):
        ServerRegenerator(tokenizer, cfg, 256).regenerate(convs, RegenerationJournal(path, fp))
    journaled = [json.loads(line)["id"] for line in path.read_text().splitlines()[1:]]
    assert sorted(journaled) == sorted(["id-00", "id-00~1", "id-01", "id-02", "id-02~1"])

    healthy.set()
    fake.received.clear()
    result = ServerRegenerator(tokenizer, cfg, 256).regenerate(convs, RegenerationJournal(path, fp))
    ids = [reply_id(c.id, r) for c in convs for r in range(2)]
    missing = [i for i in ids if i not in journaled]
    assert result.resumed == len(journaled) and result.requested == len(missing)
    assert sorted(b["seed"] for b in fake.received if len(b["messages"]) == 1) == sorted(
        request_seed(3, i, 0) for i in missing
    )  # only the missing replies' first turns
    assert [r.id for r in result.rows] == ids
    assert all(isinstance(r, RegeneratedRow) and r.turns_regenerated == 2 for r in result.rows)


def test_the_journal_drops_a_torn_line_and_refuses_another_fingerprint(tmp_path: Path) -> None:
    path = tmp_path / "r-00000.journal.jsonl"
    row = {"id": "a", "source": None, "turns_regenerated": 0, "error": "empty_reply", "messages": []}
    entry = {"id": "a", "row": row, "counts": {"replies": 1}, "new_tokens": 3}
    path.write_text(
        json.dumps({"journal": 1, "fingerprint": "f1"}) + "\n" + json.dumps(entry) + "\n" + '{"id": "b", "ro'
    )
    journal = RegenerationJournal(path, "f1")
    assert {k: e.dump() for k, e in journal.open(["a", "b"]).items()} == {"a": entry}
    journal.append(JournalEntry.model_validate({**entry, "id": "b", "row": {**row, "id": "b"}}))
    journal.close()
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()[1:]] == ["a", "b"]  # clean

    other = RegenerationJournal(path, "f2")
    assert other.open(["a", "b"]) == {} and other.discarded
    other.close()
    assert RegenerationJournal(path, "f1").open(["a"]) == {}  # it was rewritten for f2


def test_the_journal_keeps_a_reply_with_a_line_separator_and_drops_lines_no_writer_made(
    tmp_path: Path,
) -> None:
    """Lines are bytes split at newlines: a line cut inside a UTF-8 character (a kill or a full disk mid-write)
    or nested past the parser's limit is dropped like any torn line, and a reply holding U+2028, which JSON
    writes as is, is one line, not two halves dropped."""
    path = tmp_path / "r-00000.journal.jsonl"

    def entry(sample: str, reply: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}]
        row = {"id": sample, "source": None, "turns_regenerated": 1, "messages": messages, "stop": "complete"}
        return {"id": sample, "row": row, "counts": {"replies": 1}, "new_tokens": 3}

    def line(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    kept = entry("a", "one\u2028two")
    deep = b'{"id": "c", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    torn = line(entry("b", "caf\u00e9 ok"))
    torn = torn[: torn.index("\u00e9".encode()) + 1]  # the first byte of two
    path.write_bytes(line({"journal": 1, "fingerprint": "f1"}) + line(kept) + deep + torn)
    journal = RegenerationJournal(path, "f1")
    assert {k: e.dump() for k, e in journal.open(["a", "b", "c"]).items()} == {"a": kept}
    journal.close()
    assert path.read_bytes().count(b"\n") == 2  # rewritten clean: the header and "a"


CHILD = """
import json, sys
from transformers import AutoTokenizer
from eagle3_core.config import RegenerateConfig
from eagle3_core.engines.openai_client import ServerRegenerator
from eagle3_core.store.journal import RegenerationJournal
from eagle3_core.store.records import ConversationRow
args = json.loads(sys.argv[1])
cfg = RegenerateConfig.model_validate(args["cfg"])
regenerator = ServerRegenerator(AutoTokenizer.from_pretrained(args["tokenizer"]), cfg, 256)
samples = [ConversationRow.model_validate(s) for s in args["samples"]]
regenerator.regenerate(samples, RegenerationJournal(__import__("pathlib").Path(args["journal"]), "fp"))
"""


@pytest.mark.parametrize("replies", [1, 2])
def test_a_regenerating_process_killed_mid_shard_resumes_each_sample_once(
    fake: FakeServer, tokenizer: Any, toy_target_dir: Path, tmp_path: Path, replies: int
) -> None:
    """replies 2 (regenerate.samples): each reply is journaled under its own id, and the rerun requests only
    the replies missing, each once (told apart by their first turn's seed)."""
    fake.script = lambda body, n: (*echo(body)[:2], 0.2 / replies, {})  # killed well before the end
    convs = samples(16, users=2)
    sampling: dict[str, Any] = {"samples": 2, "temperature": 0.7} if replies == 2 else {}
    cfg = regen_cfg(fake.url, server={"concurrency": 2}, **sampling)
    path = journal_path(tmp_path / "r-00000.jsonl")
    args = {
        "cfg": cfg.model_dump(),
        "tokenizer": str(toy_target_dir),
        "samples": [s.dump() for s in convs],
        "journal": str(path),
    }
    child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(args)], cwd=Path(__file__).parents[2])
    try:
        deadline = time.monotonic() + 120
        while not (path.exists() and len(path.read_text().splitlines()) > 4):  # header + 4 samples
            assert child.poll() is None, "the child ended before it was killed"
            assert time.monotonic() < deadline, "no journal after 120 s"
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)  # mid-shard, maybe mid-line
    finally:
        child.kill()
        child.wait()
    lines = path.read_text().splitlines()[1:]
    done_before = set()
    for line in lines:
        try:
            done_before.add(json.loads(line)["id"])
        except ValueError:  # the kill tore this line: that sample is requested again, never taken half
            assert line is lines[-1]

    fake.received.clear()
    result = ServerRegenerator(tokenizer, cfg, 256).regenerate(convs, RegenerationJournal(path, "fp"))
    ids = [reply_id(c.id, r) for c in convs for r in range(replies)]
    assert result.resumed == len(done_before) >= 4 and result.requested == len(ids) - len(done_before)
    first_turns = [b["seed"] for b in fake.received if len(b["messages"]) == 1]
    assert sorted(first_turns) == sorted(request_seed(0, i, 0) for i in ids if i not in done_before)
    asked = {b["messages"][0]["content"].split(" turn")[0] for b in fake.received}
    assert asked == {
        f"user {i}"
        for i in range(16)
        if any(reply_id(f"id-{i:02d}", r) not in done_before for r in range(replies))
    }
    assert [r.id for r in result.rows] == ids  # each once, by conversation then reply
    assert all(isinstance(r, RegeneratedRow) and r.turns_regenerated == 2 for r in result.rows)
