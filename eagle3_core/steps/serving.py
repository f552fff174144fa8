"""The exact commands that serve an exported drafter with SGLang and with vLLM (`eagle3 serve-command`, and
drafter_export's asset page).

SGLang loads `<export>/sglang` through `--speculative-draft-model-path`; vLLM loads `<export>/speculators`
through `--speculative-config` (method `eagle3`). Both draft K = `evaluate.gate_k` tokens a round, the K the
promotion gate measured. The target is the one the export was made for, as its config.json records it.

A drafter trained with a sliding window W: vLLM reads it from the speculators config, SGLang takes it only as
the server argument `--speculative-draft-window-size`, which counts the keys left of the query (W - 1; see
export/sglang.py), so the SGLang command passes it from the export's provenance block.

Reads config.json files only, through the export's own models of them (engines/engine_config.py, which imports
no torch), so printing the commands never imports torch.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TypeVar

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
from eagle3_core.store.atomic import read_json_object
from eagle3_core.store.layout import StoreLayout
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


def sglang_serve_argv(cfg: Eagle3Config, export_dir: Path, target: str | None = None) -> list[str]:
    target = target or served_target(cfg, export_dir)
    argv = launch_command(cfg, target, "serve", drafter_dir=export_dir / "sglang")
    window = sglang_draft_window(export_dir)
    if window is not None:
        argv += ["--speculative-draft-window-size", str(window)]
    return argv


def vllm_serve_argv(cfg: Eagle3Config, export_dir: Path, target: str | None = None) -> list[str]:
    target = target or served_target(cfg, export_dir)
    spec = {
        "method": "eagle3",
        "model": str(export_dir / "speculators"),
        "num_speculative_tokens": cfg.evaluate.gate_k,
    }
    return [
        "vllm",
        "serve",
        target,
        "--tensor-parallel-size",
        str(cfg.sglang.tp_size),
        "--speculative-config",
        json.dumps(spec),
    ]


def serve_commands(cfg: Eagle3Config, export_dir: Path | None = None) -> dict[str, str]:
    """Shell lines (quoted with shlex) serving `export_dir`, or the promoted (else newest) export.

    Keys: drafter (the export directory), which (why that one), target, k, sglang, vllm.
    """
    if export_dir is None:
        export_dir, which = served_export(cfg)
    else:
        which = "this export"
    if not (export_dir / "speculators" / "config.json").is_file():
        raise Eagle3Error(f"{export_dir}: no speculators export beside the sglang one (run `eagle3 export`)")
    target = served_target(cfg, export_dir)
    return {
        "drafter": str(export_dir),
        "which": which,
        "target": target,
        "k": str(cfg.evaluate.gate_k),
        "sglang": shlex.join(sglang_serve_argv(cfg, export_dir, target)),
        "vllm": shlex.join(vllm_serve_argv(cfg, export_dir, target)),
    }


def serve_markdown(commands: dict[str, str]) -> str:
    """The two commands as Markdown, for an asset page."""
    return (
        f"Drafting K={commands['k']} tokens a round (`evaluate.gate_k`), target `{commands['target']}`.\n\n"
        f"**SGLang**\n\n```bash\n{commands['sglang']}\n```\n\n"
        f"**vLLM**\n\n```bash\n{commands['vllm']}\n```\n"
    )
