"""Where a speculative-decoding round spends its time, at batch 1, with random weights of the `m` toy shape.

Acceptance does not matter here (a forced accept count is used), only the cost of each piece: the target's
one-token forward (what target-only decoding pays per token), its verify forward over K+1 tokens, the
drafter's steps, and what a whole round costs beyond the sum of those. Prints one table; run on the GPU:

    python -m bench.specdec_profile --device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.evaluate.measure import attention_without_cudnn
from eagle3_core.evaluate.specdec import (
    DraftDecoder,
    cached_forward,
    crop_cache,
    speculative_generate,
    target_forward,
    target_generate,
)
from eagle3_core.targets.batched import Sampling as SpecSampling
from eagle3_core.toy.presets import M


def _timer(device: torch.device) -> Callable[[Callable[[], Any], int], float]:
    def timed(fn: Callable[[], Any], reps: int) -> float:
        for _ in range(3):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / reps * 1e3

    return timed


def models(device: torch.device, dtype: torch.dtype) -> tuple[Any, Eagle3Drafter, torch.Tensor]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=M.vocab_size,
        hidden_size=M.hidden_size,
        intermediate_size=M.intermediate_size,
        num_hidden_layers=M.num_layers,
        num_attention_heads=M.num_heads,
        num_key_value_heads=M.num_kv_heads,
        max_position_embeddings=M.max_position_embeddings,
        tie_word_embeddings=False,
    )
    target = LlamaForCausalLM(config).to(device, dtype).eval()
    drafter_cfg = DrafterConfig(
        target_hidden_size=M.hidden_size,
        hidden_size=M.hidden_size,
        intermediate_size=M.intermediate_size,
        num_heads=M.num_heads,
        num_kv_heads=M.num_kv_heads,
        target_vocab_size=M.vocab_size,
        draft_vocab_size=4096,
    )
    drafter = Eagle3Drafter(drafter_cfg).to(device, dtype).eval()
    d2t = torch.zeros(4096, dtype=torch.long, device=device)
    return target, drafter, d2t


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prefix", type=int, default=200)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, drafter, d2t = models(device, dtype)
    timed = _timer(device)
    aux_ids = (2, M.num_layers // 2, M.num_layers - 3)
    prompt = torch.randint(0, M.vocab_size, (args.prefix,), device=device)
    k = args.k
    rows: dict[str, float] = {}

    def fresh_kv() -> DynamicCache:
        kv = DynamicCache()
        cached_forward(target, prompt, kv)
        return kv

    kv = fresh_kv()
    one = prompt[:1]
    block = prompt[: k + 1]

    def target_one() -> None:
        cached_forward(target, one, kv)
        crop_cache(kv, args.prefix)

    def target_verify() -> None:
        target_forward(target, block, kv, aux_ids)
        crop_cache(kv, args.prefix)

    def crop_only() -> None:
        crop_cache(kv, args.prefix)

    with attention_without_cudnn():
        rows["target forward, 1 token (+crop)"] = timed(target_one, args.reps)
        rows[f"target verify, {k + 1} tokens + aux (+crop)"] = timed(target_verify, args.reps)
        rows["crop alone"] = timed(crop_only, args.reps)
        to_target = torch.arange(4096, device=device)
        aux = torch.randn(args.prefix + k + 1, 3 * M.hidden_size, device=device, dtype=dtype)
        greedy = SpecSampling()
        for graphs in (False, True):
            if graphs and device.type != "cuda":
                continue
            decoder = DraftDecoder(drafter, args.prefix + 64 + k + 1, graphs=graphs)
            decoder.draft(prompt, aux[: args.prefix], 0, k, to_target, greedy)
            how = "CUDA graph" if graphs else "eager"
            for m in (1, k + 1):
                call = partial(decoder.draft, prompt[:m], aux[:m], args.prefix, k, to_target, greedy)
                rows[f"drafter round, extend {m} + {k} drafts ({how})"] = timed(call, args.reps)

        plist = prompt.tolist()
        new = 64
        rows["target_generate per token"] = timed(lambda: target_generate(target, plist, new, set()), 3) / new
        spec_rounds: list[int] = []

        def spec() -> None:
            r = speculative_generate(target, drafter, d2t, aux_ids, plist, new, k, set())
            spec_rounds.append(len(r.accepted))

        per_call = timed(spec, 3)
        rounds = spec_rounds[-1]
        rows["speculative round (random drafter, all rejected)"] = (
            per_call - rows["target_generate per token"]
        ) / rounds
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                speculative_generate(target, drafter, d2t, aux_ids, plist, 16, k, set())
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    width = max(len(r) for r in rows)
    for name, ms in rows.items():
        print(f"{name:<{width}}  {ms:8.3f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "k": k, "prefix": args.prefix, "ms": rows}, f, indent=2)


if __name__ == "__main__":
    main()
