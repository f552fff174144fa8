"""Chain speculative decoding: the target verifies K drafts per forward, and its output distribution is unchanged.

The drafter runs as the engines run it (REFERENCE.md, "How the engines run a drafter"), with its own KV cache:

    extend  entry p pairs fc(aux(p)) with the next token seq[p+1], at RoPE position p
    decode  draft j feeds (embed(d_j), h = previous pre-norm output) at position n-1+j
    verify  one target forward over [seq[n], d_1..d_K]; accept a prefix of the drafts, then one more token
            from the target (its own next token, or a draw from the residual where a draft was rejected)
    commit  both caches cut back to the committed length; the drafter's cache is extended over the accepted
            positions from the target's aux states, so committed draft entries never come from its own outputs

Temperature 0 accepts draft i while it equals the target's argmax (the output is the target's greedy output,
token for token). Temperature > 0 is standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023):
draft d_i ~ q_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is
drawn from norm(max(0, p_i - q_i)); if all K are accepted the bonus token is drawn from p_K. Every committed
token is then distributed exactly as the target's own sample. q lives on the draft vocabulary, so it is
scattered onto the target's ids (zero elsewhere): target tokens outside the draft vocabulary come only from
the residual.

One host synchronisation per round (the accept count); the drafts stay on the device while drafting.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from eagle3_core.draft.model import Eagle3Drafter, rope_angles


class DraftCache:
    """The drafter's KV cache for one sequence: keys/values [1, kv_heads, L, d], cut back on rejection.

    Decoding is launch-bound at batch 1, so a step launches as few kernels as it can: RoPE angles come from a
    table grown on demand, and GQA is left to SDPA (`enable_gqa`) instead of copying the cache per head.
    """

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter = drafter
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._cos = self._sin = torch.empty(0)

    def crop(self, length: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def _angles(self, start: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if start + n > self._cos.shape[0]:
            size = max(2 * self._cos.shape[0], start + n, 256)
            cfg = self.drafter.cfg
            self._cos, self._sin = rope_angles(
                torch.arange(size, device=like.device), cfg.dim, cfg.rope_theta, like.dtype
            )
        return self._cos[start : start + n], self._sin[start : start + n]

    def step(self, tokens: torch.Tensor, h: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries (tokens [n], features h [n, H]) at positions start.. appended; (draft logits [n, V], pre-norm [n, H])."""
        d = self.drafter
        n = tokens.shape[0]
        q, k, v = d.midlayer.qkv(d.embed_tokens(tokens)[None], h[None], self._angles(start, n, h))
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        total = self.keys.shape[2]
        # entry i sees every cached entry before the new block and the new block up to itself
        mask = (
            None
            if n == 1
            else torch.ones(n, total, dtype=torch.bool, device=h.device).tril(diagonal=total - n)
        )
        out = F.scaled_dot_product_attention(q, self.keys, self.values, attn_mask=mask, enable_gqa=True)
        prenorm = d.midlayer.finish(h[None], d.midlayer.self_attn._out(out))[0]
        return d.lm_head(d.norm(prenorm)), prenorm


@dataclass
class SpecResult:
    tokens: list[int]  # the generated tokens (the prompt excluded)
    accepted: list[int] = field(default_factory=list)  # drafts accepted in each verification round


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: temperature 0 is greedy; above it, softmax(logits / T) drawn with `generator`."""

    temperature: float = 0.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One id per row of probs [..., V]."""
        return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=self.generator).reshape(
            probs.shape[:-1]
        )

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1) if self.greedy else self.draw(self.probs(logits))


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, list[int]]:
    """drafts [K], target logits [K+1, V] -> (accepted a, committed tokens: a drafts + the target's next)."""
    choice = target_logits.argmax(-1)
    k = drafts.numel()
    agree = (drafts == choice[:k]).int().cumprod(0)
    values = torch.cat([agree.sum()[None], drafts, choice]).tolist()  # the round's one synchronisation
    a = values[0]
    return a, [*values[1 : 1 + a], values[1 + k + a]]


def verify_sampled(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, list[int]]:
    """Speculative sampling of one round.

    drafts [K] target ids drawn from draft_probs [K, V] (already on target ids); target_probs [K+1, V], row i
    the target's distribution after verified entry i. Returns (accepted a, committed: a drafts + one token).
    """
    k = drafts.numel()
    rows = torch.arange(k, device=drafts.device)
    p, q = target_probs[rows, drafts], draft_probs[rows, drafts]  # [K]
    u = torch.rand(k, generator=generator, device=drafts.device)
    a = int((u * q <= p).int().cumprod(0).sum())  # accept while u <= p/q (q > 0: d_i was drawn from q_i)
    if a == k:
        last = target_probs[k]
    else:
        residual = (target_probs[a] - draft_probs[a]).clamp_min(0)
        # p == q leaves no residual mass, and then the draft cannot have been rejected except by rounding
        last = residual if float(residual.sum()) > 0 else target_probs[a]
    token = int(torch.multinomial(last / last.sum(), 1, generator=generator))
    return a, [*drafts[:a].tolist(), token]


_CACHE_ARGUMENT: dict[type, str] = {}


def _cache_argument(model: Any) -> str:
    """The keyword a transformers model takes its KV cache by: `cache` in recent 5.x, `past_key_values` before.

    A wrong name is swallowed by **kwargs and the model silently runs without its prefix, so it is looked up.
    """
    kind = type(model)
    if kind not in _CACHE_ARGUMENT:
        params = inspect.signature(kind.forward).parameters
        names = [name for name in ("cache", "past_key_values") if name in params]
        if not names:
            raise TypeError(f"{kind.__name__}.forward takes neither `cache` nor `past_key_values`")
        _CACHE_ARGUMENT[kind] = names[0]
    return _CACHE_ARGUMENT[kind]


def cached_forward(model: Any, ids: torch.Tensor, kv: Any, **kwargs: Any) -> Any:
    """model(ids [n]) appended to the KV cache `kv`, checked to have used and grown it."""
    before = kv.get_seq_length()
    out = model(input_ids=ids[None], use_cache=True, **{_cache_argument(model): kv}, **kwargs)
    if kv.get_seq_length() != before + ids.numel():
        raise RuntimeError(
            f"the target's KV cache went from {before} to {kv.get_seq_length()} entries over "
            f"{ids.numel()} tokens: the model did not use the cache it was given"
        )
    return out


def _target_forward(
    model: Any, ids: torch.Tensor, kv: Any, aux_layer_ids: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [n, V] and aux states [n, 3H] of `ids` appended to the KV cache."""
    out = cached_forward(model, ids, kv, output_hidden_states=True)
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
    sampling: Sampling | None = None,
) -> SpecResult:
    """Chain speculative decoding of one prompt: greedy (the target's greedy output) or sampled (its distribution)."""
    from transformers import DynamicCache

    sampling = sampling or Sampling()
    device = next(model.parameters()).device
    to_target = torch.arange(d2t.numel(), device=device) + d2t.to(device)  # draft id -> target id
    kv, draft = DynamicCache(), DraftCache(drafter)
    seq = torch.tensor(prompt, device=device)
    logits, aux = _target_forward(model, seq, kv, aux_layer_ids)
    out = [int(sampling.choose(logits[-1]))]
    result = SpecResult(out)
    # the drafter's extend over the prompt: entry p pairs aux(p) with the next token
    nxt = torch.cat([seq[1:], torch.tensor(out, device=device)])
    draft_logits, h = draft.step(nxt, drafter.fc(aux), 0)
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        n = len(prompt) + len(out) - 1  # position of the newest committed token (not yet seen by the target)
        drafts, qs = _draft_chain(draft, draft_logits[-1], h[-1:], n, k, to_target, sampling)
        vlogits, vaux = _target_forward(
            model, torch.cat([torch.tensor(out[-1:], device=device), drafts]), kv, aux_layer_ids
        )
        if sampling.greedy:
            a, committed = verify_greedy(drafts, vlogits)
        else:
            a, committed = verify_sampled(
                drafts,
                _on_target_ids(qs, to_target, vlogits.shape[-1]),
                sampling.probs(vlogits),
                sampling.generator,
            )
        result.accepted.append(a)
        _crop(kv, n + a + 1)  # keep seq[..n] and the accepted drafts
        draft.crop(n)  # the drafter keeps only entries made from target features
        # entries n..n+a pair the target's aux states with the next committed token
        pairs = torch.tensor(committed, device=device)
        draft_logits, h = draft.step(pairs, drafter.fc(vaux[: a + 1]), n)
        out.extend(_until_stop(committed, eos_ids, max_new_tokens - len(out)))
    return result


def _draft_chain(
    draft: DraftCache,
    logits: torch.Tensor,
    h: torch.Tensor,
    n: int,
    k: int,
    to_target: torch.Tensor,
    sampling: Sampling,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K drafts as target ids [K] (and, when sampling, their draft-vocab distributions [K, Vd])."""
    ids: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    for j in range(k):
        if j:
            logits, h = draft.step(to_target[ids[-1]], h, n - 1 + j)
            logits = logits[-1]
        if sampling.greedy:
            ids.append(logits.argmax(-1, keepdim=True))
        else:
            probs.append(sampling.probs(logits))
            ids.append(sampling.draw(probs[-1])[None])
    drafts = to_target[torch.cat(ids)]
    return drafts, torch.stack(probs) if probs else None


def _on_target_ids(draft_probs: torch.Tensor | None, to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """[K, Vd] on draft ids -> [K, V] on target ids, zero outside the draft vocabulary."""
    assert draft_probs is not None
    full = draft_probs.new_zeros(draft_probs.shape[0], vocab)
    return full.index_copy_(1, to_target, draft_probs)


def _crop(kv: Any, keep: int) -> None:
    """Cut a transformers cache to `keep` entries (its crop takes the count to drop, as a negative number)."""
    drop = kv.get_seq_length() - keep
    if drop > 0:
        kv.crop(-drop)


def _until_stop(tokens: list[int], eos_ids: set[int], room: int) -> list[int]:
    """The tokens up to the budget and up to (and with) the first end-of-sequence token."""
    kept = tokens[:room]
    for i, tok in enumerate(kept):
        if tok in eos_ids:
            return kept[: i + 1]
    return kept


@torch.no_grad()
def target_generate(
    model: Any, prompt: list[int], max_new_tokens: int, eos_ids: set[int], sampling: Sampling | None = None
) -> list[int]:
    """The target alone with its KV cache: the reference output (greedy) and the baseline speed."""
    from transformers import DynamicCache

    sampling = sampling or Sampling()
    device = next(model.parameters()).device
    kv = DynamicCache()
    ids = torch.tensor(prompt, device=device)
    out: list[int] = []
    while len(out) < max_new_tokens and (not out or out[-1] not in eos_ids):
        logits = cached_forward(model, ids, kv).logits[0, -1]
        nxt = sampling.choose(logits)
        out.append(int(nxt))
        ids = nxt.reshape(1)
    return out
