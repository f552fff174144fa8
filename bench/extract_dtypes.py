"""Extraction to disk with each store dtype, side by side in one run: tokens/s and bytes per token.

At a large hidden size extraction is bound by the disk (bench/README.md: about 1.4 GB/s of shard writes on the
H200 host), so FP8 shards (`extract.store_dtype: fp8_e4m3`, half the bytes of bfloat16) should extract nearly
twice as fast there, if quantising in the writer's threads keeps up. Each round extracts the same batches once
per dtype, alternating, through the pipeline's writer (`WriteBehind` threads, digests, one shard); the median
of the rounds is reported. FP8 is measured both ways: quantised on the target's device before the copy to the
host (what extraction does with a transformers target) and in the writer's threads (`fp8_e4m3@writer`). The target is a random-weight Llama with few layers, so that its forward is cheap
beside the states it hands over, as a large target's forward is beside a long extraction's disk writes.

    python -m bench.extract_dtypes --hidden 7168 --layers 8 --out bench/results/extract_dtypes_h200.json
    python -m bench.extract_dtypes --hidden 256 --layers 8 --sequences 16   # CPU-sized
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch

if __package__ in (None, ""):  # run as a file: import `bench` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import extract_to_shard, plain_forward, random_sequences, save_random_target
from bench._training import intermediate_for, shard_metadata
from eagle3_core.config import TargetConfig
from eagle3_core.steps.data import length_batches
from eagle3_core.store.shards import ShardReader
from eagle3_core.targets.hf import TransformersTarget

WRITER = "@writer"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--layers", type=int, default=8, help="at least 8: three distinct default aux layers")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--sequences", type=int, default=96)
    p.add_argument("--min-len", type=int, default=200)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--writer-threads", type=int, default=4, help="WriteBehind threads, as extraction uses")
    p.add_argument(
        "--dtypes", default=f"bfloat16,fp8_e4m3,fp8_e4m3{WRITER}",
        help=f"store dtypes; fp8_e4m3{WRITER}: FP8 quantised in the writer's threads from bfloat16 (the path "
        "of a target that cannot quantise on its device) instead of on the target's device",
    )  # fmt: skip
    p.add_argument("--workdir", type=Path, default=None, help="where the shards go (default: a temp dir)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    return args


def main() -> None:
    args = parse_args()
    device: Literal["cuda", "cpu"] = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict[str, object] = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        started = time.perf_counter()
        model_dir = save_random_target(
            Path(tmp) / "target", hidden=args.hidden, layers=args.layers, vocab=args.vocab,
            intermediate=intermediate_for(args.hidden), init_device=device,
            dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        )  # fmt: skip
        target = TransformersTarget(model_dir, TargetConfig(device=device))
        result["target_build_s"] = round(time.perf_counter() - started, 1)
        seqs = random_sequences(args.sequences, args.min_len, args.max_len, args.vocab, seed=2)
        tokens = sum(len(s) for s in seqs)
        batches = [
            [seqs[i] for i in b] for b in length_batches([len(s) for s in seqs], args.batch_tokens, 64)
        ]
        plain_forward(target, batches[:1])  # warm-up
        plain_s: list[float] = []
        extract_s: dict[str, list[float]] = {d: [] for d in args.dtypes}
        sizes: dict[str, int] = {}
        digests: dict[str, str] = {}  # of the last round's shard: both FP8 paths must write the same bytes
        for _ in range(args.rounds):
            plain_s.append(plain_forward(target, batches))
            for dtype in args.dtypes:
                path = Path(tmp) / f"{dtype.replace(WRITER, '-writer')}-00000.safetensors"
                path.unlink(missing_ok=True)
                store_dtype = dtype.removesuffix(WRITER)
                handover = torch.bfloat16 if dtype.endswith(WRITER) else None
                extract_s[dtype].append(
                    extract_to_shard(target, batches, path, threads=args.writer_threads,
                                     facts=shard_metadata(target), store_dtype=store_dtype, handover=handover)
                )  # fmt: skip
                sizes[dtype] = path.stat().st_size
                digests[dtype] = hashlib.sha256(path.read_bytes()).hexdigest()
                with ShardReader(path) as shard:
                    if problems := shard.verify():
                        raise SystemExit(f"{path}: {problems[:3]}")
        target.close()
    result["tokens"] = tokens
    result["plain_forward_tokens_per_s"] = round(tokens / statistics.median(plain_s))
    result["by_dtype"] = {
        d: {
            "extract_tokens_per_s": round(tokens / statistics.median(extract_s[d])),
            "rounds_s": [round(x, 2) for x in extract_s[d]],
            "shard_bytes_per_token": round(sizes[d] / tokens, 1),
            "write_gb_per_s": round(sizes[d] / statistics.median(extract_s[d]) / 1e9, 2),
            "shard_sha256": digests[d],
        }
        for d in args.dtypes
    }
    first = args.dtypes[0]
    for d in args.dtypes[1:]:
        mine, base = result["by_dtype"][d], result["by_dtype"][first]  # type: ignore[index]
        print(f"{d} / {first}: tokens/s x{mine['extract_tokens_per_s'] / base['extract_tokens_per_s']:.2f}, "
              f"bytes per token x{mine['shard_bytes_per_token'] / base['shard_bytes_per_token']:.3f}")  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
