"""The speculators export: the format the PyPI `speculators` package (0.9.0) and vLLM load.

Read from speculators 0.9.0 (`speculators/models/eagle3/config.py`, `core.py`, `model.py`, `train/cli.py`,
`train/checkpointer.py`):
- config.json is an `Eagle3SpeculatorConfig`: `speculators_model_type: "eagle3"`, a Llama
  `transformer_layer_config` (its `vocab_size` is the target's), `draft_vocab_size`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`, the variant flags `norm_before_residual`, `norm_before_fc`, `fc_norm`,
  `norm_output`, and `speculators_config` (algorithm, greedy proposal with `speculative_tokens`, verifier
  `name_or_path` + `architectures`).
- weights (`model.safetensors`, from `save_pretrained`) are `Eagle3DraftModel.state_dict()` less its verifier
  copies: `embed_tokens.weight` (the target's embedding; its own trainer saves it, vLLM uses it when present),
  `fc.weight`, `input_norm.weight` (norm_before_fc), `fc_norm.{i}.weight` (fc_norm), `layers.0.*` (our
  `midlayer.*`), `norm.weight`, `lm_head.weight`, and `d2t`, `t2d` unless the draft vocab is the target's.

Variants: the four flags are top-level fields, and vLLM (`configs/speculators/algos.py`) and speculators read
them there. Every one is written explicitly: vLLM takes an absent `norm_before_residual` as TRUE while the
speculators config defaults it false, so a directory without it (ours or not) is refused as ambiguous; the
others default false in both. The sliding window lives in `transformer_layer_config`: `layer_types` says which
layers are `sliding_attention` and `sliding_window` how wide (the W keys in (q - W, q], as vLLM and transformers
count). Without `layer_types` both run full attention whatever `sliding_window` says. speculators' own trainer
defaults to a window of 2048 on every layer and norm_before_fc, norm_output and norm_before_residual true; such
a directory loads as exactly that drafter.

Layer ids: vLLM and speculators number an aux layer by how many decoder layers ran before it, which is the
project convention, so they are written as they are. Without them both use (2, L//2, L-3) for the target.

The speculators package itself sizes `fc` as 3 x the drafter's hidden size, so it loads only drafters whose
hidden size equals the target's (vLLM reads `target_hidden_size`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.errors import ExportError
from eagle3_core.export.common import (
    FLAGS,
    PROVENANCE_KEY,
    ConfigFacts,
    ExportFormat,
    ExportTarget,
    FormatName,
    LayerTarget,
    drafter_config,
    expect,
    field,
    layer_ids,
    llama_layer_config,
    optional_field,
    read_external_layer,
    read_flag,
    read_llama_layer,
    write_export,
)

SPECULATORS_VERSION = "0.9.0"  # the release whose format this writes (and whose loader the tests run)
ARCHITECTURE = "Eagle3Speculator"
LAYER_CONFIG = "transformer_layer_config"
SLIDING, FULL = "sliding_attention", "full_attention"
# what speculators' Eagle3DraftModel holds beside the drafter, for its training loss; never part of the network
VERIFIER_KEYS = ("verifier_lm_head.weight", "verifier_norm.weight")


class SpeculatorsFormat(ExportFormat):
    name: ClassVar[FormatName] = "speculators"
    layer_prefix: ClassVar[str] = "layers.0."
    with_embedding: ClassVar[bool] = True

    def __init__(self, speculative_tokens: int = 3) -> None:
        if speculative_tokens < 1:
            raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
        self.speculative_tokens = speculative_tokens  # vLLM's default num_speculative_tokens for this drafter

    def engine_layer_ids(
        self, project_ids: tuple[int, int, int], target: LayerTarget
    ) -> tuple[int, int, int]:
        if 0 in project_ids:
            # vLLM's Llama adds the residual to the state entering each aux layer, and layer 0 has none yet
            # (its capture fails at the first forward): the embeddings cannot be an aux state there
            raise ExportError(
                f"aux layer ids {list(project_ids)}: vLLM cannot capture the input of layer 0 (it has no residual "
                "yet); train with target.aux_layer_ids >= 1 for a speculators/vLLM export"
            )
        return project_ids

    def project_layer_ids(
        self, engine_ids: tuple[int, int, int], target: LayerTarget
    ) -> tuple[int, int, int]:
        return engine_ids  # vLLM captures the input of each id's layer, for every model

    def check_expressible(self, cfg: DrafterConfig) -> None:
        """Every variant of ours has its field here."""

    def build_config(
        self, cfg: DrafterConfig, target: ExportTarget, dtype: torch.dtype, provenance: dict[str, Any]
    ) -> dict[str, Any]:
        layer = {
            **llama_layer_config(cfg, target, dtype),
            "sliding_window": cfg.sliding_window,
            "layer_types": [FULL if cfg.sliding_window is None else SLIDING],
        }
        return {
            "architectures": [ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            LAYER_CONFIG: layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(
                self.engine_layer_ids(target.aux_layer_ids, target.layers)
            ),
            **{flag: getattr(cfg, flag) for flag in FLAGS},
            "embed_requires_grad": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.speculative_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "verifier": {
                    "name_or_path": target.name_or_path,
                    "architectures": list(target.architectures),
                },
            },
            PROVENANCE_KEY: provenance,
        }

    def read_config(self, config: dict[str, Any], where: str, *, ours: bool) -> ConfigFacts:
        kind = field(config, "speculators_model_type", str, where)
        expect(kind == "eagle3", where, f"speculators_model_type must be 'eagle3', got {kind!r}")
        # required of any directory: vLLM's default (true) and speculators' (false) differ
        flags = {"norm_before_residual": field(config, "norm_before_residual", bool, where)}
        flags |= {flag: read_flag(config, flag, where, ours=ours) for flag in FLAGS if flag not in flags}
        path = "eagle_aux_hidden_state_layer_ids"
        raw_ids = (
            field(config, path, list, where) if ours else optional_field(config, path, list, None, where)
        )
        ids = None if raw_ids is None else layer_ids(raw_ids, path, where)
        expect(ids is None or min(ids) >= 0, where, f"{path} {raw_ids} must be >= 0")
        self._check_speculators_config(config, where, ours=ours)
        layer = field(config, LAYER_CONFIG, dict, where)
        if ours:
            sizes, dtype = read_llama_layer(layer, where, LAYER_CONFIG, require_rope_theta=False)
        else:
            sizes, dtype = read_external_layer(layer, where, LAYER_CONFIG), None
        target_hidden = (
            field(config, "target_hidden_size", (int, type(None)), where)
            if ours
            else optional_field(config, "target_hidden_size", (int, type(None)), None, where)
        )
        draft_vocab = optional_field(config, "draft_vocab_size", int, None, where)
        expect(
            draft_vocab is not None,
            where,
            "config field 'draft_vocab_size' is missing (vLLM would take the target's vocab, speculators 32000)",
        )
        return ConfigFacts(
            drafter=drafter_config(
                {
                    **sizes,
                    "target_hidden_size": sizes["hidden_size"] if target_hidden is None else target_hidden,
                    "draft_vocab_size": draft_vocab,
                    **flags,
                    "sliding_window": _window(layer, where, ours=ours),
                },
                where,
            ),
            engine_aux_layer_ids=ids,
            dtype=dtype,
        )

    def _check_speculators_config(self, config: dict[str, Any], where: str, *, ours: bool) -> None:
        """What vLLM's speculators reader needs (`validate_speculators_config`), and ours always writes."""
        spec = "speculators_config"
        expect(
            field(config, f"{spec}.algorithm", str, where) == "eagle3",
            where,
            f"{spec}.algorithm must be 'eagle3'",
        )
        methods = field(config, f"{spec}.proposal_methods", list, where)
        expect(
            bool(methods) and all(isinstance(m, dict) for m in methods),
            where,
            f"{spec}.proposal_methods must list proposals",
        )
        tokens = field(methods[0], "speculative_tokens", int, where, f"{spec}.proposal_methods[0]")
        expect(tokens >= 1, where, f"speculative_tokens must be >= 1, got {tokens}")
        default = field(config, f"{spec}.default_proposal_method", str, where)
        expect(
            default in [m.get("proposal_type") for m in methods],
            where,
            f"default_proposal_method {default!r} is not a listed proposal",
        )
        # speculators' trainer may save a verifier without a path (null); vLLM only needs the field there
        field(config, f"{spec}.verifier.name_or_path", str if ours else (str, type(None)), where)
        if ours:
            field(config, f"{spec}.verifier.architectures", list, where)

    def external_optional(self, cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
        # the package drops its verifier copies on save; other versions or tools may keep them
        verifier = {
            VERIFIER_KEYS[0]: (cfg.draft_vocab_size, cfg.hidden_size),
            VERIFIER_KEYS[1]: (cfg.hidden_size,),
        }
        return super().external_optional(cfg) | verifier


def _window(layer: dict[str, Any], where: str, *, ours: bool) -> int | None:
    """The decoder layer's sliding window, as vLLM and speculators read it: `layer_types[0]` decides."""
    types = (
        field(layer, "layer_types", list, where, LAYER_CONFIG)
        if ours
        else optional_field(layer, "layer_types", list, None, where, LAYER_CONFIG)
    )
    if ours:
        field(layer, "sliding_window", (int, type(None)), where, LAYER_CONFIG)  # written either way
    if types is None:
        return None
    expect(
        len(types) == 1 and types[0] in (SLIDING, FULL),
        where,
        f"{LAYER_CONFIG}.layer_types must be [{SLIDING!r}] or [{FULL!r}] (one decoder layer), got {types!r}",
    )
    window = optional_field(layer, "sliding_window", (int, type(None)), None, where, LAYER_CONFIG)
    if types[0] == FULL:
        expect(
            not ours or window is None,
            where,
            f"{LAYER_CONFIG}.sliding_window {window} with full attention",
        )
        return None
    expect(
        window is not None and window > 0,
        where,
        f"{LAYER_CONFIG}.layer_types is [{SLIDING!r}] but sliding_window is {window!r}",
    )
    return int(window)


SPECULATORS = SpeculatorsFormat()


def export_speculators(
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: ExportTarget,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    speculative_tokens: int = 3,
) -> Path:
    """Write a validated speculators/vLLM drafter directory at `out_dir` (replacing one there, atomically)."""
    return write_export(SpeculatorsFormat(speculative_tokens), drafter, mapping, target, out_dir, dtype)
