"""Which model directory a config means (a Hugging Face directory, or the toy target eagle3 builds), and which
backend computes its hidden states at extraction (`target.backend`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from eagle3_core.config import Eagle3Config

if TYPE_CHECKING:  # resolving a directory must not import torch (`eagle3 stats` never does)
    import torch

    from eagle3_core.targets.base import HiddenStates, SampleFailure, TargetInfo


def target_dir(cfg: Eagle3Config, log: Callable[[str], None] = print) -> Path:
    if cfg.target.path == "toy":
        from eagle3_core.toy.build import ensure_toy_target

        return ensure_toy_target(cfg.cache_root, cfg.target.toy.size, cfg.target.toy.seed, log=log)
    path = cfg.resolve(cfg.target.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"target.path: {path} is not a Hugging Face model directory (no config.json)")
    return path


class ExtractionTarget(Protocol):
    """What extraction needs of a target, whichever backend computes the states: `TargetBackend` (its info
    and `hidden_states`), the tokenizer the chat template and loss mask come from (always the target
    directory's), its fingerprint, and a way to let go of what it holds."""

    info: TargetInfo
    tokenizer: Any
    tokenizer_fingerprint: str

    def hidden_states(
        self, batch: Sequence[Sequence[int]], dtype: torch.dtype | None = None
    ) -> list[HiddenStates | SampleFailure]: ...

    def close(self, timeout_s: float = 60.0) -> float: ...


def open_extraction_target(cfg: Eagle3Config, log: Callable[[str], None] = print) -> ExtractionTarget:
    """The hidden-state backend `target.backend` names (transformers unless set otherwise)."""
    model_dir = target_dir(cfg, log=log)
    backend = cfg.target.backend
    if backend == "sglang_http":
        from eagle3_core.targets.sglang import SGLangHttpBackend

        assert cfg.target.sglang_url is not None  # the config refuses sglang_http without it
        log(f"hidden states from the SGLang server at {cfg.target.sglang_url}")
        return SGLangHttpBackend(
            cfg.target.sglang_url, model_dir, cfg.target, max_seq_len=cfg.tokenize.max_seq_len
        )
    if backend == "sglang_engine":
        from eagle3_core.targets.sglang import SGLangEngineBackend

        log(f"starting sglang.Engine over {model_dir} (tp {cfg.sglang.tp_size})")
        return SGLangEngineBackend(
            model_dir,
            cfg.target,
            tp_size=cfg.sglang.tp_size,
            mem_fraction_static=cfg.sglang.mem_fraction_static,
        )
    from eagle3_core.targets.hf import TransformersTarget

    return TransformersTarget(model_dir, cfg.target)
