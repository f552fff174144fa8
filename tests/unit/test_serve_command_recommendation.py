"""`eagle3 serve-command` on a promoted drafter whose evaluation wrote a serving recommendation: each engine's
own per-batch-size arguments (SGLang's adaptive table, vLLM's num_speculative_tokens_per_batch_size) and the
figures they come from; without one (an older evaluation, nothing measured, nothing that pays), one line says
so and the commands draft evaluate.gate_k. The recommendations are constructed here."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from eagle3_cli.steps import main
from eagle3_core.config import load_config
from eagle3_core.evaluate.serving_k import serving_file, sglang_config_file
from eagle3_core.steps.evaluation import promote_step
from eagle3_core.steps.serving import serve_commands, serve_markdown
from eagle3_core.store.atomic import atomic_write_json
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import ServingRecommendation
from tests.conftest import write_config
from tests.records import evaluated_run, serving_recommendation


def recommendation(costs: list[dict[str, Any]] | None = None, **change: Any) -> ServingRecommendation:
    """K 3 at batch 1, 1 at 16, 0 at 64 (tests/records.py), measured on cuda:0 in bfloat16."""
    return serving_recommendation(costs, **change)


@pytest.fixture
def promoted(tmp_path: Path) -> Path:
    """r1 exported (a tiny drafter for org/target-8l), evaluated with its gate passed, and promoted. Its config."""
    config = write_config(tmp_path, "store: store\nevaluate: {ks: [1, 3], gate_k: 3}\n")
    evaluated_run(StoreLayout(tmp_path / "store"), "r1")
    promote_step(load_config(config))
    return config


def eval_dir(config: Path) -> Path:
    return StoreLayout(config.parent / "store").export_eval("r1")


def test_the_promoted_drafter_is_served_with_the_k_measured_best_at_each_batch_size(
    promoted: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recommendation().write(serving_file(eval_dir(promoted), "sglang"))
    table = sglang_config_file(eval_dir(promoted), "sglang")
    current = promoted.parent / "store" / "drafter" / "current"

    assert main(["--config", str(promoted), "serve-command"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        f"drafter: {current} (promoted: drafter/current); K by batch size 1:3 16:1 64:0 (serving "
        f"recommendation, {serving_file(eval_dir(promoted), 'sglang')})"
    )
    assert lines[1].startswith(
        "from acceptance measured on the heldout prompts (rounds of K=3, temperature 0), "
    )
    assert "on cuda:0 (bfloat16; median of 3, 128 tokens in each row's cache)" in lines[1]
    assert (
        lines[2] == "  batch 1: K=3, 207.7 tokens/s against 100.0 plain (2.08x); at K=1..3: 163.6 200.0 207.7"
    )
    assert lines[3].startswith("  batch 16: K=1, ") and lines[4].startswith("  batch 64: K=0, 640.0 tokens/s")
    assert lines[5] == f"SGLang's adaptive table: {table}"

    sglang = shlex.split(lines[lines.index("SGLang:") + 1])
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == f"{current}/sglang"
    # the largest K of the table, which SGLang requires --speculative-num-steps to be one of
    assert sglang[sglang.index("--speculative-num-steps") + 1] == "3"
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "4"
    assert "--speculative-adaptive" in sglang
    assert sglang[sglang.index("--speculative-adaptive-config") + 1] == str(table)
    # the table file was written (atomically) into the export's eval/, one candidate step count a batch size
    assert json.loads(table.read_text()) == {
        "1": {"candidate_steps": [3]},
        "16": {"candidate_steps": [1]},
        "64": {"candidate_steps": [0]},
    }

    vllm = shlex.split(lines[lines.index("vLLM:") + 1])
    assert vllm[:3] == ["vllm", "serve", "org/target-8l"]
    assert json.loads(vllm[vllm.index("--speculative-config") + 1]) == {
        "method": "eagle3",
        "model": f"{current}/speculators",
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 15, 3], [16, 63, 1], [64, 65536, 0]],
    }

    assert main(["--config", str(promoted), "serve-command", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["sglang_adaptive_config"] == str(table) and printed["k"] == "3"
    assert printed["figures"].splitlines()[1] == lines[2]
    # an asset page shows the same: the K by batch size, the figures, both commands
    page = serve_markdown(printed)
    assert page.startswith("K by batch size 1:3 16:1 64:0 (serving recommendation, ")
    assert f"```text\n{printed['figures']}\n```" in page
    assert f"```bash\n{printed['sglang']}\n```" in page and f"```bash\n{printed['vllm']}\n```" in page


def test_a_table_edited_or_removed_is_written_again_as_the_recommendation_says(promoted: Path) -> None:
    r = recommendation()
    r.write(serving_file(eval_dir(promoted), "sglang"))
    table = sglang_config_file(eval_dir(promoted), "sglang")
    cfg = load_config(promoted)
    serve_commands(cfg)
    written = table.read_text()
    atomic_write_json(table, {"1": {"candidate_steps": [7]}})
    serve_commands(cfg)
    assert table.read_text() == written
    table.unlink()
    assert str(table) in serve_commands(cfg)["sglang"] and table.read_text() == written


def fixed_k(commands: dict[str, str]) -> None:
    """The commands draft evaluate.gate_k (3) at every batch size: no per-batch-size arguments."""
    sglang = shlex.split(commands["sglang"])
    assert (
        sglang[sglang.index("--speculative-num-steps") + 1] == "3" and "--speculative-adaptive" not in sglang
    )
    spec = json.loads(shlex.split(commands["vllm"])[-1])
    assert spec["num_speculative_tokens"] == 3 and "num_speculative_tokens_per_batch_size" not in spec
    assert commands["sglang_adaptive_config"] == ""


def test_an_evaluation_without_a_recommendation_is_said_in_one_line(
    promoted: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = serving_file(eval_dir(promoted), "sglang")
    assert main(["--config", str(promoted), "serve-command"]) == 0  # the report predates recommendations
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("(promoted: drafter/current); K=3 (evaluate.gate_k)")
    assert lines[1] == (
        f"no serving recommendation ({path} is absent: the export's evaluation predates it, or the export is "
        "not evaluated); drafting K=3 (evaluate.gate_k) at every batch size"
    )
    assert lines[2] == ""  # then the commands, as before
    cfg = load_config(promoted)
    fixed_k(serve_commands(cfg))

    why = "the step costs are timed with the batched target step, which does not compute this one (x)"
    recommendation([], by_batch=[], unmeasured=why).write(path)
    commands = serve_commands(cfg)
    assert commands["serving"] == (
        f"no serving recommendation: {why} ({path}); drafting K=3 (evaluate.gate_k) at every batch size"
    )
    assert commands["figures"] == ""
    fixed_k(commands)

    slow = [{"batch_size": 1, "target_s": [0.01, 0.02, 0.03, 0.04], "drafter_s": 0.01}]
    recommendation(slow).write(path)
    commands = serve_commands(cfg)
    assert commands["serving"].startswith(f"serving recommendation ({path}): plain decoding is faster than")
    assert (
        commands["figures"].splitlines()[1].startswith("  batch 1: K=0, 100.0 tokens/s against 100.0 plain")
    )
    fixed_k(commands)
    assert not sglang_config_file(eval_dir(promoted), "sglang").exists()


def test_a_damaged_recommendation_is_one_line(promoted: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = serving_file(eval_dir(promoted), "sglang")
    data = recommendation().dump()
    data["by_batch"][0]["k"] = 9
    atomic_write_json(path, data)
    assert main(["--config", str(promoted), "serve-command"]) == 2
    out = capsys.readouterr().out
    assert out.splitlines() == [f"error: {path}: by_batch[0].k: 9 is not in 0..3"] and "Traceback" not in out
