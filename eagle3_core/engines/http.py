"""The one HTTP client of eagle3's engine I/O (httpx): SGLang's native routes, the OpenAI-compatible server
regeneration talks to, and the Dagster webserver's GraphQL.

Never through a proxy, whatever *_proxy says: each of these servers is named directly (usually on this host),
and a benchmark measures the server, not something in between. JSON goes in and comes out; every failure is
one line naming the URL, raised as the caller's own error type:

    {who} server at {url} is unreachable ({reason}); is it running?
    {who} {url} did not answer within {timeout} s
    {who} {url} failed mid-request: {reason}
    {who} {url} is not a URL eagle3 can request: {reason}
    {who} {url} answered HTTP {status} {reason}: {the server's message}
    {who} {url} answered something that is not JSON: {the start of it}

{url} is the URL as `config.without_url_passwords` shows it (http://user:***@host): a password in a URL is sent
(httpx makes it Basic auth) and never printed. That is the rule for every URL eagle3 prints, logs or records.

An API key is an `ApiKey`: the client sends it, and nothing else sees it. A server may quote the key back
(some 401 answers do: "Incorrect API key provided: Bearer sk-..."), so whoever reads an answer sent with a key
passes its text through `ApiKey.redact` before anything is built from it: no error, log line or stored row
then holds the key.
"""

from __future__ import annotations

import html
import json
from collections.abc import Generator
from typing import Any
from urllib.parse import quote, quote_plus

import httpx
from pydantic import SecretStr

from eagle3_core.config import without_url_passwords
from eagle3_core.errors import Eagle3Error


class HttpError(Eagle3Error):
    """A request that failed; `status` is the HTTP status of the answer, 0 when none came."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


REDACTED_KEY = "[redacted api key]"


class ApiKey(httpx.Auth):
    """A Bearer key: a client made with it sends `Authorization: Bearer <key>` on every request (the header is
    set per request, so the key is not among the client's headers), and it is never shown: its repr is masked
    (pydantic's SecretStr) and `redact` takes it out of any text, in every form a server may echo it in."""

    def __init__(self, value: str) -> None:
        # A header value is printable ASCII; anything else would fail in httpx or h11 with the key in the
        # message, or be sent as something else than the key. The value itself is never part of the message.
        if not value or not all("!" <= c <= "~" for c in value):
            raise ValueError("an API key is printable ASCII: no spaces, control or non-ASCII characters")
        self._secret = SecretStr(value)

    def __repr__(self) -> str:
        return f"ApiKey({self._secret!r})"

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._secret.get_secret_value()}"
        yield request

    def redact(self, text: str) -> str:
        """`text` with every occurrence of the key replaced by REDACTED_KEY: the key as it is (which covers
        `Bearer <key>`), JSON-escaped (`"`, `\\`, and `/` as some encoders write it), URL-quoted and
        HTML-escaped; longest first, so that no form is left half replaced."""
        key = self._secret.get_secret_value()
        escaped = json.dumps(key)[1:-1]
        forms = {
            key,
            escaped,
            escaped.replace("/", "\\/"),
            quote(key, safe=""),
            quote_plus(key),
            html.escape(key),
        }
        for form in sorted(forms, key=len, reverse=True):
            text = text.replace(form, REDACTED_KEY)
        return text


def client(timeout_s: float) -> httpx.Client:
    return httpx.Client(trust_env=False, timeout=httpx.Timeout(timeout_s))


def async_client(timeout_s: float, connections: int, key: ApiKey | None = None) -> httpx.AsyncClient:
    """An async client of `connections` connections; with `key`, every request carries it."""
    return httpx.AsyncClient(
        trust_env=False,
        timeout=httpx.Timeout(timeout_s),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        auth=key,
    )


def request_json(
    method: str,
    url: str,
    body: object | None,
    timeout_s: float,
    *,
    who: str,
    error: type[HttpError] = HttpError,
    missing: bool = False,
) -> Any:
    """The JSON a `method` request to `url` answers; with `missing`, None for an HTTP 404 (a route the server
    does not have). `body`, when given, is sent as JSON."""
    shown = without_url_passwords(url)
    try:
        with client(timeout_s) as http:
            response = http.request(method, url, json=body) if body is not None else http.request(method, url)
    except httpx.ConnectTimeout:
        raise error(f"{who} {shown} did not answer within {timeout_s:g} s") from None
    except httpx.ConnectError as e:
        raise error(
            without_url_passwords(f"{who} server at {shown} is unreachable ({e}); is it running?")
        ) from None
    except httpx.TimeoutException:
        raise error(f"{who} {shown} did not answer within {timeout_s:g} s") from None
    except httpx.HTTPError as e:  # the connection reset or cut off mid-response
        raise error(without_url_passwords(f"{who} {shown} failed mid-request: {e}")) from None
    except httpx.InvalidURL as e:
        raise error(without_url_passwords(f"{who} {shown} is not a URL eagle3 can request: {e}")) from None
    if missing and response.status_code == 404:
        return None
    if response.status_code >= 400:
        detail = error_message(json_or_text(response.content))
        message = f"{who} {shown} answered HTTP {response.status_code} {response.reason_phrase}: {detail}"
        raise error(without_url_passwords(message), response.status_code)
    try:
        return json.loads(response.content)
    except ValueError:
        raise error(
            without_url_passwords(
                f"{who} {shown} answered something that is not JSON: {clip(response.content)}"
            )
        ) from None


def answers(url: str, timeout_s: float) -> bool:
    """Whether a GET of `url` answers 200 now (False while not listening, loading, or cut off)."""
    try:
        with client(timeout_s) as http:
            return http.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def json_or_text(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()


def error_message(body: object) -> str:
    """The message of an error body: SGLang's {"error": {"message": ...}} or {"object": "error", "message": ...},
    FastAPI's {"detail": ...}; else the body itself, clipped."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if isinstance(body.get("message"), str):
            return str(body["message"])
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    return clip(body) if body else "(empty body)"


def clip(value: object, limit: int = 300) -> str:
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
    return text if len(text) <= limit else text[:limit] + "..."
