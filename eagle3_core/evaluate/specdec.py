"""Chain speculative decoding at temperature 0: the target verifies K drafts per forward, output unchanged.

The drafter runs as the engines run it (REFERENCE.md, "How the engines run a drafter"), with its own KV cache:

    extend  entry p pairs fc(aux(p)) with the next token seq[p+1], at RoPE position p
    decode  draft j feeds (embed(d_j), h = previous pre-norm output) at position n-1+j
    verify  one target forward over [seq[n], d_1..d_K]; accept the longest prefix the target agrees with,
            plus the target's own next token
    commit  both caches cut back to the committed length; the drafter's cache is extended over the accepted
            positions from the target's aux states, so committed draft entries never come from its own outputs
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from eagle3_core.draft.model import Eagle3Drafter


class DraftCache:
    """The drafter's KV cache for one sequence: keys/values [1, kv_heads, L, d], cut back on rejection."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, length: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def step(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries (tokens [n], features h [n, H]) at `positions` appended; (draft logits [n, V], pre-norm [n, H])."""
        d = self.drafter
        attn = d.midlayer.self_attn
        q, k, v = d.midlayer.qkv(d.embed_tokens(tokens)[None], h[None], positions)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        n, total = tokens.shape[0], self.keys.shape[2]
        # entry i sees every cached entry before the new block and the new block up to itself
        mask = torch.ones(n, total, dtype=torch.bool, device=h.device).tril(diagonal=total - n)
        out = F.scaled_dot_product_attention(q, attn._expand(self.keys), attn._expand(self.values), attn_mask=mask)
        prenorm = d.midlayer.finish(h[None], attn._out(out))[0]
        return d.lm_head(d.norm(prenorm)), prenorm


@dataclass
class SpecResult:
    tokens: list[int]  # the generated tokens (the prompt excluded)
    accepted: list[int] = field(default_factory=list)  # drafts accepted in each verification round


def _target_forward(model: Any, ids: torch.Tensor, cache: Any, aux_layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [n, V] and aux states [n, 3H] of `ids` appended to `cache`."""
    out = model(input_ids=ids[None], cache=cache, use_cache=True, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k][0] for k in aux_layer_ids], dim=-1)
    return out.logits[0], aux


@torch.no_grad()
def speculative_generate(
    model: Any,
    drafter: Eagle3Drafter,
    d2t: torch.Tensor,
    aux_layer_ids: tuple[int, ...],
    prompt: list[int],
    max_new_tokens: int,
    k: int,
    eos_ids: set[int],
) -> SpecResult:
    """Greedy chain speculative decoding of one prompt; equal to the target's own greedy output."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    to_target = torch.arange(d2t.numel(), device=device) + d2t.to(device)  # draft id -> target id
    cache = DynamicCache()
    draft = DraftCache(drafter)
    seq = torch.tensor(prompt, device=device)
    logits, aux = _target_forward(model, seq, cache, aux_layer_ids)
    out = [int(logits[-1].argmax())]
    result = SpecResult(out)
    # the drafter's extend over the prompt: entry p pairs aux(p) with the next token
    nxt = torch.cat([seq[1:], torch.tensor(out, device=device)])
    draft_logits, h = draft.step(nxt, drafter.fc(aux), torch.arange(len(prompt), device=device))
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        n = len(prompt) + len(out) - 1  # position of the newest committed token (not yet seen by the target)
        drafts = [int(to_target[draft_logits[-1].argmax()])]
        hd = h[-1:]
        for j in range(1, k):
            dl, hd = draft.step(torch.tensor(drafts[-1:], device=device), hd, torch.tensor([n - 1 + j], device=device))
            drafts.append(int(to_target[dl[-1].argmax()]))
        verify = torch.tensor([out[-1], *drafts], device=device)
        vlogits, vaux = _target_forward(model, verify, cache, aux_layer_ids)
        choice = vlogits.argmax(-1).tolist()  # the target's next token after each verified entry
        a = 0
        while a < k and drafts[a] == choice[a]:
            a += 1
        committed = [*drafts[:a], choice[a]]  # the accepted drafts and the target's own next token
        result.accepted.append(a)
        _crop(cache, n + a + 1)  # keep seq[..n] and the accepted drafts
        draft.crop(n)  # the drafter keeps only entries made from target features
        # entries n..n+a pair the target's aux states with the next committed token
        pairs = torch.tensor(committed, device=device)
        draft_logits, h = draft.step(pairs, drafter.fc(vaux[: a + 1]), torch.arange(n, n + a + 1, device=device))
        out.extend(_until_stop(committed, eos_ids, max_new_tokens - len(out)))
    return result


def _crop(cache: Any, keep: int) -> None:
    """Cut a transformers cache to `keep` entries (its crop takes the count to drop, as a negative number)."""
    drop = cache.get_seq_length() - keep
    if drop > 0:
        cache.crop(-drop)


def _until_stop(tokens: list[int], eos_ids: set[int], room: int) -> list[int]:
    """The tokens up to the budget and up to (and with) the first end-of-sequence token."""
    kept = tokens[:room]
    for i, tok in enumerate(kept):
        if tok in eos_ids:
            return kept[: i + 1]
    return kept


def greedy_generate(model: Any, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The target alone, greedy, with its KV cache: the reference speculative decoding must reproduce."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache()
    ids = torch.tensor(prompt, device=device)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_new_tokens and (not out or out[-1] not in eos_ids):
            logits = model(input_ids=ids[None], cache=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.tensor(out[-1:], device=device)
    return out


