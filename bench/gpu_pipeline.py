"""The whole pipeline on a GPU machine, through the `eagle3` commands, then AL and speedup at batch 1.

    python -m bench.gpu_pipeline --stage data    # build the m toy target, ingest, regenerate, extract
    python -m bench.gpu_pipeline --stage train   # vocab mapping, training, both exports
    python -m bench.gpu_pipeline --stage eval    # speculative decoding of the held-out prompts at K = 3, 5, 7
    python -m bench.gpu_pipeline --stage all

Stages are separate so that each fits a time-limited remote command; every step is resumable and skips what
is done. The configuration is bench/configs/h200_m.yaml (chitchat, m toy, regenerated replies). The eval stage
copies the report's numbers to bench/results/gpu_pipeline_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle3_cli.steps import main as eagle3  # noqa: E402
from eagle3_core.config import load_config  # noqa: E402
from eagle3_core.steps.evaluation import read_report  # noqa: E402

STAGES = {
    "data": [["toy-target", "--size", "m"], ["ingest"], ["regenerate"], ["extract"]],
    "train": [["train"], ["export"]],
    "eval": [["eval", "--promote"]],
}


def run_stage(config: Path, stage: str) -> dict[str, float]:
    seconds = {}
    for command in STAGES[stage]:
        start = time.perf_counter()
        code = eagle3(["--config", str(config), *command])
        seconds[command[0]] = round(time.perf_counter() - start, 1)
        print(f"== eagle3 {' '.join(command)}: exit {code}, {seconds[command[0]]} s", flush=True)
        if code != 0:
            raise SystemExit(code)
    return seconds


def record(config: Path, seconds: dict[str, float], out: Path) -> None:
    cfg = load_config(config)
    report = read_report(cfg).model_dump()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    previous = json.loads(out.read_text()) if out.exists() else {}
    result = {
        "device": device,
        "torch": torch.__version__,
        "config": str(config.relative_to(REPO)),
        "seconds": {**previous.get("seconds", {}), **seconds},
        "report": report,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stage", choices=[*STAGES, "all"], required=True)
    parser.add_argument("--config", type=Path, default=REPO / "bench" / "configs" / "h200_m.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gpu_pipeline_h200.json")
    args = parser.parse_args()
    seconds: dict[str, float] = {}
    for stage in STAGES if args.stage == "all" else [args.stage]:
        seconds.update(run_stage(args.config, stage))
    if args.stage in ("eval", "all"):
        record(args.config, seconds, args.out)


if __name__ == "__main__":
    main()
