"""On-policy refinement on the toy target, as a user runs it (`eagle3 rollout`, `eagle3 refine`): record shards of
the training prompts rolled out with the offline drafter, their states the target's own forward, a kill in the
middle of a rollout leaving no record half-written and the next run finishing with exactly the records an
uninterrupted run makes, and a refinement round trained from the offline drafter on records and offline shards,
which export then publishes. Assertions hold whatever the toy decodes: they compare records with the target's
forward over the same tokens, two runs of the same rollouts, and ids and counts the pipeline fixes."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import dagster as dg
import pytest
import torch

from eagle3_cli.steps import main as eagle3
from eagle3_core.config import load_config
from eagle3_core.data.ingest import load_conversation_shard
from eagle3_core.steps.drafter import latest_final, offline_final
from eagle3_core.steps.onpolicy import refine_step
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import DrafterRefined, RunSummary
from eagle3_core.store.shards import ShardReader
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.train.data import is_validation
from eagle3_core.train.rollout_labels import NOT_DRAFTED, REJECTED, draft_steps
from eagle3_core.train.run_dir import SUMMARY
from tests.conftest import extracted_and_trained
from tests.kill import eagle3_on_one_thread, hidden_leftovers, run_killed_at_nth_call

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROLLOUT_TOKENS = 16  # onpolicy.max_new_tokens: a rollout records 1 to this many new tokens a prompt
ONPOLICY = (
    "onpolicy: {enabled: true, k: 3, temperature: 0.8, batch_size: 8, "
    f"max_new_tokens: {ROLLOUT_TOKENS}, epochs: 1}}\n"
)
PROBE = "al_every: 10, al_prompts: 4, al_confirm_prompts: 0, al_max_new_tokens: 16, al_overhead: null"


def _config(project: Path, target: Path) -> Path:
    text = (
        "store: store\ndata: {dataset: t, holdout_fraction: 0.1, shard_size: 30, "
        "sources: [{kind: chitchat, limit: 60}]}\n"
        f"target: {{path: {target}}}\nregenerate: {{max_new_tokens: 16, max_turns: 1, batch_size: 32}}\n"
        "tokenize: {max_seq_len: 256}\nextract: {store_dtype: float32}\n"
        "train: {draft_vocab_size: 256, batch_tokens: 1024, max_len: 128, epochs: 2, max_steps: 20, lr: 0.003, "
        f"log_every: 5, eval_every: 100, checkpoint_every: 100, val_fraction: 0.1, seed: 3, {PROBE}}}\n"
        "evaluate: {ks: [3], gate_k: 3, max_prompts: 4, per_conversation: 1, max_new_tokens: 16}\n" + ONPOLICY
    )
    project.mkdir(parents=True, exist_ok=True)
    (project / "eagle3.yaml").write_text(text)
    return project / "eagle3.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, toy_target_dir: Path) -> Path:
    """The toy's own replies extracted (two shards) and an offline drafter trained on them; nothing rolled out."""
    project = tmp_path_factory.mktemp("onpolicy") / "trained"
    extracted_and_trained(_config(project, toy_target_dir), toy_target_dir)
    return project


@pytest.fixture(scope="module")
def rolled_out(trained: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of `trained` whose shards were rolled out by `eagle3 rollout`, uninterrupted."""
    project = tmp_path_factory.mktemp("onpolicy") / "rolled"
    shutil.copytree(trained, project, symlinks=True)
    assert eagle3(["--config", str(project / "eagle3.yaml"), "rollout"]) == 0
    return project


def _records(project: Path) -> dict[str, list[tuple[str, list[int], list[int], torch.Tensor]]]:
    """Each record shard's samples: (id, input ids, loss mask, aux states)."""
    cfg = load_config(project / "eagle3.yaml")
    layout = StoreLayout(cfg.store_root)
    run = RunSummary.read(offline_final(layout) / SUMMARY).run
    out = {}
    for path in layout.onpolicy_record_shards(run):
        with ShardReader(path) as reader:
            out[path.stem] = [
                (s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist(), s.aux_hidden_states) for s in reader
            ]
    return out


def test_each_training_prompt_is_rolled_out_once_and_recorded_as_the_target_computes_it(
    rolled_out: Path, toy_target_dir: Path
) -> None:
    cfg = load_config(rolled_out / "eagle3.yaml")
    layout = StoreLayout(cfg.store_root)
    keys = [p.stem for p in layout.hidden_state_shards()]
    run = RunSummary.read(offline_final(layout) / SUMMARY).run
    assert [p.stem for p in layout.onpolicy_record_shards(run)] == keys and len(keys) == 2
    target = TransformersTarget(toy_target_dir, cfg.target)
    for key in keys:
        conversations, _ = load_conversation_shard(cfg.store_root, key)
        wanted = [
            f"{c.id}~p0.0" for c in conversations if c.split == "train" and not is_validation(c.id, 0.1)
        ]
        with ShardReader(layout.onpolicy_records(run, key)) as reader:
            facts = reader.meta.rollout
            assert (
                facts is not None and facts.drafter_run == run and facts.k == 3 and facts.temperature == 0.8
            )
            assert reader.sample_ids == wanted  # every training prompt once, in the shard's order
            for j, sample in enumerate(reader):
                ids = sample.input_ids.long()
                prompt = facts.prompt_lengths[j]
                assert sample.loss_mask.tolist() == [0] * prompt + [1] * (len(ids) - prompt)
                reply = len(ids) - prompt  # what the rollout decoded: at least one token, at most its budget
                assert reply >= 1 and reply <= ROLLOUT_TOKENS, (j, reply)
                labels = draft_steps(prompt, facts.verified[j], len(ids), facts.k)
                assert (labels[: prompt + 1] == NOT_DRAFTED).all()
                accepted = int(((labels >= 0) & (labels < REJECTED)).sum())
                assert accepted == _accepted_tokens(facts.verified[j], len(ids) - prompt)
                if j < 4:  # the states: the target's own forward over the recorded tokens
                    with torch.no_grad():
                        out = target.model(input_ids=ids[None], output_hidden_states=True)
                    aux = torch.cat([out.hidden_states[k][0] for k in target.info.aux_layer_ids], dim=-1)
                    torch.testing.assert_close(sample.aux_hidden_states, aux, rtol=1e-4, atol=1e-4)
                    torch.testing.assert_close(
                        sample.last_hidden_states, out.hidden_states[-1][0], rtol=1e-4, atol=1e-4
                    )
    target.close()
    # a second run finds every shard recorded with these settings and rolls nothing out
    before = {p: p.stat().st_mtime_ns for p in layout.onpolicy_record_shards(run)}
    assert eagle3(["--config", str(rolled_out / "eagle3.yaml"), "rollout"]) == 0
    assert {p: p.stat().st_mtime_ns for p in layout.onpolicy_record_shards(run)} == before


def _accepted_tokens(verified: list[int], reply: int) -> int:
    """Reply tokens that were accepted drafts: each round commits its a accepted drafts and one token of the
    target's, the first reply token comes from the prefill, and the reply's end may cut the last round."""
    left, count = reply - 1, 0
    for a in verified:
        take = min(a + 1, left)
        count, left = count + min(a, take), left - take
    assert left == 0
    return count


def test_a_rollout_killed_mid_shard_leaves_no_record_and_the_next_run_makes_exactly_the_same_records(
    trained: Path, rolled_out: Path, tmp_path: Path
) -> None:
    project = tmp_path / "killed"
    shutil.copytree(trained, project, symlinks=True)
    config = str(project / "eagle3.yaml")
    # shard 1 is rolled out in batches of 8: the kill lands in its second batch, after the first finished
    code = run_killed_at_nth_call(
        "eagle3_core.evaluate.rollout:rollout", 2, eagle3_on_one_thread, "--config", config, "rollout"
    )
    assert code == -signal.SIGKILL
    assert _records(project) == {}  # the shard in progress is not there at all, nor half of it
    assert not [p for p in hidden_leftovers(project / "store") if "onpolicy" in p]
    assert eagle3(["--config", config, "rollout"]) == 0
    resumed, whole = _records(project), _records(rolled_out)
    assert resumed.keys() == whole.keys()
    for key in whole:
        assert [r[:3] for r in resumed[key]] == [r[:3] for r in whole[key]]  # no sample lost or twice
        for a, b in zip(resumed[key], whole[key], strict=True):
            assert torch.equal(a[3], b[3])


def test_a_refinement_round_trains_from_the_offline_drafter_on_records_and_offline_shards(
    rolled_out: Path,
) -> None:
    cfg = load_config(rolled_out / "eagle3.yaml")
    layout = StoreLayout(cfg.store_root)
    base = RunSummary.read(offline_final(layout) / SUMMARY)
    assert eagle3(["--config", str(rolled_out / "eagle3.yaml"), "refine"]) == 0
    refined = DrafterRefined.read(layout.drafter_refined)
    [round_one] = refined.rounds
    assert refined.base_run == base.run and round_one.rollout_run == base.run
    run = RunSummary.read(layout.drafter_runs / round_one.run / "final" / SUMMARY)
    assert run.warm_from == base.run
    records = sum(len(v) for v in _records(rolled_out).values())
    assert round_one.record_samples == records > 0
    assert (
        run.train_samples == base.train_samples + records
    )  # the mix: every record trains, beside the offline
    assert round_one.al_start is not None  # the drafter it started from was measured, as a candidate
    chosen = layout.drafter_runs / refined.run / "final"
    assert latest_final(layout) == chosen  # what export publishes
    # a second refinement finds the round's run finished and records the same drafter
    assert refine_step(cfg, log=lambda _: None).path == chosen
    # turned off, the pointer goes and the offline drafter is the newest again; `eagle3 refine` says why not
    off = cfg.model_copy(update={"onpolicy": cfg.onpolicy.model_copy(update={"enabled": False})})
    assert refine_step(off, log=lambda _: None).metadata["enabled"] is False
    assert not layout.drafter_refined.exists() and latest_final(layout) == offline_final(layout)
    text = (rolled_out / "eagle3.yaml").read_text().replace("enabled: true", "enabled: false")
    (rolled_out / "off.yaml").write_text(text)
    assert eagle3(["--config", str(rolled_out / "off.yaml"), "refine"]) == 2


def test_through_dagster_a_partition_rolled_out_first_is_kept_and_refinement_reports_the_rest(
    trained: Path, tmp_path: Path, instance: dg.DagsterInstance
) -> None:
    from eagle3_dagster.defs.onpolicy.assets import drafter_refined, onpolicy_records
    from eagle3_dagster.defs.resources import Eagle3Resource, TargetResource

    project = tmp_path / "dagster"
    shutil.copytree(trained, project, symlinks=True)
    config = project / "eagle3.yaml"
    cfg = load_config(config)
    keys = [p.stem for p in StoreLayout(cfg.store_root).hidden_state_shards()]
    instance.add_dynamic_partitions("shards", keys)
    eagle3_resource = Eagle3Resource(config_path=str(config))
    resources = {"eagle3": eagle3_resource, "target": TargetResource(eagle3=eagle3_resource)}
    first = dg.materialize([onpolicy_records], partition_key=keys[0], instance=instance, resources=resources)
    assert first.success
    [event] = first.get_asset_materialization_events()
    assert event.materialization.metadata["skipped"].value is False
    result = dg.materialize([drafter_refined], instance=instance, resources=resources)
    assert result.success
    # the refinement rolled out only the shard that was missing, and reported it as that partition's records
    reported = instance.fetch_materializations(onpolicy_records.key, limit=10).records
    assert sorted(r.partition_key for r in reported if r.partition_key) == sorted(keys)
    made_by_refined = [r for r in reported if r.run_id == result.run_id]
    assert [r.partition_key for r in made_by_refined] == keys[1:]
    [refined] = [e for e in result.get_asset_materialization_events() if e.asset_key == drafter_refined.key]
    assert refined.materialization.metadata["rounds"].value == 1
    assert DrafterRefined.read(StoreLayout(cfg.store_root).drafter_refined).rounds[0].record_shards == 2
