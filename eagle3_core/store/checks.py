"""Verdicts of the data and vocabulary checks, computed from the store alone (Dagster shows them as checks).

- `shard_complete`: the shard's file and manifest are there, no unfinished write is, and every training
  conversation of the shard is accounted for exactly once (extracted, failed, dropped at tokenisation, or
  failed at regeneration), each of its replies once where it was regenerated `regenerate.samples` times
  (`replies_per_conversation` in the regenerated manifest). From manifests and file sizes: cheap, and what
  training waits on.
- `shard_integrity`: every sample's digest and the whole-shard checksum, by reading the shard's bytes.
- `reject_rate`: the share of a conversation shard's source rows that ingest rejected.
- `vocab_coverage`: the share of loss tokens the draft vocabulary covers, as recorded when it was built.

Each returns a `CheckVerdict`: whether it passed, a sentence saying why, and the figures behind it.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from eagle3_core.errors import RecordError
from eagle3_core.store.atomic import TEMP_MARK
from eagle3_core.store.layout import VOCAB_INFO_FILE, StoreLayout
from eagle3_core.store.records import (
    ConversationManifest,
    ConversationRow,
    Record,
    RegeneratedManifest,
    ShardManifest,
    VocabInfo,
    read_rows,
    reply_id,
)
from eagle3_core.store.stats import verify_shard

Figure = int | float | str
R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class CheckVerdict:
    passed: bool
    reason: str
    figures: dict[str, Figure] = field(default_factory=dict)


def _read_record(record: type[R], path: Path) -> R | None:
    """The record, or None when it is missing or unreadable (a check fails then; it does not raise)."""
    try:
        return record.read(path)
    except (FileNotFoundError, RecordError):
        return None


# ---- shards --------------------------------------------------------------------------------------------
def shard_complete(root: Path, key: str) -> CheckVerdict:
    """Whether shard `key` is whole: nothing missing, nothing half-written, no conversation lost or doubled."""
    layout = StoreLayout(root)
    shard, manifest_path = layout.hidden_states(key), layout.hidden_states_manifest(key)
    temps = sorted(p.name for p in layout.hidden_states_dir.glob(f".{shard.name}{TEMP_MARK}*"))
    conversations = _read_record(ConversationManifest, layout.conversations_manifest(key))
    manifest = _read_record(ShardManifest, manifest_path)
    missing = [
        str(p)
        for p, there in (
            (layout.conversations_manifest(key), conversations is not None),
            (layout.conversations(key), layout.conversations(key).exists()),
            (shard, shard.exists()),
            (manifest_path, manifest is not None),
        )
        if not there
    ]
    figures: dict[str, Figure] = {"temporary_files": len(temps)}
    if missing:
        return CheckVerdict(False, f"{key}: missing or unreadable: {', '.join(missing)}", figures)
    assert conversations is not None and manifest is not None
    counts = manifest.counts
    try:
        rows = read_rows(layout.conversations(key), ConversationRow.model_validate)
    except RecordError as err:  # a torn row: the check fails naming it, as for a torn manifest
        return CheckVerdict(False, str(err), figures)
    replies = 1
    if manifest.regenerated:  # replies per conversation as regenerated; 1 for a manifest from before samples
        regenerated = _read_record(RegeneratedManifest, layout.regenerated_manifest(key))
        if regenerated is not None and regenerated.replies_per_conversation is not None:
            replies = regenerated.replies_per_conversation
    train_ids = {reply_id(row.id, r) for row in rows if row.split == "train" for r in range(replies)}
    written = manifest.sample_ids
    dropped = list(manifest.dropped or {})
    accounted = counts.samples + counts.errors
    figures |= {
        "train_conversations": conversations.train_samples,
        "replies_per_conversation": replies,
        "samples": counts.samples,
        "failed": counts.failed,
        "dropped": counts.dropped,
        "regeneration_errors": counts.regeneration_errors,
        "accounted": accounted,
        "bytes_on_disk": shard.stat().st_size,
        "bytes_in_manifest": manifest.bytes,
    }
    problems = []
    if temps:
        problems.append(f"an unfinished write is in the store ({temps[0]})")
    if accounted != conversations.train_samples * replies:
        of = f" x {replies} replies each" if replies != 1 else ""
        problems.append(
            f"samples + failed + dropped + regeneration errors = {accounted}, "
            f"but the conversation shard has {conversations.train_samples} training conversations{of}"
        )
    if len(written) != counts.samples + counts.failed or len(dropped) != counts.dropped:
        problems.append("the manifest's sample ids do not match its counts")
    ids = written + dropped
    if len(set(ids)) != len(ids):
        problems.append("a sample id appears twice")
    if not set(ids) <= train_ids:
        problems.append(
            f"{len(set(ids) - train_ids)} sample ids are not training conversations of the shard"
            + (f" (nor their replies 1-{replies - 1})" if replies > 1 else "")
        )
    if shard.stat().st_size != manifest.bytes:
        problems.append(f"the file has {shard.stat().st_size} bytes, its manifest says {manifest.bytes}")
    if problems:
        return CheckVerdict(False, f"{key}: " + "; ".join(problems), figures)
    what = (
        f"{accounted} training conversations"
        if replies == 1
        else f"{accounted} replies to the {conversations.train_samples} training conversations"
    )
    return CheckVerdict(True, f"{key}: all {what} accounted for ({counts.samples} extracted)", figures)


def shard_integrity(root: Path, key: str) -> CheckVerdict:
    """Every byte of shard `key` against its digests and checksum, and its manifest against its header."""
    path = StoreLayout(root).hidden_states(key)
    if not path.exists():
        return CheckVerdict(False, f"{key}: no shard at {path}", {"problems": 1})
    started = time.perf_counter()
    result = verify_shard(path)
    seconds = time.perf_counter() - started
    size = path.stat().st_size
    figures: dict[str, Figure] = {
        "problems": len(result.problems),
        "bytes": size,
        "seconds": round(seconds, 3),
        "mb_per_second": round(size / 1e6 / max(seconds, 1e-9), 1),
    }
    if result.problems:
        more = f" (and {len(result.problems) - 1} more)" if len(result.problems) > 1 else ""
        return CheckVerdict(False, f"{key}: {result.problems[0]}{more}", figures)
    return CheckVerdict(True, f"{key}: every sample matches its digest and the whole-shard checksum", figures)


# ---- conversations ---------------------------------------------------------------------------------------
def reject_rate(root: Path, key: str, max_rate: float, ignored: Collection[str] = ()) -> CheckVerdict:
    """Rows ingest rejected for this shard over the rows it read, reasons in `ignored` left out of the count.

    Duplicates are the usual reason to ignore: deduplication doing its job says nothing about a bad source.
    """
    manifest = _read_record(ConversationManifest, StoreLayout(root).conversations_manifest(key))
    if manifest is None:
        return CheckVerdict(False, f"{key}: no conversation manifest (run `eagle3 ingest`)")
    rejected = manifest.rejected
    rows = manifest.samples + sum(rejected.values())
    counted = sum(n for reason, n in rejected.items() if reason not in ignored)
    rate = counted / rows if rows else 0.0
    figures: dict[str, Figure] = {
        "rows_read": rows,
        "rejected": sum(rejected.values()),
        "rejected_counted": counted,
        "reject_rate": round(rate, 6),
        "max_reject_rate": max_rate,
        "ignored_reasons": ", ".join(sorted(ignored)),
        **{f"rejected_{reason}": n for reason, n in sorted(rejected.items())},
    }
    counted_by = ", ".join(f"{r} {n}" for r, n in sorted(rejected.items()) if r not in ignored)
    left_out = ", ".join(f"{r} {n}" for r, n in sorted(rejected.items()) if r in ignored)
    verdict = "within" if rate <= max_rate else "above"
    return CheckVerdict(
        rate <= max_rate,
        f"{key}: {counted} of {rows} rows rejected ({rate:.1%}, {verdict} the {max_rate:.1%} allowed)"
        + (f"; {counted_by}" if counted_by else "")
        + (f"; not counted: {left_out}" if left_out else ""),
        figures,
    )


# ---- vocabulary ------------------------------------------------------------------------------------------
def vocab_coverage(root: Path, min_coverage: float) -> CheckVerdict:
    """The share of counted loss tokens whose id is in the draft vocabulary, at least `min_coverage`."""
    path = StoreLayout(root).vocab_mapping / VOCAB_INFO_FILE
    info = _read_record(VocabInfo, path)
    if info is None:
        return CheckVerdict(False, f"no vocab mapping at {path} (materialize vocab_mapping)")
    coverage = info.coverage
    figures: dict[str, Figure] = {
        "coverage": round(coverage, 6),
        "min_coverage": min_coverage,
        "draft_vocab_size": info.draft_vocab_size,
        "target_vocab_size": info.target_vocab_size,
        "counted_tokens": info.counted_tokens,
        "distinct_tokens": info.distinct_tokens,
        "padded": info.padded,
        "shards": len(info.shard_set),
    }
    k = figures["draft_vocab_size"]
    if coverage >= min_coverage:
        return CheckVerdict(
            True, f"K={k} covers {coverage:.2%} of loss tokens (at least {min_coverage:.2%})", figures
        )
    return CheckVerdict(
        False,
        f"K={k} covers {coverage:.2%} of loss tokens, under the {min_coverage:.2%} required: "
        "raise train.draft_vocab_size, or lower checks.min_vocab_coverage",
        figures,
    )
