"""Builders shared by the export tests: a hand-made vocab mapping, a random drafter bound to it, its export."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.draft.vocab import VocabMapping
from eagle3_core.export import ExportTarget, export_sglang, export_speculators

# An 8-layer target; aux layers 2, 4, 5 in the project convention (the inputs of those decoder layers).
LLAMA_8L = ExportTarget(
    name_or_path="org/target-8l",
    num_layers=8,
    aux_layer_ids=(2, 4, 5),
    final_state_convention="post_norm",
    vocab_size=64,
    hidden_size=16,
    max_position_embeddings=512,
    architectures=("LlamaForCausalLM",),
    model_type="llama",
)


def hand_mapping(target_vocab_size: int, draft_vocab_size: int, seed: int = 0) -> VocabMapping:
    """K target ids picked at random (so d2t is not all zeros), in ascending order, with d2t and t2d."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(target_vocab_size, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return VocabMapping(
        draft_to_target=ids,
        d2t=ids - torch.arange(draft_vocab_size),
        t2d=t2d,
        target_vocab_size=target_vocab_size,
        draft_vocab_size=draft_vocab_size,
        fingerprint="f" * 64,
        coverage=1.0,
        tokenizer_fingerprint="t" * 64,
        shard_set=[],
        counted_tokens=0,
        distinct_tokens=draft_vocab_size,
        padded=0,
    )


def drafter_config(target: ExportTarget, draft_vocab_size: int, **overrides: object) -> DrafterConfig:
    fields: dict[str, object] = {
        "target_hidden_size": target.hidden_size,
        "hidden_size": target.hidden_size,  # the speculators package needs the drafter as wide as the target
        "intermediate_size": 2 * target.hidden_size,
        "num_heads": 4,
        "num_kv_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,  # not the default, so a dropped rope_theta shows
        "target_vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
    }
    return DrafterConfig.model_validate({**fields, **overrides})


def random_drafter(cfg: DrafterConfig, embed: torch.Tensor | None = None, seed: int = 0) -> Eagle3Drafter:
    """A randomly initialised drafter whose norm weights are not all ones (a swapped norm must show): the
    layer's, the final one, and the variants' input_norm and fc_norm.{i}."""
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, embed)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    return drafter.eval()


def write_tiny_export(out: Path, seed: int = 0) -> Path:
    """Both formats of a tiny random drafter for LLAMA_8L, validated, as plain directories out/sglang and
    out/speculators (the layout of an export before versions, which eagle3 still reads): what promotion and
    serving read, without a target or a training run."""
    drafter = random_drafter(drafter_config(LLAMA_8L, 16), seed=seed)
    mapping = hand_mapping(64, 16)
    export_sglang(drafter, mapping, LLAMA_8L, out / "sglang", dtype=torch.float32)
    export_speculators(drafter, mapping, LLAMA_8L, out / "speculators", dtype=torch.float32)
    return out
