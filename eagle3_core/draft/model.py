"""The EAGLE-3 drafter, readable top to bottom.

One Llama decoder layer whose attention sees the target token's embedding and a feature vector side by side:

    e  = input_layernorm(embed(token))            # the target's embedding, frozen
    hn = hidden_norm(h)                            # h: fc(aux states) for verified positions, else own output
    h1 = h + o_proj(attn(q/k/v_proj(cat[e, hn])))  # residual from h, as SGLang's LlamaForCausalLMEagle3 runs it
    prenorm = h1 + mlp(post_attention_layernorm(h1))
    logits  = lm_head(norm(prenorm))               # over the draft vocabulary

Training-time test (TTT) unrolls this `steps` times: step 0 uses h = fc(aux), step k feeds back step k-1's
`prenorm`, with the token input teacher-forced one position further each step. Entry p of step k reads
token ids[p+1+k] at RoPE position p+k and predicts ids[p+2+k]; it attends to entries 0..p of step 0 (the
causal prefix, from target features) and to entry p of steps 1..k (its own chain), exactly what the
engines' KV cache holds when they draft k tokens after position p.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

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

    @model_validator(mode="after")
    def _shapes(self) -> DrafterConfig:
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # half precisions are normalised in float32; float32/64 stay as they are
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


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
    """cos, sin [T, dim] of rotate-half RoPE at `positions` [T] (computed in float64, then cast)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
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

        `positions` [T], or their RoPE angles already computed (a decoder keeps a table of them).
        """
        b, t, _ = x.shape
        d = self.cfg.dim
        q = self.q_proj(x).view(b, t, self.cfg.num_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.cfg.num_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.cfg.num_kv_heads, d).transpose(1, 2)
        cos, sin = (
            rope_angles(positions, d, self.cfg.rope_theta, x.dtype)
            if isinstance(positions, torch.Tensor)
            else positions
        )
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend_flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: Any) -> torch.Tensor:
        """Flex attention over all steps' keys under the TTT BlockMask (GPU: masked blocks are skipped)."""
        return self._out(_flex_attention(q.is_cuda)(q, k, v, block_mask=block_mask, enable_gqa=True))

    def attend_ttt(
        self,
        q: torch.Tensor,
        prefix: tuple[torch.Tensor, torch.Tensor],
        chain: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The TTT mask without building it: q [B, heads, T, d] attends causally to step 0's keys (`prefix`)
        and, entry by entry, to its own keys of steps 1..k (`chain`), returning [B, T, H].

        The chain part is a per-entry dot product, so step k costs one T x T block instead of k+1 of them.
        """
        pk, pv = self._expand(prefix[0]), self._expand(prefix[1])
        if not chain:
            return self._out(F.scaled_dot_product_attention(q, pk, pv, is_causal=True))
        t, scale = q.shape[2], q.shape[-1] ** -0.5
        ck = torch.stack([self._expand(k) for k, _ in chain], dim=3)  # [B, heads, T, k, d]
        cv = torch.stack([self._expand(v) for _, v in chain], dim=3)
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        prefix_scores = (q @ pk.transpose(-1, -2) * scale).masked_fill(
            ~causal, float("-inf")
        )  # [B, heads, T, T]
        chain_scores = (q.unsqueeze(3) * ck).sum(-1) * scale  # [B, heads, T, k]
        weights = torch.softmax(torch.cat([prefix_scores, chain_scores], dim=-1).float(), dim=-1).to(q.dtype)
        out = weights[..., :t] @ pv + (weights[..., t:].unsqueeze(-1) * cv).sum(3)
        return self._out(out)

    def _expand(self, kv: torch.Tensor) -> torch.Tensor:
        """[B, kv_heads, T, d] -> [B, heads, T, d] (GQA)."""
        return kv.repeat_interleave(self.cfg.num_heads // self.cfg.num_kv_heads, dim=1)

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


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
        """The pre-norm output: residual from h (not from hidden_norm(h)), then the MLP block."""
        h1 = h + attn_out
        return h1 + self.mlp(self.post_attention_layernorm(h1))


def ttt_mask(length: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """[T, (step+1)T] bool: causal over step 0's entries, then the same entry of each later step."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    eye = torch.eye(length, dtype=torch.bool, device=device)
    return torch.cat([causal, *([eye] * step)], dim=1)


def ttt_block_mask(length: int, step: int, device: torch.device) -> Any:
    """The same mask as `ttt_mask`, as a flex attention BlockMask over (step+1)*length keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    def allowed(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return ((kv < length) & (kv <= q)) | ((kv >= length) & (kv % length == q))

    return create_block_mask(
        allowed, B=None, H=None, Q_LEN=length, KV_LEN=(step + 1) * length, device=str(device)
    )


@cache
def _flex_attention(compiled: bool) -> Any:
    # flex attention is only fast compiled (GPU); eager runs anywhere and is what the CPU test checks
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


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
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)

    def forward(
        self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int, attention: AttentionBackend = "sdpa"
    ) -> list[torch.Tensor]:
        return self.ttt_forward(aux, input_ids, steps, attention)  # what DDP wraps

    def ttt_forward(
        self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int, attention: AttentionBackend = "sdpa"
    ) -> list[torch.Tensor]:
        """Draft logits of each TTT step: aux [B, T, 3H_t], input_ids [B, T] -> `steps` x [B, T, V_draft].

        Step k, entry p: token input_ids[p+1+k] (0 past the end), position p+k, prediction of token p+2+k.
        Right padding is harmless: a real entry never attends to a later one.
        """
        t = input_ids.shape[1]
        h = self.fc(aux)  # [B, T, H]
        attn = self.midlayer.self_attn
        kvs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (key, value) of each step so far
        logits = []
        for k in range(steps):
            positions = torch.arange(t, device=aux.device) + k
            q, key, value = self.midlayer.qkv(self.embed_tokens(shift_left(input_ids, k + 1)), h, positions)
            kvs.append((key, value))
            if attention == "flex":
                keys, values = (
                    torch.cat([kv[0] for kv in kvs], dim=2),
                    torch.cat([kv[1] for kv in kvs], dim=2),
                )
                attn_out = attn.attend_flex(q, keys, values, ttt_block_mask(t, k, aux.device))
            else:
                attn_out = attn.attend_ttt(q, kvs[0], kvs[1:])
            h = self.midlayer.finish(h, attn_out)  # the pre-norm output feeds the next step
            logits.append(self.lm_head(self.norm(h)))
        return logits
