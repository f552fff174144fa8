"""The SGLang architecture table, row by row: decoder path, aux format and layer-id rule as eagle3 relies on them,
and the ids an export writes (tests/conformance runs the same rows against SGLang 0.5.23's own code)."""

import pytest

from eagle3_core.engines.sglang_models import (
    MODELS,
    captured_layers,
    config_layer_ids,
    serving_dtype,
    sglang_model,
)
from eagle3_core.errors import ConfigError
from eagle3_core.export.common import ExportTarget

# architecture -> (source, decoder path, aux format, layer-id rule)
ROWS = {
    "LlamaForCausalLM": ("llama.py", "model", "list", "plus_one"),
    "Qwen2ForCausalLM": ("qwen2.py", "model", "list", "plus_one"),
    "Qwen3ForCausalLM": ("qwen3.py", "model", "list", "plus_one"),
    "Qwen3MoeForCausalLM": ("qwen3_moe.py", "model", "list", "plus_one"),
    "DeepseekV2ForCausalLM": ("deepseek_v2.py", "model", "packed", "plus_one_if_first_is_1"),
    "DeepseekV3ForCausalLM": ("deepseek_v2.py", "model", "packed", "plus_one_if_first_is_1"),
    "KimiK25ForConditionalGeneration": (
        "kimi_k25.py",
        "language_model.model",
        "packed",
        "plus_one_if_first_is_1",
    ),
    "Glm4MoeForCausalLM": ("glm4_moe.py", "model", "list", "plus_one"),
    "Glm4MoeLiteForCausalLM": ("glm4_moe_lite.py", "model", "list", "plus_one_if_first_is_1"),
    "GptOssForCausalLM": ("gpt_oss.py", "model", "list", "plus_one_unless_max_is_L"),
}


@pytest.mark.parametrize("architecture", sorted(ROWS))
def test_each_architecture_row_pins_its_decoder_path_aux_format_and_layer_rule(architecture: str) -> None:
    row = sglang_model(["SomethingElse", architecture])
    source, decoder, aux_output, rule = ROWS[architecture]
    assert (row.source, row.decoder, row.aux_output, row.layer_id_rule) == (source, decoder, aux_output, rule)
    prefix = decoder.rpartition(".")[0]  # the logits processor sits beside the decoder, in the causal LM
    assert row.logits_processor == (f"{prefix}." if prefix else "") + "logits_processor"
    # the default ids of a 61-layer target (Kimi-K2.5, DeepSeek-V3) are written so SGLang captures them
    ids = (2, 30, 58)
    written = config_layer_ids(row, ids, 61)
    assert captured_layers(rule, written, 61) == list(ids)


def test_the_table_has_every_row_and_no_other() -> None:
    assert set(MODELS) == set(ROWS)
    with pytest.raises(
        ConfigError, match=r"\['MistralForCausalLM'\] .* not one eagle3 knows .* known: Deepseek"
    ):
        sglang_model(["MistralForCausalLM"], "target/config.json")


@pytest.mark.parametrize(
    ("architecture", "ids", "written"),
    [
        ("LlamaForCausalLM", (1, 4, 6), (0, 3, 5)),
        ("LlamaForCausalLM", (3, 10, 20), (2, 9, 19)),
        ("DeepseekV3ForCausalLM", (2, 30, 58), (1, 29, 57)),  # first id 1: SGLang adds one
        ("DeepseekV3ForCausalLM", (3, 30, 58), (3, 30, 58)),  # else taken as given: k - 1 would be off by one
        ("KimiK25ForConditionalGeneration", (10, 30, 58), (10, 30, 58)),
        ("GptOssForCausalLM", (2, 12, 21), (1, 11, 20)),
    ],
)
def test_an_export_writes_the_ids_sglang_turns_into_the_trained_layers(
    architecture: str, ids: tuple[int, int, int], written: tuple[int, int, int]
) -> None:
    assert config_layer_ids(MODELS[architecture], ids, 24 if "GptOss" in architecture else 61) == written


@pytest.mark.parametrize(
    ("architecture", "ids", "reason"),
    [
        # DeepSeek: writing 0.. is taken as given (layer 0), writing 1.. gets one added (layer 2)
        (
            "DeepseekV3ForCausalLM",
            (1, 30, 58),
            r"\[0, 29, 57\] would capture \[0, 29, 57\]; \[1, 30, 58\] would capture \[2, 31, 59\]",
        ),
        ("LlamaForCausalLM", (0, 4, 6), r"\[-1, 3, 5\] is no valid config"),
    ],
)
def test_a_first_aux_layer_no_ids_can_express_is_refused_with_the_reason(
    architecture: str, ids: tuple[int, int, int], reason: str
) -> None:
    with pytest.raises(ConfigError, match=reason):
        config_layer_ids(MODELS[architecture], ids, 61)


def test_an_export_for_deepseek_refuses_a_first_aux_layer_of_1_and_unsorted_ids() -> None:
    from eagle3_core.errors import ExportError
    from eagle3_core.export.sglang import SGLangFormat

    deepseek = ExportTarget(
        "deepseek-ai/DeepSeek-V3",
        61,
        (1, 30, 58),
        "post_norm",
        129280,
        7168,
        4096,
        ("DeepseekV3ForCausalLM",),
    )
    with pytest.raises(
        ExportError, match="cannot export for SGLang: aux layers \\[1, 30, 58\\] cannot be captured"
    ):
        SGLangFormat().engine_layer_ids(deepseek.aux_layer_ids, deepseek.layers)
    with pytest.raises(ExportError, match="ascending layer order"):
        ExportTarget("t", 61, (30, 2, 58), "post_norm", 10, 8, 64, ("DeepseekV3ForCausalLM",))


@pytest.mark.parametrize(
    ("target_dtype", "config", "served"),
    [
        ("auto", {"torch_dtype": "bfloat16", "model_type": "llama"}, "bfloat16"),
        ("auto", {"dtype": "float16", "model_type": "qwen2"}, "float16"),
        ("auto", {"torch_dtype": "float32", "model_type": "llama"}, "float16"),  # SGLang downcasts float32
        ("auto", {"model_type": "llama"}, "float16"),  # undeclared counts as float32
        ("auto", {"torch_dtype": "float32", "model_type": "gemma2"}, "bfloat16"),
        ("float16", {"torch_dtype": "bfloat16"}, "float16"),  # target.dtype given: that one
    ],
)
def test_the_serving_dtype_is_the_one_sglang_serves_the_target_in(
    target_dtype: str, config: dict[str, object], served: str
) -> None:
    assert serving_dtype(target_dtype, config) == served
