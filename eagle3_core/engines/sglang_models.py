"""What eagle3 relies on in each SGLang 0.5.23 model it extracts from or drafts for, in one table.

For every target architecture (the `architectures` entry of its config.json), three facts of SGLang's model
code (`srt/models/<source>`), pinned by tests/conformance against that code:

- `decoder`, `logits_processor`: the module paths, in the causal LM, of the decoder whose forward collects
  the aux states and of the logits processor that stores returned hidden states. The capture hooks
  (engines/sglang_capture.py) are registered on exactly these names (SGLang matches hook targets against
  `named_modules()`): Kimi-K2.5 nests its DeepSeek-V3 language model as `language_model`.
- `aux_output`: how a capturing decoder returns its aux states beside the final state: `list`, one tensor
  per layer, or `packed`, one [tokens, 3H] tensor filled by `AuxHiddenStatePacker` (layers/aux_hidden_states.py).
- `layer_id_rule`: what the causal LM's `set_eagle3_layers_to_capture(config ids)` does with the drafter
  config's `eagle_aux_hidden_state_layer_ids` before the decoder captures the *input* of those layers
  (eagle3's convention, docs/design.md):
    plus_one               every id + 1 (llama.py and most models)
    plus_one_if_first_is_1 + 1 only when the first id is 1, else as given (deepseek_v2.py, glm4_moe_lite.py)
    plus_one_unless_max_is_L as given when the largest id is the layer count, else + 1 (gpt_oss.py)

`config_layer_ids` inverts the rule: the ids an export writes so that SGLang captures the layers eagle3 trained
on, refusing (with the reason) a choice no ids can express. An architecture not in the table is refused for
SGLang extraction and export: its capture cannot be known to match.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from eagle3_core.errors import ConfigError
from eagle3_core.store.atomic import read_json_object
from eagle3_core.store.records import validation_message

SGLANG_VERSION = "0.5.23"
LayerIdRule = Literal["plus_one", "plus_one_if_first_is_1", "plus_one_unless_max_is_L"]


class SGLangModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    architecture: str
    source: str  # srt/models/<source>, where the class and its rule live
    decoder: str = "model"
    logits_processor: str = "logits_processor"
    aux_output: Literal["list", "packed"] = "list"
    layer_id_rule: LayerIdRule = "plus_one"


def _deepseek(architecture: str, source: str = "deepseek_v2.py", **paths: str) -> SGLangModel:
    """The DeepSeek family: aux packed by AuxHiddenStatePacker, + 1 only when the first id is 1."""
    return SGLangModel(
        architecture=architecture,
        source=source,
        aux_output="packed",
        layer_id_rule="plus_one_if_first_is_1",
        **paths,
    )


MODELS: dict[str, SGLangModel] = {
    m.architecture: m
    for m in [
        SGLangModel(architecture="LlamaForCausalLM", source="llama.py"),
        SGLangModel(architecture="Qwen2ForCausalLM", source="qwen2.py"),
        SGLangModel(architecture="Qwen3ForCausalLM", source="qwen3.py"),
        SGLangModel(architecture="Qwen3MoeForCausalLM", source="qwen3_moe.py"),
        _deepseek("DeepseekV2ForCausalLM"),
        _deepseek("DeepseekV3ForCausalLM"),
        _deepseek(
            "KimiK25ForConditionalGeneration",
            "kimi_k25.py",
            decoder="language_model.model",
            logits_processor="language_model.logits_processor",
        ),
        SGLangModel(architecture="Glm4MoeForCausalLM", source="glm4_moe.py"),
        SGLangModel(
            architecture="Glm4MoeLiteForCausalLM",
            source="glm4_moe_lite.py",
            layer_id_rule="plus_one_if_first_is_1",
        ),
        SGLangModel(
            architecture="GptOssForCausalLM", source="gpt_oss.py", layer_id_rule="plus_one_unless_max_is_L"
        ),
    ]
}


class TargetArchitectures(BaseModel):
    """The `architectures` of a target's config.json (the user's Hugging Face file: its other fields are its own)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    architectures: tuple[str, ...] | None = None


def read_architectures(config_path: Path, error: type[Exception]) -> tuple[str, ...]:
    """The `architectures` config.json lists (none: empty); `error` naming the file when it is not a JSON
    object or the field is not a list of names."""
    try:
        found = TargetArchitectures.model_validate(read_json_object(config_path, error))
    except ValidationError as err:
        raise error(validation_message(config_path, err)) from None
    return found.architectures or ()


def sglang_model(architectures: Sequence[str], where: str = "") -> SGLangModel:
    """The table's row for a target whose config.json lists `architectures`; ConfigError naming the rows."""
    for name in architectures:
        if name in MODELS:
            return MODELS[name]
    raise ConfigError(
        f"target architecture {list(architectures)}{f' ({where})' if where else ''} is not one eagle3 knows "
        f"SGLang {SGLANG_VERSION}'s EAGLE-3 capture for (its decoder path, aux format and layer-id rule); "
        f"known: {', '.join(sorted(MODELS))}"
    )


def captured_layers(rule: LayerIdRule, config_ids: Sequence[int], num_layers: int | None) -> list[int]:
    """The layers whose input SGLang's set_eagle3_layers_to_capture(config_ids) captures, by `rule`
    (`num_layers` only matters to plus_one_unless_max_is_L: unknown, the ids are taken as not reaching it)."""
    ids = list(config_ids)
    if rule == "plus_one_if_first_is_1":
        return [k + 1 for k in ids] if ids and ids[0] == 1 else ids
    if rule == "plus_one_unless_max_is_L":
        return ids if ids and max(ids) == num_layers else [k + 1 for k in ids]
    return [k + 1 for k in ids]


def config_layer_ids(
    model: SGLangModel, aux_layer_ids: Sequence[int], num_layers: int | None
) -> tuple[int, int, int]:
    """The `eagle_aux_hidden_state_layer_ids` that make `model` capture the inputs of `aux_layer_ids`
    (eagle3's ids), ConfigError when none can: ids - 1 where the rule then adds one, else the ids as given."""
    ids = tuple(int(k) for k in aux_layer_ids)
    for candidate in (tuple(k - 1 for k in ids), ids):
        if min(candidate) >= 0 and captured_layers(model.layer_id_rule, candidate, num_layers) == list(ids):
            return (candidate[0], candidate[1], candidate[2])
    tried = []
    for candidate in (tuple(k - 1 for k in ids), ids):
        if min(candidate) < 0:
            tried.append(f"{list(candidate)} is no valid config (ids are >= 0)")
        else:
            got = captured_layers(model.layer_id_rule, candidate, num_layers)
            tried.append(f"{list(candidate)} would capture {got}")
    raise ConfigError(
        f"aux layers {list(ids)} cannot be captured by SGLang {SGLANG_VERSION}'s {model.architecture} "
        f"(srt/models/{model.source}, layer rule {model.layer_id_rule}): {'; '.join(tried)}; choose other "
        "aux layers (target.aux_layer_ids)"
    )


def captured_layer_ids(
    model: SGLangModel, config_ids: Sequence[int], num_layers: int | None
) -> tuple[int, int, int]:
    """The layers (eagle3's ids) an SGLang drafter config's ids make `model` capture."""
    a, b, c = captured_layers(model.layer_id_rule, config_ids, num_layers)
    return (a, b, c)


def serving_dtype(target_dtype: str, config: dict[str, object]) -> str:
    """The dtype SGLang serves a target in, from `target.dtype` and the target's config.json: the dtype
    given, or `--dtype auto`'s (srt/configs/model_config.py): the checkpoint's own dtype, float16 for a float32
    (or undeclared) checkpoint, bfloat16 for a float32 Gemma. Under auto SGLang resolves the drafter's dtype
    from the drafter's config by the same rule and runs fc on the target's states without a cast, so the export
    is written in a dtype both resolve to the same (steps/drafter.py `export_dtype`)."""
    if target_dtype != "auto":
        return target_dtype
    declared = config.get("dtype") or config.get("torch_dtype")
    if declared in ("bfloat16", "float16"):
        return str(declared)
    return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"


# The KV pool SGLang sizes from GPU memory; on a CPU it derives it from a share of host memory, which came out
# negative for a DeepSeek-shaped target, so eagle3 sets it there: tokens, the longest sample's several times over.
CPU_MAX_TOTAL_TOKENS = 16384


def resolved_device(device: str) -> str:
    """target.device as SGLang gets it: auto is cuda where a CUDA device is visible, else cpu."""
    if device != "auto":
        return device
    import torch  # only here: managing the server's process needs no torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_settings(device: str, max_total_tokens: int | None) -> dict[str, str | int]:
    """The ServerArgs SGLang needs for `device` (resolved, not auto) beyond its defaults: on a CPU the device, the
    torch_native attention (its other CPU backend needs Intel AMX) and the KV pool's size; on a GPU only a KV
    size that was set. One table for the in-process engine (keyword arguments) and the server (flags)."""
    settings: dict[str, str | int] = {}
    if device != "cuda":
        settings["device"] = device
        max_total_tokens = max_total_tokens or CPU_MAX_TOTAL_TOKENS
    if device == "cpu":
        settings["attention_backend"] = "torch_native"
    if max_total_tokens is not None:
        settings["max_total_tokens"] = max_total_tokens
    return settings
