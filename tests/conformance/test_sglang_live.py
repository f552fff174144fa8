"""SGLang 0.5.23 itself, live on a CPU: eagle3's engine backend extracts hidden states through the real
`sglang.Engine` (torch_native attention, float32) from a tiny random target of each family eagle3 supports
there (families.py: Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3 with MoE layers, Kimi-K2.5's wrapper,
GLM-4-MoE, GLM-4-MoE-Lite), and every row equals what transformers computes on the same ids: each aux block
the input of its own layer k, not of its neighbours (docs/design.md, section 2), and the final state the
post-norm one.

The engines run in one child process beside SGLang's code (conftest.py's sglang_env, live_extract.py), one
after another, so this process never imports SGLang and SGLang is imported once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.config import TargetConfig
from eagle3_core.targets.base import HiddenStates
from eagle3_core.targets.hf import TransformersTarget
from tests.conformance.conftest import HERE, sglang_env
from tests.conformance.families import FAMILIES, FP32_REL, H, reference_dir, rel_diff, save_family_target
from tests.conftest import REPO

AUX = (1, 4, 6)
ENGINE_TIMEOUT_S = 600

# extracted again at tensor-parallel size 2: MLA heads and MoE experts split over two ranks, all-reduced
TP2_FAMILIES = ("deepseek_v3",)

Live = tuple[Path, dict[str, dict[str, torch.Tensor]]]


def _prompts() -> list[list[int]]:
    base = [(7 * i) % 300 + 10 for i in range(40)]
    # a shared prefix in one batch: with SGLang's radix cache on, the second would lose its prefix's rows
    return [base, [*base, 11, 12, 13], [(5 * i) % 290 + 20 for i in range(63)], [42, 43]]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Live:
    """(the directory of the families' targets, each family's engine states of _prompts())."""
    work = tmp_path_factory.mktemp("sglang-live")
    # torch keys its compiled-kernel cache without the CPU capability: a kernel another run built for this CPU's
    # vector instructions fails to build under ATEN_CPU_CAPABILITY=default (`at::vec` undeclared)
    env = {**sglang_env(), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")}
    for family in FAMILIES:
        save_family_target(work / family, family)
    prompts, out = work / "prompts.json", work / "states"
    prompts.write_text(json.dumps(_prompts()))
    out.mkdir()
    done = subprocess.run(
        [sys.executable, str(HERE / "live_extract.py"), str(prompts), ",".join(map(str, AUX)), str(out),
         *(str(work / f) for f in FAMILIES), *(f"{work / f}@tp2" for f in TP2_FAMILIES)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    names = [*FAMILIES, *(f"{f}-tp2" for f in TP2_FAMILIES)]
    return work, {name: load_file(str(out / f"{name}.safetensors")) for name in names}


def _reference(work: Path, family: str) -> TransformersTarget:
    cfg = TargetConfig(device="cpu", dtype="float32", aux_layer_ids=AUX)
    return TransformersTarget(reference_dir(work / family, family), cfg)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_s_rows_equal_transformers(live: Live, family: str) -> None:
    work, states = live
    want = _reference(work, family).hidden_states(_prompts(), torch.float32)
    for i, (seq, w) in enumerate(zip(_prompts(), want, strict=True)):
        assert isinstance(w, HiddenStates)
        aux, last = states[family][f"aux.{i}"], states[family][f"last.{i}"]
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
    work, states = live
    model = _reference(work, family).model
    seq = _prompts()[2]
    pre_norm: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_hook(lambda _m, args, _out: pre_norm.append(args[0][0]))
    with torch.inference_mode():
        layers = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    hook.remove()
    for j, k in enumerate(AUX):
        mine = states[family]["aux.2"][:, j * H : (j + 1) * H]
        assert rel_diff(mine, layers[k][0]) < FP32_REL, k
        assert min(rel_diff(mine, layers[k - 1][0]), rel_diff(mine, layers[k + 1][0])) > 1000 * FP32_REL, k
    last = states[family]["last.2"]
    assert rel_diff(last, layers[-1][0]) < FP32_REL and rel_diff(last, pre_norm[0]) > 1000 * FP32_REL


@pytest.mark.parametrize("family", TP2_FAMILIES)
def test_tensor_parallel_2_captures_what_tp_1_captures(live: Live, family: str) -> None:
    _, states = live
    for name, tp1 in states[family].items():
        assert rel_diff(states[f"{family}-tp2"][name], tp1) < FP32_REL, (
            name
        )  # the same sums, added in another order
