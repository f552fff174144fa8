"""The SGLang export: the directory `--speculative-draft-model-path` points at.

SGLang's loader (`srt/models/llama_eagle3.py`, `LlamaForCausalLMEagle3`) builds one Llama decoder layer named
`midlayer`, our own name, and skips unknown weight keys silently; it derives `hot_token_id = d2t + arange` and
ignores `t2d` (written all the same: it is what the vocab mapping is, and other tools read it). It gives an
EAGLE-3 drafter the target's embedding (`set_embed`), so `embed_tokens` is left out.

Variants, as SGLang 0.5.23 reads them (every one written explicitly, true or false):
- `norm_before_fc`: `eagle_config.norm_before_fc`, else the top-level field; written in both places.
- `fc_norm`: the top-level `fc_norm` (or the legacy `use_aux_norm`, weights `aux_norm_low/mid/high`, which a
  drafter made elsewhere may use); ours writes `fc_norm` and `fc_norm.{i}.weight`.
- `norm_output`: the top-level field.
- `norm_before_residual`: SGLang has no such option, its residual is always h. A drafter trained with it is
  refused (ExportError): SGLang would serve another network. `norm_before_residual: false` is written so that
  vLLM, which also loads this architecture and defaults the flag false here, agrees.
- the sliding window: not a config field for SGLang but the server argument `--speculative-draft-window-size`,
  which LlamaForCausalLMEagle3 applies to its attention. SGLang's window counts the keys left of the query
  (its attention backends see keys in [q - S, q]), where ours (and vLLM's, speculators') is the W keys in
  (q - W, q]: the argument is S = W - 1, so a window of 1 cannot be expressed and is refused. The window is
  written in our provenance block (`drafter_variant.sliding_window`), which `eagle3 serve-command`
  (steps/serving.py) reads to pass the argument; a drafter from elsewhere cannot say its window, and loads with none,
  as SGLang runs it without the argument (and as vLLM runs this format: it reads a window from `layer_types`,
  which only the speculators export writes).

Layer ids: SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and hands them to the target's
`set_eagle3_layers_to_capture`, whose rule differs by model (engines/sglang_models.py): most capture the *input*
of layer `id + 1`, so project aux k (the input of layer k) is written k - 1; the DeepSeek family adds one only
when the first id is 1 (so k is written k - 1 when the first is 2, as given when it is 3 or more, and a first
aux layer of 1 cannot be expressed); GPT-OSS keeps ids whose largest is the layer count. Without the field it
captures the inputs of layers (2, L//2, L-3), which is the project convention's default.

A drafter made elsewhere (SpecForge, EAGLE's releases) is read as SGLang reads it: its layer may be named
`midlayer.` or `layers.0.`, its tensors may carry a `model.` prefix, `target_hidden_size` defaults to
`hidden_size`. Without `draft_vocab_size` SGLang would use the target's lm_head, which the directory cannot
give: refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Self

import torch
from pydantic import AfterValidator, Field, model_validator

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
    field_error,
    validated,
)
from eagle3_core.engines.sglang_models import captured_layer_ids, config_layer_ids, sglang_model
from eagle3_core.errors import ConfigError, ExportError
from eagle3_core.export import common

ARCHITECTURE = "LlamaForCausalLMEagle3"
# SGLang's legacy per-aux norm names (its load_weights renames them)
LEGACY_FC_NORM = {
    "aux_norm_low.": "fc_norm.0.",
    "aux_norm_mid.": "fc_norm.1.",
    "aux_norm_high.": "fc_norm.2.",
}
WITHOUT_VOCAB = "SGLang would then use the target's lm_head, which is not in a drafter directory"
NO_RESIDUAL_NORM = (
    "SGLang has no such option (its residual is h, not hidden_norm(h)), so it "
    "would serve another network than the trained one; serve it with vLLM (the speculators export)"
)


def _aux_states_used(used: bool | None) -> bool | None:
    if used is False:
        raise ValueError("must be true (an EAGLE-3 drafter reads the aux hidden states)")
    return used


def _only_eagle3(architectures: list[str]) -> list[str]:
    if architectures != [ARCHITECTURE]:
        raise ValueError(f"must be [{ARCHITECTURE!r}], got {architectures!r}")
    return architectures


def _no_residual_norm(flag: bool | None) -> bool | None:
    if flag:
        raise ValueError(f"true: {NO_RESIDUAL_NORM}")
    return flag


class EagleConfig(EngineModel):
    """`eagle_config`: where SGLang (and vLLM, for this architecture) look first."""

    # in SGLang's numbering (the module docstring); absent: SGLang captures the inputs of layers (2, L//2, L-3)
    eagle_aux_hidden_state_layer_ids: Annotated[LayerIds | None, NOT_NULL] = None
    use_aux_hidden_state: Annotated[bool | None, NOT_NULL, AfterValidator(_aux_states_used)] = None
    norm_before_fc: Annotated[bool | None, NOT_NULL] = None  # read before the top-level one


class SGLangFields(EngineModel):
    """What SGLang reads of config.json beside the Llama layer, each with the default SGLang gives it. A
    drafter made elsewhere is read with this alone (its layer goes through LlamaConfig, as in SGLang)."""

    architectures: Annotated[list[str], AfterValidator(_only_eagle3)]
    # absent: SGLang would use the target's lm_head, which no drafter directory holds (refused by the reader)
    draft_vocab_size: Annotated[int | None, NOT_NULL] = None
    target_hidden_size: Annotated[int | None, NOT_NULL] = None  # absent: the drafter's width
    norm_before_fc: Flag = None
    fc_norm: Flag = None
    norm_output: Flag = None
    # SGLang has no such option; written false so that vLLM, which defaults it false here, agrees
    norm_before_residual: Annotated[Flag, AfterValidator(_no_residual_norm)] = None
    # SGLang's older name for fc_norm (weights aux_norm_low/mid/high); read from others, never written
    use_aux_norm: Annotated[bool | None, Field(exclude=True)] = None
    eagle_config: Annotated[EagleConfig | None, NOT_NULL_IN_OURS] = None
    eagle3_export: Annotated[Provenance | None, NOT_NULL_IN_OURS] = None


class SGLangConfig(LlamaLayer, SGLangFields):
    """The whole config.json of our SGLang export: the Llama layer's fields at the top level, as SGLang's
    LlamaConfig-based reader wants them."""

    @model_validator(mode="after")
    def _norm_before_fc_once(self) -> Self:
        nested = self.eagle_config.norm_before_fc if self.eagle_config else None
        if nested != self.norm_before_fc:
            raise field_error(
                "eagle_config.norm_before_fc", f"{nested!r}, but norm_before_fc is {self.norm_before_fc!r}"
            )
        return self


def draft_window_argument(sliding_window: int) -> int:
    """Our window W (the W keys in (q - W, q]) as SGLang's `--speculative-draft-window-size` (keys in [q - S, q])."""
    return sliding_window - 1


class SGLangFormat(common.ExportFormat):
    name: ClassVar[common.FormatName] = "sglang"
    layer_prefix: ClassVar[str] = "midlayer."
    with_embedding: ClassVar[bool] = False

    def engine_layer_ids(
        self, project_ids: tuple[int, int, int], target: common.LayerTarget
    ) -> tuple[int, int, int]:
        try:
            return config_layer_ids(sglang_model(target.architectures), project_ids, target.num_layers)
        except ConfigError as e:
            raise ExportError(f"cannot export for SGLang: {e}") from e

    def project_layer_ids(
        self, engine_ids: tuple[int, int, int], target: common.LayerTarget
    ) -> tuple[int, int, int]:
        if not target.architectures:
            raise ExportError(
                "the aux layers an SGLang drafter config names depend on the target's model (SGLang's rule "
                "differs by architecture, engines/sglang_models.py): pass target_architectures"
            )
        try:
            return captured_layer_ids(sglang_model(target.architectures), engine_ids, target.num_layers)
        except ConfigError as e:
            raise ExportError(f"cannot read the SGLang drafter's aux layers: {e}") from e

    def check_expressible(self, cfg: DrafterConfig) -> None:
        if cfg.norm_before_residual:
            raise ExportError(f"cannot export for SGLang: norm_before_residual is true: {NO_RESIDUAL_NORM}")
        if cfg.sliding_window is not None and draft_window_argument(cfg.sliding_window) < 1:
            raise ExportError(
                f"cannot export for SGLang: sliding_window {cfg.sliding_window} would be "
                f"--speculative-draft-window-size {draft_window_argument(cfg.sliding_window)}, and SGLang "
                "needs it positive"
            )

    def build_config(
        self, cfg: DrafterConfig, target: common.ExportTarget, dtype: torch.dtype, provenance: dict[str, Any]
    ) -> SGLangConfig:
        config = {
            **common.llama_layer_config(cfg, target, dtype),
            "architectures": [ARCHITECTURE],
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            **{flag: getattr(cfg, flag) for flag in common.FLAGS},
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(
                    self.engine_layer_ids(target.aux_layer_ids, target.layers)
                ),
                "use_aux_hidden_state": True,
                "norm_before_fc": cfg.norm_before_fc,
            },
            "eagle3_export": provenance,
        }
        return SGLangConfig.model_validate(config, context={"ours": True})

    def read_config(self, config: dict[str, Any], where: str, *, ours: bool) -> common.ConfigFacts:
        fields: SGLangFields
        if ours:
            fields = mine = validated(SGLangConfig, config, where, ours=True)
            sizes, dtype = mine.drafter_sizes(), common.DTYPES[mine.dtype][0]
            variant = mine.eagle3_export.drafter_variant if mine.eagle3_export else None
            window = variant.sliding_window if variant else None  # SGLang's config has no window field
        else:
            fields = validated(SGLangFields, config, where, ours=False)
            sizes, dtype, window = common.read_external_layer(config, where, ""), None, None
        eagle = fields.eagle_config or EagleConfig()
        flags = {flag: bool(getattr(fields, flag)) for flag in common.FLAGS}
        if eagle.norm_before_fc is not None:
            flags["norm_before_fc"] = eagle.norm_before_fc  # SGLang and vLLM read eagle_config's first
        flags["fc_norm"] = flags["fc_norm"] or bool(fields.use_aux_norm)
        ids = eagle.eagle_aux_hidden_state_layer_ids
        return common.config_facts(fields, sizes, flags, window, ids, dtype, where, WITHOUT_VOCAB)

    def canonical_key(self, theirs: str) -> str:
        # SGLang's load_weights accepts a "model." prefix, "layers.0." for "midlayer.", and the legacy norm names
        name = theirs.removeprefix("model.")
        if name.startswith("layers.0."):
            name = common.OUR_LAYER_PREFIX + name.removeprefix("layers.0.")
        for legacy, new in LEGACY_FC_NORM.items():
            if name.startswith(legacy):
                name = new + name.removeprefix(legacy)
        return name


SGLANG = SGLangFormat()


def export_sglang(
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: common.ExportTarget,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a validated SGLang draft-model directory at `out_dir` (replacing one there, atomically).

    ExportError for a drafter SGLang cannot run as trained (norm_before_residual, a window of 1).
    """
    return common.write_export(SGLANG, drafter, mapping, target, out_dir, dtype)


def written_layer_ids(export_dir: Path) -> list[int]:
    """The aux layer ids our SGLang export's config.json gives SGLang, in SGLang's numbering: read back and
    validated as written (ExportError naming the file and the field)."""
    where = f"{export_dir} (sglang export)"
    config = validated(SGLangConfig, common.read_config_file(export_dir, where), where, ours=True)
    ids = config.eagle_config.eagle_aux_hidden_state_layer_ids if config.eagle_config else None
    if ids is None:
        raise ExportError(
            f"{where}: {common.CONFIG_FILE}: eagle_config.eagle_aux_hidden_state_layer_ids: missing"
        )
    return ids
