"""Store statistics from manifests alone, and verification of every shard's bytes.

`store_stats` never opens a tensor file (nor imports torch, so the command answers at once): lengths and counts are written with each shard, because a post-pass
over terabytes of hidden states to learn sample lengths is the kind of job that gets abandoned.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_core.store.atomic import TEMP_MARK
from eagle3_core.store.layout import StoreLayout

COLUMNS = ("samples", "tokens", "loss_tokens", "errors", "truncated_samples", "truncated_tokens", "bytes")
HEADERS = ("samples", "tokens", "loss tokens", "errors", "truncated", "tokens cut", "bytes")


@dataclass
class ShardRow:
    key: str
    values: dict[str, int]


@dataclass
class StoreStats:
    shards: list[ShardRow] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)
    conversations: int = 0
    heldout: int = 0
    disk_free: int = 0

    @property
    def totals(self) -> dict[str, int]:
        return {c: sum(r.values.get(c, 0) for r in self.shards) for c in COLUMNS}


def shard_errors(counts: dict[str, int]) -> int:
    """Samples of a shard that did not make it: failed extraction, dropped at tokenisation, failed regeneration."""
    return counts["failed"] + counts.get("dropped", 0) + counts.get("regeneration_errors", 0)


def _row(manifest: dict[str, Any]) -> dict[str, int]:
    c = manifest["counts"]
    return {
        "samples": c["samples"],
        "tokens": c["tokens"],
        "loss_tokens": c["loss_tokens"],
        "errors": shard_errors(c),
        "truncated_samples": c.get("truncated_samples", 0),
        "truncated_tokens": c.get("truncated_tokens", 0),
        "bytes": manifest["bytes"],
    }


def store_stats(root: Path) -> StoreStats:
    layout = StoreLayout(root)
    stats = StoreStats(disk_free=shutil.disk_usage(root).free if root.exists() else 0)
    for manifest_path in sorted(layout.hidden_states_dir.glob("*.json")):
        manifest = json.loads(manifest_path.read_text())
        stats.shards.append(ShardRow(manifest["key"], _row(manifest)))
    rejected: dict[str, int] = {}
    for manifest_path in sorted((root / "conversations").glob("*.json")):
        manifest = json.loads(manifest_path.read_text())
        stats.conversations += manifest["samples"]
        stats.heldout += manifest["heldout_samples"]
        for reason, n in manifest["rejected"].items():
            rejected[reason] = rejected.get(reason, 0) + n
    stats.rejected = dict(sorted(rejected.items()))
    return stats


@dataclass
class VerifyResult:
    path: Path
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_shard(path: Path) -> VerifyResult:
    from eagle3_core.store.shards import (  # torch: not for stats
        ShardCorruptError,
        ShardReader,
        manifest_from_header,
    )

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
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("header_checksum") != manifest_from_header(path)["header_checksum"]:
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
