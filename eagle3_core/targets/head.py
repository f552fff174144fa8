"""The target's embedding and output head, read straight from its safetensors files.

The drafter shares the target's (frozen) token embedding, and the teacher's distribution comes from the
target's `lm_head` applied to the stored final hidden state. Only these tensors are read, never the whole
checkpoint, so this works for a target far larger than the training machine's memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_core.conventions import FinalStateConvention
from eagle3_core.errors import TargetError
from eagle3_core.targets.model_config import read_text_config
from eagle3_core.targets.weights import EMBED, FINAL_NORM, LM_HEAD, TensorHeader, find_tensor, tensor_headers


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, the target's final norm and the drafter's norms alike: half precisions are
    normalised in float32, float32/64 stay as they are."""
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass(frozen=True)
class TargetHead:
    embed: torch.Tensor  # [V, H]
    lm_head: torch.Tensor  # [V, H]
    final_norm: torch.Tensor | None  # [H]: needed only for states stored pre_norm
    rms_norm_eps: float

    def logits(self, last_hidden: torch.Tensor, convention: FinalStateConvention) -> torch.Tensor:
        """Target logits [.., V] from stored final states [.., H] under their recorded convention."""
        h = last_hidden.to(self.lm_head.dtype)
        if convention == "pre_norm":
            if self.final_norm is None:
                raise ValueError("states are stored pre_norm but the target has no final norm weight")
            h = rms_norm(h, self.final_norm.to(h.dtype), self.rms_norm_eps)
        return h @ self.lm_head.T


def _read(tensors: dict[str, TensorHeader], name: str) -> torch.Tensor:
    with safe_open(str(tensors[name].file), framework="pt") as f:
        return f.get_tensor(name)


def load_target_head(model_dir: Path) -> TargetHead:
    config = read_text_config(model_dir)  # multimodal wrappers keep the language model's config inside
    tensors = tensor_headers(model_dir)
    embed_name = find_tensor(tensors, EMBED)
    if embed_name is None:
        raise TargetError(f"{model_dir}: no '*{EMBED}' tensor in the weights")
    head_name = find_tensor(tensors, LM_HEAD)
    if head_name is None and not config.tie_word_embeddings:
        raise TargetError(
            f"{model_dir}: no '{LM_HEAD}' tensor in the weights and tie_word_embeddings is false"
        )
    norm_name = find_tensor(tensors, FINAL_NORM)
    embed = _read(tensors, embed_name)
    return TargetHead(
        embed=embed,
        lm_head=embed if head_name is None else _read(tensors, head_name),
        final_norm=None if norm_name is None else _read(tensors, norm_name),
        rms_norm_eps=config.rms_norm_eps,
    )
