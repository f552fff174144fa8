"""The extraction path on a GPU: bf16 compute, the layer convention in bf16, batch invariance, throughput.

Run on a CUDA host (the numbers in bench/results/ came from one H200):
    python -m bench.gpu_extract --out bench/results/gpu_extract.json
Model: a random-weight Llama (hidden 2048, 16 layers, vocab 32000), bf16 on the GPU; the shard is written
to local disk in bf16. Plain = the decoder forward alone over the same batches, CUDA-synchronised.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._common import extract_to_shard, plain_forward, random_sequences, save_random_target
from eagle3_core.config import TargetConfig
from eagle3_core.steps.data import length_batches
from eagle3_core.store.shards import ShardReader
from eagle3_core.targets.base import HiddenStates
from eagle3_core.targets.hf import TransformersTarget


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/results/gpu_extract.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_target(
            Path(tmp) / "t", hidden=2048, layers=16, vocab=32000, intermediate=5632
        )
        target = TransformersTarget(model_dir, TargetConfig())
        result["compute_dtype"] = target.info.dtype
        result["aux_layer_ids"] = list(target.info.aux_layer_ids)
        # layer convention, in bf16: captured rows against output_hidden_states[k]
        seqs = random_sequences(8, 30, 600, 32000, seed=1)
        batch_states = target.hidden_states(seqs, torch.bfloat16)
        worst_conv, worst_batch = 0.0, 0.0
        h = target.info.hidden_size
        for seq, st in zip(seqs, batch_states, strict=True):
            assert isinstance(st, HiddenStates)
            with torch.inference_mode():
                ref = target.model(torch.tensor([seq]).cuda(), output_hidden_states=True).hidden_states
                [alone] = target.hidden_states([seq], torch.bfloat16)
            assert isinstance(alone, HiddenStates)
            for j, k in enumerate(target.info.aux_layer_ids):
                worst_conv = max(
                    worst_conv,
                    (alone.aux[:, j * h : (j + 1) * h].float() - ref[k][0].float().cpu()).abs().max().item(),
                )
            worst_conv = max(worst_conv, (alone.last.float() - ref[-1][0].float().cpu()).abs().max().item())
            scale = alone.aux.float().abs().max().item()
            worst_batch = max(worst_batch, (st.aux.float() - alone.aux.float()).abs().max().item() / scale)
        result["layer_convention_max_abs_diff_alone_vs_output_hidden_states"] = worst_conv
        result["batch8_vs_alone_max_rel_diff_bf16"] = worst_batch
        # throughput
        seqs = random_sequences(128, 100, 2048, 32000, seed=2)
        tokens = sum(len(s) for s in seqs)
        batches = [[seqs[i] for i in b] for b in length_batches([len(s) for s in seqs], 32768, 64)]
        plain_forward(target, batches[:2])
        t_plain, t_extract, t_states = [], [], []
        for _ in range(3):
            t_plain.append(plain_forward(target, batches))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for batch in batches:
                target.hidden_states(batch, torch.bfloat16)
            t_states.append(time.perf_counter() - t0)
            t_extract.append(extract_to_shard(target, batches, Path(tmp) / "g-00000.safetensors"))
        # the writer alone, on states already in host memory: the bound that hashing and the disk set
        held = [target.hidden_states(batch, torch.bfloat16) for batch in batches]
        t_write = extract_to_shard(target, batches, Path(tmp) / "w-00000.safetensors", held=held, threads=8)
        result["writer_only_tokens_per_s_8_threads"] = round(tokens / t_write)
        del held
        with ShardReader(Path(tmp) / "g-00000.safetensors") as shard:
            result["shard_verify_problems"] = len(shard.verify())
            result["shard_bytes"] = shard.path.stat().st_size
    result["tokens"] = tokens
    result["bytes_per_token"] = 4 * 2048 * 2 + 5
    result["plain_tokens_per_s"] = round(tokens / statistics.median(t_plain))
    result["extract_tokens_per_s"] = round(tokens / statistics.median(t_extract))
    result["states_to_cpu_tokens_per_s"] = round(tokens / statistics.median(t_states))
    result["extract_over_plain"] = round(statistics.median(t_plain) / statistics.median(t_extract), 3)
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
