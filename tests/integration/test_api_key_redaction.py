"""An OpenAI-compatible server that echoes the API key in its 401 answer: the key appears nowhere eagle3 prints
or records it, through the real `eagle3 regenerate` and through a Dagster run. Likewise a password written in
a configured URL (`http://user:password@host`: regenerate.server, target.backend, bench-sglang's --url): sent,
and shown everywhere as `***` (config.without_url_passwords).

The server is a real HTTP server on 127.0.0.1 (tests/fakes.py), started and stopped by the test; it answers
every chat completion 401 with the Authorization header it received in the message, as some servers do. The
target is the toy one (only its tokenizer is loaded: the server path never loads weights).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest

from eagle3_core.config import load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.engines.openai_client import ServerRegenerationFailed
from eagle3_core.store.layout import StoreLayout
from eagle3_dagster.materialize import materialize_shards
from tests.conftest import REPO, write_config
from tests.fakes import FakeHandler, FakeHTTPServer

KEY_ENV = "EAGLE3_TEST_API_KEY"
# base64-like, with the characters a JSON or URL encoder would change; long and unlikely anywhere else
KEY = "sk-test/eagle3+Zq9Xr81vLm0Pw7=secret"
REDACTED = "[redacted api key]"
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"hello {i}"}, {"role": "assistant", "content": "hi"}]}
    for i in range(3)
]


@dataclass
class Seen:
    authorizations: list[str]


class KeyEchoingHandler(FakeHandler):
    """401 for every request, the key it was sent quoted back in the message (OpenAI-style error body)."""

    server: FakeHTTPServer[Seen]

    def do_POST(self) -> None:
        self.json_body()
        auth = self.headers.get("Authorization", "")
        self.server.state.authorizations.append(auth)
        message = f"Incorrect API key provided: {auth!r} (key {auth.removeprefix('Bearer ')})"
        self.reply(
            401, {"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}}
        )


@pytest.fixture
def echoing_server() -> Iterator[FakeHTTPServer[Seen]]:
    with FakeHTTPServer(KeyEchoingHandler, Seen([])) as server:
        yield server


def _project(
    root: Path, url: str, target: Path, max_failed_fraction: float, api_key_env: str | None = KEY_ENV
) -> Path:
    (root / "c.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    server = {
        "url": url,
        "api_key_env": api_key_env,
        "retries": 0,
        "concurrency": 2,
        "timeout_s": 10,
        "max_failed_fraction": max_failed_fraction,
    }
    return write_config(
        root,
        "store: store\ndata: {dataset: key, holdout_fraction: 0.0, sources: [{path: c.jsonl}]}\n"
        f"target: {{path: {target}}}\n"
        f"regenerate: {{max_new_tokens: 8, server: {json.dumps(server)}}}\n",
    )


def _eagle3(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, KEY_ENV: KEY, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "eagle3_cli.steps", "--config", str(config), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _files_holding_the_key(root: Path) -> list[str]:
    """Every file under `root` (store, journal, error rows, manifests, Dagster's databases and compute logs)
    whose bytes hold the key."""
    return [str(p) for p in root.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]


def test_the_cli_never_prints_or_stores_a_key_the_server_echoes(
    tmp_path: Path, echoing_server: FakeHTTPServer[Seen], toy_target_dir: Path
) -> None:
    config = _project(tmp_path, echoing_server.url, toy_target_dir, max_failed_fraction=1.0)
    [key] = ingest(load_config(config)).all_shards

    # Tolerated failures: every sample an error row in the shard, its reason the server's answer.
    kept = _eagle3(config, "regenerate")
    assert kept.returncode == 0, kept.stderr
    assert echoing_server.state.authorizations[0] == f"Bearer {KEY}"  # the key was sent, and echoed
    shard = StoreLayout(tmp_path / "store").regenerated(key)
    rows = [json.loads(line) for line in shard.read_text().splitlines()]
    assert len(rows) == len(CONVERSATIONS)
    assert all(r["error"].startswith("request_failed: HTTP 401") and REDACTED in r["error"] for r in rows)
    assert KEY not in kept.stdout + kept.stderr
    assert _files_holding_the_key(tmp_path) == []

    # Not tolerated: the run fails in one line naming the reasons, the journal is kept.
    _project(tmp_path, echoing_server.url, toy_target_dir, max_failed_fraction=0.0)
    failed = _eagle3(config, "regenerate", "--force")
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert "failed their requests" in failed.stdout and REDACTED in failed.stdout
    assert KEY not in failed.stdout + failed.stderr
    assert _files_holding_the_key(tmp_path) == []


def test_a_dagster_run_never_records_a_key_the_server_echoes(
    tmp_path: Path,
    echoing_server: FakeHTTPServer[Seen],
    toy_target_dir: Path,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _project(tmp_path, echoing_server.url, toy_target_dir, max_failed_fraction=0.0)
    [key] = ingest(load_config(config)).all_shards
    monkeypatch.setenv("EAGLE3_CONFIG", str(config))
    monkeypatch.setenv(KEY_ENV, KEY)

    with pytest.raises(ServerRegenerationFailed) as err:
        materialize_shards([key], instance, log=lambda _: None)  # the runner's own path: tags, resources
    assert KEY not in "".join(traceback.format_exception(err.value))  # what reaches the caller's terminal

    assert echoing_server.state.authorizations == [f"Bearer {KEY}"] * len(echoing_server.state.authorizations)
    [run] = instance.get_runs()
    records = instance.all_logs(run.run_id)
    failure = next(r for r in records if r.dagster_event is not None and r.dagster_event.is_step_failure)
    assert "failed their requests" in str(failure.dagster_event) and REDACTED in str(failure.dagster_event)
    assert all(KEY not in dg.serialize_value(r) for r in records)  # the event log, every event
    assert KEY not in json.dumps(run.tags) + repr(run.run_config)
    # the compute logs (stdout and stderr captured per step: the failure is in them) and every database
    compute_logs = [p for p in (tmp_path / "dagster_home").rglob("compute_logs/*") if p.is_file()]
    assert any(REDACTED in p.read_text() for p in compute_logs)
    assert _files_holding_the_key(tmp_path) == []


# ---- a password in a configured URL ------------------------------------------------------------------------
PASSWORD = "pw-Xq81vLm0Zr7-secret"  # URL-safe, long and unlikely anywhere else
USER = "eagle3"
HIDDEN = f"{USER}:***@127.0.0.1"


class FailingHandler(FakeHandler):
    """HTTP 500 for every request (a server whose model is not loaded), recording the Authorization header."""

    server: FakeHTTPServer[Seen]

    def do_GET(self) -> None:
        self._fail()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._fail()

    def _fail(self) -> None:
        self.server.state.authorizations.append(self.headers.get("Authorization", ""))
        self.reply(500, {"error": {"message": "the model is not loaded"}})


@pytest.fixture
def failing_server() -> Iterator[FakeHTTPServer[Seen]]:
    with FakeHTTPServer(FailingHandler, Seen([])) as server:
        yield server


def _with_password(url: str) -> str:
    return url.replace("http://", f"http://{USER}:{PASSWORD}@")


def _files_holding_the_password(root: Path, config: Path) -> list[str]:
    """Every file under `root` but the config the password was written in whose bytes hold it."""
    return [
        str(p) for p in root.rglob("*") if p.is_file() and p != config and PASSWORD.encode() in p.read_bytes()
    ]


def test_the_cli_never_prints_or_stores_the_password_of_the_regeneration_servers_url(
    tmp_path: Path, failing_server: FakeHTTPServer[Seen], toy_target_dir: Path
) -> None:
    url = _with_password(failing_server.url)
    config = _project(tmp_path, url, toy_target_dir, max_failed_fraction=1.0, api_key_env=None)
    [key] = ingest(load_config(config)).all_shards

    kept = _eagle3(config, "regenerate")  # every request fails, tolerated: error rows and a manifest
    assert kept.returncode == 0, kept.stdout + kept.stderr
    basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert failing_server.state.authorizations[0] == f"Basic {basic}"  # the password was sent
    manifest = json.loads(StoreLayout(tmp_path / "store").regenerated_manifest(key).read_text())
    assert manifest["server"] == f"http://{HIDDEN}:{failing_server.url.rsplit(':', 1)[1]}"
    assert PASSWORD not in kept.stdout + kept.stderr
    assert _files_holding_the_password(tmp_path, config) == []

    _project(tmp_path, url, toy_target_dir, max_failed_fraction=0.0, api_key_env=None)
    failed = _eagle3(config, "regenerate", "--force")
    assert failed.returncode == 2, failed.stdout + failed.stderr
    assert "failed their requests to" in failed.stdout and HIDDEN in failed.stdout
    assert PASSWORD not in failed.stdout + failed.stderr
    assert _files_holding_the_password(tmp_path, config) == []


def test_a_server_url_with_a_password_is_shown_without_it_in_every_one_line_error(
    tmp_path: Path, failing_server: FakeHTTPServer[Seen], toy_target_dir: Path
) -> None:
    """Extraction through target.backend sglang_http, bench-sglang's --url, and a URL the config refuses."""
    url = _with_password(failing_server.url)
    config = write_config(
        tmp_path,
        "store: store\ndata: {dataset: key, holdout_fraction: 0.5, sources: [{path: c.jsonl}]}\n"
        f"target: {{path: {toy_target_dir}, backend: {{kind: sglang_http, url: '{url}'}}}}\n"
        "regenerate: {enabled: false}\n",
    )
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CONVERSATIONS))
    ingest(load_config(config))
    for args in (["extract"], ["bench-sglang", "--url", url]):
        done = _eagle3(config, *args)
        assert done.returncode == 2, done.stdout + done.stderr
        [line] = [line for line in done.stdout.splitlines() if line.startswith("error:")]
        assert line.startswith(f"error: SGLang http://{HIDDEN}:")
        assert line.endswith("answered HTTP 500 Internal Server Error: the model is not loaded")
        assert PASSWORD not in done.stdout + done.stderr and "Traceback" not in done.stderr
    basic = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert len(failing_server.state.authorizations) >= 2  # both reached the server, with the password
    assert set(failing_server.state.authorizations) == {f"Basic {basic}"}
    assert _files_holding_the_password(tmp_path, config) == []

    refused = write_config(
        tmp_path / "bad", f"store: store\nregenerate: {{server: {{url: 'ftp://{USER}:{PASSWORD}@h'}}}}\n"
    )
    done = _eagle3(refused, "stats")
    assert (
        done.returncode == 2
        and "regenerate.server.url" in done.stdout
        and f"ftp://{USER}:***@h" in done.stdout
    )
    assert PASSWORD not in done.stdout + done.stderr


def test_a_dagster_run_never_records_the_password_of_the_regeneration_servers_url(
    tmp_path: Path,
    failing_server: FakeHTTPServer[Seen],
    toy_target_dir: Path,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = _with_password(failing_server.url)
    config = _project(tmp_path, url, toy_target_dir, max_failed_fraction=1.0, api_key_env=None)
    [key] = ingest(load_config(config)).all_shards
    monkeypatch.setenv("EAGLE3_CONFIG", str(config))

    materialize_shards([key], instance, log=lambda _: None)  # every request failed, tolerated: materialized
    assert failing_server.state.authorizations  # the server was asked
    [run] = instance.get_runs()
    records = instance.all_logs(run.run_id)
    materialized = [
        r for r in records if r.dagster_event is not None and r.dagster_event.is_step_materialization
    ]
    assert any(HIDDEN in dg.serialize_value(r) for r in materialized)  # the "server" metadata, shown
    assert all(PASSWORD not in dg.serialize_value(r) for r in records)
    assert PASSWORD not in json.dumps(run.tags) + repr(run.run_config)
    assert _files_holding_the_password(tmp_path, config) == []
