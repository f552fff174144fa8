"""Rollouts: training prompts decoded by speculative decoding with the drafter being trained, and what the
target computed along the way, as on-policy training records.

Offline training teaches the drafter from the target's own replies, every step of the training-time test
(TTT) at every position alike. Decoding visits only some of those (entry, step) pairs: a round drafts from the
newest committed token, and a draft is only ever made on top of accepted ones. A rollout records, for each
reply token, which draft step of its round proposed it and whether the target accepted it
(train/rollout_labels.py `draft_steps`), beside the target's aux and final states at every position of the committed sequence, so
that refinement can weigh the drafter's own errors (Draft-OPD, arXiv 2605.29343: drafting replayed from the
positions verification exposed as errors). The states come from the very forwards that verified the drafts
(evaluate/batched.py records them), so recording costs no extraction: a rollout at temperature T is a
sampled reply of the target with its hidden states, in one decode.

The labels of each reply token follow from the rounds (train/rollout_labels.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.batched import batch_capacity, speculative_generate_batch
from eagle3_core.targets.batched import BatchedTarget, Sampling


@dataclass(frozen=True)
class Rollout:
    """One prompt decoded with the drafter: the reply, the drafts each round's verification accepted, and
    the target's states at every position of prompt + reply (on the CPU)."""

    prompt: list[int]
    reply: list[int]
    verified: list[int]
    aux: torch.Tensor  # [len(prompt) + len(reply), A*H]
    final: torch.Tensor  # [len(prompt) + len(reply), H], post-norm

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.reply


@dataclass(frozen=True)
class RolloutSettings:
    k: int
    max_new_tokens: int
    temperature: float
    batch_size: int


@torch.no_grad()
def rollout(
    model: Any,
    drafter: Eagle3Drafter,
    d2t: torch.Tensor,
    aux_layer_ids: tuple[int, ...],
    prompts: Sequence[list[int]],
    eos_ids: set[int],
    settings: RolloutSettings,
    generator: torch.Generator | None = None,
) -> list[Rollout]:
    """Each prompt decoded with `drafter` against the target `model`, `settings.batch_size` at once, in order.

    Greedy at temperature 0 (every reply is the target's greedy reply), else speculative sampling from
    `generator` (every reply a sample of the target's distribution at that temperature)."""
    sampling = Sampling(settings.temperature, generator if settings.temperature > 0 else None)
    out: list[Rollout] = []
    for start in range(0, len(prompts), settings.batch_size):
        batch = [list(p) for p in prompts[start : start + settings.batch_size]]
        capacity = batch_capacity(batch, settings.max_new_tokens, settings.k)
        target = BatchedTarget(model, aux_layer_ids, len(batch), capacity, record=True)
        results = speculative_generate_batch(
            model, drafter, d2t, aux_layer_ids, batch, settings.max_new_tokens, settings.k, eos_ids,
            sampling, target,
        )  # fmt: skip
        assert target.record is not None
        aux, final = target.record.aux.cpu(), target.record.final.cpu()
        for i, (prompt, result) in enumerate(zip(batch, results, strict=True)):
            n = len(prompt) + len(result.tokens)
            out.append(
                Rollout(prompt, result.tokens, result.verified, aux[i, :n].clone(), final[i, :n].clone())
            )
    return out
