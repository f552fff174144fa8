"""Training data straight from the shards: memory-mapped, length-bucketed, prefetched in the background.

Nothing is deserialised up front (SpecForge #733): opening a shard reads its header, and a sample's rows are
read, digest-checked and padded into a batch by loader threads while the previous batch trains.

Batches are planned per epoch from the seed alone, so a resumed run replays exactly the batches it would
have seen. A batch is a list of rows, each a list of samples; rank r takes rows `[r::world]`. Two layouts:
- padded: one sample per row, right-padded to the batch's longest, never more than `batch_tokens` padded
  tokens in all (its sample count times its longest sample); a DDP run sees the same global batches as one
  process;
- packed: `world` rows of a fixed width (batch_tokens / world, down to a multiple of flex attention's
  block), each holding samples back to back (first-fit, longest first), so nearly every entry is a real
  token and every step has one shape; attention stays within each sample (draft/model.py `Packing`).
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from eagle3_core.conventions import FinalStateConvention
from eagle3_core.draft.model import FLEX_BLOCK, Packing
from eagle3_core.errors import Eagle3Error
from eagle3_core.store.fp8 import FP8, SCALE_DTYPE, dequantize
from eagle3_core.store.records import ShardHeader, conversation_id
from eagle3_core.store.shards import DTYPES, ShardReader
from eagle3_core.train.loss import drafted_entries
from eagle3_core.train.rollout_labels import OFFLINE, draft_steps


@dataclass(frozen=True)
class TrainedFrom:
    """What a run records of the states it trained on (its summary), each required."""

    target_fingerprint: str
    aux_layer_ids: list[int]
    aux_layer_convention: str
    final_state_convention: FinalStateConvention


@dataclass(frozen=True)
class TrainingFacts:
    """Header facts every shard of one training run must share: mixing them would train on two different
    targets, layer choices or conventions at once. None where a shard does not record the fact."""

    hidden_size: int
    num_aux: int
    aux_layer_ids: list[int] | None
    aux_layer_convention: str | None
    final_state_convention: FinalStateConvention | None
    tokenizer_fingerprint: str | None
    target_fingerprint: str | None

    @classmethod
    def of(cls, header: ShardHeader) -> TrainingFacts:
        return cls(
            hidden_size=header.hidden_size,
            num_aux=header.num_aux,
            aux_layer_ids=header.aux_layer_ids,
            aux_layer_convention=header.aux_layer_convention,
            final_state_convention=header.final_state_convention,
            tokenizer_fingerprint=header.tokenizer_fingerprint,
            target_fingerprint=header.target.fingerprint if header.target is not None else None,
        )

    def differences(self, other: TrainingFacts) -> dict[str, tuple[object, object]]:
        mine, theirs = asdict(self), asdict(other)
        return {k: (mine[k], theirs[k]) for k in mine if mine[k] != theirs[k]}

    def trained_from(self) -> TrainedFrom:
        """The facts a run summary records: refused (before anything trains) where the shards lack one."""
        if (
            self.target_fingerprint is None
            or self.aux_layer_ids is None
            or self.aux_layer_convention is None
            or self.final_state_convention is None
        ):
            raise Eagle3Error(
                f"the shards record no target fingerprint, aux layers or final-state convention ({self}); "
                "extract them again"
            )
        return TrainedFrom(
            self.target_fingerprint,
            self.aux_layer_ids,
            self.aux_layer_convention,
            self.final_state_convention,
        )


@dataclass(frozen=True)
class SampleRef:
    shard: int  # index into TrainingData.readers
    index: int  # sample index within the shard
    length: int  # stored tokens (before the max_len cut)
    sample_id: str


def is_validation(sample_id: str, fraction: float) -> bool:
    """A fixed split by the sample's conversation id (its own id unless it is a further reply to one,
    regenerate.samples: store/records.py `reply_id`), so that every reply to one prompt falls on one side:
    validation never measures replies to a prompt the drafter trained on. Salted so that it is independent of
    the held-out split's own hash."""
    digest = hashlib.sha256(f"eagle3-validation:{conversation_id(sample_id)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


class TrainingData:
    """The samples of a set of shards, opened memory-mapped; their shared header facts checked."""

    def __init__(self, shard_paths: Sequence[Path]) -> None:
        if not shard_paths:
            raise Eagle3Error("no hidden-state shards to train on (materialize hidden_states first)")
        self.readers = [ShardReader(p) for p in sorted(shard_paths)]
        self.facts = self._shared_facts()
        self.refs = [
            SampleRef(s, i, length, sample_id)
            for s, reader in enumerate(self.readers)
            for i, (length, sample_id) in enumerate(zip(reader.lengths, reader.sample_ids, strict=True))
        ]
        if not self.refs:
            raise Eagle3Error("the hidden-state shards hold no samples")

    def _shared_facts(self) -> TrainingFacts:
        first = self.readers[0]
        facts = TrainingFacts.of(first.meta)
        for reader in self.readers[1:]:
            diff = facts.differences(TrainingFacts.of(reader.meta))
            if diff:
                raise Eagle3Error(
                    f"{reader.path.name} differs from {first.path.name} in {sorted(diff)}: {diff}; "
                    "a drafter trains on states from one target, layer set and convention"
                )
        return facts

    def split(self, val_fraction: float, max_val: int) -> tuple[list[SampleRef], list[SampleRef]]:
        """(train, validation) by conversation id (`is_validation`); validation capped at `max_val` samples,
        whole conversations: the first ones whose samples fit (the rest train, every reply of each)."""
        candidates: dict[str, list[SampleRef]] = {}
        for r in self.refs:
            if is_validation(r.sample_id, val_fraction):
                candidates.setdefault(conversation_id(r.sample_id), []).append(r)
        val: list[SampleRef] = []
        chosen: set[str] = set()
        for conversation, refs in candidates.items():
            if len(val) + len(refs) > max_val:
                break
            val += refs
            chosen.add(conversation)
        train = [r for r in self.refs if conversation_id(r.sample_id) not in chosen]
        if not train:
            raise Eagle3Error(f"train.val_fraction={val_fraction} leaves no training samples")
        return train, val

    def load_batch(
        self, refs: Sequence[SampleRef], max_len: int, pin: bool = False, pool: Executor | None = None
    ) -> Batch:
        """The samples cut to max_len, right-padded into one batch of a sample per row."""
        return self.load_rows([[r] for r in refs], max_len, None, pin, pool)

    def load_rows(
        self,
        rows: Sequence[Sequence[SampleRef]],
        max_len: int,
        width: int | None,
        pin: bool = False,
        pool: Executor | None = None,
        ttt_steps: int | None = None,
    ) -> Batch:
        """Rows of samples cut to max_len, each row's samples back to back and zero-padded to `width` (a
        packed batch), or to the longest row with `width` None (a sample per row: a padded batch); rows
        copied once, from the mapped shards, sample by sample on `pool`'s threads when one is given. A packed
        batch for `ttt_steps` steps names the entries the drafter drafts from (`Packing.drafted`)."""
        lengths = [[min(r.length, max_len) for r in row] for row in rows]
        b = len(rows)
        t = width if width is not None else max(sum(row) for row in lengths)
        first = next((r for row in rows for r in row), None)  # a rank's share of a last batch may be empty
        facts = self.readers[first.shard if first is not None else 0]
        aux_width = int(facts.header["aux_hidden_states"]["shape"][1])
        hidden = int(facts.header["last_hidden_states"]["shape"][1])
        dtype = batch_dtype([self.readers[r.shard] for row in rows for r in row] or [facts])
        input_ids = torch.zeros(b, t, dtype=torch.int32, pin_memory=pin)
        loss_mask = torch.zeros(b, t, dtype=torch.uint8, pin_memory=pin)
        aux = torch.empty(b, t, aux_width, dtype=dtype, pin_memory=pin)
        last = torch.empty(b, t, hidden, dtype=dtype, pin_memory=pin)
        scales = None  # FP8 states travel with their scales and are dequantised on the device (Batch.to)
        if dtype == FP8:
            num_aux = int(facts.header["aux_scales"]["shape"][1])
            scales = (
                torch.zeros(b, t, num_aux, dtype=SCALE_DTYPE, pin_memory=pin),
                torch.zeros(b, t, 1, dtype=SCALE_DTYPE, pin_memory=pin),
            )
        packing = None
        if width is not None:  # where each sample lies; a padded batch's rows need no such map
            packing = Packing(torch.empty(b, t, dtype=torch.int32), torch.empty(b, t, dtype=torch.int64))
        places = []  # (row, offset, ref, length) of every sample
        for i, (row, row_lengths) in enumerate(zip(rows, lengths, strict=True)):
            offset = 0
            for j, (ref, n) in enumerate(zip(row, row_lengths, strict=True)):
                places.append((i, offset, ref, n))
                if packing is not None:
                    packing.doc[i, offset : offset + n] = j
                    packing.positions[i, offset : offset + n] = torch.arange(n)
                offset += n
            if offset > t:
                raise ValueError(f"a row of {offset} tokens does not fit a packed width of {t}")
            if packing is not None:
                packing.doc[i, offset:] = len(row)  # the padding after a row's samples counts as one more
                packing.positions[i, offset:] = torch.arange(t - offset)
            aux[i, offset:].view(torch.uint8).zero_()  # bytes: FP8 has no fill, and 0 is zero in every dtype
            last[i, offset:].view(torch.uint8).zero_()

        def fill(place: tuple[int, int, SampleRef, int]) -> None:
            i, offset, ref, n = place
            rows_of = {
                "input_ids": input_ids[i, offset : offset + n],
                "loss_mask": loss_mask[i, offset : offset + n],
                "aux_hidden_states": aux[i, offset : offset + n],
                "last_hidden_states": last[i, offset : offset + n],
            }
            if scales is not None:
                rows_of["aux_scales"] = scales[0][i, offset : offset + n]
                rows_of["last_scales"] = scales[1][i, offset : offset + n]
            self.readers[ref.shard].copy_sample_into(ref.index, rows_of)

        list(pool.map(fill, places) if pool is not None else map(fill, places))  # list(): raise any error
        draft_steps = self._draft_steps(places, b, t)
        if packing is not None and ttt_steps is not None:
            drafted = drafted_entries(loss_mask, packing.doc, ttt_steps, FLEX_BLOCK)
            if drafted is not None:
                packing = Packing(packing.doc, packing.positions, drafted.pin_memory() if pin else drafted)
        return Batch(
            input_ids.long(),
            loss_mask,
            aux,
            last,
            tokens=sum(map(sum, lengths)),
            packing=packing,
            scales=scales,
            draft_steps=draft_steps,
        )

    def _draft_steps(
        self, places: list[tuple[int, int, SampleRef, int]], b: int, t: int
    ) -> torch.Tensor | None:
        """int8 [B, T]: each token's rollout label (train/rollout_labels.py `draft_steps`), OFFLINE for the tokens
        of offline samples and padding; None when no sample of the batch is an on-policy record."""
        records = [(place, self.readers[place[2].shard].meta.rollout) for place in places]
        if all(rollout is None for _, rollout in records):
            return None
        labels = torch.full((b, t), OFFLINE, dtype=torch.int8)
        for (i, offset, ref, n), rollout in records:
            if rollout is not None:
                j = self.readers[ref.shard].stored_index(ref.index)
                labels[i, offset : offset + n] = draft_steps(
                    rollout.prompt_lengths[j], rollout.verified[j], n, rollout.k
                )
        return labels

    def close(self) -> None:
        """Close every shard; safe on the error path (ShardReader.close leaves a mapping still viewed)."""
        readers, self.readers = self.readers, []
        for reader in readers:
            reader.close()


def plan_epoch(
    refs: Sequence[SampleRef], batch_tokens: int, max_len: int, seed: int, epoch: int, min_batch: int = 1
) -> list[list[int]]:
    """Length-bucketed batches of indices into `refs`, in a shuffled order fixed by (seed, epoch).

    Samples are shuffled, grouped into chunks, sorted by length within a chunk (so a batch pads little) and
    cut into batches of at most `batch_tokens` padded tokens; the samples left at a chunk's end join the
    next chunk. Every batch holds at least `min_batch` samples (every rank needs one), which needs
    `min_batch` times the longest sample (cut to max_len) to fit in `batch_tokens`. The budget then gives
    that minimum to every batch but the epoch's last (a batch is only cut once it holds `min_batch`); a
    last batch short of it takes the longest samples of the one before, moved while that one keeps
    `min_batch` and repeated beyond that. No sample is dropped; fewer than `min_batch` are repeated.
    """
    if not refs:
        return []
    cut = [min(r.length, max_len) for r in refs]
    if len(refs) < min_batch or min_batch * max(cut) > batch_tokens:
        raise ValueError(
            f"cannot plan batches of >= {min_batch} samples from {len(refs)} samples of up to {max(cut)} "
            f"tokens within {batch_tokens} tokens"
        )
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(refs), generator=g).tolist()
    chunk = 1024
    batches: list[list[int]] = []
    current: list[int] = []
    for start in range(0, len(order), chunk):
        part = sorted(current + order[start : start + chunk], key=lambda i: cut[i])
        current = []
        for i in part:  # ascending, so the newcomer is the longest
            if current and cut[i] * (len(current) + 1) > batch_tokens:
                batches.append(current)
                current = []
            current.append(i)
    if len(current) < min_batch:
        current = _fill_last(batches[-1], current, min_batch)
    batches.append(current)
    shuffled = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in shuffled]


def _fill_last(previous: list[int], last: list[int], min_batch: int) -> list[int]:
    """`last` brought up to `min_batch` samples from the longest of `previous` (which holds at least that
    many): moved while `previous` keeps `min_batch`, repeated after that. Any `min_batch` samples fit the
    budget, so neither batch exceeds it."""
    need = min_batch - len(last)
    moved = min(need, len(previous) - min_batch)
    taken = previous[len(previous) - moved :]
    del previous[len(previous) - moved :]
    repeated = previous[len(previous) - (need - moved) :] if need > moved else []
    return repeated + taken + last


Rows = list[list[int]]  # a planned batch: its rows, each the indices (into the refs) of the samples it holds


def pack_rows(order: Sequence[int], cut: Sequence[int], width: int) -> Rows:
    """`order`'s samples packed into rows of at most `width` tokens: first fit, longest first (the order
    breaks ties, so a plan is fixed by it)."""
    rows: Rows = []
    free: list[int] = []
    for i in sorted(order, key=lambda i: -cut[i]):
        for r, room in enumerate(free):
            if cut[i] <= room:
                rows[r].append(i)
                free[r] -= cut[i]
                break
        else:
            rows.append([i])
            free.append(width - cut[i])
    return rows


def plan_packed_epoch(
    refs: Sequence[SampleRef], width: int, rows_per_batch: int, max_len: int, seed: int, epoch: int
) -> list[Rows]:
    """Packed batches of `rows_per_batch` rows of `width` tokens, in an order fixed by (seed, epoch).

    Samples are shuffled, packed a chunk at a time (so a row mixes samples from across the data), the rows
    shuffled and dealt into batches. The epoch's last batch may be short of rows: it gets empty ones (a rank
    with an empty row counts nothing that step). No sample is dropped or repeated.
    """
    if not refs:
        return []
    cut = [min(r.length, max_len) for r in refs]
    if max(cut) > width:
        raise ValueError(f"cannot pack samples of up to {max(cut)} tokens into rows of {width}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(refs), generator=g).tolist()
    chunk = 1024
    rows = [
        row
        for start in range(0, len(order), chunk)
        for row in pack_rows(order[start : start + chunk], cut, width)
    ]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    batches = [rows[start : start + rows_per_batch] for start in range(0, len(rows), rows_per_batch)]
    batches[-1] += [[] for _ in range(rows_per_batch - len(batches[-1]))]
    return batches


def plan_packed_validation(refs: Sequence[SampleRef], width: int, max_len: int) -> list[Rows]:
    """Validation batches of one packed row each, in a fixed order (the same batches every time)."""
    cut = [min(r.length, max_len) for r in refs]
    order = sorted(range(len(refs)), key=lambda i: (cut[i], refs[i].sample_id))
    return [[row] for row in pack_rows(order, cut, width)]


def plan_validation(refs: Sequence[SampleRef], batch_tokens: int, max_len: int) -> list[list[int]]:
    """Validation batches: sorted by length, no shuffling (the same batches every time)."""
    order = sorted(range(len(refs)), key=lambda i: (min(refs[i].length, max_len), refs[i].sample_id))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and min(refs[i].length, max_len) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return [*batches, current] if current else batches


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # int64 [B, T], right-padded with 0
    loss_mask: torch.Tensor  # uint8 [B, T], 0 on padding
    aux: torch.Tensor  # [B, T, 3H] in the store dtype
    last: torch.Tensor  # [B, T, H] in the store dtype
    tokens: int  # real (unpadded) tokens
    packing: Packing | None = None  # where each row's samples lie; None: one sample per row
    # FP8 states' scales, aux [B, T, num_aux] and last [B, T, 1] float32; None for states in a float dtype
    scales: tuple[torch.Tensor, torch.Tensor] | None = None
    # int8 [B, T]: on-policy records' rollout labels (`TrainingData._draft_steps`); None: no record in the batch
    draft_steps: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        """The batch on `device`, FP8 states dequantised there to bfloat16 (they cross the bus at one byte)."""
        nb = device.type == "cuda"
        packing = self.packing.to(device, non_blocking=nb) if self.packing is not None else None
        aux, last = self.aux.to(device, non_blocking=nb), self.last.to(device, non_blocking=nb)
        if self.scales is not None:
            aux_scales, last_scales = (x.to(device, non_blocking=nb) for x in self.scales)
            aux, last = _dequantized(aux, aux_scales), _dequantized(last, last_scales)
        return Batch(
            self.input_ids.to(device, non_blocking=nb),
            self.loss_mask.to(device, non_blocking=nb),
            aux,
            last,
            self.tokens,
            packing,
            draft_steps=None if self.draft_steps is None else self.draft_steps.to(device, non_blocking=nb),
        )


def _dequantized(states: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP8 states [B, T, W] with their scales [B, T, G] as bfloat16 [B, T, W]."""
    b, t, w = states.shape
    return dequantize(states.view(b * t, w), scales.view(b * t, -1)).view(b, t, w)


def batch_dtype(readers: Sequence[ShardReader]) -> torch.dtype:
    """The states' dtype in a batch of these shards' samples: FP8 when every one is FP8 (copied as stored),
    else the first other shard's dtype (FP8 samples dequantised into it on the host)."""
    plain = [r for r in readers if not r.quantized]
    return DTYPES[plain[0].meta.store_dtype][0] if plain else FP8


class Prefetcher:
    """Loads and collates batches (lists of rows) on background threads, `depth` ahead, yielding them in
    order; `width`: the packed row width, None for padded batches; `ttt_steps`: the steps a packed batch's
    drafted entries are found for (None: every entry is drafted from)."""

    def __init__(
        self,
        data: TrainingData,
        refs: Sequence[SampleRef],
        max_len: int,
        *,
        threads: int | None,
        depth: int,
        pin: bool = False,
        width: int | None = None,
        ttt_steps: int | None = None,
    ) -> None:
        self.data, self.refs, self.max_len, self.pin, self.width = data, refs, max_len, pin, width
        self.ttt_steps = ttt_steps
        self.depth = depth
        # Hashing and copying release the GIL, so sample copies scale with cores (on a GPU host a token is
        # ~16 KB); `depth` batches are assembled at once, each fanning its samples out to the copy threads.
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="eagle3-batch")
        self.copiers = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="eagle3-copy")

    def _load(self, rows: Rows) -> Batch:
        refs = [[self.refs[i] for i in row] for row in rows]
        return self.data.load_rows(refs, self.max_len, self.width, self.pin, self.copiers, self.ttt_steps)

    def __call__(self, batches: Sequence[Rows]) -> Iterator[Batch]:
        pending: deque[Future[Batch]] = deque()
        todo = iter(batches)
        for indices in todo:
            pending.append(self.pool.submit(self._load, indices))
            if len(pending) >= self.depth:
                break
        while pending:
            batch = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(self.pool.submit(self._load, nxt))
            yield batch

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.copiers.shutdown(wait=True, cancel_futures=True)
