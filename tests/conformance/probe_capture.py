"""Run beside SGLang 0.5.23: build the causal LM of one row of eagle3's architecture table
(engines/sglang_models.py) the way SGLang builds it, run it, and print what SGLang's own code did, as JSON:
`python probe_capture.py ARCHITECTURE MODEL_DIR` (MODEL_DIR: a tiny config and tokenizer, families.py's
`save_table_config`).

The model is built and run by SGLang's ModelRunner through SGLang's own no-scheduler path,
`sglang.benchmark.one_batch` (what `python -m sglang.bench_one_batch` runs): server arguments resolved and
published, model-parallel groups on gloo at world size 1, random weights (`load_format dummy`), on the CPU with
torch_native attention in float32, and eagle3's capture hooks in its `forward_hooks`, which SGLang's ModelRunner
registers itself (model_executor/hook_manager.py, fnmatch over the model's named_modules). Reported:

- `hooks`: the modules SGLang put eagle3's decoder and logits-processor hooks on;
- `logits_processors`: the modules that are SGLang LogitsProcessors;
- `aux_output`: what the module the decoder hook is on returned beside the final state in a real prefill with
  capture on (the hook turns capture on after the first prefill, as in an engine; the second one captures):
  `packed`, one tensor (AuxHiddenStatePacker), or `list`, an AuxHiddenStateList; `aux_output_from`: `forward`;
- `rows`: the rows that prefill stored for `return_hidden_states`: their width and whether they are the
  decoder's aux states in layer order then its final state;
- `decoder`: the modules whose `layers_to_capture` the causal LM's own set_eagle3_layers_to_capture sets;
- `captured`: for each aux-layer choice, the ids eagle3's export writes (or its refusal) and the layers that real
  method then marks in the built decoder, each candidate id list too when eagle3 refuses;
- `hooked`: eagle3's capture hooks given the decoder output SGLang's real collectors make (AuxHiddenStatePacker
  or AuxHiddenStateList) and the real LogitsProcessorOutput: whether the stored rows become
  [aux in layer order | final] and the decoder's layers_to_capture the ids asked for.

GPT-OSS is built but not run: SGLang 0.5.23 accepts it only on attention backends that take its attention sinks
(triton, fa3, ..., intel_amx) and its CPU attention does not (the prefill goes to torch_native's forward_extend,
which has no `sinks`). It is built with intel_amx, and its `aux_output` is read from its decoder's forward
source (`aux_output_from`: `source`).

One stand-in, the one live_extract.py has and for the same reason: SGLang's DeepSeek attention dispatch has no
entry for torch_native; here it takes the absorbed MLA path, the one SGLang's GPU backends take for these shapes.
"""

import inspect
import json
import sys
import types
from array import array
from typing import Any

import torch
from sglang.benchmark import one_batch
from sglang.srt.entrypoints.engine import _set_envs_and_config
from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList, AuxHiddenStatePacker
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs

from eagle3_core.engines.sglang_capture import capture_hook_specs, decoder_hook, logits_hook
from eagle3_core.engines.sglang_models import MODELS, SGLangModel, config_layer_ids
from eagle3_core.errors import ConfigError

AttentionBackendRegistry.register("torch_native", lambda attn, forward_batch: AttnForwardMethod.MLA)

LAYERS = 8  # families.py's tiny targets
CHOICES = [(2, 4, 6), (1, 3, 5), (3, 4, 6), (5, 6, 7), (2, 4, 7)]
HOOK_IDS = [2, 4, 6]  # the layers eagle3's hooks capture in the prefills
PROMPT = list(range(10, 30))
NOT_RUN = {"GptOssForCausalLM": "intel_amx"}  # built on this backend, never run (the module docstring)


def build(row: SGLangModel, model_dir: str) -> Any:
    """SGLang's ModelRunner over `model_dir`, eagle3's capture hooks registered by it."""
    kwargs: dict[str, Any] = {
        "model_path": model_dir,
        "device": "cpu",
        "attention_backend": NOT_RUN.get(row.architecture, "torch_native"),
        "dtype": "float32",
        "load_format": "dummy",
        "max_total_tokens": 1024,
        "mem_fraction_static": 0.5,
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "enable_return_hidden_states": True,
        "skip_tokenizer_init": True,
        "forward_hooks": capture_hook_specs(HOOK_IDS, row),
    }
    if row.architecture.endswith("ForConditionalGeneration"):
        kwargs["enable_multimodal"] = False  # Kimi-K2.5's text model alone: no image processor to load
    server_args = ServerArgs(**kwargs)
    server_args.resolve_once()
    _set_envs_and_config(server_args)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
    one_batch._init_process_global_configs()
    runner, _ = one_batch.load_model(server_args, PortArgs.init_new(server_args), 0, 0)
    return runner.torch_runner


def prefill(runner: Any, rid: str) -> None:
    """One prefill of PROMPT asking for hidden states, as one_batch's correctness test sets its requests up."""
    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", PROMPT),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        return_hidden_states=True,
    )
    req.full_untruncated_fill_ids = req.origin_input_ids
    req.logprob_start_len = -1
    req.extend_end = len(PROMPT)
    one_batch.extend([req], runner)


def eagle3_hooks(module: torch.nn.Module) -> list[str]:
    return [
        kind
        for kind, factory in (("decoder", decoder_hook), ("logits", logits_hook))
        for hook in module._forward_hooks.values()
        if getattr(hook, "__qualname__", "") == f"{factory.__name__}.<locals>.hook"
    ]


def run(runner: Any, decoder: torch.nn.Module, logits_processor: torch.nn.Module) -> dict[str, Any]:
    """Two prefills; what the decoder returned and the logits processor stored in the second."""
    seen: dict[str, Any] = {}

    def decoder_output(_m: Any, _args: Any, output: Any) -> None:  # before eagle3's hook replaces it
        seen["decoder"] = output

    def stored(_m: Any, _args: Any, output: Any) -> None:  # after eagle3's hook has replaced the rows
        seen["rows"] = output.hidden_states

    handles = [
        decoder.register_forward_hook(decoder_output, prepend=True),
        logits_processor.register_forward_hook(stored),
    ]
    prefill(runner, "first")  # eagle3's decoder hook turns capture on after it
    prefill(runner, "second")
    for handle in handles:
        handle.remove()
    output, rows = seen["decoder"], seen["rows"]
    if not isinstance(output, tuple):
        return {"aux_output": type(output).__name__, "aux_output_from": "forward", "rows": None}
    final, aux = output
    packed = isinstance(aux, torch.Tensor)
    states = list(aux.chunk(len(HOOK_IDS), -1)) if packed else list(aux)
    return {
        "aux_output": "packed"
        if packed
        else "list"
        if isinstance(aux, AuxHiddenStateList)
        else type(aux).__name__,
        "aux_output_from": "forward",
        "rows": {
            "tokens": int(rows.shape[0]),
            "width": int(rows.shape[1]),
            "aux_then_final": bool(torch.equal(rows, torch.cat([*states, final], -1))),
        },
    }


def capturing(modules: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in modules.items() if hasattr(m, "layers_to_capture")}


def real_capture(
    model: torch.nn.Module, modules: dict[str, torch.nn.Module], config_ids: list[int]
) -> dict[str, Any]:
    """The layers the causal LM's own set_eagle3_layers_to_capture(config_ids) marks, per module it marks."""
    for m in capturing(modules).values():
        m.layers_to_capture = []
    model.set_eagle3_layers_to_capture(config_ids)
    return {
        name: [int(k) for k in m.layers_to_capture]
        for name, m in capturing(modules).items()
        if m.layers_to_capture
    }


def captured(
    row: SGLangModel, model: torch.nn.Module, modules: dict[str, torch.nn.Module]
) -> list[dict[str, Any]]:
    out = []
    for ids in CHOICES:
        try:
            written = list(config_layer_ids(row, ids, LAYERS))
            marked = real_capture(model, modules, written)
            out.append({"ids": list(ids), "written": written, "captured": only(marked)})
        except ConfigError as e:
            tried = {
                str(c): only(real_capture(model, modules, c))
                for c in ([k - 1 for k in ids], list(ids))
                if min(c) >= 0
            }
            out.append({"ids": list(ids), "refused": str(e), "candidates_capture": tried})
    return out


def only(marked: dict[str, Any]) -> Any:
    """The layers of the one module marked (a dict of them when another number were)."""
    return next(iter(marked.values())) if len(marked) == 1 else marked


class StandIn:
    """`self` for a model method: the attributes the method touches, nothing built."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


def hooked(row: SGLangModel, decoder_cls: type) -> dict[str, Any]:
    """eagle3's hooks on the decoder output SGLang's real collector makes for this row."""
    ids = [2, 12, 21]
    torch.manual_seed(0)
    states = [torch.randn(5, 8) for _ in ids]  # the inputs of layers 2, 12, 21, in layer order
    final = torch.randn(5, 8)
    collector: Any = AuxHiddenStatePacker(len(ids)) if row.aux_output == "packed" else AuxHiddenStateList()
    for state in states:
        collector.capture(state)
    aux = collector.finalize() if row.aux_output == "packed" else collector
    decoder = StandIn(layers=[StandIn() for _ in range(24)], layers_to_capture=[])
    setter = getattr(decoder_cls, "set_eagle3_layers_to_capture", None)
    if setter is not None:
        decoder.set_eagle3_layers_to_capture = types.MethodType(setter, decoder)
    config = {"layer_ids": ids}
    passed_on = decoder_hook(config)(decoder, (), (final, aux))  # type: ignore[arg-type]
    output = LogitsProcessorOutput(next_token_logits=None, hidden_states=final)
    logits_hook(config)(None, (), output)  # type: ignore[arg-type]
    stored = output.hidden_states
    assert stored is not None
    return {
        "aux_type": type(aux).__name__,
        "passes_final_on": passed_on is final,
        "layers_to_capture": [int(k) for k in decoder.layers_to_capture],
        "rows_are_aux_then_final": bool(torch.equal(stored, torch.cat([*states, final], -1))),
    }


architecture, model_dir = sys.argv[1:3]
row = MODELS[architecture]
runner = build(row, model_dir)
model = runner.model
modules = dict(model.named_modules())
hooks = {
    kind: [name for name, m in modules.items() if kind in eagle3_hooks(m)] for kind in ("decoder", "logits")
}
report: dict[str, Any] = {
    "built": type(model).__name__,
    "hooks": hooks,
    "logits_processors": [name for name, m in modules.items() if isinstance(m, LogitsProcessor)],
}
if len(hooks["decoder"]) != 1 or len(hooks["logits"]) != 1:  # nothing more to learn: the test shows the hooks
    print(json.dumps(report))
    sys.exit(0)
hooked_decoder, hooked_logits = modules[hooks["decoder"][0]], modules[hooks["logits"][0]]
if architecture in NOT_RUN:
    source = inspect.getsource(type(hooked_decoder).forward)
    report |= {
        "aux_output": "packed" if "AuxHiddenStatePacker(" in source else "list",
        "aux_output_from": "source",
    }
else:
    report |= run(runner, hooked_decoder, hooked_logits)
report["decoder"] = list(real_capture(model, modules, [1, 3, 5]))
report["captured"] = captured(row, model, modules)
report["hooked"] = hooked(row, type(hooked_decoder))
print(json.dumps(report))
