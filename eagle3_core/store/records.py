"""The JSON files eagle3 writes and reads back, as typed records.

Each record writes itself with `atomic_write_json` (the same keys, order and formatting as the dicts it
replaced, so files written before and after read alike) and reads with one error naming the file and the
field. `extra="forbid"` where only eagle3 ever wrote the file; a field added later has a default, so a file
from an earlier version of eagle3 still reads.

Records live in the store layer and hold only plain values: the drafter and training configs are kept as
their dumped dicts (their models live in higher layers), and the caller builds the model from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from eagle3_core.conventions import FinalStateConvention
from eagle3_core.errors import RecordError
from eagle3_core.store.atomic import atomic_write_json, read_json_object


def field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a reader writes it: `sets.heldout.by_k`, `aux_layer_ids[1]` ("" for the
    whole object)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_message(path: Path, err: ValidationError) -> str:
    first = err.errors()[0]
    more = err.error_count() - 1
    return f"{path}: {field_path(first['loc']) or '(top level)'}: {first['msg']}" + (
        f" (and {more} more)" if more else ""
    )


class Record(BaseModel):
    """A frozen JSON record: `write(path)` atomically, `read(path)` validated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    def write(self, path: Path) -> None:
        atomic_write_json(path, self.dump())

    def dump(self) -> dict[str, Any]:
        """What `write` puts in the file. Python mode, not json mode: json.dumps then writes a NaN (an
        unmeasured AL) as it always did, not as null."""
        return self.model_dump()

    @classmethod
    def read(cls, path: Path) -> Self:
        try:
            return cls.model_validate(read_json_object(path, RecordError))
        except ValidationError as err:
            raise RecordError(validation_message(path, err)) from None


class RunSummary(Record):
    """runs/<run>/final/summary.json: what a finished run was trained from and with, and its last validation."""

    run: str
    steps: int
    tokens: int
    seconds: float
    val: dict[str, int | float]  # the last validation's metrics, {} without one; `counted` is an int
    drafter_config: dict[str, Any]
    vocab_mapping: str
    target_fingerprint: str
    aux_layer_ids: list[int]
    aux_layer_convention: str
    final_state_convention: FinalStateConvention
    train_samples: int
    val_samples: int
    world_size: int
    attention: str
    bf16: bool
    train_config: dict[str, Any]
    warm_from: str | None = None  # absent from summaries written before train.init_from existed

    def tau(self, k: int) -> float | None:
        value = self.val.get(f"tau_{k}")
        return None if value is None else float(value)


class GateDecision(Record):
    """The promotion gate's verdict on a candidate drafter (docs/design.md section 6)."""

    passed: bool
    k: int
    candidate_run: str
    candidate_al: float  # NaN when no verification round was measured
    current_run: str | None
    current_al: float | None
    tolerance: float
    reason: str
    candidate_ci95: list[float] | None = None
    current_ci95: list[float] | None = None
    difference: float | None = None  # AL(candidate) - AL(current) on the same prompts
    difference_ci95: list[float] | None = None  # its paired-bootstrap interval
    prompts: int = 0


class EvalReport(Record):
    """export/<run>/eval/report-<format>.json: an export measured by speculative decoding, and the gate.

    `sets` holds each prompt set's measurement as the evaluator's Measurement dumps it, with the prompts
    named and grouped by category; it stays a plain mapping, its shape owned by the evaluate layer.
    """

    run: str
    export_dir: str
    format: str
    device: str
    dtype: str
    settings: dict[str, Any]
    tau: dict[str, float | None]  # the training estimate per K, None where validation did not measure it
    primary: str  # the set the gate compares and the page leads with
    sets: dict[str, dict[str, Any]]
    gate: GateDecision
    pictures: dict[str, str]


class DrafterDirReport(Record):
    """store/eval/drafters/<dir>-<digest>/report-<format>.json: any drafter directory measured, no gate."""

    run: str
    drafter_dir: str
    format: str
    variant: dict[str, Any] | None = None  # absent from reports written before variants were recorded
    aux_layer_ids: list[int]
    device: str
    dtype: str
    settings: dict[str, Any]
    tau: dict[str, float | None]
    primary: str
    sets: dict[str, dict[str, Any]]


class DrafterLatest(Record):
    """drafter/latest.json: the newest finished training run."""

    run: str
    final: str  # its final/ directory, relative to the store (StoreLayout.pointer_path; absolute in older stores)


class DrafterCurrent(Record):
    """drafter/current.json: the promoted drafter, the AL its gate measured, and the run it replaced."""

    run: str
    export_dir: str  # relative to the store, like DrafterLatest.final
    acceptance_length: float
    k: int
    promoted_at: str  # ISO 8601, UTC, to the second
    replaced: str | None


InboxState = Literal["ingesting", "done", "refused"]


class InboxFile(Record):
    """One inbox file as inbox.json records it. Which fields it has depends on what became of it: a read
    file has its digest and stat, a duplicate `same_as`, a refusal its `reason`, a refused link only
    `symlink` and `reason`. Absent fields are None and left out of the file."""

    state: InboxState
    symlink: bool | None = None
    sha256: str | None = None
    size: int | None = None
    mtime_ns: int | None = None
    same_as: str | None = None  # the ingested file whose content this one repeats
    reason: str | None = None


class InboxRecord(Record):
    """store/inbox.json: every inbox file seen, by its source name."""

    version: int
    files: dict[str, InboxFile]

    def dump(self) -> dict[str, Any]:
        # a file's absent fields stay absent, as the dicts this record replaced wrote them
        return self.model_dump(exclude_none=True)
