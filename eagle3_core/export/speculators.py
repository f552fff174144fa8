"""The speculators export: the format the PyPI `speculators` package (0.9.0) and vLLM load.

Read from speculators 0.9.0 (`speculators/models/eagle3/config.py`, `core.py`, `model.py`, and
`convert/eagle/eagle3_converter.py`, its own SGLang-to-speculators converter):
- config.json is an `Eagle3SpeculatorConfig`: `speculators_model_type: "eagle3"`, a Llama
  `transformer_layer_config` (its `vocab_size` is the target's), `draft_vocab_size`, `target_hidden_size`,
  `eagle_aux_hidden_state_layer_ids`, the architecture flags `norm_before_residual`, `norm_before_fc`,
  `fc_norm`, `norm_output`, and `speculators_config` (algorithm, greedy proposal with `speculative_tokens`,
  verifier `name_or_path` + `architectures`).
- weights are `Eagle3DraftModel.state_dict()` less its verifier copies: `embed_tokens.weight` (the target's
  embedding; its own trainer saves it, vLLM uses it when present), `fc.weight`, `layers.0.*` (our `midlayer.*`),
  `norm.weight`, `lm_head.weight`, `d2t`, `t2d`.
Every architecture flag is written explicitly, false: vLLM takes an absent `norm_before_residual` as true
(`configs/speculators/algos.py`), which is another network than the one we train (REFERENCE.md failure mode 11).

Layer ids: vLLM and speculators number an aux layer by how many decoder layers ran before it, which is the
project convention, so they are written as they are.

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
    PROVENANCE_KEY,
    ConfigFacts,
    ExportFormat,
    ExportTarget,
    FormatName,
    expect,
    field,
    layer_ids,
    llama_layer_config,
    read_llama_layer,
    write_export,
)

SPECULATORS_VERSION = "0.9.0"  # the release whose format this writes (and whose loader the tests run)
ARCHITECTURE = "Eagle3Speculator"
LAYER_CONFIG = "transformer_layer_config"
# architecture flags of speculators' Eagle3 that our drafter does not have: all must be false
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


class SpeculatorsFormat(ExportFormat):
    name: ClassVar[FormatName] = "speculators"
    layer_prefix: ClassVar[str] = "layers.0."
    with_embedding: ClassVar[bool] = True

    def __init__(self, speculative_tokens: int = 3) -> None:
        if speculative_tokens < 1:
            raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
        self.speculative_tokens = speculative_tokens  # vLLM's default num_speculative_tokens for this drafter

    def engine_layer_ids(self, project_ids: tuple[int, int, int]) -> tuple[int, int, int]:
        return project_ids

    def project_layer_ids(self, engine_ids: tuple[int, int, int]) -> tuple[int, int, int]:
        return engine_ids

    def build_config(
        self, cfg: DrafterConfig, target: ExportTarget, dtype: torch.dtype, provenance: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "architectures": [ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            LAYER_CONFIG: llama_layer_config(cfg, target, dtype),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(self.engine_layer_ids(target.aux_layer_ids)),
            **dict.fromkeys(FLAGS, False),
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

    def read_config(self, config: dict[str, Any], where: str) -> ConfigFacts:
        kind = field(config, "speculators_model_type", str, where)
        expect(kind == "eagle3", where, f"speculators_model_type must be 'eagle3', got {kind!r}")
        # norm_before_residual must be present (vLLM's default differs from speculators'); the others default false
        expect(
            field(config, "norm_before_residual", bool, where) is False,
            where,
            _flag_message("norm_before_residual"),
        )
        for flag in FLAGS[1:]:
            expect(config.get(flag, False) is False, where, _flag_message(flag))
        path = "eagle_aux_hidden_state_layer_ids"
        ids = layer_ids(field(config, path, list, where), path, where)
        expect(min(ids) >= 0, where, f"{path} {list(ids)} must be >= 0")
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
        field(config, f"{spec}.verifier.name_or_path", str, where)
        field(config, f"{spec}.verifier.architectures", list, where)
        drafter, dtype = read_llama_layer(
            field(config, LAYER_CONFIG, dict, where),
            where,
            LAYER_CONFIG,
            target_hidden_size=field(config, "target_hidden_size", (int, type(None)), where),
            draft_vocab_size=field(config, "draft_vocab_size", int, where),
            require_rope_theta=False,
        )
        return ConfigFacts(drafter=drafter, engine_aux_layer_ids=ids, dtype=dtype)


def _flag_message(flag: str) -> str:
    return f"{flag} must be false: our drafter (SGLang's architecture) has no such step, so this export runs another network"


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
