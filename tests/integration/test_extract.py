"""Extraction against a real transformers model: layer convention, batch invariance, the shard it writes,
and what becomes of that shard when a byte flips, the disk fills or a second extraction starts."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_cli.steps import main
from eagle3_core.config import Eagle3Config, TargetConfig, load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.errors import DiskSpaceError
from eagle3_core.steps.data import extract_step, length_batches
from eagle3_core.store import shards as shards_module
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.shards import ShardReader
from eagle3_core.store.stats import shard_done, store_stats, verify_shard
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
        assert shard.meta.aux_layer_ids == [1, 4, 6]
        assert shard.meta.aux_layer_convention == "input_of_layer"
        assert shard.meta.final_state_convention == "post_norm"
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


def test_a_shard_with_no_sample_left_to_train_on_is_one_line_and_no_shard(
    tmp_path: Path, tiny_target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An end of turn the template never writes drops every sample: a setting, not the data. Seen on the H200
    host, where transformers 5.17 gave SmolLM2's tokenizer the eos <|im_start|> and extraction wrote 13
    empty shards; the vocabulary step then failed far from the cause."""
    _conversations(tmp_path / "c.jsonl", 6)
    config = write_config(
        tmp_path,
        f"store: store\ndata: {{dataset: t, holdout_fraction: 0.0, sources: [{{path: c.jsonl}}]}}\n"
        f"target: {{path: {tiny_target_dir}, aux_layer_ids: [1, 4, 6]}}\nregenerate: {{enabled: false}}\n"
        "tokenize: {end_of_turn: '<never-written>'}\n",
    )
    assert main(["--config", str(config), "ingest"]) == 0
    capsys.readouterr()
    assert main(["--config", str(config), "extract"]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert "none of its 6 conversations can be trained on; 6 dropped for: template: end-of-turn" in lines[0]
    assert "'<never-written>' not found" in lines[0] and lines[0].endswith("set tokenize.end_of_turn")
    assert not StoreLayout(tmp_path / "store").hidden_state_shards()


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


# ---- faults ------------------------------------------------------------------------------------------------
def _extract_project(tmp_path: Path, tiny_target_dir: Path) -> tuple[Path, Eagle3Config, str]:
    _conversations(tmp_path / "c.jsonl", 12)
    config = write_config(
        tmp_path,
        f"store: store\ndata: {{dataset: t, holdout_fraction: 0.0, sources: [{{path: c.jsonl}}]}}\n"
        f"target: {{path: {tiny_target_dir}, aux_layer_ids: [1, 4, 6]}}\n"
        "regenerate: {enabled: false}\nextract: {store_dtype: float32}\n",
    )
    cfg = load_config(config)
    [key] = ingest(cfg).all_shards
    return config, cfg, key


def _error_line(out: str) -> str:
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and out.strip().splitlines()[-1] == errors[0] and "Traceback" not in out, out
    return errors[0]


def test_a_flipped_byte_in_an_extracted_shard_stops_eagle3_train_before_anything_is_built(
    tmp_path: Path, tiny_target_dir: Path, target: TransformersTarget, capsys: pytest.CaptureFixture[str]
) -> None:
    config, cfg, key = _extract_project(tmp_path, tiny_target_dir)
    path = extract_step(cfg, key, target).path
    with ShardReader(path) as shard:
        first = int(shard._offsets[shard._index[4]])
        entry = shard.header["aux_hidden_states"]
        position = shard._data_start + entry["data_offsets"][0] + first * 4 * 96 + 17
        sample_id = shard.sample_ids[4]
    raw = bytearray(path.read_bytes())
    raw[position] ^= 0x01
    path.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["--config", str(config), "train"]) == 2
    line = _error_line(capsys.readouterr().out)
    assert f"shard {key} is damaged" in line and f"sample 4 ({sample_id[:12]}) fails its checksum" in line
    assert f"eagle3 extract --shard {key} --force" in line
    layout = StoreLayout(cfg.store_root)
    assert not layout.vocab_mapping.exists() and not (layout.root / "drafter").exists()


def test_a_disk_full_at_the_manifest_leaves_no_shard_and_the_next_extract_redoes_it(
    tmp_path: Path, tiny_target_dir: Path, target: TransformersTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, cfg, key = _extract_project(tmp_path, tiny_target_dir)

    def full(*_: object) -> Path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(shards_module, "write_temp", full)
        with pytest.raises(DiskSpaceError, match=f"shard {key}: the disk filled up while finishing"):
            extract_step(cfg, key, target)
    layout = StoreLayout(cfg.store_root)
    assert not layout.hidden_states(key).exists() and not layout.hidden_states_manifest(key).exists()
    assert [p for p in layout.hidden_states_dir.iterdir() if ".tmp-" in p.name] == []
    assert store_stats(cfg.store_root).shards == [] and not shard_done(cfg.store_root, key)
    assert main(["--config", str(config), "extract"]) == 0  # not done, so extracted again
    assert shard_done(cfg.store_root, key) and verify_shard(layout.hidden_states(key)).ok
    assert [r.key for r in store_stats(cfg.store_root).shards] == [key]


HOLDER = """
import sys
from pathlib import Path
from eagle3_core.store.locks import writer_lock
with writer_lock(Path(sys.argv[1]), "test"):
    Path(sys.argv[2]).write_bytes(b"rows of a live extraction")
    print("held", flush=True)
    sys.stdin.readline()
"""


def test_a_second_eagle3_extract_of_a_shard_is_refused_and_leaves_the_first_ones_file(
    tmp_path: Path, tiny_target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config, cfg, key = _extract_project(tmp_path, tiny_target_dir)
    layout = StoreLayout(cfg.store_root)
    live = layout.hidden_states_dir / f".{key}.safetensors.tmp-999999"
    live.parent.mkdir(parents=True)
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(layout.writer_lock("hidden_states", key)), str(live)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "held"
        assert main(["--config", str(config), "extract", "--shard", key]) == 2
        line = _error_line(capsys.readouterr().out)
        assert f"hidden-state shard {key} is being written by another process (pid {first.pid}" in line
        assert live.read_bytes() == b"rows of a live extraction" and not layout.hidden_states(key).exists()
    finally:
        first.communicate("\n", timeout=30)
    assert main(["--config", str(config), "extract", "--shard", key]) == 0  # free once the first is done
    assert shard_done(cfg.store_root, key) and not live.exists()  # the lock holder clears stale files
