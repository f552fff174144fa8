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
from typing import Annotated, Any, ClassVar, Literal, Self

import torch
from pydantic import ValidationInfo, model_validator

from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.engines.engine_config import (
    NOT_NULL,
    NOT_NULL_IN_OURS,
    EngineModel,
    Flag,
    LayerIds,
    LlamaLayer,
    Provenance,
    SpeculatorsBlock,
    field_error,
    is_ours,
    validated,
)
from eagle3_core.errors import ExportError
from eagle3_core.export import common

SPECULATORS_VERSION = "0.9.0"  # the release whose format this writes (and whose loader the tests run)
ARCHITECTURE = "Eagle3Speculator"
LAYER_CONFIG = "transformer_layer_config"
SLIDING, FULL = "sliding_attention", "full_attention"
WITHOUT_VOCAB = "vLLM would take the target's vocab, speculators 32000"
# what speculators' Eagle3DraftModel holds beside the drafter, for its training loss; never part of the network
VERIFIER_KEYS = ("verifier_lm_head.weight", "verifier_norm.weight")


class LayerWindow(EngineModel):
    """The decoder layer's attention as vLLM and speculators read it: `layer_types[0]` decides. A drafter made
    elsewhere is read with this alone (its layer goes through LlamaConfig, as in the engines)."""

    # absent: full attention whatever sliding_window says
    layer_types: Annotated[list[str] | None, NOT_NULL] = None
    sliding_window: int | None = None  # the W keys in (q - W, q]

    @model_validator(mode="after")
    def _one_layer(self, info: ValidationInfo) -> Self:
        types, window = self.layer_types, self.sliding_window
        if types is None:
            return self
        if len(types) != 1 or types[0] not in (SLIDING, FULL):
            raise field_error(
                "layer_types", f"must be [{SLIDING!r}] or [{FULL!r}] (one decoder layer), got {types!r}"
            )
        if types[0] == FULL and window is not None and is_ours(info):
            raise field_error("sliding_window", f"{window} with full attention")
        if types[0] == SLIDING and (window is None or window < 1):
            raise field_error("sliding_window", f"{window!r}, but layer_types is [{SLIDING!r}]")
        return self

    @property
    def window(self) -> int | None:
        return self.sliding_window if self.layer_types == [SLIDING] else None


class SpeculatorsLayer(LlamaLayer, LayerWindow):
    """`transformer_layer_config` of our export."""


class SpeculatorsFields(EngineModel):
    """An `Eagle3SpeculatorConfig` as vLLM and speculators read it, each field with their default."""

    speculators_model_type: Literal["eagle3"]
    # required of any directory: vLLM's default (true) and speculators' (false) differ
    norm_before_residual: bool
    norm_before_fc: Flag = None
    fc_norm: Flag = None
    norm_output: Flag = None
    # absent: (2, L//2, L-3) for the target, in the project convention as vLLM numbers layers
    eagle_aux_hidden_state_layer_ids: Annotated[LayerIds | None, NOT_NULL] = None
    speculators_config: SpeculatorsBlock
    transformer_layer_config: LayerWindow
    target_hidden_size: int | None = None  # absent or null: the drafter's hidden size
    # absent: vLLM would take the target's vocab, speculators 32000 (refused by the reader)
    draft_vocab_size: Annotated[int | None, NOT_NULL] = None
    architectures: Annotated[list[str] | None, NOT_NULL] = None
    speculators_version: Annotated[str | None, NOT_NULL] = None
    embed_requires_grad: Annotated[bool | None, NOT_NULL] = None
    eagle3_export: Annotated[Provenance | None, NOT_NULL_IN_OURS] = None


class SpeculatorsConfig(SpeculatorsFields):
    """The whole config.json of our speculators export."""

    transformer_layer_config: SpeculatorsLayer


class SpeculatorsFormat(common.ExportFormat):
    name: ClassVar[common.FormatName] = "speculators"
    layer_prefix: ClassVar[str] = "layers.0."
    with_embedding: ClassVar[bool] = True

    def __init__(self, speculative_tokens: int = 3) -> None:
        if speculative_tokens < 1:
            raise ExportError(f"speculative_tokens must be >= 1, got {speculative_tokens}")
        self.speculative_tokens = speculative_tokens  # vLLM's default num_speculative_tokens for this drafter

    def engine_layer_ids(
        self, project_ids: tuple[int, int, int], target: common.LayerTarget
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
        self, engine_ids: tuple[int, int, int], target: common.LayerTarget
    ) -> tuple[int, int, int]:
        return engine_ids  # vLLM captures the input of each id's layer, for every model

    def check_expressible(self, cfg: DrafterConfig) -> None:
        """Every variant of ours has its field here."""

    def build_config(
        self, cfg: DrafterConfig, target: common.ExportTarget, dtype: torch.dtype, provenance: dict[str, Any]
    ) -> SpeculatorsConfig:
        layer = {
            **common.llama_layer_config(cfg, target, dtype),
            "sliding_window": cfg.sliding_window,
            "layer_types": [FULL if cfg.sliding_window is None else SLIDING],
        }
        config = {
            "architectures": [ARCHITECTURE],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            LAYER_CONFIG: layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": list(
                self.engine_layer_ids(target.aux_layer_ids, target.layers)
            ),
            **{flag: getattr(cfg, flag) for flag in common.FLAGS},
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
            "eagle3_export": provenance,
        }
        return SpeculatorsConfig.model_validate(config, context={"ours": True})

    def read_config(self, config: dict[str, Any], where: str, *, ours: bool) -> common.ConfigFacts:
        fields: SpeculatorsFields
        if ours:
            fields = mine = validated(SpeculatorsConfig, config, where, ours=True)
            layer = mine.transformer_layer_config
            sizes, dtype = layer.drafter_sizes(), common.DTYPES[layer.dtype][0]
        else:
            fields = validated(SpeculatorsFields, config, where, ours=False)
            sizes, dtype = common.read_external_layer(config[LAYER_CONFIG], where, LAYER_CONFIG), None
        flags = {flag: bool(getattr(fields, flag)) for flag in common.FLAGS}
        window, ids = fields.transformer_layer_config.window, fields.eagle_aux_hidden_state_layer_ids
        return common.config_facts(fields, sizes, flags, window, ids, dtype, where, WITHOUT_VOCAB)

    def external_optional(self, cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
        # the package drops its verifier copies on save; other versions or tools may keep them
        verifier = {
            VERIFIER_KEYS[0]: (cfg.draft_vocab_size, cfg.hidden_size),
            VERIFIER_KEYS[1]: (cfg.hidden_size,),
        }
        return super().external_optional(cfg) | verifier


SPECULATORS = SpeculatorsFormat()


def export_speculators(
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: common.ExportTarget,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    speculative_tokens: int = 3,
) -> Path:
    """Write a validated speculators/vLLM drafter directory at `out_dir` (replacing one there, atomically)."""
    return common.write_export(
        SpeculatorsFormat(speculative_tokens), drafter, mapping, target, out_dir, dtype
    )
