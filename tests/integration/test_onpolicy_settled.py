"""On-policy refinement of a drafter that already accepts every draft leaves it as it is.

The target is the toy made constant: every layer adds nothing (o_proj and down_proj zero) and every token
embeds alike, so its distribution is the same at every position, peaked on one token (lm_head's row for it
alone), whatever the input. A drafter trained on it proposes that token and the target accepts every draft:
AL K+1. Its rollouts then reject nothing, the refinement trains nothing and keeps the drafter's weights to the
bit; and a round trained on those records anyway, errors weighted, still accepts every draft.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_core.config import RecordLoss, load_config
from eagle3_core.data.ingest import ingest
from eagle3_core.evaluate.batched import speculative_generate_batch
from eagle3_core.evaluate.prompts import encode, heldout_prompts
from eagle3_core.steps.data import extract_step
from eagle3_core.steps.drafter import drafter_checkpoint_step, offline_final, shards_and_mapping, vocab_step
from eagle3_core.steps.onpolicy import refine_step
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import DrafterRefined, RunSummary
from eagle3_core.store.shards import read_shard_header
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.targets.regenerate import eos_token_ids
from eagle3_core.targets.resolve import target_dir
from eagle3_core.train.run_dir import SUMMARY, load_trained
from eagle3_core.train.trainer import train_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CONSTANT = 100  # the token the constant target always says (not an end of turn)
K = 3


def _constant_target(toy: Path, out: Path) -> Path:
    shutil.copytree(toy, out)
    weights = load_file(str(out / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)  # every layer adds nothing to the residual stream
    embed = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = embed[CONSTANT].expand_as(embed).clone()  # every token alike
    head = torch.zeros_like(weights["lm_head.weight"])
    normed = (
        embed[CONSTANT] * torch.rsqrt(embed[CONSTANT].pow(2).mean() + 1e-6) * weights["model.norm.weight"]
    )
    head[CONSTANT] = 20.0 * normed / normed.pow(2).sum()  # logit 20 for CONSTANT, 0 for every other token
    weights["lm_head.weight"] = head
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, toy_target_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("settled")
    target = _constant_target(toy_target_dir, root / "constant")
    config = root / "project" / "eagle3.yaml"
    config.parent.mkdir()
    config.write_text(
        "store: store\ndata: {dataset: c, holdout_fraction: 0.2, shard_size: 40, "
        "sources: [{kind: chitchat, limit: 40}]}\n"
        f"target: {{path: {target}}}\nregenerate: {{enabled: false}}\n"
        "tokenize: {max_seq_len: 256}\nextract: {store_dtype: float32}\n"
        "train: {draft_vocab_size: 4096, batch_tokens: 1024, max_len: 128, epochs: 4, max_steps: 30, lr: 0.01, "
        "log_every: 10, eval_every: 100, checkpoint_every: 100, val_fraction: 0.1, seed: 1, al_every: 15, "
        "al_prompts: 4, al_confirm_prompts: 0, al_max_new_tokens: 12, al_overhead: null}\n"
        f"evaluate: {{ks: [{K}], gate_k: {K}, max_prompts: 4, per_conversation: 1, max_new_tokens: 12}}\n"
        f"onpolicy: {{enabled: true, k: {K}, temperature: 0.8, batch_size: 16, max_new_tokens: 12, epochs: 1}}\n"
    )
    cfg = load_config(config)
    loaded = TransformersTarget(target_dir(cfg), cfg.target)
    for key in ingest(cfg).all_shards:
        extract_step(cfg, key, loaded)
    loaded.close()
    vocab_step(cfg)
    drafter_checkpoint_step(cfg, log=lambda _: None)
    return config.parent


def _every_draft_accepted(project: Path, final: Path) -> bool:
    """Whether the target accepted every draft of `final`'s drafter in every round on the held-out prompts
    (greedy, K drafts a round; a round cut by the token budget still verified all K)."""
    cfg = load_config(project / "eagle3.yaml")
    target = TransformersTarget(target_dir(cfg), cfg.target)
    drafter, mapping, _ = load_trained(final, target.model.get_input_embeddings().weight.detach().float())
    prompts = heldout_prompts(cfg.store_root, per_conversation=1, limit=4).prompts
    ids = [encode(target.tokenizer, p.messages) for p in prompts]
    eos = set(eos_token_ids(target.model, target.tokenizer))
    results = speculative_generate_batch(
        target.model, drafter.eval(), mapping.d2t, target.info.aux_layer_ids, ids, 12, K, eos
    )
    target.close()
    assert len(results) == 4 and all(r.verified for r in results)
    return all(v == K for r in results for v in r.verified)


def test_a_drafter_that_accepts_every_draft_is_left_as_it_is(project: Path) -> None:
    cfg = load_config(project / "eagle3.yaml")
    layout = StoreLayout(cfg.store_root)
    base = offline_final(layout)
    assert _every_draft_accepted(project, base)  # the premise
    before = load_file(str(base / "drafter.safetensors"))
    result = refine_step(cfg, log=lambda _: None)
    refined = DrafterRefined.read(layout.drafter_refined)
    assert refined.rounds == [] and "accepted every draft" in refined.stopped
    assert refined.run == RunSummary.read(base / SUMMARY).run and result.path == base
    after = load_file(str(base / "drafter.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    records = layout.onpolicy_record_shards(refined.run)
    assert records  # rolled out, and every round of every rollout accepted all K drafts:
    for path in records:
        facts = read_shard_header(path).rollout
        assert facts is not None and facts.verified and all(a == K for v in facts.verified for a in v)


def test_a_round_trained_on_its_records_anyway_still_accepts_every_draft(project: Path) -> None:
    cfg = load_config(project / "eagle3.yaml")
    layout = StoreLayout(cfg.store_root)
    base = offline_final(layout)
    offline, mapping = shards_and_mapping(cfg, layout, lambda _: None)
    records = layout.onpolicy_record_shards(RunSummary.read(base / SUMMARY).run)
    assert records, "run after the refinement test, which rolls out"
    train = cfg.train.model_copy(update={"epochs": 4, "max_steps": 10, "al_every": None})
    result = train_drafter(
        offline + records, target_dir(cfg), mapping, layout.drafter_runs, train, log=lambda _: None,
        init_from=base, records=RecordLoss(error_weight=4.0, positions="visited"),
    )  # fmt: skip
    assert result.steps == 10 and result.summary.train_samples > 0
    assert _every_draft_accepted(project, result.final_dir)
