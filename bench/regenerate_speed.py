"""In-process regeneration's speed by KV cache: the same chitchat prompts regenerated with a dynamic cache, a
static one (on a GPU transformers compiles its decode step) and a static one left eager, side by side.

    python -m bench.regenerate_speed                     # smollm2, 1,024 prompts, batch 512, 512 new tokens
    python -m bench.regenerate_speed --target DIR --prompts 8 --batch 4 --max-new-tokens 4

Per cache: new tokens/s, ms per decode step (a batch's seconds over its longest reply), the first batch's
seconds (a compile lands there), peak GPU memory, and whether every reply's token ids equal the dynamic
cache's. Batches as `Regenerator` makes them (`prompt_batches`), greedy, the target's own dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: import `bench` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3_core.config import Eagle3Config, RegenerateConfig
from eagle3_core.data.sources import chitchat_turns
from eagle3_core.data.tokenize import generation_prompt_ids
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.targets.regenerate import Regenerator, prompt_batches
from eagle3_core.targets.resolve import target_dir

REPO = Path(__file__).resolve().parents[1]
CACHES = ("dynamic", "static", "static_eager")  # static_eager: transformers' compile disabled


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--target", default="smollm2", help="target.path: smollm2, a *.gguf file or a model directory"
    )
    p.add_argument("--cache", type=Path, default=REPO / ".cache" / "eagle3")
    p.add_argument("--device", default="auto")
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--caches", default=",".join(CACHES))
    p.add_argument("--results", type=Path, default=None)
    return p.parse_args(argv)


def first_user_turns(count: int) -> list[str]:
    """The first user turn of the first `count` chitchat conversations (as ingest reads the package)."""
    import chitchat_dataset

    texts: list[str] = []
    for conv in chitchat_dataset.Dataset().values():
        turns = chitchat_turns(conv)
        if turns and turns[0][0] == "user" and str(turns[0][1]).strip():
            texts.append(str(turns[0][1]))
        if len(texts) == count:
            break
    return texts


def replies(rows: list[list[int]], eos_ids: list[int]) -> list[list[int]]:
    """Each row's generated ids up to (without) its end-of-turn token."""
    return [row[: next((i for i, t in enumerate(row) if t in eos_ids), len(row))] for row in rows]


def run_cache(
    target: TransformersTarget, prompts: list[list[int]], args: argparse.Namespace, cache: str
) -> Any:
    model = target.model
    cfg = RegenerateConfig(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch,
        kv_cache="dynamic" if cache == "dynamic" else "static",
    )
    regenerator = Regenerator(model, target.tokenizer, cfg, max_seq_len=1 << 20)
    model.generation_config.disable_compile = cache == "static_eager"
    on_gpu = model.device.type == "cuda"
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    outputs: list[list[int]] = [[] for _ in prompts]
    seconds, steps, first = 0.0, 0, None
    for batch in prompt_batches([len(p) for p in prompts], args.batch, regenerator.max_ratio):
        started = time.perf_counter()
        rows = regenerator.generate_ids([prompts[i] for i in batch])
        if on_gpu:
            torch.cuda.synchronize()
        took = time.perf_counter() - started
        first = took if first is None else first
        seconds += took
        steps += max(len(r) for r in rows)
        for i, reply in zip(batch, replies(rows, regenerator.eos_ids), strict=True):
            outputs[i] = reply
    model.generation_config.disable_compile = False
    new_tokens = sum(len(r) for r in outputs)
    return outputs, {
        "new_tokens": new_tokens,
        "seconds": round(seconds, 3),
        "new_tokens_per_s": round(new_tokens / seconds, 1),
        "ms_per_decode_step": round(1000 * seconds / steps, 3),
        "first_batch_seconds": round(first or 0.0, 3),
        "replies_cut": sum(len(r) == args.max_new_tokens for r in outputs),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if on_gpu else None,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Eagle3Config.model_validate(
        {"cache": str(args.cache.resolve()), "target": {"path": args.target, "device": args.device}}
    )
    target = TransformersTarget(target_dir(cfg), cfg.target)
    tokenizer = target.tokenizer
    prompts = [
        generation_prompt_ids(tokenizer, [{"role": "user", "content": t}])
        for t in first_user_turns(args.prompts)
    ]
    report: dict[str, Any] = {
        "target": args.target,
        "device": torch.cuda.get_device_name() if target.model.device.type == "cuda" else "cpu",
        "dtype": target.info.dtype,
        "prompts": len(prompts),
        "batch": args.batch,
        "max_new_tokens": args.max_new_tokens,
        "caches": {},
    }
    reference: list[list[int]] | None = None
    for cache in args.caches.split(","):
        outputs, facts = run_cache(target, prompts, args, cache)
        reference = outputs if reference is None else reference
        facts["same_ids_as_first"] = outputs == reference
        facts["rows_differing_from_first"] = sum(a != b for a, b in zip(outputs, reference, strict=True))
        report["caches"][cache] = facts
        print(json.dumps({cache: facts}), flush=True)
    text = json.dumps(report, indent=2)
    print(text)
    if args.results is not None:
        args.results.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
