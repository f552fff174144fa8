"""Run beside SGLang 0.5.23: build its real `LlamaForCausalLMEagle3` for each eagle3 SGLang export given, load the
export's tensors with the model's own `load_weights`, and print what happened, as JSON:

- `unconsumed`: tensors no weight loader took (`load_weights` skips unknown names silently), d2t/t2d aside;
- `not_loaded`: model parameters no tensor was loaded into;
- `max_abs_diff`: per parameter, against the export's tensors (q/k/v and gate/up stacked as SGLang stacks them);
- `hot_token_id_is_d2t_plus_arange`, and the EAGLE-3.1 flags as the built model holds them.

SGLang's model-parallel groups are built on gloo with world size 1 after publishing server arguments for a tiny
Llama target, as a scheduler process does; nothing is run on a device.
"""

import json
import socket
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from sglang.srt.distributed import parallel_state
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import prepare_server_args
from transformers import LlamaConfig

exports = [Path(p) for p in json.loads(sys.argv[1])]
target = Path(sys.argv[2])
publish(
    prepare_server_args(["--model-path", str(target), "--device", "cpu", "--skip-tokenizer-init"]),
    role="scheduler",
    ranks=SpawnRanks(world_rank=0),
)
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
parallel_state.init_distributed_environment(
    world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
)
parallel_state.initialize_model_parallel(backend="gloo")

from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3  # noqa: E402 (needs the groups)

STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def expected_params(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What each model parameter should hold after loading: the export's tensors, stacked where SGLang stacks."""
    out = {}
    for name, value in tensors.items():
        if name in ("d2t", "t2d"):
            continue
        name = name.replace("midlayer.", "layers.0.")
        name = name if name.startswith("lm_head.") else f"model.{name}"
        out[name] = value
    for stacked, parts in STACKED.items():
        firsts = [n for n in out if n.endswith(f".{parts[0]}.weight")]
        for first in firsts:
            names = [first.replace(f".{parts[0]}.", f".{p}.") for p in parts]
            out[first.replace(f".{parts[0]}.", f".{stacked}.")] = torch.cat([out.pop(n) for n in names], 0)
    return out


def load(export: Path) -> dict[str, Any]:
    config = LlamaConfig.from_pretrained(export)
    model = LlamaForCausalLMEagle3(config)
    params = dict(model.named_parameters())
    calls: list[str] = []
    for name, param in params.items():
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        original = getattr(param, "weight_loader", default_weight_loader)

        def recording(
            p: torch.Tensor, w: torch.Tensor, *shard: Any, _name: str = name, _f: Any = original
        ) -> None:
            calls.append(_name)
            _f(p, w, *shard)

        param.weight_loader = recording  # type: ignore[attr-defined]
    tensors = load_file(str(export / "model.safetensors"))
    consumed: list[str] = []
    for name, value in tensors.items():
        before = len(calls)
        model.load_weights([(name, value)])
        if len(calls) > before or name in ("d2t", "t2d"):
            consumed.append(name)
    expected = expected_params(tensors)
    d2t = tensors["d2t"]
    inner = model.model
    return {
        "unconsumed": sorted(set(tensors) - set(consumed)),
        "not_loaded": sorted(set(params) - set(calls)),
        "unexpected": sorted(set(expected) - set(params)),
        # a vocab-parallel lm_head pads its rows to a multiple of 64: the export's rows are its first ones
        "max_abs_diff": {
            n: float((params[n].detach()[: len(expected[n])].float() - expected[n].float()).abs().max())
            for n in expected
            if n in params
        },
        "hot_token_id_is_d2t_plus_arange": bool(
            torch.equal(model.hot_token_id, d2t + torch.arange(d2t.shape[0]))
        ),
        "flags": {
            "norm_before_fc": getattr(inner, "input_norm", None) is not None,
            "fc_norm": getattr(inner, "fc_norm", None) is not None,
            "norm_output": bool(getattr(inner, "norm_output", False)),
        },
    }


print(json.dumps({str(e): load(e) for e in exports}))
