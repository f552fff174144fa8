"""Chain speculative decoding: the target verifies K drafts per forward, and its output distribution is unchanged.

The drafter runs as the engines run it (docs/reference.md, "How a drafter runs in both engines"), with its own KV cache:

    extend  entry p pairs fc(aux(p)) with the next token seq[p+1], at RoPE position p
    decode  draft j feeds (embed(d_j), h = previous output, pre-norm unless norm_output) at position n-1+j
    verify  one target forward over [seq[n], d_1..d_K]; accept a prefix of the drafts, then one more token
            from the target (its own next token, or a draw from the residual where a draft was rejected)
    commit  the target's cache is cut back to the committed length; the drafter's next extend overwrites its
            cache from the committed position on, so committed draft entries never come from its own outputs

Temperature 0 accepts draft i while it equals the target's argmax (the output is the target's greedy output,
token for token). Temperature > 0 is standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023):
draft d_i ~ q_i is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the token is
drawn from norm(max(0, p_i - q_i)); if all K are accepted the bonus token is drawn from p_K. Every committed
token is then distributed exactly as the target's own sample. q lives on the draft vocabulary, so it is
scattered onto the target's ids (zero elsewhere): target tokens outside the draft vocabulary come only from
the residual.

One host synchronisation per round (the accept count); the drafts stay on the device while drafting. At
batch 1 a decode step is launch-bound, so on a GPU the drafter's whole round (extend over the committed
tokens, then the K-1 chained steps) replays as one CUDA graph, as SGLang runs its draft decode. The graph and
the eager path run the same code (`DraftDecoder._round`), so the CPU tests check what the GPU replays.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from eagle3_core.draft.model import Eagle3Drafter, rope_angles
from eagle3_core.targets.batched import Sampling
from eagle3_core.targets.graphed import GraphedTarget, write_slots


class DraftDecoder:
    """The drafter with a KV cache of fixed capacity ([rows, kv_heads, capacity, d]), one sequence a row
    (`rows` 1 here; evaluate/batched.py decodes many).

    Entry i of a row's cache is RoPE position i. A write at positions start.. makes every later entry stale, and
    the attention mask (slot <= position) never lets a query see one, so rejection needs no crop. Fixed
    shapes and addresses are what lets a greedy round be captured once per (K, committed count) and replayed.
    """

    def __init__(self, drafter: Eagle3Drafter, capacity: int, graphs: bool = False, rows: int = 1) -> None:
        cfg = drafter.cfg
        weight = drafter.lm_head.weight
        self.drafter, self.capacity = drafter, capacity
        shape = (rows, cfg.num_kv_heads, capacity, cfg.dim)
        # zeros, not empty: a masked slot's value still meets a zero weight, and 0 * NaN would leak
        self.keys = torch.zeros(shape, device=weight.device, dtype=weight.dtype)
        self.values = torch.zeros_like(self.keys)
        self.slots = torch.arange(capacity, device=weight.device)
        self.cos, self.sin = rope_angles(self.slots, cfg.dim, cfg.rope_theta, weight.dtype)
        self.graphs = graphs and weight.is_cuda
        self._captured: dict[tuple[int, int], _CapturedRound] = {}

    def step(
        self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Entries (tokens [n], features h [n, H]) written at positions [n] of the first row; (draft logits
        [n, Vd], the state the next draft is fed [n, H]: pre-norm, or post-norm for a norm_output drafter)."""
        logits, fed = self.rows_step(tokens[None], h[None], positions[None], slice(0, 1))
        return logits[0], fed[0]

    def rows_step(
        self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, rows: slice = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` for the cache rows `rows`, each at its own positions: tokens, positions [b, n], h [b, n, H]
        -> draft logits [b, n, Vd], the states fed on [b, n, H]."""
        d = self.drafter
        angles = self.cos[positions], self.sin[positions]
        q, k, v = d.midlayer.qkv(d.embed_tokens(tokens), h, angles)
        keys, values = self.keys[rows], self.values[rows]
        write_slots(keys, positions, k)
        write_slots(values, positions, v)
        mask = self.slots[None, None, :] <= positions[:, :, None]  # [b, n, capacity]: up to each query's own
        if d.cfg.sliding_window is not None:
            mask &= self.slots[None, None, :] > positions[:, :, None] - d.cfg.sliding_window
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=True)
        return d.head(d.midlayer.finish(h, d.midlayer.self_attn._out(out)))

    def draft(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        start: int,
        k: int,
        to_target: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Extend over committed (tokens [m], aux [m, 3H_t]) at positions start.., then draft K target ids [K].

        Returns the drafts and, when sampling, their draft-vocabulary distributions [K, Vd].
        """
        m = tokens.shape[0]
        if start + m + k - 1 > self.capacity:
            raise ValueError(
                f"the drafter's cache holds {self.capacity} entries; this round needs {start + m + k - 1}"
            )
        if self.graphs and sampling.greedy and m <= k + 1:
            key = (k, m)
            if key not in self._captured:
                self._captured[key] = _CapturedRound(self, k, m, to_target)
            return self._captured[key].replay(tokens, aux, start), None
        positions = torch.arange(start, start + m, device=tokens.device)
        return self._round(tokens, aux, positions, k, to_target, sampling)

    def _round(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        positions: torch.Tensor,
        k: int,
        to_target: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, h = self.step(tokens, self.drafter.features(aux), positions)
        drafts, probs = self.draft_rows(logits[-1:], h[-1:][None], positions[-1:], k, to_target, sampling)
        return drafts[0], None if probs is None else probs[0]

    def extend_rows(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        rows: slice = slice(None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Committed entries (tokens [B, m], aux [B, m, 3H_t]) at positions [B, m] of the cache rows `rows`;
        each row's entry `last` [B] is its newest real one (those after it pad a shorter row). Its (draft
        logits [B, Vd], state [B, 1, H])."""
        logits, h = self.rows_step(tokens, self.drafter.features(aux), positions, rows)
        at = torch.arange(tokens.shape[0], device=tokens.device)
        return logits[at, last], h[at, last][:, None]

    def draft_rows(
        self,
        logits: torch.Tensor,
        h: torch.Tensor,
        position: torch.Tensor,
        k: int,
        to_target: torch.Tensor,
        sampling: Sampling,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K drafts a row from the newest committed entry's logits [B, Vd] and state [B, 1, H] at position
        [B]: target ids [B, K] and, when sampling, their draft-vocabulary distributions [B, K, Vd]."""
        ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for j in range(k):
            if j:
                position = position + 1
                step_logits, h = self.rows_step(to_target[ids[-1]][:, None], h, position[:, None])
                logits = step_logits[:, 0]
            if sampling.greedy:
                ids.append(logits.argmax(-1))
            else:
                probs.append(sampling.probs(logits))
                ids.append(sampling.draw(probs[-1]))
        drafts = to_target[torch.stack(ids, dim=1)]
        return drafts, torch.stack(probs, dim=1) if probs else None


class _CapturedRound:
    """One greedy drafter round (extend over m committed tokens, K drafts) as a CUDA graph on static buffers."""

    def __init__(self, decoder: DraftDecoder, k: int, m: int, to_target: torch.Tensor) -> None:
        device = decoder.keys.device
        self.decoder, self.k, self.m, self.to_target = decoder, k, m, to_target
        self.tokens = torch.zeros(m, dtype=torch.long, device=device)
        self.aux = torch.zeros(m, decoder.drafter.fc.in_features, dtype=decoder.keys.dtype, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.drafts = torch.empty(0)

    def _body(self) -> torch.Tensor:
        positions = self.start + torch.arange(self.m, device=self.start.device)
        return self.decoder._round(self.tokens, self.aux, positions, self.k, self.to_target, Sampling())[0]

    def _capture(self) -> None:
        # capture records launches without running them; a warm-up on a side stream runs them once first
        # (lazy initialisation, kernel selection), as torch.cuda.graphs requires. The warm-up writes the
        # cache, so it runs on this round's real inputs: the replay then writes the same entries again.
        device = self.start.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._body()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.drafts = self._body()

    def replay(self, tokens: torch.Tensor, aux: torch.Tensor, start: int) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.aux.copy_(aux)
        self.start.fill_(start)
        if self.graph is None:
            self._capture()
        assert self.graph is not None
        self.graph.replay()
        return self.drafts.clone()  # the next replay overwrites the graph's output buffer


@dataclass
class SpecResult:
    tokens: list[int]  # the generated tokens (the prompt excluded)
    accepted: list[int] = field(default_factory=list)  # drafts emitted in each verification round
    # drafts the verification accepted in each round, before an end of turn or the budget cut what it emitted
    # (recorded by the batched decoder, where on-policy records need to know which draft was rejected)
    verified: list[int] = field(default_factory=list)


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


def target_forward(
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
    decoder: DraftDecoder | None = None,
    graphed: GraphedTarget | None = None,
) -> SpecResult:
    """Chain speculative decoding of one prompt: greedy (the target's greedy output) or sampled (its distribution).

    `decoder` lets a caller keep one drafter cache (and its CUDA graphs) across prompts; its capacity must
    cover the prompt, max_new_tokens and K. `graphed`: the target's step as an engine runs it (its capacity
    likewise); without it, transformers' eager forward with its dynamic cache.
    """
    sampling = sampling or Sampling()
    device = next(model.parameters()).device
    decoder = decoder or DraftDecoder(drafter, len(prompt) + max_new_tokens + k + 1)
    to_target = torch.arange(d2t.numel(), device=device) + d2t.to(device)  # draft id -> target id
    step, keep = target_steps(model, aux_layer_ids, graphed)
    seq = torch.tensor(prompt, device=device)
    logits, aux = step(seq)
    out = [int(sampling.choose(logits[-1]))]
    result = SpecResult(out)
    # the first extend covers the prompt: entry p pairs aux(p) with the next token
    committed, committed_aux, start = torch.cat([seq[1:], seq.new_tensor(out)]), aux, 0
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        n = len(prompt) + len(out) - 1  # position of the newest committed token (not yet seen by the target)
        drafts, qs = decoder.draft(committed, committed_aux, start, k, to_target, sampling)
        vlogits, vaux = step(torch.cat([seq.new_tensor(out[-1:]), drafts]))
        if sampling.greedy:
            a, accepted = verify_greedy(drafts, vlogits)
        else:
            a, accepted = verify_sampled(
                drafts,
                _on_target_ids(qs, to_target, vlogits.shape[-1]),
                sampling.probs(vlogits),
                sampling.generator,
            )
        keep(n + a + 1)  # seq[..n] and the accepted drafts
        # the next extend writes entries n..n+a: the target's aux states paired with the next committed token
        committed, committed_aux, start = seq.new_tensor(accepted), vaux[: a + 1], n
        emitted = until_stop(accepted, eos_ids, max_new_tokens - len(out))
        # AL counts what the round emitted: drafts past the budget or past end-of-turn are never served
        result.accepted.append(len(emitted) - 1)
        out.extend(emitted)
    return result


TargetStep = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def target_steps(
    model: Any, aux_layer_ids: tuple[int, ...], graphed: GraphedTarget | None
) -> tuple[TargetStep, Callable[[int], None]]:
    """A fresh sequence's step (ids [n] appended -> logits [n, V], aux [n, A*H]) and its roll-back to n tokens."""
    if graphed is not None:
        graphed.reset()
        return graphed.extend, graphed.keep
    from transformers import DynamicCache

    kv = DynamicCache()
    return (lambda ids: target_forward(model, ids, kv, aux_layer_ids)), (lambda n: crop_cache(kv, n))


def _on_target_ids(draft_probs: torch.Tensor | None, to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """[K, Vd] on draft ids -> [K, V] on target ids, zero outside the draft vocabulary."""
    assert draft_probs is not None
    full = draft_probs.new_zeros(draft_probs.shape[0], vocab)
    return full.index_copy_(1, to_target, draft_probs)


def crop_cache(kv: Any, keep: int) -> None:
    """Cut a transformers cache to `keep` entries (its crop takes the count to drop, as a negative number)."""
    drop = kv.get_seq_length() - keep
    if drop > 0:
        kv.crop(-drop)


def until_stop(tokens: list[int], eos_ids: set[int], room: int) -> list[int]:
    """The tokens up to the budget and up to (and with) the first end-of-sequence token."""
    kept = tokens[:room]
    for i, tok in enumerate(kept):
        if tok in eos_ids:
            return kept[: i + 1]
    return kept


@torch.no_grad()
def target_generate(
    model: Any,
    prompt: list[int],
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling | None = None,
    graphed: GraphedTarget | None = None,
) -> list[int]:
    """The target alone with its KV cache: the reference output (greedy) and the baseline speed."""
    from transformers import DynamicCache

    sampling = sampling or Sampling()
    device = next(model.parameters()).device
    kv = DynamicCache()
    if graphed is not None:
        graphed.reset()
    ids = torch.tensor(prompt, device=device)
    out: list[int] = []
    while len(out) < max_new_tokens and (not out or out[-1] not in eos_ids):
        logits = (
            graphed.extend(ids)[0] if graphed is not None else cached_forward(model, ids, kv).logits[0]
        )[-1]
        nxt = sampling.choose(logits)
        out.append(int(nxt))
        ids = nxt.reshape(1)
    return out
