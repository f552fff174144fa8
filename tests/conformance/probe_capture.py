"""Run beside SGLang 0.5.23: for each row of eagle3's architecture table (engines/sglang_models.py), read what
SGLang's own model code does, and print it as JSON:

- `decoder`/`logits_processor`: the attributes the causal LM's __init__ assigns them to (its source), nested
  through Kimi-K2.5's `language_model`;
- `aux_output`: whether the decoder class's forward packs its captures (AuxHiddenStatePacker) or lists them;
- `captured`: for each aux-layer choice, the ids eagle3's export writes (or its refusal) and the layers SGLang's
  real set_eagle3_layers_to_capture then marks in the decoder, called on stand-ins for `self` (a causal LM
  needs GPUs to build; the method's body is SGLang's), each candidate id list too when eagle3 refuses;
- `hooked`: eagle3's capture hooks given the decoder output SGLang's real collectors make (AuxHiddenStatePacker
  or AuxHiddenStateList) and the real LogitsProcessorOutput: whether the stored rows become
  [aux in layer order | final] and the decoder's layers_to_capture the ids asked for.
"""

import importlib
import inspect
import json
import re
import types
from typing import Any

import torch
from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList, AuxHiddenStatePacker
from sglang.srt.layers.logits_processor import LogitsProcessorOutput

from eagle3_core.engines.sglang_capture import decoder_hook, logits_hook
from eagle3_core.engines.sglang_models import MODELS, SGLangModel, config_layer_ids
from eagle3_core.errors import ConfigError

LAYERS = 24
CHOICES = [(2, 12, 21), (1, 10, 20), (3, 10, 20), (5, 11, 17), (2, 12, 23)]


def assigned_class(cls: type, attribute: str) -> type:
    """The class `cls.__init__` builds `self.<attribute>` from, resolved in the module that defines it."""
    source = inspect.getsource(cls.__init__)
    match = re.search(rf"self\.{attribute}\s*=\s*(self\.)?(\w+)\(", source)
    if match is None:
        raise LookupError(f"{cls.__name__}.__init__ assigns no self.{attribute} = Class(...)")
    name = match.group(2)
    if match.group(1):  # built by a method (LlamaForCausalLM._init_model): the class it returns
        returned = re.search(r"return\s+(\w+)\(", inspect.getsource(getattr(cls, name)))
        if returned is None:
            raise LookupError(f"{cls.__name__}.{name} returns no Class(...)")
        name = returned.group(1)
    return cls.__init__.__globals__[name]


def causal_lm_and_decoder(row: SGLangModel) -> tuple[type, type, list[str]]:
    """(the causal LM class whose set_eagle3_layers_to_capture runs, the decoder class, the path walked)."""
    cls = getattr(importlib.import_module(f"sglang.srt.models.{row.source[:-3]}"), row.architecture)
    path = []
    *outer, last = row.decoder.split(".")
    for attribute in outer:  # Kimi-K2.5: language_model = DeepseekV3ForCausalLM(...)
        path.append(attribute)
        cls = assigned_class(cls, attribute)
    path.append(last)
    return cls, assigned_class(cls, last), path


class StandIn:
    """`self` for a model method: the attributes the method touches, nothing built."""

    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)


def fake_decoder(decoder_cls: type) -> StandIn:
    decoder = StandIn(layers=[StandIn() for _ in range(LAYERS)], layers_to_capture=[])
    setter = getattr(decoder_cls, "set_eagle3_layers_to_capture", None)
    if setter is not None:
        decoder.set_eagle3_layers_to_capture = types.MethodType(setter, decoder)
    return decoder


def real_capture(row: SGLangModel, config_ids: list[int]) -> list[int]:
    """The layers SGLang's own set_eagle3_layers_to_capture(config_ids) marks in the decoder."""
    top = getattr(importlib.import_module(f"sglang.srt.models.{row.source[:-3]}"), row.architecture)
    lm_cls, decoder_cls, path = causal_lm_and_decoder(row)
    decoder = fake_decoder(decoder_cls)
    inner = StandIn(
        pp_group=StandIn(is_last_rank=True),
        config=StandIn(num_hidden_layers=LAYERS),
        model=decoder,
        capture_aux_hidden_states=False,
    )
    inner.set_eagle3_layers_to_capture = types.MethodType(lm_cls.set_eagle3_layers_to_capture, inner)
    outer: Any = inner
    if len(path) > 1:  # the multimodal wrapper delegates to its language model
        outer = StandIn(**{path[0]: inner})
    top.set_eagle3_layers_to_capture(outer, config_ids)
    assert inner.capture_aux_hidden_states is True
    return [int(k) for k in decoder.layers_to_capture]


def captured(row: SGLangModel) -> list[dict[str, Any]]:
    out = []
    for ids in CHOICES:
        try:
            written = list(config_layer_ids(row, ids, LAYERS))
            out.append({"ids": list(ids), "written": written, "captured": real_capture(row, written)})
        except ConfigError as e:
            tried = {str(c): real_capture(row, c) for c in ([k - 1 for k in ids], list(ids)) if min(c) >= 0}
            out.append({"ids": list(ids), "refused": str(e), "candidates_capture": tried})
    return out


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
    decoder = fake_decoder(decoder_cls)
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


report = {}
for name, row in MODELS.items():
    lm_cls, decoder_cls, path = causal_lm_and_decoder(row)
    lm_source = inspect.getsource(lm_cls.__init__)
    report[name] = {
        "decoder": ".".join(path),
        "decoder_class": decoder_cls.__name__,
        "logits_processor": ".".join([*path[:-1], "logits_processor"])
        if re.search(r"self\.logits_processor\s*=\s*LogitsProcessor\(", lm_source)
        else None,
        "aux_output": "packed"
        if "AuxHiddenStatePacker(" in inspect.getsource(decoder_cls.forward)
        else "list",
        "captured": captured(row),
        "hooked": hooked(row, decoder_cls),
    }
print(json.dumps(report))
