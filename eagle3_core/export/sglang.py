"""The SGLang export: the directory `--speculative-draft-model-path` points at.

SGLang's loader (`srt/models/llama_eagle3.py`, `LlamaForCausalLMEagle3`) builds one Llama decoder layer named
`midlayer`, our own name, and skips unknown weight keys silently; it derives `hot_token_id = d2t + arange` and
ignores `t2d` (written all the same: it is what the vocab mapping is, and other tools read it). It shares the
target's embedding, so `embed_tokens` is left out. Its residual comes from h, as ours does; the layer has no
`norm_before_residual` option at all (REFERENCE.md failure mode 11).

Layer ids: SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` and captures the *input* of layer
`id + 1` (`set_eagle3_layers_to_capture`), so project aux k (the input of layer k) is written k - 1.
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

ARCHITECTURE = "LlamaForCausalLMEagle3"


class SGLangFormat(ExportFormat):
    name: ClassVar[FormatName] = "sglang"
    layer_prefix: ClassVar[str] = "midlayer."
    with_embedding: ClassVar[bool] = False

    def engine_layer_ids(self, project_ids: tuple[int, int, int]) -> tuple[int, int, int]:
        if min(project_ids) < 1:
            # k - 1 = -1 has no meaning to SGLang (it would capture the input of layer 0, the raw embedding)
            raise ExportError(
                f"aux layer 0 cannot be expressed for SGLang (ids {list(project_ids)}, project convention)"
            )
        a, b, c = project_ids
        return (a - 1, b - 1, c - 1)

    def project_layer_ids(self, engine_ids: tuple[int, int, int]) -> tuple[int, int, int]:
        a, b, c = engine_ids
        return (a + 1, b + 1, c + 1)

    def build_config(
        self, cfg: DrafterConfig, target: ExportTarget, dtype: torch.dtype, provenance: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            **llama_layer_config(cfg, target, dtype),
            "architectures": [ARCHITECTURE],
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.engine_layer_ids(target.aux_layer_ids)),
                "use_aux_hidden_state": True,
            },
            PROVENANCE_KEY: provenance,
        }

    def read_config(self, config: dict[str, Any], where: str) -> ConfigFacts:
        architectures = field(config, "architectures", list, where)
        expect(
            architectures == [ARCHITECTURE],
            where,
            f"architectures must be [{ARCHITECTURE!r}], got {architectures!r}",
        )
        expect(
            field(config, "eagle_config.use_aux_hidden_state", bool, where),
            where,
            "eagle_config.use_aux_hidden_state must be true",
        )
        path = "eagle_config.eagle_aux_hidden_state_layer_ids"
        ids = layer_ids(field(config, path, list, where), path, where)
        expect(min(ids) >= 0, where, f"{path} {list(ids)}: SGLang ids are >= 0")
        drafter, dtype = read_llama_layer(
            config,
            where,
            "",
            target_hidden_size=field(config, "target_hidden_size", int, where),
            draft_vocab_size=field(config, "draft_vocab_size", int, where),
            require_rope_theta=True,
        )
        return ConfigFacts(drafter=drafter, engine_aux_layer_ids=ids, dtype=dtype)


SGLANG = SGLangFormat()


def export_sglang(
    drafter: Eagle3Drafter,
    mapping: VocabMapping,
    target: ExportTarget,
    out_dir: Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write a validated SGLang draft-model directory at `out_dir` (replacing one there, atomically)."""
    return write_export(SGLANG, drafter, mapping, target, out_dir, dtype)
