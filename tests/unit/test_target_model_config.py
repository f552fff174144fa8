"""A target's config.json read through its declared fields: the drafter is shaped as it was from the dict,
the serving dtype sees the file's own fields, and a missing or wrong field is one line naming the file and
the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from eagle3_core.config import DrafterVariant, Eagle3Config
from eagle3_core.draft.model import DrafterConfig
from eagle3_core.errors import TargetError
from eagle3_core.steps.drafter import export_dtype
from eagle3_core.targets.model_config import read_text_config
from eagle3_core.train.trainer import drafter_config_for

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 6,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 300,
    "torch_dtype": "bfloat16",
}
TRANSFORMERS_5 = {  # rope_parameters, dtype, an explicit head_dim, no kv head count
    **{k: v for k, v in LLAMA.items() if k not in ("rope_theta", "num_key_value_heads", "torch_dtype")},
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "head_dim": 32,
    "dtype": "float16",
}
MULTIMODAL = {  # the language model inside text_config; a null head_dim; no rms_norm_eps or rope theta at all
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        **{k: v for k, v in LLAMA.items() if k not in ("rms_norm_eps", "rope_theta")},
        "head_dim": None,
    },
    "vision_config": {"hidden_size": 32},
}


def _dict_reader(config: dict[str, Any], draft_vocab_size: int) -> DrafterConfig:
    """drafter_config_for as it read the file before the model, kept here to compare against."""
    cfg = config.get("text_config", config)
    rope = cfg.get("rope_parameters") or {}
    heads = int(cfg["num_attention_heads"])
    return DrafterConfig(
        target_hidden_size=int(cfg["hidden_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=cfg.get("head_dim") or int(cfg["hidden_size"]) // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        target_vocab_size=int(cfg["vocab_size"]),
        draft_vocab_size=draft_vocab_size,
        **DrafterVariant().model_dump(),
    )


def _target(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "config", [LLAMA, TRANSFORMERS_5, MULTIMODAL], ids=["llama", "transformers5", "multimodal"]
)
def test_the_drafter_is_shaped_as_the_dict_reader_shaped_it(tmp_path: Path, config: dict[str, Any]) -> None:
    assert drafter_config_for(_target(tmp_path, config), 32) == _dict_reader(config, 32)


def test_the_serving_dtype_sees_the_files_own_fields(tmp_path: Path) -> None:
    text = read_text_config(_target(tmp_path, TRANSFORMERS_5))
    fields = text.model_dump(exclude_unset=True)
    assert fields["dtype"] == "float16" and "torch_dtype" not in fields and "rope_theta" not in fields
    assert fields["rope_parameters"] == TRANSFORMERS_5["rope_parameters"]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({k: v for k, v in LLAMA.items() if k != "hidden_size"}, "hidden_size: Field required"),
        ({**LLAMA, "num_attention_heads": "four"}, "num_attention_heads: Input should be a valid integer"),
        ({**LLAMA, "intermediate_size": 0}, "intermediate_size: Input should be greater than 0"),
        (
            {**MULTIMODAL, "text_config": {**LLAMA, "vocab_size": None}},
            "text_config.vocab_size: Input should be",
        ),
        ({**MULTIMODAL, "text_config": [1]}, "text_config: Input should be a valid dictionary"),
    ],
)
def test_a_missing_or_wrong_field_is_one_line_naming_the_file_and_field(
    tmp_path: Path, config: dict[str, Any], expected: str
) -> None:
    target = _target(tmp_path, config)
    with pytest.raises(TargetError, match="^" + re.escape(f"{target / 'config.json'}: {expected}")) as err:
        drafter_config_for(target, 32)
    assert "\n" not in str(err.value)


def test_a_torn_config_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "interm')
    with pytest.raises(TargetError, match=re.escape(f"{tmp_path / 'config.json'}: not valid JSON")):
        read_text_config(tmp_path)


@pytest.mark.parametrize(
    ("target_dtype", "fields", "exported"),
    [
        ("auto", {"torch_dtype": "float32"}, torch.float32),  # the checkpoint's own, not SGLang's float16
        ("auto", {"torch_dtype": None}, torch.float32),  # undeclared: the weights' float32
        ("auto", {"torch_dtype": "bfloat16"}, torch.bfloat16),
        ("auto", {"dtype": "float16"}, torch.float16),
        # SGLang serves a float32 Gemma in bfloat16 but would serve a float32 drafter in float16: bfloat16
        ("auto", {"torch_dtype": "float32", "model_type": "gemma2"}, torch.bfloat16),
        ("float16", {"torch_dtype": "float32"}, torch.float16),  # target.dtype set: that one
        ("bfloat16", {"torch_dtype": "float32"}, torch.bfloat16),
    ],
)
def test_the_export_dtype_follows_the_checkpoint_unless_target_dtype_is_set(
    tmp_path: Path, target_dtype: str, fields: dict[str, Any], exported: torch.dtype
) -> None:
    config = {k: v for k, v in {**LLAMA, **fields}.items() if v is not None}
    cfg = Eagle3Config.model_validate({"target": {"dtype": target_dtype}})
    assert export_dtype(cfg, _target(tmp_path, config)) == exported


DEEPSEEK_V3 = {  # DeepSeek-V3's own config.json sizes (MLA), as transformers saves it: head_dim is the rope part
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "head_dim": 64,
    "vocab_size": 129280,
}
KIMI_K25 = {  # Kimi-K2.5's wrapper: DeepSeek-V3's text model with 64 heads and no head_dim
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": {
        **{k: v for k, v in DEEPSEEK_V3.items() if k != "head_dim"},
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "vocab_size": 163840,
    },
}


@pytest.mark.parametrize("config", [DEEPSEEK_V3, KIMI_K25], ids=["deepseek_v3", "kimi_k25"])
def test_an_mla_target_s_drafter_gets_heads_of_128_not_the_rope_part_or_hidden_over_heads(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    d = drafter_config_for(_target(tmp_path, config), 32000)
    # hidden over heads would be 56 (DeepSeek-V3) or 112 (Kimi); the config's head_dim 64 is the rope part
    assert (d.num_heads, d.num_kv_heads, d.dim) == (56, 8, 128)
    assert d.num_heads * d.dim == d.hidden_size == 7168


def test_a_small_mla_target_s_drafter_keeps_its_heads_whole(tmp_path: Path) -> None:
    small = {
        **DEEPSEEK_V3,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "head_dim": 16,
    }
    d = drafter_config_for(_target(tmp_path, small), 32)
    assert (d.num_heads, d.num_kv_heads, d.dim) == (2, 2, 128)
