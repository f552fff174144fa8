"""The target's embedding and output head, read straight from its safetensors files.

The drafter shares the target's (frozen) token embedding, and the teacher's distribution comes from the
target's `lm_head` applied to the stored final hidden state. Only these tensors are read, never the whole
checkpoint, so this works for a target far larger than the training machine's memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_core.conventions import FinalStateConvention
from eagle3_core.targets.model_config import read_text_config


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


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file, from the index of a sharded checkpoint or the single file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    files: dict[str, Path] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), path))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights")
    return files


def _find(files: dict[str, Path], suffix: str, exclude: str = "layers.") -> str | None:
    matches = sorted(n for n in files if n.endswith(suffix) and exclude not in n)
    if len(matches) > 1:
        raise ValueError(f"several tensors end with {suffix!r}: {matches}")
    return matches[0] if matches else None


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_target_head(model_dir: Path) -> TargetHead:
    config = read_text_config(model_dir)  # multimodal wrappers keep the language model's config inside
    files = _weight_files(model_dir)
    embed_name = _find(files, "embed_tokens.weight")
    if embed_name is None:
        raise ValueError(f"{model_dir}: no '*embed_tokens.weight' tensor")
    head_name = _find(files, "lm_head.weight")
    if head_name is None and not config.tie_word_embeddings:
        raise ValueError(f"{model_dir}: no 'lm_head.weight' and tie_word_embeddings is false")
    norm_name = _find(files, "norm.weight")
    embed = _read(files, embed_name)
    return TargetHead(
        embed=embed,
        lm_head=embed if head_name is None else _read(files, head_name),
        final_norm=None if norm_name is None else _read(files, norm_name),
        rms_norm_eps=config.rms_norm_eps,
    )
