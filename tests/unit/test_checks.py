"""The check verdicts, from stores built by hand: a real ingest of a fixture with bad rows, real shards."""

import json
import shutil
from pathlib import Path

import pytest

from eagle3_core.config import ConfigError, load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.draft.vocab import build_vocab_mapping, save_vocab_mapping
from eagle3_core.store.checks import reject_rate, shard_complete, shard_integrity, vocab_coverage
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.shards import read_header
from tests.conftest import FIXTURES, write_config
from tests.records import write_shard

H = 4
TOK = "a" * 64


def _ingested(tmp_path: Path) -> tuple[Path, str]:
    """bad_rows.jsonl ingested: 10 rows, 4 conversations (all training), 6 rejected of which 1 a duplicate."""
    shutil.copy(FIXTURES / "bad_rows.jsonl", tmp_path / "rows.jsonl")
    config = write_config(
        tmp_path, "store: store\ndata: {dataset: fx, holdout_fraction: 0.0, sources: [{path: rows.jsonl}]}\n"
    )
    [key] = ingest(load_config(config)).all_shards
    return tmp_path / "store", key


# ---- shard_complete --------------------------------------------------------------------------------------
def test_a_whole_shard_is_complete_with_failures_and_drops_accounted(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    write_shard(root, key, failed=1, dropped=1)
    verdict = shard_complete(root, key)
    assert verdict.passed, verdict.reason
    f = verdict.figures
    assert (f["train_conversations"], f["samples"], f["failed"], f["dropped"]) == (4, 2, 1, 1)
    assert f["accounted"] == 4 and f["temporary_files"] == 0


def test_a_torn_conversation_row_fails_the_check_naming_the_line(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    write_shard(root, key)
    path = StoreLayout(root).conversations(key)
    lines = path.read_text(encoding="utf-8").splitlines()
    path.write_text("\n".join([lines[0], lines[1].replace('"split"', '"spilt"'), *lines[2:]]) + "\n")
    verdict = shard_complete(root, key)  # fails, does not raise
    assert not verdict.passed and verdict.reason.startswith(f"{path} line 2: split: Field required")


def test_a_conversation_lost_without_a_count_fails_completeness(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    write_shard(root, key, skip=1)
    verdict = shard_complete(root, key)
    assert not verdict.passed
    assert verdict.figures["accounted"] == 3 and verdict.figures["train_conversations"] == 4
    assert "4 training conversations" in verdict.reason


def test_an_unfinished_write_fails_completeness(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    shard = write_shard(root, key)
    (shard.parent / f".{shard.name}.tmp-4242").write_bytes(b"\0" * 64)
    verdict = shard_complete(root, key)
    assert not verdict.passed and verdict.figures["temporary_files"] == 1
    assert "unfinished write" in verdict.reason


@pytest.mark.parametrize("remove", ["shard", "manifest"])
def test_a_missing_file_fails_completeness(tmp_path: Path, remove: str) -> None:
    root, key = _ingested(tmp_path)
    shard = write_shard(root, key)
    gone = shard if remove == "shard" else shard.with_suffix(".json")
    gone.unlink()
    verdict = shard_complete(root, key)
    assert not verdict.passed and str(gone) in verdict.reason


def test_a_shard_not_extracted_at_all_is_not_complete(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    assert not shard_complete(root, key).passed


def test_a_shard_whose_size_differs_from_its_manifest_is_not_complete(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    shard = write_shard(root, key)
    with open(shard, "ab") as f:
        f.write(b"\0")
    verdict = shard_complete(root, key)
    assert not verdict.passed and "bytes" in verdict.reason


# ---- shard_integrity -------------------------------------------------------------------------------------
def test_a_good_shard_passes_integrity_and_one_flipped_byte_fails_it(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    shard = write_shard(root, key)
    good = shard_integrity(root, key)
    assert good.passed and good.figures["problems"] == 0, good.reason
    _, data_start = read_header(shard)
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01  # inside the last tensor (loss_mask): the header stays valid, a sample's digest does not
    assert len(raw) - 5 > data_start
    shard.write_bytes(bytes(raw))
    bad = shard_integrity(root, key)
    assert not bad.passed and bad.figures["problems"] >= 1
    assert "checksum" in bad.reason
    assert shard_complete(root, key).passed  # completeness reads manifests only: integrity is what sees it


def test_a_corrupted_header_fails_integrity(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    shard = write_shard(root, key)
    raw = bytearray(shard.read_bytes())
    raw[20] ^= 0x01
    shard.write_bytes(bytes(raw))
    verdict = shard_integrity(root, key)
    assert not verdict.passed and "header" in verdict.reason


def test_a_missing_shard_fails_integrity(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    assert not shard_integrity(root, key).passed


# ---- reject_rate -----------------------------------------------------------------------------------------
def test_reject_rate_counts_rejects_over_rows_read_leaving_out_ignored_reasons(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    high = reject_rate(root, key, max_rate=0.05, ignored=["duplicate"])
    assert not high.passed
    assert (high.figures["rows_read"], high.figures["rejected"], high.figures["rejected_counted"]) == (
        10,
        6,
        5,
    )
    assert high.figures["reject_rate"] == pytest.approx(0.5)
    assert high.figures["rejected_duplicate"] == 1 and high.figures["rejected_invalid_utf8"] == 1
    assert "above" in high.reason


def test_reject_rate_threshold_is_inclusive_and_duplicates_count_unless_ignored(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    manifest = json.loads(StoreLayout(root).conversations_manifest(key).read_text())
    rows = manifest["samples"] + sum(manifest["rejected"].values())
    rejected = sum(manifest["rejected"].values())
    rate = rejected / rows
    assert reject_rate(root, key, max_rate=rate).passed
    assert not reject_rate(root, key, max_rate=rate - 1e-3).passed
    assert reject_rate(root, key, max_rate=rate - 1e-3, ignored=list(manifest["rejected"])).passed


def test_a_clean_shard_has_no_rejects(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text(
        "\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(5)) + "\n"
    )
    config = write_config(tmp_path, "store: store\ndata: {dataset: ok, sources: [{path: rows.jsonl}]}\n")
    [key] = ingest(load_config(config)).all_shards
    verdict = reject_rate(tmp_path / "store", key, max_rate=0.0)
    assert verdict.passed and verdict.figures["reject_rate"] == 0.0 and verdict.figures["rows_read"] == 5


def test_reject_rate_without_a_conversation_shard_fails(tmp_path: Path) -> None:
    assert not reject_rate(tmp_path, "fx-00000", max_rate=1.0).passed


# ---- vocab_coverage --------------------------------------------------------------------------------------
def test_vocab_coverage_against_the_minimum(tmp_path: Path) -> None:
    root, key = _ingested(tmp_path)
    shard = write_shard(root, key)  # loss tokens: ids 0..6 cycling over lengths 3..6: 0,1,2 dominate
    mapping = build_vocab_mapping([shard], 16, 3, tokenizer_fingerprint=TOK)
    save_vocab_mapping(mapping, StoreLayout(root).vocab_mapping)
    assert 0.0 < mapping.coverage < 1.0
    low = vocab_coverage(root, min_coverage=mapping.coverage + 1e-3)
    assert not low.passed and "train.draft_vocab_size" in low.reason
    assert low.figures["coverage"] == pytest.approx(mapping.coverage, abs=1e-6)
    assert low.figures["draft_vocab_size"] == 3 and low.figures["shards"] == 1
    assert vocab_coverage(root, min_coverage=mapping.coverage).passed


def test_vocab_coverage_without_a_mapping_fails(tmp_path: Path) -> None:
    verdict = vocab_coverage(tmp_path, min_coverage=0.0)
    assert not verdict.passed and "vocab_mapping" in verdict.reason


# ---- config ----------------------------------------------------------------------------------------------
def test_checks_config_defaults(tmp_path: Path) -> None:
    checks = load_config(write_config(tmp_path, "store: s\n")).checks
    assert checks.max_reject_rate == 0.05
    assert checks.reject_rate_ignores == ["duplicate"]
    assert checks.min_vocab_coverage == 0.9


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("checks: {max_reject_rate: 1.5}\n", "checks.max_reject_rate", "less than or equal to 1"),
        ("checks: {min_vocab_coverage: -0.1}\n", "checks.min_vocab_coverage", "greater than or equal to 0"),
        ("checks: {reject_rate_ignores: [dupes]}\n", "checks.reject_rate_ignores", "duplicate"),
    ],
)
def test_invalid_check_thresholds_name_the_field(
    tmp_path: Path, text: str, field: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, text))
    assert f"{field}:" in str(err.value) and fragment in str(err.value), str(err.value)
