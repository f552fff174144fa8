"""Rollouts (evaluate/rollout.py): training prompts decoded with the drafter, recording what the target
computed. The recorded states are the target's own forward over the committed sequence at every position
(float64, so that a verification forward of K+1 tokens and the whole sequence's forward agree to rounding),
greedy replies are the target's greedy replies, and each token's draft-step label follows its round."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_core.evaluate.rollout import RolloutSettings, rollout
from eagle3_core.evaluate.specdec import target_generate
from eagle3_core.train.rollout_labels import NOT_DRAFTED, REJECTED, draft_steps
from tests.helpers import float64_target_and_drafter

pytestmark = pytest.mark.usefixtures("one_torch_thread")
AUX = (1, 3, 4)
VOCAB = 8


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in (3, 9, 5, 14, 2, 7)]


@pytest.mark.parametrize(("temperature", "prefill_tokens"), [(0.0, 8192), (0.9, 8192), (0.0, 20)])
def test_the_recorded_states_are_the_targets_forward_at_every_position(
    tmp_path: Path, temperature: float, prefill_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefilled in one padded group, or (a budget of 20 tokens) in several: a padded slot's states never
    survive into a record."""
    from eagle3_core.targets import batched

    monkeypatch.setattr(batched, "PREFILL_TOKENS", prefill_tokens)
    model, drafter, d2t = float64_target_and_drafter(tmp_path, VOCAB, seed=3)
    prompts = _prompts(1)
    eos = {target_generate(model, prompts[0], 20, set())[5]}  # some rows end early, inside a round
    settings = RolloutSettings(k=3, max_new_tokens=20, temperature=temperature, batch_size=4)  # 2 batches
    rollouts = rollout(model, drafter, d2t, AUX, prompts, eos, settings, torch.Generator().manual_seed(0))
    assert [r.prompt for r in rollouts] == prompts
    for r in rollouts:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([r.tokens]), output_hidden_states=True)
        want_aux = torch.cat([out.hidden_states[k][0] for k in AUX], dim=-1)
        torch.testing.assert_close(r.aux, want_aux, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(r.final, out.hidden_states[-1][0], rtol=1e-9, atol=1e-9)
        left = len(r.reply) - 1  # the first reply token came from the prefill; each round commits a + 1
        for a in r.verified:
            assert 0 <= a <= 3 and left > 0
            left -= min(a + 1, left)
        assert left == 0
    assert any(len(r.reply) < 20 for r in rollouts) and any(len(r.reply) == 20 for r in rollouts)
    if temperature == 0.0:
        assert [r.reply for r in rollouts] == [target_generate(model, p, 20, eos) for p in prompts]
        assert len({a for r in rollouts for a in r.verified}) >= 2


def test_a_rounds_tokens_are_labelled_with_the_step_that_proposed_them() -> None:
    # prompt of 4; the prefill's token at 4; round 1 accepts 2 of 3 (5, 6 right; 7 the correction); round 2
    # accepts all 3 (8, 9, 10; 11 the bonus); round 3 accepts 0 (12, the correction), cut at length 13
    labels = draft_steps(prompt_length=4, verified=[2, 3, 0, 1], length=13, k=3)
    n = NOT_DRAFTED
    assert labels.tolist() == [n, n, n, n, n, 0, 1, 2 + REJECTED, 0, 1, 2, n, 0 + REJECTED]
    assert labels.dtype == torch.int8


def test_labels_refuse_a_k_they_cannot_encode() -> None:
    with pytest.raises(ValueError, match="below 64"):
        draft_steps(2, [1], 5, k=64)
