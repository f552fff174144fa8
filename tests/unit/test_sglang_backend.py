"""The checks on SGLang's hidden-state responses, the capture hooks, and the backend's configuration.

The responses are tests/fixtures/sglang/hidden_states_*.json (SGLang's `/generate` format, read from its source;
see the README there): the request for each is input_ids [1, 2, 3, 4, 5] to a target of hidden size 4.
"""

from __future__ import annotations

import fnmatch
import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from eagle3_core.engines.sglang_capture import capture_hook_specs, capture_launch_args, hooked_layer_ids
from eagle3_core.engines.sglang_client import SGLangError
from eagle3_core.engines.sglang_models import MODELS
from eagle3_core.targets.base import SampleFailure
from eagle3_core.targets.sglang import (
    echo_problem,
    finite_problem,
    row_count_problem,
    states_from_response,
    width_problem,
)
from tests.conftest import FIXTURES

LLAMA = MODELS["LlamaForCausalLM"]

SENT = [1, 2, 3, 4, 5]
H = 4
MAX_REASON = 200  # store.shards.MAX_REASON: a longer reason is cut in the shard's header


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / "sglang" / f"hidden_states_{name}.json").read_text())
    return data


def rows(name: str) -> torch.Tensor:
    return torch.tensor(fixture(name)["meta_info"]["hidden_states"][0])


# ---- the pure checks ---------------------------------------------------------------------------------------
def test_row_count_equal_is_fine() -> None:
    assert row_count_problem(52, 52) is None
    assert row_count_problem(52, 52, cached_tokens=0) is None


def test_fewer_rows_with_cached_tokens_names_the_radix_cache_and_the_flag() -> None:
    why = row_count_problem(37, 52, cached_tokens=15)
    assert why is not None
    assert why.startswith("sglang returned 37 hidden-state rows for 52 input tokens: the radix cache")
    assert "(15 tokens)" in why and "--disable-radix-cache" in why
    assert len(why) <= MAX_REASON


def test_fewer_rows_without_cached_tokens_names_both_causes() -> None:
    why = row_count_problem(4096, 5000, cached_tokens=0)
    assert why is not None and "4096 hidden-state rows for 5000 input tokens" in why
    assert "--chunked-prefill-size -1" in why and "--disable-radix-cache" in why
    assert len(why) <= MAX_REASON


def test_more_rows_than_tokens_is_refused_too() -> None:
    why = row_count_problem(53, 52)
    assert why is not None and "more rows than tokens" in why


@pytest.mark.parametrize(
    ("width", "with_aux", "expected"),
    [
        (4, False, None),
        (16, True, None),
        (4, True, "final state only"),
        (12, False, "SGLang's own EAGLE-3 aux states"),
        (12, True, "SGLang's own EAGLE-3 aux states"),
        (5, False, "another model"),
        (20, True, "another model"),
    ],
)
def test_width(width: int, with_aux: bool, expected: str | None) -> None:
    why = width_problem(width, H, with_aux)
    if expected is None:
        assert why is None
    else:
        assert why is not None and expected in why
        assert f"rows {width} wide, expected {16 if with_aux else 4}" in why


def test_finite() -> None:
    assert finite_problem(torch.zeros(3, 4)) is None
    t = torch.zeros(3, 4)
    t[1, 2], t[2, 0] = float("nan"), float("-inf")
    why = finite_problem(t)
    assert why == (
        "sglang returned 2 non-finite hidden-state values (first: nan at row 1, column 2); "
        "the target overflowed on this sample"
    )


def test_echoed_token_ids() -> None:
    assert echo_problem([1, 2, 3], [1, 2, 3]) is None
    assert echo_problem([2, 3], [1, 2, 3]) is None  # logprobs from a start position cover the tail
    assert echo_problem([9, 3], [1, 2, 3]) == (
        "sglang ran other token ids than were sent: position 1 is 9, sent 2"
    )
    assert echo_problem([1, 2, 3, 4], [1, 2, 3]) == "sglang echoed 4 input token ids for 3 sent"


# ---- one response, from the fixtures ---------------------------------------------------------------------------
def test_the_good_response_gives_its_rows() -> None:
    states = states_from_response(fixture("good"), SENT, H, with_aux=False)
    assert isinstance(states, torch.Tensor)
    assert torch.equal(states, rows("good"))  # the fixture's values are exact in float32


def test_the_capture_response_gives_aux_and_final() -> None:
    states = states_from_response(fixture("capture"), SENT, H, with_aux=True)
    assert isinstance(states, torch.Tensor) and states.shape == (5, 16)
    assert torch.equal(states[:, 12:], rows("good"))  # the final state is the stock server's


def test_a_short_response_is_rejected_with_the_radix_cache_reason() -> None:
    failure = states_from_response(fixture("short"), SENT, H, with_aux=False)
    assert isinstance(failure, SampleFailure)
    assert failure.reason == (
        "sglang returned 3 hidden-state rows for 5 input tokens: the radix cache served a cached prefix "
        "(2 tokens) without running it; launch with --disable-radix-cache"
    )


def test_a_null_value_is_rejected() -> None:
    failure = states_from_response(fixture("nan"), SENT, H, with_aux=False)
    assert isinstance(failure, SampleFailure)
    assert "null for a hidden-state value (row 3, column 1)" in failure.reason
    assert len(failure.reason) <= MAX_REASON


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_number_is_rejected(bad: float) -> None:
    # the engine hands Python floats; Python's json module reads NaN and Infinity literals the same way
    response = fixture("good")
    response["meta_info"]["hidden_states"][0][2][3] = bad
    failure = states_from_response(json.loads(json.dumps(response)), SENT, H, with_aux=False)
    assert isinstance(failure, SampleFailure)
    assert f"first: {bad} at row 2, column 3" in failure.reason


def test_a_wrong_width_stops_the_run() -> None:
    with pytest.raises(SGLangError, match=r"rows 5 wide, expected 4 .*another model than target.path"):
        states_from_response(fixture("wide"), SENT, H, with_aux=False)
    with pytest.raises(SGLangError, match=r"rows 4 wide, expected 16 .*final state only"):
        states_from_response(fixture("good"), SENT, H, with_aux=True)


def test_other_prompt_counts_and_echoed_ids_are_rejected() -> None:
    failure = states_from_response(fixture("good"), [1, 2, 3, 4], H, with_aux=False)
    assert isinstance(failure, SampleFailure) and failure.reason == (
        "sglang counted 5 prompt tokens for 4 input_ids sent"
    )
    echoed = fixture("good")
    echoed["meta_info"]["input_token_logprobs"] = [[None, 3, None], [-1.5, 4, None], [-0.2, 7, None]]
    failure = states_from_response(echoed, SENT, H, with_aux=False)
    assert isinstance(failure, SampleFailure) and "position 4 is 7, sent 5" in failure.reason
    echoed["meta_info"]["input_token_logprobs"] = [[None, 3, None], [-1.5, 4, None], [-0.2, 5, None]]
    assert isinstance(states_from_response(echoed, SENT, H, with_aux=False), torch.Tensor)


def test_ragged_rows_and_aborts_are_sample_failures() -> None:
    ragged = fixture("good")
    ragged["meta_info"]["hidden_states"][0][1] = [0.0, 1.0]
    failure = states_from_response(ragged, SENT, H, with_aux=False)
    assert isinstance(failure, SampleFailure) and "unequal widths [2, 4]" in failure.reason
    aborted = json.loads((FIXTURES / "sglang" / "generate_abort.json").read_text())
    failure = states_from_response(aborted, SENT, H, with_aux=False)
    assert isinstance(failure, SampleFailure) and failure.reason == (
        "sglang aborted the request: Abort in waiting queue"
    )


def test_a_server_without_hidden_states_or_with_an_error_stops_the_run() -> None:
    plain = json.loads((FIXTURES / "sglang" / "generate_no_spec.json").read_text())
    with pytest.raises(SGLangError, match="--enable-return-hidden-states"):
        states_from_response(plain, list(range(17)), H, with_aux=False)
    error = json.loads((FIXTURES / "sglang" / "error_validation.json").read_text())
    with pytest.raises(SGLangError, match="validation error for GenerateReqInput"):
        states_from_response(error, SENT, H, with_aux=False)
    with pytest.raises(SGLangError, match="not a JSON object"):
        states_from_response([fixture("good")], SENT, H, with_aux=False)


def test_the_engine_may_hand_tensors() -> None:
    response = fixture("good")
    response["meta_info"]["hidden_states"] = [rows("good").to(torch.bfloat16)]
    states = states_from_response(response, SENT, H, with_aux=False)
    assert isinstance(states, torch.Tensor) and states.dtype == torch.float32
    assert torch.equal(states, rows("good"))  # every fixture value is exact in bfloat16 too


# ---- the capture hooks, on a stand-in for SGLang's Llama -------------------------------------------------------
class _Decoder(nn.Module):
    """SGLang's LlamaModel as far as capture goes: the state entering layer i, kept when i is listed."""

    def __init__(self, layers: int, h: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(h, h) for _ in range(layers))
        self.norm = nn.LayerNorm(h)
        self.layers_to_capture: list[int] = []

    def set_eagle3_layers_to_capture(self, ids: list[int]) -> None:
        self.layers_to_capture = ids

    def forward(self, x: torch.Tensor) -> Any:
        aux = []
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(x)
            x = x + torch.tanh(layer(x))
        x = self.norm(x)
        return x if not aux else (x, aux)


class _PackedDecoder(_Decoder):
    """SGLang's DeepseekV2Model as far as capture goes: the aux states packed side by side in one tensor."""

    def forward(self, x: torch.Tensor) -> Any:
        out = super().forward(x)
        return out if isinstance(out, torch.Tensor) else (out[0], torch.cat(out[1], -1))


class _LogitsProcessor(nn.Module):
    def forward(self, input_ids: Any, hidden: torch.Tensor, lm_head: Any, batch: Any, aux: Any = None) -> Any:
        # CaptureHiddenMode.FULL: with aux states SGLang stores their concatenation, else the final state
        return SimpleNamespace(hidden_states=torch.cat(aux, -1) if aux is not None else hidden)


class _CausalLM(nn.Module):
    def __init__(self, layers: int = 8, h: int = 4, packed: bool = False) -> None:
        super().__init__()
        self.model = (_PackedDecoder if packed else _Decoder)(layers, h)
        self.logits_processor = _LogitsProcessor()
        self.capture_aux_hidden_states = False  # set by the causal LM's own method, which eagle3 cannot call

    def forward(self, x: torch.Tensor) -> Any:
        hidden = self.model(x)
        aux = None
        if self.capture_aux_hidden_states:
            hidden, aux = hidden
        return self.logits_processor(None, hidden, None, None, aux)


class _MultimodalLM(nn.Module):
    """Kimi-K2.5 as far as hooks go: the DeepSeek-V3 causal LM nested as `language_model`, called as a module."""

    def __init__(self) -> None:
        super().__init__()
        self.language_model = _CausalLM(packed=True)

    def forward(self, x: torch.Tensor) -> Any:
        return self.language_model(x)


def _register(model: nn.Module, specs: list[dict[str, Any]]) -> None:
    """What SGLang's hook_manager.register_forward_hooks does with a spec list."""
    for spec in specs:
        path, name = spec["hook_factory"].split(":")
        hook = getattr(importlib.import_module(path), name)(spec["config"])
        for module_name, module in model.named_modules():
            if any(fnmatch.fnmatch(module_name, p) for p in spec["target_modules"]):
                module.register_forward_hook(hook)


@pytest.mark.parametrize(
    "architecture", ["LlamaForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]
)
def test_the_hooks_return_aux_in_the_asked_order_then_the_final_state(architecture: str) -> None:
    torch.manual_seed(0)
    row = MODELS[architecture]
    root: nn.Module = (
        _MultimodalLM()
        if row.decoder == "language_model.model"
        else _CausalLM(packed=row.aux_output == "packed")
    )
    lm = root.get_submodule(row.decoder.rpartition(".")[0]) if "." in row.decoder else root
    assert isinstance(lm, _CausalLM)
    ids = (6, 1, 4)  # not sorted: SGLang captures in layer order, the rows follow the config
    _register(root, capture_hook_specs(ids, row))
    x = torch.randn(5, 4)
    with torch.no_grad():
        first = root.forward(x).hidden_states  # the model runner calls forward(), not the module
        second = root.forward(x).hidden_states
        entering, h = [], x
        for layer in lm.model.layers:
            entering.append(h)
            h = h + torch.tanh(layer(h))
        final = lm.model.norm(h)
    assert first.shape == (5, 4)  # the first forward turns capture on: the final state only
    assert torch.equal(first, final)
    assert second.shape == (5, 16)
    assert torch.equal(second, torch.cat([entering[6], entering[1], entering[4], final], -1))
    assert lm.model.layers_to_capture == [6, 1, 4]  # the decoder's ids: the layers whose input is read


def test_the_hooks_leave_a_decode_step_alone() -> None:
    lm = _CausalLM()
    _register(lm, capture_hook_specs((1, 4, 6), LLAMA))
    lm.forward(torch.randn(3, 4))  # turns capture on
    lm.model.layers_to_capture = []  # a forward without capture: no aux list
    out = lm.forward(torch.randn(2, 4)).hidden_states
    assert out.shape == (2, 4)


def test_launch_args_and_what_a_server_reports() -> None:
    flag, value = capture_launch_args([2, 16, 29], LLAMA)
    assert flag == "--forward-hooks"
    specs = json.loads(value)
    assert specs == capture_hook_specs([2, 16, 29], LLAMA)
    assert [s["target_modules"] for s in specs] == [["model"], ["logits_processor"]]
    kimi = capture_hook_specs([2, 16, 29], MODELS["KimiK25ForConditionalGeneration"])
    assert [s["target_modules"] for s in kimi] == [
        ["language_model.model"],
        ["language_model.logits_processor"],
    ]
    assert hooked_layer_ids(specs) == [2, 16, 29]
    assert hooked_layer_ids(None) is None
    assert hooked_layer_ids([{"hook_factory": "other:hook", "config": {}}]) is None


# ---- configuration -----------------------------------------------------------------------------------------------
def test_the_engine_backend_says_how_to_get_sglang(tmp_path: Path) -> None:
    from eagle3_core.config import TargetConfig
    from eagle3_core.errors import Eagle3Error
    from eagle3_core.targets.sglang import SGLangEngineBackend

    try:
        import sglang  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("SGLang is installed here: tests/sglang runs the engine")
    with pytest.raises(
        Eagle3Error, match=r"needs SGLang, which is not installed: pip install 'eagle3\[sglang\]'"
    ):
        SGLangEngineBackend(tmp_path, TargetConfig())
