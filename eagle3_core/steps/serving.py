"""The exact commands that serve an exported drafter with SGLang and with vLLM (`eagle3 serve-command`, and
drafter_export's asset page).

SGLang loads `<export>/sglang` through `--speculative-draft-model-path`; vLLM loads `<export>/speculators`
through `--speculative-config` (method `eagle3`). Where the export's evaluation wrote a serving recommendation
(eval/serving-<format>.json, evaluate/serving_k.py) that drafts at some batch size, each engine gets the K it
chose at each batch size in its own terms: SGLang 0.5.23 `--speculative-adaptive` with
`--speculative-adaptive-config` naming eval/sglang-adaptive-<format>.json (one candidate step count per
batch-size key), vLLM `num_speculative_tokens_per_batch_size` in its speculative config ([first, last, K]
ranges). Otherwise both draft K = `evaluate.gate_k` tokens a round, the K the promotion gate measured, and a
line says why. The target is the one the export was made for, as its config.json records it.

A drafter trained with a sliding window W: vLLM reads it from the speculators config, SGLang takes it only as
the server argument `--speculative-draft-window-size`, which counts the keys left of the query (W - 1; see
export/sglang.py), so the SGLang command passes it from the export's provenance block.

Reads config.json files only, through the export's own models of them (engines/engine_config.py, which imports
no torch), so printing the commands never imports torch.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pydantic import Field

from eagle3_core.config import Eagle3Config
from eagle3_core.engines.engine_config import (
    CONFIG_FILE,
    PROVENANCE_KEY,
    VARIANT_KEY,
    EngineModel,
    Provenance,
    SpeculatorsBlock,
    validated,
)
from eagle3_core.engines.sglang_server import launch_command
from eagle3_core.errors import Eagle3Error
from eagle3_core.evaluate.serving_k import (
    k_by_batch_size,
    recommendation_lines,
    serving_file,
    sglang_adaptive_config,
    sglang_config_file,
    vllm_per_batch_size,
)
from eagle3_core.store.atomic import atomic_write_json, read_json_object
from eagle3_core.store.layout import StoreLayout, export_eval_dir
from eagle3_core.store.promotion import read_current
from eagle3_core.store.records import ServingRecommendation
from eagle3_core.targets.gguf import is_gguf_target


class ServedSGLangConfig(EngineModel):
    """What serving reads of `<export>/sglang/config.json`: our provenance block (under PROVENANCE_KEY),
    absent from a drafter made elsewhere. The engine's fields are kept aside unread: the
    export's check validates them, this only prints commands."""

    provenance: Provenance | None = Field(default=None, alias="eagle3_export")  # PROVENANCE_KEY


class ServedSpeculatorsConfig(EngineModel):
    """What serving reads of `<export>/speculators/config.json`: the `speculators_config` block, its verifier."""

    speculators_config: SpeculatorsBlock | None = None


C = TypeVar("C", ServedSGLangConfig, ServedSpeculatorsConfig)


def served_export(cfg: Eagle3Config) -> tuple[Path, str]:
    """The export to serve and why: the promoted one (`drafter/current`), else the newest complete export."""
    layout = StoreLayout(cfg.store_root)
    current = layout.drafter_current_link
    if (current / "sglang" / CONFIG_FILE).is_file():
        # the link itself, not where it points: a server restarted after the next promotion serves that one
        return current, "promoted: drafter/current"
    exports = (
        sorted(
            (p for p in layout.exports.iterdir() if _both_formats(p)),
            key=lambda p: (p / "sglang" / CONFIG_FILE).stat().st_mtime,
        )
        if layout.exports.is_dir()
        else []
    )
    if not exports:
        raise Eagle3Error(
            f"{layout.exports}: no exported drafter yet (materialize drafter_export, or run `eagle3 export`)"
        )
    return exports[-1], "newest export, not promoted"


def _both_formats(export_dir: Path) -> bool:
    """A published export (not a writer's hidden temporary) with both formats' config.json: one with
    `sglang/` alone was cut short by an older eagle3 and cannot be served by vLLM."""
    return not export_dir.name.startswith(".") and all(
        (export_dir / name / CONFIG_FILE).is_file() for name in ("sglang", "speculators")
    )


def _config(model: type[C], directory: Path) -> C:
    """`directory`'s config.json as `model`; an Eagle3Error (ExportError) naming the file and the field."""
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise Eagle3Error(f"{directory}: not an export (no config.json)")
    return validated(model, read_json_object(path, Eagle3Error), str(directory), ours=False)


def served_target(cfg: Eagle3Config, export_dir: Path) -> str:
    """The target the export drafts for: our provenance block, else speculators' verifier, else the config."""
    block = _config(ServedSGLangConfig, export_dir / "sglang").provenance
    name = block.target.name_or_path if block is not None and block.target is not None else None
    if not name and (export_dir / "speculators" / "config.json").is_file():
        speculators = _config(ServedSpeculatorsConfig, export_dir / "speculators").speculators_config
        name = speculators.verifier.name_or_path if speculators is not None else None
    if not name:
        if cfg.target.path == "toy" or is_gguf_target(cfg.target.path):  # built here: no path to serve from
            raise Eagle3Error(f"{export_dir}: the export does not say which target it was made for")
        name = str(cfg.resolve(cfg.target.path))
    return str(name)


def sglang_draft_window(export_dir: Path) -> int | None:
    """SGLang's `--speculative-draft-window-size` for the export's drafter, None without a window.

    Our window W admits the W keys in (q - W, q]; SGLang's S the keys in [q - S, q]: S = W - 1 (the exporter
    refuses W = 1, which SGLang cannot take).
    """
    block = _config(ServedSGLangConfig, export_dir / "sglang").provenance
    variant = block.drafter_variant if block is not None else None
    window = variant.sliding_window if variant is not None else None
    if window is None:
        return None
    if window < 2:
        raise Eagle3Error(
            f"{export_dir / 'sglang' / 'config.json'}: {PROVENANCE_KEY}.{VARIANT_KEY}.sliding_window is "
            f"{window!r}, not a window SGLang can take (an integer >= 2)"
        )
    return window - 1


def sglang_serve_argv(
    cfg: Eagle3Config,
    export_dir: Path,
    target: str | None = None,
    adaptive: AdaptiveServing | None = None,
) -> list[str]:
    """SGLang's launch_server drafting `evaluate.gate_k` tokens a round, or, with `adaptive`, the K its table
    gives each batch size (`--speculative-adaptive`; the largest K as `--speculative-num-steps`, which SGLang
    requires to be one of the table's)."""
    target = target or served_target(cfg, export_dir)
    k = adaptive.largest_k if adaptive is not None else None
    argv = launch_command(cfg, target, "serve", drafter_dir=export_dir / "sglang", k=k)
    window = sglang_draft_window(export_dir)
    if window is not None:
        argv += ["--speculative-draft-window-size", str(window)]
    if adaptive is not None:
        argv += ["--speculative-adaptive", "--speculative-adaptive-config", str(adaptive.sglang_config)]
    return argv


def vllm_serve_argv(
    cfg: Eagle3Config,
    export_dir: Path,
    target: str | None = None,
    adaptive: AdaptiveServing | None = None,
) -> list[str]:
    """vLLM serving the speculators export drafting `evaluate.gate_k` tokens a round, or, with `adaptive`, the
    K its `num_speculative_tokens_per_batch_size` gives each batch size (vLLM caps each at
    `num_speculative_tokens`, so that is the largest)."""
    target = target or served_target(cfg, export_dir)
    spec: dict[str, Any] = {
        "method": "eagle3",
        "model": str(export_dir / "speculators"),
        "num_speculative_tokens": cfg.evaluate.gate_k if adaptive is None else adaptive.largest_k,
    }
    if adaptive is not None:
        spec["num_speculative_tokens_per_batch_size"] = vllm_per_batch_size(adaptive.recommendation)
    return [
        "vllm",
        "serve",
        target,
        "--tensor-parallel-size",
        str(cfg.sglang.tp_size),
        "--speculative-config",
        json.dumps(spec),
    ]


# ---- the serving recommendation -------------------------------------------------------------------------------
@dataclass(frozen=True)
class AdaptiveServing:
    """A recommendation that drafts at some batch size, and SGLang's table of it, in the export's eval/."""

    recommendation: ServingRecommendation
    sglang_config: Path

    @property
    def largest_k(self) -> int:
        return max(self.recommendation.best_k().values())


def served_eval_dir(cfg: Eagle3Config, export_dir: Path) -> Path:
    """The eval/ directory of the export served: for the promoted drafter (`current`, a promotion directory
    holding no eval/), its run's export as the promotion record names it; else `export_dir`'s own."""
    layout = StoreLayout(cfg.store_root)
    current = layout.drafter_current_link
    if current.exists() and export_dir.resolve() == current.resolve():
        record = read_current(layout)
        if record is not None:
            return export_eval_dir(layout.from_pointer(record.export_dir))
    return export_eval_dir(export_dir)


def served_recommendation(
    cfg: Eagle3Config, export_dir: Path
) -> tuple[ServingRecommendation | None, AdaptiveServing | None, str]:
    """The export's serving recommendation (evaluate/serving_k.py, in `evaluate.export_format`'s file), the
    engines' per-batch-size arguments from it where it drafts at some batch size, and a line saying what they
    are, or why there are none. SGLang's table is written again (atomically) where its file is missing or
    holds another table, so the path printed always holds what the recommendation says."""
    eval_dir = served_eval_dir(cfg, export_dir)
    path = serving_file(eval_dir, cfg.evaluate.export_format)
    if not path.is_file():
        return (
            None,
            None,
            (
                f"no serving recommendation ({path} is absent: the export's evaluation predates it, or the export "
                f"is not evaluated); drafting K={cfg.evaluate.gate_k} (evaluate.gate_k) at every batch size"
            ),
        )
    recommendation = ServingRecommendation.read(path)
    if recommendation.unmeasured is not None:
        return (
            recommendation,
            None,
            (
                f"no serving recommendation: {recommendation.unmeasured} ({path}); drafting "
                f"K={cfg.evaluate.gate_k} (evaluate.gate_k) at every batch size"
            ),
        )
    if not any(recommendation.best_k().values()):
        return (
            recommendation,
            None,
            (
                f"serving recommendation ({path}): plain decoding is faster than drafting at every batch size "
                "measured, so serve the target alone; the commands below draft "
                f"K={cfg.evaluate.gate_k} (evaluate.gate_k)"
            ),
        )
    table = sglang_config_file(eval_dir, recommendation.format)
    wanted = sglang_adaptive_config(recommendation)
    try:
        if not table.is_file() or read_json_object(table, Eagle3Error) != wanted:
            atomic_write_json(table, wanted)
    except OSError as err:
        raise Eagle3Error(f"{table}: SGLang's adaptive table could not be written: {err}") from None
    line = f"K by batch size {k_by_batch_size(recommendation)} (serving recommendation, {path})"
    return recommendation, AdaptiveServing(recommendation, table), line


def serve_commands(cfg: Eagle3Config, export_dir: Path | None = None) -> dict[str, str]:
    """Shell lines (quoted with shlex) serving `export_dir`, or the promoted (else newest) export, with the K
    its serving recommendation chose at each batch size where it has one, else `evaluate.gate_k`.

    Keys: drafter (the export directory), which (why that one), target, k (evaluate.gate_k), serving (a line:
    the K by batch size and the file it is from, or why `k` is drafted), figures (the tokens/s each K was
    chosen from, a line a batch size; "" without them), sglang_adaptive_config (SGLang's table file, "" when
    not used), sglang, vllm.
    """
    if export_dir is None:
        export_dir, which = served_export(cfg)
    else:
        which = "this export"
    if not (export_dir / "speculators" / "config.json").is_file():
        raise Eagle3Error(f"{export_dir}: no speculators export beside the sglang one (run `eagle3 export`)")
    target = served_target(cfg, export_dir)
    recommendation, adaptive, serving = served_recommendation(cfg, export_dir)
    measured = recommendation is not None and recommendation.unmeasured is None
    return {
        "drafter": str(export_dir),
        "which": which,
        "target": target,
        "k": str(cfg.evaluate.gate_k),
        "serving": serving,
        "figures": "\n".join(recommendation_lines(recommendation)) if recommendation and measured else "",
        "sglang_adaptive_config": str(adaptive.sglang_config) if adaptive is not None else "",
        "sglang": shlex.join(sglang_serve_argv(cfg, export_dir, target, adaptive)),
        "vllm": shlex.join(vllm_serve_argv(cfg, export_dir, target, adaptive)),
    }


def serve_markdown(commands: dict[str, str]) -> str:
    """The two commands as Markdown, for an asset page."""
    said = commands["serving"]  # the K drafted at each batch size and where from, or why evaluate.gate_k
    drafting = f"{said[:1].upper()}{said[1:]}."
    figures = f"\n\n```text\n{commands['figures']}\n```" if commands.get("figures") else ""
    return (
        f"{drafting} Target `{commands['target']}`.{figures}\n\n"
        f"**SGLang**\n\n```bash\n{commands['sglang']}\n```\n\n"
        f"**vLLM**\n\n```bash\n{commands['vllm']}\n```\n"
    )
