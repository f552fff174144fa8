"""The inbox: conversation files dropped into a directory become shards, each file exactly once.

Which files are read (the rule a writer must follow):
- only regular files directly in the inbox whose name ends in .jsonl, .json or .parquet;
- never a symbolic link (to a file or a directory): it could point at anything the reader may read, a
  secret among them, so it is refused, recorded with the reason and reported once, and not opened at all
  (a file is opened without following links, so one swapped in after the check is not read either);
- never a name starting with "." or "_", nor one ending in .tmp, .part, .partial, .crdownload, .filepart,
  .swp or ~ (copy under such a name, then rename: a rename is atomic, so the file appears whole);
- never a file modified less than `orchestration.inbox_min_age_seconds` ago (a writer that appends in
  place is taken as finished once it has been quiet that long).

Exactly once, across restarts: an inbox file is a file source like any other, so its rows go through the
ingest ledger (`ledger.json`), which is committed after every shard and records how many rows of the file
were consumed with a digest of their bytes. A crash mid-file resumes after the last whole shard; rows
appended to a file later become new shards; a file whose consumed rows changed is refused, not re-sharded.
On top of that, `inbox.json` in the store records each file's size, mtime and sha256: an unchanged file is
skipped from its stat alone (no re-read every tick), and a file with the content of one already ingested
(a renamed or re-dropped copy) is recorded as the same and not read again; a file whose rows are all in the
store already (other bytes, same conversations) is read once and makes no shard. A file is recorded before its
first shard is committed, so every shard made from the inbox is listed by `InboxReport.inbox_shards`, even
one whose caller died before seeing it. Files are recorded by `sources.stored_name`: a name that is not UTF-8
is escaped, so it is ingested like any other, never a failure that would stop every tick at that file.

A file is refused (recorded in inbox.json with the reason, reported once, read again only once it changes)
when its consumed rows changed, when it cannot be decoded (a broken Parquet file: SourceUnreadableError,
whatever pyarrow raised), and, unread, when another inbox file would be recorded under its name (a UTF-8
name that spells out the escape of the other's byte): the files after it go on. Only a failure of the
system (an OSError reading it) leaves a file to the next call.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISLNK, S_ISREG
from typing import NamedTuple

from eagle3_core.config import Eagle3Config, FileSource
from eagle3_core.data.ingest import (
    Ledger,
    ShardReport,
    SourceEntry,
    UnshardedRows,
    describe,
    ingest_lock,
    ingest_source,
    seen_sample_ids,
)
from eagle3_core.data.sources import ResolvedSource, open_binary, stored_name
from eagle3_core.errors import ConfigError, SourceChangedError, SourceUnreadableError
from eagle3_core.store.layout import SHARD_KEY, StoreLayout
from eagle3_core.store.records import InboxFile, InboxRecord, InboxState

RECORD_VERSION = 1
READ_SUFFIXES = {".jsonl", ".json", ".parquet"}
TEMP_SUFFIXES = {".tmp", ".part", ".partial", ".crdownload", ".filepart", ".swp"}

# The states of a file in inbox.json. "ingesting" is written before the file's first shard, so a crash
# leaves it there and the next call resumes the file through the ledger.
INGESTING: InboxState = "ingesting"
DONE: InboxState = "done"
REFUSED: InboxState = "refused"


@dataclass
class InboxReport:
    inbox: Path
    new_shards: list[ShardReport] = field(default_factory=list)
    inbox_shards: list[str] = field(default_factory=list)  # every shard ever made from the inbox, by index
    rejected: dict[str, int] = field(default_factory=dict)  # reasons, over the rows this call read
    truncated: dict[str, int] = field(default_factory=dict)  # samples cut before an empty turn, this call
    unsharded: list[UnshardedRows] = field(default_factory=list)  # a file's last rows with no new sample
    ingested: list[str] = field(default_factory=list)  # files finished by this call
    same_as: dict[str, str] = field(default_factory=dict)  # file -> the ingested file it duplicates
    waiting: dict[str, str] = field(default_factory=dict)  # file -> why not yet (too young)
    ignored: dict[str, str] = field(default_factory=dict)  # file -> why never (not a conversation file)
    refused: dict[str, str] = field(default_factory=dict)  # file -> why (changed, a link), newly refused
    failed: dict[str, str] = field(default_factory=dict)  # file -> error; retried on the next call
    unfinished: str | None = None  # the file the time budget stopped in; continued on the next call
    busy: bool = False  # another process was ingesting the inbox; nothing was done

    @property
    def new_keys(self) -> list[str]:
        return [s.key for s in self.new_shards]

    @property
    def duplicates_skipped(self) -> int:
        return self.rejected.get("duplicate", 0)


def inbox_dir(cfg: Eagle3Config) -> Path:
    if cfg.orchestration.inbox is None:
        raise ConfigError("orchestration.inbox is not set: name the directory to watch in eagle3.yaml")
    return cfg.resolve(cfg.orchestration.inbox)


def shard_index(key: str) -> int:
    match = SHARD_KEY.match(key)
    if match is None:
        raise ValueError(f"{key!r} is not a shard key")
    return int(match["index"])


def ingest_inbox(
    cfg: Eagle3Config,
    *,
    now: float | None = None,
    max_seconds: float | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> InboxReport:
    """Shard every new or grown file of the inbox. `max_seconds`: once a shard is made, start no new one
    after this long (the file in progress is continued by the next call), so a sensor tick keeps its deadline."""
    inbox = inbox_dir(cfg)
    report = InboxReport(inbox)
    if not inbox.is_dir():
        raise FileNotFoundError(f"orchestration.inbox: {inbox} is not a directory")
    layout = StoreLayout(cfg.store_root)
    layout.root.mkdir(parents=True, exist_ok=True)
    with ingest_lock(layout) as locked:
        if not locked:
            report.busy = True
            return report
        _ingest_locked(cfg, layout, report, time.time() if now is None else now, max_seconds, log)
    return report


def _ingest_locked(
    cfg: Eagle3Config,
    layout: StoreLayout,
    report: InboxReport,
    now: float,
    max_seconds: float | None,
    log: Callable[[str], None],
) -> None:
    started = time.monotonic()
    record = _Record.load(layout.inbox_record)
    files = record.files
    ledger = Ledger.load(layout.ledger, cfg.data.dataset, cfg.data.shard_size)
    seen: set[str] | None = None  # every sample id in the store: read only when a file is to be ingested
    totals: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    min_age = cfg.orchestration.inbox_min_age_seconds
    inbox = report.inbox.resolve()
    entries = _listing(report.inbox, cfg.root)
    clashing = _clashing(entries, record)
    for path, name, st in entries:
        if path in clashing:
            _refuse_clash(record, name, path, st, clashing[path], report, log)
            continue
        refusal = _link_refusal(path, st, inbox)
        if refusal is not None:
            _refuse_link(record, name, refusal, report, log)
            continue
        if not _conversation_file(path, st, report, name):
            continue
        if now - st.st_mtime < min_age:
            report.waiting[name] = f"modified {now - st.st_mtime:.0f} s ago (< {min_age:g} s)"
            continue
        known = files.get(name)
        if known and known.symlink:  # a refused link replaced by a regular file: a new file
            known = None
        if known and known.state != INGESTING and _same_stat(known, st):
            continue
        made_something = report.new_shards or report.unsharded
        if made_something and _out_of_time(started, max_seconds):  # each call makes one shard at least
            report.unfinished = name
            break
        try:
            digest = _sha256(path)
        except OSError as err:  # unreadable, or gone since the listing
            report.failed[name] = f"{type(err).__name__}: {err}"
            continue
        if known and known.state != INGESTING and known.sha256 == digest:
            files[name] = known.model_copy(update={"size": st.st_size, "mtime_ns": st.st_mtime_ns})  # touched
            record.save()
            continue
        twin = None if known else _file_with_digest(files, digest)
        if twin is not None:
            files[name] = InboxFile(
                state=DONE, sha256=digest, size=st.st_size, mtime_ns=st.st_mtime_ns, same_as=twin
            )
            record.save()
            report.same_as[name] = twin
            log(f"{name}: same content as {twin}, already ingested")
            continue
        files[name] = InboxFile(state=INGESTING, sha256=digest, size=st.st_size, mtime_ns=st.st_mtime_ns)
        record.save()
        if seen is None:
            seen = seen_sample_ids(layout, ledger)
        source = ResolvedSource(name, FileSource(path=name), path, no_follow=True)
        entry = ledger.sources.setdefault(name, SourceEntry())
        try:
            for consumed in _within(
                ingest_source(cfg, layout, ledger, source, entry, seen), started, max_seconds
            ):
                if isinstance(consumed, UnshardedRows):
                    report.unsharded.append(consumed)
                else:
                    report.new_shards.append(consumed)
                    truncated.update(consumed.truncated)
                totals.update(consumed.rejected)
                log(describe(consumed))
        except (SourceChangedError, SourceUnreadableError) as err:  # until the file changes
            files[name] = InboxFile(
                state=REFUSED, sha256=digest, size=st.st_size, mtime_ns=st.st_mtime_ns, reason=str(err)
            )
            record.save()
            report.refused[name] = str(err)
            continue
        except (OSError, ValueError) as err:  # the system's or the store's fault, not the file's: retried
            report.failed[name] = f"{type(err).__name__}: {err}"
            continue
        except _OutOfTime:
            report.unfinished = name
            break
        files[name] = InboxFile(state=DONE, sha256=digest, size=st.st_size, mtime_ns=st.st_mtime_ns)
        record.save()
        report.ingested.append(name)
    report.rejected = dict(totals)
    report.truncated = dict(truncated)
    report.inbox_shards = sorted(
        (k for name in files for k in ledger.sources.get(name, SourceEntry()).shards), key=shard_index
    )


class _OutOfTime(Exception):
    pass


def _within(
    consumed: Iterator[ShardReport | UnshardedRows], started: float, max_seconds: float | None
) -> Iterator[ShardReport | UnshardedRows]:
    """The source's shards, one by one, until time is up. Every shard yielded is in the ledger already; the
    one being filled when time runs out is dropped with the source's generator, and its rows are not."""
    for item in consumed:
        yield item
        if _out_of_time(started, max_seconds):
            raise _OutOfTime


def _out_of_time(started: float, max_seconds: float | None) -> bool:
    return max_seconds is not None and time.monotonic() - started >= max_seconds


def _temporary(name: str) -> bool:
    """A file being written, by convention: never read, not even worth a mention."""
    return name.startswith((".", "_")) or name.endswith("~") or Path(name).suffix in TEMP_SUFFIXES


def _link_refusal(path: Path, st: os.stat_result, inbox: Path) -> str | None:
    """Why an entry must not be read at all: it is a symbolic link, or its resolved path is not in the inbox
    (a second guard, whatever leads there). None for a plain entry of the inbox."""
    if S_ISLNK(st.st_mode):
        return (
            f"a symbolic link{_link_target(path)}, not read: the inbox takes regular files only; "
            "copy the file into the inbox instead"
        )
    if path.resolve().parent != inbox:
        return f"resolves to {stored_name(str(path.resolve()))}, outside the inbox {inbox}; not read"
    return None


def _link_target(path: Path) -> str:
    try:
        return f" (to {stored_name(os.readlink(path))})"
    except OSError:  # removed since the listing: the refusal stands, without the target
        return ""


def _refuse_link(
    record: _Record, name: str, reason: str, report: InboxReport, log: Callable[[str], None]
) -> None:
    """Record and report a refused link once; the record keeps the reason, a later call stays quiet."""
    known = record.files.get(name)
    if known and known.state == REFUSED and known.reason == reason:
        return
    record.files[name] = InboxFile(state=REFUSED, symlink=True, reason=reason)
    record.save()
    report.refused[name] = reason
    log(f"{name}: refused, {reason}")


def _conversation_file(path: Path, st: os.stat_result, report: InboxReport, name: str) -> bool:
    if not S_ISREG(st.st_mode):
        return False  # a directory (the inbox is not read recursively), a socket, a FIFO
    if path.suffix not in READ_SUFFIXES:
        report.ignored[name] = f"not {' or '.join(sorted(READ_SUFFIXES))}"
        return False
    return True


def _source_name(path: Path, root: Path) -> str:
    """As `data.sources` names a file: relative to the config's directory, so the ledger entry is shared,
    and JSON-safe (`stored_name`: a name that is not UTF-8 is escaped, not a crash on every tick). The entry
    itself is not resolved: a link is named as itself, not after what it points to."""
    where = path.parent.resolve() / path.name
    try:
        return stored_name(str(where.relative_to(root.resolve())))
    except ValueError:
        return stored_name(str(where))


def _same_stat(known: InboxFile | None, st: os.stat_result) -> bool:
    return known is not None and known.size == st.st_size and known.mtime_ns == st.st_mtime_ns


def _file_with_digest(files: dict[str, InboxFile], digest: str) -> str | None:
    for name, known in files.items():
        if known.state == DONE and known.sha256 == digest:
            return known.same_as or name
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_binary(path, no_follow=True) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class _Record:
    """inbox.json as a call changes it: `files` by name, `clashes` by the name the refused file would take."""

    path: Path
    files: dict[str, InboxFile]
    clashes: dict[str, InboxFile]

    @classmethod
    def load(cls, path: Path) -> _Record:
        if not path.exists():
            return cls(path, {}, {})
        record = InboxRecord.read(path)
        return cls(path, dict(record.files), dict(record.clashes or {}))

    def save(self) -> None:
        InboxRecord(version=RECORD_VERSION, files=self.files, clashes=self.clashes or None).write(self.path)


class _Entry(NamedTuple):
    path: Path
    name: str  # as the store records it (`_source_name`)
    st: os.stat_result  # of the entry itself (lstat): a link is looked at, never followed


def _listing(inbox: Path, root: Path) -> list[_Entry]:
    """The inbox's entries in order, temporary names left out, as are entries gone since the listing."""
    entries = []
    for path in sorted(inbox.iterdir()):
        if _temporary(path.name):
            continue
        try:
            st = path.lstat()
        except FileNotFoundError:  # moved away between listing and stat
            continue
        entries.append(_Entry(path, _source_name(path, root), st))
    return entries


def _clashing(entries: list[_Entry], record: _Record) -> dict[Path, Path]:
    """The entries inbox.json would record under a name another entry has too (`stored_name` writes a byte
    that is not UTF-8 as `\\xNN`, which a UTF-8 name may spell out): {entry: the one that keeps the name}.
    Without this, the second would be read against the first one's ledger entry, refused as changed, its
    refusal written over the first one's record, and both read again on every call. The name is kept by the
    file recorded under it (same stat), else by the one not refused for the clash already, else by the first
    in order: a file ingested before its twin appeared keeps its name, whichever of the two sorts first."""
    alike: dict[str, list[_Entry]] = {}
    for entry in entries:
        if S_ISLNK(entry.st.st_mode) or _conversation_suffix(entry):  # what inbox.json records
            alike.setdefault(entry.name, []).append(entry)
    clashing: dict[Path, Path] = {}
    for name, group in alike.items():
        if len(group) > 1:
            known, refused = record.files.get(name), record.clashes.get(name)
            keeper = min(group, key=lambda e: (not _same_stat(known, e.st), _same_stat(refused, e.st)))
            clashing.update({e.path: keeper.path for e in group if e is not keeper})
    return clashing


def _conversation_suffix(entry: _Entry) -> bool:
    return S_ISREG(entry.st.st_mode) and entry.path.suffix in READ_SUFFIXES


def _refuse_clash(
    record: _Record,
    name: str,
    path: Path,
    st: os.stat_result,
    keeper: Path,
    report: InboxReport,
    log: Callable[[str], None],
) -> None:
    """Refuse, unread, a file whose name would be recorded as another's; reported once, and again only when
    the file changes (its stat) or its twin does (the reason)."""
    reason = (
        f"not read: its name {os.fsencode(path.name)!r} is recorded as {name}, as is the name of "
        f"{os.fsencode(keeper.name)!r}, which keeps it; rename one of the two"
    )
    known = record.clashes.get(name)
    if known and known.reason == reason and _same_stat(known, st):
        return
    record.clashes[name] = InboxFile(state=REFUSED, size=st.st_size, mtime_ns=st.st_mtime_ns, reason=reason)
    record.save()
    report.refused[name] = reason
    log(f"{name}: refused, {reason}")
