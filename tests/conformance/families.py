"""Tiny random targets of each model family eagle3 extracts from through SGLang, saved as Hugging Face
directories with the tiny chat tokenizer: the architecture's own transformers class, 8 layers, hidden 256, a
MoE block where the family has one. Not here: GPT-OSS (SGLang 0.5.23 refuses the torch_native attention for it:
`GptOssForCausalLM requires one of ['triton', 'trtllm_mha', 'fa3', ...]`). `kimi_k25` is DeepSeek-V3's weights
under `language_model.*` with Kimi-K2.5's wrapper config (transformers has no Kimi-K2.5 class: its reference is
the DeepSeek-V3 directory).

`save_table_config` writes the config alone (and the tokenizer) of every row of eagle3's architecture table,
GPT-OSS and DeepSeek-V2 included, for SGLang to build with random weights (probe_capture.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from eagle3_core.toy.tokenizer import train_tokenizer
from tests.helpers import CORPUS

H = 256
LAYERS = 8
FP32_REL = 1e-5  # relative L2 difference between two float32 computations of the same 8-layer model
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "glm4_moe", "glm4_moe_lite")
COMMON: dict[str, Any] = {
    "hidden_size": H,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 2 * H,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}

# DeepSeek-V3's own rope (yarn), scaled to 1,024 positions: SGLang's CPU rope for DeepSeek requires a scaling
DEEPSEEK_YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
    "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
}  # fmt: skip


def family_config(family: str, vocab: int) -> PretrainedConfig:
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        GptOssConfig,
        LlamaConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    common = {**COMMON, "vocab_size": vocab}
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=64)
    if family == "qwen3_moe":  # every layer sparse: 4 experts, 2 per token
        return Qwen3MoeConfig(
            **common, head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        )  # fmt: skip
    if family in ("deepseek_v3", "kimi_k25"):  # MLA; layers 0-1 dense, 2-7 MoE with a shared expert
        return DeepseekV3Config(
            **{**common, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=2, n_group=1, topk_group=1,
            routed_scaling_factor=1.0, rope_parameters=DEEPSEEK_YARN, norm_topk_prob=True,
            moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid",  # DeepSeek-V3 config.json fields SGLang reads
        )  # fmt: skip
    if family == "deepseek_v2":  # DeepSeek-V3's shape, V2's greedy routing
        return DeepseekV2Config(
            **{**common, "num_key_value_heads": 4}, q_lora_rank=None, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, n_shared_experts=1, first_k_dense_replace=2, n_group=1, topk_group=1,
            routed_scaling_factor=1.0, rope_parameters=DEEPSEEK_YARN, norm_topk_prob=True, moe_layer_freq=1,
            topk_method="greedy", scoring_func="softmax",  # DeepSeek-V2's routing, fields SGLang reads
        )  # fmt: skip
    if family == "gpt_oss":  # 4 experts, 2 per token; sliding and full attention layers alternate
        return GptOssConfig(
            **common, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
            rope_parameters={**DEEPSEEK_YARN, "rope_theta": 150000.0},
        )  # fmt: skip
    if family == "glm4_moe":  # layer 0 dense, 1-7 MoE with a shared expert, partial rotary, q/k norms
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(
            **common, head_dim=64, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True,
            partial_rotary_factor=0.5, norm_topk_prob=True,
        )  # fmt: skip
    if family == "glm4_moe_lite":  # GLM-4.7-Flash's shape: MLA with a q LoRA, layer 0 dense, 1-7 MoE
        from transformers import Glm4MoeLiteConfig

        # SGLang 0.5.23's GLM-4-MoE-Lite reads q only through q_a_proj/q_b_proj: a target without a q LoRA
        # loads with its q_proj left at zero, silently (rows ~13% off). Its q_a/kv_a norms take
        # rms_norm_eps, transformers' a fixed 1e-6: at GLM-4.7-Flash's 1e-5 the tiny target's rows differ
        # by 6e-5, so the config here says 1e-6. first_k_dense_replace and moe_layer_freq: the fields
        # GLM-4.7-Flash's config.json carries and SGLang reads (transformers writes mlp_layer_types).
        return Glm4MoeLiteConfig(
            **{**common, "num_key_value_heads": 4}, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=128, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
            norm_topk_prob=True, rope_parameters=DEEPSEEK_YARN, rope_interleave=True, rms_norm_eps=1e-6,
            mlp_layer_types=["dense"] + ["sparse"] * (LAYERS - 1), first_k_dense_replace=1, moe_layer_freq=1,
        )  # fmt: skip
    raise ValueError(f"unknown family {family!r}")


def save_family_target(directory: Path, family: str, seed: int = 0) -> Path:
    """The family's tiny target in `directory`; for kimi_k25 also its DeepSeek-V3 reference in
    `directory`-reference."""
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, len(tokenizer)), dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if family == "kimi_k25":
        reference = reference_dir(directory, family)
        directory.rename(reference)
        wrap_as_kimi(reference, directory)
    return directory


def reference_dir(directory: Path, family: str) -> Path:
    """Where transformers reads the same weights: the directory itself, or Kimi's DeepSeek-V3 reference."""
    return directory.with_name(directory.name + "-reference") if family == "kimi_k25" else directory


def wrap_as_kimi(deepseek: Path, kimi: Path) -> None:
    """Kimi-K2.5's layout over a DeepSeek-V3 directory: the text model's weights under `language_model.`, its
    config as text_config."""
    kimi.mkdir()
    config = kimi_config(json.loads((deepseek / "config.json").read_text()))
    (kimi / "config.json").write_text(json.dumps(config, indent=1))
    weights = load_file(str(deepseek / "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in weights.items()}, str(kimi / "model.safetensors"))
    for f in deepseek.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (kimi / f.name).write_bytes(f.read_bytes())


def kimi_config(text: dict[str, Any]) -> dict[str, Any]:
    """Kimi-K2.5's wrapper config over a DeepSeek-V3 config (`text`, a config.json's fields)."""
    text = {**text, "architectures": ["DeepseekV3ForCausalLM"]}
    vision = {  # Kimi-K2.5's vision_config fields, a 1-layer tower of width 32 (SGLang builds it; never run)
        "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 1,
        "pos_emb_type": "divided_fixed", "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal", "mm_projector_type": "patchmerger", "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5, "text_hidden_size": H, "mm_hidden_size": 32,
        "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 64,
        "vt_hidden_size": 32, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1, "vt_intermediate_size": 64,
    }  # fmt: skip
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
    }


# each row of eagle3's architecture table (engines/sglang_models.py) -> the family whose tiny config builds it
TABLE_FAMILIES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "KimiK25ForConditionalGeneration": "kimi_k25",
    "Glm4MoeForCausalLM": "glm4_moe",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "GptOssForCausalLM": "gpt_oss",
}


def save_table_config(directory: Path, architecture: str) -> Path:
    """The tiny config.json (and the tiny tokenizer) of a table row's architecture in `directory`: no weights."""
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    family = TABLE_FAMILIES[architecture]
    config = family_config(family, len(tokenizer)).to_dict()
    config["architectures"] = [architecture]
    if family == "kimi_k25":
        config = kimi_config(config)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(directory)
    return directory


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b| (L2): how far SGLang's states are from transformers'."""
    return float((a - b).norm() / b.norm().clamp_min(1e-12))
