"""What the store holds, shard by shard, read from its files alone: the truth an orchestrator records.

Read-only and cheap (names, sizes, manifests; no tensor file is opened): `eagle3 status` asks it of every
shard. That a shard held here is also whole and intact is the checks' verdict (eagle3_core/store/checks.py).
"""

from __future__ import annotations

from pathlib import Path

from eagle3_core.errors import RecordError
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
    the file of the size the manifest records. None for a shard deleted, truncated or never finished."""
    layout = StoreLayout(root)
    shard = layout.hidden_states(key)
    try:
        manifest = ShardManifest.read(layout.hidden_states_manifest(key))
        size = shard.stat().st_size
    except (FileNotFoundError, RecordError):
        return None
    return manifest if size == manifest.bytes else None
