"""`make bench` from a fresh clone: every recipe line runs a bench as a module of the repository's `bench`
package, and each of them imports there (running one as `python bench/x.py` could not find `bench._common`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def _bench_recipe() -> list[str]:
    lines = (REPO / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("bench:")))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def test_make_bench_runs_each_bench_as_a_module_that_imports_from_the_repository() -> None:
    recipe = _bench_recipe()
    modules = [
        m.group(1) for line in recipe if (m := re.fullmatch(r"\$\(BIN\)/python -m (bench\.\w+)", line))
    ]
    assert modules and len(modules) == len(recipe), recipe
    for module in modules:
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    assert callable(importlib.import_module(m).main), m"
    result = subprocess.run(
        [sys.executable, "-c", code, *modules], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_checkpoint_bench_saves_and_resumes_a_verified_checkpoint_beside_plain_files(
    tmp_path: Path,
) -> None:
    """bench/checkpoint_scale.py at a tiny shape (the H200 figures are at hidden 7168): both paths run, the
    checkpoint is the size of the tensors it holds."""
    from bench import checkpoint_scale

    results = tmp_path / "ckpt.json"
    shape = ["--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv-heads", "2"]
    assert (
        checkpoint_scale.main(
            [
                *shape,
                "--vocab",
                "256",
                "--target-vocab",
                "512",
                "--dir",
                str(tmp_path),
                "--results",
                str(results),
            ]
        )
        == 0
    )
    report = json.loads(results.read_text())
    params, seconds = report["trainable_params"], report["seconds"]
    # float32 weights and AdamW's two moments, plus the files' headers and state.json
    assert 3 * 4 * params < report["checkpoint_bytes"] < 3 * 4 * params + 200_000
    assert all(seconds[k] > 0 for k in ("save_plain", "save_eagle3", "resume_eagle3"))
    assert [p.name for p in tmp_path.iterdir()] == [results.name]  # its working files removed


def test_the_regeneration_speed_bench_gives_each_kv_cache_the_same_replies(tmp_path: Path) -> None:
    """bench/regenerate_speed.py on a tiny random Llama on the CPU (the H200 figures are SmolLM2 at batch
    512): every cache runs the same chitchat prompts and gives the dynamic cache's token ids."""
    from bench import regenerate_speed
    from tests.helpers import save_tiny_chat_target

    target = save_tiny_chat_target(tmp_path / "target")
    results = tmp_path / "speed.json"
    args = ["--target", str(target), "--device", "cpu", "--prompts", "5", "--batch", "2"]
    assert regenerate_speed.main([*args, "--max-new-tokens", "3", "--results", str(results)]) == 0
    report = json.loads(results.read_text())
    assert report["prompts"] == 5 and list(report["caches"]) == ["dynamic", "static", "static_eager"]
    for facts in report["caches"].values():
        assert facts["same_ids_as_first"] and facts["rows_differing_from_first"] == 0
        assert 0 < facts["new_tokens"] <= 5 * 3 and facts["ms_per_decode_step"] > 0


def test_the_real_model_shell_drivers_parse_and_pass_only_flags_the_bench_takes() -> None:
    """bench/real_model_{screen,headline}.sh run on a GPU host, where a typo costs a lease: each is valid bash,
    and every flag it passes is one of bench/real_model.py's."""
    from bench.real_model import build_parser

    options = set(re.findall(r"--[a-z][a-z0-9-]*", build_parser().format_help()))
    scripts = sorted((REPO / "bench").glob("real_model_*.sh"))
    assert {p.name for p in scripts} >= {"real_model_screen.sh", "real_model_headline.sh"}
    for script in scripts:
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{script.name}: {syntax.stderr}"
        code = "\n".join(line.split("#", 1)[0] for line in script.read_text().splitlines())
        flags = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", code))
        assert flags and flags <= options, f"{script.name}: {sorted(flags - options)}"


def test_the_extraction_dtype_bench_writes_both_dtypes_side_by_side(tmp_path: Path) -> None:
    """bench/extract_dtypes.py at a tiny CPU size: each dtype extracted from the same batches, FP8 at about
    half of bfloat16's bytes a token, whichever side quantised it."""
    out = tmp_path / "extract.json"
    argv = ["--hidden", "64", "--layers", "8", "--vocab", "512", "--sequences", "4", "--min-len", "20",
            "--max-len", "60", "--rounds", "1", "--out", str(out)]  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-m", "bench.extract_dtypes", *argv], cwd=REPO, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    by_dtype = json.loads(out.read_text())["by_dtype"]
    assert set(by_dtype) == {"bfloat16", "fp8_e4m3", "fp8_e4m3@writer"}
    # quantised on the target's device or in the writer's threads: the same shard, byte for byte
    assert by_dtype["fp8_e4m3"]["shard_sha256"] == by_dtype["fp8_e4m3@writer"]["shard_sha256"]
    ratio = by_dtype["fp8_e4m3"]["shard_bytes_per_token"] / by_dtype["bfloat16"]["shard_bytes_per_token"]
    assert 0.45 < ratio < 0.7 and all(d["extract_tokens_per_s"] > 0 for d in by_dtype.values())


def test_the_muon_step_bench_times_both_optimizers_on_two_ranks_and_they_end_on_the_same_weights(
    tmp_path: Path,
) -> None:
    """bench/muon_step.py at a tiny width (the recorded figures are at hidden 1024): two gloo ranks under
    torchrun, both optimizers timed, the ratio and the weights' equality recorded."""
    from bench import muon_step

    out = tmp_path / "muon_step.json"
    assert muon_step.main(["--hidden", "128", "--steps", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["ranks"] == 2 and results["weights_equal"] is True
    assert len(results["matrices"]) == 8  # fc, q, k, v, o, gate, up, down
    assert set(results["median_step_seconds"]) == {"torch.optim.Muon", "DistributedMuon"}
    seconds = results["median_step_seconds"]
    assert results["torch_over_distributed"] == round(
        seconds["torch.optim.Muon"] / seconds["DistributedMuon"], 3
    )
