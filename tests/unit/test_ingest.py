import codecs
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from eagle3_cli.steps import main
from eagle3_core.config import ConfigError, load_config
from eagle3_core.data.conversation import Conversation, build_conversation, is_heldout
from eagle3_core.data.ingest import Ledger, SourceChangedError, ingest, load_conversation_shard
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import ConversationManifest, RejectRow, read_rows
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
    assert [s.source.line for s in samples] == [1, 9, 11]
    assert manifest.rejected == report.rejected
    rejects = read_rows(StoreLayout(cfg.store_root).rejects(shard.key), RejectRow.model_validate)
    assert {(r.line, r.reason) for r in rejects} == {
        (2, "malformed_json"),
        (3, "wrong_shape"),
        (4, "unknown_role"),
        (5, "empty_content"),
        (6, "invalid_utf8"),
        (7, "no_assistant_turn"),
        (8, "duplicate"),
    }
    assert all(r.file == "rows.jsonl" and r.raw for r in rejects)


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
    assert samples[0].id == expected


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
    held = [s for s in samples if s.split == "heldout"]
    assert all(is_heldout(s.id, 0.1) for s in held)
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
    assert samples[0].messages[0].role == "user"
    assert samples[0].source.file.startswith("chitchat-dataset:")


def test_a_chitchat_source_without_its_package_is_one_line_before_any_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(
        tmp_path, "store: store\ndata: {dataset: c, sources: [{path: c.jsonl}, {kind: chitchat, limit: 4}]}\n"
    )
    (tmp_path / "c.jsonl").write_text(_message_row(0) + "\n")
    monkeypatch.setitem(sys.modules, "chitchat_dataset", None)  # as if never installed: find_spec gives None
    assert main(["--config", str(config), "ingest"]) == 2
    [line] = capsys.readouterr().out.strip().splitlines()
    assert line == (
        "error: data.sources[1]: kind chitchat reads the chitchat-dataset package, which is not installed: "
        "pip install chitchat-dataset==0.9.0"
    )
    assert not StoreLayout(tmp_path / "store").conversations("c-00000").exists()  # the file's row neither


def _message_row(i: int) -> str:
    return json.dumps(
        {"messages": [{"role": "user", "content": f"q {i}"}, {"role": "assistant", "content": f"a {i}"}]}
    )


def test_a_byte_order_mark_at_the_start_of_a_line_is_not_part_of_the_row(tmp_path: Path) -> None:
    bom = "\ufeff".encode()
    # A Windows editor's file (BOM on the first line, CRLF), another one concatenated onto it (a BOM again),
    # and a line that holds nothing but a BOM.
    lines = [bom + _message_row(0).encode(), _message_row(1).encode(), bom + _message_row(2).encode(), bom]
    (tmp_path / "rows.jsonl").write_bytes(b"".join(line + b"\r\n" for line in lines))
    (tmp_path / "more.json").write_bytes(bom + _message_row(3).encode() + b"\n")
    cfg = load_config(_config(tmp_path, "[{path: rows.jsonl}, {path: more.json}]"))
    report = ingest(cfg)
    assert report.rejected == {}
    assert report.rows_read == 4
    samples = [s for key in report.new_keys for s in load_conversation_shard(cfg.store_root, key)[0]]
    assert [(s.source.file, s.source.line) for s in samples] == [
        ("rows.jsonl", 1),
        ("rows.jsonl", 2),
        ("rows.jsonl", 3),
        ("more.json", 1),
    ]
    assert [s.messages[0].content for s in samples] == ["q 0", "q 1", "q 2", "q 3"]
    assert not StoreLayout(cfg.store_root).rejects(report.new_keys[0]).read_text()
    # The consumed rows' digests are of the bytes as read, BOM and all: a second ingest finds them unchanged.
    again = ingest(cfg)
    assert again.new_shards == [] and again.rows_read == 0


def test_a_copy_under_a_new_name_makes_no_empty_shard_and_counts_its_duplicates(tmp_path: Path) -> None:
    rows = [_message_row(i) for i in range(3)]
    (tmp_path / "a.jsonl").write_text("".join(f"{r}\n" for r in rows))
    cfg = load_config(_config(tmp_path, "[{path: '*.jsonl'}]", shard_size=10))
    first = ingest(cfg)
    assert first.new_keys == ["t-00000"]
    layout = StoreLayout(cfg.store_root)
    files_before = sorted(p.name for p in (cfg.store_root / "conversations").iterdir())

    (tmp_path / "b.jsonl").write_text("\n".join(reversed(rows)) + "\n")  # other bytes, the same conversations
    logged: list[str] = []
    copy = ingest(cfg, log=logged.append)
    assert copy.new_shards == [] and copy.all_shards == ["t-00000"]
    assert copy.rows_read == 3 and copy.rejected == {"duplicate": 3} and copy.duplicates_skipped == 3
    [unsharded] = copy.unsharded
    assert (unsharded.source, unsharded.first_line, unsharded.last_line) == ("b.jsonl", 1, 3)
    assert unsharded.rejects_file is None  # nothing but duplicates: nothing worth keeping
    assert any("b.jsonl" in line and "no shard written" in line for line in logged)
    assert sorted(p.name for p in (cfg.store_root / "conversations").iterdir()) == files_before
    ledger = json.loads(layout.ledger.read_text())
    assert ledger["next_index"] == 1
    assert (ledger["sources"]["b.jsonl"]["rows"], ledger["sources"]["b.jsonl"]["shards"]) == (3, [])

    # The copy's rows are consumed once: not read again, and a row appended to it is a shard of its own.
    assert ingest(cfg).rows_read == 0
    _jsonl(tmp_path / "b.jsonl", 50, 1)
    appended = ingest(cfg)
    assert appended.new_keys == ["t-00001"] and appended.rejected == {} and appended.unsharded == []
    samples, _ = load_conversation_shard(cfg.store_root, "t-00001")
    assert [s.source.line for s in samples] == [4]

    # Consumed rows without a shard are pinned by the ledger all the same.
    (tmp_path / "b.jsonl").write_text("\n".join(rows) + "\n" + _message_row(50) + "\n")
    with pytest.raises(SourceChangedError, match=r"b\.jsonl: its first 4 rows changed"):
        ingest(cfg)


def test_a_tail_without_a_new_sample_keeps_its_other_rejects_and_survives_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [_message_row(0), _message_row(1), _message_row(0), '{"messages": [', "not json at all"]
    (tmp_path / "a.jsonl").write_text("".join(f"{line}\n" for line in lines))
    cfg = load_config(_config(tmp_path, "[{path: a.jsonl}]", shard_size=2))
    layout = StoreLayout(cfg.store_root)
    saved = Ledger.save

    def crash_on_the_tail(self: Ledger, path: Path) -> None:
        if self.sources["a.jsonl"].rows > 2:  # the shard (2 rows) commits; the tail's commit dies
            raise RuntimeError("killed")
        saved(self, path)

    monkeypatch.setattr(Ledger, "save", crash_on_the_tail)
    with pytest.raises(RuntimeError, match="killed"):
        ingest(cfg)
    tail_file = layout.unsharded_rejects("a.jsonl", 3)
    left = tail_file.read_bytes()
    assert json.loads(layout.ledger.read_text())["sources"]["a.jsonl"]["rows"] == 2

    monkeypatch.setattr(Ledger, "save", saved)
    resumed = ingest(cfg)
    assert resumed.new_shards == [] and resumed.all_shards == ["t-00000"]
    [tail] = resumed.unsharded
    assert tail.rejected == {"duplicate": 1, "malformed_json": 2}
    assert tail.rejects_file == tail_file and tail_file.read_bytes() == left  # rewritten identically
    kept = read_rows(tail_file, RejectRow.model_validate)
    assert [(r.file, r.line, r.reason) for r in kept] == [
        ("a.jsonl", 4, "malformed_json"),
        ("a.jsonl", 5, "malformed_json"),
    ]
    assert json.loads(layout.ledger.read_text())["sources"]["a.jsonl"]["rows"] == 5
    assert not layout.conversations_manifest("t-00001").exists()
    assert ingest(cfg).rows_read == 0


NOT_UTF8 = (
    b"caf\xe9.jsonl"  # Latin-1 bytes, as a file copied from an old system is named; Linux allows any bytes
)


def test_a_file_name_that_is_not_utf8_is_ingested_under_a_json_safe_name_that_reads_back_to_its_bytes(
    tmp_path: Path,
) -> None:
    (tmp_path / os.fsdecode(NOT_UTF8)).write_text(_message_row(0) + "\n" + '{"messages": [\n')
    _jsonl(tmp_path / "zeta.jsonl", 10, 1)  # sorted after it: must not be held up by it
    cfg = load_config(_config(tmp_path, "[{path: '*.jsonl'}]", shard_size=10))
    report = ingest(cfg)
    stored = "caf\\xe9.jsonl"
    assert codecs.escape_decode(stored.encode())[0] == NOT_UTF8  # the escape is lossless
    assert [s.source for s in report.new_shards] == [stored, "zeta.jsonl"]
    assert report.rejected == {"malformed_json": 1}
    layout = StoreLayout(cfg.store_root)
    samples, manifest = load_conversation_shard(cfg.store_root, "t-00000")
    assert [(s.source.file, s.messages[0].content) for s in samples] == [(stored, "q 0")]
    assert manifest.source == stored
    [reject] = read_rows(layout.rejects("t-00000"), RejectRow.model_validate)
    assert (reject.file, reject.line) == (stored, 2)
    assert list(json.loads(layout.ledger.read_text())["sources"]) == [stored, "zeta.jsonl"]
    # The same file gets the same name on the next run: its consumed rows are found, only new ones are read.
    assert ingest(cfg).rows_read == 0
    with open(tmp_path / os.fsdecode(NOT_UTF8), "a") as f:
        f.write(_message_row(1) + "\n")
    appended = ingest(cfg)
    assert appended.new_keys == ["t-00002"] and appended.rows_read == 1
    # A UTF-8 name spelling that escape literally would share the file's ledger entry: refused, naming both.
    _jsonl(tmp_path / "caf\\xe9.jsonl", 20, 1)
    with pytest.raises(ConfigError, match="would name two files") as refused:
        ingest(cfg)
    assert f"data.sources: {stored} would" in str(refused.value)
    assert repr(os.fsencode(tmp_path / "caf\\xe9.jsonl")) in str(refused.value)
    assert repr(os.fsencode(tmp_path) + b"/" + NOT_UTF8) in str(refused.value)


def _turns(*contents: str, roles: tuple[str, ...] = ("user", "assistant") * 3) -> str:
    """A `messages` row of these contents, with these roles in turn (user and assistant alternating)."""
    return json.dumps(
        {"messages": [{"role": r, "content": c} for r, c in zip(roles, contents, strict=False)]}
    )


EMPTY_TURN_ROWS = [
    _turns("q0", "a0", "q1", "  "),  # 1: the last reply empty: the first exchange is kept
    _turns("q2", "a2", "", "a3"),  # 2: an empty question in the middle: the exchange before it is kept
    _turns("   ", "x"),  # 3: nothing before the empty turn: rejected whole, as before
    _turns("q4", ""),  # 4: a question whose reply is empty: a complete exchange only when regenerating
    _turns("q5", "", "a5", roles=("user", "assistant", "assistant")),  # 5: a wrong shape, wherever it is
]


def test_an_empty_turn_keeps_the_complete_exchanges_before_it_and_counts_the_cut(tmp_path: Path) -> None:
    (tmp_path / "rows.jsonl").write_text("".join(f"{row}\n" for row in EMPTY_TURN_ROWS))
    cfg = load_config(_config(tmp_path, "[{path: rows.jsonl}]"))
    logged: list[str] = []
    report = ingest(cfg, log=logged.append)
    assert report.rows_read == 5 and report.new_shards[0].rows == 5  # every row once: a sample or a reject
    assert report.truncated == {"empty_content_truncated": 2}
    assert report.rejected == {"empty_content": 2, "wrong_shape": 1}  # row 5 alternates wrongly after its cut
    samples, manifest = load_conversation_shard(cfg.store_root, "t-00000")
    assert [[m.content for m in s.messages] for s in samples] == [["q0", "a0"], ["q2", "a2"]]
    # the same id as the kept exchange alone, from any source: a copy of it elsewhere is a duplicate
    assert (
        samples[0].id
        == build_conversation([("user", "q0"), ("assistant", "a0")], require_assistant=True).sample_id
    )
    assert (manifest.samples, manifest.truncated, manifest.rejected) == (2, report.truncated, report.rejected)
    rejects = read_rows(StoreLayout(cfg.store_root).rejects("t-00000"), RejectRow.model_validate)
    kept = [f"; the turns before are sample {s.id[:12]}" for s in samples]
    assert [(r.line, r.reason, r.detail) for r in rejects] == [
        (1, "empty_content_truncated", f"turn 3 (assistant) is empty: turns 2-3 of 4 dropped{kept[0]}"),
        (2, "empty_content_truncated", f"turn 2 (user) is empty: turns 2-3 of 4 dropped{kept[1]}"),
        (3, "empty_content", "turn 0 (user) is empty"),
        (4, "empty_content", "turn 1 (assistant) is empty, and no complete exchange comes before it"),
        (5, "wrong_shape", "turns 1 and 2 are both assistant: user and assistant must alternate"),
    ]
    assert rejects[0].raw == EMPTY_TURN_ROWS[0]  # the dropped turns are kept to look at
    assert "t-00000: 2 samples, 2 cut before an empty turn, 3 rejected (rows.jsonl)" in logged
    assert json.loads(StoreLayout(cfg.store_root).ledger.read_text())["sources"]["rows.jsonl"]["rows"] == 5
    assert ingest(cfg).rows_read == 0


def test_the_rows_cut_before_an_empty_turn_are_counted_by_the_conversations_step_and_by_eagle3_stats(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where rejects are shown, so is the cut: the conversations step's metadata (the asset's in Dagster) and
    `eagle3 stats`, table and --json, from the manifests' `truncated`."""
    from eagle3_cli.main import main
    from eagle3_core.steps.data import conversations_step
    from eagle3_core.store.stats import store_stats

    rows = [*EMPTY_TURN_ROWS, _message_row(6)]
    (tmp_path / "rows.jsonl").write_text("".join(f"{row}\n" for row in rows))
    config = _config(tmp_path, "[{path: rows.jsonl}]", shard_size=1)  # one sample a shard
    cfg = load_config(config)
    keys = ["t-00000", "t-00001", "t-00002"]
    assert ingest(cfg).new_keys == keys
    metadata = [conversations_step(cfg, key).metadata for key in keys]
    counts = [(m["samples"], m["truncated"], m["rejected"]) for m in metadata]
    assert counts == [(1, 1, 0), (1, 1, 0), (1, 0, 3)]  # the third: rows 3-5 rejected, then row 6

    stats = store_stats(cfg.store_root)
    assert stats.truncated == {"empty_content_truncated": 2}
    assert stats.rejected == {"empty_content": 2, "wrong_shape": 1}
    assert main(["--config", str(config), "stats"]) == 0
    shown = " ".join(capsys.readouterr().out.split())  # the console wraps at its width
    assert (
        "conversations: 3 accepted (0 held out for evaluation, 2 kept in part: cut before an empty turn)"
        in shown
    )
    assert "rejected rows: 3 (empty_content=2, wrong_shape=1)" in shown
    assert main(["--config", str(config), "stats", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["truncated"] == {"empty_content_truncated": 2} and figures["conversations"] == 3


def test_with_regeneration_a_question_whose_reply_is_empty_is_kept_for_the_target_to_answer(
    tmp_path: Path,
) -> None:
    (tmp_path / "rows.jsonl").write_text(f"{EMPTY_TURN_ROWS[0]}\n{EMPTY_TURN_ROWS[3]}\n")
    cfg = load_config(_config(tmp_path, "[{path: rows.jsonl}]", regenerate=True))
    report = ingest(cfg)
    assert report.truncated == {"empty_content_truncated": 2} and report.rejected == {}
    samples, _ = load_conversation_shard(cfg.store_root, "t-00000")
    assert [[m.content for m in s.messages] for s in samples] == [["q0", "a0", "q1"], ["q4"]]


def test_rows_an_earlier_ingest_consumed_are_not_read_again_when_the_rules_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store ingested before empty turns were cut keeps its shards as they are: the ledger skips the rows it
    consumed (checking their bytes), so only rows added since are read under the new rule."""
    import eagle3_core.data.sources as sources

    def rejecting_whole(turns: list[tuple[object, object]], **given: Any) -> Conversation:
        return build_conversation(turns, **{**given, "keep_before_empty": False})  # the rule before

    (tmp_path / "rows.jsonl").write_text(f"{_message_row(0)}\n{EMPTY_TURN_ROWS[0]}\n")
    cfg = load_config(_config(tmp_path, "[{path: rows.jsonl}]"))
    monkeypatch.setattr(sources, "build_conversation", rejecting_whole)
    assert ingest(cfg).rejected == {"empty_content": 1}
    layout = StoreLayout(cfg.store_root)
    before = {p.name: p.read_bytes() for p in (cfg.store_root / "conversations").iterdir()}
    monkeypatch.undo()
    with open(tmp_path / "rows.jsonl", "a") as f:
        f.write(f"{EMPTY_TURN_ROWS[1]}\n")
    again = ingest(cfg)
    assert again.rows_read == 1 and again.truncated == {"empty_content_truncated": 1}
    assert {
        p.name: p.read_bytes() for p in (cfg.store_root / "conversations").iterdir() if p.name in before
    } == before
    assert ConversationManifest.read(layout.conversations_manifest("t-00000")).rejected == {
        "empty_content": 1
    }


NESTED_ROW = "[" * 100_000  # far past Python's recursion limit, which json's parser recurses against


def test_a_row_nested_too_deeply_is_one_reject_and_the_rest_of_the_file_is_sharded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [_message_row(0), NESTED_ROW, '{"messages": ' + "[" * 100_000, _message_row(1)]
    (tmp_path / "rows.jsonl").write_text("".join(f"{line}\n" for line in lines))
    config = _config(tmp_path, "[{path: rows.jsonl}]")
    assert main(["--config", str(config), "ingest"]) == 0, capsys.readouterr().out
    cfg = load_config(config)
    key = "t-00000"  # the one shard: both samples, and the rejects met on the way
    samples, manifest = load_conversation_shard(cfg.store_root, key)
    assert [s.source.line for s in samples] == [1, 4]
    assert manifest.rejected == {"malformed_json": 2}
    rejects = read_rows(StoreLayout(cfg.store_root).rejects(key), RejectRow.model_validate)
    assert [(r.line, r.reason) for r in rejects] == [(2, "malformed_json"), (3, "malformed_json")]
    assert all("nested too deeply" in r.detail and r.raw_truncated for r in rejects)
