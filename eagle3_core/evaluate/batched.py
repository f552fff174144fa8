"""Chain speculative decoding of many prompts at once, for measuring acceptance over hundreds of prompts.

At batch 1 a decode round is a few small kernels, so one sequence leaves a GPU mostly idle, and processes
sharing it are time-sliced rather than run side by side. Here B sequences advance together: each round the
drafter drafts K tokens for every row, the target verifies every row in one forward, and each row accepts its
own prefix. Rows sit at different positions, so the target and the drafter keep a KV cache per row and
attend by position (slot j is seen by the query at position p iff j <= p), as `GraphedTarget` and
`DraftDecoder` do for one row: slots past a row's committed length hold entries of rejected drafts (or of a
shorter row's padding) and are written again before any query at their position reads them. A finished row
(end of turn, or its token budget) is carried along and ignored.

The rules of a round are `speculative_generate`'s (specdec.py): greedy rounds accept while a draft equals the
target's argmax, so every row's output is the target's own greedy output; sampled rounds are speculative
sampling row by row. Sampled draws come from one generator in another order than one row at a time, so a
sampled AL is the same in distribution, not draw for draw.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from eagle3_core.draft.model import Eagle3Drafter, rope_angles
from eagle3_core.evaluate.graphed_target import check_supported
from eagle3_core.evaluate.specdec import Sampling, SpecResult, until_stop, verify_sampled


def _scatter_slots(cache: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor) -> None:
    """cache [B, heads, slots, d] <- entries [B, heads, n, d] at each row's positions [B, n]."""
    index = positions[:, None, :, None].expand(-1, entries.shape[1], -1, entries.shape[3])
    cache.scatter_(2, index, entries)


def _visible(slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, n, slots]: each query sees the slots up to its own position."""
    return (slots[None, None, :] <= positions[:, :, None])[:, None]


class BatchedTarget:
    """The target's forward for `batch` rows, each appending tokens at its own positions (eager: the same
    layers `GraphedTarget` runs, from the model's own modules)."""

    def __init__(self, model: Any, aux_layer_ids: tuple[int, ...], batch: int, capacity: int) -> None:
        check_supported(model)
        self.model, self.aux_layer_ids = model, aux_layer_ids
        self.layers = list(model.model.layers)
        first = self.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.kv_heads = first.k_proj.out_features // self.head_dim
        self.heads = first.q_proj.out_features // self.head_dim
        parameter = next(model.parameters())
        shape = (len(self.layers), batch, self.kv_heads, capacity, self.head_dim)
        self.keys = torch.zeros(shape, dtype=parameter.dtype, device=parameter.device)
        self.values = torch.zeros_like(self.keys)
        self.slots = torch.arange(capacity, device=parameter.device)
        rope_module = sys.modules[type(first).__module__]
        self.apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]] = rope_module.apply_rotary_pos_emb

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, rows: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [b, n] for the cache rows `rows` -> logits [b, n, V], aux states [b, n, A*H]."""
        inner = self.model.model
        h = inner.embed_tokens(ids)  # [b, n, H]
        cos, sin = inner.rotary_emb(h, positions)
        visible = _visible(self.slots, positions)
        inputs: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(self.layers):
            inputs[index] = h
            x = layer.input_layernorm(h)
            h = h + self._attention(index, rows, layer.self_attn, x, cos, sin, positions, visible)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.model.lm_head(inner.norm(h))
        return logits, torch.cat([inputs[k] for k in self.aux_layer_ids], dim=-1)

    def _attention(
        self,
        index: int,
        rows: slice,
        attn: Any,
        x: torch.Tensor,  # [b, n, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,  # [b, n]
        visible: torch.Tensor,  # [b, 1, n, slots]
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = attn.q_proj(x).view(b, n, self.heads, self.head_dim)
        k = attn.k_proj(x).view(b, n, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: an RMSNorm per head, before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.apply_rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [b, heads, n, d]
        keys, values = self.keys[index, rows], self.values[index, rows]
        _scatter_slots(keys, positions, k)
        _scatter_slots(values, positions, v)
        out = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=visible,
            scale=float(attn.scaling),
            enable_gqa=self.heads != self.kv_heads,
        )  # [b, heads, n, d]
        return attn.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class BatchedDraftDecoder:
    """The drafter with a KV cache per row ([B, kv_heads, capacity, d]), as `DraftDecoder` for one row."""

    def __init__(self, drafter: Eagle3Drafter, batch: int, capacity: int) -> None:
        cfg = drafter.cfg
        weight = drafter.lm_head.weight
        self.drafter = drafter
        shape = (batch, cfg.num_kv_heads, capacity, cfg.dim)
        # zeros, not empty: a masked slot's value still meets a zero weight, and 0 * NaN would leak
        self.keys = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
        self.values = torch.zeros_like(self.keys)
        self.slots = torch.arange(capacity, device=weight.device)
        self.cos, self.sin = rope_angles(self.slots, cfg.dim, cfg.rope_theta, weight.dtype)

    def step(
        self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, rows: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries (tokens [b, n], features h [b, n, H]) at positions [b, n] of the cache rows `rows`;
        (draft logits [b, n, Vd], the state each next draft is fed [b, n, H])."""
        d = self.drafter
        angles = self.cos[positions], self.sin[positions]
        q, k, v = d.midlayer.qkv(d.embed_tokens(tokens), h, angles)
        keys, values = self.keys[rows], self.values[rows]
        _scatter_slots(keys, positions, k)
        _scatter_slots(values, positions, v)
        mask = self.slots[None, None, :] <= positions[:, :, None]
        if d.cfg.sliding_window is not None:
            mask &= self.slots[None, None, :] > positions[:, :, None] - d.cfg.sliding_window
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)
        return d.head(d.midlayer.finish(h, d.midlayer.self_attn._out(out)))

    def extend(
        self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, last: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed entries (tokens [B, m], aux [B, m, 3H_t]) at positions [B, m]; each row's entry `last` [B]
        is its newest real one (those after it pad a shorter row). Its (draft logits [B, Vd], state [B, 1, H])."""
        logits, h = self.step(tokens, self.drafter.features(aux), positions)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        return logits[rows, last], h[rows, last][:, None]

    def chain(
        self,
        logits: torch.Tensor,
        h: torch.Tensor,
        position: torch.Tensor,
        k: int,
        to_target: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K drafts a row from the newest committed entry's logits [B, Vd] and state [B, 1, H] at position [B]:
        target ids [B, K] and, when sampling, their draft-vocabulary distributions [B, K, Vd]."""
        ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            if j:
                position = position + 1
                step_logits, h = self.step(to_target[ids[-1]][:, None], h, position[:, None])
                logits = step_logits[:, 0]
            if sampling.greedy:
                ids.append(logits.argmax(-1))
            else:
                probs.append(sampling.probs(logits))
                ids.append(sampling.draw(probs[-1]))
        drafts = to_target[torch.stack(ids, dim=1)]
        return drafts, torch.stack(probs, dim=1) if probs else None


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
    decoder = BatchedDraftDecoder(drafter, b, capacity)
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
        dl, dh = decoder.step(committed, drafter.features(aux), positions, row)
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
        drafts, qs = decoder.chain(draft_logits, state, newest - 1, k, to_target, sampling)
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
        draft_logits, state = decoder.extend(committed, aux, positions, counts - 1)
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
