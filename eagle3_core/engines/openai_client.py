"""Regeneration through an OpenAI-compatible server (SGLang, vLLM, `transformers serve`): `/v1/chat/completions`.

Each assistant turn of a conversation is one request, turn after turn, and the server sees exactly what the
in-process `Regenerator` would give the target: the conversation's system turns, the earlier user turns and
the target's own earlier replies, then the user turn to answer. The same bookkeeping decides when a
conversation stops (`context_limit` by the local tokenizer's count of the prompt, `empty_reply`,
`max_turns`), and the same row is written, so a shard regenerated here at temperature 0 equals the
in-process one (as long as the server stops on the same end-of-turn tokens and decodes without special
tokens, as `transformers serve`, SGLang and vLLM do by default).

Requests: at most `concurrency` conversations in flight (one request each), a deadline of `timeout_s` per
request, and `retries` further attempts with exponential backoff and jitter after a connection error, a
timeout, HTTP 408, 429 or 5xx; any other 4xx, or an answer that is not a chat completion, fails the request
at once. A sample whose request fails is an error row with the reason (the shape the in-process path writes),
unless more than `max_failed_fraction` of the shard failed: then no new request is sent, and the shard fails.

The API key (`api_key_env`) goes out as `http.ApiKey`, and every answer is read through its `redact` before a
reason, error row, journal line or reply is built from it: a server that quotes the key back in a 401 puts
`[redacted api key]` in what eagle3 prints and stores, never the key.

With `regenerate.samples` n > 1 each conversation is regenerated n times, each reply a sample of its own
(reply r >= 1 under the id `<id>~r`, store/records.py `reply_id`): its own conversation of requests, each
request carrying the seed `request_seed(seed, reply id, turn)`, so the replies differ and a resumed run sends
the seeds an uninterrupted one would (a server that honours `seed`, as vLLM and SGLang do, then samples the
same reply; one that ignores it still gives n samples, not reproducible ones).

Resume: every finished sample (every reply) is appended to the shard's journal (eagle3_core/store/journal.py,
the one the in-process path keeps too). A run that dies or fails mid-shard leaves the journal; the next run
takes the samples in it and requests only the others, and the shard is written whole, in input order (by
conversation, then reply), each sample once.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eagle3_core.config import Eagle3Config, RegenerateConfig, RegenerateServerConfig, without_url_passwords
from eagle3_core.data.conversation import normalise_content
from eagle3_core.data.tokenize import generation_prompt_ids
from eagle3_core.engines import http
from eagle3_core.errors import ConfigError, Eagle3Error
from eagle3_core.store.journal import RegenerationJournal, journal_fingerprint, journal_path
from eagle3_core.store.records import ConversationRow, JournalEntry, RegenerationError, reply_id
from eagle3_core.targets.regenerate import (
    Dialogue,
    RegenerationProgress,
    RegenerationResult,
    append_reply,
    dialogue_of,
    finish_row,
    reply_units,
    request_seed,
)

RETRY_STATUS = frozenset({408, 429})  # and every 5xx: the server's trouble, not the request's
MAX_BACKOFF_S = 60.0


class RequestFailed(Exception):
    """A request that failed for good: a non-retryable answer, or every attempt spent."""

    def __init__(self, reason: str, attempts: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.attempts = attempts


class ServerRegenerationFailed(Eagle3Error):
    """More of a shard's requests failed than `max_failed_fraction` allows; its finished samples are kept."""


@dataclass(frozen=True)
class ChatReply:
    content: str  # as the server sent it (normalised by the caller, as in process)
    finish_reason: str
    completion_tokens: int | None  # None: the server sent no usage
    attempts: int


def completions_endpoint(url: str) -> str:
    base = url.rstrip("/")
    base = base.removesuffix("/v1")  # "http://host:port/v1" is how OpenAI clients are usually configured
    return f"{base}/v1/chat/completions"


def backoff_delay(base_s: float, retry: int, retry_after_s: float | None = None) -> float:
    """Wait before retry `retry` (0-based): base * 2**retry, jittered to 50-100% so that requests that failed
    together do not come back together; never under the server's Retry-After; at most MAX_BACKOFF_S."""
    delay = base_s * 2.0**retry * random.uniform(0.5, 1.0)
    if retry_after_s is not None:
        delay = max(delay, retry_after_s)
    return min(delay, MAX_BACKOFF_S)


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:  # an HTTP date: rare from inference servers, the exponential backoff serves
        return None


class ChatClient:
    """`/v1/chat/completions` with bounded concurrency, a per-request deadline and retries with backoff."""

    def __init__(self, server: RegenerateServerConfig) -> None:
        self.server = server
        self.endpoint = completions_endpoint(server.url)
        self.shown_url = without_url_passwords(server.url)
        try:  # refused here in one line, not by httpx at the first request with a traceback
            httpx.URL(self.endpoint)
        except httpx.InvalidURL as err:
            raise ConfigError(
                without_url_passwords(
                    f"regenerate.server.url {self.shown_url} is not a URL eagle3 can request: {err}"
                )
            ) from None
        self._key = api_key(server)
        # the server is the project's own (a cluster address or loopback): never through a proxy (engines/http.py)
        self._client = http.async_client(server.timeout_s, server.concurrency, self._key)
        self._client.headers["Content-Type"] = "application/json"
        self._slots = asyncio.Semaphore(server.concurrency)
        self.retried = 0  # attempts after the first, over every request

    async def __aenter__(self) -> ChatClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.aclose()

    async def complete(self, body: dict[str, Any]) -> ChatReply:
        attempts = self.server.retries + 1
        last = ""
        retry_after: float | None = None
        for attempt in range(attempts):
            if attempt:
                self.retried += 1
                await asyncio.sleep(backoff_delay(self.server.backoff_s, attempt - 1, retry_after))
            retry_after = None
            try:
                # A slot is held only while a request is on the wire, not while it waits to be retried.
                async with self._slots:
                    response = await asyncio.wait_for(
                        self._client.post(self.endpoint, json=body), self.server.timeout_s
                    )
            except (TimeoutError, httpx.TimeoutException):
                last = f"timeout after {self.server.timeout_s:g} s"
                continue
            except httpx.TransportError as err:
                last = self._shown(f"{type(err).__name__}: {err}").rstrip(": ")
                continue
            # The one place an answer is read: the key taken out before any reason, row or reply is built
            # from it (a 401 may quote it back).
            text = self._shown(response.text)
            if response.status_code == 200:
                return _parse(text, attempt + 1)
            last = f"HTTP {response.status_code}: {text[:300]}".rstrip(": ")
            if response.status_code not in RETRY_STATUS and response.status_code < 500:  # the request's fault
                raise RequestFailed(last, attempt + 1)
            retry_after = _retry_after(response)
        raise RequestFailed(f"{last} (after {attempts} attempts)", attempts)

    def _shown(self, text: str) -> str:
        """`text` as eagle3 may print or store it: without the API key, nor the password of a URL."""
        return without_url_passwords(self._key.redact(text) if self._key is not None else text)


def api_key(server: RegenerateServerConfig) -> http.ApiKey | None:
    """The key in the variable `api_key_env` names; None when it names none. Its value is never in a message."""
    if server.api_key_env is None:
        return None
    field = f"regenerate.server.api_key_env: the environment variable {server.api_key_env}"
    value = os.environ.get(server.api_key_env)
    if not value:
        raise ConfigError(f"{field} is not set")
    try:
        return http.ApiKey(value)
    except ValueError as err:
        raise ConfigError(
            f"{field} holds no usable key ({err}; a stray newline?); its value is not shown"
        ) from None


def _parse(text: str, attempts: int) -> ChatReply:
    try:
        data = json.loads(text)
        choice = data["choices"][0]
        content = choice["message"].get("content") or ""
        usage = data.get("usage") or {}
        tokens = usage.get("completion_tokens")
        if not isinstance(content, str):
            raise TypeError(f"content is {type(content).__name__}")
        return ChatReply(
            content,
            str(choice.get("finish_reason") or ""),
            int(tokens) if tokens is not None else None,
            attempts,
        )
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise RequestFailed(
            f"not a chat completion ({type(err).__name__}: {err}): {text[:200]}", attempts
        ) from None


# ---- regeneration ------------------------------------------------------------------------------------------
@dataclass
class ServerRegenerationResult(RegenerationResult):
    requested: int = 0  # samples (replies) whose turns were requested in this run
    retries: int = 0
    failures: dict[str, str] = field(default_factory=dict)  # sample (reply) id -> reason


class _Aborted(Exception):
    """Too many requests failed: a conversation still under way stops, unfinished and unjournaled."""


class ServerRegenerator:
    """Replaces assistant turns with the replies of an OpenAI-compatible server, as `Regenerator` does in
    process; `tokenizer` (the target's) only measures prompts and conversations against `max_seq_len`."""

    def __init__(self, tokenizer: Any, cfg: RegenerateConfig, max_seq_len: int) -> None:
        if cfg.server is None:
            raise ValueError("regenerate.server is not set")
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.server: RegenerateServerConfig = cfg.server
        self.max_seq_len = max_seq_len
        self.max_prompt_tokens = max_seq_len - cfg.max_new_tokens

    def regenerate(
        self,
        samples: Sequence[ConversationRow],
        journal: RegenerationJournal | None = None,
        progress: Callable[[RegenerationProgress], None] = lambda _p: None,
        log: Callable[[str], None] = lambda _m: None,
    ) -> ServerRegenerationResult:
        """Rows in the order of `samples`, `regenerate.samples` replies each (by reply); raises
        ServerRegenerationFailed (journal kept) past the threshold."""
        try:
            return asyncio.run(self._regenerate(samples, journal, progress, log))
        finally:
            if journal is not None:
                journal.close()

    async def _regenerate(
        self,
        samples: Sequence[ConversationRow],
        journal: RegenerationJournal | None,
        progress: Callable[[RegenerationProgress], None],
        log: Callable[[str], None],
    ) -> ServerRegenerationResult:
        started = time.perf_counter()
        units = reply_units(samples, self.cfg.samples)
        ids = [reply_id(s.id, r) for s, r in units]
        entries = journal.open(ids) if journal is not None else {}
        if journal is not None and journal.discarded:
            log(f"{journal.path.name}: discarded ({journal.discarded})")
        result = ServerRegenerationResult(rows=[], resumed=len(entries))
        dialogues = [
            dialogue_of(s, self.cfg.max_turns, r)
            for (s, r), i in zip(units, ids, strict=True)
            if i not in entries
        ]
        allowed = math.floor(self.server.max_failed_fraction * len(ids))
        queue: asyncio.Queue[Dialogue] = asyncio.Queue()
        for d in dialogues:
            queue.put_nowait(d)
        aborted = asyncio.Event()

        def sample_done() -> None:
            done = len(entries) + len(result.failures)
            # As often as the in-process path reports (once per batch), not once per request.
            if (done - result.resumed) % self.cfg.batch_size == 0 or done == len(ids):
                seconds = time.perf_counter() - started
                progress(RegenerationProgress(done, len(ids), result.resumed, result.fresh_tokens, seconds))

        async with ChatClient(self.server) as client:

            async def worker() -> None:
                while not aborted.is_set() and not queue.empty():
                    d = queue.get_nowait()
                    result.requested += 1
                    try:
                        entry = await self._conversation(client, d, aborted)
                    except RequestFailed as err:
                        result.failures[d.id] = err.reason
                        if len(result.failures) > allowed:
                            aborted.set()  # the shard fails anyway: stop spending requests on it
                        sample_done()
                        continue
                    except _Aborted:
                        continue
                    entries[d.id] = entry
                    result.fresh_tokens += entry.new_tokens
                    if journal is not None:
                        journal.append(entry)
                    sample_done()

            await asyncio.gather(*(worker() for _ in range(min(self.server.concurrency, len(dialogues)))))
            result.retries = client.retried

        if aborted.is_set():
            raise ServerRegenerationFailed(self._failure_message(len(ids), entries, result, allowed, journal))
        for (s, _), i in zip(units, ids, strict=True):
            entry = entries.get(i)
            if entry is None:  # its request failed, within what max_failed_fraction allows
                entry = _failed_entry(s, i, result.failures[i])
            result.add(entry)
        return result

    async def _conversation(self, client: ChatClient, d: Dialogue, aborted: asyncio.Event) -> JournalEntry:
        counts: Counter[str] = Counter()
        new_tokens = 0
        turn = 0
        while d.pending_users and not d.stop:
            messages = [*d.done, {"role": "user", "content": d.pending_users[0]}]
            if len(generation_prompt_ids(self.tokenizer, messages)) > self.max_prompt_tokens:
                d.stop = "context_limit"
                break
            if aborted.is_set():
                raise _Aborted
            reply = await client.complete(self._body(messages, d.id, turn))
            text = normalise_content(reply.content)
            new_tokens += self._new_tokens(reply)
            hit_limit = reply.finish_reason == "length"
            append_reply(d, text, hit_limit, counts, self.tokenizer, self.max_seq_len)
            turn += 1
        row = finish_row(d, counts)
        return JournalEntry(id=d.id, row=row, counts=dict(counts), new_tokens=new_tokens)

    def _body(self, messages: list[dict[str, str]], sample_id: str, turn: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": self.cfg.max_new_tokens,
            "temperature": self.cfg.temperature,
            "seed": request_seed(self.cfg.seed, sample_id, turn),
            "stream": False,
        }
        if self.cfg.temperature > 0:  # as in process: top_p only shapes sampling
            body["top_p"] = self.cfg.top_p
        if self.server.model is not None:
            body["model"] = self.server.model
        return body

    def _new_tokens(self, reply: ChatReply) -> int:
        """Reply tokens, as in process: without the end-of-turn token, which servers count when they stop."""
        if reply.completion_tokens is None:
            ids = self.tokenizer(reply.content, add_special_tokens=False)["input_ids"]
            return len(ids)
        return max(0, reply.completion_tokens - (1 if reply.finish_reason == "stop" else 0))

    def _failure_message(
        self,
        samples: int,
        entries: dict[str, JournalEntry],
        result: ServerRegenerationResult,
        allowed: int,
        journal: RegenerationJournal | None,
    ) -> str:
        reasons = Counter(_short(r) for r in result.failures.values())
        listed = "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common(3))
        kept = f"kept in {journal.path}" if journal is not None else "not kept (no journal)"
        return (
            f"{len(result.failures)} of {samples} samples failed their requests to {without_url_passwords(self.server.url)} "
            f"({listed}), more than max_failed_fraction {self.server.max_failed_fraction:g} allows "
            f"({allowed}); no new request was started. {len(entries)} finished samples are {kept}; "
            f"run again to request the other {samples - len(entries)}."
        )


def _short(reason: str) -> str:
    return reason if len(reason) <= 160 else reason[:157] + "..."


def _failed_entry(sample: ConversationRow, sample_id: str, reason: str) -> JournalEntry:
    """An error row of the in-process shape for the reply `sample_id` to `sample`: no conversation kept, the
    reason named, counted as an error."""
    row = RegenerationError(
        id=sample_id,
        source=sample.source,
        turns_regenerated=0,
        error=f"request_failed: {reason}",
        messages=[],
    )
    return JournalEntry(id=sample_id, row=row, counts={"errors": 1, "request_errors": 1}, new_tokens=0)


def regenerate_through_server(
    cfg: Eagle3Config,
    shard: Path,
    samples: Sequence[ConversationRow],
    progress: Callable[[RegenerationProgress], None] = lambda _p: None,
    log: Callable[[str], None] = lambda _m: None,
) -> ServerRegenerationResult:
    """Regenerate one shard's samples through `cfg.regenerate.server`, journaled beside `shard`.

    Only the target's tokenizer is loaded (to measure prompts), never its weights. The caller writes the
    shard, then removes the journal (`remove_journal`).
    """
    from transformers import AutoTokenizer

    from eagle3_core.targets.hf import tokenizer_fingerprint
    from eagle3_core.targets.resolve import target_dir

    model_dir = target_dir(cfg, log=log, weights=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    server = cfg.regenerate.server
    fingerprint = journal_fingerprint(
        cfg.regenerate,
        cfg.tokenize.max_seq_len,
        tokenizer_fingerprint(model_dir),
        [s.id for s in samples],
        model=server.model if server is not None else None,
    )
    journal = RegenerationJournal(journal_path(shard), fingerprint)
    regenerator = ServerRegenerator(tokenizer, cfg.regenerate, cfg.tokenize.max_seq_len)
    return regenerator.regenerate(samples, journal, progress, log)
