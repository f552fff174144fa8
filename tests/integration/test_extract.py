"""Extraction against a real transformers model: layer convention, batch invariance, the shard it writes."""

import json
from pathlib import Path

import pytest
import torch

from eagle3_core.config import TargetConfig, load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.pipeline import extract_step, length_batches
from eagle3_core.store.shards import ShardReader
from eagle3_core.targets.hf import TransformersTarget
from tests.conftest import write_config
from tests.helpers import save_tiny_chat_target


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path) -> TransformersTarget:
    return TransformersTarget(tiny_target_dir, TargetConfig(aux_layer_ids=(1, 4, 6)))


def _conversations(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            turns = [
                {"role": "user", "content": "hello " * (i % 7 + 1)},
                {"role": "assistant", "content": f"reply {i} " * (i % 5 + 1)},
            ]
            if i % 3 == 0:
                turns += [
                    {"role": "user", "content": "and then?"},
                    {"role": "assistant", "content": "the end " * (i % 4 + 1)},
                ]
            f.write(json.dumps({"messages": turns}) + "\n")


def test_stored_aux_rows_are_output_hidden_states_k(
    tmp_path: Path, tiny_target_dir: Path, target: TransformersTarget
) -> None:
    _conversations(tmp_path / "c.jsonl", 12)
    cfg = load_config(
        write_config(
            tmp_path,
            f"store: store\ndata: {{dataset: t, holdout_fraction: 0.0, sources: [{{path: c.jsonl}}]}}\n"
            f"target: {{path: {tiny_target_dir}, aux_layer_ids: [1, 4, 6]}}\n"
            "regenerate: {enabled: false}\nextract: {store_dtype: float32, max_batch_tokens: 200}\n",
        )
    )
    [key] = ingest(cfg).all_shards
    result = extract_step(cfg, key, target)
    assert result.metadata["samples"] == 12
    with ShardReader(result.path) as shard:
        assert shard.metadata["aux_layer_ids"] == [1, 4, 6]
        assert shard.metadata["aux_layer_convention"] == "input_of_layer"
        assert shard.metadata["final_state_convention"] == "post_norm"
        for i in range(len(shard)):
            s = shard.sample(i)
            with torch.inference_mode():
                ref = target.model(s.input_ids.long()[None], output_hidden_states=True).hidden_states
            for j, k in enumerate((1, 4, 6)):
                torch.testing.assert_close(
                    s.aux_hidden_states[:, j * 32 : (j + 1) * 32], ref[k][0], rtol=1e-5, atol=1e-5
                )
            torch.testing.assert_close(
                s.last_hidden_states, ref[-1][0], rtol=1e-5, atol=1e-5
            )  # normed: post_norm
            assert int(s.loss_mask.sum()) > 0


def test_truncation_is_counted(tmp_path: Path, tiny_target_dir: Path, target: TransformersTarget) -> None:
    _conversations(tmp_path / "c.jsonl", 12)
    base = (
        f"store: store{{n}}\ndata: {{{{dataset: t, holdout_fraction: 0.0, sources: [{{{{path: c.jsonl}}}}]}}}}\n"
        f"target: {{{{path: {tiny_target_dir}, aux_layer_ids: [1, 4, 6]}}}}\nregenerate: {{{{enabled: false}}}}\n"
    )
    full_cfg = load_config(write_config(tmp_path, base.format(n=1)))
    [key] = ingest(full_cfg).all_shards
    full = extract_step(full_cfg, key, target)
    short_cfg = load_config(write_config(tmp_path, base.format(n=2) + "tokenize: {max_seq_len: 24}\n"))
    ingest(short_cfg)
    short = extract_step(short_cfg, key, target)
    with ShardReader(full.path) as f:
        lengths = dict(zip(f.sample_ids, f.lengths, strict=True))
    cut = {s: n - 24 for s, n in lengths.items() if n > 24}
    assert cut, "the fixture must have samples longer than 24 tokens"
    assert short.metadata["truncated_samples"] == len(cut)
    assert short.metadata["truncated_tokens"] == sum(cut.values())
    assert short.metadata["tokens"] + short.metadata["truncated_tokens"] <= full.metadata["tokens"]
    with ShardReader(short.path) as s:
        assert max(s.lengths) == 24


def test_a_sample_gets_the_same_states_alone_or_in_a_mixed_batch_of_8(target: TransformersTarget) -> None:
    g = torch.Generator().manual_seed(1)
    lengths = [37, 5, 64, 12, 50, 3, 29, 41]
    batch = [torch.randint(10, 300, (n,), generator=g).tolist() for n in lengths]
    together = target.hidden_states(batch)
    for seq, states in zip(batch, together, strict=True):
        [alone] = target.hidden_states([seq])
        assert states.aux.shape == (len(seq), 96) and states.last.shape == (len(seq), 32)
        torch.testing.assert_close(states.aux, alone.aux, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states.last, alone.last, rtol=1e-5, atol=1e-5)


def test_length_batches_respect_the_token_budget() -> None:
    lengths = [5, 100, 30, 30, 7, 64, 2, 300]
    batches = list(length_batches(lengths, max_tokens=128, max_size=3))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 128
