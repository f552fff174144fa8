"""Peak GPU memory of a training run, estimated from shapes before the first step (the memory preflight).

A run whose settings cannot fit is refused before anything is allocated, with the estimate, the free memory
and the largest `batch_tokens` that fits, instead of an out-of-memory error some steps in. The estimate is
linear in the tokens a rank holds per step:

    peak = fixed + tokens * (ttt_steps * per_step_token + chain_token + teacher_token) + transient

- fixed: fp32 weights and AdamW's two moments (12 bytes per trainable parameter; DDP adds its fp32 gradient
  buckets), the frozen embedding (fp32) and the target's head (in the compute dtype). Under FSDP
  (train.sharding fsdp, train/sharding.py) each rank keeps its shard of the weights, their gradients, AdamW's
  moments and the embedding, holds whole the weights gathered for a forward and backward (the head's
  gradient before its reduce-scatter is counted with the loss's, below). Muon's momentum is sharded as
  AdamW's moments are (train/muon.py, DistributedMuon); the updates its step gathers whole, each on the rank
  that orthogonalises it, live after the backward has freed the activations, so they are not in the peak.
  Muon keeps one moment where AdamW keeps two; the estimate counts two for every parameter, as it did on
  the runs it was fitted on;
- per step and token: the activations one TTT step keeps for backward. Counted from the tensors the layer
  saves (the MLP's three [T, I] products, q/k/v, attention's output, the norms' inputs, the state the head
  reads and its gradient) times CALIBRATION (below), plus the earlier steps' keys and values each step
  stacks for its chain (quadratic in TTT steps, counted as they are);
- teacher: the target's logits over the draft vocabulary in the compute dtype, their log-sum-exp and top id;
- transient: the loss's float32 lm_head gradient (summed over the steps), lm_head's copy in the compute dtype
  that the steps' logits are made with, one block of that gradient's rows as a product and its float32
  copy, one step's logit gradients [tokens, V_draft] in the compute dtype (train/loss.py, HeadLoss), and
  the float32 [chunk, V_draft] temporaries of one loss chunk.
CALIBRATION is fitted on the current trainer's every-entry runs at Kimi-K2.5's widths (bench/sharding.py on
an H100, DDP and FSDP, both heads; docs/training-memory.md): there the estimate reads 1% above the DDP
peaks (so the allocated peak takes most of MARGIN) and 9-30% above the FSDP ones. The estimate assumes
every entry is drafted; chat data, whose prompts are loss-masked, drafts from fewer, and on the H200 runs
with 30% prompt it reads 22-47% above.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_core.draft.model import DrafterConfig
from eagle3_core.errors import ConfigError
from eagle3_core.train.loss import default_chunk_tokens, head_gradient_rows

GIB = 2**30
# measured per-step activation bytes over the counted ones. 1.33 was fitted on an earlier trainer's H200
# runs (1.23 at hidden 4096, 1.32 at 7168) and read 2-5% below the current one's peaks at hidden 7168
CALIBRATION = 1.5
MARGIN = 1.05  # the estimate's allowance for the allocator's fragmentation
LOSS_TEMPORARIES = 6  # float32 [chunk, V_draft] tensors alive at once in one loss chunk


def gib(n_bytes: float) -> float:
    """Bytes in GiB, to the two decimals the run records and the benches write."""
    return round(n_bytes / GIB, 2)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of a run's peak on one rank, split as the module docstring says."""

    fixed: float
    per_token: (
        float  # all TTT steps' activations, the teacher and a step's logit gradients, per token on a rank
    )
    per_run: float  # the loss's lm_head gradient and one loss chunk's temporaries
    world_size: int

    def peak(self, batch_tokens: int) -> float:
        """Bytes at `batch_tokens` global tokens a step (each rank holds its share)."""
        return MARGIN * (self.fixed + self.per_run + self.per_token * batch_tokens / self.world_size)

    def largest_batch_tokens(self, free_bytes: float) -> int:
        """The largest global batch_tokens (a multiple of 256) whose peak fits in `free_bytes`; 0 if none."""
        room = free_bytes / MARGIN - self.fixed - self.per_run
        if room <= 0:
            return 0
        return int(room / self.per_token * self.world_size) // 256 * 256


def trainable_parameters(d: DrafterConfig) -> int:
    h, hq, hkv = d.hidden_size, d.num_heads * d.dim, d.num_kv_heads * d.dim
    fc = d.num_aux * d.target_hidden_size * h
    attention = 2 * h * (hq + 2 * hkv) + hq * h
    mlp = 3 * h * d.intermediate_size
    norms = (4 + d.num_aux * d.fc_norm) * h + (d.num_aux * d.target_hidden_size if d.norm_before_fc else 0)
    return fc + attention + mlp + d.draft_vocab_size * h + norms


def counted_step_bytes(d: DrafterConfig, compute_bytes: int) -> float:
    """Bytes per token one TTT step saves for backward, counted tensor by tensor (before CALIBRATION)."""
    h, hq, hkv, i = d.hidden_size, d.num_heads * d.dim, d.num_kv_heads * d.dim, d.intermediate_size
    products = compute_bytes * (
        3 * i + (hq + 2 * hkv) + 2 * hq + 2 * h
    )  # MLP, q/k/v, attention out, o/qkv in
    norms = 4 * 4 * h  # float32 inputs of the four norms a step runs
    head = compute_bytes * 2 * h  # the state the head reads and its gradient
    return products + norms + head


def stacked_chain_bytes(d: DrafterConfig, ttt_steps: int, compute_bytes: int, flex: bool = True) -> float:
    """Bytes per token of the chains the TTT steps stack for attention and keep for backward: step s (of
    1..ttt_steps-1) stacks its s earlier keys and values ([B, kv_heads, M, s, d] for flex, expanded to every
    head for SDPA; draft/model.py). Not in CALIBRATION, whose runs predate the stacking: at Kimi's widths
    and TTT 7, 21 entries of 2 x 1,024 bf16 values a token, 1.3 GiB at 16,384 tokens."""
    width = (d.num_kv_heads if flex else d.num_heads) * d.dim
    return compute_bytes * 2 * width * ttt_steps * (ttt_steps - 1) / 2


def estimate_training_memory(
    d: DrafterConfig,
    ttt_steps: int,
    world_size: int = 1,
    compute_bytes: int = 2,
    sdpa_keys: int = 0,
    sharded: bool = False,
) -> MemoryEstimate:
    """The estimate for a drafter `d` trained with `ttt_steps`, on `world_size` ranks, computing in
    `compute_bytes`-byte floats (2: bf16 autocast, 4: float32). `sdpa_keys`: with SDPA attention, the
    longest sample (its float32 [heads, T, T] weights are kept per step); 0 for flex attention. `sharded`:
    FSDP over the ranks (train.sharding fsdp)."""
    params = trainable_parameters(d)
    embed = 4 * d.target_vocab_size * d.hidden_size
    if sharded and world_size > 1:
        shards = (16 * params + embed) / world_size  # weights, gradients, moments, embedding
        fixed = shards + 4 * params + embed  # and the weights gathered for forward and backward
    else:
        fixed = 12 * params + (4 * params if world_size > 1 else 0) + embed
    fixed += compute_bytes * d.target_vocab_size * d.target_hidden_size
    teacher = compute_bytes * d.draft_vocab_size + 4 + 8 + ttt_steps
    logit_grads = compute_bytes * d.draft_vocab_size
    sdpa = 2 * 4 * d.num_heads * sdpa_keys  # scores and softmax weights, per query
    per_token = (
        ttt_steps * (CALIBRATION * counted_step_bytes(d, compute_bytes) + sdpa)
        + stacked_chain_bytes(d, ttt_steps, compute_bytes, flex=sdpa_keys == 0)
        + teacher
        + logit_grads
    )
    chunk = default_chunk_tokens(d.draft_vocab_size)
    head_copy = compute_bytes * d.draft_vocab_size * d.hidden_size if compute_bytes != 4 else 0
    head_block = (
        (compute_bytes + 4) * min(head_gradient_rows(d.hidden_size), d.draft_vocab_size) * d.hidden_size
    )
    per_run = (
        4 * d.draft_vocab_size * d.hidden_size
        + head_copy
        + head_block
        + LOSS_TEMPORARIES * 4 * chunk * d.draft_vocab_size
    )
    return MemoryEstimate(fixed, per_token, per_run, world_size)


def check_training_memory(
    estimate: MemoryEstimate,
    batch_tokens: int,
    free_bytes: float,
    total_bytes: float,
    where: str,
    sharded: MemoryEstimate | None = None,
) -> None:
    """Refuse a run whose estimated peak exceeds the free memory of its device, with what would fit: a smaller
    batch, and the same batch under FSDP when `sharded` (the run's estimate under train.sharding fsdp, for a
    DDP run over several ranks) fits it."""
    need = estimate.peak(batch_tokens)
    if need <= free_bytes:
        return
    fits = estimate.largest_batch_tokens(free_bytes)
    advice = (
        f"train.batch_tokens <= {fits} fits"
        if fits > 0
        else "no batch_tokens fits: lower train.ttt_steps or train.draft_vocab_size, or use more processes"
    )
    if sharded is not None and sharded.peak(batch_tokens) <= free_bytes:
        advice += (
            f"; or train.sharding: fsdp, which shards the weights and optimizer state and needs about "
            f"{sharded.peak(batch_tokens) / GIB:.1f} GiB per process at this batch"
        )
    raise ConfigError(
        f"train.batch_tokens={batch_tokens}: the run needs about {need / GIB:.1f} GiB per process on {where}, "
        f"which has {free_bytes / GIB:.1f} GiB free of {total_bytes / GIB:.1f} GiB; {advice}"
    )
