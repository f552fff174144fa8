"""The typed JSON records: each round-trips, writes the bytes the dict writer wrote before it, reads a file
from an earlier eagle3, and refuses a missing field or a wrong type with one line naming the file and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_core.errors import RecordError
from eagle3_core.store.atomic import atomic_write_json
from eagle3_core.store.records import RunSummary, field_path
from tests.records import summary_dict


def _same_bytes(tmp_path: Path, record: RunSummary, today: dict[str, object]) -> None:
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
    assert field_path(()) == "(top level)"
