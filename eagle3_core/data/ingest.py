"""Ingest: sources in, conversation shards out, incrementally and deterministically.

Each source is read in order; accepted conversations fill shards of `shard_size` samples, one source at a
time (a shard never mixes sources), so appending a file or appending rows to a file only adds shards.
The ledger (`ledger.json` in the store) records, per source, how many rows were consumed and a digest of
their raw bytes: a later ingest starts after them, and refuses a source whose consumed rows changed.

Every rejected row is kept with its location and reason in the rejects file of the shard it fell in;
duplicates (a sample id seen before, in this source or an earlier one) are rejects with reason `duplicate`.
A row cut before an empty turn is a sample of its complete exchanges; the rejects file keeps the row too, under
`empty_content_truncated`, and the shard counts it apart from its rejects (`truncated`, not `rejected`: the
row is not lost, and every row read is a sample or a reject).
A shard always holds a sample: a source's last rows that hold no new one (a file copied under a new name, all
duplicates) are consumed in the ledger without a shard, their reasons counted in the report, and the rows
rejected for another reason than `duplicate` kept in the store's unsharded rejects file for those rows.
The ledger is committed after every shard (and after such rows), so a crash mid-source resumes at the last
whole shard and rewrites, identically, any shard files the crashed run left that the ledger does not list.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_core.config import Eagle3Config
from eagle3_core.data.conversation import EMPTY_CONTENT_TRUNCATED, Conversation, RowRejected, is_heldout
from eagle3_core.data.sources import RawRow, ResolvedSource, parse_row, resolve_sources
from eagle3_core.errors import ConfigError, SourceChangedError, StoreBusyError
from eagle3_core.store.layout import StoreLayout, shard_key
from eagle3_core.store.locks import exclusive_lock
from eagle3_core.store.records import (
    ConversationManifest,
    ConversationRow,
    LedgerRecord,
    LedgerSource,
    RejectRow,
    read_rows,
    write_rows,
)

LEDGER_VERSION = 1
MAX_KEPT_RAW = 4000  # characters of a rejected row kept in the rejects file


@dataclass
class SourceEntry:
    rows: int = 0
    digest: str = hashlib.sha256().hexdigest()
    shards: list[str] = field(default_factory=list)


@dataclass
class Ledger:
    dataset: str
    shard_size: int
    next_index: int = 0
    sources: dict[str, SourceEntry] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, dataset: str, shard_size: int) -> Ledger:
        if not path.exists():
            return cls(dataset, shard_size)
        raw = LedgerRecord.read(path)
        ledger = cls(
            raw.dataset,
            raw.shard_size,
            raw.next_index,
            {name: SourceEntry(e.rows, e.digest, list(e.shards)) for name, e in raw.sources.items()},
        )
        if ledger.dataset != dataset:
            raise ConfigError(
                f"data.dataset is {dataset!r} but the store at {path.parent} holds dataset {ledger.dataset!r}; "
                "use another store, or the old name"
            )
        ledger.shard_size = shard_size  # a new size applies to new shards; existing shards never change
        return ledger

    def save(self, path: Path) -> None:
        LedgerRecord(
            version=LEDGER_VERSION,
            dataset=self.dataset,
            shard_size=self.shard_size,
            next_index=self.next_index,
            sources={
                n: LedgerSource(rows=e.rows, digest=e.digest, shards=e.shards)
                for n, e in self.sources.items()
            },
        ).write(path)

    @property
    def shard_keys(self) -> list[str]:
        return [k for e in self.sources.values() for k in e.shards]


@dataclass
class ShardReport:
    key: str
    source: str
    samples: int
    heldout: int
    rejected: dict[str, int]
    first_line: int
    last_line: int
    truncated: dict[str, int] = field(default_factory=dict)  # samples cut before an empty turn (by reason)

    @property
    def rows(self) -> int:
        return self.samples + sum(self.rejected.values())


@dataclass
class UnshardedRows:
    """A source's last rows when not one of them is a new sample: consumed, but no (empty) shard is made."""

    source: str
    rejected: dict[str, int]
    first_line: int
    last_line: int
    rejects_file: Path | None  # the rows rejected for another reason than duplicate; None if there are none

    @property
    def rows(self) -> int:
        return sum(self.rejected.values())

    def describe(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(self.rejected.items()))
        kept = f"; rejects kept in {self.rejects_file}" if self.rejects_file else ""
        return (
            f"{self.source} lines {self.first_line}-{self.last_line}: no new sample ({reasons}), "
            f"no shard written{kept}"
        )


@dataclass
class IngestReport:
    new_shards: list[ShardReport]
    all_shards: list[str]
    rows_read: int
    rejected: dict[str, int]  # reasons, over every row read (the new shards' and the unsharded rows')
    unsharded: list[UnshardedRows] = field(default_factory=list)
    truncated: dict[str, int] = field(default_factory=dict)  # samples cut before an empty turn

    @property
    def new_keys(self) -> list[str]:
        return [s.key for s in self.new_shards]

    @property
    def duplicates_skipped(self) -> int:
        return self.rejected.get("duplicate", 0)


@dataclass
class _Pending:
    """The shard being filled: accepted samples and the rejects met since the previous shard (with the rows
    cut before an empty turn, which are samples too), and how many source rows that is."""

    samples: list[ConversationRow] = field(default_factory=list)
    rejects: list[RejectRow] = field(default_factory=list)
    rows: int = 0
    first_line: int | None = None
    last_line: int = 0
    digest: Any = None  # the source digest after this shard's last row


@contextmanager
def ingest_lock(layout: StoreLayout) -> Iterator[bool]:
    """An advisory lock on the store's ledger: a second ingester (the inbox sensor beside `eagle3 ingest`)
    gets False at once instead of racing on ledger.json."""
    with exclusive_lock(layout.ingest_lock) as attempt:
        yield attempt.acquired


def ingest(cfg: Eagle3Config, log: Callable[[str], None] = lambda _: None) -> IngestReport:
    layout = StoreLayout(cfg.store_root)
    with ingest_lock(layout) as locked:
        if not locked:
            raise StoreBusyError(
                f"another process is ingesting into {layout.root} (the inbox sensor, or a second "
                "`eagle3 ingest`); run again once it is done"
            )
        return _ingest_sources(cfg, layout, log)


def _ingest_sources(cfg: Eagle3Config, layout: StoreLayout, log: Callable[[str], None]) -> IngestReport:
    ledger = Ledger.load(layout.ledger, cfg.data.dataset, cfg.data.shard_size)
    seen = seen_sample_ids(layout, ledger)
    report = IngestReport([], [], 0, {})
    totals: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    for source in resolve_sources(cfg):
        entry = ledger.sources.setdefault(source.name, SourceEntry())
        for consumed in ingest_source(cfg, layout, ledger, source, entry, seen):
            totals.update(consumed.rejected)
            report.rows_read += consumed.rows
            if isinstance(consumed, UnshardedRows):
                report.unsharded.append(consumed)
            else:
                report.new_shards.append(consumed)
                truncated.update(consumed.truncated)
            log(describe(consumed))
    report.all_shards = ledger.shard_keys
    report.rejected = dict(totals)
    report.truncated = dict(truncated)
    return report


def describe(consumed: ShardReport | UnshardedRows) -> str:
    if isinstance(consumed, UnshardedRows):
        return consumed.describe()
    rejected = sum(consumed.rejected.values())
    truncated = sum(consumed.truncated.values())
    cut = f", {truncated} cut before an empty turn" if truncated else ""
    return f"{consumed.key}: {consumed.samples} samples{cut}, {rejected} rejected ({consumed.source})"


def seen_sample_ids(layout: StoreLayout, ledger: Ledger) -> set[str]:
    seen: set[str] = set()
    for key in ledger.shard_keys:
        seen.update(ConversationManifest.read(layout.conversations_manifest(key)).sample_ids)
    return seen


def _consumed_rows(source: ResolvedSource, entry: SourceEntry) -> tuple[Iterator[RawRow], Any]:
    """Skip the rows the ledger says are consumed, checking their digest; return the rest and the digest."""
    digest = hashlib.sha256()
    rows = source.rows()
    for _ in range(entry.rows):
        row = next(rows, None)
        if row is None:
            raise SourceChangedError(
                f"{source.name} has fewer rows than the {entry.rows} already sharded; sources are append-only "
                "(add new data as new files)"
            )
        _digest_row(digest, row)
    if digest.hexdigest() != entry.digest:
        into = f"sharded into {entry.shards[0]}..{entry.shards[-1]}" if entry.shards else "ingested"
        raise SourceChangedError(
            f"{source.name}: its first {entry.rows} rows changed since they were {into}; "
            "sources are append-only (add new data as new files)"
        )
    return rows, digest


def _digest_row(digest: Any, row: RawRow) -> None:
    digest.update(len(row.raw).to_bytes(8, "little"))
    digest.update(row.raw)


def ingest_source(
    cfg: Eagle3Config,
    layout: StoreLayout,
    ledger: Ledger,
    source: ResolvedSource,
    entry: SourceEntry,
    seen: set[str],
) -> Iterator[ShardReport | UnshardedRows]:
    """The source's rows after those the ledger has, as shards, each committed to the ledger before it is
    yielded; the last rows, if not one of them is a new sample, as UnshardedRows (committed too)."""
    rows, digest = _consumed_rows(source, entry)
    require_assistant = not cfg.regenerate.enabled
    pending = _Pending()
    for row in rows:
        _digest_row(digest, row)
        pending.rows += 1
        pending.first_line = pending.first_line or row.location.line
        pending.last_line = row.location.line
        try:
            conv = parse_row(
                row, source, require_assistant=require_assistant, system_prompt=cfg.data.system_prompt
            )
            if conv.sample_id in seen:
                raise RowRejected("duplicate", f"same conversation as sample {conv.sample_id[:12]}")
        except RowRejected as rej:
            pending.rejects.append(_reject_row(row, rej.reason, rej.detail))
        else:
            seen.add(conv.sample_id)
            pending.samples.append(_sample_row(conv, row, cfg.data.holdout_fraction))
            if conv.dropped is not None:
                kept = f"{conv.dropped}; the turns before are sample {conv.sample_id[:12]}"
                pending.rejects.append(_reject_row(row, EMPTY_CONTENT_TRUNCATED, kept))
        if len(pending.samples) == ledger.shard_size:
            pending.digest = digest.copy()
            yield _commit_shard(layout, ledger, source, entry, pending)
            pending = _Pending()
    if pending.samples:
        pending.digest = digest.copy()
        yield _commit_shard(layout, ledger, source, entry, pending)
    elif pending.rejects:  # a shard is cut at shard_size samples, so only the source's tail can have none
        pending.digest = digest.copy()
        yield _commit_unsharded(layout, ledger, source, entry, pending)


def _sample_row(conv: Conversation, row: RawRow, holdout_fraction: float) -> ConversationRow:
    return ConversationRow.model_validate(
        {
            "id": conv.sample_id,
            "split": "heldout" if is_heldout(conv.sample_id, holdout_fraction) else "train",
            "messages": conv.messages,
            "source": row.location.as_dict(),
        }
    )


def _reject_row(row: RawRow, reason: str, detail: str) -> RejectRow:
    text = row.raw.decode("utf-8", errors="backslashreplace")
    return RejectRow(
        file=row.location.file,
        line=row.location.line,
        reason=reason,
        detail=detail,
        raw=text[:MAX_KEPT_RAW],
        raw_truncated=len(text) > MAX_KEPT_RAW,
    )


def _commit_unsharded(
    layout: StoreLayout, ledger: Ledger, source: ResolvedSource, entry: SourceEntry, pending: _Pending
) -> UnshardedRows:
    """Rows without a new sample: the ledger counts them consumed and no shard is written. Duplicates are
    only counted (the sample each repeats is in the store); other rejects are kept for a look, in a file
    named by the source and first line, so a rerun after a crash before the ledger commit rewrites it."""
    first_line = pending.first_line or 0
    kept = [r for r in pending.rejects if r.reason != "duplicate"]
    rejects_file = layout.unsharded_rejects(source.name, first_line) if kept else None
    if rejects_file is not None:
        write_rows(rejects_file, kept)
    entry.rows += pending.rows
    entry.digest = pending.digest.hexdigest()
    ledger.save(layout.ledger)
    rejected = dict(Counter(r.reason for r in pending.rejects))
    return UnshardedRows(source.name, rejected, first_line, pending.last_line, rejects_file)


def _commit_shard(
    layout: StoreLayout, ledger: Ledger, source: ResolvedSource, entry: SourceEntry, pending: _Pending
) -> ShardReport:
    key = shard_key(ledger.dataset, ledger.next_index)
    truncated = dict(Counter(r.reason for r in pending.rejects if r.reason == EMPTY_CONTENT_TRUNCATED))
    rejected = dict(Counter(r.reason for r in pending.rejects if r.reason != EMPTY_CONTENT_TRUNCATED))
    heldout = sum(1 for s in pending.samples if s.split == "heldout")
    write_rows(layout.rejects(key), pending.rejects)
    write_rows(layout.conversations(key), pending.samples)
    ConversationManifest(
        key=key,
        source=source.name,
        lines=[pending.first_line or 0, pending.last_line],
        samples=len(pending.samples),
        train_samples=len(pending.samples) - heldout,
        heldout_samples=heldout,
        assistant_turns=sum(1 for s in pending.samples for m in s.messages if m.role == "assistant"),
        rejected=rejected,
        truncated=truncated,
        sample_ids=[s.id for s in pending.samples],
    ).write(layout.conversations_manifest(key))
    entry.rows += pending.rows
    entry.digest = pending.digest.hexdigest()
    entry.shards.append(key)
    ledger.next_index += 1
    ledger.save(layout.ledger)
    return ShardReport(
        key,
        source.name,
        len(pending.samples),
        heldout,
        rejected,
        pending.first_line or 0,
        pending.last_line,
        truncated,
    )


def load_conversation_shard(store_root: Path, key: str) -> tuple[list[ConversationRow], ConversationManifest]:
    """The samples of a conversation shard and its manifest; a clear error if ingest has not made it, one
    RecordError line naming the file, the line and the field if a row is torn."""
    layout = StoreLayout(store_root)
    manifest_path = layout.conversations_manifest(key)
    if not manifest_path.exists():
        raise FileNotFoundError(
            f"conversation shard {key} is not in the store {store_root}: run `eagle3 ingest`"
        )
    manifest = ConversationManifest.read(manifest_path)
    samples = read_rows(layout.conversations(key), ConversationRow.model_validate)
    if [s.id for s in samples] != manifest.sample_ids:
        raise RuntimeError(f"conversation shard {key} does not match its manifest; re-run `eagle3 ingest`")
    return samples, manifest
