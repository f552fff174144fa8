"""Chain speculative decoding of many prompts at once, for measuring acceptance over hundreds of prompts.

At batch 1 a decode round is a few small kernels, so one sequence leaves a GPU mostly idle, and processes
sharing it are time-sliced rather than run side by side. Here B sequences advance together: each round the
drafter drafts K tokens for every row, the target verifies every row in one forward, and each row accepts its
own prefix. Rows sit at different positions, so the target and the drafter keep a KV cache per row and
attend by position (slot j is seen by the query at position p iff j <= p): the layers `GraphedTarget` runs
(`TargetLayers`) and `DraftDecoder`, with a cache row per sequence: slots past a row's committed length hold entries of rejected drafts (or of a
shorter row's padding) and are written again before any query at their position reads them. A finished row
(end of turn, or its token budget) is carried along and ignored.

The rules of a round are `speculative_generate`'s (specdec.py): greedy rounds accept while a draft equals the
target's argmax, so every row's output is the target's own greedy output; sampled rounds are speculative
sampling row by row. Sampled draws come from one generator in another order than one row at a time, so a
sampled AL is the same in distribution, not draw for draw.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.graphed_target import TargetLayers
from eagle3_core.evaluate.specdec import DraftDecoder, Sampling, SpecResult, until_stop, verify_sampled


class BatchedTarget(TargetLayers):
    """The target's forward for `batch` rows, each appending tokens at its own positions (eager: the layers
    `GraphedTarget` runs, `TargetLayers`)."""

    def __init__(self, model: Any, aux_layer_ids: tuple[int, ...], batch: int, capacity: int) -> None:
        super().__init__(model, aux_layer_ids)
        self.keys, self.values = self.cache(batch, capacity)

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [b, n] for the cache rows `rows` -> logits [b, n, V], aux states [b, n, A*H]."""
        return self.rows_forward(self.keys[:, rows], self.values[:, rows], ids, positions)


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
) -> list[SpecResult]:
    """`speculative_generate` for every prompt at once: each prompt's SpecResult (its tokens and accepted
    drafts per round), in order."""
    sampling = sampling or Sampling()
    device = next(model.parameters()).device
    b = len(prompts)
    capacity = max(len(p) for p in prompts) + max_new_tokens + 2 * k + 2
    target = BatchedTarget(model, aux_layer_ids, b, capacity)
    decoder = DraftDecoder(drafter, capacity, rows=b)
    to_target = torch.arange(d2t.numel(), device=device) + d2t.to(device)
    results = [SpecResult([]) for _ in prompts]
    logits_now, h_now = [], []
    # prefill, a row at a time (prompts differ in length): the target over the prompt, its first token, and
    # the drafter's extend over the prompt (entry p pairs aux(p) with token p+1)
    for i, prompt in enumerate(prompts):
        row = slice(i, i + 1)
        seq = torch.tensor([prompt], device=device)
        positions = torch.arange(len(prompt), device=device)[None]
        logits, aux = target.forward(seq, positions, row)
        first = int(sampling.choose(logits[0, -1]))
        results[i].tokens.append(first)
        committed = torch.cat([seq[:, 1:], seq.new_tensor([[first]])], dim=1)
        dl, dh = decoder.rows_step(committed, drafter.features(aux), positions, row)
        logits_now.append(dl[0, -1])
        h_now.append(dh[:, -1:])
    draft_logits, state = torch.stack(logits_now), torch.cat(h_now)
    newest = torch.tensor([len(p) for p in prompts], device=device)  # position of each row's newest token
    offsets = torch.arange(k + 1, device=device)
    while True:
        live = [
            i for i, r in enumerate(results) if len(r.tokens) < max_new_tokens and r.tokens[-1] not in eos_ids
        ]
        if not live:
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
        for i in live:
            emitted = until_stop(accepted[i], eos_ids, max_new_tokens - len(results[i].tokens))
            results[i].accepted.append(len(emitted) - 1)
            results[i].tokens.extend(emitted)
        # the drafter's extend over each row's committed tokens, paired with the target's aux states there
        committed = _padded(accepted, k + 1, device)
        width = vaux.shape[-1]
        aux = torch.where((offsets[None, :] < counts[:, None])[..., None], vaux, vaux.new_zeros(width))
        draft_logits, state = decoder.extend_rows(committed, aux, positions, counts - 1)
        newest = torch.where(
            torch.tensor([i in live for i in range(b)], device=device), newest + counts, newest
        )


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
    probs = sampling.probs(vlogits)
    return [
        verify_sampled(drafts[i], on_target[i], probs[i], sampling.generator)[1]
        for i in range(drafts.shape[0])
    ]


@torch.no_grad()
def target_generate_batch(
    model: Any,
    aux_layer_ids: tuple[int, ...],
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling | None = None,
) -> list[list[int]]:
    """`target_generate` for every prompt at once: the target alone, each row's reply (greedy: its own)."""
    sampling = sampling or Sampling()
    device = next(model.parameters()).device
    b = len(prompts)
    target = BatchedTarget(model, aux_layer_ids, b, max(len(p) for p in prompts) + max_new_tokens + 1)
    replies: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        positions = torch.arange(len(prompt), device=device)[None]
        logits, _ = target.forward(torch.tensor([prompt], device=device), positions, slice(i, i + 1))
        replies.append([int(sampling.choose(logits[0, -1]))])
    newest = torch.tensor([len(p) for p in prompts], device=device)
    while live := [i for i, r in enumerate(replies) if len(r) < max_new_tokens and r[-1] not in eos_ids]:
        ids = torch.tensor([[r[-1]] for r in replies], device=device)
        logits, _ = target.forward(ids, newest[:, None])
        chosen = sampling.choose(logits[:, 0]).tolist()
        for i in live:
            replies[i].append(chosen[i])
        newest = newest + torch.tensor([int(i in live) for i in range(b)], device=device)
    return replies
