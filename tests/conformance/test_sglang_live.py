"""SGLang 0.5.23 itself, live on a CPU: eagle3's engine backend extracts hidden states through the real
`sglang.Engine` (torch_native attention, float32) and every row equals what transformers computes on the same
ids, with each aux layer the input of layer k, not of its neighbours (docs/design.md, section 2).

The engine runs in a child process beside SGLang's code (conftest.py's sglang_env), so this process never
imports SGLang."""

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
from tests.conftest import REPO
from tests.helpers import save_tiny_chat_target

AUX = (1, 4, 6)
H = 256  # 4 heads of 64
FP32_REL = 1e-5  # relative L2 difference between two float32 computations of the same 8-layer model
ENGINE_TIMEOUT_S = 600


def _prompts() -> list[list[int]]:
    base = [(7 * i) % 300 + 10 for i in range(40)]
    # a shared prefix in one batch: with SGLang's radix cache on, the second would lose its prefix's rows
    return [base, [*base, 11, 12, 13], [(5 * i) % 290 + 20 for i in range(63)], [42, 43]]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(the target's directory, the engine's states of _prompts())."""
    env = sglang_env()
    work = tmp_path_factory.mktemp("sglang-live")
    model_dir = save_tiny_chat_target(work / "target", hidden=H)
    prompts, out = work / "prompts.json", work / "states.safetensors"
    prompts.write_text(json.dumps(_prompts()))
    done = subprocess.run(
        [sys.executable, str(HERE / "live_extract.py"), str(model_dir), str(prompts), str(out),
         ",".join(map(str, AUX))],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=ENGINE_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
    return model_dir, load_file(str(out))


def test_the_engine_s_rows_equal_transformers(live: tuple[Path, dict[str, torch.Tensor]]) -> None:
    model_dir, states = live
    reference = TransformersTarget(model_dir, TargetConfig(device="cpu", dtype="float32", aux_layer_ids=AUX))
    want = reference.hidden_states(_prompts(), torch.float32)
    for i, (seq, w) in enumerate(zip(_prompts(), want, strict=True)):
        assert isinstance(w, HiddenStates)
        aux, last = states[f"aux.{i}"], states[f"last.{i}"]
        assert aux.shape == (len(seq), 3 * H) and last.shape == (
            len(seq),
            H,
        )  # every row, prefix shared or not
        assert _rel(last, w.last) < FP32_REL, i
        assert _rel(aux, w.aux) < FP32_REL, i


def test_each_aux_layer_is_the_input_of_layer_k_not_its_neighbours(
    live: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    model_dir, states = live
    model = TransformersTarget(
        model_dir, TargetConfig(device="cpu", dtype="float32", aux_layer_ids=AUX)
    ).model
    seq = _prompts()[2]
    with torch.inference_mode():
        layers = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    for j, k in enumerate(AUX):
        mine = states["aux.2"][:, j * H : (j + 1) * H]
        assert _rel(mine, layers[k][0]) < FP32_REL, k
        assert min(_rel(mine, layers[k - 1][0]), _rel(mine, layers[k + 1][0])) > 1000 * FP32_REL, k
