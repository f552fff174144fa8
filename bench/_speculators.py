"""eagle3's hidden-state shards in speculators 0.9.0's offline layout, and its own trainer launched on them.

The layout, as speculators 0.9.0 reads it (`train/data.py` ArrowDataset, `train/dataloader.py`,
`hs_connectors.FileTransfer`, `data_generation/offline.py` check_hidden_states, `train/cli.py`
parse_vocab_mappings, `train/vocab_mapping.py`):

    <data>/                          a `datasets` Arrow dataset (save_to_disk), torch format, one row per
                                     sample: input_ids int64 [T], loss_mask int64 [T], seq_len int
    <data>/hidden_states/hs_{i}.safetensors
                                     row i's states: token_ids int64 [T] (must equal the row's input_ids)
                                     and hidden_states [T, 4, H]: the three aux layers in order, then the
                                     final state BEFORE the target's final norm (its model applies
                                     `verifier_norm` before `verifier_lm_head` to build the teacher)
    <data>/token_freq.pt             {token id: count} of the loss-masked tokens (torch.save of a plain dict
                                     of ints, what its `save_token_frequency_distribution` writes and its
                                     `_generate_vocab_mappings` sorts as a dict)
    d2t.npy, t2d.npy                 the vocab mapping (int64 offsets, bool mask), given as --d2t-path and
                                     --t2d-path: the same draft vocabulary as eagle3's run

The final state. eagle3's transformers extraction stores it after the final norm (header fact
`final_state_convention: post_norm`): post = w * x / rms(x). The pre-norm state x is not recoverable (rms(x)
is lost), but u = post / w is a state whose RMSNorm with weight w gives `post` back: norm_w(u) = post /
rms(post / w), and rms(post / w) = 1 up to eps for an exact post. The shards hold post rounded to bf16,
whose rms(post / w) is 1 only to about 1e-3, and no RMSNorm output can match it exactly (an RMSNorm output
y always has rms(y / w) = 1), so speculators' teacher state is eagle3's times a per-position factor within
1 +- 2e-3 (measured on the toy: 0.9992-1.0009): the same direction, the same argmax, a 0.1% change of the
teacher's logit scale. The files hold the states in the dtype speculators' loader computes in (float32 on
CPU: nothing rounded beyond the shards' own bf16; bf16 on GPU, as vLLM writes them).

The split. speculators keeps the dataset's last (1 - train_data_ratio) rows for validation; eagle3 holds out
samples by a hash of their id. The rows are written eagle3's training samples first, its validation samples
last, and the ratio is chosen so that both trainers train and validate on exactly the same samples.

The launcher. `python -m bench._speculators RESULT.json [--threads N] -- <speculators train flags>` runs
what `speculators train` runs (`TrainConfig.resolve(argv)`, then `speculators.train.cli.main`), with two
rebinds that let 0.9.0 train on a host without an accelerator (`_cpu_rebinds`). Neither touches the model,
the loss or the optimizers: one puts the model and batches on the CPU instead of `cuda:0`, the other skips
synchronising a device that does not exist.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.errors import Eagle3Error
from eagle3_core.store.atomic import atomic_directory, atomic_write_json
from eagle3_core.train.data import SampleRef, TrainingData

Log = Callable[[str], None]
SPECULATORS_VERSION = "0.9.0"  # the release whose layout and trainer this module drives
LAYOUT_VERSION = "1"  # bump when the files written here change: it is part of the cache keys
HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ_FILE = "token_freq.pt"
D2T_FILE = "d2t.npy"
T2D_FILE = "t2d.npy"
MARKER = "offline_dataset.json"
RESULT_FILE = "result.json"
# The smallest |w| of the final norm we divide by: a (near) zero weight leaves no pre-norm state to rebuild.
MIN_NORM_WEIGHT = 1e-6


class SpeculatorsError(Eagle3Error):
    """speculators is missing, of another version, or its training run failed (the message names its log)."""


def check_speculators_version() -> str:
    try:
        version = metadata.version("speculators")
    except metadata.PackageNotFoundError:
        raise SpeculatorsError(
            f"speculators is not installed: pip install --no-deps speculators=={SPECULATORS_VERSION}"
        ) from None
    if version != SPECULATORS_VERSION:
        raise SpeculatorsError(
            f"speculators {version} is installed; this bench reads and drives {SPECULATORS_VERSION}'s layout"
        )
    return version


# ---- the final state ---------------------------------------------------------------------------------------
def pre_norm_states(post: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 [T, H] states u = post / w, whose RMSNorm with weight w gives `post` back (see the module doc)."""
    w = weight.detach().float()
    if w.ndim != 1 or post.shape[-1] != w.numel():
        raise Eagle3Error(
            f"final norm weight of shape {tuple(w.shape)} does not fit states {tuple(post.shape)}"
        )
    smallest = float(w.abs().min())
    if smallest < MIN_NORM_WEIGHT:
        raise Eagle3Error(
            f"the target's final norm weight has an entry of {smallest:.3g}: its post-norm states cannot be "
            "turned back into pre-norm ones; extract pre-norm states instead"
        )
    return post.float() / w


# ---- the offline dataset -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class OfflineDataset:
    root: Path
    samples: int
    train_samples: int  # rows [0, train_samples) are eagle3's training split, the rest its validation split
    tokens: int
    train_tokens: int
    hidden_size: int
    aux_layer_ids: tuple[int, int, int]
    states_dtype: str
    key: str  # what the dataset was made from (shards' checksums, split, dtype, layout version)

    @property
    def train_data_ratio(self) -> float:
        """speculators' --train-data-ratio whose split is this one: int(samples * ratio) == train_samples."""
        if not 0 < self.train_samples < self.samples:
            raise Eagle3Error(
                f"speculators needs both splits non-empty; {self.train_samples} of {self.samples} samples train"
            )
        return (self.train_samples + 0.5) / self.samples

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "root": str(self.root), "aux_layer_ids": list(self.aux_layer_ids)}


def ordered_refs(data: TrainingData, val_fraction: float, max_val: int) -> tuple[list[SampleRef], int]:
    """eagle3's training samples, then its validation samples (as `TrainingData.split` gives them), and the
    count of the former."""
    train, val = data.split(val_fraction, max_val)
    return [*train, *val], len(train)


def dataset_key(data: TrainingData, val_fraction: float, max_val: int, states_dtype: str) -> str:
    identity = {
        "shards": [r.meta.checksum for r in data.readers],
        "val_fraction": val_fraction,
        "max_val": max_val,
        "states_dtype": states_dtype,
        "layout": LAYOUT_VERSION,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def write_offline_dataset(
    shard_paths: Sequence[Path],
    final_norm: torch.Tensor,
    out: Path,
    *,
    val_fraction: float,
    max_val: int,
    states_dtype: torch.dtype,
    log: Log = print,
) -> OfflineDataset:
    """The shards' samples in speculators' layout at `out`, or the dataset an earlier call left there whole.

    Written into a temporary directory renamed into place last, with its marker, so `out` is whole or absent.
    """
    data = TrainingData(list(shard_paths))
    try:
        dtype_name = str(states_dtype).removeprefix("torch.")
        key = dataset_key(data, val_fraction, max_val, dtype_name)
        marker = out / MARKER
        if marker.exists():
            info = json.loads(marker.read_text())
            if info.get("key") == key:
                log(f"reusing speculators dataset {out}")
                return _from_info(info, out)
            log(f"{out} holds another dataset ({info.get('key')}, not {key}); rewriting it")
        if data.facts.final_state_convention != "post_norm":
            raise Eagle3Error(
                f"shards record final_state_convention {data.facts.final_state_convention!r}; "
                "this conversion turns post_norm states into pre_norm ones"
            )
        refs, n_train = ordered_refs(data, val_fraction, max_val)
        with atomic_directory(out, replace=True) as temp:
            dataset = _write(data, refs, n_train, final_norm, temp, states_dtype, key, log)
        return replace(dataset, root=out)
    finally:
        data.close()


def _from_info(info: dict[str, Any], root: Path) -> OfflineDataset:
    fields = {k: v for k, v in info.items() if k in OfflineDataset.__dataclass_fields__}
    ids = tuple(int(i) for i in fields.pop("aux_layer_ids"))
    return OfflineDataset(**{**fields, "root": root, "aux_layer_ids": (ids[0], ids[1], ids[2])})


def _write(
    data: TrainingData,
    refs: list[SampleRef],
    n_train: int,
    final_norm: torch.Tensor,
    root: Path,
    states_dtype: torch.dtype,
    key: str,
    log: Log,
) -> OfflineDataset:
    from datasets import Dataset
    from safetensors.torch import save_file

    states_dir = root / HIDDEN_STATES_DIR
    states_dir.mkdir(parents=True)
    hidden = data.facts.hidden_size
    rows: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    freq: Counter[int] = Counter()
    started = time.perf_counter()
    for i, ref in enumerate(refs):
        sample = data.readers[ref.shard].sample(ref.index)  # digest-checked
        ids = sample.input_ids.long()
        mask = sample.loss_mask.long()
        aux = sample.aux_hidden_states.float().view(len(ids), -1, hidden)  # [T, num_aux, H]
        last = pre_norm_states(sample.last_hidden_states, final_norm)[:, None, :]
        states = torch.cat([aux, last], dim=1).to(states_dtype).contiguous()  # [T, num_aux + 1, H]
        save_file({"token_ids": ids, "hidden_states": states}, str(states_dir / f"hs_{i}.safetensors"))
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(len(ids))
        freq.update(ids[mask.bool()].tolist())
        if (i + 1) % 500 == 0:
            log(f"  {i + 1}/{len(refs)} samples written ({time.perf_counter() - started:.0f}s)")
    dataset = Dataset.from_dict(rows)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(root))
    # speculators' own file: a dict {token id: count} of Python ints (no other objects), loaded weights_only
    torch.save(dict(sorted(freq.items())), root / TOKEN_FREQ_FILE)
    lengths = rows["seq_len"]
    ids_ = data.facts.trained_from().aux_layer_ids
    result = OfflineDataset(
        root=root,
        samples=len(refs),
        train_samples=n_train,
        tokens=sum(lengths),
        train_tokens=sum(lengths[:n_train]),
        hidden_size=hidden,
        aux_layer_ids=(int(ids_[0]), int(ids_[1]), int(ids_[2])),
        states_dtype=str(states_dtype).removeprefix("torch."),
        key=key,
    )
    atomic_write_json(root / MARKER, result.as_dict())  # last: a directory with it is whole
    log(
        f"  {len(refs)} samples ({n_train} train) in speculators' layout ({time.perf_counter() - started:.0f}s)"
    )
    return result


def write_vocab_files(mapping: VocabMapping, out_dir: Path) -> tuple[Path, Path]:
    """eagle3's mapping as the .npy pair speculators loads with --d2t-path/--t2d-path (same conventions:
    target id = i + d2t[i]; t2d a bool mask over the target vocabulary)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    d2t, t2d = out_dir / D2T_FILE, out_dir / T2D_FILE
    np.save(d2t, mapping.d2t.numpy().astype(np.int64))
    np.save(t2d, mapping.t2d.numpy().astype(np.bool_))
    return d2t, t2d


# ---- the run -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpeculatorsSettings:
    """The flags of one `speculators train` run: its defaults except what is set here (see `flags`)."""

    verifier: Path
    data: Path
    d2t: Path
    t2d: Path
    draft_vocab_size: int
    epochs: int
    ttt_steps: int
    total_seq_len: int  # speculators' max training length (tokens per packed batch): eagle3's max_len
    train_data_ratio: float
    target_layer_ids: tuple[int, int, int]
    hidden_states_dtype: str  # float32 on CPU (eagle3 trains float32 there), its default bfloat16 on GPU
    loss_implementation: str  # eager on CPU (its fused loss is a Triton kernel), its default fused on GPU
    num_workers: int
    draft_attn_impl: str = "sdpa"  # torch has no flex attention backward on CPU
    extra: tuple[str, ...] = field(default_factory=tuple)

    def flags(self, save_path: Path, log_dir: Path) -> list[str]:
        return [
            "--verifier-name-or-path", str(self.verifier),
            "--data-path", str(self.data),
            "--save-path", str(save_path),
            "--log-dir", str(log_dir),
            "--d2t-path", str(self.d2t),
            "--t2d-path", str(self.t2d),
            "--draft-vocab-size", str(self.draft_vocab_size),
            "--epochs", str(self.epochs),
            "--ttt-steps", str(self.ttt_steps),
            "--total-seq-len", str(self.total_seq_len),
            "--train-data-ratio", repr(self.train_data_ratio),
            "--target-layer-ids", *(str(i) for i in self.target_layer_ids),
            "--hidden-states-dtype", self.hidden_states_dtype,
            "--loss-implementation", self.loss_implementation,
            "--num-workers", str(self.num_workers),
            "--draft-attn-impl", self.draft_attn_impl,
            "--on-missing", "raise",  # every sample has its file: a missing one is a bug, never a vLLM call
            *self.extra,
        ]  # fmt: skip

    def key(self, dataset_key: str, mapping_fingerprint: str, device: str) -> str:
        """Same settings, data, mapping, versions and device -> same cached run."""
        identity = {
            "settings": {k: str(v) for k, v in asdict(self).items()},
            "dataset": dataset_key,
            "mapping": mapping_fingerprint,
            "device": device,
            "speculators": SPECULATORS_VERSION,
            "torch": torch.__version__,
            "layout": LAYOUT_VERSION,
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def final_checkpoint(run_dir: Path, epochs: int) -> Path:
    """The drafter speculators saved after its last epoch (its checkpointer writes <save_path>/<epoch>/)."""
    return run_dir / "checkpoints" / str(epochs - 1)


def train_speculators(
    settings: SpeculatorsSettings,
    run_dir: Path,
    log: Log = print,
    timeout_s: float | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """A fresh `speculators train` run in a child process; its result (timings, metrics, checkpoint path).

    `threads`: torch's intra-op threads in the child (None: torch's default). The child's output goes to
    run_dir/train.log; a failed run raises with the log's tail.
    """
    check_speculators_version()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    flags = settings.flags(run_dir / "checkpoints", run_dir / "logs")
    result_path, log_path = run_dir / RESULT_FILE, run_dir / "train.log"
    repo = Path(__file__).resolve().parents[1]
    threading = ["--threads", str(threads)] if threads is not None else []
    command = [sys.executable, "-m", "bench._speculators", str(result_path), *threading, "--", *flags]
    log(f"speculators train {' '.join(flags)}")
    started = time.perf_counter()
    with open(log_path, "wb") as out:
        proc = subprocess.run(command, cwd=repo, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    wall = time.perf_counter() - started
    if proc.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace")[-3000:]
        raise SpeculatorsError(f"speculators train failed (exit {proc.returncode}); {log_path}:\n{tail}")
    result: dict[str, Any] = json.loads(result_path.read_text())
    checkpoint = final_checkpoint(run_dir, settings.epochs)
    if not (checkpoint / "config.json").is_file():
        raise SpeculatorsError(
            f"speculators train finished without a checkpoint at {checkpoint}; see {log_path}"
        )
    result.update({"process_wall_s": round(wall, 2), "checkpoint": str(checkpoint), "log": str(log_path)})
    atomic_write_json(result_path, result)
    return result


# ---- the child process -------------------------------------------------------------------------------------
def _cpu_rebinds() -> list[str]:
    """Rebinds of speculators 0.9.0's launcher so that it trains on a host without an accelerator.

    Its Trainer assumes one: it moves the model and every batch to `get_local_rank()` (the integer 0, which
    torch reads as cuda:0) and its step timer calls `torch.accelerator.synchronize()` around every logged
    step, which raises without an accelerator. The model, the loss and the optimizers are untouched. On a
    host with an accelerator nothing is rebound.
    """
    if torch.accelerator.is_available():
        return []
    import speculators.train.trainer as trainer

    # 1. the device the Trainer puts the model and batches on: the CPU instead of local rank 0 (cuda:0)
    def local_device() -> Any:
        return torch.device("cpu")

    trainer.get_local_rank = local_device

    # 2. nothing runs asynchronously on the CPU, so there is nothing to wait for
    def synchronize(device: Any = None) -> None:
        return None

    torch.accelerator.synchronize = synchronize
    # 3. (not a rebind) its autocast names device type "cuda" when no accelerator is found, which torch
    #    disables with a warning: the CPU run computes in hidden_states_dtype's precision, float32 here.
    return ["Trainer device -> cpu", "torch.accelerator.synchronize -> no-op"]


class _MetricRecords(logging.Handler):
    """Keeps what speculators logs to its metric logger (dicts: per-step train metrics, per-epoch val)."""

    def __init__(self) -> None:
        super().__init__()
        self.train: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if isinstance(msg, dict):
            if "val" in msg:
                self.val.append({"epoch": msg.get("epoch"), **msg["val"]})
            elif "train" in msg:
                step = {"step": msg.get("global_step"), "epoch": msg.get("epoch"), **msg["train"]}
                if msg.get("profile"):  # its own step timer: tokens_per_s, phase times, memory_mb
                    step["profile"] = msg["profile"]
                self.train.append(step)


def _child_main(argv: list[str]) -> int:
    usage = "usage: python -m bench._speculators RESULT.json [--threads N] -- <speculators train flags>"
    if (
        "--" not in argv
        or argv.index("--") not in (1, 3)
        or (argv.index("--") == 3 and argv[1] != "--threads")
    ):
        print(usage, file=sys.stderr)
        return 2
    split = argv.index("--")
    result_path, flags = Path(argv[0]), argv[split + 1 :]
    if split == 3:
        torch.set_num_threads(int(argv[2]))
    started = time.perf_counter()
    rebinds = _cpu_rebinds()
    import speculators.train.trainer as trainer
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    records = _MetricRecords()
    timing: dict[str, Any] = {}
    run_training = trainer.Trainer.run_training

    # Timing the training loop (every epoch's training, validation and checkpoint) from outside it.
    def timed_run_training(self: Any) -> None:
        logging.getLogger("speculators.metrics").addHandler(records)
        timing["steps_per_epoch"] = len(self.train_loader)
        t0 = time.perf_counter()
        run_training(self)
        timing["train_loop_s"] = round(time.perf_counter() - t0, 2)
        timing["steps"] = int(self.global_step)

    trainer.Trainer.run_training = timed_run_training  # type: ignore[method-assign]
    cfg = TrainConfig.resolve(flags)
    main(cfg)
    last_train = records.train[-1] if records.train else {}
    atomic_write_json(
        result_path,
        {
            **timing,
            "child_wall_s": round(time.perf_counter() - started, 2),
            "threads": torch.get_num_threads(),
            "flags": flags,
            "rebinds": rebinds,
            "resolved": {k: str(v) for k, v in cfg.flatten().items()},
            "val": records.val,
            "last_train": last_train,
            "train_steps": records.train,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
