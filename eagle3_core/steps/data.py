"""The data domain's steps, one shard each: conversations, regenerated, hidden_states.

Each step reads its input from the store, writes its output atomically, and returns a `StepResult` whose
flat `metadata` is what the CLI prints and what Dagster shows on the partition's page.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from eagle3_core.config import Eagle3Config, without_url_passwords
from eagle3_core.conventions import AUX_LAYER_CONVENTION
from eagle3_core.data.conversation import Conversation
from eagle3_core.data.ingest import load_conversation_shard
from eagle3_core.data.tokenize import ChatTokenizer, TemplateError, TokenizedSample
from eagle3_core.engines.openai_client import regenerate_through_server
from eagle3_core.steps.common import Log, StepResult, quiet
from eagle3_core.store.convert import convert_key
from eagle3_core.store.fp8 import SOURCE_DTYPE
from eagle3_core.store.journal import RegenerationJournal, journal_fingerprint, journal_path, remove_journal
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.locks import writer_lock
from eagle3_core.store.records import (
    ConversationRow,
    RegeneratedManifest,
    RegeneratedRow,
    ShardFacts,
    ShardManifest,
    read_rows,
    regeneration_row,
    reply_id,
    write_rows,
)
from eagle3_core.store.shards import DTYPES, QUANTIZED, ShardWriter
from eagle3_core.targets.base import ExtractionTarget, HiddenStates, SampleFailure
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.targets.regenerate import RegenerationProgress, RegenerationResult, Regenerator


# ---- conversations -----------------------------------------------------------------------------------------
def conversations_step(cfg: Eagle3Config, key: str) -> StepResult:
    """A conversation shard is written by ingest; this checks it against its manifest and reports it.
    `truncated`: the samples kept in part, cut before an empty turn (rows kept, not rejected; their rows are
    in the rejects file too, as `empty_content_truncated`)."""
    layout = StoreLayout(cfg.store_root)
    _, manifest = load_conversation_shard(cfg.store_root, key)
    rejected = manifest.rejected
    return StepResult(
        key,
        layout.conversations(key),
        {
            "samples": manifest.samples,
            "train_samples": manifest.train_samples,
            "heldout_samples": manifest.heldout_samples,
            "assistant_turns": manifest.assistant_turns,
            "rejected": sum(rejected.values()),
            **{f"rejected_{reason}": n for reason, n in sorted(rejected.items())},
            "truncated": sum(manifest.truncated.values()),
            "source": manifest.source,
            "source_lines": "-".join(map(str, manifest.lines)),
            "rejects_file": str(layout.rejects(key)),
        },
    )


# ---- regenerated -------------------------------------------------------------------------------------------
def regenerate_step(
    cfg: Eagle3Config, key: str, target: TransformersTarget | None, log: Log = quiet
) -> StepResult:
    """The shard's training conversations with every assistant turn the target's: in process with `target`,
    or through `cfg.regenerate.server` (then `target` is not used and may be None); `regenerate.samples`
    rows per conversation, by conversation then reply (store/records.py `reply_id`).

    Under the shard's writer lock: a second regeneration of it is refused (StoreBusyError), not raced.
    """
    layout = StoreLayout(cfg.store_root)
    with writer_lock(layout.writer_lock("regenerated", key), f"regenerated shard {key}"):
        return _regenerate(cfg, key, target, log)


def _regenerate(cfg: Eagle3Config, key: str, target: TransformersTarget | None, log: Log) -> StepResult:
    layout = StoreLayout(cfg.store_root)
    samples, _ = load_conversation_shard(cfg.store_root, key)
    train = [s for s in samples if s.split == "train"]
    started = time.perf_counter()

    def progress(p: RegenerationProgress) -> None:
        log(f"{key}: {p.line()}")

    result: RegenerationResult
    if cfg.regenerate.server is not None:
        result = regenerate_through_server(cfg, layout.regenerated(key), train, progress, log)
        source: dict[str, Any] = {
            "server": without_url_passwords(cfg.regenerate.server.url),
            "resumed_samples": result.resumed,
            "requested_samples": result.requested,
            "request_retries": result.retries,
        }
    else:
        if target is None:
            raise ValueError(
                f"{key}: in-process regeneration needs the target (regenerate.server is not set)"
            )
        result = _regenerate_in_process(cfg, key, target, train, progress, log)
        source = {
            "target": target.info.fingerprint[:16],
            "resumed_samples": result.resumed,
            "step": result.step,
        }
    fresh_tokens = result.fresh_tokens
    seconds = time.perf_counter() - started
    replies = cfg.regenerate.samples
    if [r.id for r in result.rows] != [reply_id(s.id, r) for s in train for r in range(replies)]:
        raise RuntimeError(f"{key}: regeneration returned other sample ids than it was given")
    metadata = {
        "samples": len(result.rows) - result.counts["errors"],
        "errors": result.counts["errors"],
        "heldout_skipped": len(samples) - len(train),
        "replies": result.counts["replies"],
        # kept, marked "length" in the rows' finish_reasons; extraction leaves their end-of-turn untrained
        "replies_cut_at_max_new_tokens": result.counts["replies_cut_at_max_new_tokens"],
        "new_tokens": result.new_tokens,
        "tokens_per_second": round(fresh_tokens / max(seconds, 1e-9), 1),
        "seconds": round(seconds, 2),
        **{
            k: v
            for k, v in sorted(result.counts.items())
            if k not in {"errors", "replies", "replies_cut_at_max_new_tokens"}
        },
        **source,
        "temperature": cfg.regenerate.temperature,
        "max_new_tokens": cfg.regenerate.max_new_tokens,
        "replies_per_conversation": replies,
    }
    # The manifest before the shard, the shard's rename last: a regenerated shard is whole with its manifest
    # or absent (what a redo replaces is gone first, so a crash between the two never pairs old and new).
    layout.regenerated(key).unlink(missing_ok=True)
    RegeneratedManifest.model_validate({"key": key, **metadata}).write(layout.regenerated_manifest(key))
    write_rows(layout.regenerated(key), result.rows)
    # The shard is committed: its journal (this run's, or an earlier one's) has nothing left to give.
    remove_journal(layout.regenerated(key))
    return StepResult(key, layout.regenerated(key), metadata)


def _regenerate_in_process(
    cfg: Eagle3Config,
    key: str,
    target: TransformersTarget,
    train: list[ConversationRow],
    progress: Callable[[RegenerationProgress], None],
    log: Log,
) -> RegenerationResult:
    """The shard's training conversations regenerated by `target`, journaled beside the shard as they finish
    (the server path's journal), so that a killed run's finished samples are taken up by the next one."""
    shard = StoreLayout(cfg.store_root).regenerated(key)
    info = target.info
    fingerprint = journal_fingerprint(
        cfg.regenerate,
        cfg.tokenize.max_seq_len,
        target.tokenizer_fingerprint,
        [s.id for s in train],
        model=f"in process: {info.fingerprint} {info.dtype}",
    )
    regenerator = Regenerator(target.model, target.tokenizer, cfg.regenerate, cfg.tokenize.max_seq_len)
    return regenerator.regenerate(train, RegenerationJournal(journal_path(shard), fingerprint), progress, log)


# ---- hidden_states -----------------------------------------------------------------------------------------
def _extraction_input(
    cfg: Eagle3Config, key: str, counts: Counter[str]
) -> Sequence[ConversationRow | RegeneratedRow]:
    """The conversations to extract: regenerated ones when regeneration is on, else the training split."""
    layout = StoreLayout(cfg.store_root)
    if not cfg.regenerate.enabled:
        samples, _ = load_conversation_shard(cfg.store_root, key)
        counts["heldout_skipped"] = sum(1 for s in samples if s.split != "train")
        return [s for s in samples if s.split == "train"]
    path = layout.regenerated(key)
    if not path.exists():
        raise FileNotFoundError(f"{key}: no regenerated shard at {path}; materialize `regenerated` first")
    rows = read_rows(path, regeneration_row)
    regenerated = [r for r in rows if isinstance(r, RegeneratedRow)]
    counts["regeneration_errors"] = len(rows) - len(regenerated)
    counts["cut_replies"] = 0  # counted as they are tokenised (untrained_endings)
    return regenerated


def _tokenize_all(
    chat: ChatTokenizer,
    rows: Sequence[ConversationRow | RegeneratedRow],
    counts: Counter[str],
    dropped: dict[str, str],
) -> list[TokenizedSample]:
    out = []
    end_of_turn = chat.tokenizer(chat.end_of_turn, add_special_tokens=False)["input_ids"]
    for row in rows:
        conv = Conversation(tuple((m.role, m.content) for m in row.messages))
        try:
            sample = replace(chat.tokenize(conv), sample_id=row.id)
            if isinstance(row, RegeneratedRow) and row.cut_turns:
                sample = untrained_endings(sample, row.cut_turns, end_of_turn)
                counts["cut_replies"] += len(row.cut_turns)
        except TemplateError as err:
            dropped[row.id] = f"template: {err}"
            continue
        if sample.truncated:
            counts["truncated_samples"] += 1
            counts["truncated_tokens"] += sample.truncated_tokens
            counts["truncated_loss_tokens"] += sample.truncated_loss_tokens
        if sample.loss_tokens == 0:
            dropped[row.id] = "no loss tokens (after truncation)"
            continue
        out.append(sample)
    return out


def _drop_kind(reason: str) -> str:
    """A dropped sample's reason without what names the sample, so that one cause counts once."""
    return re.sub(r"^template: [0-9a-f]{1,12}: assistant turn \d+: ", "template: ", reason)


def untrained_endings(sample: TokenizedSample, turns: list[int], end_of_turn: list[int]) -> TokenizedSample:
    """`sample` with the closing end-of-turn of each assistant turn in `turns` (0-based among its assistant
    turns) out of the loss: those replies were cut at max_new_tokens, so the target never ended them there,
    and a drafter trained on that ending would learn to end replies where the target goes on.

    Each assistant turn's loss span (content through its end-of-turn) is one run of 1s in the mask, the runs
    in turn order, apart from each other by the user turns between them; a turn truncation cut off has no
    end-of-turn left to take out.
    """
    mask = sample.loss_mask.copy()
    ends = _run_ends(mask)
    for turn in turns:
        if turn >= len(ends):
            continue  # truncation cut this turn off, with its end-of-turn
        end = ends[turn]
        if [int(t) for t in sample.input_ids[end - len(end_of_turn) : end]] == end_of_turn:
            mask[end - len(end_of_turn) : end] = 0
        elif not (sample.truncated and end == sample.length):
            raise TemplateError(
                f"{sample.sample_id[:12]}: assistant turn {turn} was cut at max_new_tokens, but its loss span "
                f"does not end on the end-of-turn tokens {end_of_turn}"
            )
    return replace(sample, loss_mask=mask)


def _run_ends(mask: npt.NDArray[np.uint8]) -> list[int]:
    """Where each run of 1s in `mask` ends (the index after its last 1), in order."""
    steps = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    return [int(i) for i in np.flatnonzero(steps == -1)]


def length_batches(lengths: list[int], max_tokens: int, max_size: int) -> Iterator[list[int]]:
    """Indices grouped longest first so a batch pads little: padded tokens <= max_tokens (or one sample)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batch: list[int] = []
    for i in order:
        width = lengths[batch[0]] if batch else lengths[i]
        if batch and ((len(batch) + 1) * width > max_tokens or len(batch) == max_size):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def _row_tensors(sample: TokenizedSample) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.from_numpy(sample.input_ids.copy()), torch.from_numpy(sample.loss_mask.copy())


class WriteBehind:
    """Digests and writes a batch's rows on worker threads while the target computes the next batch.

    hashlib and pwrite release the GIL, so hashing and disk writes overlap the forward pass. At most
    `depth` batches are in flight, which keeps memory bounded by a few batches, never by the shard.
    """

    def __init__(self, writer: ShardWriter, threads: int = 4, depth: int = 2) -> None:
        self.writer = writer
        self.depth = depth
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shard-writer")
        self.in_flight: deque[list[Future[None]]] = deque()

    def submit(
        self, rows: list[tuple[int, torch.Tensor, torch.Tensor, HiddenStates | SampleFailure]]
    ) -> None:
        """Rows of one batch: (sample index, input_ids [T], loss_mask [T], its states or failure)."""
        futures = [self.pool.submit(self._write, *row) for row in rows]
        self.in_flight.append(futures)
        while len(self.in_flight) > self.depth:
            for f in self.in_flight.popleft():
                f.result()

    def _write(
        self, i: int, ids: torch.Tensor, mask: torch.Tensor, states: HiddenStates | SampleFailure
    ) -> None:
        if isinstance(states, SampleFailure):
            self.writer.mark_failed(i, states.reason)
        else:
            self.writer.write_sample(
                i,
                ids,
                mask,
                states.aux,
                states.last,
                aux_scales=states.aux_scales,
                last_scales=states.last_scales,
            )

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            return
        try:
            while self.in_flight:  # surface the first worker error, after every write has finished
                for f in self.in_flight.popleft():
                    f.result()
        finally:
            self.pool.shutdown(wait=True)


def handover_dtype(store_dtype: str, target: ExtractionTarget) -> torch.dtype:
    """The dtype to ask `target` for its states in: the store's. For an FP8 store, FP8 quantised on the
    target's device where it can (half the bytes to the host, and no quantising on the writer's CPU threads,
    which fall behind the disk at a large hidden size), else bfloat16 for the writer to quantise: the same
    bytes either way."""
    if store_dtype in QUANTIZED and not target.quantizes_on_device:
        return SOURCE_DTYPE
    return DTYPES[store_dtype][0]


def extract_step(cfg: Eagle3Config, key: str, target: ExtractionTarget, log: Log = quiet) -> StepResult:
    """Hidden states of the shard's conversations into its safetensors shard and manifest.

    Under the shard's writer lock: a second extraction of it is refused (StoreBusyError) before it touches
    anything, so it never removes the first one's temporary file.
    """
    layout = StoreLayout(cfg.store_root)
    with writer_lock(layout.writer_lock("hidden_states", key), f"hidden-state shard {key}"):
        return _extract(cfg, key, target, log)


def _extract(cfg: Eagle3Config, key: str, target: ExtractionTarget, log: Log) -> StepResult:
    layout = StoreLayout(cfg.store_root)
    counts: Counter[str] = Counter(
        dict.fromkeys(("truncated_samples", "truncated_tokens", "truncated_loss_tokens"), 0)
    )
    dropped: dict[str, str] = {}
    rows = _extraction_input(cfg, key, counts)
    chat = ChatTokenizer.from_config(target.tokenizer, cfg.tokenize)
    samples = _tokenize_all(chat, rows, counts, dropped)
    if rows and not samples:  # a setting, not the data: say so before writing a shard with nothing to train
        kinds = Counter(_drop_kind(reason) for reason in dropped.values())
        (kind, count), others = kinds.most_common(1)[0], len(dropped) - kinds.most_common(1)[0][1]
        raise TemplateError(
            f"{key}: none of its {len(rows)} conversations can be trained on; {count} dropped for: {kind}"
            + (f" ({others} for other reasons)" if others else "")
        )
    info = target.info
    facts = ShardFacts(
        conversation_shard=key,
        regenerated=cfg.regenerate.enabled,
        target=info.facts(),
        tokenizer_fingerprint=target.tokenizer_fingerprint,
        aux_layer_ids=list(info.aux_layer_ids),
        aux_layer_convention=AUX_LAYER_CONVENTION,
        final_state_convention=info.final_state_convention,
        max_seq_len=cfg.tokenize.max_seq_len,
        dropped=dropped,
    )
    store_dtype = handover_dtype(cfg.extract.store_dtype, target)
    started = time.perf_counter()
    with ShardWriter(
        layout.hidden_states(key),
        sample_ids=[s.sample_id for s in samples],
        lengths=[s.length for s in samples],
        hidden_size=info.hidden_size,
        store_dtype=cfg.extract.store_dtype,
        facts=facts,
        disk_headroom=cfg.extract.disk_headroom,
    ) as writer:
        done = 0
        with WriteBehind(writer) as behind:
            for batch in length_batches(
                [s.length for s in samples], cfg.extract.max_batch_tokens, cfg.extract.max_batch_size
            ):
                states = target.hidden_states([samples[i].input_ids.tolist() for i in batch], store_dtype)
                behind.submit(
                    [(i, *_row_tensors(samples[i]), st) for i, st in zip(batch, states, strict=True)]
                )
                done += len(batch)
                log(f"{key}: {done}/{len(samples)} samples extracted")
        seconds = time.perf_counter() - started
        manifest = writer.finalize({**counts, "dropped": len(dropped)})
    return StepResult(
        key,
        layout.hidden_states(key),
        {
            **shard_figures(manifest),
            "tokens_per_second": round(manifest.counts.tokens / max(seconds, 1e-9), 1),
            "seconds": round(seconds, 2),
        },
    )


def shard_figures(manifest: ShardManifest) -> dict[str, Any]:
    """A finished shard's figures as its manifest records them: what extraction reports, timings aside."""
    counts = manifest.counts
    return {
        **counts.dump(),
        "errors": counts.errors,
        "bytes": manifest.bytes,
        "aux_layer_ids": json.dumps(manifest.aux_layer_ids),
        "final_state_convention": manifest.final_state_convention,
    }


def convert_step(cfg: Eagle3Config, key: str, store_dtype: str, log: Log = quiet) -> StepResult:
    """The shard's hidden states re-encoded in `store_dtype` without extracting again (`eagle3 convert-shards`
    for one shard, store/convert.py): under its writer lock, the new file renamed over the old one only when
    whole. A shard already in `store_dtype` is left as it is (`converted` false). Its figures are its
    manifest's, with the dtype and bytes before and after, and the seconds taken."""
    started = time.perf_counter()
    done = convert_key(cfg.store_root, key, store_dtype, cfg.extract.disk_headroom, log)
    seconds = time.perf_counter() - started
    layout = StoreLayout(cfg.store_root)
    manifest = ShardManifest.read(layout.hidden_states_manifest(key))
    return StepResult(
        key,
        layout.hidden_states(key),
        {
            **shard_figures(manifest),
            "store_dtype": manifest.store_dtype,
            "converted": done is not None,
            "converted_from": manifest.store_dtype if done is None else done.before,
            "bytes_before": manifest.bytes if done is None else done.bytes_before,
            "bytes_after": manifest.bytes,
            "newly_failed": 0 if done is None else done.newly_failed,
            "seconds": round(seconds, 2),
        },
    )
