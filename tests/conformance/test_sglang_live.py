"""SGLang 0.5.23 itself, live on a CPU: eagle3's engine backend extracts hidden states through the real
`sglang.Engine` (torch_native attention, float32) from a tiny random target of each family eagle3 supports
there (families.py: Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3 with MoE layers, Kimi-K2.5's wrapper,
GLM-4-MoE, GLM-4-MoE-Lite), and every row equals what transformers computes on the same ids: each aux block
the input of its own layer k, not of its neighbours (docs/design.md, section 2), and the final state the
post-norm one.

The engines run in one child process beside SGLang's code (conftest.py's sglang_env, live_extract.py), one
after another, so this process never imports SGLang and SGLang is imported once; each engine has its own time
budget, and one that overruns it fails its own family's tests (with the engines' log), not the others'."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


@dataclass
class Live:
    """The directory of the families' targets, each engine's states of _prompts() by name (a family, or
    `<family>-tp2`), and why an engine gave none (its budget ran out, or it failed: the log's last lines)."""

    work: Path
    states: dict[str, dict[str, torch.Tensor]]
    failures: dict[str, str]

    def of(self, name: str) -> dict[str, torch.Tensor]:
        if name in self.failures:
            pytest.fail(self.failures[name])
        return self.states[name]


def _prompts() -> list[list[int]]:
    base = [(7 * i) % 300 + 10 for i in range(40)]
    # a shared prefix in one batch: with SGLang's radix cache on, the second would lose its prefix's rows
    return [base, [*base, 11, 12, 13], [(5 * i) % 290 + 20 for i in range(63)], [42, 43]]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Live:
    work = tmp_path_factory.mktemp("sglang-live")
    # torch keys its compiled-kernel cache without the CPU capability: a kernel another run built for this CPU's
    # vector instructions fails to build under ATEN_CPU_CAPABILITY=default (`at::vec` undeclared)
    env = {**sglang_env(), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    for family in FAMILIES:
        save_family_target(work / family, family)
    prompts, out = work / "prompts.json", work / "states"
    prompts.write_text(json.dumps(_prompts()))
    out.mkdir()
    jobs = {family: str(work / family) for family in FAMILIES} | {
        f"{family}-tp2": f"{work / family}@tp2" for family in TP2_FAMILIES
    }
    head = [str(prompts), ",".join(map(str, AUX)), str(out)]
    failures = run_engines(HERE / "live_extract.py", jobs, head, env, work / "engines.log")
    states = {name: load_file(str(out / f"{name}.safetensors")) for name in jobs if name not in failures}
    return Live(work, states, failures)


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
