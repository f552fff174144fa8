"""The inbox: each dropped file becomes shards exactly once (across restarts and lost records), a file still
being written waits, bad rows are counted with their reason, a file that changed under us is refused, and a
symbolic link is refused without being read."""

import fcntl
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from eagle3_core.config import ConfigError, Eagle3Config, FileSource, OrchestrationConfig, load_config
from eagle3_core.data.inbox import ingest_inbox
from eagle3_core.data.ingest import ingest, load_conversation_shard
from eagle3_core.data.sources import ResolvedSource
from eagle3_core.errors import StoreBusyError
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import RejectRow, read_rows
from tests.conftest import write_config
from tests.parquet_files import UNREADABLE, unreadable_parquet

NAME = "inbox/a.jsonl"  # as sources are named: relative to the config's directory


def _config(tmp_path: Path, shard_size: int = 2, extra: str = "") -> Eagle3Config:
    (tmp_path / "inbox").mkdir(parents=True, exist_ok=True)
    return load_config(
        write_config(
            tmp_path,
            f"store: store\ndata: {{dataset: t, shard_size: {shard_size}}}\n"
            f"orchestration: {{inbox: inbox, inbox_min_age_seconds: 60{extra}}}\n",
        )
    )


def _row(i: int) -> str:
    return json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]})


def _drop(tmp_path: Path, name: str, lines: list[str], age: float = 120.0) -> Path:
    path = tmp_path / "inbox" / name
    path.write_text("".join(f"{line}\n" for line in lines))
    _age(path, age)
    return path


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _samples(cfg: Eagle3Config, keys: list[str]) -> list[dict[str, Any]]:
    return [s for key in keys for s in load_conversation_shard(cfg.store_root, key)[0]]


def _record(cfg: Eagle3Config) -> dict[str, Any]:
    return dict(json.loads((StoreLayout(cfg.store_root).inbox_record).read_text())["files"])


def test_a_new_file_is_sharded_once_and_its_malformed_row_is_counted_with_its_reason(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _drop(tmp_path, "a.jsonl", [_row(0), _row(1), '{"messages": [', _row(2), _row(3), _row(4)])
    report = ingest_inbox(cfg)
    assert report.new_keys == ["t-00000", "t-00001", "t-00002"]
    assert report.inbox_shards == report.new_keys
    assert report.ingested == [NAME]
    assert report.rejected == {"malformed_json": 1}
    assert [s.messages[0].content for s in _samples(cfg, report.new_keys)] == [
        f"question {i}" for i in range(5)
    ]
    [reject] = read_rows(StoreLayout(cfg.store_root).rejects("t-00001"), RejectRow.model_validate)
    assert (reject.file, reject.line, reject.reason) == (NAME, 3, "malformed_json")
    assert _record(cfg)[NAME]["state"] == "done"

    again = ingest_inbox(cfg)
    assert again.new_keys == [] and again.ingested == []
    assert again.inbox_shards == report.new_keys


def test_a_restart_mid_file_neither_skips_nor_reingests_a_row(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _drop(tmp_path, "a.jsonl", [_row(i) for i in range(7)])
    first = ingest_inbox(cfg, max_seconds=0.0)  # the time budget stops it after one shard, as a kill would
    assert first.new_keys == ["t-00000"] and first.unfinished == NAME
    assert _record(cfg)[NAME]["state"] == "ingesting"

    restarted = ingest_inbox(load_config(cfg.root / "eagle3.yaml"))
    assert restarted.new_keys == ["t-00001", "t-00002", "t-00003"]
    every = first.new_keys + restarted.new_keys
    assert restarted.inbox_shards == every
    contents = [s.messages[0].content for s in _samples(cfg, every)]
    assert contents == [f"question {i}" for i in range(7)]  # each row once, in order

    (
        StoreLayout(cfg.store_root).inbox_record
    ).unlink()  # even with the inbox record lost, the ledger knows the rows
    lost = ingest_inbox(cfg)
    assert lost.new_keys == []
    assert lost.inbox_shards == every  # and the record is rebuilt with the file's shards


def test_a_file_still_being_written_waits_and_temporary_names_are_never_read(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    young = _drop(tmp_path, "a.jsonl", [_row(0), _row(1)], age=0.0)
    _drop(tmp_path, ".b.jsonl", [_row(2)])
    _drop(tmp_path, "c.jsonl.part", [_row(3)])
    _drop(tmp_path, "d.jsonl.tmp", [_row(4)])
    _drop(tmp_path, "notes.txt", ["hello"])
    report = ingest_inbox(cfg)
    assert report.new_keys == []
    assert list(report.waiting) == [NAME]
    assert list(report.ignored) == ["inbox/notes.txt"]
    assert not (StoreLayout(cfg.store_root).inbox_record).exists()

    _age(young, 61)  # quiet for longer than inbox_min_age_seconds: taken as written
    report = ingest_inbox(cfg)
    assert report.new_keys == ["t-00000"] and report.ingested == [NAME]
    assert [s.messages[0].content for s in _samples(cfg, report.new_keys)] == [
        "question 0",
        "question 1",
    ]


def test_a_copy_is_not_read_again_appended_rows_add_shards_and_a_changed_file_is_refused(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path)
    a = _drop(tmp_path, "a.jsonl", [_row(0), _row(1)])
    assert ingest_inbox(cfg).new_keys == ["t-00000"]

    shutil.copy2(a, tmp_path / "inbox" / "copy.jsonl")  # the same bytes dropped again under another name
    copied = ingest_inbox(cfg)
    assert copied.new_keys == [] and copied.same_as == {"inbox/copy.jsonl": NAME}

    with a.open("a") as f:
        f.write(f"{_row(2)}\n{_row(3)}\n")
    _age(a, 120)
    appended = ingest_inbox(cfg)
    assert appended.new_keys == ["t-00001"]
    assert [s.messages[0].content for s in _samples(cfg, appended.new_keys)] == [
        "question 2",
        "question 3",
    ]

    _drop(tmp_path, "a.jsonl", [_row(9), _row(1), _row(2), _row(3)])  # a consumed row rewritten
    _drop(tmp_path, "b.jsonl", [_row(5)])
    changed = ingest_inbox(cfg)
    assert list(changed.refused) == [NAME] and "changed" in changed.refused[NAME]
    assert changed.new_keys == ["t-00002"] and changed.ingested == ["inbox/b.jsonl"]  # the others go on
    assert ingest_inbox(cfg).refused == {}  # reported once; the record keeps the reason
    assert _record(cfg)[NAME]["state"] == "refused"


def test_a_second_caller_is_turned_away_while_one_holds_the_inbox(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _drop(tmp_path, "a.jsonl", [_row(0)])
    cfg.store_root.mkdir(parents=True)
    with open(StoreLayout(cfg.store_root).ingest_lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        report = ingest_inbox(cfg)
        with pytest.raises(StoreBusyError, match="another process is ingesting"):
            ingest(cfg)  # `eagle3 ingest` takes the same lock
    assert report.busy and report.new_keys == []
    assert ingest_inbox(cfg).new_keys == ["t-00000"]


def test_orchestration_defaults_and_invalid_values_name_the_field(tmp_path: Path) -> None:
    defaults = OrchestrationConfig()
    assert (defaults.inbox, defaults.nightly_cron, defaults.nightly_timezone, defaults.nightly_enabled) == (
        None,
        "0 2 * * *",
        "UTC",
        True,
    )
    cfg = _config(tmp_path / "proj")
    assert cfg.resolve(cfg.orchestration.inbox or "") == (tmp_path / "proj" / "inbox").resolve()
    for text, field in [
        ("orchestration: {nightly_cron: '0 2 * *'}\n", "orchestration.nightly_cron"),
        ("orchestration: {nightly_timezone: Mars/Olympus}\n", "orchestration.nightly_timezone"),
        ("orchestration: {inbox_min_age_seconds: -1}\n", "orchestration.inbox_min_age_seconds"),
    ]:
        with pytest.raises(ConfigError, match=f"{field}:"):
            load_config(write_config(tmp_path / "bad", text))


SECRET = "sk-live-0123456789abcdef"


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_a_symbolic_link_is_refused_unread_and_nothing_of_its_target_reaches_the_store(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    secrets = outside / "secrets.jsonl"
    secrets.write_text(f"API_KEY={SECRET}\n{_row(77)}\n")  # a malformed row would go to a rejects file
    (outside / "nested.jsonl").write_text(f"API_KEY={SECRET}\n")
    (tmp_path / "inbox" / "leak.jsonl").symlink_to(secrets)
    (tmp_path / "inbox" / "linked").symlink_to(outside, target_is_directory=True)
    _drop(tmp_path, "a.jsonl", [_row(0)])
    for path in (secrets, outside / "nested.jsonl"):
        _age(path, 120)

    logged: list[str] = []
    report = ingest_inbox(cfg, log=logged.append)
    assert report.ingested == [NAME] and report.new_keys == ["t-00000"]
    assert sorted(report.refused) == ["inbox/leak.jsonl", "inbox/linked"]
    assert all("symbolic link" in why for why in report.refused.values())
    assert str(secrets) in report.refused["inbox/leak.jsonl"]  # names where it points, to find who made it
    assert any(line.startswith("inbox/leak.jsonl: refused") for line in logged)
    assert _files_holding(cfg.store_root, SECRET.encode()) == []
    assert _files_holding(cfg.store_root, b"question 77") == []
    assert set(json.loads(StoreLayout(cfg.store_root).ledger.read_text())["sources"]) == {NAME}
    record = _record(cfg)
    assert record["inbox/leak.jsonl"]["state"] == "refused" and "sha256" not in record["inbox/leak.jsonl"]

    again = ingest_inbox(cfg)  # reported once; the record keeps the reason
    assert again.refused == {} and again.new_keys == []
    assert _files_holding(cfg.store_root, SECRET.encode()) == []

    # Replaced by a regular file of the same name, it is an ordinary new file.
    (tmp_path / "inbox" / "leak.jsonl").unlink()
    _drop(tmp_path, "leak.jsonl", [_row(5)])
    replaced = ingest_inbox(cfg)
    assert replaced.ingested == ["inbox/leak.jsonl"] and replaced.new_keys == ["t-00001"]


def test_an_inbox_file_swapped_for_a_link_after_the_check_is_not_read(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets.jsonl"
    secrets.write_text(f"API_KEY={SECRET}\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(secrets)
    source = ResolvedSource("inbox/link.jsonl", FileSource(path="inbox/link.jsonl"), link, no_follow=True)
    with pytest.raises(OSError, match="symbolic links"):
        next(source.rows())
    followed = ResolvedSource("link.jsonl", FileSource(path="link.jsonl"), link)  # data.sources may use links
    assert next(followed.rows()).raw == f"API_KEY={SECRET}".encode()


def test_a_file_of_rows_already_in_the_store_makes_no_shard(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _drop(tmp_path, "a.jsonl", [_row(0), _row(1), _row(2)])
    assert ingest_inbox(cfg).new_keys == ["t-00000", "t-00001"]
    _drop(tmp_path, "b.jsonl", [_row(2), _row(0)])  # other bytes than a.jsonl, so not a `same_as` copy
    report = ingest_inbox(cfg)
    assert report.new_keys == [] and report.ingested == ["inbox/b.jsonl"]
    assert report.duplicates_skipped == 2 and report.rejected == {"duplicate": 2}
    assert [u.source for u in report.unsharded] == ["inbox/b.jsonl"]
    assert report.inbox_shards == ["t-00000", "t-00001"]
    assert not StoreLayout(cfg.store_root).conversations_manifest("t-00002").exists()
    assert _record(cfg)["inbox/b.jsonl"]["state"] == "done"


def test_a_file_name_that_is_not_utf8_is_ingested_and_jams_nothing_sorted_after_it(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    _drop(tmp_path, os.fsdecode(b"caf\xe9.jsonl"), [_row(0), _row(1), "not json", _row(2)])
    _drop(tmp_path, "zeta.jsonl", [_row(3)])
    link = tmp_path / "inbox" / "link.jsonl"  # a refusal's reason names the target, in the record too
    link.symlink_to(tmp_path / os.fsdecode(b"secret-\xff.txt"))
    stored = "inbox/caf\\xe9.jsonl"  # each byte that is no UTF-8 as \xNN: JSON holds it, and it reads back
    report = ingest_inbox(cfg)
    assert report.ingested == [stored, "inbox/zeta.jsonl"] and report.failed == {}
    assert report.new_keys == ["t-00000", "t-00001", "t-00002"]
    assert report.rejected == {"malformed_json": 1}
    assert "secret-\\xff.txt" in report.refused["inbox/link.jsonl"]
    samples = _samples(cfg, report.new_keys)
    assert [(s.source.file, s.messages[0].content) for s in samples] == [
        (stored, "question 0"),
        (stored, "question 1"),
        (stored, "question 2"),
        ("inbox/zeta.jsonl", "question 3"),
    ]
    record = _record(cfg)
    assert record[stored]["state"] == "done" and record["inbox/zeta.jsonl"]["state"] == "done"
    # Recorded under the name the next call computes: known from its stat, not read again.
    again = ingest_inbox(cfg)
    assert again.new_keys == [] and again.ingested == [] and again.failed == {} and again.refused == {}


def test_a_row_cut_before_an_empty_turn_is_a_sample_and_the_inbox_counts_the_cut(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    turns = [("user", "q0"), ("assistant", "a0"), ("user", "q1"), ("assistant", " ")]
    cut = json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})
    _drop(tmp_path, "a.jsonl", [cut, _row(1)])
    report = ingest_inbox(cfg)
    assert report.truncated == {"empty_content_truncated": 1} and report.rejected == {}
    assert [[m.content for m in s.messages] for s in _samples(cfg, report.new_keys)] == [
        ["q0", "a0", "q1"],  # regeneration is on: the target answers q1
        ["question 1"],
    ]


def test_a_parquet_file_that_cannot_be_decoded_is_refused_once_and_the_files_after_it_are_ingested(
    tmp_path: Path,
) -> None:
    """pyarrow raises whatever its failing layer raises (OverflowError, a time zone's KeyError, ArrowInvalid,
    ArrowNotImplementedError...): each is the file's fault, recorded as a refusal naming the file, never an
    exception that stops the tick at that file, every tick."""
    cfg = _config(tmp_path)
    names = []
    for kind in UNREADABLE:
        _age(unreadable_parquet(tmp_path / "inbox" / f"{kind}.parquet", kind), 120)
        names.append(f"inbox/{kind}.parquet")
    _drop(tmp_path, "zeta.jsonl", [_row(0), _row(1)])  # sorted after them: must not be held up
    report = ingest_inbox(cfg)
    assert report.ingested == ["inbox/zeta.jsonl"] and report.new_keys == ["t-00000"]
    assert report.failed == {} and sorted(report.refused) == sorted(names)
    for kind, name in zip(UNREADABLE, names, strict=True):
        reason = report.refused[name]
        assert reason.startswith(f"{name}: not readable as Parquet (") and UNREADABLE[kind] in reason
        assert "\n" not in reason
        assert _record(cfg)[name] == {**_record(cfg)[name], "state": "refused", "reason": reason}
    # Recorded: a later call neither reports nor reads them again (a read would fail the same way)
    again = ingest_inbox(cfg)
    assert again.refused == {} and again.failed == {} and again.ingested == [] and again.new_keys == []
    # Until one changes: the fixed file is read, its rows become a shard
    fixed = tmp_path / "inbox" / "truncated.parquet"
    pd.DataFrame([{"messages": [{"role": "user", "content": "question 7"}]}]).to_parquet(fixed)
    _age(fixed, 120)
    after = ingest_inbox(cfg)
    assert after.ingested == ["inbox/truncated.parquet"] and after.new_keys == ["t-00001"]
    assert [s.messages[0].content for s in _samples(cfg, after.new_keys)] == ["question 7"]


def test_two_files_whose_names_are_recorded_alike_the_second_is_refused_once_naming_both(
    tmp_path: Path,
) -> None:
    """A UTF-8 name that spells out `\\xe9` and the Latin-1 name whose byte that is are both recorded as
    `inbox/caf\\xe9.jsonl`. The second is refused up front, unread, naming both; it was read against the first
    one's ledger entry, refused as changed over the first one's record, and both read again on every call."""
    cfg = _config(tmp_path)
    spelled = _drop(tmp_path, "caf\\xe9.jsonl", [_row(0), _row(1)])
    latin1 = _drop(tmp_path, os.fsdecode(b"caf\xe9.jsonl"), [_row(2), _row(3)])
    stored = "inbox/caf\\xe9.jsonl"
    first = ingest_inbox(cfg)
    assert first.ingested == [stored] and first.new_keys == ["t-00000"]
    assert [s.messages[0].content for s in _samples(cfg, first.new_keys)] == ["question 0", "question 1"]
    reason = first.refused[stored]
    assert repr(b"caf\xe9.jsonl") in reason and repr(b"caf\\xe9.jsonl") in reason and "rename" in reason
    record = json.loads(StoreLayout(cfg.store_root).inbox_record.read_text())
    assert record["files"][stored]["state"] == "done"  # the first one's record stands
    assert record["files"][stored]["size"] == spelled.stat().st_size
    assert record["clashes"][stored] == {
        "state": "refused",
        "size": latin1.stat().st_size,
        "mtime_ns": latin1.stat().st_mtime_ns,
        "reason": reason,
    }
    # Later calls skip both from their stat: nothing read, nothing reported
    again = ingest_inbox(cfg)
    assert again.refused == {} and again.ingested == [] and again.failed == {} and again.new_keys == []
    # Until the refused one changes: refused again, still unread
    with latin1.open("a") as f:
        f.write(f"{_row(4)}\n")
    _age(latin1, 120)
    changed = ingest_inbox(cfg)
    assert changed.refused == {stored: reason} and changed.new_keys == [] and changed.ingested == []


def test_of_two_files_recorded_alike_the_one_ingested_first_keeps_the_name_whichever_sorts_first(
    tmp_path: Path,
) -> None:
    cfg = _config(tmp_path)
    latin1 = _drop(tmp_path, os.fsdecode(b"caf\xe9.jsonl"), [_row(0)])
    stored = "inbox/caf\\xe9.jsonl"
    assert ingest_inbox(cfg).ingested == [stored]
    spelled = _drop(tmp_path, "caf\\xe9.jsonl", [_row(1)])  # sorts before the Latin-1 name ("\\" < byte 0xe9)
    later = ingest_inbox(cfg)
    assert later.ingested == [] and later.new_keys == []
    refused = os.fsencode(spelled.name)
    assert later.refused[stored].startswith(f"not read: its name {refused!r} is recorded as {stored}")
    assert _record(cfg)[stored] == {**_record(cfg)[stored], "state": "done", "size": latin1.stat().st_size}
    assert ingest_inbox(cfg).refused == {}


def test_a_row_nested_too_deeply_is_one_reject_and_jams_neither_its_file_nor_the_files_after_it(
    tmp_path: Path,
) -> None:
    """json's parser recurses once per nested array: a row of 100,000 `[` raised RecursionError on every
    tick, the file stayed "ingesting" and the files sorted after it were never read."""
    cfg = _config(tmp_path)
    _drop(tmp_path, "a.jsonl", [_row(0), "[" * 100_000, _row(1)])
    _drop(tmp_path, "b.jsonl", [_row(2), _row(3)])
    report = ingest_inbox(cfg)
    assert report.failed == {} and report.refused == {}
    assert report.ingested == [NAME, "inbox/b.jsonl"]
    assert report.rejected == {"malformed_json": 1}
    assert [s.messages[0].content for s in _samples(cfg, report.new_keys)] == [
        f"question {i}" for i in range(4)
    ]
    [reject] = read_rows(StoreLayout(cfg.store_root).rejects("t-00000"), RejectRow.model_validate)
    assert (reject.file, reject.line, reject.reason) == (NAME, 2, "malformed_json")
    assert "nested too deeply" in reject.detail
    assert {name: entry["state"] for name, entry in _record(cfg).items()} == {
        NAME: "done",
        "inbox/b.jsonl": "done",
    }
