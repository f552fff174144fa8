"""The EAGLE-3 drafter, readable top to bottom.

One Llama decoder layer whose attention sees the target token's embedding and a feature vector side by side:

    e  = input_layernorm(embed(token))            # the target's embedding, frozen
    hn = hidden_norm(h)                            # h: fc(aux states) for verified positions, else own output
    h1 = h + o_proj(attn(q/k/v_proj(cat[e, hn])))  # residual from h, as SGLang's LlamaForCausalLMEagle3 runs it
    prenorm = h1 + mlp(post_attention_layernorm(h1))
    logits  = lm_head(norm(prenorm))               # over the draft vocabulary

The variants both engines read from the drafter's config (SGLang 0.5.23 `srt/models/llama_eagle3.py`, vLLM
`model_executor/models/llama_eagle3.py`; docs/drafter-variants.md), each off by default:
    norm_before_fc        fc(input_norm(aux))                  one RMSNorm over the concatenated aux states
    fc_norm               fc(cat[fc_norm_i(aux_i)])            one RMSNorm per aux state
    norm_output           the next step is fed norm(prenorm), not prenorm
    norm_before_residual  h1 = hn + attn(...)                  vLLM only: SGLang has no such option
    sliding_window W      a query at position q sees keys at positions > q - W

Training-time test (TTT) unrolls this `steps` times: step 0 uses h = fc(aux), step k feeds back step k-1's
`prenorm`, with the token input teacher-forced one position further each step. Entry p of step k reads
token ids[p+1+k] at RoPE position p+k and predicts ids[p+2+k]; it attends to entries 0..p of step 0 (the
causal prefix, from target features) and to entry p of steps 1..k (its own chain), exactly what the
engines' KV cache holds when they draft k tokens after position p.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from eagle3_core.targets.head import rms_norm

Positive = Annotated[int, Field(gt=0)]
AttentionBackend = Literal["sdpa", "flex"]


class DrafterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target_hidden_size: Positive
    hidden_size: Positive
    intermediate_size: Positive
    num_heads: Positive
    num_kv_heads: Positive
    head_dim: Positive | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_vocab_size: Positive
    draft_vocab_size: Positive
    num_aux: Positive = 3
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    sliding_window: Positive | None = None

    @model_validator(mode="after")
    def _shapes(self) -> DrafterConfig:
        if self.norm_before_fc and self.fc_norm:
            # both engines would apply both; speculators refuses the pair, and so do we
            raise ValueError("norm_before_fc and fc_norm are exclusive: set one of them")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads (or set head_dim)")
        if self.draft_vocab_size > self.target_vocab_size:
            raise ValueError("draft_vocab_size cannot exceed target_vocab_size")
        return self

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_angles(
    positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., T, dim] of rotate-half RoPE at `positions` [..., T] (computed in float64, then cast)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [..., T, d/2]
    return torch.cat([angles.cos(), angles.cos()], -1).to(dtype), torch.cat(
        [angles.sin(), angles.sin()], -1
    ).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (the Llama convention). x [B, heads, T, d], positions [T]."""
    return apply_rope(x, *rope_angles(positions, x.shape[-1], theta, x.dtype))


Angles = tuple[torch.Tensor, torch.Tensor]  # RoPE (cos, sin), each [T, d]


class Attention(nn.Module):
    """GQA attention whose input is [embedding, feature] (2H wide)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, positions: torch.Tensor | Angles
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, d] and k, v [B, kv_heads, T, d], RoPE applied to q and k.

        `positions` [T] (or [B, T] in a packed batch: each sample counts from 0), or their RoPE angles
        already computed (a decoder keeps a table of them).
        """
        b, t, _ = x.shape
        d = self.cfg.dim
        q = self.q_proj(x).view(b, t, self.cfg.num_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.cfg.num_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.cfg.num_kv_heads, d).transpose(1, 2)
        # the angles in the projections' dtype (bf16 under autocast, as the engines rotate): in the input's
        # float32 they would promote q and k to float32, and attention would run without tensor cores
        cos, sin = (
            rope_angles(positions, d, self.cfg.rope_theta, q.dtype)
            if isinstance(positions, torch.Tensor)
            else positions
        )
        if cos.dim() == 3:  # per row: [B, T, d] -> [B, 1, T, d], broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend_flex(
        self,
        q: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor],
        chain: list[tuple[torch.Tensor, torch.Tensor]],
        block_mask: Any,
    ) -> torch.Tensor:
        """`attend_ttt` by flex attention: q [B, heads, M, d] over step 0's keys under the prefix BlockMask (GPU:
        masked blocks are skipped), then its own chain (`chain`: steps 1..k, each [B, kv_heads, M, d]) merged
        in through the prefix's log-sum-exp, returning [B, M, H].

        The chain stays out of flex: in a key block of another step only one entry per query is allowed, so
        flex would compute a whole 128 x 128 block for 128 dot products.
        """
        from torch.nn.attention.flex_attention import AuxRequest

        compiled = q.is_cuda
        out, aux = _flex_attention(compiled)(
            q, *prefix, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True)
        )
        lse = aux.lse
        step = len(chain)
        window = self.cfg.sliding_window
        # chain entry j sits at position p + j, the query at p + k: seen within a window iff k - j < window
        seen = [kv for j, kv in enumerate(chain, start=1) if window is None or j > step - window]
        if seen:
            # stacked here, outside the compiled merge: one graph serves every chain length (a list's
            # length is a guard, and 6 lengths times a few shape bounds passed dynamo's recompile limit)
            chain_k = torch.stack([k for k, _ in seen], dim=3)  # [B, kv_heads, M, j, d]
            chain_v = torch.stack([v for _, v in seen], dim=3)
            out = _chain_merge(compiled)(q, out, lse, chain_k, chain_v)
        return self._out(out)

    def attend_ttt(
        self,
        q: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor],
        chain: list[tuple[torch.Tensor, torch.Tensor]],
        doc: torch.Tensor | None = None,
        queries: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The TTT mask without building it: q [B, heads, M, d] attends causally to step 0's keys (`prefix`,
        [B, kv_heads, T, d]) and, entry by entry, to its own keys of steps 1..k (`chain`), returning
        [B, M, H]. `doc` [B, T]: the sample each entry belongs to in a packed batch (a query sees only its own
        sample's prefix); `queries` [B, M]: the entries the queries are of (None: all T of them).

        The chain part is a per-entry dot product, so step k costs one M x T block instead of k+1 of them.
        """
        pk, pv = self._expand(prefix[0]), self._expand(prefix[1])
        if not chain and self.cfg.sliding_window is None and doc is None:
            return self._out(F.scaled_dot_product_attention(q, pk, pv, is_causal=True))
        t = pk.shape[2]
        allowed = prefix_mask(t, len(chain), self.cfg.sliding_window, q.device, doc, queries)
        if not chain:
            return self._out(F.scaled_dot_product_attention(q, pk, pv, attn_mask=allowed))
        scale = q.shape[-1] ** -0.5
        ck = torch.stack([self._expand(k) for k, _ in chain], dim=3)  # [B, heads, M, k, d]
        cv = torch.stack([self._expand(v) for _, v in chain], dim=3)
        prefix_scores = (q @ pk.transpose(-1, -2) * scale).masked_fill(
            ~allowed, float("-inf")
        )  # [B, heads, M, T]
        chain_scores = (q.unsqueeze(3) * ck).sum(-1) * scale  # [B, heads, M, k]
        if self.cfg.sliding_window is not None:  # chain entry j sits at position p + j, the query at p + k
            k = len(chain)
            too_far = torch.arange(1, k + 1, device=q.device) <= k - self.cfg.sliding_window
            chain_scores = chain_scores.masked_fill(too_far, float("-inf"))
        scores = torch.cat([prefix_scores, chain_scores], dim=-1)
        # half precisions are normalised in float32, float64 stays float64 (what the exactness tests run)
        weights = torch.softmax(scores.to(torch.promote_types(q.dtype, torch.float32)), dim=-1).to(q.dtype)
        out = weights[..., :t] @ pv + (weights[..., t:].unsqueeze(-1) * cv).sum(3)
        return self._out(out)

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, kv_heads, T, d] -> [B, heads, T, d] (GQA)."""
        return kv.repeat_interleave(self.cfg.num_heads // self.cfg.num_kv_heads, dim=1)

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def prefix_mask(
    length: int,
    step: int,
    window: int | None,
    device: torch.device,
    doc: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, T] bool (or [B, 1, M, T] given `doc` [B, T]): entry p of step `step` (RoPE position p + step) may
    see step 0's entry j (position j). `queries` [B, M]: the entries the queries are of (`Packing.drafted`;
    None: every entry).

    Causal (j <= p), in a packed batch within the same sample (doc[j] == doc[p]), and with a sliding window
    only j > p + step - window, as the engines' draft attention windows by position (within a sample,
    positions differ as indices do; the chain's entries, at positions p + 1..p + step, are windowed in
    `attend_ttt`).
    """
    cols = torch.arange(length, device=device)
    rows = (cols if queries is None else queries)[..., None]  # [T, 1] or [B, M, 1]
    allowed = cols <= rows
    if window is not None:
        allowed = allowed & (cols > rows + step - window)
    if doc is not None:
        row_doc = doc if queries is None else doc.gather(1, queries)  # [B, M]
        allowed = (allowed & (row_doc[:, :, None] == doc[:, None, :])).unsqueeze(1)
    return allowed


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The drafter's one decoder layer (`midlayer.*` in the SGLang checkpoint)."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def qkv(
        self, emb: torch.Tensor, h: torch.Tensor, positions: torch.Tensor | Angles
    ) -> tuple[torch.Tensor, ...]:
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)  # [B, T, 2H]
        return self.self_attn.project(x, positions)

    def finish(self, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The pre-norm output: residual from h (from hidden_norm(h) with norm_before_residual), then the MLP."""
        h1 = (self.hidden_norm(h) if self.norm_before_residual else h) + attn_out
        return h1 + self.mlp(self.post_attention_layernorm(h1))


def ttt_mask(length: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """[T, (step+1)T] bool: causal over step 0's entries, then the same entry of each later step."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal, *([eye] * step)], dim=1)


def ttt_block_mask(length: int, step: int, device: torch.device, window: int | None = None) -> Any:
    """The prefix part of `ttt_mask` (with `prefix_mask`'s window) as a flex BlockMask over step 0's `length`
    keys: step `step`'s queries see the causal prefix; `attend_flex` adds each entry's own chain."""
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if window is None:
            return kv <= q
        return (kv <= q) & (kv > q + step - window)  # by position: entry kv at kv, the query at q + step

    return create_block_mask(allowed, B=None, H=None, Q_LEN=length, KV_LEN=length, device=str(device))


FLEX_BLOCK = 128  # flex attention's default block: a packed row's length is a multiple of it


@dataclass(frozen=True)
class Packing:
    """Where the samples of a packed batch lie: each row holds several, back to back, then padding."""

    doc: torch.Tensor  # int [B, T]: the entry's sample, counted along its row (padding counts as one more)
    positions: torch.Tensor  # int64 [B, T]: the entry's position within its sample
    # int64 [B, M]: the entries some step's loss reads a draft of, ascending, M a multiple of FLEX_BLOCK, padded
    # with the row's last entry (which never counts); None: every entry. Every entry's step-0 keys are still
    # made (they are the causal prefix), but only these are drafted from: in chat data the prompt's entries,
    # a third or more of a row, are taught nothing.
    drafted: torch.Tensor | None = None

    def to(self, device: torch.device, non_blocking: bool = False) -> Packing:
        def moved(x: torch.Tensor) -> torch.Tensor:
            return x.to(device, non_blocking=non_blocking)

        return Packing(
            moved(self.doc), moved(self.positions), None if self.drafted is None else moved(self.drafted)
        )


def pick(x: torch.Tensor, entries: torch.Tensor | None, dim: int = 1) -> torch.Tensor:
    """x's entries along `dim` at `entries` [B, M] (x [B, T, ...] with dim 1, or [B, heads, T, d] with dim 2);
    x itself for None (every entry)."""
    if entries is None:
        return x
    index = entries.view(*entries.shape[:1], *[1] * (dim - 1), entries.shape[1], *[1] * (x.dim() - dim - 1))
    return torch.take_along_dim(x, index, dim=dim)


def packed_block_masks(
    doc: torch.Tensor, steps: int, window: int | None = None, drafted: torch.Tensor | None = None
) -> list[Any]:
    """The prefix BlockMask of each TTT step for a packed batch (`ttt_block_mask` within each sample), built
    from the samples' extents block by block, so no [M, T] mask is ever evaluated to find the empty blocks.

    doc [B, T], nondecreasing along each row, T a multiple of FLEX_BLOCK; `drafted` [B, M] the queries' entries
    (`Packing.drafted`; None: every entry). The keys are step 0's T entries; `attend_flex` adds the chain. A
    query block sees the key blocks that can share a sample with it, full when every key precedes every
    query within one sample. Without a window every step has the same mask, built once.
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, t = doc.shape
    if t % FLEX_BLOCK:
        raise ValueError(f"a packed row of {t} entries is not a multiple of {FLEX_BLOCK}")
    query = torch.arange(t, device=doc.device).expand(b, t) if drafted is None else drafted
    m = query.shape[1]
    if m % FLEX_BLOCK:
        raise ValueError(f"{m} drafted entries are not a multiple of {FLEX_BLOCK}")
    q_first, q_last = query[:, ::FLEX_BLOCK], query[:, FLEX_BLOCK - 1 :: FLEX_BLOCK]  # [B, nq] entries
    qdoc_first, qdoc_last = doc.gather(1, q_first), doc.gather(1, q_last)
    kdoc_first, kdoc_last = doc[:, ::FLEX_BLOCK], doc[:, FLEX_BLOCK - 1 :: FLEX_BLOCK]  # [B, nk]
    k_first = torch.arange(0, t, FLEX_BLOCK, device=doc.device)  # [nk]
    k_last = k_first + FLEX_BLOCK - 1
    # samples are contiguous and queries ascend, so a key block can share a sample with a query block iff it
    # starts by the last query and its last sample is not before the first query's; every pair is allowed
    # iff every key precedes the first query and the key block's first sample is the last query's
    shares = (k_first <= q_last[..., None]) & (kdoc_last[:, None, :] >= qdoc_first[..., None])  # [B, nq, nk]
    one_sample = (k_last <= q_first[..., None]) & (kdoc_first[:, None, :] == qdoc_last[..., None])

    # What the mask reads, as tensors rather than Python ints (which a compiled kernel is specialised to: a
    # new drafted count would recompile it), int32 (the kernel reads them at every entry of a partial block)
    key_doc = doc.to(torch.int32)  # [B, T]
    query_doc = key_doc if drafted is None else doc.gather(1, drafted).to(torch.int32)  # [B, M]
    drafted32 = None if drafted is None else drafted.to(torch.int32)

    def entry_of(bi: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return q if drafted32 is None else drafted32[bi, q]  # every entry drafted: a query is its entry

    def allowed(bi: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        # one function for every batch (the batch's samples are tensors it reads): no recompile per batch
        return (kv <= entry_of(bi, q)) & (key_doc[bi, kv] == query_doc[bi, q])

    def windowed(step: int, window: int) -> Any:
        def allowed_in_window(
            bi: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            entry = entry_of(bi, q)  # within a sample, positions differ as entries do
            return (kv <= entry) & (key_doc[bi, kv] == query_doc[bi, q]) & (kv > entry + step - window)

        return allowed_in_window

    def mask(step: int) -> Any:
        full, partial = one_sample, shares & ~one_sample
        if window is not None:  # by block: some key (partial) or every key (full) inside the window
            some = k_last > q_first[..., None] + step - window
            every = k_first > q_last[..., None] + step - window
            partial = (partial | (full & ~every)) & some
            full = full & every
        return BlockMask.from_kv_blocks(
            *_block_list(partial),
            *_block_list(full),
            BLOCK_SIZE=FLEX_BLOCK,
            mask_mod=allowed if window is None else windowed(step, window),
            seq_lengths=(m, t),
        )

    if window is None:
        return [mask(0)] * steps
    return [mask(step) for step in range(steps)]


def _block_list(chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chosen [B, n_q, n_kv] bool -> (count [B, 1, n_q] int32, ascending indices [B, 1, n_q, n_kv] int32)."""
    counts = chosen.sum(-1, dtype=torch.int32)
    order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts.unsqueeze(1), order.unsqueeze(1)


@cache
def _flex_attention(compiled: bool) -> Any:
    # flex attention is only fast compiled (GPU); eager runs anywhere and is what the CPU test checks
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


def merge_chain(
    q: torch.Tensor,
    prefix_out: torch.Tensor,
    prefix_lse: torch.Tensor,
    chain_k: torch.Tensor,
    chain_v: torch.Tensor,
) -> torch.Tensor:
    """Attention over the prefix and each query's own chain, from the prefix's output and log-sum-exp.

    q, prefix_out [B, heads, M, d]; prefix_lse [B, heads, M] (natural log; -inf where the prefix is empty);
    chain_k, chain_v [B, kv_heads, M, j, d]: entry m's own keys and values of its j chain steps. The chain's
    scores are per-entry dot products;
    the softmax over [prefix lse, chain scores] weighs the prefix's output against the chain's values. At least
    float32 throughout; gradients reach q and the prefix's keys through the lse as through the scores.
    """
    b, h, m, d = q.shape
    kvh = chain_k.shape[1]
    g = h // kvh  # GQA: each kv head's group of query heads
    wide = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64 (the exactness tests)
    # products and sums rather than einsum: compiled, they fuse into a few reductions, where einsum's batched
    # [G, d] x [d, j] products run as a slow bmm over B * kv_heads * M tiny matrices
    keys = chain_k.to(wide).unsqueeze(2)  # [B, kv_heads, 1, M, j, d]
    values = chain_v.to(wide).unsqueeze(2)
    scores = (q.to(wide).view(b, kvh, g, m, 1, d) * keys).sum(-1) * d**-0.5  # [B, kv_heads, G, M, j]
    lse = prefix_lse.to(wide).view(b, kvh, g, m, 1)
    weights = torch.softmax(torch.cat([lse, scores], dim=-1), dim=-1)  # [B, kv_heads, G, M, 1 + j]
    out = weights[..., :1] * prefix_out.to(wide).view(b, kvh, g, m, d)
    out = out + (weights[..., 1:, None] * values).sum(-2)
    return out.view(b, h, m, d).to(q.dtype)


@cache
def _chain_merge(compiled: bool) -> Any:
    # small reductions and elementwise work over [B, heads, M, j, d]: compiled (GPU) it fuses and never makes
    # the float32 copies; eager it is what the CPU runs and the tests compare
    return torch.compile(merge_chain, dynamic=True) if compiled else merge_chain


def shift_left(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """x[:, p] <- x[:, p + n] along dim 1, the last n entries filled."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, cfg.hidden_size)
        if embed_weight is not None:
            self.embed_tokens.weight.data.copy_(embed_weight)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding: shared, never trained
        aux_width = cfg.num_aux * cfg.target_hidden_size
        self.input_norm = RMSNorm(aux_width, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.num_aux))
            if cfg.fc_norm
            else None
        )
        self.fc = nn.Linear(aux_width, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # flex BlockMasks by (length, step, device), kept with the drafter (and freed with it): building one
        # costs more than a TTT step's attention, and batch lengths repeat
        self.block_masks: dict[tuple[int, int, str], Any] = {}

    def block_mask(self, length: int, step: int, device: torch.device) -> Any:
        if self.cfg.sliding_window is None:
            step = 0  # the prefix mask is the same at every step
        key = (length, step, str(device))
        if key not in self.block_masks:
            self.block_masks[key] = ttt_block_mask(length, step, device, self.cfg.sliding_window)
        return self.block_masks[key]

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        attention: AttentionBackend = "sdpa",
        output: Literal["logits", "states"] = "logits",
        packing: Packing | None = None,
    ) -> list[torch.Tensor]:
        """What DDP wraps: each TTT step's draft logits, or its normed states (what lm_head reads)."""
        if output == "states":
            return self.ttt_states(aux, input_ids, steps, attention, packing)
        return self.ttt_forward(aux, input_ids, steps, attention, packing)

    def features(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [.., 3H_t] -> the first step's h [.., H] (with the variant's norms)."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(aux)

    def head(self, prenorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's pre-norm output -> (draft logits, the state the next step is fed)."""
        normed, fed = self.step_out(prenorm)
        return self.lm_head(normed), fed

    def step_out(self, prenorm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's pre-norm output -> (the normed state lm_head reads, the state the next step is fed)."""
        normed = self.norm(prenorm)
        return normed, normed if self.cfg.norm_output else prenorm

    def ttt_forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        attention: AttentionBackend = "sdpa",
        packing: Packing | None = None,
    ) -> list[torch.Tensor]:
        """Draft logits of each TTT step: aux [B, T, 3H_t], input_ids [B, T] -> `steps` x [B, T, V_draft]."""
        return [self.lm_head(s) for s in self.ttt_states(aux, input_ids, steps, attention, packing)]

    def ttt_states(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        steps: int,
        attention: AttentionBackend = "sdpa",
        packing: Packing | None = None,
    ) -> list[torch.Tensor]:
        """The normed state of each TTT step, `steps` x [B, N, H]; lm_head of it is the step's draft logits. N is
        T, or the M drafted entries of a packed batch (`Packing.drafted`).

        Step k, entry p: token input_ids[p+1+k] (0 past the end), position p+k, prediction of token p+2+k.
        Right padding is harmless: a real entry never attends to a later one. In a packed batch positions
        count within each sample and attention stays inside it; an entry whose token input_ids[p+1+k] lies
        in the next sample computes nonsense that no entry of its own sample reads (the loss skips it).
        Step 0 makes every entry's keys (the prefix every query sees); from its queries on, only the drafted
        entries are computed, as nothing reads another entry's chain.
        """
        t = input_ids.shape[1]
        base = packing.positions if packing is not None else torch.arange(t, device=aux.device)
        doc = packing.doc if packing is not None else None
        drafted = packing.drafted if packing is not None else None
        masks = None
        if packing is not None and attention == "flex":
            masks = packed_block_masks(packing.doc, steps, self.cfg.sliding_window, drafted)
        h = self.features(aux)  # [B, T, H]
        attn = self.midlayer.self_attn
        kvs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (key, value) of each step so far
        states = []
        for k in range(steps):
            ids = shift_left(input_ids, k + 1)
            if k == 0:  # every entry's keys; the drafted entries' queries and states
                q, key, value = self.midlayer.qkv(self.embed_tokens(ids), h, base)
                q, h = pick(q, drafted, dim=2), pick(h, drafted)  # [B, heads, N, d], [B, N, H]
            else:
                ids, positions = pick(ids, drafted), pick(base, drafted) + k
                q, key, value = self.midlayer.qkv(self.embed_tokens(ids), h, positions)
            kvs.append((key, value))
            if attention == "flex":
                mask = masks[k] if masks is not None else self.block_mask(t, k, aux.device)
                attn_out = attn.attend_flex(q, kvs[0], kvs[1:], mask)
            else:
                attn_out = attn.attend_ttt(q, kvs[0], kvs[1:], doc, drafted)
            normed, h = self.step_out(self.midlayer.finish(h, attn_out))
            states.append(normed)
        return states
