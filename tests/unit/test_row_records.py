"""The store's JSONL rows (conversation rows, ingest's rejects, regenerated rows and the regeneration journal) as
records: written, they are the bytes the dict writers wrote before them; read, a torn or wrong row is one line
naming the file, the line and the field.

Each dict below is built the way the writer built it before the records (ingest's `_sample_row` and
`_reject_row`, regenerate's `finish_row`, the server client's `_failed_entry` and journal entry), key for key.
tests/fixtures/records holds the conversation and rejects files the dict writer made of fixtures/bad_rows.jsonl.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from eagle3_core.data.ingest import MAX_KEPT_RAW, load_conversation_shard
from eagle3_core.errors import RecordError
from eagle3_core.evaluate.prompts import heldout_prompts
from eagle3_core.store.atomic import write_jsonl
from eagle3_core.store.journal import RegenerationJournal
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import (
    ConversationRow,
    JournalEntry,
    JournalHeader,
    Message,
    RegeneratedRow,
    RegenerationError,
    RejectRow,
    read_rows,
    regeneration_row,
    write_rows,
)
from tests.conftest import FIXTURES
from tests.records import ingest_bad_rows

RECORDS = FIXTURES / "records"
SOURCE = {"file": "chitchat-dataset:train", "line": 7}
# what the writers meet: non-ASCII text (written as is), quotes, backslashes, newlines, a system turn
MESSAGES = [
    {"role": "system", "content": "Réponds «brièvement»."},
    {"role": "user", "content": 'a "quoted" \\ back\nslash, 日本語, emoji 🙂'},
    {"role": "assistant", "content": "ok\ttab"},
]


def _old_sample_row(sample_id: str, split: str) -> dict[str, Any]:
    return {"id": sample_id, "split": split, "messages": MESSAGES, "source": dict(SOURCE)}


def _old_reject_row(raw: bytes, reason: str, detail: str) -> dict[str, Any]:
    text = raw.decode("utf-8", errors="backslashreplace")
    return {
        **SOURCE,
        "reason": reason,
        "detail": detail,
        "raw": text[:MAX_KEPT_RAW],
        "raw_truncated": len(text) > MAX_KEPT_RAW,
    }


def _old_finish_row(source: dict[str, Any] | None, turns: int, stop: str) -> dict[str, Any]:
    row = {"id": "s" * 64, "source": source, "turns_regenerated": turns}
    if turns == 0:
        return {**row, "error": stop or "no_user_turn", "messages": []}
    return {**row, "messages": MESSAGES, "stop": stop or "complete"}


def _same_bytes(tmp_path: Path, old: list[dict[str, Any]], new: list[Any]) -> bytes:
    write_jsonl(tmp_path / "old.jsonl", old)
    write_rows(tmp_path / "new.jsonl", new)
    assert (tmp_path / "new.jsonl").read_bytes() == (tmp_path / "old.jsonl").read_bytes()
    return (tmp_path / "new.jsonl").read_bytes()


def test_conversation_rows_write_the_dicts_bytes_and_read_back(tmp_path: Path) -> None:
    old = [_old_sample_row("a" * 64, "train"), _old_sample_row("b" * 64, "heldout")]
    new = [ConversationRow.model_validate(row) for row in old]
    _same_bytes(tmp_path, old, new)
    assert read_rows(tmp_path / "new.jsonl", ConversationRow.model_validate) == new
    assert new[1].messages[0].role == "system" and new[1].source.line == 7


def test_reject_rows_write_the_dicts_bytes(tmp_path: Path) -> None:
    cases = [
        (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "invalid_utf8", "byte 46: invalid"),
        ("é".encode() * (MAX_KEPT_RAW + 3), "wrong_shape", "too long"),  # cut, and said to be
    ]
    old = [_old_reject_row(*case) for case in cases]
    new = [
        RejectRow(
            file=SOURCE["file"],
            line=SOURCE["line"],
            reason=reason,
            detail=detail,
            raw=raw.decode("utf-8", errors="backslashreplace")[:MAX_KEPT_RAW],
            raw_truncated=len(raw.decode("utf-8", errors="backslashreplace")) > MAX_KEPT_RAW,
        )
        for raw, reason, detail in cases
    ]
    _same_bytes(tmp_path, old, new)
    assert read_rows(tmp_path / "new.jsonl", RejectRow.model_validate) == new
    assert [r.raw_truncated for r in new] == [False, True]


@pytest.mark.parametrize("source", [SOURCE, None])
def test_regenerated_and_error_rows_write_the_dicts_bytes(
    tmp_path: Path, source: dict[str, Any] | None
) -> None:
    old = [
        _old_finish_row(source, 2, ""),
        _old_finish_row(source, 1, "context_limit"),
        _old_finish_row(source, 0, "empty_reply"),
        _old_finish_row(source, 0, ""),
    ]
    new = [regeneration_row(row) for row in old]
    assert [type(r) for r in new] == [RegeneratedRow, RegeneratedRow, RegenerationError, RegenerationError]
    _same_bytes(tmp_path, old, new)
    assert read_rows(tmp_path / "new.jsonl", regeneration_row) == new


def test_a_regenerated_row_says_how_each_reply_ended_one_reason_per_reply() -> None:
    row = {**_old_finish_row(SOURCE, 2, ""), "finish_reasons": ["stop", "length"]}
    read = regeneration_row(row)
    assert isinstance(read, RegeneratedRow) and read.cut_turns == [1] and read.dump() == row
    with pytest.raises(ValueError, match="finish_reasons: 1 reasons for 2 replies"):
        regeneration_row({**row, "finish_reasons": ["stop"]})


def test_the_journal_writes_the_dicts_bytes(tmp_path: Path) -> None:
    header = {"journal": 1, "fingerprint": "f" * 64}
    failed = {
        "id": "s" * 64,
        "source": SOURCE,
        "turns_regenerated": 0,
        "error": "request_failed: HTTP 400",
        "messages": [],
    }
    entries = [
        {"id": "s" * 64, "row": _old_finish_row(SOURCE, 2, ""), "counts": {"replies": 2}, "new_tokens": 9},
        {"id": "s" * 64, "row": failed, "counts": {"errors": 1, "request_errors": 1}, "new_tokens": 0},
    ]
    records = [JournalEntry.model_validate(e) for e in entries]
    assert isinstance(records[1].row, RegenerationError)
    _same_bytes(tmp_path, [header, *entries], [JournalHeader.model_validate(header), *records])

    path = tmp_path / "r-00000.journal.jsonl"
    journal = RegenerationJournal(path, header["fingerprint"])
    assert journal.open([]) == {}
    for record in records:
        journal.append(record)
    journal.close()
    assert path.read_bytes() == (tmp_path / "old.jsonl").read_bytes()  # appended lines too


def test_ingest_writes_the_rows_the_dict_writer_wrote(tmp_path: Path) -> None:
    layout = ingest_bad_rows(tmp_path)
    for written, golden in (
        (layout.conversations("t-00000"), "conversations-t-00000.jsonl"),
        (layout.rejects("t-00000"), "conversations-t-00000.rejects.jsonl"),
    ):
        assert written.read_bytes() == (RECORDS / golden).read_bytes(), golden
    samples, manifest = load_conversation_shard(layout.root, "t-00000")
    assert [s.id for s in samples] == manifest.sample_ids
    rejects = read_rows(layout.rejects("t-00000"), RejectRow.model_validate)
    assert [r.reason for r in rejects] == list(manifest.rejected)


def _store(tmp_path: Path) -> tuple[Path, Path]:
    """A store with the golden conversation shard: its root and its rows file."""
    layout = StoreLayout(tmp_path / "store")
    layout.conversations("t-00000").parent.mkdir(parents=True)
    shutil.copy(RECORDS / "conversations-t-00000.json", layout.conversations_manifest("t-00000"))
    shutil.copy(RECORDS / "conversations-t-00000.jsonl", layout.conversations("t-00000"))
    return layout.root, layout.conversations("t-00000")


TORN = [
    (lambda r: r.pop("split"), "split: Field required"),
    (lambda r: r.update(split="test"), "split: Input should be 'train' or 'heldout'"),
    (lambda r: r["messages"][1].update(role="wizard"), "messages[1].role: Input should be"),
    (lambda r: r["messages"][0].update(content=7), "messages[0].content: Input should be a valid string"),
    (lambda r: r["source"].update(line="1"), "source.line: Input should be a valid integer"),
    (lambda r: r.update(surplus=1), "surplus: Extra inputs are not permitted"),
]


@pytest.mark.parametrize(("change", "field"), TORN)
def test_a_wrong_conversation_row_is_one_line_naming_the_file_the_line_and_the_field(
    tmp_path: Path, change: Any, field: str
) -> None:
    root, path = _store(tmp_path)
    lines = path.read_text(encoding="utf-8").splitlines()
    row = json.loads(lines[2])
    change(row)
    lines[2] = json.dumps(row, ensure_ascii=False)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(RecordError) as err:
        load_conversation_shard(root, "t-00000")
    message = str(err.value)
    assert message.startswith(f"{path} line 3: {field}") and "\n" not in message
    with pytest.raises(RecordError, match=re.escape(f"{path} line 3: {field}")):
        heldout_prompts(root, per_conversation=1, limit=10)


def test_a_torn_conversation_file_is_one_line_naming_it(tmp_path: Path) -> None:
    root, path = _store(tmp_path)
    text = path.read_text(encoding="utf-8")
    path.write_text(text[: len(text) - 40], encoding="utf-8")  # the last row cut by a crash
    with pytest.raises(RecordError) as err:
        load_conversation_shard(root, "t-00000")
    assert str(err.value).startswith(f"{path} line 4: not valid JSON") and "\n" not in str(err.value)


DAMAGED_LINES = {
    "not UTF-8": (lambda line: line.replace(b'"content":"', b'"content":"\xff', 1), "not UTF-8 text"),
    "nested too deeply": (
        lambda line: b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n",
        "nested too deeply for Python's parser",
    ),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_LINES))
def test_a_damaged_conversation_line_is_one_line_naming_it(tmp_path: Path, damage: str) -> None:
    change, said = DAMAGED_LINES[damage]
    root, path = _store(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = change(lines[2])
    path.write_bytes(b"".join(lines))
    with pytest.raises(RecordError) as err:
        load_conversation_shard(root, "t-00000")
    assert str(err.value).startswith(f"{path} line 3: ") and said in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_a_row_holding_a_line_separator_reads_back_as_one_row(tmp_path: Path) -> None:
    """JSON writes U+2028 as is (UTF-8 as is, store/atomic.py `write_jsonl`): it is not a line break there."""
    rows = [
        Message(role="user", content="one\u2028two\u0085three"),
        Message(role="assistant", content="four"),
    ]
    write_rows(tmp_path / "rows.jsonl", rows)
    assert read_rows(tmp_path / "rows.jsonl", Message.model_validate) == rows


def test_a_wrong_regenerated_row_names_the_line_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    good = _old_finish_row(SOURCE, 2, "")
    error_row = {**_old_finish_row(SOURCE, 0, "empty_reply"), "messages": [{"role": "user"}]}
    write_jsonl(path, [good, {k: v for k, v in good.items() if k != "stop"}])
    with pytest.raises(RecordError, match=rf"^{path} line 2: stop: Field required$"):
        read_rows(path, regeneration_row)
    write_jsonl(path, [good, good, error_row])
    with pytest.raises(RecordError, match=rf"^{path} line 3: messages\[0\]\.content: Field required$"):
        read_rows(path, regeneration_row)
