"""The SGLang launch commands (extraction, serving), the printed serve commands for SGLang and vLLM, the GPU
memory probe's parsing of nvidia-smi, and reading /proc: everything about the managed server but its lifecycle
(tests/integration/test_sglang_lifecycle.py)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from eagle3_core.config import Eagle3Config, config_from_dict
from eagle3_core.engines.sglang_capture import hooked_layer_ids
from eagle3_core.engines.sglang_server import launch_command, nvidia_smi_held, proc_stat
from eagle3_core.errors import ConfigError, Eagle3Error
from eagle3_core.steps.serving import serve_commands, serve_markdown
from tests.records import DAMAGED_JSON


def make_config(tmp: Path, **sections: object) -> Eagle3Config:
    return config_from_dict({"store": "store", **sections}, tmp)


def test_the_extraction_command_has_every_flag_extraction_needs(tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path,
        target={"device": "cuda"},
        sglang={"tp_size": 2, "mem_fraction_static": 0.7, "port": 31234},
    )
    assert launch_command(cfg, "/models/llama", "extract") == [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/llama",
        "--tp-size",
        "2",
        "--mem-fraction-static",
        "0.7",
        "--host",
        "127.0.0.1",
        "--port",
        "31234",
        "--disable-radix-cache",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--chunked-prefill-size",
        "-1",
        "--enable-return-hidden-states",
        "--enforce-disable-flashinfer-allreduce-fusion",  # tp 2: the hooks must not read partial sums
    ]
    hooked = launch_command(
        cfg, "/models/llama", "extract", aux_layer_ids=[1, 15, 28], architectures=["LlamaForCausalLM"]
    )
    assert hooked[-2] == "--forward-hooks" and hooked_layer_ids(json.loads(hooked[-1])) == [1, 15, 28]
    # the hooks' module paths follow the architecture, read from the target's config.json when it is here
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"]}))
    specs = json.loads(launch_command(cfg, kimi, "extract", aux_layer_ids=[2, 30, 58])[-1])
    assert [s["target_modules"] for s in specs] == [
        ["language_model.model"],
        ["language_model.logits_processor"],
    ]
    with pytest.raises(ConfigError, match=r"/models/llama: no config\.json here .* pass the architectures"):
        launch_command(cfg, "/models/llama", "extract", aux_layer_ids=[1, 15, 28])
    (kimi / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ConfigError, match=r"\['MistralForCausalLM'\] .* is not one eagle3 knows"):
        launch_command(cfg, kimi, "extract", aux_layer_ids=[2, 30, 58])


def test_on_a_cpu_the_extraction_server_gets_the_device_torch_native_and_a_kv_size(tmp_path: Path) -> None:
    cpu = make_config(tmp_path, target={"device": "cpu"})
    argv = launch_command(cpu, "/models/llama", "extract")
    assert "--device" in argv and argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
    assert argv[argv.index("--max-total-tokens") + 1] == "16384"  # SGLang's own choice came out negative
    sized = make_config(tmp_path, target={"device": "cpu"}, sglang={"max_total_tokens": 2048})
    assert launch_command(sized, "/models/llama", "extract")[argv.index("--max-total-tokens") + 1] == "2048"
    gpu = make_config(tmp_path, target={"device": "cuda"}, sglang={"max_total_tokens": 2048})
    on_gpu = launch_command(gpu, "/models/llama", "extract")
    assert "--device" not in on_gpu and on_gpu[on_gpu.index("--max-total-tokens") + 1] == "2048"
    # SGLang has no CPU draft attention: a CPU serving command is refused, not printed to fail on the host
    with pytest.raises(ConfigError, match=r"target\.device: SGLang serves an EAGLE-3 drafter on a GPU only"):
        launch_command(cpu, "/models/llama", "serve", drafter_dir="/exports/sglang")
    auto = make_config(tmp_path)  # auto: the serving host decides, so no device flags are printed for it
    assert "--device" not in launch_command(auto, "/models/llama", "serve", drafter_dir="/exports/sglang")


def test_the_serving_command_runs_eagle3_with_k_steps_and_k_plus_one_draft_tokens(tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path,
        evaluate={"ks": [3, 5], "gate_k": 5},
        target={"dtype": "bfloat16"},
        sglang={
            "launcher": ["/opt/sglang/bin/python", "-m", "sglang.launch_server"],
            "extra_args": ["--x", "1"],
        },
    )
    argv = launch_command(cfg, "/models/llama", "serve", drafter_dir="/store/drafter/current/sglang")
    assert argv[:5] == [
        "/opt/sglang/bin/python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/llama",
    ]
    assert argv[5:] == [
        *("--tp-size", "1", "--mem-fraction-static", "0.85", "--host", "127.0.0.1", "--port", "30000"),
        *("--dtype", "bfloat16"),
        *("--speculative-algorithm", "EAGLE3"),
        *("--speculative-draft-model-path", "/store/drafter/current/sglang"),
        *(
            "--speculative-num-steps",
            "5",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "6",
        ),
        *("--x", "1"),  # extra_args last, for every purpose
    ]
    assert "--disable-radix-cache" not in argv and "--enable-return-hidden-states" not in argv
    k2 = launch_command(cfg, "/m", "serve", drafter_dir="/d", k=2)
    assert k2[k2.index("--speculative-num-steps") + 1] == "2"
    assert k2[k2.index("--speculative-num-draft-tokens") + 1] == "3"


def test_launch_command_refuses_what_does_not_fit_its_purpose(tmp_path: Path) -> None:
    cfg = make_config(tmp_path)
    with pytest.raises(ValueError, match="drafter_dir"):
        launch_command(cfg, "/m", "serve")
    with pytest.raises(ValueError, match="no drafter_dir"):
        launch_command(cfg, "/m", "extract", drafter_dir="/d")
    with pytest.raises(ValueError, match="purpose"):
        launch_command(cfg, "/m", "train")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("section", "field"),
    [
        ({"mem_fraction_static": 1.0}, "sglang.mem_fraction_static"),
        ({"tp_size": 0}, "sglang.tp_size"),
        ({"port": 70000}, "sglang.port"),
        ({"launcher": []}, "sglang.launcher"),
        ({"shutdown_grace": 3}, "sglang.shutdown_grace"),  # a typo is an error, never ignored
    ],
)
def test_invalid_sglang_settings_name_the_field(
    tmp_path: Path, section: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        make_config(tmp_path, sglang=section)


# ---- serve commands -------------------------------------------------------------------------------------------
def fake_export(
    store: Path, run: str, target: str | None = "/models/llama", verifier: str | None = None
) -> Path:
    """An export as far as the serve commands read it: the two config.json files."""
    out = store / "drafter" / "export" / run
    (out / "sglang").mkdir(parents=True)
    (out / "speculators").mkdir(parents=True)
    sglang: dict[str, Any] = {"architectures": ["LlamaForCausalLMEagle3"]}
    if target is not None:
        sglang["eagle3_export"] = provenance(target)
    (out / "sglang" / "config.json").write_text(json.dumps(sglang))
    block = {
        "algorithm": "eagle3",
        "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
        "verifier": {"name_or_path": verifier or target},
    }
    (out / "speculators" / "config.json").write_text(json.dumps({"speculators_config": block}))
    return out


def provenance(target: str | None, **change: Any) -> dict[str, Any]:
    """Our provenance block as an export of ours writes it, as far as it is required."""
    return {
        "schema": "eagle3.export/2",
        "format": "sglang",
        "aux_layer_ids": [1, 3, 5],
        "final_state_convention": "post_norm",
        "target": {"name_or_path": target},
        **change,
    }


def test_serve_commands_for_the_newest_export_then_for_the_promoted_one(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, sglang={"tp_size": 2})
    store = cfg.store_root
    with pytest.raises(Eagle3Error, match="no exported drafter yet"):
        serve_commands(cfg)
    old = fake_export(store, "run-old")
    newest = fake_export(store, "run-new", target="/models/llama with space")
    os.utime(old / "sglang" / "config.json", (1, 1))  # the older one

    commands = serve_commands(cfg)
    assert commands["drafter"] == str(newest) and "not promoted" in commands["which"]
    sglang = shlex.split(commands["sglang"])  # one shell line: quoting round-trips
    assert sglang[:5] == ["python3", "-m", "sglang.launch_server", "--model-path", "/models/llama with space"]
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == str(newest / "sglang")
    assert sglang[sglang.index("--speculative-num-steps") + 1] == "3"  # evaluate.gate_k
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "4"
    assert sglang[sglang.index("--tp-size") + 1] == "2"
    vllm = shlex.split(commands["vllm"])
    assert vllm[:3] == ["vllm", "serve", "/models/llama with space"]
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "2"
    spec = json.loads(vllm[vllm.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": str(newest / "speculators"), "num_speculative_tokens": 3}
    assert '--speculative-config \'{"method": "eagle3"' in commands["vllm"]  # single-quoted JSON

    current = store / "drafter" / "current"
    current.symlink_to(os.path.relpath(old, current.parent))
    promoted = serve_commands(cfg)
    assert promoted["drafter"] == str(current) and promoted["which"].startswith("promoted")
    assert f"--speculative-draft-model-path {current}/sglang" in promoted["sglang"]
    assert f'"model": "{current}/speculators"' in promoted["vllm"]
    md = serve_markdown(promoted)
    assert f"```bash\n{promoted['sglang']}\n```" in md and f"```bash\n{promoted['vllm']}\n```" in md


def test_the_target_comes_from_the_export_else_the_verifier_else_the_config(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, target={"path": "models/t"})
    a = fake_export(cfg.store_root, "a", target=None, verifier="org/verifier")
    assert serve_commands(cfg, a)["target"] == "org/verifier"
    (a / "speculators" / "config.json").write_text("{}")
    assert serve_commands(cfg, a)["target"] == str(tmp_path / "models" / "t")
    # the targets eagle3 builds into its cache (the toy, smollm2, a *.gguf file's) have no path to print
    for built in ({}, {"target": {"path": "smollm2"}}, {"target": {"path": "models/m.gguf"}}):
        with pytest.raises(Eagle3Error, match="does not say which target"):
            serve_commands(make_config(tmp_path, **built), a)


@pytest.mark.parametrize(
    ("sglang", "speculators", "message"),
    [
        (
            {"eagle3_export": provenance("/m", aux_layer_ids=[1, 1, 5])},
            None,
            "sglang: config.json: eagle3_export.aux_layer_ids: must be three distinct integers",
        ),
        (
            {"eagle3_export": {**provenance("/m"), "target": {"name_or_path": 7}}},
            None,
            "sglang: config.json: eagle3_export.target.name_or_path: input should be a valid string, got 7",
        ),
        (
            {"eagle3_export": provenance(None)},
            {"speculators_config": {"verifier": {"name_or_path": "/v"}}},
            "speculators: config.json: speculators_config.algorithm: missing",
        ),
    ],
)
def test_a_wrong_export_config_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, sglang: dict[str, Any], speculators: dict[str, Any] | None, message: str
) -> None:
    export = fake_export(tmp_path, "run")
    (export / "sglang" / "config.json").write_text(json.dumps(sglang))
    if speculators is not None:
        (export / "speculators" / "config.json").write_text(json.dumps(speculators))
    with pytest.raises(Eagle3Error) as err:
        serve_commands(make_config(tmp_path), export)
    assert str(err.value).startswith(str(export / message)) and "\n" not in str(err.value)


def test_the_sglang_window_is_read_through_the_provenance(tmp_path: Path) -> None:
    export = fake_export(tmp_path, "run")
    variant = {
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "norm_before_residual": False,
        "sliding_window": 8,
    }
    sglang = {"eagle3_export": provenance("/m", drafter_variant=variant)}
    (export / "sglang" / "config.json").write_text(json.dumps(sglang))
    argv = shlex.split(serve_commands(make_config(tmp_path), export)["sglang"])
    assert argv[argv.index("--speculative-draft-window-size") + 1] == "7"
    for window, error in (
        ("8", "sliding_window: input should be a valid integer"),
        (1, "is 1, not a window"),
    ):
        sglang["eagle3_export"]["drafter_variant"] = {**variant, "sliding_window": window}
        (export / "sglang" / "config.json").write_text(json.dumps(sglang))
        with pytest.raises(Eagle3Error, match=error):
            serve_commands(make_config(tmp_path), export)


def test_eagle3_serve_command_prints_both_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from eagle3_cli.steps import main

    config = tmp_path / "eagle3.yaml"
    config.write_text("store: store\nevaluate: {ks: [3, 7], gate_k: 7}\n")
    run = fake_export(tmp_path / "store", "r1")
    assert main(["--config", str(config), "serve-command"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"drafter: {run} (newest export, not promoted); K=7 (evaluate.gate_k)"
    sglang, vllm = lines[lines.index("SGLang:") + 1], lines[lines.index("vLLM:") + 1]
    assert "--speculative-num-steps 7 --speculative-eagle-topk 1 --speculative-num-draft-tokens 8" in sglang
    assert json.loads(shlex.split(vllm)[-1])["num_speculative_tokens"] == 7
    assert main(["--config", str(config), "serve-command", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vllm"] == vllm
    assert main(["--config", str(config), "serve-command", "--export", str(tmp_path / "nope")]) == 2


def test_drafter_export_shows_the_serve_commands_on_its_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dagster as dg

    from eagle3_core.steps import drafter
    from eagle3_core.steps.common import StepResult
    from eagle3_dagster.defs.drafter.assets import drafter_export
    from eagle3_dagster.defs.resources import Eagle3Resource

    config = tmp_path / "eagle3.yaml"
    config.write_text("store: store\n")
    run = fake_export(tmp_path / "store", "r1")
    # the export itself is tested elsewhere (tests/integration/test_train.py); here only its page
    monkeypatch.setattr(
        drafter,
        "export_step",
        lambda cfg, log: StepResult(
            "drafter_export",
            run,
            {"sglang_dir": str(run / "sglang"), "speculators_dir": str(run / "speculators")},
        ),
    )
    result = dg.materialize([drafter_export], resources={"eagle3": Eagle3Resource(config_path=str(config))})
    meta = result.asset_materializations_for_node("drafter_export")[0].metadata
    text = meta["serve"].value
    assert isinstance(text, str)
    cfg = make_config(tmp_path)
    commands = serve_commands(cfg, run)
    assert f"```bash\n{commands['sglang']}\n```" in text and f"```bash\n{commands['vllm']}\n```" in text


# ---- the GPU memory probe and /proc ---------------------------------------------------------------------------
def fake_nvidia_smi(tmp: Path, output: str, status: int = 0) -> str:
    exe = tmp / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '%s' '{output}'\nexit {status}\n")
    exe.chmod(0o755)
    return str(exe)


def test_nvidia_smi_memory_is_summed_over_the_servers_pids_only(tmp_path: Path) -> None:
    exe = fake_nvidia_smi(tmp_path, "123, 2048\n456, [N/A]\n789, 100\n")
    assert nvidia_smi_held({123, 456}, exe) == (2048 + 1) * 2**20  # N/A: held, amount unknown
    assert nvidia_smi_held({1}, exe) == 0
    assert nvidia_smi_held({123}, fake_nvidia_smi(tmp_path, "No devices were found", status=6)) == 0
    assert nvidia_smi_held({123}, str(tmp_path / "missing")) == 0


def test_proc_stat_reads_group_and_start_time_past_an_odd_command_name(tmp_path: Path) -> None:
    odd = tmp_path / "a) (b c"  # the name in /proc/<pid>/stat is parenthesised and may hold both
    odd.symlink_to(sys.executable)
    proc = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        st = proc_stat(proc.pid)
        # a live state: running, sleeping, or (a child still loading, on a busy disk) in uninterruptible sleep
        assert st is not None and st.pgrp == proc.pid and st.state in "RSD"
        assert st.start_ticks >= proc_stat(os.getpid()).start_ticks  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait()
    assert proc_stat(proc.pid) is None


def test_a_started_process_is_known_by_start_time_group_command_and_marker(tmp_path: Path) -> None:
    from eagle3_core.procs import (
        StartedProcess,
        command_matches,
        marked_environment,
        new_marker,
        proc_cmdline,
    )

    script = tmp_path / "launch"  # run through its #! line: /proc shows the interpreter, then the script
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    script.chmod(0o755)
    marker = new_marker()
    command = [str(script), "--port", "1"]
    proc = subprocess.Popen(command, start_new_session=True, env=marked_environment(marker))
    try:
        # Popen returns once the exec began; the kernel fills in argv and the environment a moment later
        deadline = time.monotonic() + 10
        while not proc_cmdline(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        st = proc_stat(proc.pid)
        assert st is not None
        started = StartedProcess(proc.pid, st.start_ticks, command, marker)
        assert started.mismatch() is None
        for other, why in [
            (StartedProcess(proc.pid, st.start_ticks - 1, command, marker), "started at another time"),
            (
                StartedProcess(proc.pid, st.start_ticks, [str(script), "--port", "2"], marker),
                "another command",
            ),
            (StartedProcess(proc.pid, st.start_ticks, command, new_marker()), "does not carry the marker"),
            (StartedProcess(proc.pid, st.start_ticks, command, None), "no process marker"),
        ]:
            assert why in (other.mismatch() or ""), why
    finally:
        proc.kill()
        proc.wait()
    assert "no process" in (started.mismatch() or "")
    assert command_matches(
        ["python3", "-m", "sglang.launch_server"], ["python3", "-m", "sglang.launch_server"]
    )
    assert command_matches(["/usr/bin/python3", "/opt/bin/sgl", "-x"], ["sgl", "-x"])  # a #! script by name
    assert not command_matches(["python3", "-m", "other"], ["python3", "-m", "sglang.launch_server"])
    assert not command_matches(["sleep", "60"], [])


def test_the_serve_commands_import_no_torch() -> None:
    """serving reads the exports through engines/engine_config.py: printing a command loads no torch."""
    code = "import sys, eagle3_core.steps.serving; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_serving_reads_the_block_the_exporter_writes() -> None:
    from eagle3_core.engines.engine_config import PROVENANCE_KEY
    from eagle3_core.steps.serving import ServedSGLangConfig

    assert ServedSGLangConfig.model_fields["provenance"].alias == PROVENANCE_KEY


@pytest.mark.parametrize("damage", sorted(DAMAGED_JSON))
def test_the_architectures_of_a_damaged_config_json_are_one_line(damage: str, tmp_path: Path) -> None:
    data, said = DAMAGED_JSON[damage]
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_bytes(data)
    with pytest.raises(ConfigError) as caught:
        launch_command(make_config(tmp_path), target, "extract", aux_layer_ids=[2, 30, 58])
    assert str(caught.value).startswith(f"{target / 'config.json'}: ") and said in str(caught.value)


def test_at_tp_2_extraction_turns_all_reduce_fusion_off_and_refuses_a_flag_that_turns_it_on(
    tmp_path: Path,
) -> None:
    tp2 = make_config(tmp_path, target={"device": "cuda"}, sglang={"tp_size": 2})
    assert "--enforce-disable-flashinfer-allreduce-fusion" in launch_command(tp2, "/models/llama", "extract")
    tp1 = make_config(tmp_path, target={"device": "cuda"})
    assert "--enforce-disable-flashinfer-allreduce-fusion" not in launch_command(
        tp1, "/models/llama", "extract"
    )
    fusing = make_config(
        tmp_path,
        target={"device": "cuda"},
        sglang={"tp_size": 2, "extra_args": ["--enable-flashinfer-allreduce-fusion"]},
    )
    with pytest.raises(
        ConfigError, match=r"sglang\.extra_args: --enable-flashinfer-allreduce-fusion at tp_size 2"
    ):
        launch_command(fusing, "/models/llama", "extract")
