"""Flex attention over one packed row (the drafter's prefix attention), by how the BlockMask and the kernel are made.

    python -m bench.flex_masks               # GPU: T 16,384, 32 query heads, 8 kv heads, d 128, bf16

Samples of 256..2,048 tokens packed back to back into one row, each attending causally within itself. For each
variant: forward and forward+backward milliseconds (CUDA events, after a warm-up) and the TFLOP/s that counts
only the allowed query-key pairs (4 d FLOPs each a head forward, 3.5x that for forward+backward), with the
blocks computed (partial and full) beside the blocks a dense causal mask would compute. Variants:
- `packed` (what training runs): `packed_block_masks` from the samples' extents, flex compiled dynamic=True;
- `packed_static`: the same mask, flex compiled for the static shapes;
- `create`: create_block_mask evaluating the same rule entry by entry;
- `causal`: a plain causal mask over the whole row (no samples), the kernel's speed on a simple mask.
First, compiled flex's gradient through its log-sum-exp (what the drafter's chain merge relies on) against
dense float32 attention, as relative errors.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._training import StepClock
from eagle3_core.draft.model import FLEX_BLOCK, packed_block_masks


def packed_doc(length: int, seed: int) -> torch.Tensor:
    """int32 [1, length]: the sample of each entry, samples of 256..2,048 back to back, the rest one more."""
    rng = random.Random(seed)
    doc, start, sample = torch.empty(1, length, dtype=torch.int32), 0, 0
    while start < length:
        n = min(rng.randint(256, 2048), length - start)
        doc[0, start : start + n] = sample
        start, sample = start + n, sample + 1
    return doc


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median milliseconds of fn over `repeat` calls (CUDA events between calls), after three warm-up calls."""
    for _ in range(3):
        fn()
    clock = StepClock(torch.device("cuda"))
    clock.mark()
    for _ in range(repeat):
        fn()
        clock.mark()
    return statistics.median(clock.seconds()) * 1e3


def lse_gradient_check(device: torch.device) -> dict[str, float]:
    """Relative errors of compiled flex attention's output, lse and the gradients of a loss reading both,
    against dense float32 attention (causal, GQA, 1,024 entries)."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    torch.manual_seed(0)
    t, h, kvh, d = 1024, 8, 2, 64
    q = torch.randn(1, h, t, d, device=device, requires_grad=True)
    k, v = (torch.randn(1, kvh, t, d, device=device, requires_grad=True) for _ in range(2))
    w_out, w_lse = torch.randn(1, h, t, d, device=device), torch.randn(1, h, t, device=device)
    mask = create_block_mask(lambda b, hh, qi, kv: kv <= qi, None, None, t, t, device=str(device))
    out, aux = torch.compile(flex_attention)(
        q, k, v, block_mask=mask, enable_gqa=True, return_aux=AuxRequest(lse=True)
    )
    got = [out, aux.lse, *torch.autograd.grad((out * w_out).sum() + (aux.lse * w_lse).sum(), (q, k, v))]
    scores = q @ k.repeat_interleave(h // kvh, 1).transpose(-1, -2) * d**-0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=device).tril(), float("-inf"))
    ref_out, ref_lse = torch.softmax(scores, -1) @ v.repeat_interleave(h // kvh, 1), scores.logsumexp(-1)
    want = [
        ref_out,
        ref_lse,
        *torch.autograd.grad((ref_out * w_out).sum() + (ref_lse * w_lse).sum(), (q, k, v)),
    ]
    names = ["out", "lse", "grad_q", "grad_k", "grad_v"]
    return {n: float((a - b).norm() / b.norm()) for n, a, b in zip(names, got, want, strict=True)}


def main() -> int:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=16384)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args()
    device = torch.device("cuda")
    rows: dict[str, Any] = {"lse_gradient_rel_error": lse_gradient_check(device)}
    print(f"lse gradient check: {json.dumps(rows['lse_gradient_rel_error'])}", flush=True)
    t = args.length
    doc = packed_doc(t, 0).to(device)
    q = torch.randn(1, args.heads, t, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, args.kv_heads, t, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    grad = torch.randn_like(q)
    entries = torch.arange(t, device=device)
    allowed = (entries[None, :] <= entries[:, None]) & (doc[0, None, :] == doc[0, :, None])
    pairs = int(allowed.sum())
    del allowed

    def doc_causal(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return (kv <= qi) & (doc[b, kv] == doc[b, qi])

    def causal(b: Any, h: Any, qi: Any, kv: Any) -> Any:
        return kv <= qi

    dynamic = torch.compile(flex_attention, dynamic=True)
    static = torch.compile(flex_attention, dynamic=False)
    packed = packed_block_masks(doc, 1)[0]
    variants = {
        "packed": (dynamic, packed, pairs),
        "packed_static": (static, packed, pairs),
        "create": (static, create_block_mask(doc_causal, 1, None, t, t, device=str(device)), pairs),
        "causal": (static, create_block_mask(causal, None, None, t, t, device=str(device)), t * (t + 1) // 2),
    }
    flops = 4 * args.dim * args.heads
    dense_blocks = (t // FLEX_BLOCK) * (t // FLEX_BLOCK + 1) // 2
    rows.update(length=t, allowed_pairs=pairs, dense_causal_blocks=dense_blocks)
    for name, (kernel, mask, counted) in variants.items():

        def forward(kernel: Any = kernel, mask: Any = mask) -> Any:
            return kernel(q, k, v, block_mask=mask, enable_gqa=True)

        def both(forward: Callable[[], Any] = forward) -> None:
            torch.autograd.grad(forward(), (q, k, v), grad)

        try:
            both_ms = timed(both, args.repeat)
            fwd_ms = timed(forward, args.repeat)  # with grad on, as training runs it: the same compiled graph
        except (
            Exception
        ) as err:  # one variant failing (an OOM in a dense fallback) leaves the others' numbers
            rows[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(f"{name}: {rows[name]}", flush=True)
            torch.cuda.empty_cache()
            continue
        blocks = int(mask.kv_num_blocks.sum()) + int(
            mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None else 0
        )
        rows[name] = {
            "forward_ms": round(fwd_ms, 3),
            "forward_backward_ms": round(both_ms, 3),
            "forward_tflops": round(counted * flops / fwd_ms / 1e9, 1),
            "forward_backward_tflops": round(3.5 * counted * flops / both_ms / 1e9, 1),
            "blocks": blocks,
        }
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    if args.results:
        args.results.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
