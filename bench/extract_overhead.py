"""Extraction throughput over a plain forward pass's, same model, same batches, measured side by side.

Plain: the decoder's forward over each batch (no capture, nothing kept). Extraction: the same batches
through the transformers backend (aux capture) and the streamed shard writer (rows to disk, digests,
fsync, rename). The two alternate for several rounds and each side's median round is compared, so a
noisy neighbour slows both. The model is a random-weight Llama of the toy target `xs` shape.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch

from bench._common import extract_to_shard, plain_forward, random_sequences, save_random_target
from eagle3_core.config import TargetConfig
from eagle3_core.steps.data import length_batches
from eagle3_core.targets.hf import TransformersTarget

ROUNDS = 5


def main() -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_target(
            Path(tmp) / "target", hidden=128, layers=8, vocab=4096, intermediate=384
        )
        target = TransformersTarget(model_dir, TargetConfig())
        seqs = random_sequences(96, 40, 700, 4096)
        tokens = sum(len(s) for s in seqs)
        batches = [[seqs[i] for i in b] for b in length_batches([len(s) for s in seqs], 8192, 64)]
        plain_forward(target, batches[:2])  # warm-up
        t_plain, t_extract = [], []
        for r in range(ROUNDS):
            t_plain.append(plain_forward(target, batches))
            t_extract.append(extract_to_shard(target, batches, Path(tmp) / f"bench-{r:05d}.safetensors"))
    plain_tps, extract_tps = tokens / statistics.median(t_plain), tokens / statistics.median(t_extract)
    ratio = extract_tps / plain_tps
    print(f"{tokens:,} tokens in {len(batches)} batches, {ROUNDS} alternating rounds, median")
    print(f"plain forward: {plain_tps:,.0f} tokens/s; extraction to a shard: {extract_tps:,.0f} tokens/s")
    print(f"extraction / plain forward = {ratio:.3f} (goal >= 0.85)")
    if ratio < 0.85:
        sys.exit("FAIL")


if __name__ == "__main__":
    main()
