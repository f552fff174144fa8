"""`eagle3 stats` over manifests describing 100,000 samples: wall time, and proof that no tensor file is opened.

The store holds manifests (400 shards of 250 samples, each with its sample ids and lengths, as the writer
produces them) beside empty stand-ins of their shard files; an audit hook counts every attempt to open a
.safetensors file during the call.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3_cli.steps import main as cli_main
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.stats import store_stats

SHARDS, PER_SHARD = 400, 250


def write_manifests(root: Path) -> None:
    layout = StoreLayout(root)
    layout.hidden_states_dir.mkdir(parents=True)
    for s in range(SHARDS):
        key = f"chat-{s:05d}"
        lengths = [300 + (i * 37 + s) % 900 for i in range(PER_SHARD)]
        manifest = {
            "key": key,
            "file": f"{key}.safetensors",
            "bytes": sum(lengths) * 2 * 4 * 7168,
            "schema": "eagle3.hidden_states/1",
            "store_dtype": "bfloat16",
            "hidden_size": 7168,
            "num_aux": 3,
            "sample_ids": [f"{s:08x}{i:056x}" for i in range(PER_SHARD)],
            "lengths": lengths,
            "failed": {},
            "counts": {
                "samples": PER_SHARD,
                "tokens": sum(lengths),
                "loss_tokens": sum(lengths) // 2,
                "failed": 0,
                "dropped": 0,
                "truncated_samples": 3,
                "truncated_tokens": 1234,
            },
            "checksum": "0" * 32,
            "header_checksum": "0" * 32,
        }
        layout.hidden_states_manifest(key).write_text(json.dumps(manifest))
        # stats counts a shard only beside its file (stat, never opened): an empty stand-in is enough
        layout.hidden_states(key).touch()


def main() -> None:
    opened: list[str] = []

    def audit(event: str, args: tuple[object, ...]) -> None:
        if event == "open" and str(args[0]).endswith(".safetensors"):
            opened.append(str(args[0]))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_manifests(root / "store")
        (root / "eagle3.yaml").write_text("store: store\n")
        sys.addaudithook(audit)
        t0 = time.perf_counter()
        stats = store_stats(root / "store")
        t_lib = time.perf_counter() - t0
        t0 = time.perf_counter()
        cli_main(["--config", str(root / "eagle3.yaml"), "stats"])
        t_cli = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "eagle3_cli.main", "--config", str(root / "eagle3.yaml"), "stats"],
            check=True,
            capture_output=True,
        )
        t_proc = time.perf_counter() - t0
    samples = stats.totals["samples"]
    print(f"samples described: {samples:,} in {len(stats.shards)} manifests")
    print(f"store_stats: {t_lib:.3f} s; `eagle3 stats` (table printed): {t_cli:.3f} s; budget 1.0 s")
    print(f"the whole command in a fresh process (interpreter start and imports included): {t_proc:.3f} s")
    print(f"ratio to budget: {t_proc / 1.0:.2f}; tensor files opened: {len(opened)}")
    if samples != SHARDS * PER_SHARD or opened or t_proc >= 1.0:
        sys.exit("FAIL")


if __name__ == "__main__":
    main()
