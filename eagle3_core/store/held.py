"""What the store holds, shard by shard, read from its files alone: the truth an orchestrator records.

Read-only and cheap (names, sizes, manifests; no tensor file is opened): `eagle3 status` asks it of every
shard. That a shard held here is also whole and intact is the checks' verdict (eagle3_core/store/checks.py).
"""

from __future__ import annotations

from pathlib import Path

from eagle3_core.errors import RecordError, ShardCorruptError
from eagle3_core.store.layout import SHARD_KEY, StoreLayout
from eagle3_core.store.records import ShardManifest


def store_shard_keys(root: Path) -> list[str]:
    """Every shard of the store: one ingest (or the inbox) wrote, or one whose hidden states are there."""
    layout = StoreLayout(root)
    conversations = (root / "conversations").glob("*.json")
    hidden_states = layout.hidden_states_dir.glob("*.safetensors")
    return sorted({p.stem for p in (*conversations, *hidden_states) if SHARD_KEY.match(p.stem)})


def held_shard(root: Path, key: str) -> ShardManifest | None:
    """The manifest of hidden-state shard `key` if the store holds the shard: its file and a readable manifest,
    the file of the size the manifest records. None for a shard deleted, truncated or never finished. A shard
    whose conversion (`eagle3 convert-shards`) was cut between its two renames is held too, whole in its new
    dtype beside its old manifest: its manifest is then the one its header gives (`cut_conversion`)."""
    layout = StoreLayout(root)
    shard = layout.hidden_states(key)
    try:
        manifest = ShardManifest.read(layout.hidden_states_manifest(key))
        size = shard.stat().st_size
    except (FileNotFoundError, RecordError):
        return None
    return manifest if size == manifest.bytes else cut_conversion(root, key, manifest)


def cut_conversion(root: Path, key: str, manifest: ShardManifest | None = None) -> ShardManifest | None:
    """The manifest shard `key`'s header gives when a conversion was cut after renaming the new shard over the
    old one and before renaming its manifest in: the shard whole (its header checked against the file's size)
    and the manifest (`manifest`, else the one on disk) of the same samples in another dtype. None when the
    files are not that. Reads the shard's header only."""
    from eagle3_core.store.shards import manifest_from_header  # torch: only for a shard that may be one

    layout = StoreLayout(root)
    try:
        old = manifest or ShardManifest.read(layout.hidden_states_manifest(key))
        new = manifest_from_header(layout.hidden_states(key))
    except (OSError, RecordError, ShardCorruptError):
        return None
    converted = new.store_dtype != old.store_dtype and (new.key, new.sample_ids) == (old.key, old.sample_ids)
    return new if converted else None
