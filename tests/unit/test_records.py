"""The typed JSON records: each round-trips, writes the bytes the dict writer wrote before it, reads a file
from an earlier eagle3, and refuses a missing field or a wrong type with one line naming the file and field."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from eagle3_core.errors import RecordError
from eagle3_core.store.atomic import atomic_write_json
from eagle3_core.store.records import (
    DrafterCurrent,
    DrafterDirReport,
    DrafterLatest,
    EvalReport,
    GateDecision,
    InboxRecord,
    Record,
    RunSummary,
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
    assert isinstance(read.val["counted"], int) and isinstance(read.val["acc_0"], float)
    assert read.tau(1) == 1.5 and read.tau(3) is None


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
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not None or k == "warm_from"}))
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
        "tau": {"3": None},
        "primary": "prompts",
        "sets": {"prompts": set_dict()},
    }
    _same_bytes(tmp_path, DrafterDirReport(**today), today)
    read = DrafterDirReport.read(tmp_path / "record.json")
    assert read.model_dump(mode="json") == DrafterDirReport(**today).model_dump(mode="json")


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
