"""Re-encode hidden-state shards in another store dtype, shard by shard (`eagle3 convert-shards`): a store of
bfloat16 shards becomes FP8 at about half the bytes without extracting again.

Each shard is read and written whole, under its writer lock, into a temporary file beside it, and renamed
over the old one only when complete (`ShardWriter.finalize(in_place=True)`): a crash leaves every shard in its
old dtype or its new one, never half of each, and a rerun converts only what is still in the old dtype. Its
samples keep their ids, lengths, facts and counts; failed samples stay failed with their reasons; a sample
whose states FP8 cannot hold (NaN or inf) is failed with that reason, and counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3_core.errors import RecordError
from eagle3_core.store.atomic import remove_stale_temps
from eagle3_core.store.held import cut_conversion
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.locks import writer_lock
from eagle3_core.store.records import ShardFacts, ShardManifest
from eagle3_core.store.shards import ShardReader, ShardWriter, manifest_from_header, read_shard_header

ROW_COUNTS = ("samples", "tokens", "loss_tokens", "failed")  # recounted by the writer


@dataclass(frozen=True)
class Conversion:
    key: str
    before: str  # the store dtype it had
    bytes_before: int
    bytes_after: int
    newly_failed: int  # samples the new dtype could not hold


def convert_shard(path: Path, store_dtype: str, disk_headroom: float = 1.5) -> Conversion | None:
    """Re-encode the shard at `path` in `store_dtype`; None when it is in that dtype already (its manifest
    rewritten from its header if a crash left the old one beside it). The caller holds its writer lock."""
    header = read_shard_header(path)
    manifest_path = path.with_suffix(".json")
    if header.store_dtype == store_dtype:
        manifest = manifest_from_header(path)
        if _stale(
            manifest_path, manifest
        ):  # a crash between the two renames: the new shard, the old manifest
            manifest.write(manifest_path)
        return None
    size = path.stat().st_size
    with ShardReader(path) as reader:
        meta = reader.meta
        facts = ShardFacts.model_validate({f: getattr(meta, f) for f in ShardFacts.model_fields})
        good = dict(zip(reader.sample_ids, range(len(reader)), strict=True))
        counts = {k: v for k, v in (meta.counts.dump() if meta.counts else {}).items() if k not in ROW_COUNTS}
        with ShardWriter(
            path,
            sample_ids=meta.sample_ids,
            lengths=meta.lengths,
            hidden_size=meta.hidden_size,
            store_dtype=store_dtype,
            num_aux=meta.num_aux,
            facts=facts,
            disk_headroom=disk_headroom,
        ) as writer:
            for j, sample_id in enumerate(meta.sample_ids):
                if sample_id in meta.failed:
                    writer.mark_failed(j, meta.failed[sample_id])
                    continue
                s = reader.sample(good[sample_id])  # digest-checked: a corrupt shard is never converted
                writer.write_sample(j, s.input_ids, s.loss_mask, s.aux_hidden_states, s.last_hidden_states)
            manifest = writer.finalize(counts, in_place=True)
    return Conversion(
        path.stem, header.store_dtype, size, path.stat().st_size, len(manifest.failed) - len(meta.failed)
    )


def _stale(manifest_path: Path, manifest: ShardManifest) -> bool:
    try:
        return ShardManifest.read(manifest_path) != manifest
    except (RecordError, OSError):
        return True


def finish_cut_conversion(root: Path, key: str) -> bool:
    """What a writer of shard `key` killed mid-way left, finished as a rerun of it would: its temporaries
    removed and, where a conversion renamed the new shard in but not its manifest, the manifest written from
    the shard's header. Under the shard's writer lock, taken without waiting (a writer at work on it:
    StoreBusyError, its files left to it). Whether anything was left to finish."""
    layout = StoreLayout(root)
    path = layout.hidden_states(key)
    with writer_lock(layout.writer_lock("hidden_states", key), f"hidden-state shard {key}"):
        removed = remove_stale_temps(path) + remove_stale_temps(layout.hidden_states_manifest(key))
        manifest = cut_conversion(root, key)
        if manifest is not None:
            manifest.write(layout.hidden_states_manifest(key))
    return bool(removed) or manifest is not None


def convert_store(
    root: Path,
    store_dtype: str,
    keys: list[str] | None = None,
    disk_headroom: float = 1.5,
    log: Callable[[str], None] = lambda _: None,
) -> list[Conversion]:
    """Convert the store's shards (or `keys`) to `store_dtype`, one at a time, each under its writer lock."""
    done: list[Conversion] = []
    for path in StoreLayout(root).hidden_state_shards():
        key = path.stem
        if keys is not None and key not in keys:
            continue
        result = convert_key(root, key, store_dtype, disk_headroom, log)
        if result is not None:
            done.append(result)
    return done


def convert_key(
    root: Path,
    key: str,
    store_dtype: str,
    disk_headroom: float = 1.5,
    log: Callable[[str], None] = lambda _: None,
) -> Conversion | None:
    """Convert shard `key` of the store to `store_dtype` under its writer lock (a second writer of it is
    refused, StoreBusyError); None when it is in that dtype already. FileNotFoundError, naming the file, when
    the store holds no such shard."""
    layout = StoreLayout(root)
    path = layout.hidden_states(key)
    if not path.exists():
        raise FileNotFoundError(f"{key}: no hidden-state shard to convert at {path} (extract it first)")
    with writer_lock(layout.writer_lock("hidden_states", key), f"hidden-state shard {key}"):
        result = convert_shard(path, store_dtype, disk_headroom)
    if result is None:
        log(f"{key}: already {store_dtype}")
        return None
    log(
        f"{key}: {result.before} -> {store_dtype}, {result.bytes_before:,} -> {result.bytes_after:,} bytes"
        + (f", {result.newly_failed} sample(s) failed (non-finite states)" if result.newly_failed else "")
    )
    return result
