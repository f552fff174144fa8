"""Peak memory of extracting a shard does not grow with the shard: a 4x larger shard, same peak RSS.

Each size runs in its own process (peak RSS is per process) over the same model and batch budget; rows
stream into the preallocated file, so only one batch is ever held. The model is a random-weight Llama with
a wide hidden state (512) so the shard's bytes (4 KiB a token in bf16) would dominate memory if they were
held: the large shard is ~260 MB of tensors.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import json, resource, sys, torch
from pathlib import Path
from bench._common import random_sequences
from eagle3_core.config import TargetConfig
from eagle3_core.steps.data import length_batches
from eagle3_core.store.shards import ShardWriter
from eagle3_core.targets.hf import TransformersTarget
torch.set_num_threads(2)
model_dir, out, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
target = TransformersTarget(model_dir, TargetConfig(aux_layer_ids=(1, 2, 3)))
seqs = random_sequences(32, 200, 800, 1000) * (n // 32)  # the large shard is exactly 4x the small
with ShardWriter(out, sample_ids=[f"{i:064x}" for i in range(n)], lengths=[len(s) for s in seqs],
                 hidden_size=target.info.hidden_size) as w:
    for b in length_batches([len(s) for s in seqs], 4096, 16):
        for i, st in zip(b, target.hidden_states([seqs[i] for i in b], torch.bfloat16)):
            ids = torch.tensor(seqs[i], dtype=torch.int32)
            w.write_sample(i, ids, torch.ones_like(ids, dtype=torch.uint8), st.aux, st.last)
    m = w.finalize()
print(json.dumps({"tokens": m["counts"]["tokens"], "bytes": m["bytes"],
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run(model_dir: Path, out: Path, samples: int) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(model_dir), str(out), str(samples)],
        check=True,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> None:
    from bench._common import save_random_target

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_random_target(
            Path(tmp) / "target", hidden=512, layers=4, vocab=1000, intermediate=1024
        )
        small = run(model_dir, Path(tmp) / "small-00000.safetensors", 32)
        large = run(model_dir, Path(tmp) / "large-00000.safetensors", 128)
    for name, r in (("small", small), ("large", large)):
        print(
            f"{name}: {r['tokens']:,} tokens, shard {r['bytes'] / 2**20:,.0f} MiB, peak RSS {r['peak_rss'] / 2**20:,.0f} MiB"
        )
    ratio = large["peak_rss"] / small["peak_rss"]
    print(
        f"shard size ratio {large['bytes'] / small['bytes']:.2f}x; peak RSS ratio large/small = {ratio:.3f} (goal <= 1.10)"
    )
    print(
        f"(max RSS of this parent process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:,.0f} MiB)"
    )
    if ratio > 1.10:
        sys.exit("FAIL")


if __name__ == "__main__":
    main()
