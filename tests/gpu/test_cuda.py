"""What only a GPU can show: `pytest -m gpu tests/gpu` on a CUDA host (the H200 runs of bench/ use it).

CI has no GPU, so these are deselected there by the `gpu` marker (pyproject.toml), not counted as passing.
"""

from pathlib import Path

import pytest
import torch

from eagle3_core.config import TargetConfig
from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.specdec import DraftDecoder
from eagle3_core.targets.batched import Sampling
from eagle3_core.targets.gpu_memory import GpuMemoryNotReleased, held_bytes
from eagle3_core.targets.hf import TransformersTarget
from tests.fakes import tiny_drafter_config
from tests.helpers import save_tiny_chat_target

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail(
            "the gpu tests need a CUDA device (they are deselected by default; run them on a GPU host)"
        )


def test_closing_the_target_gives_every_byte_back(tmp_path: Path) -> None:
    model_dir = save_tiny_chat_target(tmp_path / "t")
    target = TransformersTarget(model_dir, TargetConfig(path=str(model_dir), device="cuda"))
    target.hidden_states([[1, 2, 3, 4]])
    assert held_bytes() > 0
    target.close()
    assert held_bytes() == 0


def test_a_tensor_kept_alive_fails_the_release(tmp_path: Path) -> None:
    model_dir = save_tiny_chat_target(tmp_path / "t")
    target = TransformersTarget(model_dir, TargetConfig(path=str(model_dir), device="cuda"))
    kept = target.model.lm_head.weight  # a leak: someone still references the weights
    with pytest.raises(GpuMemoryNotReleased, match="still held"):
        target.close(timeout_s=1)
    del kept


def test_the_captured_round_drafts_what_the_eager_round_drafts() -> None:
    torch.manual_seed(0)
    cfg = tiny_drafter_config(
        target_hidden_size=256,
        hidden_size=256,
        intermediate_size=512,
        target_vocab_size=1000,
        draft_vocab_size=500,
    )
    drafter = Eagle3Drafter(cfg).cuda().eval()
    to_target = torch.arange(500, device="cuda") * 2
    tokens = torch.randint(0, 1000, (40,), device="cuda")
    aux = torch.randn(40, 3 * 256, device="cuda")
    eager, graphed = DraftDecoder(drafter, 64), DraftDecoder(drafter, 64, graphs=True)
    with torch.no_grad():
        for decoder in (eager, graphed):
            decoder.draft(tokens[:30], aux[:30], 0, 4, to_target, Sampling())
        for start, m in (
            (30, 1),
            (31, 3),
            (34, 5),
            (39, 1),
            (33, 2),
        ):  # replays of captured (K, m) rounds too
            want, _ = eager.draft(
                tokens[start - 30 : start - 30 + m], aux[:m], start, 4, to_target, Sampling()
            )
            got, _ = graphed.draft(
                tokens[start - 30 : start - 30 + m], aux[:m], start, 4, to_target, Sampling()
            )
            assert got.tolist() == want.tolist()
    assert set(graphed._captured) == {(4, 1), (4, 3), (4, 5), (4, 2)}


def test_on_a_gpu_auto_takes_the_graphed_target_step_and_decodes_the_eager_rounds() -> None:
    """evaluate.target_step auto on CUDA: the graphed step (CUDA graphs), whose rounds in float64 (far from any
    argmax tie) are the eager step's, prompt by prompt, and whose output is the target's own."""
    from eagle3_core.evaluate.measure import DecodeSettings, measure
    from eagle3_core.targets.graphed import runs_graphed
    from tests.helpers import random_drafter, tiny_family_model

    aux = (1, 3, 5)

    model = tiny_family_model("llama").cuda()
    assert runs_graphed("auto", model, aux, "cuda")
    drafter, d2t = random_drafter(torch.arange(0, 64, 2), seed=5)
    drafter, d2t = drafter.cuda(), d2t.cuda()
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [11, 12]]
    runs = {
        graphed: measure(
            model, drafter, d2t, aux, prompts, set(), DecodeSettings((1, 3), 16, graphed_target=graphed)
        )
        for graphed in (False, True)
    }
    for k in (1, 3):
        assert [r.accepted for r in runs[True].runs[k]] == [r.accepted for r in runs[False].runs[k]]
    assert runs[True].greedy_mismatches == {1: 0, 3: 0}


def test_on_a_gpu_distributed_muon_is_torchs_muon_bit_for_bit() -> None:
    """DistributedMuon's own Newton-Schulz (bfloat16 matrix products on the GPU's kernels) against
    torch.optim.Muon's, at a width where the GPU's matmuls split their work (one process: its owner is it)."""
    from eagle3_core.train.muon import DistributedMuon

    shapes = [(1024, 3072), (3072, 1024), (128, 2048)]
    ours, torchs = (
        [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes] for _ in range(2)
    )
    for a, b in zip(ours, torchs, strict=True):
        b.data.copy_(a.data)
    ours_opt = DistributedMuon(ours, lr=0.02, adjust_lr_fn="match_rms_adamw")
    torch_opt = torch.optim.Muon(torchs, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for step in range(3):
        for a, b in zip(ours, torchs, strict=True):
            a.grad = torch.randn(a.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            b.grad = a.grad.clone()
        ours_opt.step()
        torch_opt.step()
    for a, b in zip(ours, torchs, strict=True):
        assert torch.equal(a, b)


def test_a_gpu_run_logs_its_peak_and_sets_it_beside_the_preflights_estimate(tmp_path: Path) -> None:
    """Each log row carries the most memory a rank has allocated so far, and the summary the run's peak,
    never below a row's, beside the estimate the preflight went by and the GPU it ran on."""
    from bench._training import DataSpec, training_set
    from eagle3_core.config import TrainConfig
    from eagle3_core.draft.vocab import load_vocab_mapping
    from eagle3_core.store.records import TrainRow
    from eagle3_core.train.run_dir import read_metrics
    from eagle3_core.train.trainer import train_drafter

    spec = DataSpec(
        hidden=256, layers=8, vocab=2048, intermediate=704, draft_vocab=512, shards=1, samples_per_shard=24,
        min_len=64, max_len=256, device="cuda",
    )  # fmt: skip
    ts = training_set(tmp_path, spec, log=lambda _: None)
    cfg = TrainConfig(
        draft_vocab_size=512, batch_tokens=1024, max_len=256, max_steps=6, log_every=2, eval_every=6,
        checkpoint_every=6, device="cuda",
    )  # fmt: skip
    result = train_drafter(
        ts.shard_paths, ts.target_dir, load_vocab_mapping(ts.mapping_dir), tmp_path / "runs", cfg, log=print
    )
    peaks = [r.peak_gpu_gib for r in read_metrics(result.run_dir) if isinstance(r, TrainRow)]
    assert len(peaks) == 3 and all(p is not None and p > 0 for p in peaks)
    assert peaks == sorted(peaks)  # a running maximum
    gpu = result.summary.gpu_memory
    assert gpu is not None and gpu.peak_gib >= max(p for p in peaks if p is not None)
    assert gpu.estimate_gib > 0 and gpu.free_at_start_gib > gpu.peak_gib
    assert torch.cuda.get_device_name() in gpu.device
