"""FP8 extraction quantised on the target's device (`TransformersTarget.quantizes_on_device`) against the shard
writer's quantising of the bfloat16 states the target hands over otherwise: the same bytes, the same failures."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_core.config import Eagle3Config, TargetConfig, load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.steps.data import extract_step
from eagle3_core.store import shards as shards_module
from eagle3_core.store.fp8 import FP8, NonFiniteStates, quantize
from eagle3_core.store.shards import ShardReader
from eagle3_core.targets.base import HiddenStates, SampleFailure
from eagle3_core.targets.hf import TransformersTarget
from tests.conftest import write_config
from tests.helpers import save_tiny_chat_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")
MARKER = "~"  # in one conversation only: where its token is embedded, the test makes the states NaN


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> TransformersTarget:
    directory = save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target")
    return TransformersTarget(directory, TargetConfig(aux_layer_ids=(1, 4, 6)))


def _conversations(path: Path, n: int, poisoned: int | None = None) -> None:
    with open(path, "w") as f:
        for i in range(n):
            reply = f"reply {i} " * (i % 5 + 1) + (f" {MARKER}{MARKER} and more" if i == poisoned else "")
            turns = [
                {"role": "user", "content": "hello " * (i % 7 + 1)},
                {"role": "assistant", "content": reply},
            ]
            f.write(json.dumps({"messages": turns}) + "\n")


def _config(
    directory: Path, conversations: Path, target: TransformersTarget, batch_tokens: int
) -> Eagle3Config:
    return load_config(
        write_config(
            directory,
            f"store: store\ndata: {{dataset: t, holdout_fraction: 0.0, sources: [{{path: {conversations}}}]}}\n"
            f"target: {{path: {target.model_dir}, aux_layer_ids: [1, 4, 6]}}\nregenerate: {{enabled: false}}\n"
            f"extract: {{store_dtype: fp8_e4m3, max_batch_tokens: {batch_tokens}}}\n",
        )
    )


def _extract_both_ways(
    tmp_path: Path, target: TransformersTarget, monkeypatch: pytest.MonkeyPatch, batch_tokens: int
) -> dict[str, tuple[Path, int]]:
    """The conversations extracted to FP8 shards once per path: each shard and how often the writer quantised."""
    calls = {"n": 0}

    def counted(states: torch.Tensor, groups: int) -> Any:
        calls["n"] += 1
        return quantize(states, groups)

    monkeypatch.setattr(shards_module, "quantize", counted)
    out: dict[str, tuple[Path, int]] = {}
    for way, on_device in (("device", True), ("writer", False)):
        monkeypatch.setattr(target, "quantizes_on_device", on_device)
        cfg = _config(tmp_path / way, tmp_path / "c.jsonl", target, batch_tokens)
        [key] = ingest(cfg).all_shards
        calls["n"] = 0
        out[way] = (extract_step(cfg, key, target).path, calls["n"])
    return out


def test_a_device_quantised_fp8_shard_is_byte_identical_to_the_writer_quantised_one(
    tmp_path: Path, target: TransformersTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    _conversations(tmp_path / "c.jsonl", 12)
    shards = _extract_both_ways(tmp_path, target, monkeypatch, batch_tokens=200)  # several padded batches
    (device, device_calls), (writer, writer_calls) = shards["device"], shards["writer"]
    assert device_calls == 0 and writer_calls == 2 * 12  # aux and last of each sample, in the writer only
    assert device.read_bytes() == writer.read_bytes()  # states, scales, digests, header: all of it
    assert device.with_suffix(".json").read_text() == writer.with_suffix(".json").read_text()
    with ShardReader(device) as r:
        assert len(r) == 12 and r.verify() == [] and r.meta.failed == {}
        assert r.header["aux_hidden_states"]["dtype"] == "F8_E4M3" and r.header["aux_scales"]["shape"][1] == 3


def test_the_target_hands_over_fp8_as_the_writer_would_quantise_its_bfloat16(
    target: TransformersTarget,
) -> None:
    g = torch.Generator().manual_seed(3)
    batch = [torch.randint(10, 300, (n,), generator=g).tolist() for n in (37, 5, 64, 12)]
    as_fp8 = target.hidden_states(batch, FP8)
    as_bf16 = target.hidden_states(batch, torch.bfloat16)
    for seq, q, ref in zip(batch, as_fp8, as_bf16, strict=True):
        assert isinstance(q, HiddenStates) and isinstance(ref, HiddenStates)
        assert q.aux.dtype == FP8 and q.aux.shape == (len(seq), 96) and q.last.shape == (len(seq), 32)
        assert q.aux_scales is not None and q.last_scales is not None
        assert q.aux_scales.shape == (len(seq), 3) and q.last_scales.shape == (len(seq), 1)
        for values, scales, states, groups in (
            (q.aux, q.aux_scales, ref.aux, 3),
            (q.last, q.last_scales, ref.last, 1),
        ):
            want = quantize(states, groups)
            assert torch.equal(values.view(torch.uint8), want.values.view(torch.uint8))
            assert torch.equal(scales, want.scales)


def _nan_at(token: int) -> Callable[..., torch.Tensor]:
    def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output.masked_fill((args[0] == token)[..., None], float("nan"))  # that token's embedding

    return hook


@pytest.fixture
def nan_embeddings(target: TransformersTarget) -> Iterator[None]:
    """The embeddings of MARKER's token are NaN: its sample's states hold NaN from there on, no other's."""
    [token] = target.tokenizer.encode(MARKER * 2, add_special_tokens=False)[:1]
    handle = target.model.get_input_embeddings().register_forward_hook(_nan_at(token))
    yield
    handle.remove()


@pytest.mark.usefixtures("nan_embeddings")
def test_a_sample_with_nan_states_fails_with_the_same_reason_either_way_and_the_batch_is_kept(
    tmp_path: Path, target: TransformersTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    _conversations(tmp_path / "c.jsonl", 10, poisoned=4)
    shards = _extract_both_ways(tmp_path, target, monkeypatch, batch_tokens=8192)  # one batch of 10
    (device, _), (writer, _) = shards["device"], shards["writer"]
    with ShardReader(device) as d, ShardReader(writer) as w:
        assert d.meta.failed == w.meta.failed and len(d.meta.failed) == 1
        [reason] = d.meta.failed.values()
        assert reason.startswith("non-finite hidden states: ") and "FP8 cannot store them" in reason
        assert int(reason.split()[3]) > 0  # the count of NaN values, the same on both sides
        assert len(d) == 9 and d.verify() == [] and d.meta.counts.failed == 1
        for i in range(len(d)):
            s = d.sample(i)
            assert bool(torch.isfinite(s.aux_hidden_states.float()).all()) and int(s.loss_mask.sum()) > 0
    assert device.read_bytes() == writer.read_bytes()


def test_the_target_fails_the_nan_sample_with_the_reason_the_writer_gives_its_bfloat16(
    target: TransformersTarget,
) -> None:
    [token] = target.tokenizer.encode(MARKER * 2, add_special_tokens=False)[:1]
    batch = [[20, 21, 22, 23, 24], [20, token, 22], [30, 31]]
    handle = target.model.get_input_embeddings().register_forward_hook(_nan_at(token))
    try:
        as_fp8 = target.hidden_states(batch, FP8)
        [_, poisoned, _] = target.hidden_states(batch, torch.bfloat16)
    finally:
        handle.remove()
    assert isinstance(as_fp8[0], HiddenStates) and isinstance(as_fp8[2], HiddenStates)
    assert isinstance(poisoned, HiddenStates)
    with pytest.raises(NonFiniteStates) as refused:
        quantize(poisoned.aux, 3)  # what the writer quantises first, and fails the sample with
    assert as_fp8[1] == SampleFailure(refused.value.reason)
    assert refused.value.count == int((~torch.isfinite(poisoned.aux.float())).sum()) > 0
