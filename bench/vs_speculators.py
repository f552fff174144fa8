"""eagle3's trainer against vllm-project/speculators 0.9.0's, trained on identical data, measured the same way.

    python -m bench.vs_speculators                                  # default sizes: 27 minutes on 2 CPU cores
    python -m bench.vs_speculators --train-conversations 200 --heldout-prompts 20 --epochs 1   # a quick look
    python -m bench.vs_speculators --skip-speculators --eagle3-set lr=3e-4 --eagle3-set batch_tokens=4096
                                                                    # an ablation: speculators' run is reused

1. Target: the toy target (xs unless --toy-size), built and cached by eagle3_core.toy; its held-out loss is the
   one its build recorded.
2. Data: chitchat conversations ingested as the demo ingests them (human replies, no regeneration, cut at
   --max-len tokens), hidden states extracted by `steps.data.extract_step` (aux layers: the toy's defaults), the
   vocab mapping counted from those shards. Held-out prompts: the first --per-conversation user turns of the
   held-out conversations (held out by sample id at --holdout-fraction; the default 0.02 is the toy target's
   own held-out fraction, so neither the target nor either drafter has seen them).
3. The same states in speculators' offline layout (bench/_speculators.py says how, and how the post-norm
   final state becomes a pre-norm one), with eagle3's d2t/t2d as its vocab mapping and eagle3's training /
   validation split.
4. speculators' own trainer (`speculators train`, in a child process) at its defaults except the matched
   settings: epochs, ttt_steps, the draft vocabulary, the max length (its --total-seq-len), the validation
   split, sdpa attention; on CPU also float32 (eagle3's CPU precision), its eager loss (its fused one is a
   Triton kernel) and no loader workers.
5. eagle3's `train_drafter` at TrainConfig's defaults except the same matched settings (and the device);
   --eagle3-set KEY=VALUE changes any other TrainConfig field (dotted for nested ones: variant.norm_output=true).
6. Both drafters (weights rounded to bf16, as both are saved and served) decoded by eagle3's evaluator,
   `evaluate.measure.measure`, on the same prompts: temperature 0, 64 new tokens, K = 1, 3, 5, 7.
7. AL per K with the paired-bootstrap 95% interval of AL(eagle3) - AL(speculators), per-position acceptance,
   training wall time and tokens/s; written to bench/results/vs_speculators_<device>.json.

Defaults: 1,000 training conversations (933 train + 67 validation samples, 340k tokens), 100 prompts, one
epoch, ttt_steps 3, K=1024 draft ids, max length 512; on CPU one torch thread for everything (--threads).
Measured on this 2-core CPU (load average 1-2.5): data 138 s, speculators 523 s (759 steps, 624 tokens/s),
eagle3 199 s (21 steps, 1,602 tokens/s), evaluation 755 s.

Everything is kept under --workdir (.cache/vs_speculators): data and conversion are reused when their inputs
are unchanged; speculators' run is cached by its inputs and reused with --skip-speculators; eagle3 is
trained afresh on every run (its wall time is what is measured).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

if __package__ in (None, ""):  # run as a file: import `bench` from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._speculators import (
    SPECULATORS_VERSION,
    OfflineDataset,
    SpeculatorsSettings,
    check_speculators_version,
    final_checkpoint,
    train_speculators,
    write_offline_dataset,
    write_vocab_files,
)
from eagle3_core.config import Eagle3Config, TrainConfig, config_from_dict
from eagle3_core.errors import ConfigError, Eagle3Error

Log = Callable[[str], None]
REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
DEFAULT_WORKDIR = REPO / ".cache" / "vs_speculators"
TOY_CACHE = REPO / ".cache" / "eagle3"  # the toy targets the tests and the demo share
DATA_MARKER = "data.json"
BENCH_VERSION = "1"  # bump when what the data step produces changes: it is part of the data key
# TrainConfig fields set from this bench's own options, the same for both trainers (-> the option that sets
# them): --eagle3-set may not change them, or the two runs would no longer see the same samples, length,
# vocabulary or unroll.
MATCHED = {
    "epochs": "--epochs",
    "ttt_steps": "--ttt-steps",
    "draft_vocab_size": "--draft-vocab",
    "max_len": "--max-len",
    "device": "--device",
    "val_fraction": None,  # eagle3's default validation split is the one speculators is given
    "max_val_samples": None,
}


def _log(message: str) -> None:
    print(message, flush=True)


# ---- options -------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR)
    p.add_argument(
        "--toy-cache", type=Path, default=TOY_CACHE, help="where the toy target is built and cached"
    )
    p.add_argument("--toy-size", choices=["xs", "m"], default="xs")
    p.add_argument(
        "--train-conversations", type=int, default=1000, help="at least this many training samples"
    )
    p.add_argument("--heldout-prompts", type=int, default=100)
    p.add_argument("--per-conversation", type=int, default=2, help="user turns of a held-out conversation")
    p.add_argument("--holdout-fraction", type=float, default=0.02)
    p.add_argument("--shard-size", type=int, default=256, help="conversations per ingested shard")
    p.add_argument(
        "--chitchat-rows", type=int, default=None, help="ingest only the first N rows (default all)"
    )
    p.add_argument("--max-len", type=int, default=512, help="samples cut to this many tokens (both trainers)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=1024)
    p.add_argument("--ks", default="1,3,5,7", help="draft lengths K, comma-separated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--eagle3-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a TrainConfig field for eagle3's run (a JSON or YAML value; dotted for nested fields); repeatable",
    )
    p.add_argument(
        "--skip-speculators",
        action="store_true",
        help="reuse the cached speculators run for these inputs (refused if there is none)",
    )
    p.add_argument(
        "--speculators-workers",
        type=int,
        default=None,
        help="speculators' --num-workers (default: 0 on CPU, where spawned workers only compete for the "
        "cores; its own default 12 on GPU)",
    )
    p.add_argument(
        "--speculators-total-seq-len",
        type=int,
        default=None,
        help="speculators' --total-seq-len, the tokens it packs into one step (default --max-len: its attention "
        "over a packed step costs (length x ttt)^2, and eagle3's max_len is the matched setting)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads for both trainers and the evaluation (default: 1 on CPU, torch's own on "
        "GPU). One: on a shared 2-core host, two threads contending with other processes made batch-1 "
        "decoding 5-10x and speculators' 512-token steps 3-7x slower, eagle3's 16k-token steps no faster",
    )
    p.add_argument("--speculators-timeout", type=float, default=None, help="seconds its run may take")
    p.add_argument(
        "--results", type=Path, default=None, help="default bench/results/vs_speculators_<device>.json"
    )
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        args.ks = tuple(sorted({int(k) for k in str(args.ks).split(",") if k.strip()}))
    except ValueError:
        p.error(f"--ks must be comma-separated integers, got {args.ks!r}")
    if not args.ks or min(args.ks) < 1:
        p.error("--ks needs at least one K >= 1")
    for name in (
        "train_conversations",
        "heldout_prompts",
        "per_conversation",
        "shard_size",
        "epochs",
        "ttt_steps",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_new_tokens >= args.max_len:
        p.error("--max-new-tokens must be below --max-len (a prompt and its reply fit the trained length)")
    return args


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda, but no CUDA device is visible")
    return device


def device_label(device: str) -> str:
    """'cpu', or the GPU's name without the vendor ('h200'): the results file's suffix."""
    if device == "cpu":
        return "cpu"
    name = torch.cuda.get_device_name(0).lower().removeprefix("nvidia").strip()
    return re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "cuda"


def eagle3_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    """KEY=VALUE pairs as a nested dict (dotted keys nest; values read as JSON, else YAML), refusing the
    matched fields."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--eagle3-set {pair!r}: expected KEY=VALUE")
        top = key.split(".")[0]
        if top in MATCHED:
            how = f"set it with {MATCHED[top]}" if MATCHED[top] else "the split is speculators' too"
            raise ConfigError(f"--eagle3-set {key}: {top} is matched between the two trainers ({how})")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--eagle3-set {key}: {part} is given both a value and nested fields")
            node = child
        node[parts[-1]] = _value(raw.strip())
    return out


def _value(raw: str) -> Any:
    """JSON first (it reads 3e-4 as a number, which YAML 1.1 does not), then YAML (true, null, names)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return yaml.safe_load(raw)


def eagle3_train_config(args: argparse.Namespace, device: str) -> TrainConfig:
    """TrainConfig's defaults, the --eagle3-set overrides, then the matched fields (which always win)."""
    raw = {
        **eagle3_overrides(args.eagle3_set),
        "epochs": args.epochs,
        "ttt_steps": args.ttt_steps,
        "draft_vocab_size": args.draft_vocab,
        "max_len": args.max_len,
        "device": device,
    }
    try:
        return TrainConfig.model_validate(raw)
    except ValueError as err:  # pydantic's ValidationError is a ValueError
        raise ConfigError(f"--eagle3-set: {err}") from None


# ---- 1 + 2: target and data ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSpec:
    train_conversations: int
    holdout_fraction: float
    shard_size: int
    chitchat_rows: int | None
    max_len: int
    toy_size: str
    device: str

    def key(self) -> str:
        identity = {**asdict(self), "bench": BENCH_VERSION}
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class BenchData:
    root: Path  # the data's directory: the store, the vocab mappings and the speculators dataset live in it
    cfg: Eagle3Config
    target_dir: Path
    shard_paths: list[Path]
    info: dict[str, Any]  # samples, tokens, shard keys, truncation counts, seconds


def data_config(spec: DataSpec, root: Path, toy_cache: Path) -> Eagle3Config:
    """The demo's way to conversations (chitchat, held out by sample id), without regeneration."""
    raw = {
        "store": "store",
        "cache": str(toy_cache.resolve()),
        "data": {
            "dataset": "chat",
            "sources": [{"kind": "chitchat", "limit": spec.chitchat_rows}],
            "shard_size": spec.shard_size,
            "holdout_fraction": spec.holdout_fraction,
        },
        "target": {"path": "toy", "toy": {"size": spec.toy_size, "seed": 0}, "device": spec.device},
        "regenerate": {"enabled": False},
        "tokenize": {"max_seq_len": spec.max_len},
    }
    return config_from_dict(raw, root, "bench/vs_speculators.py")


def build_data(spec: DataSpec, workdir: Path, toy_cache: Path, log: Log) -> BenchData:
    """Ingest, then extract shard after shard until they hold train_conversations samples; reused when whole."""
    from eagle3_core.targets.resolve import target_dir

    root = workdir / f"data-{spec.key()}"
    cfg = data_config(spec, root, toy_cache)
    target = target_dir(cfg, log=log)
    marker = root / DATA_MARKER
    if marker.exists():
        info = json.loads(marker.read_text())
        log(f"reusing data {root}: {info['samples']} samples, {info['tokens']:,} tokens")
        return BenchData(root, cfg, target, [root / p for p in info["shards"]], info)
    shutil.rmtree(root / "store", ignore_errors=True)  # a crashed build is redone from the start
    info = _extract(cfg, spec, log)
    info["shards"] = [str(Path(p).relative_to(root)) for p in info.pop("paths")]
    marker.write_text(json.dumps(info, indent=1) + "\n")  # last: a directory with it is whole
    return BenchData(root, cfg, target, [root / p for p in info["shards"]], info)


def _extract(cfg: Eagle3Config, spec: DataSpec, log: Log) -> dict[str, Any]:
    from eagle3_core.data.ingest import ingest
    from eagle3_core.steps.data import extract_step
    from eagle3_core.store.layout import StoreLayout
    from eagle3_core.store.shards import ShardReader
    from eagle3_core.targets.resolve import open_extraction_target

    started = time.perf_counter()
    report = ingest(cfg, log=lambda m: None)
    log(
        f"ingested {len(report.all_shards)} conversation shards ({report.rows_read} rows, rejected {report.rejected})"
    )
    layout = StoreLayout(cfg.store_root)
    target = open_extraction_target(cfg, log=log)
    paths: list[str] = []
    samples = tokens = truncated = 0
    try:
        for key in report.all_shards:
            if samples >= spec.train_conversations:
                break
            step = extract_step(cfg, key, target)
            truncated += int(step.metadata.get("truncated_samples", 0))
            with ShardReader(layout.hidden_states(key)) as reader:
                samples += len(reader)
                tokens += sum(reader.lengths)
            paths.append(str(layout.hidden_states(key)))
            log(f"  {key}: extracted; {samples} samples, {tokens:,} tokens so far")
    finally:
        target.close()
    if samples < spec.train_conversations:
        raise Eagle3Error(
            f"the corpus gives {samples} training samples, fewer than --train-conversations "
            f"{spec.train_conversations} (--chitchat-rows {spec.chitchat_rows}, --holdout-fraction "
            f"{spec.holdout_fraction})"
        )
    return {
        "samples": samples,
        "tokens": tokens,
        "truncated_samples": truncated,
        "conversation_shards": len(report.all_shards),
        "paths": paths,
        "seconds": round(time.perf_counter() - started, 1),
    }


def vocab_mapping(data: BenchData, k: int, log: Log) -> Any:
    """The draft vocabulary over the extracted shards (the one both trainers use), reused when current."""
    from eagle3_core.draft.vocab import (
        build_vocab_mapping,
        load_vocab_mapping,
        mapping_fingerprint,
        save_vocab_mapping,
    )
    from eagle3_core.store.shards import ShardReader

    with ShardReader(data.shard_paths[0]) as reader:
        fingerprint = reader.meta.tokenizer_fingerprint
        vocab = reader.meta.target_vocab_size(reader.path)
    directory = data.root / f"vocab_mapping-{k}"
    expected = mapping_fingerprint(data.shard_paths, vocab, k, tokenizer_fingerprint=fingerprint)
    if (directory / "vocab_mapping.json").exists():
        return load_vocab_mapping(directory, expected_fingerprint=expected)
    mapping = build_vocab_mapping(data.shard_paths, vocab, k, tokenizer_fingerprint=fingerprint)
    save_vocab_mapping(mapping, directory)
    log(f"draft vocabulary: K={mapping.draft_vocab_size} of {vocab}, coverage {mapping.coverage:.3f}")
    return mapping


def toy_report(target_dir: Path) -> dict[str, Any]:
    from eagle3_core.toy.build import REPORT_FILE, ToyTargetReport

    if not (target_dir / REPORT_FILE).exists():
        raise Eagle3Error(f"{target_dir}: no {REPORT_FILE}; is it a toy target built by eagle3_core.toy?")
    report = ToyTargetReport.of_target(target_dir)
    return {
        k: getattr(report, k)
        for k in (
            "size",
            "params",
            "num_layers",
            "vocab_size",
            "heldout_loss",
            "heldout_tokens",
            "fingerprint",
        )
    }


# ---- 4: speculators ------------------------------------------------------------------------------------
def speculators_settings(
    args: argparse.Namespace, data: BenchData, dataset: OfflineDataset, d2t: Path, t2d: Path, device: str
) -> SpeculatorsSettings:
    cpu = device == "cpu"
    workers = args.speculators_workers if args.speculators_workers is not None else (0 if cpu else 12)
    return SpeculatorsSettings(
        verifier=data.target_dir,
        data=dataset.root,
        d2t=d2t,
        t2d=t2d,
        draft_vocab_size=args.draft_vocab,
        epochs=args.epochs,
        ttt_steps=args.ttt_steps,
        total_seq_len=args.speculators_total_seq_len or args.max_len,
        train_data_ratio=dataset.train_data_ratio,
        target_layer_ids=dataset.aux_layer_ids,
        hidden_states_dtype="float32" if cpu else "bfloat16",
        loss_implementation="eager" if cpu else "fused",
        num_workers=workers,
    )


def run_speculators(
    args: argparse.Namespace,
    settings: SpeculatorsSettings,
    dataset: OfflineDataset,
    mapping_fingerprint: str,
    device: str,
    log: Log,
) -> dict[str, Any]:
    key = settings.key(dataset.key, mapping_fingerprint, device)
    run_dir = args.workdir / f"speculators-{key}"
    result_path = run_dir / "result.json"
    if args.skip_speculators:
        if (
            not result_path.exists()
            or not (final_checkpoint(run_dir, settings.epochs) / "config.json").exists()
        ):
            raise Eagle3Error(
                f"--skip-speculators: no finished speculators run for these inputs at {run_dir}; "
                "run once without --skip-speculators"
            )
        log(f"reusing speculators run {run_dir}")
        result: dict[str, Any] = json.loads(result_path.read_text())
        return {**result, "reused": True, "run_dir": str(run_dir)}
    result = train_speculators(settings, run_dir, log, args.speculators_timeout, args.threads)
    return {**result, "reused": False, "run_dir": str(run_dir)}


# ---- 5: eagle3 ---------------------------------------------------------------------------------------
def run_eagle3(
    cfg: TrainConfig, data: BenchData, mapping: Any, workdir: Path, log: Log
) -> tuple[Any, dict[str, Any]]:
    """A fresh train_drafter run (an earlier one of the same config is removed: its wall time is measured)."""
    from eagle3_core.train.trainer import train_drafter

    identity = {
        "train": cfg.model_dump(mode="json"),
        "mapping": mapping.fingerprint,
        "data": data.info["shards"],
    }
    runs = workdir / "eagle3" / hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    shutil.rmtree(runs, ignore_errors=True)
    started = time.perf_counter()
    result = train_drafter(data.shard_paths, data.target_dir, mapping, runs, cfg, log=_quiet_steps(log))
    wall = time.perf_counter() - started
    return result, {"process_wall_s": round(wall, 2), "run_dir": str(result.run_dir)}


def _quiet_steps(log: Log) -> Log:
    """The trainer's log without its per-step lines (every 10 steps), which bury the bench's own."""

    def out(message: str) -> None:
        if not message.startswith("step "):
            log(message)

    return out


# ---- 6: evaluation ---------------------------------------------------------------------------------------
def bf16_rounded(drafter: Any) -> Any:
    """The drafter with its trained weights rounded to bf16, as both trainers save and serve them; the
    embedding (the target's, frozen) stays as it is."""
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name != "embed_tokens.weight":
                param.copy_(param.to(torch.bfloat16).to(param.dtype))
    return drafter


def load_speculators_drafter(
    checkpoint: Path, embed: torch.Tensor
) -> tuple[Any, torch.Tensor, tuple[int, ...]]:
    """(drafter, d2t, aux layer ids) of a speculators-trained directory, through eagle3's export loader."""
    from eagle3_core.export import load_drafter_dir

    loaded = load_drafter_dir(checkpoint, "auto", embed)
    return loaded.drafter, loaded.d2t, tuple(loaded.info.aux_layer_ids)


def prompt_ids(
    cfg: Eagle3Config, tokenizer: Any, n: int, per_conversation: int, room: int
) -> list[list[int]]:
    from eagle3_core.evaluate.prompts import heldout_prompts
    from eagle3_core.steps.evaluation import encode_fitting

    # every held-out prompt, then the first n that leave room for the reply (a long history does not)
    prompts = heldout_prompts(cfg.store_root, per_conversation=per_conversation, limit=sys.maxsize)
    ids = [encoded for _, encoded in encode_fitting(tokenizer, prompts, room)][:n]
    if len(ids) < n:
        raise Eagle3Error(
            f"{len(ids)} held-out prompts fit (of {len(prompts.prompts)} found, {prompts.reject_counts}), "
            f"fewer than --heldout-prompts {n}: raise --holdout-fraction or --per-conversation"
        )
    return ids


def evaluation_inputs(
    data: BenchData, args: argparse.Namespace, log: Log
) -> tuple[Any, torch.Tensor, list[list[int]]]:
    """(the target as evaluation loads it, its embedding on the CPU, the held-out prompts' token ids)."""
    from eagle3_core.steps.evaluation import load_target

    target = load_target(data.cfg, log)
    embed = target.model.get_input_embeddings().weight.detach().float().cpu()
    room = args.max_len - args.max_new_tokens
    ids = prompt_ids(data.cfg, target.tokenizer, args.heldout_prompts, args.per_conversation, room)
    return target, embed, ids


def measure_drafter(
    target: Any, drafter: Any, d2t: torch.Tensor, ids: list[list[int]], settings: Any, name: str, log: Log
) -> Any:
    from eagle3_core.evaluate.measure import measure

    every = max(1, len(ids) // 4)

    def progress(done: int, total: int) -> None:
        if done % every == 0 or done == total:
            log(f"  {name}: {done}/{total} prompts decoded")

    dtype = next(target.model.parameters()).dtype
    drafter = drafter.to(target.device, dtype).eval()
    return measure(
        target.model,
        drafter,
        d2t.to(target.device),
        target.aux_layer_ids,
        ids,
        target.eos_ids,
        settings,
        progress,
    )


# ---- 7: the report -------------------------------------------------------------------------------------
def comparison(eagle3: Any, speculators: Any, ks: Sequence[int]) -> dict[str, Any]:
    from eagle3_core.evaluate.measure import paired_al_difference

    out: dict[str, Any] = {}
    for k in ks:
        e, s = eagle3.acceptance[k], speculators.acceptance[k]
        diff = paired_al_difference(eagle3.runs[k], speculators.runs[k])
        out[str(k)] = {
            "eagle3_al": round(e.acceptance_length, 4),
            "eagle3_al_ci95": [round(x, 4) for x in eagle3.al_interval(k)],
            "speculators_al": round(s.acceptance_length, 4),
            "speculators_al_ci95": [round(x, 4) for x in speculators.al_interval(k)],
            "eagle3_minus_speculators": diff.as_dict(),
            "eagle3_per_position": [round(x, 4) for x in e.per_position],
            "speculators_per_position": [round(x, 4) for x in s.per_position],
        }
    return out


def training_summary(train_loop_s: float, wall_s: float, steps: int, tokens: int, val: Any) -> dict[str, Any]:
    return {
        "train_loop_s": round(train_loop_s, 2),
        "process_wall_s": round(wall_s, 2),
        "steps": steps,
        "tokens": tokens,
        "tokens_per_s": round(tokens / max(train_loop_s, 1e-9), 1),
        "val": val,
    }


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    cmp = report["comparison"]
    table = Table(
        title=f"AL on {report['eval']['prompts']} held-out prompts (temperature {report['eval']['temperature']})"
    )
    for col in ("K", "eagle3 AL [95%]", "speculators AL [95%]", "eagle3 - speculators [paired 95%]"):
        table.add_column(col, justify="right")
    for k, row in cmp.items():
        d = row["eagle3_minus_speculators"]
        table.add_row(
            k,
            f"{row['eagle3_al']:.3f} [{row['eagle3_al_ci95'][0]:.3f}, {row['eagle3_al_ci95'][1]:.3f}]",
            f"{row['speculators_al']:.3f} [{row['speculators_al_ci95'][0]:.3f}, {row['speculators_al_ci95'][1]:.3f}]",
            f"{d['difference']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]",
        )
    console.print(table)
    pos = Table(title="per-position acceptance (share of rounds whose draft i was accepted)")
    pos.add_column("K", justify="right")
    pos.add_column("trainer")
    pos.add_column("positions 1..K")
    for k, row in cmp.items():
        for who in ("eagle3", "speculators"):
            pos.add_row(k, who, " ".join(f"{x:.3f}" for x in row[f"{who}_per_position"]))
    console.print(pos)
    train = Table(title="training (same samples, epochs, unroll, vocabulary, max length)")
    for col in ("trainer", "steps", "training loop s", "process wall s", "tokens/s"):
        train.add_column(col, justify="right")
    for who in ("eagle3", "speculators"):
        t = report[who]["training"]
        train.add_row(
            who,
            str(t["steps"]),
            f"{t['train_loop_s']:.1f}",
            f"{t['process_wall_s']:.1f}",
            f"{t['tokens_per_s']:,.0f}",
        )
    console.print(train)
    target = report["target"]
    console.print(
        f"target: toy {target['size']} ({target['params']:,} parameters), held-out loss {target['heldout_loss']:.3f} "
        f"over {target['heldout_tokens']:,} tokens; data: {report['data']['train_samples']} training + "
        f"{report['data']['val_samples']} validation samples, {report['data']['tokens']:,} tokens"
    )
    phases = ", ".join(f"{k} {v}s" for k, v in report["seconds"].items())
    loads = ", ".join(f"{k} {v}" for k, v in report["load_average_1m"].items())
    console.print(f"phases: {phases}; 1-minute load average on {report['cpu_count']} cores: {loads}")
    console.print(f"written: {report['results_file']}")


# ---- the run ---------------------------------------------------------------------------------------------
def _load_average() -> float:
    return round(os.getloadavg()[0], 2)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except Eagle3Error as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def run(args: argparse.Namespace, log: Log = _log) -> dict[str, Any]:
    from eagle3_core.evaluate.measure import DecodeSettings
    from eagle3_core.targets.head import load_target_head
    from eagle3_core.train.run_dir import load_trained

    check_speculators_version()
    device = resolve_device(args.device)
    if args.threads is None and device == "cpu":
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    train_cfg = eagle3_train_config(args, device)  # first: a bad --eagle3-set is refused before any work
    args.workdir = args.workdir.resolve()
    seconds: dict[str, float] = {}
    load: dict[str, float] = {}  # the 1-minute load average as each phase starts: the host may be shared
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = round(now - clock, 1)
        clock = now

    log("== 1-2. target, data, vocab mapping")
    spec = DataSpec(
        args.train_conversations, args.holdout_fraction, args.shard_size, args.chitchat_rows, args.max_len,
        args.toy_size, device,
    )  # fmt: skip
    data = build_data(spec, args.workdir, args.toy_cache, log)
    mapping = vocab_mapping(data, args.draft_vocab, log)
    target_info = toy_report(data.target_dir)
    lap("data")

    log("== 3. the same states in speculators' offline layout")
    spec_root = data.root
    head = load_target_head(data.target_dir)
    if head.final_norm is None:
        raise Eagle3Error(
            f"{data.target_dir}: the target has no final norm weight to rebuild pre-norm states"
        )
    states_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    dataset = write_offline_dataset(
        data.shard_paths,
        head.final_norm,
        spec_root / "speculators",
        val_fraction=train_cfg.val_fraction,
        max_val=train_cfg.max_val_samples,
        states_dtype=states_dtype,
        log=log,
    )
    d2t, t2d = write_vocab_files(mapping, spec_root / f"speculators-vocab-{mapping.draft_vocab_size}")
    lap("conversion")
    load["speculators_train"] = _load_average()

    log("== 4. speculators' trainer")
    settings = speculators_settings(args, data, dataset, d2t, t2d, device)
    spec_result = run_speculators(args, settings, dataset, mapping.fingerprint, device, log)
    lap("speculators_train")

    log("== 5. eagle3's trainer")
    load["eagle3_train"] = _load_average()
    result, eagle3_extra = run_eagle3(train_cfg, data, mapping, args.workdir, log)
    lap("eagle3_train")

    log("== 6. evaluation")
    target, embed, ids = evaluation_inputs(data, args, log)
    decode = DecodeSettings(args.ks, args.max_new_tokens, args.temperature, 0)
    e_drafter, e_mapping, _ = load_trained(result.final_dir, embed)
    e_measured = measure_drafter(target, bf16_rounded(e_drafter), e_mapping.d2t, ids, decode, "eagle3", log)
    load["evaluation"] = _load_average()
    s_drafter, s_d2t, s_aux = load_speculators_drafter(Path(spec_result["checkpoint"]), embed)
    if tuple(s_aux) != tuple(target.aux_layer_ids):
        raise Eagle3Error(
            f"speculators' drafter reads aux layers {list(s_aux)}, the target gives {list(target.aux_layer_ids)}"
        )
    if not torch.equal(s_d2t.cpu(), e_mapping.d2t):
        raise Eagle3Error("speculators' drafter carries another draft vocabulary than eagle3's mapping")
    s_measured = measure_drafter(target, bf16_rounded(s_drafter), s_d2t, ids, decode, "speculators", log)
    lap("evaluation")

    epochs = args.epochs
    val_samples = dataset.samples - dataset.train_samples
    spec_loop = float(spec_result.get("train_loop_s", float("nan")))
    label = device_label(device)
    results_file = args.results or RESULTS / f"vs_speculators_{label}.json"
    report: dict[str, Any] = {
        "device": label,
        "torch": torch.__version__,
        "speculators_version": SPECULATORS_VERSION,
        "argv": args.argv,
        "settings": {
            "train_conversations": args.train_conversations,
            "heldout_prompts": args.heldout_prompts,
            "epochs": epochs,
            "ttt_steps": args.ttt_steps,
            "draft_vocab": mapping.draft_vocab_size,
            "max_len": args.max_len,
            "ks": list(args.ks),
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "eagle3_set": list(args.eagle3_set),
        },
        "target": target_info,
        "data": {
            **{k: v for k, v in data.info.items() if k != "shards"},
            "train_samples": dataset.train_samples,
            "val_samples": val_samples,
            "train_tokens": dataset.train_tokens,
            "vocab_coverage": round(mapping.coverage, 4),
            "speculators_states_dtype": dataset.states_dtype,
            "final_state": "post_norm shards; speculators gets post / w, whose RMSNorm gives post back up to a "
            "per-position scale within 1 +- 2e-3 (bf16 rounding of post)",
        },
        "eval": {
            "prompts": len(ids),
            "temperature": args.temperature,
            "weights": "bf16-rounded, float32 compute",
        },
        "comparison": comparison(e_measured, s_measured, args.ks),
        "eagle3": {
            "train_config": train_cfg.model_dump(mode="json"),
            # tokens: the training split's tokens times the epochs, for both trainers alike
            "training": {
                **training_summary(
                    result.seconds,
                    eagle3_extra["process_wall_s"],
                    result.steps,
                    dataset.train_tokens * epochs,
                    result.val,
                ),
                "trainer_counted_tokens": result.tokens,
                "threads": torch.get_num_threads(),
            },
            "drafter_config": e_drafter.cfg.model_dump(),
            "measurement": e_measured.as_dict(),
            "run_dir": eagle3_extra["run_dir"],
        },
        "speculators": {
            "flags": spec_result.get("flags"),
            "rebinds": spec_result.get("rebinds"),
            "reused": spec_result["reused"],
            "training": {
                **training_summary(
                    spec_loop,
                    float(spec_result["process_wall_s"]),
                    int(spec_result.get("steps", 0)),
                    dataset.train_tokens * epochs,
                    spec_result.get("val"),
                ),
                "steps_per_epoch": spec_result.get("steps_per_epoch"),
                "threads": spec_result.get("threads"),
                "last_train": spec_result.get("last_train"),
            },
            "drafter_config": s_drafter.cfg.model_dump(),
            "measurement": s_measured.as_dict(),
            "run_dir": spec_result["run_dir"],
        },
        "seconds": seconds,
        "load_average_1m": load,
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "tokens_definition": "the training split's tokens times the epochs, for both trainers alike",
        "results_file": str(results_file),
    }
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps(report, indent=1) + "\n")
    print_report(report)
    return report


if __name__ == "__main__":
    sys.exit(main())
