"""What a verified checkpoint costs at the shape users train: save and resume of a drafter's checkpoint with
eagle3's checksums, beside the same tensors saved and loaded with safetensors alone, in one run.

    python -m bench.checkpoint_scale                      # hidden 7168 (Kimi-K2.5's), draft vocabulary 32,000
    python -m bench.checkpoint_scale --hidden 576 --vocab 49152 --intermediate 1536 --heads 9 --kv-heads 3

The drafter's trainable weights and AdamW's two moments are real tensors of the shape (float32, as training
keeps them); the plain path writes the same two safetensors files with `save_file` (fsynced) and reads every
byte back with `load_file`. eagle3's path is `save_checkpoint` (the files, their sha256 over the tensors, a checksummed
state.json, all in one atomic directory) and `resume_checkpoint` (verify, then load). The ratios are the cost
of the checksums a resume verifies; the sizes say how much disk a checkpoint takes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.store.atomic import fsync_path
from eagle3_core.store.records import RunProgress
from eagle3_core.train.checkpoint import OPTIMIZER, WEIGHTS, resume_checkpoint, save_checkpoint
from eagle3_core.train.run_dir import drafter_state

# what the trainer records beside the tensors (a few hundred bytes: it does not weigh on the figures)
PROGRESS = RunProgress(
    tokens=100, interval_sums=[[0.0] * 7 for _ in range(4)], interval_tokens=0, metrics_bytes=0, rng_cpu=[0]
)


def _state(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The trainable weights and an AdamW state_dict with both moments filled, as after a step."""
    cfg = DrafterConfig(
        target_hidden_size=args.hidden,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        target_vocab_size=args.target_vocab,
        draft_vocab_size=args.vocab,
    )
    with torch.device("meta"):
        meta = Eagle3Drafter(cfg)
    shapes = {name: t.shape for name, t in drafter_state(meta).items()}
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()}
    params = [torch.nn.Parameter(w) for w in weights.values()]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4)
    opt.step()
    return weights, opt.state_dict()


def _save_plain(directory: Path, weights: dict[str, torch.Tensor], opt: dict[str, torch.Tensor]) -> None:
    """The two files with safetensors alone, fsynced as a checkpoint must be to survive a power loss."""
    for name, tensors in ((WEIGHTS, weights), (OPTIMIZER, opt)):
        save_file(tensors, directory / name)
        fsync_path(directory / name)


def _load_plain(directory: Path) -> int:
    """The two files read back, every byte (load_file maps the file: a tensor is read when first touched)."""
    return sum(
        int(t.clone().numel()) for name in (WEIGHTS, OPTIMIZER) for t in load_file(directory / name).values()
    )


def _timed(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=19712)  # bench._training.intermediate_for(7168)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000, help="draft vocabulary")
    p.add_argument("--target-vocab", type=int, default=163840)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--results", type=Path, default=None)
    args = p.parse_args(argv)

    weights, opt_state = _state(args)
    opt_tensors = {f"state.{i}.{k}": v for i, fields in opt_state["state"].items() for k, v in fields.items()}
    params = sum(t.numel() for t in weights.values())
    root = Path(tempfile.mkdtemp(prefix="ckpt-", dir=args.dir))
    try:
        plain = root / "plain"
        plain.mkdir()
        save_plain, _ = _timed(lambda: _save_plain(plain, weights, opt_tensors))
        load_plain, _ = _timed(lambda: _load_plain(plain))
        run_dir = root / "run"
        save_ours, path = _timed(lambda: save_checkpoint(run_dir, 100, weights, opt_state, PROGRESS, keep=2))
        resume_ours, ckpt = _timed(lambda: resume_checkpoint(run_dir, print))
        assert ckpt is not None and ckpt.verified and ckpt.step == 100
        size = sum(f.stat().st_size for f in path.iterdir())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = {
        "shape": vars(args) | {"dir": str(args.dir), "results": None},
        "trainable_params": params,
        "checkpoint_bytes": size,
        "seconds": {  # to the microsecond: a small shape's save takes milliseconds, which 2 decimals made 0
            "save_plain": round(save_plain, 6),
            "save_eagle3": round(save_ours, 6),
            "load_plain": round(load_plain, 6),
            "resume_eagle3": round(resume_ours, 6),
        },
        "save_ratio": round(save_ours / save_plain, 2),
        "resume_ratio": round(resume_ours / load_plain, 2),
    }
    print(
        f"hidden {args.hidden}, draft vocabulary {args.vocab}: {params / 1e6:,.1f}M trainable parameters, "
        f"checkpoint {size / 2**30:.2f} GiB\n"
        f"save:   plain {save_plain:.2f} s, eagle3 (with checksums) {save_ours:.2f} s: {result['save_ratio']}x\n"
        f"resume: plain load {load_plain:.2f} s, eagle3 (verified) {resume_ours:.2f} s: {result['resume_ratio']}x"
    )
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
