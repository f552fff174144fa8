"""The typed JSON records: each round-trips, writes the bytes the dict writer wrote before it, reads a file
from an earlier eagle3, and refuses a missing field or a wrong type with one line naming the file and field."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from eagle3_core.errors import RecordError
from eagle3_core.evaluate.acceptance import acceptance
from eagle3_core.evaluate.measure import (
    Measurement,
    PathTiming,
    PromptRun,
    bootstrap_al_interval,
    pooled_runs_al,
)
from eagle3_core.evaluate.prompts import EvalPrompt
from eagle3_core.steps.drafter import gpu_memory_metadata
from eagle3_core.store.atomic import atomic_write_json
from eagle3_core.store.records import (
    DrafterCurrent,
    DrafterDirReport,
    DrafterLatest,
    EvalReport,
    GateDecision,
    GpuMemory,
    InboxRecord,
    Record,
    RunSummary,
    SetMeasurement,
    TrainRow,
    field_path,
)
from tests.records import gate_dict, report_dict, set_dict, summary_dict


def _same_bytes(tmp_path: Path, record: Record, today: dict[str, object]) -> None:
    atomic_write_json(tmp_path / "dict.json", today)
    record.write(tmp_path / "record.json")
    assert (tmp_path / "record.json").read_bytes() == (tmp_path / "dict.json").read_bytes()


def test_a_run_summary_round_trips_and_writes_todays_bytes(tmp_path: Path) -> None:
    summary = RunSummary(**summary_dict())
    _same_bytes(tmp_path, summary, summary_dict())
    read = RunSummary.read(tmp_path / "record.json")
    assert read == summary
    assert read.val is not None and read.val.counted == 96 and read.val.acc == [0.5]
    assert read.tau(1) == 1.5 and read.tau(3) is None


def test_a_summary_without_validation_writes_an_empty_val_as_before(tmp_path: Path) -> None:
    today = {**summary_dict(), "val": {}, "val_samples": 0}
    summary = RunSummary(**today)
    assert summary.val is None and summary.tau(1) is None
    _same_bytes(tmp_path, summary, today)
    assert RunSummary.read(tmp_path / "record.json") == summary


def test_a_summary_from_before_warm_starts_still_reads(tmp_path: Path) -> None:
    old = {k: v for k, v in summary_dict().items() if k != "warm_from"}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    assert RunSummary.read(tmp_path / "summary.json").warm_from is None


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"steps": None}, "steps: Field required"),
        ({"steps": "many"}, "steps: Input should be a valid integer"),
        ({"aux_layer_ids": [2, "x", 5]}, "aux_layer_ids[1]: Input should be a valid integer"),
        ({"val": {"acc_0": "high"}}, "val.acc_0"),
        ({"surplus": 1}, "surplus: Extra inputs are not permitted"),
    ],
)
def test_a_bad_summary_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, change: dict[str, object], expected: str
) -> None:
    data = {**summary_dict(), **change}
    path = tmp_path / "summary.json"
    path.write_text(
        json.dumps({k: v for k, v in data.items() if v is not None or k in ("warm_from", "selection")})
    )
    with pytest.raises(RecordError) as err:
        RunSummary.read(path)
    assert str(err.value).startswith(f"{path}: {expected}") and "\n" not in str(err.value)


def test_a_file_that_is_not_a_json_object_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text("[1, 2]")
    with pytest.raises(RecordError, match="expected a JSON object, got list"):
        RunSummary.read(path)


def test_field_paths_read_as_written() -> None:
    assert field_path(("sets", "heldout", "by_k", "3")) == "sets.heldout.by_k.3"
    assert field_path(("aux_layer_ids", 0)) == "aux_layer_ids[0]"
    assert field_path(()) == ""
    assert field_path((0, "kind")) == "[0].kind"


def test_an_evaluation_report_round_trips_and_writes_todays_bytes(tmp_path: Path) -> None:
    report = EvalReport(**report_dict())
    _same_bytes(tmp_path, report, report_dict())
    read = EvalReport.read(tmp_path / "record.json")
    # the decode settings' tuple of K reads back as the list JSON holds
    assert read.model_dump(mode="json") == report.model_dump(mode="json")
    assert read.gate.candidate_ci95 == [2.25, 2.75]


def test_an_unmeasured_gate_keeps_its_nan_as_json_dumps_writes_it(tmp_path: Path) -> None:
    today = report_dict(passed=False, candidate_al=float("nan"), reason="no verification round was measured")
    _same_bytes(tmp_path, EvalReport(**today), today)
    assert "NaN" in (tmp_path / "record.json").read_text()
    assert math.isnan(EvalReport.read(tmp_path / "record.json").gate.candidate_al)


def test_a_drafter_dir_report_writes_todays_bytes(tmp_path: Path) -> None:
    today = {
        "run": "other",
        "drafter_dir": "/d/other",
        "format": "speculators",
        "variant": {"norm_before_fc": False},
        "aux_layer_ids": [1, 3, 5],
        "device": "cpu",
        "dtype": "float32",
        "settings": {"ks": (3,), "max_new_tokens": 64, "temperature": 0.0, "seed": 0, "batch_size": 1},
        "target_step": "graphed",
        "tau": {"3": None},
        "primary": "prompts",
        "sets": {"prompts": set_dict()},
    }
    _same_bytes(tmp_path, DrafterDirReport(**today), today)
    read = DrafterDirReport.read(tmp_path / "record.json")
    assert read.model_dump(mode="json") == DrafterDirReport(**today).model_dump(mode="json")


def test_a_report_from_before_target_step_reads_as_timed_with_the_eager_step() -> None:
    old = {k: v for k, v in report_dict().items() if k != "target_step"}
    assert EvalReport(**old).target_step == "eager"


def test_a_gate_from_before_the_paired_intervals_still_reads() -> None:
    old = {
        k: v for k, v in gate_dict().items() if not k.endswith("ci95") and k not in ("difference", "prompts")
    }
    assert GateDecision.model_validate(old).prompts == 0


@pytest.mark.parametrize(
    ("gate", "expected"),
    [
        ({"candidate_al": None}, "gate.candidate_al: Input should be a valid number"),
        ({"k": "three"}, "gate.k: Input should be a valid integer"),
    ],
)
def test_a_bad_gate_names_its_field_path(tmp_path: Path, gate: dict[str, object], expected: str) -> None:
    path = tmp_path / "report-sglang.json"
    atomic_write_json(path, report_dict(**gate))
    with pytest.raises(RecordError, match="^" + re.escape(f"{path}: {expected}")):
        EvalReport.read(path)


def test_a_report_missing_its_gate_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "report-sglang.json"
    atomic_write_json(path, {k: v for k, v in report_dict().items() if k != "gate"})
    with pytest.raises(RecordError, match="^" + re.escape(f"{path}: gate: Field required")):
        EvalReport.read(path)


def test_the_eval_page_is_drawn_from_the_report_the_step_returned(tmp_path: Path) -> None:
    import dagster as dg

    from eagle3_core.steps.common import StepResult
    from eagle3_dagster.defs.metadata import eval_metadata

    pictures = {name: tmp_path / f"{name}.png" for name in ("acceptance", "training_curves")}
    for picture in pictures.values():
        picture.write_bytes(b"\x89PNG")
    report = EvalReport(**{**report_dict(), "pictures": {k: str(v) for k, v in pictures.items()}})
    meta = eval_metadata(StepResult("drafter_eval", tmp_path, {"run": "r1"}, record=report))
    assert meta["run"] == "r1" and isinstance(meta["gate"], dg.MarkdownMetadataValue)
    assert "| heldout (1) | 3 | 2.500 (2.25-2.75) | 2.750 |" in meta["acceptance_table"].md_str
    assert "**promote**: no drafter is promoted yet" in meta["gate"].md_str
    assert "| heldout | chat | 3 | 2.500" in meta["acceptance_by_category"].md_str
    with pytest.raises(TypeError, match="returned no EvalReport"):
        eval_metadata(StepResult("drafter_eval", tmp_path, {}))


def test_the_drafter_pointers_write_todays_bytes(tmp_path: Path) -> None:
    latest = {"run": "r1", "final": "drafter/runs/r1/final"}
    _same_bytes(tmp_path, DrafterLatest(**latest), latest)
    assert DrafterLatest.read(tmp_path / "record.json") == DrafterLatest(**latest)
    current = {
        "run": "r2",
        "export_dir": "drafter/export/r2",
        "acceptance_length": 2.8125,
        "k": 3,
        "promoted_at": "2026-12-01T12:00:00+00:00",
        "replaced": None,
    }
    _same_bytes(tmp_path, DrafterCurrent(**current), current)
    assert DrafterCurrent.read(tmp_path / "record.json") == DrafterCurrent(**current)


def test_a_pointer_missing_its_path_names_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "latest.json"
    path.write_text('{"run": "r1"}')
    with pytest.raises(RecordError, match="^" + re.escape(f"{path}: final: Field required")):
        DrafterLatest.read(path)


def test_the_inbox_record_writes_todays_bytes_each_entry_with_only_its_fields(tmp_path: Path) -> None:
    stat = {"size": 120, "mtime_ns": 1_700_000_000_000_000_000}
    today = {
        "version": 1,
        "files": {
            "inbox/a.jsonl": {"state": "done", "sha256": "a" * 64, **stat},
            "inbox/b.jsonl": {"state": "done", "sha256": "a" * 64, **stat, "same_as": "inbox/a.jsonl"},
            "inbox/c.jsonl": {"state": "ingesting", "sha256": "c" * 64, **stat},
            "inbox/d.jsonl": {"state": "refused", "sha256": "d" * 64, **stat, "reason": "rows changed"},
            "inbox/e.jsonl": {"state": "refused", "symlink": True, "reason": "a symbolic link, not read"},
        },
    }
    record = InboxRecord.model_validate(today)
    _same_bytes(tmp_path, record, today)
    assert InboxRecord.read(tmp_path / "record.json") == record
    touched = record.files["inbox/a.jsonl"].model_copy(update={"mtime_ns": 5})
    written = InboxRecord(version=1, files={"inbox/a.jsonl": touched}).dump()["files"]["inbox/a.jsonl"]
    assert written == {"state": "done", "sha256": "a" * 64, "size": 120, "mtime_ns": 5}


def test_an_inbox_entry_in_an_unknown_state_names_its_field(tmp_path: Path) -> None:
    path = tmp_path / "inbox.json"
    path.write_text(json.dumps({"version": 1, "files": {"inbox/a.jsonl": {"state": "lost"}}}))
    with pytest.raises(
        RecordError, match="^" + re.escape(f"{path}: files.inbox/a.jsonl.state: Input should be")
    ):
        InboxRecord.read(path)


def _dict_writer_set(
    measured: Measurement, prompts: list[EvalPrompt], rejected: dict[str, int]
) -> dict[str, Any]:
    """A prompt set's block as the evaluation step wrote it before records (Measurement.as_dict with its
    prompts named, then the rejections and the categories), kept here to compare the bytes against."""
    by_k = {}
    for k, runs in measured.runs.items():
        a = acceptance((x for r in runs for x in r.accepted), k)
        lo, hi = measured.al_interval(k)
        out: dict[str, Any] = {
            "k": a.k,
            "rounds": a.rounds,
            "acceptance_length": round(a.acceptance_length, 4),
            "acceptance_rate": round(a.acceptance_rate, 4),
            **{f"accept_{i}": round(x, 4) for i, x in enumerate(a.per_position)},
            "al_ci95": [round(lo, 4), round(hi, 4)],
            "per_position": [round(x, 4) for x in a.per_position],
            "tokens_per_s": round(measured.speculative(k).tokens_per_s, 2),
            "speedup": round(measured.speedup(k), 4),
            "speedup_statistic": "median over prompts of the per-prompt ratio",
            "per_prompt": [
                {
                    "al": round(1 + sum(r.accepted) / len(r.accepted), 4) if r.accepted else None,
                    "rounds": len(r.accepted),
                    "accepted": sum(r.accepted),
                    "speedup": None if math.isnan(r.speedup) else round(r.speedup, 4),
                    "id": p.id,
                    **({"category": p.category} if p.category is not None else {}),
                }
                for r, p in zip(runs, prompts, strict=True)
            ],
        }
        if k in measured.greedy_mismatches:
            out["greedy_mismatches"] = measured.greedy_mismatches[k]
        by_k[str(k)] = out
    block = {
        "prompts": measured.prompts,
        "device": measured.device,
        "target_tokens_per_s": round(measured.target.tokens_per_s, 2),
        "by_k": by_k,
        "rejected": rejected,
    }
    categories = sorted({p.category for p in prompts if p.category is not None})
    if categories:
        block["by_category"] = {
            c: {
                str(k): {
                    "prompts": len(
                        picked := [r for r, p in zip(runs, prompts, strict=True) if p.category == c]
                    ),
                    "acceptance_length": round(pooled_runs_al(picked, k), 4),
                    "al_ci95": [round(x, 4) for x in bootstrap_al_interval(picked)],
                }
                for k, runs in measured.runs.items()
            }
            for c in categories
        }
    return block


def _measured(categories: list[str | None]) -> tuple[Measurement, list[EvalPrompt]]:
    def run(accepted: tuple[int, ...], spec_s: float) -> PromptRun:
        return PromptRun(accepted, PathTiming(12, spec_s), PathTiming(12, 0.5))

    runs = {
        3: [run((3, 1, 0), 0.25), run((), 0.0), run((2, 2), 0.4), run((0, 1, 3, 3), 0.3)],
        5: [run((5, 0), 0.2), run((1,), 0.6), run((4, 4, 1), 0.35), run((), 0.0)],
    }
    prompts = [EvalPrompt(f"p{i}", [], c) for i, c in enumerate(categories)]
    return Measurement(prompts=4, runs=runs, greedy_mismatches={5: 1}), prompts


@pytest.mark.parametrize("categories", [["chat", None, "code", "chat"], [None] * 4])
def test_a_sets_measurement_writes_the_bytes_the_dict_writer_wrote(
    tmp_path: Path, categories: list[str | None]
) -> None:
    from eagle3_core.evaluate.prompts import PromptSet
    from eagle3_core.steps.evaluation import set_reports

    measured, prompts = _measured(categories)
    prompt_set = PromptSet("heldout", prompts, [{"id": "x", "reason": "too_long", "detail": ""}])
    record = set_reports([prompt_set], {"heldout": [(p, []) for p in prompts]}, {"heldout": measured})[
        "heldout"
    ]
    today = _dict_writer_set(measured, prompts, prompt_set.reject_counts)
    _same_bytes(tmp_path, record, today)
    read = SetMeasurement.read(tmp_path / "record.json")
    assert read.model_dump(mode="json") == record.model_dump(mode="json")
    k3 = read.at(3)
    assert k3.per_prompt[1].al is None and k3.per_prompt[1].speedup is None and k3.greedy_mismatches is None
    assert read.at(5).greedy_mismatches == 1 and (read.by_category is None) == (categories == [None] * 4)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"speedup": None}, "sets.heldout.by_k.3.speedup: Field required"),
        ({"accept_1": 0.4}, "sets.heldout.by_k.3.accept_1: 0.4 disagrees with per_position[1]"),
        ({"accept_3": 0.1}, "sets.heldout.by_k.3.accept_3: beyond the 3 draft positions"),
        (
            {"per_prompt": [{"al": 2.5, "rounds": "four"}]},
            "sets.heldout.by_k.3.per_prompt[0].rounds: Input should",
        ),
    ],
)
def test_a_bad_measurement_names_its_field_path(
    tmp_path: Path, change: dict[str, object], expected: str
) -> None:
    report = report_dict()
    by_k = report["sets"]["heldout"]["by_k"]["3"]
    report["sets"]["heldout"]["by_k"]["3"] = {k: v for k, v in {**by_k, **change}.items() if v is not None}
    path = tmp_path / "report-sglang.json"
    atomic_write_json(path, report)
    with pytest.raises(RecordError, match="^" + re.escape(f"{path}: {expected}")) as err:
        EvalReport.read(path)
    assert "\n" not in str(err.value)


def test_a_summary_from_before_acceptance_selection_still_reads(tmp_path: Path) -> None:
    old = {k: v for k, v in summary_dict().items() if k != "selection"}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    assert RunSummary.read(tmp_path / "summary.json").selection is None


def test_a_gpu_runs_summary_keeps_its_peak_beside_the_estimate_and_the_page_shows_both(
    tmp_path: Path,
) -> None:
    gpu = GpuMemory(device="NVIDIA H200 (cuda:0)", free_at_start_gib=139.1, estimate_gib=75.7, peak_gib=80.7)
    RunSummary(**{**summary_dict(), "gpu_memory": gpu.model_dump()}).write(tmp_path / "summary.json")
    read = RunSummary.read(tmp_path / "summary.json")
    assert read.gpu_memory == gpu
    assert gpu_memory_metadata(read) == {
        "gpu_peak_gib": 80.7, "gpu_estimate_gib": 75.7, "gpu": "NVIDIA H200 (cuda:0)"
    }  # fmt: skip
    assert gpu_memory_metadata(RunSummary(**summary_dict())) == {}  # a CPU run estimates nothing


def test_a_summary_and_a_log_row_from_before_gpu_peaks_still_read(tmp_path: Path) -> None:
    old = {k: v for k, v in summary_dict().items() if k != "gpu_memory"}
    (tmp_path / "summary.json").write_text(json.dumps(old))
    assert RunSummary.read(tmp_path / "summary.json").gpu_memory is None
    row = {
        "kind": "train", "step": 2, "epoch": 0, "lr": 0.001, "loss": 1.5, "loss_0": 1.5, "acc_0": 0.5,
        "full_acc_0": 0.5, "tau_1": 1.5, "counted": 8, "tokens": 64, "tokens_per_s": 10.0, "elapsed_s": 6.4,
    }  # fmt: skip
    assert TrainRow.model_validate(row).peak_gpu_gib is None
