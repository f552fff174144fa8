"""Every SGLang command and engine argument eagle3 builds, read by SGLang 0.5.23's own argument code."""

import json
from pathlib import Path

from eagle3_core.config import Eagle3Config, config_from_dict
from eagle3_core.engines.sglang_capture import capture_hook_specs
from eagle3_core.engines.sglang_models import MODELS
from eagle3_core.engines.sglang_server import launch_command
from tests.conformance.conftest import Probe

AUX = [2, 16, 29]
LLAMA = MODELS["LlamaForCausalLM"]


def _config(tmp_path: Path) -> Eagle3Config:
    raw = {
        "store": "store",
        "target": {"path": "/models/llama", "dtype": "bfloat16"},
        "sglang": {"tp_size": 2, "mem_fraction_static": 0.7, "host": "127.0.0.1", "port": 31234},
    }
    return config_from_dict(raw, tmp_path)


def _server_argv(argv: list[str]) -> list[str]:
    """The arguments after the launcher (`python -m sglang.launch_server`), what its parser reads."""
    return argv[argv.index("--model-path") :]


def test_the_extraction_and_serving_commands_parse_in_the_real_server_args_as_intended(
    tmp_path: Path, sglang_probe: Probe
) -> None:
    cfg = _config(tmp_path)
    extract = launch_command(
        cfg, "/models/llama", "extract", aux_layer_ids=AUX, architectures=["LlamaForCausalLM"]
    )
    serve = launch_command(cfg, "/models/llama", "serve", drafter_dir="/drafters/d", k=5)
    result = sglang_probe("probe_server_args.py", json.dumps([_server_argv(extract), _server_argv(serve)]))
    (got_extract, got_serve) = result["parsed"]
    common = {
        "model_path": "/models/llama", "tp_size": 2, "mem_fraction_static": 0.7, "host": "127.0.0.1",
        "port": 31234, "dtype": "bfloat16",
    }  # fmt: skip
    fields = got_extract["fields"]
    assert {k: fields[k] for k in common} == common
    assert fields["disable_radix_cache"] is True and fields["chunked_prefill_size"] == -1
    assert fields["enable_return_hidden_states"] is True
    assert fields["cuda_graph_backend_decode"] == fields["cuda_graph_backend_prefill"] == "disabled"
    assert fields["forward_hooks"] == capture_hook_specs(AUX, LLAMA)  # the hooks arrive as eagle3 wrote them
    # at tp 2 no all-reduce is fused into the next layer's norm, where the hooks would read partial sums
    assert fields["enforce_disable_flashinfer_allreduce_fusion"] is True
    assert fields["speculative_algorithm"] is None
    fields = got_serve["fields"]
    assert {k: fields[k] for k in common} == common
    assert fields["speculative_algorithm"] == "EAGLE3"
    assert fields["speculative_draft_model_path"] == "/drafters/d"
    assert (fields["speculative_num_steps"], fields["speculative_eagle_topk"]) == (5, 1)
    assert fields["speculative_num_draft_tokens"] == 6
    assert fields["forward_hooks"] is None and fields["enable_return_hidden_states"] is False
    # nothing eagle3 passes is a deprecated spelling (0.5.23 deprecated --disable-cuda-graph)
    assert got_extract["deprecated"] == [] and got_serve["deprecated"] == []


def test_the_engine_arguments_eagle3_needs_are_fields_of_the_real_server_args(sglang_probe: Probe) -> None:
    # ServerArgs is a msgspec Struct in 0.5.23: reading its fields as a dataclass's raised TypeError
    result = sglang_probe("probe_server_args.py", "[]")
    assert "forward_hooks" in result["engine_fields"]
    assert {"enable_return_hidden_states", "disable_radix_cache", "chunked_prefill_size"} <= set(
        result["engine_fields"]
    )


def test_the_preflight_reads_sglangs_resolved_server_info_as_intended(
    tmp_path: Path, sglang_probe: Probe
) -> None:
    cfg = _config(tmp_path)
    extract = _server_argv(
        launch_command(cfg, "/models/llama", "extract", aux_layer_ids=AUX, architectures=["LlamaForCausalLM"])
    )
    mode_full = [
        a if a != "--enable-return-hidden-states" else "--return-hidden-states-mode" for a in extract
    ]
    mode_full.insert(mode_full.index("--return-hidden-states-mode") + 1, "full")
    mode_last = [a if a != "full" else "last" for a in mode_full]
    radix_on = [a for a in extract if a != "--disable-radix-cache"]
    no_hooks = extract[: extract.index("--forward-hooks")]
    fused = [a for a in extract if a != "--enforce-disable-flashinfer-allreduce-fusion"]
    fused.append("--enable-flashinfer-allreduce-fusion")
    problems = sglang_probe(
        "probe_server_info.py",
        json.dumps([extract, mode_full, mode_last, radix_on, no_hooks, fused]),
        json.dumps(AUX),
    )
    assert problems[0] == [] and problems[1] == []  # eagle3's command, and the mode spelled out
    assert [len(p) for p in problems[2:]] == [1, 1, 1, 1], problems[5]
    assert "fuses the all-reduce into the next layer's norm" in problems[5][0]
    assert "no hidden states for every prompt token" in problems[2][0]
    assert "radix cache is on" in problems[3][0]
    assert "does not run eagle3's capture hooks" in problems[4][0]


def test_the_serving_dtype_is_the_dtype_sglangs_own_resolution_serves_a_checkpoint_in(
    sglang_probe: Probe,
) -> None:
    cases = [
        ["auto", {"torch_dtype": "bfloat16", "model_type": "llama"}],
        ["auto", {"torch_dtype": "float16", "model_type": "llama"}],
        ["auto", {"torch_dtype": "float32", "model_type": "llama"}],
        ["auto", {"model_type": "deepseek_v3"}],
        ["auto", {"torch_dtype": "float32", "model_type": "gemma2"}],
        ["float16", {"torch_dtype": "bfloat16", "model_type": "llama"}],
    ]
    pairs = sglang_probe("probe_dtype.py", json.dumps(cases))
    assert [theirs for theirs, _ in pairs] == [
        "bfloat16",
        "float16",
        "float16",
        "float16",
        "bfloat16",
        "float16",
    ]
    assert all(theirs == ours for theirs, ours in pairs), pairs
