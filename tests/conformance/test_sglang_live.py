"""SGLang 0.5.23 itself, live on a CPU: eagle3's engine backend extracts hidden states through the real
`sglang.Engine` (torch_native attention, float32) from a tiny random target of each family eagle3 supports
there (families.py: Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3 with MoE layers, Kimi-K2.5's wrapper,
GLM-4-MoE, GLM-4-MoE-Lite), and every row equals what transformers computes on the same ids: each aux block
the input of its own layer k, not of its neighbours (docs/design.md, section 2), and the final state the
post-norm one.

Each engine also extracts, after its batch has completed, a prompt that extends one of the batch: with SGLang's
radix cache on, its prefix would be served from the cache and its rows would go missing (a shared prefix within
one batch is not: nothing is cached before the batch runs). And the arguments each engine resolved from eagle3's
(`Engine.get_server_info`, what a server's `/server_info` serves) are read back: radix cache off, no chunked
prefill, and at tp 2 FlashInfer's all-reduce fusion forced off.

The engines run in one child process beside SGLang's code (conftest.py's sglang_env, live_extract.py), one
after another, so this process never imports SGLang and SGLang is imported once; each engine has its own time
budget, and one that overruns it fails its own family's tests (with the engines' log), not the others'.

EAGLE3_LIVE_ENGINES=llama,deepseek_v3-tp2 (engine names: a family, or `<family>-tp2`) starts only those engines,
for a quicker look at a few families: the tests of every other engine skip, saying so. Under CI=true it is
refused."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.config import TargetConfig
from eagle3_core.targets.base import HiddenStates
from eagle3_core.targets.hf import TransformersTarget
from tests.conformance.conftest import HERE, run_engines, sglang_env
from tests.conformance.families import FAMILIES, FP32_REL, H, reference_dir, rel_diff, save_family_target

AUX = (1, 4, 6)

# extracted again at tensor-parallel size 2: MLA heads and MoE experts split over two ranks, all-reduced
TP2_FAMILIES = ("deepseek_v3",)
ENGINES = (*FAMILIES, *(f"{family}-tp2" for family in TP2_FAMILIES))
ONLY = "EAGLE3_LIVE_ENGINES"


@dataclass
class Live:
    """The directory of the families' targets, each engine's states of _prompts() and _after() by name (a family,
    or `<family>-tp2`), the arguments it resolved (live_extract.py's RESOLVED), why an engine gave none (its budget
    ran out, or it failed: the log's last lines), and the engines EAGLE3_LIVE_ENGINES left out."""

    work: Path
    states: dict[str, dict[str, torch.Tensor]]
    resolved: dict[str, dict[str, Any]]
    failures: dict[str, str]
    left_out: tuple[str, ...] = ()

    def of(self, name: str) -> dict[str, torch.Tensor]:
        self._ran(name)
        return self.states[name]

    def resolved_by(self, name: str) -> dict[str, Any]:
        self._ran(name)
        return self.resolved[name]

    def _ran(self, name: str) -> None:
        if name in self.left_out:
            pytest.skip(f"engine {name} not started: {ONLY}={os.environ.get(ONLY)}")
        if name in self.failures:
            pytest.fail(self.failures[name])


def _prompts() -> list[list[int]]:
    base = [(7 * i) % 300 + 10 for i in range(40)]
    # a shared prefix in one batch: with SGLang's radix cache on, the second would lose its prefix's rows
    return [base, [*base, 11, 12, 13], [(5 * i) % 290 + 20 for i in range(63)], [42, 43]]


def _after() -> list[list[int]]:
    """Sent once _prompts() has completed: prompt 2 and 9 more tokens, whose first 63 the radix cache would hold."""
    return [[*_prompts()[2], *range(100, 109)]]


def _chosen() -> tuple[str, ...]:
    """The engines to start: all, or those EAGLE3_LIVE_ENGINES names."""
    asked = os.environ.get(ONLY)
    if not asked:
        return ENGINES
    if os.environ.get("CI") == "true":
        pytest.fail(f"{ONLY} leaves engines out: a CI run starts them all")
    chosen = tuple(name.strip() for name in asked.split(",") if name.strip())
    unknown = [name for name in chosen if name not in ENGINES]
    if unknown:
        pytest.fail(f"{ONLY}: no engine {unknown}; the engines are {', '.join(ENGINES)}")
    return chosen


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Live:
    work = tmp_path_factory.mktemp("sglang-live")
    # torch keys its compiled-kernel cache without the CPU capability: a kernel another run built for this CPU's
    # vector instructions fails to build under ATEN_CPU_CAPABILITY=default (`at::vec` undeclared)
    env = {**sglang_env(), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    chosen = _chosen()
    for family in FAMILIES:
        save_family_target(work / family, family)
    prompts, out = work / "prompts.json", work / "states"
    prompts.write_text(json.dumps({"batch": _prompts(), "after": _after()}))
    out.mkdir()
    jobs = {family: str(work / family) for family in FAMILIES} | {
        f"{family}-tp2": f"{work / family}@tp2" for family in TP2_FAMILIES
    }
    jobs = {name: job for name, job in jobs.items() if name in chosen}
    head = [str(prompts), ",".join(map(str, AUX)), str(out)]
    failures = run_engines(HERE / "live_extract.py", jobs, head, env, work / "engines.log")
    ran = [name for name in jobs if name not in failures]
    states = {name: load_file(str(out / f"{name}.safetensors")) for name in ran}
    resolved = {name: json.loads((out / f"{name}.json").read_text()) for name in ran}
    left_out = tuple(name for name in ENGINES if name not in chosen)
    return Live(work, states, resolved, failures, left_out)


def _reference(work: Path, family: str) -> TransformersTarget:
    cfg = TargetConfig(device="cpu", dtype="float32", aux_layer_ids=AUX)
    return TransformersTarget(reference_dir(work / family, family), cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_s_rows_equal_transformers(live: Live, family: str) -> None:
    want = _reference(live.work, family).hidden_states(_prompts(), torch.float32)
    for i, (seq, w) in enumerate(zip(_prompts(), want, strict=True)):
        assert isinstance(w, HiddenStates)
        aux, last = live.of(family)[f"aux.{i}"], live.of(family)[f"last.{i}"]
        assert aux.shape == (len(seq), 3 * H) and last.shape == (
            len(seq),
            H,
        )  # every row, prefix shared or not
        assert rel_diff(last, w.last) < FP32_REL, i
        assert rel_diff(aux, w.aux) < FP32_REL, i


@pytest.mark.parametrize("family", FAMILIES)
def test_each_aux_block_is_the_input_of_its_layer_and_the_final_state_is_post_norm(
    live: Live, family: str
) -> None:
    model = _reference(live.work, family).model
    seq = _prompts()[2]
    pre_norm: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, args, _out: pre_norm.append(args[0][0]))
    with torch.inference_mode():
        layers = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    hook.remove()
    for j, k in enumerate(AUX):
        mine = live.of(family)["aux.2"][:, j * H : (j + 1) * H]
        assert rel_diff(mine, layers[k][0]) < FP32_REL, k
        assert min(rel_diff(mine, layers[k - 1][0]), rel_diff(mine, layers[k + 1][0])) > 1000 * FP32_REL, k
    last = live.of(family)["last.2"]
    assert rel_diff(last, layers[-1][0]) < FP32_REL and rel_diff(last, pre_norm[0]) > 1000 * FP32_REL


@pytest.mark.parametrize("family", TP2_FAMILIES)
def test_tensor_parallel_2_captures_what_tp_1_captures(live: Live, family: str) -> None:
    for name, tp1 in live.of(family).items():
        assert rel_diff(live.of(f"{family}-tp2")[name], tp1) < FP32_REL, name  # sums added in another order


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_extending_one_of_an_earlier_call_gets_every_row(live: Live, family: str) -> None:
    """The second call, after the batch completed: with the radix cache on, the first 63 tokens would come from the
    cache and only the last 9 be run (live_extract.py would stop at that sample's row-count failure)."""
    want = _reference(live.work, family).hidden_states(_after(), torch.float32)
    for j, (seq, w) in enumerate(zip(_after(), want, strict=True)):
        assert isinstance(w, HiddenStates)
        aux, last = live.of(family)[f"aux.after.{j}"], live.of(family)[f"last.after.{j}"]
        assert aux.shape == (len(seq), 3 * H) and last.shape == (len(seq), H)
        assert rel_diff(last, w.last) < FP32_REL and rel_diff(aux, w.aux) < FP32_REL, j


@pytest.mark.parametrize("name", ENGINES)
def test_the_engine_resolved_what_extraction_needs(live: Live, name: str) -> None:
    """As SGLang resolved eagle3's engine arguments: the radix cache off; chunked prefill off (-1), where SGLang's
    own default on a CPU is a chunk sized from the host's memory (2048 to 16384 tokens: 4096 at 24 GiB), longer
    than every prompt here, so its rows alone would not show it; and at tp 2 FlashInfer's all-reduce fusion
    forced off, which no row shows on a CPU (SGLang fuses nothing there)."""
    tp = 2 if name.endswith("-tp2") else 1
    resolved = live.resolved_by(name)
    assert resolved["tp_size"] == tp
    assert resolved["disable_radix_cache"] is True
    assert resolved["chunked_prefill_size"] == -1
    if tp > 1:
        assert resolved["enforce_disable_flashinfer_allreduce_fusion"] is True
