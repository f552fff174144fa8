"""How on-policy records count in the TTT loss (train/loss.py `record_weights`, config.RecordLoss): each token's
rollout label names the (entry, step) decoding visited, the drafter's errors weigh `error_weight`, `visited`
keeps only the visited pairs of a record, and offline samples count as ever. The rollout below: a prompt of
3 tokens, the prefill's token at 3, then rounds accepting 2, 0 and 3 of K=3 drafts."""

from __future__ import annotations

import pytest
import torch

from eagle3_core.config import RecordLoss
from eagle3_core.train.loss import TTTTargets, record_weights, ttt_loss
from eagle3_core.train.rollout_labels import OFFLINE, draft_steps

K, T = 3, 12
# round 1 (newest token 3, extend entry 2): tokens 4, 5 right, 6 the correction at step 2
# round 2 (newest 6, entry 5): token 7 the correction at step 0
# round 3 (newest 7, entry 6): tokens 8, 9, 10 right, 11 the bonus
VISITED = {(2, 0), (2, 1), (2, 2), (5, 0), (6, 0), (6, 1), (6, 2)}  # (entry, step)
ERRORS = {(2, 2), (5, 0)}


def _targets(rows: int = 2) -> TTTTargets:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, T, 5, generator=g, dtype=torch.float64)
    masks = torch.ones(K, rows, T, dtype=torch.bool)
    for k in range(K):
        masks[k, :, T - 2 - k :] = False  # step k of entry p predicts token p+2+k: none past the end
    return TTTTargets(logits, torch.logsumexp(logits, -1), logits.argmax(-1), masks)


def _labels() -> torch.Tensor:
    record = draft_steps(prompt_length=3, verified=[2, 0, 3], length=T, k=K)
    return torch.stack([record, torch.full((T,), OFFLINE, dtype=torch.int8)])  # row 1: an offline sample


def test_errors_weigh_error_weight_and_every_pair_still_counts_under_all() -> None:
    targets = _targets()
    weighted = record_weights(targets, _labels(), RecordLoss(error_weight=4.0))
    assert torch.equal(weighted.masks, targets.masks)
    assert weighted.weights is not None
    heavy = {(p, k) for k in range(K) for p in range(T) if weighted.weights[k, 0, p] != 1.0}
    assert heavy == ERRORS and all(weighted.weights[k, 0, p] == 4.0 for p, k in ERRORS)
    assert (weighted.weights[:, 1] == 1.0).all()  # the offline sample
    expected = (targets.masks * weighted.weights).sum(dim=(1, 2)).double()
    assert torch.equal(weighted.counts(), expected)


def test_visited_keeps_only_the_pairs_decoding_made_of_a_record() -> None:
    targets = _targets()
    weighted = record_weights(targets, _labels(), RecordLoss(positions="visited"))
    kept = {(p, k) for k in range(K) for p in range(T) if weighted.masks[k, 0, p]}
    assert kept == VISITED
    assert torch.equal(weighted.masks[:, 1], targets.masks[:, 1])  # the offline sample keeps every pair
    assert weighted.weights is not None and (weighted.weights == 1.0).all()


def test_the_loss_is_the_weighted_mean_over_counted_pairs() -> None:
    targets = record_weights(_targets(rows=1), _labels()[:1], RecordLoss(error_weight=3.0))
    g = torch.Generator().manual_seed(1)
    draft = [torch.randn(1, T, 5, generator=g, dtype=torch.float64) for _ in range(K)]
    total, _ = ttt_loss(draft, targets, step_weight=0.5)
    teacher = targets.logp()
    expected = torch.zeros((), dtype=torch.float64)
    assert targets.weights is not None
    for k in range(K):
        entry = -(teacher[0, 1 + k : T].exp() * draft[k][0, : T - 1 - k].log_softmax(-1)).sum(-1)
        weight = (targets.masks[k, 0] * targets.weights[k, 0])[: T - 1 - k].double()
        expected += 0.5**k * (entry * weight).sum() / weight.sum()
    assert float(total) == pytest.approx(float(expected), rel=1e-6)  # the weights are float32
