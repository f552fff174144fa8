"""Store statistics from manifests alone, and verification of every shard's bytes.

`store_stats` never opens a tensor file (nor imports torch, so the command answers at once): lengths and
counts are written with each shard, because a post-pass over terabytes of hidden states to learn sample
lengths is the kind of job that gets abandoned.

A shard counts only with both its files: the shard and its manifest (`shard_done`). The writer commits the
manifest first and the shard last, so a manifest alone is an interrupted write, and a shard alone is one
whose manifest was lost (`eagle3 verify --repair` rewrites it).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_core.errors import RecordError, ShardCorruptError
from eagle3_core.store.atomic import TEMP_MARK
from eagle3_core.store.layout import SHARD_KEY, StoreLayout
from eagle3_core.store.records import ConversationManifest, ShardManifest

COLUMNS = ("samples", "tokens", "loss_tokens", "errors", "truncated_samples", "truncated_tokens", "bytes")
HEADERS = ("samples", "tokens", "loss tokens", "errors", "truncated", "tokens cut", "bytes")


@dataclass
class ShardRow:
    key: str
    values: dict[str, int]
    store_dtype: str = ""


@dataclass
class StoreStats:
    shards: list[ShardRow] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)
    # conversations kept in part, cut before an empty turn (by reason, as the manifests count them): samples,
    # apart from `rejected`
    truncated: dict[str, int] = field(default_factory=dict)
    conversations: int = 0
    heldout: int = 0
    disk_free: int = 0
    incomplete: list[str] = field(default_factory=list)  # keys with a shard or a manifest, not both

    @property
    def totals(self) -> dict[str, int]:
        return {c: sum(r.values.get(c, 0) for r in self.shards) for c in COLUMNS}

    def bytes_per_token(self) -> dict[str, float]:
        """Per store dtype: the shards' bytes on disk (header, ids, states and any scales) over their tokens."""
        out: dict[str, float] = {}
        for dtype in sorted({r.store_dtype for r in self.shards}):
            rows = [r for r in self.shards if r.store_dtype == dtype]
            out[dtype] = sum(r.values["bytes"] for r in rows) / max(sum(r.values["tokens"] for r in rows), 1)
        return out


def _row(manifest: ShardManifest) -> dict[str, int]:
    c = manifest.counts
    return {
        "samples": c.samples,
        "tokens": c.tokens,
        "loss_tokens": c.loss_tokens,
        "errors": c.errors,
        "truncated_samples": c.truncated_samples,
        "truncated_tokens": c.truncated_tokens,
        "bytes": manifest.bytes,
    }


def shard_done(root: Path, key: str) -> bool:
    """Whether hidden-state shard `key` is in the store: its file and its manifest both."""
    layout = StoreLayout(root)
    return layout.hidden_states(key).is_file() and layout.hidden_states_manifest(key).is_file()


def store_stats(root: Path) -> StoreStats:
    layout = StoreLayout(root)
    stats = StoreStats(disk_free=shutil.disk_usage(root).free if root.exists() else 0)
    directory = layout.hidden_states_dir
    keys = {
        p.stem
        for p in (*directory.glob("*.json"), *directory.glob("*.safetensors"))
        if SHARD_KEY.match(p.stem)
    }
    for key in sorted(keys):
        if not shard_done(root, key):
            stats.incomplete.append(key)
            continue
        manifest = ShardManifest.read(layout.hidden_states_manifest(key))
        stats.shards.append(ShardRow(manifest.key, _row(manifest), manifest.store_dtype))
    rejected: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    for manifest_path in sorted((root / "conversations").glob("*.json")):
        conversations = ConversationManifest.read(manifest_path)
        stats.conversations += conversations.samples
        stats.heldout += conversations.heldout_samples
        rejected.update(conversations.rejected)
        truncated.update(conversations.truncated)
    stats.rejected = dict(sorted(rejected.items()))
    stats.truncated = dict(sorted(truncated.items()))
    return stats


@dataclass
class VerifyResult:
    path: Path
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_shard(path: Path) -> VerifyResult:
    from eagle3_core.store.shards import ShardReader, manifest_from_header  # torch: not for stats

    if TEMP_MARK in path.name:
        return VerifyResult(
            path, [f"{path}: temporary file of an unfinished write (removed by the next write)"]
        )
    try:
        with ShardReader(path) as reader:
            problems = reader.verify()
    except ShardCorruptError as err:
        return VerifyResult(path, [str(err)])
    manifest_path = path.with_suffix(".json")
    if not manifest_path.exists():
        problems.append(
            f"{manifest_path}: manifest missing (`eagle3 verify --repair` rewrites it from the header)"
        )
    elif not problems:
        try:
            recorded = ShardManifest.read(manifest_path).header_checksum
        except RecordError:
            recorded = None  # unreadable: reported as not matching, like any other damage
        if recorded != manifest_from_header(path).header_checksum:
            problems.append(f"{manifest_path}: manifest does not match its shard's header")
    return VerifyResult(path, problems)


def verify_store(root: Path, keys: list[str] | None = None) -> list[VerifyResult]:
    layout = StoreLayout(root)
    if keys:
        paths = [layout.hidden_states(k) for k in keys]
    else:
        paths = sorted(layout.hidden_states_dir.glob("*.safetensors")) + sorted(
            layout.hidden_states_dir.glob(f".*{TEMP_MARK}*")
        )
    return [verify_shard(p) if p.exists() else VerifyResult(p, [f"{p}: missing"]) for p in paths]


# Shards found intact in this process, by file identity: `eagle3 train` checks before the vocabulary and
# again before training, and a shard that was not replaced or modified in between is not read twice.
_INTACT: set[tuple[int, ...]] = set()


def _identity(path: Path) -> tuple[int, ...]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def require_intact(paths: Sequence[Path], log: Callable[[str], None] = lambda _: None) -> None:
    """Refuse (ShardCorruptError) unless every shard in `paths` matches its checksums and has its manifest.

    For whatever reads shards to train: a bad byte stops the run before anything is built, not at the
    step that first reads its sample. Shards are read on a few threads (hashing releases the GIL).
    """
    todo = {p: _identity(p) for p in paths}
    todo = {p: ident for p, ident in todo.items() if ident not in _INTACT}
    if not todo:
        return
    bad: list[VerifyResult] = []
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="verify") as pool:
        futures = [pool.submit(verify_shard, p) for p in todo]
        for done, future in enumerate(as_completed(futures), 1):
            result = future.result()
            if not result.ok:
                bad.append(result)
            if done == len(todo) or done % max(1, len(todo) // 20) == 0:  # ~20 lines for any store
                log(f"checksums: {done}/{len(todo)} shards")
    if bad:
        raise _refusal(bad)
    _INTACT.update(todo.values())


def _refusal(bad: list[VerifyResult]) -> ShardCorruptError:
    first = min(bad, key=lambda r: r.path.name)
    key = first.path.stem
    others = f" ({len(bad) - 1} more shards have problems)" if len(bad) > 1 else ""
    fix = (
        "`eagle3 verify --repair` rewrites its manifest"
        if all("manifest" in p for p in first.problems)
        else f"re-extract it with `eagle3 extract --shard {key} --force`"
    )
    return ShardCorruptError(
        f"shard {key} is damaged: {first.problems[0]}{others}. Nothing was built or trained: run "
        f"`eagle3 verify` to list every problem; {fix}"
    )
