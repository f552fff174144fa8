"""A run's directory: its identity, its metric log, its final drafter, and the weights in its files.

    runs/<run id>/metrics.jsonl          one JSON record per logged interval and validation
    runs/<run id>/checkpoints/step-*/    train/checkpoint.py
    runs/<run id>/final/                 drafter.safetensors, drafter_config.json, vocab_mapping/, summary.json
    runs/<run id>/.train.lock            held by the run's trainer (`run_lock`)

The run id hashes what the run computes from (data, mapping, target, settings, starting weights), so running
again with the same inputs finds the same directory and resumes it, or returns it once `final/` exists. One
trainer at a time per run directory: a second would append the same steps to the metric log again and race
the first to its checkpoints and final/.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3_core.config import RecordLoss, TrainConfig
from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.draft.vocab import VocabMapping, load_vocab_mapping, save_vocab_mapping
from eagle3_core.errors import Eagle3Error
from eagle3_core.store.atomic import atomic_directory, atomic_write_json
from eagle3_core.store.locks import writer_lock
from eagle3_core.store.records import MetricsRow, RunSummary, metrics_row
from eagle3_core.train.checkpoint import full_disk_stops_the_run
from eagle3_core.train.distributed import World, on_main

FINAL = "final"
SUMMARY = "summary.json"  # in final/: a run is finished once it exists


METRICS = "metrics.jsonl"
RUN_LOCK = ".train.lock"


# Settings that change how a run is watched, not what it computes: changing them keeps the run (and resumes it).
OPERATIONAL = {
    "log_every",
    "keep_checkpoints",
    "prefetch_batches",
    "loader_threads",
    "device",
    "processes",
    "nodes",
    "rendezvous",
    "max_restarts",
    "compile",
    "sharding",
    # read once, at the last step's choice: a run resumed with another value (or by an eagle3 from before the
    # setting) is the same run
    "al_confirm_prompts",
}


# the only metric fields a resumed run may not reproduce: its speed and its GPU peak (counted from the resume)
RUNTIME_FIELDS = ("tokens_per_s", "elapsed_s", "seconds", "peak_gpu_gib")


BATCH_PLAN = 2  # 2: batches keep to train.batch_tokens (1 held at least 8 samples whatever their length)


def run_id(
    train: TrainConfig,
    mapping: VocabMapping,
    target_fingerprint: str,
    drafter: DrafterConfig,
    warm_from: str | None = None,
    records: RecordLoss | None = None,
) -> str:
    """Same data, mapping, target, settings and starting weights -> same run directory, so running again
    resumes it."""
    # a padded plan is the same for any number of processes (and its ids predate packing); a packed one
    # gives each process a row, so there the process and node counts are part of what the run computes; where
    # the nodes meet (the rendezvous) and how often torchrun restarts never are
    padded = train.batching == "pad"
    identity = {
        "train": train.model_dump(
            exclude=OPERATIONAL | {"batching"} if padded else OPERATIONAL - {"processes", "nodes"}
        ),
        "mapping": mapping.fingerprint,
        "target": target_fingerprint,
        "drafter": drafter.model_dump(),
        # the batch planner's version: a run checkpointed under another plan cannot resume exactly
        "batch_plan": BATCH_PLAN,
        "warm_from": warm_from,
    }
    if records is not None:  # an on-policy refinement's; absent from every offline run's identity, as before
        identity["records"] = records.model_dump()
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


@contextmanager
def run_lock(world: World, run_dir: Path) -> Iterator[None]:
    """The run directory held by this trainer for the block: rank 0 holds its writer lock (the other ranks of
    its torchrun are the same trainer and take none, so none waits on it). A run another process holds is
    refused on every rank, rank 0's StoreBusyError naming the holder's PID."""
    with ExitStack() as held:
        what = f"training run {run_dir.name}"
        on_main(world, f"locking {what}", lambda: held.enter_context(writer_lock(run_dir / RUN_LOCK, what)))
        yield


class MetricsLog:
    """Append-only JSONL, written by rank 0; a checkpoint records its size, a resume cuts it back to that.

    A row is appended whole or not at all: a write the disk filled up under is cut back to where the row began
    and stops the run on every rank with the one-line DiskSpaceError a checkpoint gives, so the log holds only
    whole rows (`read_metrics` reads it at the end of the run), and the resumed run logs that row again."""

    def __init__(self, path: Path, world: World) -> None:
        self.path, self.world = path, world
        self.enabled = world.is_main

    def write(self, row: MetricsRow | None) -> None:
        """Every rank calls it (rank 0 writes; a row only rank 0 made is None on the others): an error on rank 0
        stops the others too (`on_main`)."""
        on_main(self.world, f"appending to {self.path}", lambda: None if row is None else self._append(row))

    def _append(self, row: MetricsRow) -> None:
        line = (json.dumps(row.dump()) + "\n").encode()
        writing = f"the {row.kind} row of step {row.step} to {METRICS}"
        with (
            full_disk_stops_the_run(self.path.parent, writing, len(line)),
            open(self.path, "ab", buffering=0) as f,
        ):
            start = f.seek(0, os.SEEK_END)
            try:
                rest = memoryview(line)
                while rest:  # an unbuffered write may take part of it: the kernel's short write
                    rest = rest[f.write(rest) :]
            except BaseException:
                f.truncate(start)  # shrinking needs no space: no half row is left for a reader
                raise

    def durable_size(self) -> int:
        if not self.enabled or not self.path.exists():
            return 0
        with open(self.path, "rb+") as f:
            os.fsync(f.fileno())
            return f.seek(0, os.SEEK_END)

    def cut_to(self, size: int) -> None:
        """Back to `size` bytes (a checkpoint's `metrics_bytes`), dropping every row logged after it; never
        longer (truncate would pad a shorter file with NUL bytes, a line no reader can parse)."""
        if self.enabled and self.path.exists() and self.path.stat().st_size > size:
            with open(self.path, "rb+") as f:
                f.truncate(size)


def read_metrics(run_dir: Path) -> list[MetricsRow]:
    """The run's metric log, a row per line (RecordError naming the file, the line and the field)."""
    path = run_dir / METRICS
    if not path.exists():
        return []
    return [metrics_row(line, f"{path} line {n}") for n, line in enumerate(path.read_bytes().splitlines(), 1)]


@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path
    steps: int
    tokens: int
    seconds: float
    val: dict[str, float]
    resumed_from: int | None
    drafter_config: DrafterConfig
    summary: RunSummary


EMBEDDING = "embed_tokens.weight"  # the target's own, never saved with a drafter


def drafter_state(drafter: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The weights a run saves: all the drafter's own (a frozen head too), not the target's shared embedding."""
    return {n: p.detach() for n, p in drafter.named_parameters() if n != EMBEDDING}


def load_drafter_state(drafter: Eagle3Drafter, weights: dict[str, torch.Tensor], where: Path) -> None:
    """Load saved drafter weights; anything but the (shared, frozen) embedding missing or extra is an error."""
    missing, unexpected = drafter.load_state_dict(weights, strict=False)
    if unexpected or set(missing) != {EMBEDDING}:
        raise Eagle3Error(
            f"{where}: drafter weights do not match (missing {missing}, unexpected {unexpected})"
        )


def write_final(
    run_dir: Path,
    weights: dict[str, torch.Tensor],
    drafter_cfg: DrafterConfig,
    mapping: VocabMapping,
    summary: RunSummary,
) -> Path:
    """final/: weights (`drafter_state`, whole), drafter config, the vocab mapping it is bound to, and the
    summary; whole or absent."""
    from safetensors.torch import save_file

    final = run_dir / FINAL
    with atomic_directory(final) as temp:
        save_file({n: t.cpu().contiguous() for n, t in weights.items()}, str(temp / "drafter.safetensors"))
        atomic_write_json(temp / "drafter_config.json", drafter_cfg.model_dump())
        save_vocab_mapping(mapping, temp / "vocab_mapping")
        summary.write(temp / SUMMARY)
    return final


def finished_result(run_dir: Path, resumed_from: int | None) -> TrainResult:
    summary = RunSummary.read(run_dir / FINAL / SUMMARY)
    return TrainResult(
        run_dir,
        run_dir / FINAL,
        summary.steps,
        summary.tokens,
        summary.seconds,
        summary.val.flat() if summary.val else {},
        resumed_from,
        DrafterConfig(**summary.drafter_config),
        summary,
    )


def load_trained(final_dir: Path, embed: torch.Tensor) -> tuple[Eagle3Drafter, VocabMapping, RunSummary]:
    """The drafter of a finished run (with the target's embedding), the mapping it is bound to, its summary."""
    from safetensors.torch import load_file

    summary = RunSummary.read(final_dir / SUMMARY)
    mapping = load_vocab_mapping(final_dir / "vocab_mapping", expected_fingerprint=summary.vocab_mapping)
    drafter = Eagle3Drafter(DrafterConfig(**summary.drafter_config), embed.float())
    load_drafter_state(drafter, load_file(str(final_dir / "drafter.safetensors")), final_dir)
    return drafter, mapping, summary
