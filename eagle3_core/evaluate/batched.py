"""Chain speculative decoding of many prompts at once, for measuring acceptance over hundreds of prompts.

At batch 1 a decode round is a few small kernels, so one sequence leaves a GPU mostly idle, and processes
sharing it are time-sliced rather than run side by side. Here B sequences advance together: each round the
drafter drafts K tokens for every row, the target verifies every row in one forward, and each row accepts its
own prefix. Rows sit at different positions, so the target and the drafter keep a KV cache per row and
attend by position (slot j is seen by the query at position p iff j <= p): `BatchedTarget` (targets/batched.py,
the layers `GraphedTarget` runs) and `DraftDecoder`, with a cache row per sequence: slots past a row's committed length hold entries of rejected drafts (or of a
shorter row's padding) and are written again before any query at their position reads them. A finished row
(end of turn, or its token budget) is carried along and ignored.

The rules of a round are `speculative_generate`'s (specdec.py): greedy rounds accept while a draft equals the
target's argmax, so every row's output is the target's own greedy output; sampled rounds are speculative
sampling, every row's verification at once (`verify_sampled_rows`). Sampled draws come from one generator in another order than one row at a time, so a
sampled AL is the same in distribution, not draw for draw.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.specdec import DraftDecoder, SpecResult, until_stop
from eagle3_core.targets.batched import BatchedTarget, Sampling, prefill_groups


def batch_capacity(prompts: list[list[int]], max_new_tokens: int, k: int) -> int:
    """Cache slots a batch decoded at K needs: its longest prompt, the budget, and a round's overshoot."""
    return max(len(p) for p in prompts) + max_new_tokens + 2 * k + 2


def _padded(rows: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)


@torch.no_grad()
def speculative_generate_batch(
    model: Any,
    drafter: Eagle3Drafter,
    d2t: torch.Tensor,
    aux_layer_ids: tuple[int, ...],
    prompts: list[list[int]],
    max_new_tokens: int,
    k: int,
    eos_ids: set[int],
    sampling: Sampling | None = None,
    target: BatchedTarget | None = None,
) -> list[SpecResult]:
    """`speculative_generate` for every prompt at once: each prompt's SpecResult (its tokens and accepted
    drafts per round), in order. `target`: the batch's target to decode with (one of len(prompts) rows and
    `batch_capacity` slots), to read its state record afterwards; the last committed token of each row is
    then run through it too, so that the record holds the states of every token."""
    sampling = sampling or Sampling()
    device = next(model.parameters()).device
    b = len(prompts)
    capacity = batch_capacity(prompts, max_new_tokens, k)
    target = target or BatchedTarget(model, aux_layer_ids, b, capacity)
    if target.keys.shape[1] != b or target.keys.shape[3] < capacity:
        raise ValueError(f"the target holds {target.keys.shape[1]} rows of {target.keys.shape[3]} slots, "
                         f"this batch needs {b} of {capacity}")  # fmt: skip
    decoder = DraftDecoder(drafter, capacity, rows=b)
    to_target = torch.arange(d2t.numel(), device=device) + d2t.to(device)
    results = [SpecResult([]) for _ in prompts]
    logits_now, h_now = [], []
    # prefill, a group of rows at a time (padded to its longest prompt): the target over the prompt, its first
    # token, and the drafter's extend over the prompt (entry p pairs aux(p) with token p+1); a padded entry
    # past a row's prompt is written again before the row reads it, in both caches
    for start, end in prefill_groups(prompts):
        group = prompts[start:end]
        logits, aux = target.prefill(group, start)
        firsts = sampling.choose(logits)  # [b]
        last = torch.tensor([len(p) - 1 for p in group], device=device)
        for i, first in enumerate(firsts.tolist()):
            results[start + i].tokens.append(first)
        width = aux.shape[1]
        committed = torch.tensor([p[1:] + [0] * (width - len(p)) + [0] for p in group], device=device)
        committed[torch.arange(len(group), device=device), last] = firsts
        positions = torch.arange(width, device=device).expand(len(group), width)
        dl, dh = decoder.extend_rows(committed, aux, positions, last, slice(start, end))
        logits_now.append(dl)
        h_now.append(dh)
    draft_logits, state = torch.cat(logits_now), torch.cat(h_now)
    newest = torch.tensor([len(p) for p in prompts], device=device)  # position of each row's newest token
    offsets = torch.arange(k + 1, device=device)
    while True:
        live = [
            i for i, r in enumerate(results) if len(r.tokens) < max_new_tokens and r.tokens[-1] not in eos_ids
        ]
        if not live:
            if target.record is not None:  # the states of each row's last token, which no round verified
                last_tokens = torch.tensor([[r.tokens[-1]] for r in results], device=device)
                target.forward(last_tokens, newest[:, None])
            return results
        drafts, qs = decoder.draft_rows(draft_logits, state, newest - 1, k, to_target, sampling)
        last_tokens = torch.tensor([r.tokens[-1] for r in results], device=device)
        positions = newest[:, None] + offsets  # [B, K+1]: the newest token, then the drafts
        vlogits, vaux = target.forward(torch.cat([last_tokens[:, None], drafts], dim=1), positions)
        accepted = _verify(drafts, vlogits, qs, to_target, sampling)
        for i in range(b):  # a finished row is carried along, its results left as they are
            if i not in live:
                accepted[i] = [results[i].tokens[-1]]
        counts = torch.tensor([len(a) for a in accepted], device=device)  # a + 1 committed tokens a row
        advance = [0] * b  # tokens each row kept: a + 1, or fewer where its reply ended inside the round
        for i in live:
            emitted = until_stop(accepted[i], eos_ids, max_new_tokens - len(results[i].tokens))
            results[i].accepted.append(len(emitted) - 1)
            results[i].verified.append(len(accepted[i]) - 1)
            results[i].tokens.extend(emitted)
            advance[i] = len(emitted)
        # the drafter's extend over each row's committed tokens, paired with the target's aux states there
        committed = _padded(accepted, k + 1, device)
        width = vaux.shape[-1]
        aux = torch.where((offsets[None, :] < counts[:, None])[..., None], vaux, vaux.new_zeros(width))
        draft_logits, state = decoder.extend_rows(committed, aux, positions, counts - 1)
        newest = newest + torch.tensor(advance, device=device)


def _verify(
    drafts: torch.Tensor,
    vlogits: torch.Tensor,
    qs: torch.Tensor | None,
    to_target: torch.Tensor,
    sampling: Sampling,
) -> list[list[int]]:
    """Each row's committed tokens of a round: its accepted drafts, then one token of the target's."""
    if sampling.greedy:
        choice = vlogits.argmax(-1)  # [B, K+1]
        k = drafts.shape[1]
        agree = (drafts == choice[:, :k]).int().cumprod(1).sum(1)
        counts, drafted, chosen = agree.tolist(), drafts.tolist(), choice.tolist()  # the round's one sync
        return [[*drafted[i][:a], chosen[i][a]] for i, a in enumerate(counts)]
    assert qs is not None
    vocab = vlogits.shape[-1]
    on_target = qs.new_zeros(*qs.shape[:2], vocab).index_copy_(2, to_target, qs)
    return verify_sampled_rows(drafts, on_target, sampling.probs(vlogits), sampling.generator)


def verify_sampled_rows(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> list[list[int]]:
    """`verify_sampled` (specdec.py) for every row at once, with one host synchronisation: drafts [B, K] drawn
    from draft_probs [B, K, V] (on target ids), target_probs [B, K+1, V]; each row's committed tokens. Row by
    row the draws would cost a handful of synchronisations a row and round (at batch 256, most of a round)."""
    b, k = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    p = target_probs[rows[:, None], torch.arange(k, device=drafts.device), drafts]  # [B, K]
    q = draft_probs[rows[:, None], torch.arange(k, device=drafts.device), drafts]
    u = torch.rand(b, k, generator=generator, device=drafts.device)
    accepted = (u * q <= p).int().cumprod(1).sum(1)  # [B]: accept while u <= p/q
    at = target_probs[rows, accepted]  # [B, V]: the target's distribution where the row's drafts stop
    # where a draft was rejected, the residual max(0, p - q); after all K, p itself (the bonus token)
    drafted_at = draft_probs[rows, accepted.clamp(max=k - 1)] * (accepted < k)[:, None]
    residual = (at - drafted_at).clamp_min(0)
    # p == q leaves no residual mass, and then the draft cannot have been rejected except by rounding
    last = torch.where(residual.sum(-1, keepdim=True) > 0, residual, at)
    token = torch.multinomial(last / last.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
    counts, drafted, tokens = accepted.tolist(), drafts.tolist(), token.tolist()  # the round's one sync
    return [[*drafted[i][:a], tokens[i]] for i, a in enumerate(counts)]
