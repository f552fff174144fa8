"""The regeneration journal: a shard's finished samples, kept while the shard is regenerated.

Both regeneration paths (in process, and through an OpenAI-compatible server) append every finished sample
(each reply of a conversation regenerated `regenerate.samples` times is one, under its own id) to
`regenerated/<key>.journal.jsonl` (one JSON line, fsynced) before counting it as done, keyed by sample id
and bound by a fingerprint to the settings, model, tokenizer and sample ids that produced it. A run that
dies or fails mid-shard leaves the journal; the next run takes the samples in it and regenerates only the
others, and the shard is written whole, in input order, each sample once; then the journal is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TypeVar

from eagle3_core.config import RegenerateConfig
from eagle3_core.store.atomic import fsync_path
from eagle3_core.store.records import JournalEntry, JournalHeader, write_rows

JOURNAL_VERSION = 1


def journal_path(shard: Path) -> Path:
    """Beside the shard it belongs to: `regenerated/<key>.journal.jsonl`."""
    return shard.with_name(f"{shard.stem}.journal.jsonl")


class RegenerationJournal:
    """The finished samples of one shard, one fsynced JSON line each: `{"id", "row", "counts", "new_tokens"}`.

    The first line is a header with the fingerprint of what produced the entries; a journal with another
    fingerprint (other settings, model, tokenizer or samples) is discarded, never mixed into the shard. A line
    torn by a kill is dropped, and the journal is rewritten clean before anything is appended after it.
    """

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self._file: IO[str] | None = None
        self.discarded = ""  # why an existing journal was not used, for the log

    def open(self, sample_ids: Iterable[str]) -> dict[str, JournalEntry]:
        """The usable entries by sample id; the journal is then open for appending."""
        wanted = set(sample_ids)
        entries: dict[str, JournalEntry] = {}
        if self.path.exists():
            # bytes: a line cut mid-character is dropped as torn, and a reply's U+2028 (JSON leaves it as is,
            # str.splitlines would break there) stays inside its line
            lines = self.path.read_bytes().splitlines()
            header = _line_as(JournalHeader, lines[0]) if lines else None
            if header is None or header.fingerprint != self.fingerprint:
                self.discarded = "written for other settings, model, tokenizer or samples"
            else:
                for line in lines[1:]:
                    entry = _line_as(JournalEntry, line)
                    if entry is not None and entry.id in wanted and entry.id not in entries:
                        entries[entry.id] = entry
        header_row = JournalHeader(journal=JOURNAL_VERSION, fingerprint=self.fingerprint)
        write_rows(self.path, [header_row, *entries.values()])
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        return entries

    def append(self, entry: JournalEntry) -> None:
        if self._file is None:
            raise RuntimeError("the journal is not open")
        self._file.write(json.dumps(entry.dump(), ensure_ascii=False, separators=(",", ":")) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())  # a sample counted as done survives a kill of this process

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def remove_journal(shard: Path) -> None:
    """Once `shard` is committed, its journal (if a run left one) has nothing left to give."""
    path = journal_path(shard)
    if path.exists():
        path.unlink()
        fsync_path(path.parent)


J = TypeVar("J", JournalHeader, JournalEntry)


def _line_as(record: type[J], line: bytes) -> J | None:
    """A journal line as its record; None for a line a kill tore (or that is not one)."""
    try:
        return record.model_validate(json.loads(line))
    # not UTF-8, not JSON, or not the record (UnicodeDecodeError and pydantic's ValidationError are
    # ValueErrors); nested past the parser's recursion limit: not a line eagle3 wrote either
    except (ValueError, RecursionError):
        return None


def journal_fingerprint(
    cfg: RegenerateConfig,
    max_seq_len: int,
    tokenizer_fingerprint: str,
    sample_ids: list[str],
    model: str | None,
) -> str:
    """What a journaled reply depends on: the settings, the model that replies (through a server, the
    request's `model`; in process, the target's fingerprint and dtype), the tokenizer and the samples.
    Transport settings (URL, concurrency, timeouts, retries, key), the batch size, the KV cache and the decoding
    step are left out: the same model behind a restarted server on another port, in batches of another size,
    with another cache or through eagle3's batched step instead of `generate`, gives the same replies. So is `samples` (the replies per conversation): each reply is journaled under its own
    id and sampled with its own seed (targets/regenerate.py `request_seed`), whatever the number asked for, so
    a run asking for more replies keeps the journaled ones; a journal written before the setting existed
    still fits (`sample_ids` are the conversations' ids)."""
    what = {
        "regenerate": cfg.model_dump(
            exclude={"server", "batch_size", "kv_cache", "step", "enabled", "samples"}
        ),
        "model": model,
        "max_seq_len": max_seq_len,
        "tokenizer": tokenizer_fingerprint,
        "samples": hashlib.sha256("\n".join(sample_ids).encode()).hexdigest(),
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()
