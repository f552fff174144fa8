"""drafter_eval on a real trained and exported drafter of the toy target: lossless greedy decoding, measured
acceptance, the pictures, and the promotion gate through Dagster (worse refused, better promoted)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from safetensors.torch import load_file, save_file

from eagle3_core.config import Eagle3Config, load_config
from eagle3_core.data.ingest import ingest, load_conversation_shard
from eagle3_core.evaluate.measure import DecodeSettings, measure
from eagle3_core.evaluate.prompts import encode, heldout_prompts
from eagle3_core.steps.common import StepResult
from eagle3_core.steps.data import extract_step
from eagle3_core.steps.drafter import drafter_checkpoint_step, export_step, vocab_step
from eagle3_core.steps.evaluation import eval_step, load_exported, load_target, read_current, report_file
from eagle3_core.store.layout import StoreLayout
from eagle3_core.targets.hf import TransformersTarget
from tests.conftest import FIXTURES, extracted_and_trained

# the toy target and drafter decode one prompt at a time: ops small enough that a second thread only waits
pytestmark = pytest.mark.usefixtures("one_torch_thread")

EVALUATE = "evaluate: {ks: [1, 3], gate_k: 3, max_prompts: 6, per_conversation: 1, max_new_tokens: 24}\n"


def _config(project: Path, target: Path, *, steps: int, name: str = "eagle3.yaml") -> Path:
    text = (
        f"store: store\ndata: {{dataset: t, holdout_fraction: 0.1, shard_size: 100, sources: [{{kind: chitchat, limit: 200}}]}}\n"
        f"target: {{path: {target}}}\nregenerate: {{max_new_tokens: 32, max_turns: 2, batch_size: 64}}\n"
        f"tokenize: {{max_seq_len: 512}}\nextract: {{store_dtype: float32}}\n"
        f"train: {{draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, epochs: 4, max_steps: {steps}, lr: 0.003, "
        f"log_every: 5, eval_every: 100, checkpoint_every: 100, val_fraction: 0.1, seed: 3}}\n" + EVALUATE
    )
    project.mkdir(parents=True, exist_ok=True)
    (project / name).write_text(text)
    return project / name


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, toy_target_dir: Path) -> Path:
    """A store of the toy target's own greedy replies (extracted), a drafter trained on it, and its exports."""
    project = tmp_path_factory.mktemp("evaluate") / "project"
    cfg = extracted_and_trained(_config(project, toy_target_dir, steps=40), toy_target_dir)
    export_step(cfg)
    return project


def _with_prompt_file(cfg: Eagle3Config) -> Eagle3Config:
    files = [str(FIXTURES / "prompts.jsonl")]
    return cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={"prompt_files": files})})


@pytest.fixture(scope="module")
def evaluated(project: Path) -> StepResult:
    """The sglang export measured once, on the held-out prompts and the prompt file."""
    return eval_step(_with_prompt_file(load_config(project / "eagle3.yaml")))


def test_the_export_decodes_the_targets_greedy_output_and_its_acceptance_is_measured(
    evaluated: StepResult,
) -> None:
    result = evaluated
    report = json.loads(report_file(result.path, "sglang").read_text())
    heldout, from_file = report["sets"]["heldout"], report["sets"]["prompts"]
    assert heldout["prompts"] == 6 and from_file["prompts"] == 4
    categories = from_file["by_category"]  # rows 1 (writing), 2 and 4 (chat) carry a category; 3 none
    assert {c: v["3"]["prompts"] for c, v in categories.items()} == {"chat": 2, "writing": 1}
    assert "by_category" not in heldout
    runs = from_file["by_k"]["3"]["per_prompt"]  # prompts in file order: chat is the 2nd and 4th usable row
    chat = [runs[1], runs[3]]
    assert [r["id"] for r in chat] == ["prompts.jsonl:2", "prompts.jsonl:4"]
    assert {r["category"] for r in chat} == {"chat"}
    expected = 1 + sum(r["accepted"] for r in chat) / sum(r["rounds"] for r in chat)
    assert categories["chat"]["3"]["acceptance_length"] == pytest.approx(expected, abs=1e-4)
    assert from_file["rejected"] == {
        "malformed_json": 1,
        "unknown_role": 1,
        "empty_content": 1,
        "wrong_shape": 1,
    }
    for measured in (heldout, from_file):
        for k, r in measured["by_k"].items():
            assert r["greedy_mismatches"] == 0  # lossless on every prompt, at every K
            assert abs(sum(r["per_position"]) - (r["acceptance_length"] - 1)) < 1e-3
            assert r["acceptance_rate"] == pytest.approx((r["acceptance_length"] - 1) / int(k), abs=1e-3)
            assert r["tokens_per_s"] > 0 and r["speedup"] > 0
    assert heldout["by_k"]["3"]["acceptance_length"] > 1.3  # a trained drafter is accepted often
    assert report["tau"]["3"] is not None and report["tau"]["1"] is not None
    for picture in report["pictures"].values():
        assert Path(picture).read_bytes()[:4] == b"\x89PNG"
    meta = result.metadata
    assert meta["target_step"] == "eager"  # auto, on a CPU
    assert meta["al_k3"] == heldout["by_k"]["3"]["acceptance_length"]
    assert meta["greedy_mismatches_k3"] == 0
    assert report["gate"]["passed"] and report["gate"]["reason"] == "no drafter is promoted yet"


def test_the_evaluation_writes_its_serving_recommendation_beside_the_report(evaluated: StepResult) -> None:
    from eagle3_core.evaluate.serving_k import (
        recommend,
        serving_file,
        sglang_adaptive_config,
        sglang_config_file,
    )
    from eagle3_core.store.records import EvalReport, ServingRecommendation

    report = evaluated.record_as(EvalReport)
    written = ServingRecommendation.read(serving_file(evaluated.path, "sglang"))
    assert written == evaluated.extra_record(ServingRecommendation)
    # the acceptance the report measured at the largest K, on the prompts the gate compares
    assert (written.prompt_set, written.measured_k, written.device) == ("heldout", 3, "cpu")
    assert written.per_position == report.sets["heldout"].at(3).per_position
    # the costs timed at the default batch sizes, one width a K and the plain step; the K is the maths' choice
    assert written.unmeasured is None and [c.batch_size for c in written.costs] == [1, 4, 16, 64]
    assert all(len(c.target_s) == 4 for c in written.costs)
    assert written.by_batch == recommend(written.per_position, written.costs)
    table = json.loads(sglang_config_file(evaluated.path, "sglang").read_text())
    assert table == sglang_adaptive_config(written)
    assert Path(report.pictures["serving"]).read_bytes()[:4] == b"\x89PNG"
    assert {evaluated.metadata[f"serving_k_b{b}"] for b in (1, 4, 16, 64)} <= set(range(4))


def test_each_export_format_is_measured_into_its_own_report(project: Path, evaluated: StepResult) -> None:
    cfg = _with_prompt_file(load_config(project / "eagle3.yaml"))
    first = evaluated
    sglang = report_file(first.path, "sglang")
    before = sglang.read_bytes()
    # the second format measured with the target's step as an engine computes it (evaluate.target_step)
    evaluate = cfg.evaluate.model_copy(update={"export_format": "speculators", "target_step": "graphed"})
    eval_step(cfg.model_copy(update={"evaluate": evaluate}))
    speculators = json.loads(report_file(first.path, "speculators").read_text())
    assert speculators["format"] == "speculators" and json.loads(before)["format"] == "sglang"
    assert (speculators["target_step"], json.loads(before)["target_step"]) == ("graphed", "eager")
    assert speculators["settings"]["graphed_target"] and not json.loads(before)["settings"]["graphed_target"]
    assert sglang.read_bytes() == before  # measuring the second format left the first one's report alone
    # one drafter in two formats is one network, and either target step is the target's own: the same rounds,
    # prompt by prompt
    a = json.loads(before)["sets"]["heldout"]["by_k"]["3"]["per_prompt"]
    b = speculators["sets"]["heldout"]["by_k"]["3"]["per_prompt"]
    assert [(r["id"], r["accepted"], r["rounds"]) for r in a] == [
        (r["id"], r["accepted"], r["rounds"]) for r in b
    ]


def _eagle3(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "eagle3_cli.steps", "--config", str(project / "eagle3.yaml"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as in this process (one_torch_thread)
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def test_eval_drafter_measures_a_directory_from_elsewhere_on_a_prompt_file(
    project: Path, evaluated: StepResult, tmp_path: Path
) -> None:
    """`eagle3 eval --drafter DIR --prompts FILE`: another trainer's drafter (our speculators export without our
    provenance block) measured by the real CLI gives, prompt by prompt, the pipeline's own measurement."""
    cfg = load_config(project / "eagle3.yaml")
    [run] = list(StoreLayout(cfg.store_root).exports.iterdir())
    external = tmp_path / "someone-elses-drafter"
    shutil.copytree(run / "speculators", external)
    config = json.loads((external / "config.json").read_text())
    del config["eagle3_export"]
    (external / "config.json").write_text(json.dumps(config))
    prompts = FIXTURES / "prompts.jsonl"
    done = _eagle3(project, "eval", "--drafter", str(external), "--prompts", str(prompts))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "K=3: AL" in done.stdout
    out = StoreLayout(cfg.store_root).drafter_dir_eval(external)
    [first] = out.glob("report-*.json")
    report = json.loads(first.read_text())
    assert list(report["sets"]) == ["prompts"] and report["format"] == "speculators"
    assert report["variant"]["norm_before_residual"] is False
    ours = json.loads(report_file(evaluated.path, "sglang").read_text())["sets"]["prompts"]["by_k"]["3"]
    theirs = report["sets"]["prompts"]["by_k"]["3"]
    assert [(r["id"], r["accepted"], r["rounds"]) for r in theirs["per_prompt"]] == [
        (r["id"], r["accepted"], r["rounds"]) for r in ours["per_prompt"]
    ]
    refused = _eagle3(project, "eval", "--drafter", str(tmp_path))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "config.json" in refused.stdout

    # A second prompt set is measured into a report of its own; the first one's is kept as it was.
    before = first.read_bytes()
    other = tmp_path / "chat.jsonl"
    other.write_text("".join(line for line in prompts.read_text().splitlines(True) if '"chat"' in line))
    second = _eagle3(project, "eval", "--drafter", str(external), "--prompts", str(other))
    assert second.returncode == 0, second.stdout + second.stderr
    assert first.read_bytes() == before
    measured = {name: p for p in out.glob("report-*.json") for name in json.loads(p.read_text())["sets"]}
    assert measured == {"prompts": first, "chat": report_file(out, "speculators", other)}
    assert f"kept: {first.name} (speculators): prompts AL " in second.stdout  # the CLI names what is kept


def test_a_drafter_that_is_almost_always_rejected_still_gives_the_targets_output(
    project: Path, toy_target_dir: Path, tmp_path: Path
) -> None:
    cfg = load_config(project / "eagle3.yaml")
    [run] = list(StoreLayout(cfg.store_root).exports.iterdir())
    bad = tmp_path / "bad"
    shutil.copytree(run / "sglang", bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["lm_head.weight"] = (
        weights["lm_head.weight"].roll(7, dims=0).contiguous()
    )  # every draft a wrong id
    save_file(weights, str(bad / "model.safetensors"))
    target = load_target(cfg, lambda _: None)
    drafter, d2t = load_exported(bad, "sglang", target)
    prompts = heldout_prompts(cfg.store_root, per_conversation=1, limit=6)
    ids = [encode(target.tokenizer, p.messages) for p in prompts.prompts]
    m = measure(
        target.model, drafter, d2t, target.aux_layer_ids, ids, target.eos_ids, DecodeSettings((3,), 24)
    )
    assert m.greedy_mismatches == {3: 0}
    assert m.acceptance[3].acceptance_length < 1.15
    assert m.acceptance[3].rounds >= m.speculative(3).tokens - 6 * 2  # nearly one round per token


def _run_gate(config: Path) -> dg.ExecuteInProcessResult:
    from eagle3_dagster.defs.drafter.assets import drafter_checkpoint, drafter_export, vocab_mapping
    from eagle3_dagster.defs.evaluation.assets import drafter_current, drafter_eval, not_worse_than_current
    from eagle3_dagster.defs.onpolicy.assets import drafter_refined
    from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource
    from eagle3_dagster.materialize import SHARD_ASSETS

    resource = Eagle3Resource(config_path=str(config))
    return dg.materialize(
        [
            *SHARD_ASSETS,
            vocab_mapping,
            drafter_checkpoint,
            drafter_refined,
            drafter_export,
            drafter_eval,
            drafter_current,
            not_worse_than_current,
        ],
        selection=[drafter_eval, drafter_current],
        instance=dg.DagsterInstance.ephemeral(),
        resources={"eagle3": resource, "target": TargetResource(eagle3=resource)},
        raise_on_error=False,
    )


def _latest(config: Path) -> str:
    cfg = load_config(config)
    drafter_checkpoint_step(
        cfg, log=lambda _: None
    )  # a finished run is returned, not retrained, and becomes the latest
    return str(export_step(cfg).metadata["run"])


def test_the_gate_promotes_a_better_drafter_and_refuses_a_worse_one(
    project: Path, toy_target_dir: Path
) -> None:
    good_config = project / "eagle3.yaml"
    worse_config = _config(project, toy_target_dir, steps=1, name="worse.yaml")
    layout = StoreLayout(load_config(good_config).store_root)
    if layout.drafter_current.exists():
        layout.drafter_current.unlink()

    worse = _latest(worse_config)  # nothing promoted yet: the first evaluated drafter is promoted
    first = _run_gate(worse_config)
    assert first.success
    assert read_current(layout).run == worse  # type: ignore[union-attr]

    good = _latest(good_config)  # better: measured against the promoted one on the same prompts, promoted
    second = _run_gate(good_config)
    assert second.success
    [check] = second.get_asset_check_evaluations()
    assert check.passed
    assert check.metadata["candidate_al"].value > check.metadata["current_al"].value
    assert check.metadata["current_run"].value == worse
    assert read_current(layout).run == good  # type: ignore[union-attr]
    assert (layout.drafter_current_link / "sglang" / "config.json").exists()

    assert _latest(worse_config) == worse  # worse again: refused, and `current` stays where it was
    third = _run_gate(worse_config)
    assert not third.success
    [check] = third.get_asset_check_evaluations()
    assert not check.passed
    assert check.metadata["candidate_run"].value == worse and check.metadata["current_run"].value == good
    assert check.metadata["candidate_al"].value < check.metadata["current_al"].value - 0.05
    materialized = {e.asset_key.path[-1] for e in third.get_asset_materialization_events()}
    assert materialized == {"drafter_eval"}  # drafter_current did not run
    assert read_current(layout).run == good  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def small_project(tmp_path_factory: pytest.TempPathFactory, toy_target_dir: Path) -> Path:
    """A few dozen conversations at the default data.holdout_fraction 0.02, which holds none of them out (by
    sample id), and a drafter trained on them a few steps and exported."""
    project = tmp_path_factory.mktemp("small") / "project"
    project.mkdir()
    (project / "eagle3.yaml").write_text(
        "store: store\ndata: {dataset: t, shard_size: 100, sources: [{kind: chitchat, limit: 40}]}\n"
        f"target: {{path: {toy_target_dir}}}\nregenerate: {{enabled: false}}\ntokenize: {{max_seq_len: 512}}\n"
        "train: {draft_vocab_size: 512, batch_tokens: 2048, max_len: 256, max_steps: 3, log_every: 1, "
        "eval_every: 100, checkpoint_every: 100, val_fraction: 0.1}\n" + EVALUATE
    )
    cfg = load_config(project / "eagle3.yaml")
    assert cfg.data.holdout_fraction == 0.02  # the default
    target = TransformersTarget(toy_target_dir, cfg.target)
    for key in ingest(cfg).all_shards:
        extract_step(cfg, key, target)
    target.close()
    vocab_step(cfg)
    drafter_checkpoint_step(cfg, log=lambda _: None)
    export_step(cfg)
    return project


def test_eval_says_how_many_conversations_are_held_out_and_measures_a_prompt_file_without_drafter(
    small_project: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`eagle3 eval` on a store that held none of its conversations out says so at the fraction it used (not
    that the fraction is 0); `eagle3 eval --prompts FILE` then measures the run's newest export on that file
    (the real command in a process of its own; the refusals through its main, in this process)."""
    from eagle3_cli.steps import main

    cfg = load_config(small_project / "eagle3.yaml")
    [(samples, _)] = [load_conversation_shard(cfg.store_root, key) for key in ingest(cfg).all_shards]
    assert len(samples) > 20 and all(s.split == "train" for s in samples)
    capsys.readouterr()
    assert main(["--config", str(small_project / "eagle3.yaml"), "eval"]) == 2
    refused = " ".join(capsys.readouterr().out.split())  # one line, whatever the console's width
    assert refused.startswith("error: ") and refused.count("error: ") == 1
    assert f"0 of {len(samples)} conversations are held out at data.holdout_fraction 0.02" in refused
    assert "eagle3 eval --prompts FILE" in refused

    prompts = FIXTURES / "prompts.jsonl"
    done = _eagle3(small_project, "eval", "--prompts", str(prompts))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "K=3: AL" in done.stdout
    layout = StoreLayout(cfg.store_root)
    [run] = [p.name for p in layout.exports.iterdir()]
    report = json.loads(report_file(layout.export_eval(run), "sglang", prompts).read_text())
    assert report["run"] == run and list(report["sets"]) == ["prompts"]
    assert report["sets"]["prompts"]["prompts"] == 4  # the file's usable rows
    assert report["sets"]["prompts"]["by_k"]["3"]["greedy_mismatches"] == 0  # the export, decoding losslessly
    assert not report_file(layout.export_eval(run), "sglang").exists()  # the gate's report: not this one

    assert (
        main(["--config", str(small_project / "eagle3.yaml"), "eval", "--prompts", str(prompts), "--promote"])
        == 2
    )
    assert "a --prompts file is only measured" in capsys.readouterr().out
