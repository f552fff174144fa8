"""Forward hooks that make SGLang return the EAGLE-3 aux states beside the final state, in one row per token.

SGLang returns hidden states only through `meta_info.hidden_states` (`return_hidden_states`), and only the
final state, post norm (docs/reference.md, "Hidden states from SGLang"). Its own EAGLE-3 capture,
`set_eagle3_layers_to_capture`, is switched on only when a drafter is loaded, and then the logits processor
stores `torch.cat(aux_hidden_states)` *instead of* the final state (`srt/layers/logits_processor.py`): never
both. These hooks keep SGLang's capture (the same tensors a drafter reads when SGLang serves it) and return
both, each row laid out as

    [aux(ids[0]) | aux(ids[1]) | aux(ids[2]) | final]      width 4H, aux in `layer_ids` order

They run inside SGLang's scheduler process, registered by SGLang's `forward_hooks` server argument
(`--forward-hooks JSON` for the HTTP server, `sglang.Engine(forward_hooks=...)`; added by sgl-project/sglang
PR #13217, `srt/model_executor/hook_manager.py`: a spec names modules by `fnmatch` pattern over
`model.named_modules()` and a factory `module:function` called with the spec's `config`). Why hooks and not a
call on the model: the engine's model lives in that other process, and the model runner calls the causal LM
as `model.forward(...)`, so hooks on the root module never fire; its submodules are called as modules.

- the decoder (`model`, or `language_model.model` in Kimi-K2.5: the path is the architecture's row in
  engines/sglang_models.py): after each forward, makes sure SGLang's capture is on, through the decoder's
  own `set_eagle3_layers_to_capture(ids)` where it has one (Qwen's MoE decoders mark their layers there), else
  its `layers_to_capture` (the decoder's ids name the layers whose *input* is captured, which is eagle3's
  convention; the causal LM's method, used with a drafter config, applies the model's layer-id rule first).
  A decoder capturing returns `(hidden, aux)`, aux a list of per-layer tensors or, in the DeepSeek family,
  one [T, 3H] tensor packed by `AuxHiddenStatePacker`; the causal LM, whose `capture_aux_hidden_states`
  flag stays off, expects the tensor alone, so the hook hands it the tensor and keeps the aux states.
  Capture starts with the decoder's second forward: the backends send probe requests until the rows are 4H
  wide.
- `logits_processor`: where SGLang stores every row of a prefill for `return_hidden_states`
  (`CaptureHiddenMode.FULL`: `hidden_states_to_store = hidden_states`, the final state), replaces them by the
  concatenation above. Any other forward (a decode step, a prefill without hidden states) is left alone.

This module imports torch and the architecture table only: SGLang imports it in its own process by the path in
the hook spec.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from eagle3_core.engines.sglang_models import SGLangModel

DECODER_FACTORY = "eagle3_core.engines.sglang_capture:decoder_hook"
LOGITS_FACTORY = "eagle3_core.engines.sglang_capture:logits_hook"

# The aux list of the forward in flight, from the decoder's hook to the logits processor's (one forward at
# a time per process: each tensor-parallel rank is its own process with its own copy of this module).
_pending: dict[str, list[torch.Tensor]] = {}

Hook = Callable[[nn.Module, tuple[Any, ...], Any], Any]


def capture_hook_specs(layer_ids: Sequence[int], model: SGLangModel) -> list[dict[str, Any]]:
    """SGLang's `forward_hooks` value that captures the residual stream entering `layer_ids` (eagle3's ids)
    in a target of `model`'s architecture (the module paths its hooks go on)."""
    config = {"layer_ids": [int(k) for k in layer_ids]}
    return [
        {
            "name": "eagle3_aux_capture",
            "target_modules": [model.decoder],
            "hook_factory": DECODER_FACTORY,
            "config": config,
        },
        {
            "name": "eagle3_aux_concat",
            "target_modules": [model.logits_processor],
            "hook_factory": LOGITS_FACTORY,
            "config": config,
        },
    ]


def capture_launch_args(layer_ids: Sequence[int], model: SGLangModel) -> list[str]:
    """The flags that add the hooks to `python -m sglang.launch_server` (one JSON argument)."""
    return ["--forward-hooks", json.dumps(capture_hook_specs(layer_ids, model), separators=(",", ":"))]


def hooked_layer_ids(forward_hooks: object) -> list[int] | None:
    """The layer ids eagle3's capture hooks were registered with, from a server's `forward_hooks`; None if absent."""
    if not isinstance(forward_hooks, list):
        return None
    for spec in forward_hooks:
        if isinstance(spec, dict) and spec.get("hook_factory") == DECODER_FACTORY:
            ids = (spec.get("config") or {}).get("layer_ids")
            if isinstance(ids, list) and all(isinstance(k, int) for k in ids):
                return [int(k) for k in ids]
    return None


def _layer_ids(config: dict[str, Any]) -> list[int]:
    ids = config.get("layer_ids")
    if not isinstance(ids, list) or len(ids) != 3 or len(set(ids)) != 3:
        raise ValueError(f"eagle3 capture hook: config.layer_ids must be three distinct layers, got {ids!r}")
    return [int(k) for k in ids]


def decoder_hook(config: dict[str, Any]) -> Hook:
    ids = _layer_ids(config)

    def hook(module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        if not getattr(module, "_eagle3_capture_on", False):
            setter = getattr(module, "set_eagle3_layers_to_capture", None)
            if callable(setter):
                setter(list(ids))
            elif hasattr(module, "layers_to_capture"):
                # older SGLang decoders have no setter: the causal LM's method assigns this attribute
                setattr(module, "layers_to_capture", list(ids))  # noqa: B010 (a plain attribute, not a submodule)
            else:
                raise TypeError(
                    f"{type(module).__name__} has no EAGLE-3 capture (set_eagle3_layers_to_capture): "
                    "SGLang cannot give this architecture's aux hidden states"
                )
            module._eagle3_capture_on = True  # type: ignore[assignment]
        aux = _aux_states(output, len(ids))
        if aux is not None:
            _pending["aux"] = aux
            return output[0]
        _pending.pop("aux", None)  # a forward without capture: nothing of an earlier one may be reused
        return None

    return hook


def _aux_states(output: Any, count: int) -> list[torch.Tensor] | None:
    """A capturing decoder's aux states, one tensor per layer in layer order, from `(hidden, aux)`: aux a list
    of them, or one tensor of `count` of them side by side (AuxHiddenStatePacker); None for any other output."""
    if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor)):
        return None
    aux = output[1]
    if isinstance(aux, list | tuple) and all(isinstance(t, torch.Tensor) for t in aux):
        return list(aux)
    if isinstance(aux, torch.Tensor) and aux.shape[-1] == count * output[0].shape[-1]:
        return list(aux.chunk(count, dim=-1))
    return None


def logits_hook(config: dict[str, Any]) -> Hook:
    ids = _layer_ids(config)
    # SGLang appends the captured states in layer order, whatever order the ids were given in
    order = [sorted(ids).index(k) for k in ids]

    def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        aux = _pending.pop("aux", None)
        stored = getattr(output, "hidden_states", None)
        if aux is None or not isinstance(stored, torch.Tensor) or len(aux) != len(ids):
            return None
        if any(a.shape[0] != stored.shape[0] for a in aux):
            return None  # not a full capture (e.g. only the last rows kept): leave SGLang's rows as they are
        output.hidden_states = torch.cat([aux[j].to(stored.dtype) for j in order] + [stored], dim=-1)
        return output

    return hook
