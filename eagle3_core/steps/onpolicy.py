"""The on-policy domain's steps (docs/onpolicy.md): onpolicy_records, one conversation shard's training prompts
decoded with the offline drafter and recorded; drafter_refined, the drafter trained further on its records
mixed with the offline shards, in rounds.

    records  store/onpolicy/<drafter run>/<shard>.safetensors: a hidden-state shard (store/shards.py) whose
             samples are prompt + rollout reply, with the states of the forwards that verified the drafts and,
             in its header (RolloutFacts), the drafts each round accepted; written whole and atomically under
             the shard's writer lock, so a killed rollout leaves the shard absent and the next run makes it
             (no sample lost, none twice)
    refine   round r trains from round r-1's drafter (round 1: the offline one, drafter/latest.json) on the
             records of its rollouts, measuring the acceptance length as training does and keeping the best
             weights; the next round rolls out with what it kept, while a round keeps other weights than it
             started from. drafter/refined.json then names the drafter drafter_export publishes.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from eagle3_core.config import Eagle3Config
from eagle3_core.data.ingest import load_conversation_shard
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.errors import Eagle3Error
from eagle3_core.evaluate.prompts import encode
from eagle3_core.evaluate.rollout import Rollout, RolloutSettings, rollout
from eagle3_core.steps.common import Log, StepResult, quiet
from eagle3_core.steps.drafter import offline_final, shards_and_mapping
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.locks import writer_lock
from eagle3_core.store.records import (
    ALRow,
    ConversationRow,
    DrafterRefined,
    RefinementRound,
    RegeneratedRow,
    RolloutFacts,
    RunSummary,
    ShardFacts,
    ShardHeader,
    conversation_id,
    read_rows,
    regeneration_row,
)
from eagle3_core.store.shards import ShardWriter, read_shard_header
from eagle3_core.targets.graphed import TargetLayers, UnsupportedTargetError
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.targets.regenerate import eos_token_ids
from eagle3_core.train.data import is_validation
from eagle3_core.train.run_dir import SUMMARY, TrainResult, load_trained, read_metrics


@dataclass(frozen=True)
class RolloutPrompt:
    sample_id: str  # the record's: the conversation's id, the turn and the rollout
    ids: list[int]


def record_id(conversation_id: str, turn: int, sample: int) -> str:
    """A record sample's id: its conversation's, so that the training split keeps every record of a
    conversation on its side (train/data.py `is_validation` reads the part before `~`)."""
    return f"{conversation_id}~p{turn}.{sample}"


def rollout_prompts(cfg: Eagle3Config, key: str, tokenizer: Any) -> tuple[list[RolloutPrompt], Counter[str]]:
    """The prompts of shard `key`'s training conversations: each of their first onpolicy.turns user turns,
    with the turns before it as history (the target's own replies, where regeneration is on), onpolicy.samples
    times; a conversation in the training validation split is left out, as is a prompt that leaves no room
    for onpolicy.max_new_tokens within tokenize.max_seq_len (both counted)."""
    rows = _training_rows(cfg, key)
    room = cfg.tokenize.max_seq_len - rollout_budget(cfg)
    counts: Counter[str] = Counter()
    prompts = []
    for row in rows:
        if row.id != conversation_id(row.id):
            continue  # a further sampled reply to a conversation (regenerate.samples): the same prompts
        if is_validation(row.id, cfg.train.val_fraction):
            counts["validation_conversations"] += 1
            continue
        messages = [{"role": m.role, "content": m.content} for m in row.messages]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        for turn, end in enumerate(users[: cfg.onpolicy.turns]):
            ids = encode(tokenizer, messages[: end + 1])
            if len(ids) > room:
                counts["prompts_too_long"] += 1
                continue
            prompts += [RolloutPrompt(record_id(row.id, turn, s), ids) for s in range(cfg.onpolicy.samples)]
    return prompts, counts


def _training_rows(cfg: Eagle3Config, key: str) -> list[ConversationRow | RegeneratedRow]:
    """Shard `key`'s training conversations as extraction reads them: regenerated when regeneration is on."""
    if not cfg.regenerate.enabled:
        samples, _ = load_conversation_shard(cfg.store_root, key)
        return [s for s in samples if s.split == "train"]
    path = StoreLayout(cfg.store_root).regenerated(key)
    if not path.exists():
        raise Eagle3Error(f"{key}: no regenerated shard at {path}; materialize `regenerated` first")
    return [r for r in read_rows(path, regeneration_row) if isinstance(r, RegeneratedRow)]


def rollout_budget(cfg: Eagle3Config) -> int:
    return cfg.onpolicy.max_new_tokens or cfg.regenerate.max_new_tokens


def _seed(cfg: Eagle3Config, drafter_run: str, key: str) -> int:
    """The rollouts' sampling seed: fixed by onpolicy.seed, the drafter and the shard, so that a shard rolled
    out again (after a kill) samples what it would have."""
    text = f"{cfg.onpolicy.seed}:{drafter_run}:{key}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1


def file_digest(path: Path) -> str:
    """sha256 of a file, computed once per file version (its size and mtime): each shard's records check the
    drafter they were made with, and a drafter's weights are gigabytes at a large target's width."""
    stat = path.stat()
    return _digest_of(path.resolve(), stat.st_size, stat.st_mtime_ns)


@cache
def _digest_of(path: Path, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def records_step(
    cfg: Eagle3Config,
    key: str,
    target: TransformersTarget,
    log: Log = quiet,
    drafter_final: Path | None = None,
    round_number: int = 1,
) -> StepResult:
    """Shard `key`'s training prompts rolled out with the drafter of `drafter_final` (default: the newest
    offline run, drafter/latest.json) and recorded as an on-policy record shard; one already recorded with
    these settings is left as it is (`skipped`)."""
    layout = StoreLayout(cfg.store_root)
    final = drafter_final or offline_final(layout)
    expected = expected_rollout(cfg, final, key, round_number)
    path = layout.onpolicy_records(expected.drafter_run, key)
    with writer_lock(layout.writer_lock("onpolicy", key), f"on-policy records {key}"):
        if recorded(path, expected):
            return StepResult(key, path, {**_figures(read_shard_header(path)), "skipped": True})
        facts = _record_facts(cfg, key, target, expected)
        return _record(cfg, key, target, final, facts, path, log)


def expected_rollout(cfg: Eagle3Config, final: Path, key: str, round_number: int) -> RolloutFacts:
    """The rollout facts shard `key`'s records with `final`'s drafter would carry (their per-sample lists
    empty): the drafter, by run and weights digest, and the settings."""
    run = RunSummary.read(final / SUMMARY).run
    o = cfg.onpolicy
    return RolloutFacts(
        drafter_run=run, drafter_digest=file_digest(final / "drafter.safetensors"), round=round_number, k=o.k,
        temperature=o.temperature, max_new_tokens=rollout_budget(cfg), seed=_seed(cfg, run, key),
        prompt_lengths=[], verified=[],
    )  # fmt: skip


def recorded(path: Path, expected: RolloutFacts) -> bool:
    """Whether the record shard at `path` exists and holds the rollouts `expected` describes."""
    if not path.exists():
        return False
    done = read_shard_header(path).rollout
    lists = {"prompt_lengths", "verified"}
    return done is not None and done.model_dump(exclude=lists) == expected.model_dump(exclude=lists)


def _record_facts(
    cfg: Eagle3Config, key: str, target: TransformersTarget, rollout_facts: RolloutFacts
) -> ShardFacts:
    """The record shard's facts: the offline shard's own (a drafter trains on shards that agree on them),
    checked against the target that rolls out, with the rollouts'."""
    offline_path = StoreLayout(cfg.store_root).hidden_states(key)
    if not offline_path.exists():
        raise Eagle3Error(
            f"{key}: no hidden-state shard at {offline_path}; materialize `hidden_states` first"
        )
    offline = read_shard_header(offline_path)
    info = target.info
    if offline.target is None or offline.target.fingerprint != info.fingerprint:
        raise Eagle3Error(
            f"{key}: the offline shard's states are of another target than the one loaded ({info.name}); "
            "records must come from the target the drafter was trained on"
        )
    if offline.aux_layer_ids != list(info.aux_layer_ids) or offline.final_state_convention != "post_norm":
        raise Eagle3Error(
            f"{key}: the offline shard holds aux layers {offline.aux_layer_ids} and "
            f"{offline.final_state_convention} final states; rollouts record layers {list(info.aux_layer_ids)} "
            "and post_norm (the transformers target's), which training cannot mix with them"
        )
    kept = offline.model_dump(
        include={"target", "tokenizer_fingerprint", "aux_layer_ids", "aux_layer_convention",
                 "final_state_convention", "max_seq_len"},
        exclude_unset=True,
    )  # fmt: skip
    return ShardFacts.model_validate(
        {**kept, "conversation_shard": key, "regenerated": cfg.regenerate.enabled, "rollout": rollout_facts},
        strict=False,
    )


def _load_drafter(final: Path, target: TransformersTarget) -> tuple[Any, torch.Tensor]:
    model = target.model
    embed = model.get_input_embeddings().weight.detach().float().cpu()
    drafter, mapping, _ = load_trained(final, embed)
    dtype = next(model.parameters()).dtype
    return drafter.to(target.device, dtype).eval(), mapping.d2t.to(target.device)


def _record(
    cfg: Eagle3Config,
    key: str,
    target: TransformersTarget,
    final: Path,
    facts: ShardFacts,
    path: Path,
    log: Log,
) -> StepResult:
    assert facts.rollout is not None
    model = target.model
    try:
        TargetLayers(model, target.info.aux_layer_ids)
    except UnsupportedTargetError as err:
        raise Eagle3Error(
            f"onpolicy: rollouts decode with eagle3's batched target step, which cannot compute this target: {err}"
        ) from None
    prompts, counts = rollout_prompts(cfg, key, target.tokenizer)
    if not prompts:
        raise Eagle3Error(f"{key}: no training prompt to roll out ({dict(counts) or 'the shard has none'})")
    drafter, d2t = _load_drafter(final, target)
    o = cfg.onpolicy
    settings = RolloutSettings(o.k, rollout_budget(cfg), o.temperature, o.batch_size)
    generator = torch.Generator(device=target.device).manual_seed(facts.rollout.seed)
    eos = set(eos_token_ids(model, target.tokenizer))
    started = time.perf_counter()
    rollouts: list[Rollout] = []
    for start in range(0, len(prompts), o.batch_size):
        batch = [p.ids for p in prompts[start : start + o.batch_size]]
        rollouts += rollout(model, drafter, d2t, target.info.aux_layer_ids, batch, eos, settings, generator)
        log(f"{key}: {len(rollouts)}/{len(prompts)} prompts rolled out")
    seconds = time.perf_counter() - started
    rollout_facts = facts.rollout.model_copy(
        update={
            "prompt_lengths": [len(r.prompt) for r in rollouts],
            "verified": [r.verified for r in rollouts],
        }
    )
    facts = facts.model_copy(update={"rollout": rollout_facts})
    with ShardWriter(
        path,
        sample_ids=[p.sample_id for p in prompts],
        lengths=[len(r.tokens) for r in rollouts],
        hidden_size=target.info.hidden_size,
        store_dtype=cfg.extract.store_dtype,
        num_aux=len(target.info.aux_layer_ids),
        facts=facts,
        disk_headroom=cfg.extract.disk_headroom,
    ) as writer:
        for i, r in enumerate(rollouts):
            loss_mask = torch.zeros(len(r.tokens), dtype=torch.uint8)
            loss_mask[len(r.prompt) :] = 1  # the reply, as extraction masks an assistant turn
            writer.write_sample(i, torch.tensor(r.tokens, dtype=torch.int32), loss_mask, r.aux, r.final)
        manifest = writer.finalize({"dropped": counts["prompts_too_long"]})
    header = read_shard_header(path)
    new_tokens = sum(len(r.reply) for r in rollouts)
    log(f"{key}: {len(rollouts)} rollouts recorded ({new_tokens} new tokens in {seconds:.1f} s)")
    return StepResult(
        key,
        path,
        {
            **_figures(header),
            "bytes": manifest.bytes,
            "validation_conversations": counts["validation_conversations"],
            "prompts_too_long": counts["prompts_too_long"],
            "new_tokens_per_second": round(new_tokens / max(seconds, 1e-9), 1),
            "seconds": round(seconds, 2),
            "skipped": False,
        },
    )


def _figures(header: ShardHeader) -> dict[str, Any]:
    """A record shard's figures from its header: what its rollouts decoded and how the drafter fared."""
    facts = header.rollout
    assert facts is not None and header.counts is not None
    rounds = sum(len(v) for v in facts.verified)
    accepted = sum(sum(v) for v in facts.verified)
    return {
        "drafter_run": facts.drafter_run,
        "round": facts.round,
        "samples": header.counts.samples,
        "tokens": header.counts.tokens,
        "new_tokens": header.counts.loss_tokens,
        "rollout_al": round(1 + accepted / max(rounds, 1), 4),
        "rejected_drafts": rejected_drafts(facts),
        "k": facts.k,
        "temperature": facts.temperature,
    }


# ---- refinement ------------------------------------------------------------------------------------------
def refine_step(
    cfg: Eagle3Config,
    log: Log = print,
    target: TransformersTarget | None = None,
    on_record: Callable[[StepResult], None] | None = None,
) -> StepResult:
    """The on-policy rounds from the newest offline drafter (module docstring), recorded in
    drafter/refined.json; with onpolicy.enabled false, that pointer is removed and the offline drafter is
    what is exported. `target`: the loaded target, when the caller holds it (else loaded for the rollouts a
    round lacks, and released before the round trains). `on_record`: told of each record shard of the first
    round's (the offline drafter's) rollouts this step made."""
    layout = StoreLayout(cfg.store_root)
    base = offline_final(layout)
    base_run = RunSummary.read(base / SUMMARY).run
    if not cfg.onpolicy.enabled:
        layout.drafter_refined.unlink(missing_ok=True)
        return StepResult("drafter_refined", base, {"enabled": False, "run": base_run, "rounds": 0})
    offline, mapping = shards_and_mapping(cfg, layout, log)
    keys = [p.stem for p in offline]
    rounds: list[RefinementRound] = []
    start, stopped = base, f"onpolicy.rounds ({cfg.onpolicy.rounds}) done"
    for number in range(1, cfg.onpolicy.rounds + 1):
        rollout_run = RunSummary.read(start / SUMMARY).run
        records = _ensure_records(cfg, keys, start, number, target, log, on_record if number == 1 else None)
        if not any(_rejected(p) for p in records):
            stopped = f"round {number}: the drafter accepted every draft of its rollouts, nothing to learn"
            break
        done = _train_round(cfg, offline, records, mapping, start, log)
        rounds.append(_round_record(number, rollout_run, records, done))
        if rounds[-1].kept_step == 0:
            stopped = f"round {number} kept the weights it started from: no measured gain"
            break
        start = done.final_dir
    chosen = RunSummary.read(start / SUMMARY).run
    DrafterRefined(
        base_run=base_run, run=chosen, final=layout.pointer_path(start), rounds=rounds, stopped=stopped
    ).write(layout.drafter_refined)
    log(f"on-policy refinement of {base_run}: {len(rounds)} round(s), drafter {chosen} ({stopped})")
    figures: dict[str, Any] = {}
    if rounds:
        figures = {"al_start": rounds[0].al_start, "al_kept": rounds[-1].al_kept}
    return StepResult(
        "drafter_refined",
        start,
        {
            "enabled": True,
            "base_run": base_run,
            "run": chosen,
            "rounds": len(rounds),
            "stopped": stopped,
            "record_samples": sum(r.record_samples for r in rounds),
            **{k: v for k, v in figures.items() if v is not None},
        },
    )


def _ensure_records(
    cfg: Eagle3Config,
    keys: list[str],
    final: Path,
    number: int,
    target: TransformersTarget | None,
    log: Log,
    on_record: Callable[[StepResult], None] | None,
) -> list[Path]:
    """The round's record shards, one per conversation shard, rolled out where missing (or made with other
    settings); a target loaded here is released before training needs the GPU."""
    layout = StoreLayout(cfg.store_root)
    run = RunSummary.read(final / SUMMARY).run
    missing = [
        key
        for key in keys
        if not recorded(layout.onpolicy_records(run, key), expected_rollout(cfg, final, key, number))
    ]
    if missing:
        from eagle3_core.targets.resolve import target_dir

        loaded = target or TransformersTarget(target_dir(cfg, log=log), cfg.target)
        try:
            for key in missing:
                result = records_step(cfg, key, loaded, log, final, number)
                if on_record is not None:
                    on_record(result)
        finally:
            if target is None:
                loaded.close()
    return [layout.onpolicy_records(run, key) for key in keys]


def _train_round(
    cfg: Eagle3Config, offline: list[Path], records: list[Path], mapping: VocabMapping, start: Path, log: Log
) -> TrainResult:
    """One round's training run: from `start`'s weights, on the records (and the offline shards), measured
    and selected as any training run is."""
    from eagle3_core.steps.evaluation import training_selector  # evaluation reads this module's runs
    from eagle3_core.targets.resolve import target_dir
    from eagle3_core.train.trainer import train_drafter

    o = cfg.onpolicy
    train = cfg.train.model_copy(update={"epochs": o.epochs, "lr": o.lr or cfg.train.lr})
    selector = training_selector(cfg, mapping.d2t, log)
    shards = (offline if o.offline else []) + records
    return train_drafter(
        shards, target_dir(cfg, log=log), mapping, StoreLayout(cfg.store_root).drafter_runs, train, log=log,
        init_from=start, selector=selector, records=o.loss,
    )  # fmt: skip


def _round_record(number: int, rollout_run: str, records: list[Path], done: TrainResult) -> RefinementRound:
    summary = done.summary
    selection = summary.selection
    al = {r.step: r.al for r in read_metrics(done.run_dir) if isinstance(r, ALRow)}
    kept = selection.kept_step if selection is not None else summary.steps
    samples = sum(_samples(p) for p in records)
    return RefinementRound(
        round=number, rollout_run=rollout_run, record_shards=len(records), record_samples=samples,
        run=summary.run, kept_step=kept, al_start=al.get(0), al_kept=al.get(kept),
    )  # fmt: skip


def _samples(shard: Path) -> int:
    counts = read_shard_header(shard).counts
    assert counts is not None  # a finished shard's header has them
    return counts.samples


def rejected_drafts(facts: RolloutFacts) -> int:
    """Drafts the target rejected in a record shard's rollouts: one in each round that accepted fewer than K."""
    return sum(1 for rounds in facts.verified for accepted in rounds if accepted < facts.k)


def _rejected(shard: Path) -> int:
    facts = read_shard_header(shard).rollout
    assert facts is not None
    return rejected_drafts(facts)
