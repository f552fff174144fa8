"""Extraction through SGLangHttpBackend against a real HTTP server on loopback that answers with the fixtures.

The server is the one tests/integration/test_sglang_client.py runs, taught `/server_info` and batched
hidden-state requests. Each answer is its fixture (tests/fixtures/sglang/hidden_states_*.json: SGLang's format,
read from its source) for the request's tokens: the fixture's fields and its defect (the rows a radix-cache hit
leaves out, a null, an extra column), with rows made from the tokens so that stored states can be compared.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_core.config import Eagle3Config, TargetConfig, load_config
from eagle3_core.data.conversation import Conversation
from eagle3_core.data.ingest import ingest, load_conversation_shard
from eagle3_core.data.tokenize import ChatTokenizer
from eagle3_core.engines.sglang_capture import capture_hook_specs
from eagle3_core.engines.sglang_client import SGLangError
from eagle3_core.engines.sglang_models import MODELS
from eagle3_core.errors import Eagle3Error
from eagle3_core.steps.data import extract_step
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.shards import ShardReader
from eagle3_core.targets.base import HiddenStates
from eagle3_core.targets.resolve import open_extraction_target
from eagle3_core.targets.sglang import SGLangHttpBackend
from tests.conftest import FIXTURES, write_config
from tests.fakes import FakeHandler, FakeHTTPServer, free_port
from tests.helpers import save_tiny_chat_target
from tests.integration.test_sglang_client import FakeSGLang

H = 32  # the tiny target's hidden size
AUX = (1, 4, 6)
FIXTURE_H = 4  # the fixtures' target


def fixture(kind: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "sglang" / f"hidden_states_{kind}.json").read_text())
    return data


def token_rows(ids: list[int], width: int) -> list[list[float]]:
    """Rows for these tokens, exact in float32: what the stored states must be, value for value."""
    return [[((t * 7 + p * 3 + c) % 64) / 64 - 0.5 for c in range(width)] for p, t in enumerate(ids)]


def answer(kind: str, ids: list[int], width: int) -> dict[str, Any]:
    """The fixture of `kind` as the answer to `ids`, its rows `width` wide (plus the fixture's extra columns)."""
    out = copy.deepcopy(fixture(kind))
    meta = out["meta_info"]
    fixture_rows = meta["hidden_states"][0]
    cached = min(int(meta["cached_tokens"]), len(ids) - 1)
    rows = token_rows(ids, width + len(fixture_rows[0]) - FIXTURE_H)[cached:]
    for r, row in enumerate(fixture_rows):
        for c, value in enumerate(row):
            if value is None:
                rows[min(r, len(rows) - 1)][c] = None  # type: ignore[call-overload]
    meta.update(prompt_tokens=len(ids), cached_tokens=cached, hidden_states=[rows])
    return out


@dataclass
class HiddenStatesFake(FakeSGLang):
    width: int = 4 * H  # rows as eagle3's capture hooks make them: [aux0 | aux1 | aux2 | final]
    kinds: dict[tuple[int, ...], str] = field(default_factory=dict)  # request -> fixture; default "good"
    server_info: dict[str, Any] | None = None  # None: the server has no server-info route (HTTP 404)
    info_route: str = "/server_info"  # SGLang 0.5.23's; releases before it had only /get_server_info
    first_widths: list[int] = field(default_factory=list)  # widths of the first answers (capture not on yet)


class HiddenStatesHandler(FakeHandler):
    server: FakeHTTPServer[HiddenStatesFake]

    def do_GET(self) -> None:
        fake = self.server.state
        if self.path != fake.info_route or fake.server_info is None:
            return self.reply(404, b'{"detail":"Not Found"}')
        self.reply(200, fake.server_info)

    def do_POST(self) -> None:
        fake = self.server.state
        body = self.json_body()
        with fake.lock:
            fake.received.append(body)
        if self.path != "/generate":
            return self.reply(404, b'{"detail":"Not Found"}')
        if fake.status != 200:
            return self.reply(fake.status, fake.error_body)
        kinds = [fake.kinds.get(tuple(ids), "good") for ids in body["input_ids"]]
        if "unencodable" in kinds:
            # a NaN in the states, before 0.5.23: FastAPI's encoder raises "Out of range float values are not
            # JSON compliant" (0.5.23 answers through orjson, which writes null: the "nan" fixture)
            return self.reply(500, b"Internal Server Error")
        with fake.lock:
            width = fake.first_widths.pop(0) if fake.first_widths else fake.width
        self.reply(200, [answer(k, ids, width) for k, ids in zip(kinds, body["input_ids"], strict=True)])


def extraction_server_info(layer_ids: tuple[int, ...] = AUX) -> dict[str, Any]:
    """The part of SGLang's /server_info (its resolved server arguments) the backend reads."""
    return {
        "model_path": "/models/tiny",
        "enable_return_hidden_states": True,
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "forward_hooks": capture_hook_specs(layer_ids, MODELS["LlamaForCausalLM"]),
        "version": "0.5.9",
    }


@pytest.fixture
def server() -> Iterator[HiddenStatesFake]:
    fake = HiddenStatesFake(server_info=extraction_server_info())
    with FakeHTTPServer(HiddenStatesHandler, fake) as httpd:
        fake.url = httpd.url
        yield fake


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target")  # hidden 32, 8 layers


def _write_conversations(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            turns = [
                {"role": "user", "content": "hello " * (i % 7 + 1)},
                {"role": "assistant", "content": f"reply {i} " * (i % 5 + 1)},
            ]
            f.write(json.dumps({"messages": turns}) + "\n")


def _setup(tmp_path: Path, target_dir: Path, url: str, n: int = 12) -> tuple[Eagle3Config, str]:
    _write_conversations(tmp_path / "c.jsonl", n)
    cfg = load_config(
        write_config(
            tmp_path,
            "store: store\ndata: {dataset: t, holdout_fraction: 0.0, sources: [{path: c.jsonl}]}\n"
            f"target: {{path: {target_dir}, aux_layer_ids: {list(AUX)}, backend: {{kind: sglang_http, url: '{url}'}}}}\n"
            "regenerate: {enabled: false}\nextract: {store_dtype: float32, max_batch_tokens: 160}\n",
        )
    )
    [key] = ingest(cfg).all_shards
    return cfg, key


def _tokens(cfg: Eagle3Config, key: str, target_dir: Path) -> dict[str, list[int]]:
    """The token ids extraction sends for each sample id (the pipeline's own tokenisation)."""
    from transformers import AutoTokenizer

    chat = ChatTokenizer.from_config(AutoTokenizer.from_pretrained(target_dir), cfg.tokenize)
    samples, _ = load_conversation_shard(cfg.store_root, key)
    return {
        s.id: chat.tokenize(Conversation(tuple((m.role, m.content) for m in s.messages))).input_ids.tolist()
        for s in samples
    }


def test_extraction_stores_the_good_samples_and_counts_the_bad_with_their_reasons(
    tmp_path: Path, tiny_target_dir: Path, server: HiddenStatesFake
) -> None:
    cfg, key = _setup(tmp_path, tiny_target_dir, server.url)
    tokens = _tokens(cfg, key, tiny_target_dir)
    ids = sorted(tokens)
    bad = {ids[1]: "short", ids[4]: "nan", ids[7]: "unencodable"}
    server.kinds = {tuple(tokens[s]): kind for s, kind in bad.items()}

    target = open_extraction_target(cfg, log=lambda _: None)  # target.backend: sglang_http
    assert isinstance(target, SGLangHttpBackend)
    result = extract_step(cfg, key, target)

    assert result.metadata["failed"] == 3 and result.metadata["samples"] == len(ids) - 3
    manifest = json.loads(result.path.with_suffix(".json").read_text())
    failed = manifest["failed"]
    assert set(failed) == set(bad)
    assert failed[ids[1]].startswith("sglang returned ")
    assert "the radix cache served a cached prefix" in failed[ids[1]]
    assert failed[ids[1]].endswith("launch with --disable-radix-cache")
    assert "null for a hidden-state value" in failed[ids[4]]
    assert "HTTP 500 for this sample, alone too" in failed[ids[7]]
    with ShardReader(result.path) as shard:
        assert sorted(shard.sample_ids) == sorted(set(ids) - set(bad))  # the bad ones never reach a reader
        assert shard.meta.aux_layer_ids == list(AUX)
        assert shard.meta.final_state_convention == "post_norm"
        for i in range(len(shard)):
            s = shard.sample(i)
            sent = tokens[s.sample_id]
            expected = torch.tensor(token_rows(sent, 4 * H))
            assert s.input_ids.tolist() == sent
            assert torch.equal(s.aux_hidden_states, expected[:, : 3 * H])
            assert torch.equal(s.last_hidden_states, expected[:, 3 * H :])
    # batched: lists of input_ids, hidden states asked, one new token
    assert any(len(body["input_ids"]) > 1 for body in server.received)
    assert all(body["return_hidden_states"] is True for body in server.received)
    assert all(
        body["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0} for body in server.received
    )
    # the batch that held the unencodable sample (HTTP 500) was sent again one sample at a time
    bodies = [body["input_ids"] for body in server.received]
    [batch] = [b for b in bodies if tokens[ids[7]] in b and len(b) > 1]
    assert [[t] for t in batch] == [b for b in bodies if len(b) == 1 and b[0] in batch]


def test_a_short_response_is_never_stored(
    tmp_path: Path, tiny_target_dir: Path, server: HiddenStatesFake
) -> None:
    cfg, key = _setup(tmp_path, tiny_target_dir, server.url, n=4)
    tokens = _tokens(cfg, key, tiny_target_dir)
    short = sorted(tokens)[0]
    server.kinds = {tuple(tokens[short]): "short"}
    result = extract_step(cfg, key, open_extraction_target(cfg, log=lambda _: None))
    n = len(tokens[short])
    manifest = json.loads(result.path.with_suffix(".json").read_text())
    assert manifest["failed"] == {
        short: f"sglang returned {n - 2} hidden-state rows for {n} input tokens: the radix cache served a "
        "cached prefix (2 tokens) without running it; launch with --disable-radix-cache"
    }
    with ShardReader(result.path) as shard:
        assert short not in shard.sample_ids and len(shard) == 3
        # its place in the file holds zeros, not the rows SGLang sent
        j = shard.meta.sample_ids.index(short)
        first = sum(shard.meta.lengths[:j])
        input_ids, loss_mask = shard.all_tokens()
        assert not input_ids[first : first + n].any() and not loss_mask[first : first + n].any()


def test_a_wrong_width_stops_the_run_and_writes_no_shard(
    tmp_path: Path, tiny_target_dir: Path, server: HiddenStatesFake
) -> None:
    cfg, key = _setup(tmp_path, tiny_target_dir, server.url, n=6)
    tokens = _tokens(cfg, key, tiny_target_dir)
    server.kinds = {tuple(tokens[sorted(tokens)[2]]): "wide"}
    with pytest.raises(SGLangError, match=r"rows 129 wide, expected 128 .*another model than target.path"):
        extract_step(cfg, key, open_extraction_target(cfg, log=lambda _: None))
    shard = StoreLayout(cfg.store_root).hidden_states(key)
    assert not shard.exists() and not list(shard.parent.glob("*.tmp*"))


@pytest.mark.parametrize(
    ("info", "message"),
    [
        ({"disable_radix_cache": False}, "its radix cache is on.*--disable-radix-cache"),
        ({"enable_return_hidden_states": False}, "--enable-return-hidden-states"),
        ({"return_hidden_states_mode": "last"}, "no hidden states for every prompt token"),
        ({"enable_return_aux_hidden_states": True}, "in place of the final state.*launch without it"),
        ({"chunked_prefill_size": 8192}, r"chunked prefill \(8192 tokens\) splits samples of up to 16384"),
        ({"forward_hooks": None}, r"does not run eagle3's capture hooks, .*--forward-hooks '\["),
        (
            {"forward_hooks": capture_hook_specs([2, 4, 6], MODELS["LlamaForCausalLM"])},
            r"read layers \[2, 4, 6\], .* are \[1, 4, 6\]",
        ),
    ],
)
def test_a_server_set_up_to_lose_rows_is_refused_before_any_sample(
    tiny_target_dir: Path, server: HiddenStatesFake, info: dict[str, Any], message: str
) -> None:
    assert server.server_info is not None
    server.server_info.update(info)
    with pytest.raises(SGLangError, match=f"cannot serve extraction: .*{message}"):
        SGLangHttpBackend(server.url, tiny_target_dir, TargetConfig(aux_layer_ids=AUX), max_seq_len=16384)
    assert server.received == []


def test_an_older_server_is_checked_through_get_server_info_and_mode_full_is_accepted(
    tiny_target_dir: Path, server: HiddenStatesFake
) -> None:
    assert server.server_info is not None
    server.info_route = "/get_server_info"
    server.server_info["disable_radix_cache"] = False
    with pytest.raises(SGLangError, match="its radix cache is on"):
        SGLangHttpBackend(server.url, tiny_target_dir, TargetConfig(aux_layer_ids=AUX))
    # --return-hidden-states-mode full instead of --enable-return-hidden-states
    server.server_info.update(disable_radix_cache=True, enable_return_hidden_states=False)
    server.server_info["return_hidden_states_mode"] = "full"
    backend = SGLangHttpBackend(server.url, tiny_target_dir, TargetConfig(aux_layer_ids=AUX))
    assert backend.check_server() == server.server_info


def test_without_server_info_only_the_responses_are_checked(
    tiny_target_dir: Path, server: HiddenStatesFake
) -> None:
    server.server_info = None  # an SGLang without either route
    backend = SGLangHttpBackend(server.url, tiny_target_dir, TargetConfig(aux_layer_ids=AUX))
    assert backend.check_server() is None
    [states] = backend.hidden_states([[5, 6, 7]])
    assert isinstance(states, HiddenStates) and states.last.shape == (3, H)


def test_a_stock_server_gives_final_states_and_refuses_to_invent_aux(
    tmp_path: Path, tiny_target_dir: Path, server: HiddenStatesFake
) -> None:
    server.width = H  # no capture hooks: the final state only
    backend = SGLangHttpBackend(
        server.url, tiny_target_dir, TargetConfig(aux_layer_ids=AUX), aux_from_response=False
    )
    short = [9, 8, 7, 6]
    server.kinds = {tuple(short): "short"}
    good, failure = backend.final_states([[5, 6, 7], short], torch.bfloat16)
    assert isinstance(good, torch.Tensor) and good.dtype == torch.bfloat16
    assert torch.equal(good.float(), torch.tensor(token_rows([5, 6, 7], H)))
    assert not isinstance(failure, torch.Tensor) and "radix cache" in failure.reason
    with pytest.raises(
        Eagle3Error, match=r"returns only the final hidden state .* No aux states are invented"
    ):
        backend.hidden_states([[5, 6, 7]])
    # and so does extraction through it: no shard
    cfg, key = _setup(tmp_path, tiny_target_dir, server.url, n=3)
    with pytest.raises(Eagle3Error, match="not reachable through it"):
        extract_step(cfg, key, backend)
    assert not StoreLayout(cfg.store_root).hidden_states(key).exists()


def test_a_server_failing_every_sample_stops_the_run(tiny_target_dir: Path, server: HiddenStatesFake) -> None:
    backend = SGLangHttpBackend(server.url, tiny_target_dir, TargetConfig(aux_layer_ids=AUX))
    server.status, server.error_body = 500, b"Internal Server Error"
    with pytest.raises(SGLangError, match=r"failed on every sample of the batch, alone too: .*HTTP 500"):
        backend.hidden_states([[1, 2], [3, 4, 5]])
    server.status, server.error_body = 400, (FIXTURES / "sglang" / "error_validation.json").read_bytes()
    with pytest.raises(SGLangError, match=r"HTTP 400 .*validation error for GenerateReqInput"):
        backend.hidden_states([[1, 2], [3, 4, 5]])


def test_an_unreachable_server_is_named(tiny_target_dir: Path) -> None:
    port = free_port()  # a port that was free a moment ago: nothing listens there
    with pytest.raises(SGLangError, match=rf"server at http://127.0.0.1:{port}/server_info is unreachable"):
        SGLangHttpBackend(f"http://127.0.0.1:{port}", tiny_target_dir, TargetConfig(aux_layer_ids=AUX))


def test_the_backend_waits_for_the_capture_to_be_on(tiny_target_dir: Path, server: HiddenStatesFake) -> None:
    # a server started without its warm-up request: its first forward runs before the hooks turn capture on
    server.first_widths = [H]
    SGLangHttpBackend(server.url, tiny_target_dir, TargetConfig(aux_layer_ids=AUX))
    assert len(server.received) == 2
    server.first_widths = [H] * 3
    with pytest.raises(
        Eagle3Error, match=r"still returns hidden-state rows 32 wide after 3 requests, not 128"
    ):
        SGLangHttpBackend(server.url, tiny_target_dir, TargetConfig(aux_layer_ids=AUX))
