"""Hidden-state shards: one safetensors file per shard, written streamed and atomically, read memory-mapped.

File layout (a valid safetensors file; `safetensors.safe_open` reads it):

    u64 header length | header JSON, space-padded so the data starts 64-byte aligned | data
    data = offsets int64 [N+1] | input_ids int32 [T] | aux_hidden_states [T, 3H] | last_hidden_states [T, H]
           | loss_mask uint8 [T]

Sample i is rows offsets[i]:offsets[i+1] of every [T, ...] tensor; no padding is stored. With store_dtype
fp8_e4m3 (eagle3_core/store/fp8.py) the two state tensors are FP8 and two more follow the loss mask, their
scales: aux_scales float32 [T, num_aux] | last_scales float32 [T, 1]; readers hand the states back dequantised,
and the training loader copies the FP8 bytes and scales as they are, to be dequantised on the device. Lengths are known
before the target runs, so the header is written first with room reserved, rows go straight into the
preallocated temporary file as batches finish (memory: one batch), and `finalize` rewrites the header in
place with the counts and checksums, fsyncs and renames. A file under its final name is complete, and its
manifest is beside it: the manifest is committed first and the shard's rename is the commit point, so a
crash or a full disk at any moment leaves the shard whole with its manifest, or absent (at most a manifest
without its shard, which readers ignore and the next writer replaces). A disk that fills up is reported as
a `DiskSpaceError` naming the shard, after the temporary files are removed and the descriptor closed.

The caller holds the shard's writer lock (eagle3_core/store/locks.py): the writer removes the temporary
files an earlier writer of the shard left, which must never be those of a writer still at work.

Integrity: each sample has a sha256 digest of its rows (input_ids, loss_mask, aux, last bytes, in that
order), computed by the writer from the batch in memory; `checksum` is sha256 over the offsets bytes and the
sample digests, so it covers every tensor byte; `header_checksum` covers the header itself. The reader
checks the header when it opens a shard and a sample's digest each time it reads that sample.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch
from pydantic import ValidationError

from eagle3_core.errors import ShardCorruptError
from eagle3_core.store.atomic import fsync_path, json_text, remove_stale_temps, temp_path_for, write_temp
from eagle3_core.store.disk import disk_preflight, full_disk_is_one_line
from eagle3_core.store.fp8 import FP8, SCALE_DTYPE, NonFiniteStates, dequantize, quantize
from eagle3_core.store.records import ShardCounts, ShardFacts, ShardHeader, ShardManifest, validation_message

SCHEMA = "eagle3.hidden_states/1"
DATA_ALIGN = 64
DTYPES: dict[str, tuple[torch.dtype, str, int]] = {  # name -> (torch dtype, safetensors dtype, bytes)
    "int64": (torch.int64, "I64", 8),
    "int32": (torch.int32, "I32", 4),
    "uint8": (torch.uint8, "U8", 1),
    "bfloat16": (torch.bfloat16, "BF16", 2),
    "float16": (torch.float16, "F16", 2),
    "float32": (torch.float32, "F32", 4),
    "fp8_e4m3": (torch.float8_e4m3fn, "F8_E4M3", 1),
}
QUANTIZED = ("fp8_e4m3",)  # store dtypes whose states carry a scale per token and layer block
SCALES = {"aux_hidden_states": "aux_scales", "last_hidden_states": "last_scales"}
MAX_REASON = 200
SAMPLE_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states")  # digest order
NO_FALLOCATE = (errno.EOPNOTSUPP, errno.EINVAL)  # the filesystem cannot preallocate: a sparse file instead


def sample_tensors(store_dtype: str) -> tuple[str, ...]:
    """A sample's tensors in a shard of `store_dtype`, in digest order: the scales last, where there are any."""
    return (*SAMPLE_TENSORS, *SCALES.values()) if store_dtype in QUANTIZED else SAMPLE_TENSORS


def _digest(data: bytes | memoryview = b"") -> Any:
    # sha256: with the SHA extensions of current x86 CPUs it hashes 2x faster than blake2b (1.1-1.4 GB/s).
    return hashlib.sha256(data)


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: str
    row_shape: tuple[int, ...]  # shape of one row ([] for 1-D tensors)
    rows: int
    start: int  # byte offset inside the data region

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.row_shape, dtype=np.int64)) * DTYPES[self.dtype][2]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def header_entry(self) -> dict[str, Any]:
        return {
            "dtype": DTYPES[self.dtype][1],
            "shape": [self.rows, *self.row_shape],
            "data_offsets": [self.start, self.start + self.nbytes],
        }


def plan_slots(lengths: list[int], hidden_size: int, num_aux: int, store_dtype: str) -> dict[str, TensorSlot]:
    tokens = sum(lengths)
    specs = [
        ("offsets", "int64", (), len(lengths) + 1),
        ("input_ids", "int32", (), tokens),
        ("aux_hidden_states", store_dtype, (num_aux * hidden_size,), tokens),
        ("last_hidden_states", store_dtype, (hidden_size,), tokens),
        ("loss_mask", "uint8", (), tokens),
    ]
    if store_dtype in QUANTIZED:
        specs += [("aux_scales", "float32", (num_aux,), tokens), ("last_scales", "float32", (1,), tokens)]
    slots: dict[str, TensorSlot] = {}
    start = 0
    for name, dtype, row_shape, rows in specs:
        slots[name] = TensorSlot(name, dtype, row_shape, rows, start)
        start += slots[name].nbytes
    return slots


def estimate_shard_bytes(
    lengths: list[int], hidden_size: int, num_aux: int = 3, store_dtype: str = "bfloat16"
) -> int:
    slots = plan_slots(lengths, hidden_size, num_aux, store_dtype)
    return sum(s.nbytes for s in slots.values()) + _reserved_header_bytes(len(lengths)) + 8


def _reserved_header_bytes(num_samples: int) -> int:
    # ids, lengths and digests, with room for every sample to fail with a reason and for the counts.
    return 16_384 + num_samples * (70 + 12 + 68 + MAX_REASON + 80)


def _header_checksum(header: dict[str, Any]) -> str:
    body = {k: v for k, v in header.items() if k != "__metadata__"}
    meta = {k: v for k, v in header["__metadata__"].items() if k != "header_checksum"}
    blob = json.dumps({"tensors": body, "metadata": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _tensor_bytes(t: torch.Tensor, dtype: str | None = None) -> memoryview:
    """`t`'s bytes as stored in `dtype` (None: its own dtype)."""
    as_dtype = t.dtype if dtype is None else DTYPES[dtype][0]
    arr = t.detach().to(device="cpu", dtype=as_dtype).contiguous().view(torch.uint8).numpy()
    return memoryview(arr).cast("B")  # type: ignore[arg-type]


DIGEST_PIECE = 64 << 20  # bytes a thread hashes at a time


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over named tensors in name order: each one's name, dtype and shape, then the sha256 of each
    64 MiB piece of its bytes. The checksum a training checkpoint records of each of its safetensors files
    (train/checkpoint.py), so a file that still loads but holds other bytes or other tensors is caught.

    The pieces are hashed on a thread each (hashlib lets go of the GIL over a large buffer): a checkpoint at
    hidden 7168 is 11 GiB, which one thread hashes in about 10 s, at every save and every resume."""
    names = sorted(tensors)
    # flat: a 0-d tensor (an optimizer's step) has no byte view
    views = {name: _tensor_bytes(tensors[name].reshape(-1)) for name in names}
    starts = {name: range(0, max(len(views[name]), 1), DIGEST_PIECE) for name in names}
    pieces = [views[name][start : start + DIGEST_PIECE] for name in names for start in starts[name]]
    with ThreadPoolExecutor(max_workers=max(1, min(len(pieces), os.cpu_count() or 1, 32))) as pool:
        digests = iter(pool.map(lambda piece: bytes(_digest(piece).digest()), pieces))
    h = _digest()
    for name in names:
        t = tensors[name]
        h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
        for _ in starts[name]:
            h.update(next(digests))
    return str(h.hexdigest())


class ShardWriter:
    """Streams one shard: header first, then rows per sample in any order, then `finalize`.

    Use as a context manager: leaving it by an exception removes the temporary file.
    """

    def __init__(
        self,
        path: Path,
        *,
        sample_ids: list[str],
        lengths: list[int],
        hidden_size: int,
        store_dtype: str = "bfloat16",
        num_aux: int = 3,
        facts: ShardFacts | None = None,
        disk_headroom: float = 1.5,
    ) -> None:
        if len(sample_ids) != len(lengths):
            raise ValueError("sample_ids and lengths differ in length")
        if any(n <= 0 for n in lengths):
            raise ValueError("every sample needs at least one token")
        self.path = path
        self.sample_ids = list(sample_ids)
        self.lengths = list(lengths)
        self.hidden_size = hidden_size
        self.num_aux = num_aux
        self.store_dtype = store_dtype
        self.facts = facts or ShardFacts()
        self.counts: ShardCounts | None = None  # set by finalize
        self.slots = plan_slots(self.lengths, hidden_size, num_aux, store_dtype)
        self.tensor_names = sample_tensors(store_dtype)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)]).astype(np.int64)
        self.digests: list[str | None] = [None] * len(lengths)
        self.loss_tokens = [0] * len(lengths)
        self.failed: dict[str, str] = {}
        self.manifest_path = path.with_suffix(".json")
        self._committed = False
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path)
        remove_stale_temps(self.manifest_path)
        self._needed = estimate_shard_bytes(self.lengths, hidden_size, num_aux, store_dtype)
        disk_preflight(path.parent, self._needed, disk_headroom, f"shard {path.stem}")
        self.temp = temp_path_for(path)
        self._fd = -1
        with self._on_disk("creating its temporary file"):
            self._fd = os.open(self.temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:  # not yet inside a `with`: a failure here must close the descriptor and remove the file itself
            self._start()
        except BaseException:
            self.abort()
            raise

    def _start(self) -> None:
        self._header_room = self._header_len(self._header(placeholder=True)) + _reserved_header_bytes(
            len(self.lengths)
        )
        self._header_room += (-(8 + self._header_room)) % DATA_ALIGN
        self._data_start = 8 + self._header_room
        self._needed = self._data_start + sum(s.nbytes for s in self.slots.values())  # exact, not estimated
        self._preallocate(self._needed)
        self._write_header(placeholder=True)
        self._pwrite_slot("offsets", 0, memoryview(self.offsets.tobytes()))

    # ---- a full disk ----------------------------------------------------------------------------------
    def _on_disk(self, doing: str) -> AbstractContextManager[None]:
        """A full disk or quota (ENOSPC, EDQUOT) under the block is a DiskSpaceError naming the shard and the bytes."""

        def say(reason: str, free: int) -> str:
            return (
                f"shard {self.path.stem}: the disk filled up while {doing} ({reason}); the shard needs "
                f"{self._needed:,} bytes ({self._needed / 2**30:.2f} GiB) and {self.path.parent} has {free:,} "
                f"bytes ({free / 2**30:.2f} GiB) free. Free space or move the store, then extract it again"
            )

        return full_disk_is_one_line(self.path.parent, say)

    def _pwrite(self, data: memoryview, offset: int) -> None:
        # pwrite may write less than asked when the disk is filling up: the rest is written or its error raised
        with self._on_disk("writing the shard"):
            while len(data):
                n = os.pwrite(self._fd, data, offset)
                if n <= 0:
                    raise OSError(errno.EIO, f"pwrite wrote {n} of {len(data)} bytes", str(self.temp))
                data, offset = data[n:], offset + n

    # ---- header ---------------------------------------------------------------------------------------
    def _header(self, placeholder: bool) -> dict[str, Any]:
        # finalize writes the real header only once every sample has its digest
        digests = ["0" * 64 if placeholder or d is None else d for d in self.digests]
        counts = {"counts": self.counts} if self.counts is not None else {}
        meta = ShardHeader.model_validate(
            {
                "format": "pt",
                "schema": SCHEMA,
                "store_dtype": self.store_dtype,
                "hidden_size": self.hidden_size,
                "num_aux": self.num_aux,
                **self.facts.dump(),
                **counts,
                "sample_ids": self.sample_ids,
                "lengths": self.lengths,
                "failed": self.failed,
                "sample_digests": digests,
                "checksum": "0" * 64 if placeholder else self._checksum(),
            }
        )
        header: dict[str, Any] = {name: slot.header_entry() for name, slot in self.slots.items()}
        header["__metadata__"] = {k: _meta_str(k, v) for k, v in meta.dump().items()}
        header["__metadata__"]["header_checksum"] = _meta_str("header_checksum", _header_checksum(header))
        return header

    @staticmethod
    def _header_len(header: dict[str, Any]) -> int:
        return len(json.dumps(header, separators=(",", ":")).encode())

    def _write_header(self, placeholder: bool) -> None:
        blob = json.dumps(self._header(placeholder), separators=(",", ":")).encode()
        if len(blob) > self._header_room:
            raise RuntimeError(f"shard header outgrew its reserved {self._header_room} bytes")
        blob += b" " * (self._header_room - len(blob))
        self._pwrite(memoryview(self._header_room.to_bytes(8, "little") + blob), 0)

    def _checksum(self) -> str:
        h = _digest()
        h.update(self.offsets.tobytes())
        for d in self.digests:
            h.update(bytes.fromhex(d or "0" * 64))
        return h.hexdigest()

    def _preallocate(self, size: int) -> None:
        # Reserve the blocks now, so a disk that fills up fails this shard at the start, not hours in.
        with self._on_disk("reserving its space"):
            try:
                os.posix_fallocate(self._fd, 0, size)
            except OSError as err:
                if err.errno not in NO_FALLOCATE:
                    raise
                os.ftruncate(self._fd, size)

    # ---- rows -----------------------------------------------------------------------------------------
    def _pwrite_slot(self, name: str, first_row: int, data: memoryview) -> None:
        slot = self.slots[name]
        self._pwrite(data, self._data_start + slot.start + first_row * slot.row_bytes)

    def write_sample(
        self,
        index: int,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux: torch.Tensor,
        last: torch.Tensor,
        *,
        aux_scales: torch.Tensor | None = None,
        last_scales: torch.Tensor | None = None,
    ) -> None:
        """Write sample `index`: input_ids/loss_mask [T], aux [T, 3H], last [T, H] (any float dtype/device).

        In an FP8 shard a sample whose states hold NaN or inf is marked failed with the reason instead. With
        `aux_scales` [T, 3] and `last_scales` [T, 1] (float32) the states are FP8 already, quantised by
        store/fp8.py on the target's device, and are written as they are."""
        n = self.lengths[index]
        expected = {
            "input_ids": (n,),
            "loss_mask": (n,),
            "aux_hidden_states": (n, self.num_aux * self.hidden_size),
            "last_hidden_states": (n, self.hidden_size),
        }
        tensors = {
            "input_ids": input_ids,
            "loss_mask": loss_mask,
            "aux_hidden_states": aux,
            "last_hidden_states": last,
        }
        for name in SAMPLE_TENSORS:
            if tuple(tensors[name].shape) != expected[name]:
                raise ValueError(
                    f"{self._sample(index)}: {name} has shape {tuple(tensors[name].shape)}, "
                    f"expected {expected[name]}"
                )
        prequantized = (
            aux_scales is not None or last_scales is not None or aux.dtype == FP8 or last.dtype == FP8
        )
        if prequantized:
            tensors |= self._checked_scales(index, aux, last, aux_scales, last_scales)
        elif self.store_dtype in QUANTIZED:
            try:
                tensors |= self._quantized(tensors)
            except NonFiniteStates as err:
                self.mark_failed(index, err.reason)
                return
        h = _digest()
        first = int(self.offsets[index])
        for name in self.tensor_names:
            data = _tensor_bytes(tensors[name], self.slots[name].dtype)
            h.update(data)
            self._pwrite_slot(name, first, data)
        self.digests[index] = h.hexdigest()
        self.loss_tokens[index] = int(loss_mask.sum())

    def _sample(self, index: int) -> str:
        return f"sample {index} ({self.sample_ids[index][:12]})"

    def _checked_scales(
        self,
        index: int,
        aux: torch.Tensor,
        last: torch.Tensor,
        aux_scales: torch.Tensor | None,
        last_scales: torch.Tensor | None,
    ) -> dict[str, torch.Tensor]:
        """The scales of states quantised before they came here, refused unless they are what this shard
        stores as they are: a wrong dtype or layout would be written silently and read back as other
        numbers."""
        where = f"{self._sample(index)}: pre-quantised states"
        if self.store_dtype not in QUANTIZED:
            raise ValueError(f"{where} given to a {self.store_dtype} shard, which stores no scales")
        if aux.dtype != FP8 or last.dtype != FP8:
            raise ValueError(f"{where} must be {FP8}, got aux {aux.dtype} and last {last.dtype}")
        n = self.lengths[index]
        checked: dict[str, torch.Tensor] = {}
        for name, t, shape in (
            ("aux_scales", aux_scales, (n, self.num_aux)),
            ("last_scales", last_scales, (n, 1)),
        ):
            if t is None or t.dtype != SCALE_DTYPE or tuple(t.shape) != shape:
                got = "none" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise ValueError(f"{where}: {name} must be {SCALE_DTYPE} {shape}, got {got}")
            checked[name] = t
        return checked

    def _quantized(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The states as FP8 and their scales (store/fp8.py): a block per aux layer, one for the final state."""
        out: dict[str, torch.Tensor] = {}
        for name, groups in (("aux_hidden_states", self.num_aux), ("last_hidden_states", 1)):
            q = quantize(tensors[name], groups)
            out[name], out[SCALES[name]] = q.values, q.scales
        return out

    def mark_failed(self, index: int, reason: str) -> None:
        """A sample whose states could not be obtained: its rows stay zero and readers skip it."""
        n = self.lengths[index]
        zeros = {
            "input_ids": torch.zeros(n, dtype=torch.int32),
            "loss_mask": torch.zeros(n, dtype=torch.uint8),
            "aux": torch.zeros(n, self.num_aux * self.hidden_size),
            "last": torch.zeros(n, self.hidden_size),
        }
        self.write_sample(index, zeros["input_ids"], zeros["loss_mask"], zeros["aux"], zeros["last"])
        self.failed[self.sample_ids[index]] = reason[:MAX_REASON]

    # ---- commit ---------------------------------------------------------------------------------------
    def finalize(self, counts: Mapping[str, int] | None = None, *, in_place: bool = False) -> ShardManifest:
        """Commit the shard; `counts`: what the caller counted before the rows (ShardCounts' leading fields).

        `in_place`: the shard replaces one of the same samples whose rows exist nowhere else (a conversion):
        see `_commit`."""
        missing = [i for i, d in enumerate(self.digests) if d is None]
        if missing:
            raise RuntimeError(f"{len(missing)} samples were never written (first: index {missing[0]})")
        self.counts = ShardCounts.model_validate({**(counts or {}), **self._row_counts()})
        try:
            self._write_header(placeholder=False)
            with self._on_disk("finishing the shard"):
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
                manifest = manifest_from_header(self.temp, final=self.path)
                self._commit(manifest, in_place)
        except BaseException:
            self.abort()
            raise
        return manifest

    def _commit(self, manifest: ShardManifest, in_place: bool = False) -> None:
        """Manifest first, shard last: the shard's rename is the commit point (see the module docstring).

        In place, the new shard is renamed over the old one first and its manifest follows: the old rows are
        never removed before the new ones are in place, and a crash between the renames leaves the new shard
        with the old manifest, which `verify` names and a rerun of the conversion (or `verify --repair`)
        rewrites from the shard's header."""
        manifest_temp = write_temp(self.manifest_path, json_text(manifest.dump()).encode())
        if in_place:
            os.replace(self.temp, self.path)
            self._committed = True
            fsync_path(self.path.parent)
            os.replace(manifest_temp, self.manifest_path)
            fsync_path(self.path.parent)
            return
        # A redo: the old shard goes before the new manifest is put in, so the two never meet.
        self.path.unlink(missing_ok=True)
        os.replace(manifest_temp, self.manifest_path)
        fsync_path(self.path.parent)  # the manifest's rename is durable before the shard's can be
        os.replace(self.temp, self.path)
        self._committed = True
        fsync_path(self.path.parent)

    def _row_counts(self) -> dict[str, int]:
        good = [i for i, s in enumerate(self.sample_ids) if s not in self.failed]
        return {
            "samples": len(good),
            "tokens": int(sum(self.lengths[i] for i in good)),
            "loss_tokens": int(sum(self.loss_tokens[i] for i in good)),
            "failed": len(self.failed),
        }

    def abort(self) -> None:
        """Close and remove what this writer made; a shard that never got in place leaves no manifest."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._committed:
            return  # the shard and its manifest are both in place (only a directory fsync failed)
        self.temp.unlink(missing_ok=True)
        temp_path_for(self.manifest_path).unlink(missing_ok=True)
        if not self.path.exists():
            self.manifest_path.unlink(missing_ok=True)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif self._fd >= 0:
            self.abort()
            raise RuntimeError("ShardWriter left without finalize(); the shard was discarded")


def _meta_str(key: str, value: Any) -> str:
    # safetensors metadata maps str -> str: every value is stored as JSON, but for the conventional "format".
    return value if key == "format" else json.dumps(value, separators=(",", ":"))


def _meta_value(key: str, text: str) -> Any:
    return text if key == "format" else json.loads(text)


# ---- reading ----------------------------------------------------------------------------------------------
def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The parsed header and the data region's start, checked against the header checksum and file size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ShardCorruptError(f"{path}: truncated ({size} bytes)")
        n = int.from_bytes(head, "little")
        if 8 + n > size:
            raise ShardCorruptError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
        blob = f.read(n)
    try:
        header = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ShardCorruptError(f"{path}: header is not valid JSON ({err})") from None
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else {}
    if meta.get("schema") != json.dumps(SCHEMA):
        raise ShardCorruptError(f"{path}: not an eagle3 hidden-state shard (schema {meta.get('schema')!r})")
    if meta.get("header_checksum") != _meta_str("header_checksum", _header_checksum(header)):
        raise ShardCorruptError(f"{path}: header checksum mismatch (the header was modified or corrupted)")
    data_bytes = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    if 8 + n + data_bytes != size:
        raise ShardCorruptError(f"{path}: {size} bytes on disk, the header describes {8 + n + data_bytes}")
    return header, 8 + n


def decode_metadata(header: dict[str, Any], path: Path) -> ShardHeader:
    """The header's metadata as its record; one line naming the shard and the field when it does not fit."""
    try:
        return ShardHeader.model_validate({k: _meta_value(k, v) for k, v in header["__metadata__"].items()})
    except json.JSONDecodeError as err:
        raise ShardCorruptError(f"{path}: a header metadata value is not valid JSON ({err})") from None
    except ValidationError as err:
        raise ShardCorruptError(validation_message(path, err)) from None


def read_shard_header(path: Path) -> ShardHeader:
    """A shard's header metadata, checked (`read_header`) and typed, without opening its tensors."""
    return decode_metadata(read_header(path)[0], path)


def manifest_from_header(path: Path, final: Path | None = None) -> ShardManifest:
    """The manifest beside a shard: its header metadata (without per-sample digests), size and name.

    `final`: the name the shard will have, when `path` is its temporary file not yet renamed.
    """
    name = final or path
    return ShardManifest.of(read_shard_header(path), key=name.stem, file=name.name, size=path.stat().st_size)


@dataclass(frozen=True)
class ShardSample:
    sample_id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    aux_hidden_states: torch.Tensor  # [T, 3H]
    last_hidden_states: torch.Tensor  # [T, H]


class ShardReader:
    """Memory-mapped random access to the samples of one shard, checking each sample's digest on read.

    Indices run over the good samples only; samples the writer marked failed are not visible.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header, self._data_start = read_header(path)
        self.meta = decode_metadata(self.header, path)
        self._all_ids = self.meta.sample_ids
        self._digests = self.meta.sample_digests
        failed = self.meta.failed
        self._index = [i for i, s in enumerate(self._all_ids) if s not in failed]
        self.tensor_names = sample_tensors(self.meta.store_dtype)
        self.quantized = self.meta.store_dtype in QUANTIZED
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close(); the mmap outlives __init__)
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self._offsets = np.frombuffer(self._raw("offsets", 0, len(self._all_ids) + 1), dtype=np.int64).copy()
        if not np.array_equal(np.diff(self._offsets), np.asarray(self.meta.lengths, dtype=np.int64)):
            raise ShardCorruptError(f"{path}: the offsets tensor does not match the recorded lengths")

    @property
    def sample_ids(self) -> list[str]:
        return [self._all_ids[i] for i in self._index]

    @property
    def lengths(self) -> list[int]:
        return [self.meta.lengths[i] for i in self._index]

    def __len__(self) -> int:
        return len(self._index)

    def stored_index(self, i: int) -> int:
        """Good sample i's index among all the shard's samples, failed ones included: its place in the
        header's per-sample lists."""
        return self._index[i]

    def _raw(self, name: str, first_row: int, rows: int) -> memoryview:
        """A view of the mapping. Use it in a `with` block: a view left alive (by the traceback of an error
        raised while it was in scope) keeps the mapping exported, and `close` would raise BufferError."""
        entry = self.header[name]
        row_bytes = DTYPES[_dtype_name(entry["dtype"])][2] * int(np.prod(entry["shape"][1:], dtype=np.int64))
        start = self._data_start + entry["data_offsets"][0] + first_row * row_bytes
        return memoryview(self._mm)[start : start + rows * row_bytes]

    def _tensor(self, name: str, first: int, rows: int, h: Any) -> torch.Tensor:
        entry = self.header[name]
        dtype = DTYPES[_dtype_name(entry["dtype"])][0]
        with self._raw(name, first, rows) as raw:
            if h is not None:
                h.update(raw)
            t = torch.frombuffer(bytearray(raw), dtype=dtype) if rows else torch.empty(0, dtype=dtype)
        return t.view(rows, *entry["shape"][1:])

    def _checksum_error(self, j: int) -> ShardCorruptError:
        where = f"sample {self._index.index(j)}" if j in self._index else "failed sample"
        return ShardCorruptError(f"{self.path}: {where} ({self._all_ids[j][:12]}) fails its checksum")

    def _sample_digest(self, j: int) -> str:
        """The digest of sample j's rows as stored, hashed straight from the mapping (no copy)."""
        first, rows = self._rows(j)
        h = _digest()
        for name in self.tensor_names:
            with self._raw(name, first, rows) as raw:
                h.update(raw)
        return str(h.hexdigest())

    def _rows(self, j: int) -> tuple[int, int]:
        """First row and row count of sample j (over all samples, failed ones included)."""
        return int(self._offsets[j]), int(self._offsets[j + 1] - self._offsets[j])

    def sample(self, i: int, verify: bool = True) -> ShardSample:
        """Sample i, its states in the store dtype (an FP8 shard's dequantised to bfloat16)."""
        j = self._index[i]
        first, rows = self._rows(j)
        h = _digest() if verify else None
        tensors = {n: self._tensor(n, first, rows, h) for n in self.tensor_names}
        if h is not None and h.hexdigest() != self._digests[j]:
            raise self._checksum_error(j)
        if self.quantized:
            for name, scales in SCALES.items():
                tensors[name] = dequantize(tensors[name], tensors.pop(scales))
        return ShardSample(self._all_ids[j], *(tensors[n] for n in SAMPLE_TENSORS))

    def copy_sample_into(self, i: int, out: dict[str, torch.Tensor]) -> None:
        """Copy sample i's rows straight from the mapped file into `out` (name -> tensor of at most its rows).

        One copy and no intermediate buffers: what the training loader uses to fill a (pinned) batch. A
        destination shorter than the sample takes its first rows (a cut to max_len); the digest is still
        checked over the whole sample, so a cut never hides corruption. From an FP8 shard, `out` takes the FP8
        states and their scales as stored (dequantised later, on the device), or, without the scales in `out`,
        the states dequantised into its dtype (a batch mixing FP8 and other shards).
        """
        j = self._index[i]
        first, rows = self._rows(j)
        h = _digest()
        dequantized = self.quantized and not set(SCALES.values()) <= set(out)
        held: dict[str, torch.Tensor] = {}
        for name in self.tensor_names:
            if dequantized and (name in SCALES or name in SCALES.values()):
                held[name] = self._tensor(name, first, rows, h)  # dequantised below, after the digest
                continue
            dest = out[name]
            n = dest.shape[0]
            if dest.dtype != DTYPES[_dtype_name(self.header[name]["dtype"])][0] or n > rows:
                raise ValueError(
                    f"{self.path}: cannot copy {name} ({rows} rows) into {dest.dtype} x {n} rows"
                )
            with self._raw(name, first, rows) as raw:
                h.update(raw)
                row_bytes = len(raw) // rows
                dest.view(torch.uint8).numpy().reshape(n, row_bytes)[:] = np.frombuffer(
                    raw[: n * row_bytes], np.uint8
                ).reshape(n, row_bytes)
        if h.hexdigest() != self._digests[j]:
            raise self._checksum_error(j)
        for name, scales in SCALES.items() if dequantized else ():
            dest = out[name]
            dest.copy_(dequantize(held[name][: dest.shape[0]], held[scales][: dest.shape[0]], dest.dtype))

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample i's input_ids int32 [T] and loss_mask uint8 [T], without its hidden states.

        Not digest-checked: a sample's digest covers all four of its tensors, so it cannot be checked from
        two of them without reading the hidden states, which is what this method exists to avoid.
        """
        j = self._index[i]
        first, rows = self._rows(j)
        return self._tensor("input_ids", first, rows, None), self._tensor("loss_mask", first, rows, None)

    def all_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids int32 [T] and loss_mask uint8 [T] of the whole shard, failed samples' rows included.

        Failed samples' rows are zero (see `ShardWriter.mark_failed`), so masked counts over the whole
        tensors count only good samples; that is checked here from the header's `failed` field rather than
        assumed. Not digest-checked, for the reason given in `tokens`.
        """
        total = int(self._offsets[-1])
        input_ids = self._tensor("input_ids", 0, total, None)
        loss_mask = self._tensor("loss_mask", 0, total, None)
        failed = self.meta.failed
        for j, sample_id in enumerate(self._all_ids):
            if sample_id in failed and bool(loss_mask[self._offsets[j] : self._offsets[j + 1]].any()):
                raise ShardCorruptError(f"{self.path}: failed sample {sample_id[:12]} has loss-masked rows")
        return input_ids, loss_mask

    def __iter__(self) -> Iterator[ShardSample]:
        for i in range(len(self)):
            yield self.sample(i)

    def verify(self) -> list[str]:
        """Every problem found: samples failing their digest (failed samples' zero rows included: the
        vocabulary counts their tokens), and a whole-file checksum mismatch."""
        problems = [
            str(self._checksum_error(j))
            for j in range(len(self._all_ids))
            if self._sample_digest(j) != self._digests[j]
        ]
        h = _digest()
        h.update(self._offsets.tobytes())
        for d in self._digests:
            h.update(bytes.fromhex(d))
        if h.hexdigest() != self.meta.checksum:
            problems.append(f"{self.path}: whole-shard checksum mismatch")
        return problems

    def close(self) -> None:
        """Close the file and the mapping. A mapping a tensor still views (one kept alive by the traceback of
        an error being raised) cannot be closed: it is unmapped when its last view is collected, and the
        error being raised is not replaced by a BufferError."""
        with contextlib.suppress(BufferError):
            self._mm.close()
        self._file.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dtype_name(safetensors_dtype: str) -> str:
    for name, (_, st, _) in DTYPES.items():
        if st == safetensors_dtype:
            return name
    raise ShardCorruptError(f"unknown dtype {safetensors_dtype}")
