"""SGLang itself, on a GPU host: `pytest -m sglang tests/sglang` after `pip install 'eagle3[sglang]'` there.

Deselected by default (the `sglang` marker, pyproject.toml): it needs SGLang with its CUDA kernels, which the GPU
host this project uses does not have, so it has not run. The same checks run live on the CPU, in float32 with
SGLang's torch_native attention, in every `make test` (tests/conformance/test_sglang_live*.py); here they run in
bfloat16 on SGLang's GPU kernels. What it checks, against TransformersTarget on the same GPU:

- the engine backend's aux and final states match transformers' within bf16 error, and each aux layer is
  nearest to `output_hidden_states[k]`, not k-1 or k+1 (docs/design.md, section 2: a drafter trained
  on off-by-one layers loses most of its acceptance);
- every sample gets all its rows, with a shared prefix and in any batch (radix cache off; sglang #4997);
- an HTTP server launched with the extraction flags and eagle3's capture hooks passes the backend's
  preflight (its real `/server_info`) and returns the same states.

The rules these rely on (the architecture table, layer ids, hook formats, server-info fields, load_weights)
are checked against SGLang 0.5.23 itself on CPU in tests/conformance, in every `make test`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagle3_core.config import TargetConfig
from eagle3_core.engines.sglang_capture import capture_launch_args
from eagle3_core.engines.sglang_models import MODELS
from eagle3_core.targets.base import HiddenStates
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.targets.sglang import SGLangEngineBackend, SGLangHttpBackend
from tests.conftest import REPO
from tests.fakes import free_port
from tests.helpers import save_tiny_chat_target

pytestmark = pytest.mark.sglang

AUX = (1, 4, 6)
H = 256  # 4 heads of 64: a head size every SGLang attention kernel has
BF16_REL = 0.02  # relative L2 error between two bf16 runs of the same 8-layer model (kernels differ)


@pytest.fixture(scope="module", autouse=True)
def _needs_sglang_on_a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.fail(
            "the sglang tests need a CUDA device (they are deselected by default; run them on a GPU host)"
        )
    try:
        import sglang  # noqa: F401
    except ImportError:
        pytest.fail("the sglang tests need SGLang: pip install 'eagle3[sglang]' on this GPU host")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_target(tmp_path_factory.mktemp("sglang") / "target", hidden=H)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> TransformersTarget:
    return TransformersTarget(model_dir, TargetConfig(device="cuda", dtype="bfloat16", aux_layer_ids=AUX))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[SGLangEngineBackend]:
    backend = SGLangEngineBackend(
        model_dir, TargetConfig(dtype="bfloat16", aux_layer_ids=AUX), mem_fraction_static=0.3
    )
    yield backend
    backend.close()


def prompts() -> list[list[int]]:
    base = [(7 * i) % 300 + 10 for i in range(40)]
    return [base, [*base, 11, 12, 13, 14, 15], base[:17], [(5 * i) % 290 + 20 for i in range(63)], [42, 43]]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _compare(got: list[object], want: list[object], batch: list[list[int]]) -> None:
    for g, w, seq in zip(got, want, batch, strict=True):
        assert isinstance(g, HiddenStates) and isinstance(w, HiddenStates)
        assert g.aux.shape == (len(seq), 3 * H) and g.last.shape == (len(seq), H)
        assert rel(g.last, w.last) < BF16_REL
        for j in range(3):
            assert rel(g.aux[:, j * H : (j + 1) * H], w.aux[:, j * H : (j + 1) * H]) < BF16_REL


def test_engine_states_match_transformers(engine: SGLangEngineBackend, reference: TransformersTarget) -> None:
    batch = prompts()
    _compare(engine.hidden_states(batch, torch.float32), reference.hidden_states(batch, torch.float32), batch)


def test_each_aux_layer_is_the_input_of_layer_k_not_its_neighbours(
    engine: SGLangEngineBackend, reference: TransformersTarget
) -> None:
    seq = prompts()[3]
    [got] = engine.hidden_states([seq], torch.float32)
    assert isinstance(got, HiddenStates)
    with torch.inference_mode():
        ids = torch.tensor([seq], device=reference.device)
        layers = reference.model(ids, output_hidden_states=True).hidden_states
    for j, k in enumerate(AUX):
        mine = got.aux[:, j * H : (j + 1) * H]
        right = rel(mine, layers[k][0])
        assert right < BF16_REL, (k, right)
        assert 3 * right < min(rel(mine, layers[k - 1][0]), rel(mine, layers[k + 1][0])), k


def test_a_shared_prefix_and_any_batch_give_every_row(engine: SGLangEngineBackend) -> None:
    base = prompts()[0]
    [alone] = engine.hidden_states([base], torch.float32)
    # the same prefix again, then in a batch with others: with a radix cache, rows would go missing
    again, longer, other = engine.hidden_states([base, [*base, 5, 6, 7], prompts()[3]], torch.float32)
    for s in (alone, again, longer, other):
        assert isinstance(s, HiddenStates)
    assert isinstance(alone, HiddenStates) and isinstance(again, HiddenStates)
    assert isinstance(longer, HiddenStates)
    assert longer.last.shape[0] == len(base) + 3
    assert rel(again.last, alone.last) < BF16_REL / 4 and rel(again.aux, alone.aux) < BF16_REL / 4
    assert rel(longer.aux[: len(base)], alone.aux) < BF16_REL  # causal: the prefix's rows do not change


def test_an_http_server_with_the_capture_hooks_gives_the_same_states(
    model_dir: Path, reference: TransformersTarget, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--mem-fraction-static", "0.3",
        "--enable-return-hidden-states", "--disable-radix-cache",
        "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        "--chunked-prefill-size", "-1", *capture_launch_args(AUX, MODELS["LlamaForCausalLM"]),
    ]  # fmt: skip
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 (closed in finally)
    # cwd: the scheduler imports eagle3_core.engines.sglang_capture by the hook spec's path
    proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(url + "/health_generate", timeout=10) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the SGLang server did not become healthy in 600 s"
            time.sleep(2)
        backend = SGLangHttpBackend(url, model_dir, TargetConfig(aux_layer_ids=AUX), max_seq_len=4096)
        batch = prompts()
        got = backend.hidden_states(batch, torch.float32)
        # the server's own warm-up request turned the capture on; if not, the first answer says so
        _compare(got, reference.hidden_states(batch, torch.float32), batch)
        finals = backend.final_states(batch)
        for f, g in zip(finals, got, strict=True):
            assert isinstance(f, torch.Tensor) and isinstance(g, HiddenStates) and torch.equal(f, g.last)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
