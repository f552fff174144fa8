"""The store's records (shard headers and manifests, conversation and regenerated-response manifests) write
the bytes the dict writers wrote before them, and a torn or wrong file is one line naming it and the field.

tests/fixtures/records holds files written by the dict writers (the shard manifests from `_write_shards`'
inputs, the conversation manifest by ingesting fixtures/bad_rows.jsonl); the shards themselves are pinned
by digest (they are mostly header padding).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_core.data.ingest import Ledger, SourceEntry
from eagle3_core.errors import RecordError, ShardCorruptError
from eagle3_core.store.atomic import atomic_write_json
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import (
    ConversationManifest,
    RegeneratedManifest,
    ShardFacts,
    ShardManifest,
    TargetFacts,
    VocabInfo,
)
from eagle3_core.store.shards import ShardReader, ShardWriter, decode_metadata, read_header
from eagle3_core.store.stats import store_stats
from tests.conftest import FIXTURES
from tests.records import ingest_bad_rows

RECORDS = FIXTURES / "records"
H = 8
# sha256 of the shards `_write_shards` makes. The dict writer (main before the records) wrote these bytes; the
# rows were then made exact on every CPU (they were torch.linspace, which rounds per kernel set), which changed
# the data and the manifests' two checksums, nothing of the format
SHARD_DIGESTS = {
    "d-00000": "0566e1a4a0b59f243a530e4a71e6deef7c94b26ffc3181779c22876d808e583f",
    "r-00001": "de48709ae7c8438f51b72ccb3461d29c1ef7b8a440a802f0ca4e88e39f652b99",
}
TARGET = TargetFacts(
    name="toy-xs", fingerprint="a" * 64, num_layers=8, hidden_size=H, vocab_size=500, compute_dtype="float32"
)


def _rows(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    ids = torch.arange(seed, seed + n, dtype=torch.int32)
    mask = (torch.arange(n) % 3 != 0).to(torch.uint8)
    # exact in float32 (integers over a power of two) on any CPU: torch.linspace rounds differently under
    # each kernel set (ATEN_CPU_CAPABILITY), and these bytes are compared with a digest
    aux = (torch.arange(n * 3 * H, dtype=torch.float32) / 64 - 2 + seed).reshape(n, 3 * H)
    last = (1 - torch.arange(n * H, dtype=torch.float32) / 32).reshape(n, H) * seed
    return ids, mask, aux, last


def _shard(
    path: Path,
    ids: list[str],
    lengths: list[int],
    dtype: str,
    facts: ShardFacts,
    counts: dict[str, int],
    fail: int,
) -> None:
    with ShardWriter(
        path, sample_ids=ids, lengths=lengths, hidden_size=H, store_dtype=dtype, facts=facts
    ) as w:
        for i, n in enumerate(lengths):
            if i == fail:
                w.mark_failed(i, "target: out of memory")
            else:
                w.write_sample(i, *_rows(n, i + 1))
        w.finalize(counts)


def _write_shards(directory: Path) -> None:
    """An extracted shard (a failed sample, one dropped, held-out conversations skipped) and a regenerated
    one (a regeneration error, float32 states), with every fact extraction records."""
    _shard(
        directory / "d-00000.safetensors",
        [f"{i:064x}" for i in range(4)],
        [5, 7, 3, 6],
        "bfloat16",
        ShardFacts(
            conversation_shard="d-00000",
            regenerated=False,
            target=TARGET,
            tokenizer_fingerprint="b" * 64,
            aux_layer_ids=[1, 4, 6],
            aux_layer_convention="input_of_layer",
            final_state_convention="post_norm",
            max_seq_len=64,
            dropped={"f" * 64: "template: no assistant turn"},
        ),
        {
            "truncated_samples": 1,
            "truncated_tokens": 9,
            "truncated_loss_tokens": 4,
            "heldout_skipped": 2,
            "dropped": 1,
        },
        fail=2,
    )
    _shard(
        directory / "r-00001.safetensors",
        [f"{i + 16:064x}" for i in range(3)],
        [4, 2, 9],
        "float32",
        ShardFacts(
            conversation_shard="r-00001",
            regenerated=True,
            target=TARGET,
            tokenizer_fingerprint="c" * 64,
            aux_layer_ids=[2, 4, 5],
            aux_layer_convention="input_of_layer",
            final_state_convention="pre_norm",
            max_seq_len=32,
            dropped={},
        ),
        {
            "truncated_samples": 0,
            "truncated_tokens": 0,
            "truncated_loss_tokens": 0,
            "regeneration_errors": 1,
            "dropped": 0,
        },
        fail=-1,
    )


def test_the_record_writer_writes_the_shards_and_manifests_the_dict_writer_wrote(tmp_path: Path) -> None:
    _write_shards(tmp_path)
    for key, digest in SHARD_DIGESTS.items():
        assert hashlib.sha256((tmp_path / f"{key}.safetensors").read_bytes()).hexdigest() == digest
        assert (tmp_path / f"{key}.json").read_bytes() == (RECORDS / f"hidden_states-{key}.json").read_bytes()
    with ShardReader(tmp_path / "d-00000.safetensors") as reader:
        assert reader.meta.counts is not None and reader.meta.counts.errors == 2  # failed 1, dropped 1
        assert reader.meta.target == TARGET and len(reader) == 3


@pytest.mark.parametrize("key", sorted(SHARD_DIGESTS))
def test_a_shard_manifest_reads_and_rewrites_byte_identically(tmp_path: Path, key: str) -> None:
    golden = RECORDS / f"hidden_states-{key}.json"
    manifest = ShardManifest.read(golden)
    manifest.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == golden.read_bytes()
    assert (
        manifest.key == key and manifest.counts.samples == len(manifest.sample_ids) - manifest.counts.failed
    )


def test_a_conversation_manifest_is_the_bytes_ingest_wrote(tmp_path: Path) -> None:
    golden = RECORDS / "conversations-t-00000.json"
    ConversationManifest.read(golden).write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == golden.read_bytes()
    layout = ingest_bad_rows(tmp_path)
    assert layout.conversations_manifest("t-00000").read_bytes() == golden.read_bytes()


def _regenerated(server: bool) -> dict[str, Any]:
    """regenerated/<key>.json as `steps.data.regenerate_step` wrote it as a dict, key for key."""
    source: dict[str, Any] = (
        {
            "server": "http://127.0.0.1:30000",
            "resumed_samples": 1,
            "requested_samples": 3,
            "request_retries": 2,
        }
        if server
        else {"target": "0123456789abcdef"}
    )
    counts = {"replies_cut_at_max_new_tokens": 1, "request_errors": 1, "stopped_eos": 2} if server else {}
    return {
        "key": "r-00001",
        "samples": 3,
        "errors": 1,
        "heldout_skipped": 2,
        "replies": 5,
        "new_tokens": 321,
        "tokens_per_second": 42.5,
        "seconds": 7.55,
        **counts,
        **source,
        "temperature": 0.0,
        "max_new_tokens": 64,
    }


@pytest.mark.parametrize("server", [True, False])
def test_a_regenerated_manifest_writes_the_dicts_bytes(tmp_path: Path, server: bool) -> None:
    atomic_write_json(tmp_path / "dict.json", _regenerated(server))
    record = RegeneratedManifest.model_validate(_regenerated(server))
    record.write(tmp_path / "record.json")
    assert (tmp_path / "record.json").read_bytes() == (tmp_path / "dict.json").read_bytes()
    assert RegeneratedManifest.read(tmp_path / "record.json") == record
    assert record.counts == (
        {"replies_cut_at_max_new_tokens": 1, "request_errors": 1, "stopped_eos": 2} if server else {}
    )


def _store_with(tmp_path: Path, text: str) -> Path:
    """A store whose one shard has the manifest `text` (the shard file an empty stand-in: stats never opens it)."""
    layout = StoreLayout(tmp_path / "store")
    layout.hidden_states_dir.mkdir(parents=True)
    layout.hidden_states("d-00000").touch()
    layout.hidden_states_manifest("d-00000").write_text(text)
    return layout.hidden_states_manifest("d-00000")


def test_a_torn_manifest_is_one_line_naming_the_file(tmp_path: Path) -> None:
    text = (RECORDS / "hidden_states-d-00000.json").read_text()
    path = _store_with(tmp_path, text[: len(text) // 2])
    with pytest.raises(RecordError) as err:
        store_stats(tmp_path / "store")
    assert str(err.value).startswith(f"{path}: not valid JSON") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda m: m["counts"].pop("samples"), "counts.samples: Field required"),
        (lambda m: m.update(lengths=[5, "7"]), "lengths[1]: Input should be a valid integer"),
        (
            lambda m: m["target"].update(vocab_size=500.0),
            "target.vocab_size: Input should be a valid integer",
        ),
        (lambda m: m.update(final_state_convention="sideways"), "final_state_convention: Input should be"),
        (lambda m: m.update(surplus=1), "surplus: Extra inputs are not permitted"),
    ],
)
def test_a_wrong_manifest_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, change: Any, field: str
) -> None:
    manifest = json.loads((RECORDS / "hidden_states-d-00000.json").read_text())
    change(manifest)
    path = _store_with(tmp_path, json.dumps(manifest))
    with pytest.raises(RecordError) as err:
        store_stats(tmp_path / "store")
    assert str(err.value).startswith(f"{path}: {field}") and "\n" not in str(err.value)


def test_a_shard_header_that_does_not_fit_its_record_names_the_shard_and_the_field(tmp_path: Path) -> None:
    _write_shards(tmp_path)
    path = tmp_path / "d-00000.safetensors"
    header, _ = read_header(path)
    header["__metadata__"]["num_aux"] = '"three"'
    with pytest.raises(ShardCorruptError) as err:
        decode_metadata(header, path)
    assert str(err.value) == f"{path}: num_aux: Input should be a valid integer"


def test_a_vocab_info_writes_the_dicts_bytes(tmp_path: Path) -> None:
    """vocab_mapping.json as `VocabMapping.info()` returned it as a dict, key for key."""
    info = {
        "schema": "eagle3.vocab_mapping/1",
        "fingerprint": "f" * 64,
        "tokenizer_fingerprint": "b" * 64,
        "target_vocab_size": 500,
        "draft_vocab_size": 32,
        "coverage": 0.96875,
        "counted_tokens": 64,
        "distinct_tokens": 30,
        "padded": 2,
        "shard_set": [["d-00000", "a" * 64], ["d-00001", "c" * 64]],
    }
    atomic_write_json(tmp_path / "dict.json", info)
    record = VocabInfo.model_validate(info)
    record.write(tmp_path / "record.json")
    assert (tmp_path / "record.json").read_bytes() == (tmp_path / "dict.json").read_bytes()
    assert json.dumps(record.dump()) == json.dumps(info)  # the copy in the safetensors metadata
    assert VocabInfo.read(tmp_path / "record.json") == record and record.shard_set[1] == ("d-00001", "c" * 64)


def test_the_ledger_writes_the_dicts_bytes_and_reads_back(tmp_path: Path) -> None:
    """ledger.json as `Ledger.save` wrote it as a dict, key for key."""
    ledger = Ledger("t", 256, 2, {"rows.jsonl": SourceEntry(11, "d" * 64, ["t-00000", "t-00001"])})
    atomic_write_json(
        tmp_path / "dict.json",
        {
            "version": 1,
            "dataset": "t",
            "shard_size": 256,
            "next_index": 2,
            "sources": {"rows.jsonl": {"rows": 11, "digest": "d" * 64, "shards": ["t-00000", "t-00001"]}},
        },
    )
    ledger.save(tmp_path / "ledger.json")
    assert (tmp_path / "ledger.json").read_bytes() == (tmp_path / "dict.json").read_bytes()
    assert Ledger.load(tmp_path / "ledger.json", "t", 128) == Ledger("t", 128, 2, ledger.sources)
    (tmp_path / "ledger.json").write_text('{"version": 1, "dataset": "t"}')
    with pytest.raises(RecordError, match=r"ledger.json: shard_size: Field required \(and 2 more\)"):
        Ledger.load(tmp_path / "ledger.json", "t", 128)
