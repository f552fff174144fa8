import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from eagle3_core.config import load_config
from eagle3_core.data.conversation import build_conversation, is_heldout
from eagle3_core.data.ingest import SourceChangedError, ingest, load_conversation_shard
from eagle3_core.store.atomic import read_jsonl
from eagle3_core.store.layout import StoreLayout
from tests.conftest import FIXTURES, write_config


def _config(tmp_path: Path, sources: str, regenerate: bool = False, shard_size: int = 256) -> Path:
    return write_config(
        tmp_path,
        f"store: store\ndata:\n  dataset: t\n  shard_size: {shard_size}\n  sources: {sources}\n"
        f"regenerate: {{enabled: {str(regenerate).lower()}}}\n",
    )


def test_one_row_of_each_rejection_reason(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "bad_rows.jsonl", tmp_path / "rows.jsonl")
    cfg = load_config(_config(tmp_path, "[{path: rows.jsonl}]"))
    report = ingest(cfg)
    assert report.rejected == {
        "malformed_json": 1,
        "wrong_shape": 1,
        "unknown_role": 1,
        "empty_content": 1,
        "invalid_utf8": 1,
        "no_assistant_turn": 1,
        "duplicate": 1,
    }
    [shard] = report.new_shards
    samples, manifest = load_conversation_shard(cfg.store_root, shard.key)
    assert [s["source"]["line"] for s in samples] == [1, 9, 11]
    assert manifest["rejected"] == report.rejected
    rejects = read_jsonl(StoreLayout(cfg.store_root).rejects(shard.key))
    assert {(r["line"], r["reason"]) for r in rejects} == {
        (2, "malformed_json"),
        (3, "wrong_shape"),
        (4, "unknown_role"),
        (5, "empty_content"),
        (6, "invalid_utf8"),
        (7, "no_assistant_turn"),
        (8, "duplicate"),
    }
    assert all(r["file"] == "rows.jsonl" and r["raw"] for r in rejects)


def test_prompt_only_rows_are_the_point_when_regenerating(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "bad_rows.jsonl", tmp_path / "rows.jsonl")
    report = ingest(load_config(_config(tmp_path, "[{path: rows.jsonl}]", regenerate=True)))
    assert "no_assistant_turn" not in report.rejected
    assert report.new_shards[0].samples == 4


def test_formats_normalise_to_the_same_sample_id(tmp_path: Path) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": " hi\r\n"},
                {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
            ]
        },
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo "}]},
    ]
    (tmp_path / "a.jsonl").write_text(json.dumps(rows[0]) + "\n")
    pd.DataFrame([rows[1]]).to_parquet(tmp_path / "b.parquet")
    report = ingest(load_config(_config(tmp_path, "[{path: a.jsonl}, {path: b.parquet}]")))
    assert report.rejected == {"duplicate": 1}
    expected = build_conversation([("user", "hi"), ("assistant", "yo")], require_assistant=True).sample_id
    samples, _ = load_conversation_shard(
        load_config(tmp_path / "eagle3.yaml").store_root, report.new_shards[0].key
    )
    assert samples[0]["id"] == expected


def _jsonl(path: Path, start: int, n: int) -> None:
    with open(path, "a") as f:
        for i in range(start, start + n):
            row = {
                "messages": [
                    {"role": "user", "content": f"question {i}"},
                    {"role": "assistant", "content": f"answer {i}"},
                ]
            }
            f.write(json.dumps(row) + "\n")


def test_appending_a_file_leaves_existing_shards_byte_identical(tmp_path: Path) -> None:
    _jsonl(tmp_path / "a.jsonl", 0, 25)
    cfg = load_config(
        _config(tmp_path, "[{path: 'data*.jsonl'}, {path: a.jsonl}]".replace("data*", "a"), shard_size=10)
    )
    first = ingest(cfg)
    assert [s.samples for s in first.new_shards] == [10, 10, 5]
    layout = StoreLayout(cfg.store_root)
    before = {k: layout.conversations(k).read_bytes() for k in first.all_shards}

    _jsonl(tmp_path / "b.jsonl", 100, 12)
    cfg = load_config(_config(tmp_path, "[{path: '*.jsonl'}]", shard_size=10))
    second = ingest(cfg)
    assert second.new_keys == ["t-00003", "t-00004"]
    assert {k: layout.conversations(k).read_bytes() for k in first.all_shards} == before

    _jsonl(tmp_path / "a.jsonl", 25, 3)  # rows appended to a consumed file: a new shard, old ones untouched
    third = ingest(cfg)
    assert [s.samples for s in third.new_shards] == [3]
    assert {k: layout.conversations(k).read_bytes() for k in first.all_shards} == before
    assert ingest(cfg).new_shards == []

    _jsonl(tmp_path / "c.jsonl", 200, 8)  # a smaller shard size applies to new shards only
    cfg = load_config(_config(tmp_path, "[{path: '*.jsonl'}]", shard_size=5))
    assert [s.samples for s in ingest(cfg).new_shards] == [5, 3]
    assert {k: layout.conversations(k).read_bytes() for k in first.all_shards} == before


def test_a_changed_source_is_refused(tmp_path: Path) -> None:
    _jsonl(tmp_path / "a.jsonl", 0, 5)
    cfg = load_config(_config(tmp_path, "[{path: a.jsonl}]"))
    ingest(cfg)
    text = (tmp_path / "a.jsonl").read_text().replace("answer 2", "answer two")
    (tmp_path / "a.jsonl").write_text(text)
    with pytest.raises(SourceChangedError, match="append-only"):
        ingest(cfg)


def test_heldout_split_is_fixed_by_sample_id(tmp_path: Path) -> None:
    _jsonl(tmp_path / "a.jsonl", 0, 400)
    cfg = load_config(
        write_config(
            tmp_path, "store: store\ndata: {dataset: t, holdout_fraction: 0.1, sources: [{path: a.jsonl}]}\n"
        )
    )
    report = ingest(cfg)
    samples, _ = load_conversation_shard(cfg.store_root, report.new_shards[0].key)
    held = [s for s in samples if s["split"] == "heldout"]
    assert all(is_heldout(s["id"], 0.1) for s in held)
    assert 20 <= len(held) <= 60  # about 10% of 256


def test_chitchat_source(tmp_path: Path) -> None:
    cfg = load_config(
        write_config(
            tmp_path,
            "store: store\ndata: {dataset: c, shard_size: 16, sources: [{kind: chitchat, limit: 40}]}\n",
        )
    )
    report = ingest(cfg)
    assert report.rows_read == 40
    total = sum(s.samples for s in report.new_shards) + sum(report.rejected.values())
    assert total == 40
    samples, _ = load_conversation_shard(cfg.store_root, report.all_shards[0])
    assert samples[0]["messages"][0]["role"] == "user"
    assert samples[0]["source"]["file"].startswith("chitchat-dataset:")
