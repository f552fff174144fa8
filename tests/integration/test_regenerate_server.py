"""Regeneration through a real `transformers serve` on 127.0.0.1, hosting a Llama whose greedy reply is set
by its weights (tests/helpers.py `save_scripted_chat_target`), so what the rows must hold is known on any CPU.

Each server is started by the test in its own process group (offline: the model is a local directory) and
stopped by its PID; one is killed with SIGKILL mid-shard to show that the shard fails resumably, and that a
run against a restarted server requests only the samples missing from the journal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from eagle3_core.config import Eagle3Config, RegenerateServerConfig, load_config
from eagle3_core.data.ingest import ingest, load_conversation_shard
from eagle3_core.engines.openai_client import ServerRegenerationFailed
from eagle3_core.steps.data import regenerate_step
from eagle3_core.store.atomic import read_jsonl
from eagle3_core.store.journal import journal_path
from eagle3_core.store.layout import StoreLayout
from eagle3_core.targets.hf import TransformersTarget
from tests.conftest import write_config
from tests.fakes import free_port
from tests.helpers import SCRIPTED_REPLY, save_scripted_chat_target, save_tiny_chat_target

KEY = "srv-00000"
TRANSFORMERS_CLI = Path(sys.executable).parent / "transformers"
N = 8  # conversations in the shard
USERS = [
    "hello there, how are you?",
    "what did you do this weekend",
    "do you like pizza or pasta more",
    "tell me about your dog",
    "the weather is nice today",
    "i went hiking in the hills",
    "what is your favourite colour",
    "any plans for the holidays?",
]


def _conversations() -> list[dict[str, Any]]:
    rows = []
    for i in range(7):
        turns: list[dict[str, str]] = []
        if i % 4 == 0:
            turns.append({"role": "system", "content": "You are a friendly chat partner."})
        for u in range(1 + i % 3):  # one to three assistant turns to regenerate
            turns += [
                {"role": "user", "content": USERS[(i + 3 * u) % len(USERS)] + f" ({i})"},
                {"role": "assistant", "content": "an original human reply"},
            ]
        if i % 5 == 1:
            turns.append({"role": "user", "content": "and then?"})  # ends with a user turn: answered too
        rows.append({"messages": turns})
    rows.append({"messages": [{"role": "user", "content": "I love pizza, do you?"}]})
    return rows


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread here and in the servers: these models are tiny, and on a busy 2-core machine two
    OpenMP threads stall each other (the same greedy generate took 17 s with two threads, 0.13 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _prepare(root: Path, target_dir: Path) -> tuple[Eagle3Config, bytes, dict[str, Any]]:
    """A store with one shard of the conversations, and that shard regenerated in process (the reference:
    its bytes and its metadata)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "c.jsonl", "w") as f:
        for row in _conversations():
            f.write(json.dumps(row) + "\n")
    config = write_config(
        root,
        f"store: store\ndata: {{dataset: srv, holdout_fraction: 0.0, sources: [{{path: c.jsonl}}]}}\n"
        f"target: {{path: {target_dir}, device: cpu}}\n"
        "regenerate: {temperature: 0.0, max_new_tokens: 24, batch_size: 4}\n",
    )
    cfg = load_config(config)
    ingest(cfg)
    target = TransformersTarget(target_dir, cfg.target)
    try:
        result = regenerate_step(cfg, KEY, target)
    finally:
        target.close()
    return cfg, result.path.read_bytes(), result.metadata


@pytest.fixture(scope="module")
def scripted_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_scripted_chat_target(tmp_path_factory.mktemp("scripted") / "target")


@pytest.fixture(scope="module")
def setup(
    tmp_path_factory: pytest.TempPathFactory, scripted_target: Path
) -> tuple[Eagle3Config, bytes, dict[str, Any]]:
    return _prepare(tmp_path_factory.mktemp("regen-server"), scripted_target)


@contextmanager
def transformers_serve(model_dir: Path, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`transformers serve MODEL` on a free loopback port, in its own process group, stopped by its PID."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [str(TRANSFORMERS_CLI), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--device", "cpu", "--log-level", "warning"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"transformers serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"transformers serve not up after 180 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        yield proc, url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


def _with_server(cfg: Eagle3Config, url: str, model_dir: Path, **kw: Any) -> Eagle3Config:
    server = RegenerateServerConfig(url=url, model=str(model_dir), **kw)
    return cfg.model_copy(update={"regenerate": cfg.regenerate.model_copy(update={"server": server})})


def _fresh_shard(cfg: Eagle3Config) -> Path:
    """Forget the regenerated shard of an earlier test, so each test starts from none."""
    layout = StoreLayout(cfg.store_root)
    for path in (
        layout.regenerated(KEY),
        layout.regenerated_manifest(KEY),
        journal_path(layout.regenerated(KEY)),
    ):
        path.unlink(missing_ok=True)
    return layout.regenerated(KEY)


def _kill_after(proc: subprocess.Popen[bytes], samples: int, killed: list[int]) -> Any:
    """A step log that SIGKILLs the server's group once `samples` samples are done: a server lost mid-shard."""

    def log(message: str) -> None:
        if "samples regenerated" in message and not killed:
            done = int(message.split(": ", 1)[1].split("/")[0])
            if done >= samples:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)
                killed.append(done)

    return log


def _check_equal_to_in_process(
    cfg: Eagle3Config, reference: bytes, in_process: dict[str, Any], model_dir: Path, log: Path
) -> dict[str, Any]:
    shard = _fresh_shard(cfg)
    with transformers_serve(model_dir, log) as (_, url):
        result = regenerate_step(_with_server(cfg, url, model_dir, concurrency=4), KEY, None)
    assert result.path.read_bytes() == reference  # the stored rows, byte for byte
    rows = read_jsonl(shard)
    samples, _ = load_conversation_shard(cfg.store_root, KEY)
    assert [r["id"] for r in rows] == [s.id for s in samples]
    assert any(r["turns_regenerated"] == 3 for r in rows)  # later turns saw the server's own replies
    m = result.metadata
    assert m["errors"] == 0 and m["requested_samples"] == N and m["resumed_samples"] == 0
    counted = ("samples", "errors", "replies", "new_tokens", "replies_cut_at_max_new_tokens")
    counted += tuple(k for k in in_process if k.startswith("stopped_"))
    assert {k: m.get(k) for k in counted} == {k: in_process.get(k) for k in counted}
    assert m["new_tokens"] > 0
    assert not journal_path(shard).exists()
    return m


def test_a_shard_through_the_server_equals_in_process_at_temperature_0(
    setup: tuple[Eagle3Config, bytes, dict[str, Any]], scripted_target: Path, tmp_path: Path
) -> None:
    m = _check_equal_to_in_process(*setup, scripted_target, tmp_path / "serve.log")
    # Every reply is the scripted one, ended on end-of-turn before the token limit: end-of-turn handling
    # is compared too, and it is not the end-of-turn token's text that ends the stored reply.
    assert m["replies"] > 0 and m.get("replies_cut_at_max_new_tokens", 0) == 0
    rows = read_jsonl(StoreLayout(setup[0].store_root).regenerated(KEY))
    replies = [t["content"] for r in rows for t in r["messages"] if t["role"] == "assistant"]
    assert len(replies) == m["replies"] and set(replies) == {SCRIPTED_REPLY}


def test_equal_on_a_random_target_whose_replies_depend_on_every_prompt_token(tmp_path: Path) -> None:
    """The scripted target gives every prompt one reply; a random-weight Llama's replies depend on every prompt
    token, byte-level garbage and all (partial UTF-8, control characters), so the prompts and the decoding
    must match exactly."""
    model_dir = save_tiny_chat_target(tmp_path / "random-target")
    _check_equal_to_in_process(*_prepare(tmp_path / "store", model_dir), model_dir, tmp_path / "serve.log")


def test_a_server_killed_mid_shard_fails_resumably_and_a_rerun_requests_only_the_rest(
    setup: tuple[Eagle3Config, bytes, dict[str, Any]], scripted_target: Path, tmp_path: Path
) -> None:
    cfg, reference, _ = setup
    shard = _fresh_shard(cfg)
    transport = {"concurrency": 2, "retries": 1, "backoff_s": 0.05, "max_failed_fraction": 0.0}
    killed: list[int] = []
    failed = pytest.raises(ServerRegenerationFailed, match=r"of 8 samples failed their requests")
    with transformers_serve(scripted_target, tmp_path / "serve1.log") as (proc, url), failed as err:
        regenerate_step(
            _with_server(cfg, url, scripted_target, **transport), KEY, None, _kill_after(proc, 4, killed)
        )
    assert killed, "the server was never killed"
    assert not shard.exists()  # nothing committed
    lines = journal_path(shard).read_text().splitlines()
    journaled = [json.loads(line)["id"] for line in lines[1:]]
    assert 0 < len(journaled) < N and len(set(journaled)) == len(journaled)
    assert f"{len(journaled)} finished samples are kept" in str(err.value)

    # The server back (on another port: the journal is bound to what the replies depend on, not the URL).
    with transformers_serve(scripted_target, tmp_path / "serve2.log") as (_, url):
        result = regenerate_step(_with_server(cfg, url, scripted_target, **transport), KEY, None)
    m = result.metadata
    assert m["resumed_samples"] == len(journaled) and m["requested_samples"] == N - len(journaled)
    assert shard.read_bytes() == reference  # every sample once, in order, as in process
    assert not journal_path(shard).exists()


def test_a_server_killed_mid_shard_leaves_counted_error_rows_when_tolerated(
    setup: tuple[Eagle3Config, bytes, dict[str, Any]], scripted_target: Path, tmp_path: Path
) -> None:
    cfg, reference, _ = setup
    shard = _fresh_shard(cfg)
    killed: list[int] = []
    with transformers_serve(scripted_target, tmp_path / "serve.log") as (proc, url):
        server_cfg = _with_server(
            cfg, url, scripted_target, concurrency=2, retries=1, backoff_s=0.05, max_failed_fraction=1.0
        )
        result = regenerate_step(server_cfg, KEY, None, _kill_after(proc, 4, killed))
    assert killed
    rows = read_jsonl(shard)
    expected = {r["id"]: r for r in map(json.loads, reference.decode().splitlines())}
    assert [r["id"] for r in rows] == list(expected)  # each sample once, in order
    failed = [r for r in rows if "error" in r]
    assert failed and all(r["error"].startswith("request_failed: ") and r["messages"] == [] for r in failed)
    assert all(r == expected[r["id"]] for r in rows if "error" not in r)  # the finished ones are right
    m = result.metadata
    assert m["errors"] == m["request_errors"] == len(failed) and m["samples"] == N - len(failed)
    assert not journal_path(shard).exists()
