"""A run's export is published whole (export/__init__.py `publish_export`): `eagle3 export` SIGKILLed between its
two formats or at any of its renames, or stopped by a full disk, leaves the previous export or none, never one
format alone; and re-exporting the promoted run never takes `current/sglang` away. After each, the next
commands (`eagle3 eval --promote`, `eagle3 export`, `eagle3 serve-command`) work on the store.

The drafter has random weights for the toy target (tests/records.py `trained_run`): export and evaluation read
final/ only, so nothing is trained here.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3_cli.main import main
from eagle3_core.config import load_config
from eagle3_core.errors import DiskSpaceError
from eagle3_core.export import validate_export
from eagle3_core.steps.drafter import export_step
from eagle3_core.steps.evaluation import PromotionRefused, promote_step, read_current, report_file
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import EvalReport
from tests.conftest import FIXTURES, write_config
from tests.full_disk import SAFETENSORS_FULL
from tests.kill import eagle3, every_crash_point, export_latest, hidden_leftovers, run_killed_at_call
from tests.records import report_dict, trained_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FORMATS = ("sglang", "speculators")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, toy_target_dir: Path) -> Path:
    """A project whose newest run (random weights) is finished and not exported yet; each test copies it."""
    project = tmp_path_factory.mktemp("trained") / "project"
    write_config(
        project,
        f"store: store\ntarget: {{path: {toy_target_dir}}}\nevaluate: {{ks: [1], gate_k: 1, max_prompts: 2, "
        f"max_new_tokens: 4, prompt_files: [{FIXTURES / 'prompts.jsonl'}]}}\n",
    )
    trained_run(StoreLayout(project / "store"), toy_target_dir, "r1", seed=1)
    return project


def copy_of(project: Path, to: Path) -> Path:
    shutil.rmtree(to, ignore_errors=True)
    shutil.copytree(project, to, symlinks=True)
    return to / "eagle3.yaml"


def complete(export_dir: Path) -> bool:
    """Both formats there, each valid (eagle3's own check of an export directory)."""
    for fmt in FORMATS:
        if not (export_dir / fmt / "config.json").is_file():
            return False
        validate_export(export_dir / fmt, fmt)  # type: ignore[arg-type]
    return True


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`eagle3 ARGS` (the console script's main, in this process): its status and what it printed."""
    code = main(list(args))
    return code, capsys.readouterr().out


def touch_weights(layout: StoreLayout, change: float | None = None) -> None:
    """r1's final weights changed by hand: fc.weight scaled by 0.5, or one of its values set to `change`."""
    path = layout.drafter_runs / "r1" / "final" / "drafter.safetensors"
    tensors = load_file(str(path))
    if change is None:
        tensors["fc.weight"] *= 0.5
    else:
        tensors["fc.weight"][0, 0] = change
    save_file(tensors, str(path))


def test_export_killed_between_its_two_formats_publishes_nothing(
    trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = copy_of(trained, tmp_path / "project")
    layout = StoreLayout(config.parent / "store")
    code = run_killed_at_call(
        "eagle3_core.export:export_speculators", eagle3, "--config", str(config), "export"
    )
    assert code == -signal.SIGKILL
    assert not (layout.exports / "r1").exists()  # not sglang/ alone

    refused, out = cli(capsys, "--config", str(config), "eval", "--promote")
    assert refused == 2 and "run r1 is not exported yet" in out and len(out.strip().splitlines()) == 1
    assert read_current(layout) is None

    assert cli(capsys, "--config", str(config), "export")[0] == 0  # exported again, whole
    assert complete(layout.exports / "r1") and hidden_leftovers(layout.root / "drafter") == []
    promoted, out = cli(capsys, "--config", str(config), "eval", "--promote")
    assert promoted == 0, out
    served, out = cli(capsys, "--config", str(config), "serve-command", "--json")
    assert served == 0 and json.loads(out)["drafter"] == str(layout.drafter_current_link)
    assert complete(layout.drafter_current_link)


def test_an_export_killed_at_any_rename_leaves_none_or_all_of_it(trained: Path, tmp_path: Path) -> None:
    work = tmp_path / "project"
    layout = StoreLayout(work / "store")

    def check(n: int) -> None:
        export = layout.exports / "r1"
        assert not export.exists() or complete(export), f"killed at rename {n}: half an export"
        export_latest(work / "eagle3.yaml")  # the next export works and clears what the crash left
        assert complete(export) and hidden_leftovers(layout.root / "drafter") == [], f"killed at rename {n}"

    points = every_crash_point(export_latest, (work / "eagle3.yaml",), lambda: copy_of(trained, work), check)
    assert points >= 2


@pytest.fixture(scope="module")
def promoted(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained project with r1 exported, evaluated (a report as eval writes it) and promoted."""
    config = copy_of(trained, tmp_path_factory.mktemp("promoted") / "project")
    layout = StoreLayout(config.parent / "store")
    export_step(load_config(config))
    report = EvalReport(**report_dict("r1", layout.pointer_path(layout.exports / "r1"), k=1))
    report.write(report_file(layout.export_eval("r1"), "sglang"))
    promote_step(load_config(config))
    return config.parent


def test_re_exporting_the_promoted_run_killed_at_any_rename_keeps_it_served(
    promoted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "project"
    layout = StoreLayout(work / "store")

    report = report_file(layout.export_eval("r1"), "sglang")

    def check(n: int) -> None:
        assert complete(layout.drafter_current_link), f"killed at rename {n}: current/ is not served whole"
        assert complete(layout.exports / "r1"), f"killed at rename {n}"
        assert read_current(layout).run == "r1"  # type: ignore[union-attr]
        assert report.is_file(), f"killed at rename {n}: the promoted drafter's evaluation is gone"
        served, out = cli(capsys, "--config", str(work / "eagle3.yaml"), "serve-command", "--json")
        assert served == 0 and json.loads(out)["which"].startswith("promoted"), f"killed at rename {n}: {out}"
        export_latest(work / "eagle3.yaml")
        assert complete(layout.drafter_current_link) and hidden_leftovers(layout.root / "drafter") == []
        assert report.is_file(), f"killed at rename {n}, then exported: the evaluation is gone"

    def reset() -> None:  # the weights changed since the export: exporting again writes a new version
        copy_of(promoted, work)
        touch_weights(layout)

    points = every_crash_point(export_latest, (work / "eagle3.yaml",), reset, check)
    assert points >= 2


def disk_full_in(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights write of format `fmt` fails as a full disk makes it fail."""
    import eagle3_core.export.common as common

    real = common.save_file

    def save_file(tensors: Any, filename: str, *args: Any, **kwargs: Any) -> None:
        if Path(filename).parent.name.startswith(f".{fmt}.tmp-"):  # atomic_directory's temporary for `fmt`
            raise SafetensorError(SAFETENSORS_FULL)
        real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(common, "save_file", save_file)


def test_a_full_disk_in_the_second_format_publishes_nothing_and_keeps_the_previous_export(
    trained: Path,
    promoted: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = copy_of(promoted, tmp_path / "project")
    layout = StoreLayout(config.parent / "store")
    before = {p.relative_to(layout.exports): p.read_bytes() for p in (layout.exports / "r1").rglob("*.*")}
    touch_weights(layout)  # what is exported changed: a new version is written
    disk_full_in("speculators", monkeypatch)

    with pytest.raises(DiskSpaceError, match="the disk filled up while exporting"):
        export_step(load_config(config))  # a re-export: the previous one stays, whole
    after = {p.relative_to(layout.exports): p.read_bytes() for p in (layout.exports / "r1").rglob("*.*")}
    assert after == before and complete(layout.drafter_current_link)
    assert hidden_leftovers(layout.root / "drafter") == []

    config = copy_of(trained, tmp_path / "first")  # no export yet: none is published
    code, out = cli(capsys, "--config", str(config), "export")
    assert code == 2 and "No space left on device" in out and len(out.strip().splitlines()) == 1
    layout = StoreLayout(config.parent / "store")
    assert not (layout.exports / "r1").exists() and hidden_leftovers(layout.root / "drafter") == []


def test_an_export_the_disk_cannot_hold_is_refused_before_anything_is_written(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = copy_of(trained, tmp_path / "project")
    layout = StoreLayout(config.parent / "store")
    drafter_dir = layout.root / "drafter"
    before = {p: p.read_bytes() for p in drafter_dir.rglob("*") if p.is_file()}
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10_000))

    code, out = cli(capsys, "--config", str(config), "export")
    assert code == 2 and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
    said = re.fullmatch(
        rf"error: the export of {re.escape(str(layout.exports / 'r1'))} \(sglang and speculators\) needs about "
        r"([\d,]+) bytes \(\d+\.\d\d GiB\) and "
        + re.escape(str(layout.export_versions("r1")))
        + r" has 10,000 bytes \(0\.00 GiB\) free; refusing to start below 1\.5x the estimate \([\d,]+ bytes\)\. "
        r"Free space or move the store\.",
        out.strip(),
    )
    assert said is not None, out
    assert {p: p.read_bytes() for p in drafter_dir.rglob("*") if p.is_file()} == before  # nothing written
    assert not layout.export_versions("r1").exists() and not (layout.exports / "r1").exists()

    monkeypatch.setattr(shutil, "disk_usage", real)  # room again: the export the estimate was made for
    export_step(load_config(config))
    written = sum(p.stat().st_size for p in layout.export_versions("r1").rglob("*") if p.is_file())
    estimate = int(said[1].replace(",", ""))
    assert written <= estimate <= written + 2 * (1 << 16)  # the weights exact, the configs allowed for


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_exporting_the_promoted_run_again_keeps_its_evaluation_and_its_promotion(
    trained: Path, tmp_path: Path, toy_target_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The demo's state (exported, evaluated, promoted), exported again: unchanged, nothing is written and the
    version stays; changed (weights touched, another target.dtype), the new version carries the evaluation,
    marked as measured on the version before, which no promotion is made from until it is measured again."""
    config = copy_of(trained, tmp_path / "project")
    layout = StoreLayout(config.parent / "store")
    assert cli(capsys, "--config", str(config), "export")[0] == 0
    code, out = cli(capsys, "--config", str(config), "eval", "--promote")
    assert code == 0, out
    eval_dir = layout.export_eval("r1")
    measured = files_of(eval_dir)
    assert {"report-sglang.json", "acceptance-sglang.png", "training_curves.png"} <= measured.keys()
    version = (layout.exports / "r1").resolve()

    code, out = cli(capsys, "--config", str(config), "export")  # unchanged: a no-op
    assert code == 0, out
    assert files_of(eval_dir) == measured, "the promoted drafter's evaluation is gone"
    assert (layout.exports / "r1").resolve() == version and "unchanged" in out, out
    assert [p.name for p in layout.export_versions("r1").iterdir()] == [version.name]
    assert read_current(layout).run == "r1"  # type: ignore[union-attr]
    assert complete(layout.drafter_current_link)
    assert (layout.drafter_current_link / "sglang").resolve() == version / "sglang"

    touch_weights(layout)  # changed: a new version, the evaluation carried into it
    assert cli(capsys, "--config", str(config), "export")[0] == 0
    new = (layout.exports / "r1").resolve()
    assert new != version and [p.name for p in layout.export_versions("r1").iterdir()] == [new.name]
    carried = files_of(eval_dir)
    assert {k: v for k, v in carried.items() if k != "carried.json"} == measured
    marker = json.loads(carried["carried.json"])
    assert {f: m["measured_on"]["version"] for f, m in marker["files"].items()} == dict.fromkeys(
        measured, version.name
    )
    assert read_current(layout).run == "r1"  # type: ignore[union-attr]
    assert complete(layout.drafter_current_link)
    assert (layout.drafter_current_link / "sglang").resolve() == new / "sglang"
    with pytest.raises(PromotionRefused) as refused:  # the gate measured the version before, not this one
        promote_step(load_config(config))
    assert "\n" not in str(refused.value) and f"measured on {version.name}" in str(refused.value)

    code, out = cli(capsys, "--config", str(config), "eval", "--promote")  # measured again: promoted
    assert code == 0, out
    remeasured = files_of(eval_dir)
    assert remeasured["report-sglang.json"] != measured["report-sglang.json"]  # this version's own

    # another export dtype: carried again; the report measured on `new`, the pictures still on `version`
    write_config(
        config.parent,
        config.read_text().replace(
            f"target: {{path: {toy_target_dir}}}", f"target: {{path: {toy_target_dir}, dtype: float16}}"
        ),
    )
    assert "dtype: float16" in config.read_text()
    assert cli(capsys, "--config", str(config), "export")[0] == 0
    newest = (layout.exports / "r1").resolve()
    assert (
        newest not in (version, new)
        and json.loads((newest / "sglang" / "config.json").read_text())["torch_dtype"] == "float16"
    )
    assert {k: v for k, v in files_of(eval_dir).items() if k != "carried.json"} == {
        k: v for k, v in remeasured.items() if k != "carried.json"
    }
    marker = json.loads((eval_dir / "carried.json").read_text())
    assert marker["files"]["report-sglang.json"]["measured_on"]["version"] == new.name
    assert complete(layout.drafter_current_link) and read_current(layout).run == "r1"  # type: ignore[union-attr]
    assert hidden_leftovers(layout.root / "drafter") == []


def test_an_export_of_weights_set_to_nan_by_hand_is_refused_and_the_promoted_export_stays(
    promoted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = copy_of(promoted, tmp_path / "project")
    layout = StoreLayout(config.parent / "store")
    before = {p.relative_to(layout.exports): p.read_bytes() for p in (layout.exports / "r1").rglob("*.*")}
    touch_weights(layout, float("nan"))

    code, out = cli(capsys, "--config", str(config), "export")
    assert code == 2 and len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
    assert out.startswith(f"error: {layout.exports / 'r1'}: not exported: fc.weight holds 1 NaN"), out
    after = {p.relative_to(layout.exports): p.read_bytes() for p in (layout.exports / "r1").rglob("*.*")}
    assert after == before and complete(layout.drafter_current_link)
    assert hidden_leftovers(layout.root / "drafter") == []
