"""Greedy speculative decoding reproduces the target's greedy output token for token (transformers target)."""

import pytest
import torch

from eagle3_core.draft.model import DrafterConfig, Eagle3Drafter
from eagle3_core.evaluate.acceptance import acceptance
from eagle3_core.evaluate.specdec import greedy_generate, speculative_generate
from eagle3_core.targets.hf import load_causal_lm
from tests.helpers import save_tiny_llama


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = save_tiny_llama(tmp_path_factory.mktemp("spec") / "t", layers=8, hidden=32, vocab=64)
    return load_causal_lm(path, torch.device("cpu"), torch.float64)


def _drafter(t2d_ids: torch.Tensor, seed: int) -> tuple[Eagle3Drafter, torch.Tensor]:
    torch.manual_seed(seed)
    cfg = DrafterConfig(target_hidden_size=32, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                        target_vocab_size=64, draft_vocab_size=t2d_ids.numel())
    drafter = Eagle3Drafter(cfg).double().eval()
    return drafter, t2d_ids - torch.arange(t2d_ids.numel())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_random_drafter_changes_nothing_in_the_output(target: object, k: int) -> None:
    drafter, d2t = _drafter(torch.arange(0, 64, 2), seed=k)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(0, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        expected = greedy_generate(target, prompt, 24, eos_ids=set())
        got = speculative_generate(target, drafter, d2t, (2, 4, 5), prompt, 24, k, eos_ids=set())
        assert got.tokens == expected
        assert sum(a + 1 for a in got.accepted) >= len(expected) - 1  # every round commits accepted + 1


def test_rounds_of_a_full_vocabulary_drafter_account_for_every_token(target: object) -> None:
    drafter, d2t = _drafter(torch.arange(64), seed=0)
    prompt = [1, 2, 3, 4, 5]
    result = speculative_generate(target, drafter, d2t, (2, 4, 5), prompt, 30, 4, eos_ids=set())
    report = acceptance(result.accepted, k=4)
    assert report.rounds == len(result.accepted)
    assert abs(sum(report.per_position) - (report.acceptance_length - 1)) < 1e-12
    assert result.tokens == greedy_generate(target, prompt, 30, eos_ids=set())
    assert sum(a + 1 for a in result.accepted) >= 30 - 1
