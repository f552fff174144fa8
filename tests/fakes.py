"""Fakes the tests share: a free loopback port, an HTTP server on a thread, a tiny drafter config.

A fake HTTP service is a state object (what it answers, what it received) and a `FakeHandler` subclass that
reads it from `self.server.state`; `FakeHTTPServer(handler, state)` serves it on a free loopback port for
the duration of a `with` block.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Generic, TypeVar

from eagle3_core.draft.model import DrafterConfig

S = TypeVar("S")


def free_port() -> int:
    """A loopback port free a moment ago (a server started next binds it; the race is the tests' to lose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeHTTPServer(ThreadingHTTPServer, Generic[S]):
    """`handler` serving `state` on a free loopback port (`url`), on a daemon thread while in a `with`."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], state: S) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.state = state
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> FakeHTTPServer[S]:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=10)


class FakeHandler(BaseHTTPRequestHandler):
    """A handler of a FakeHTTPServer: its state, the request's JSON body, a reply in one call, no logging."""

    server: FakeHTTPServer[Any]

    def json_body(self) -> Any:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def reply(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        """`payload` as JSON, or as it is when bytes or text (content type JSON when it looks like JSON)."""
        if isinstance(payload, bytes | str):
            data = payload.encode() if isinstance(payload, str) else payload
            kind = "application/json" if data.startswith((b"{", b"[")) else "text/plain"
        else:
            data, kind = json.dumps(payload).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # keep pytest's output clean
        pass


def tiny_drafter_config(**change: Any) -> DrafterConfig:
    """A drafter small enough for float64 checks of every path: GQA (4 query heads over 2), target wider
    than draft; `change` overrides fields."""
    fields: dict[str, Any] = {
        "target_hidden_size": 24,
        "hidden_size": 16,
        "intermediate_size": 40,
        "num_heads": 4,
        "num_kv_heads": 2,
        "target_vocab_size": 50,
        "draft_vocab_size": 30,
    }
    return DrafterConfig(**{**fields, **change})
