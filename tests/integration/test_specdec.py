"""Greedy speculative decoding reproduces the target's greedy output token for token (transformers target)."""

import pytest
import torch

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.evaluate.acceptance import acceptance
from eagle3_core.evaluate.specdec import (
    DraftDecoder,
    Sampling,
    speculative_generate,
    target_generate,
    verify_sampled,
)
from eagle3_core.targets.hf import load_causal_lm
from tests.fakes import tiny_drafter_config
from tests.helpers import chi_square_p, random_drafter, save_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> object:
    path = save_tiny_llama(tmp_path_factory.mktemp("spec") / "t", layers=8, hidden=32, vocab=64)
    return load_causal_lm(path, torch.device("cpu"), torch.float64)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_random_drafter_changes_nothing_in_the_output(target: object, k: int) -> None:
    drafter, d2t = random_drafter(torch.arange(0, 64, 2), seed=k)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        prompt = torch.randint(0, 64, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        expected = target_generate(target, prompt, 24, eos_ids=set())
        got = speculative_generate(target, drafter, d2t, (2, 4, 5), prompt, 24, k, eos_ids=set())
        assert got.tokens == expected
        # AL counts what the rounds emitted: the tokens after the prefill's one, per verification round
        emitted_per_round = (len(got.tokens) - 1) / len(got.accepted)
        assert acceptance(got.accepted, k).acceptance_length == pytest.approx(emitted_per_round)


def test_rounds_of_a_full_vocabulary_drafter_account_for_every_token(target: object) -> None:
    drafter, d2t = random_drafter(torch.arange(64), seed=0)
    prompt = [1, 2, 3, 4, 5]
    result = speculative_generate(target, drafter, d2t, (2, 4, 5), prompt, 30, 4, eos_ids=set())
    report = acceptance(result.accepted, k=4)
    assert report.rounds == len(result.accepted)
    assert abs(sum(report.per_position) - (report.acceptance_length - 1)) < 1e-12
    assert result.tokens == target_generate(target, prompt, 30, eos_ids=set())
    # AL counts the 29 tokens the rounds emitted (the budget may cut the last one), not what they accepted
    assert report.acceptance_length == pytest.approx((len(result.tokens) - 1) / report.rounds)


class OracleDecoder(DraftDecoder):
    """Drafts the target's own greedy continuation: every draft is accepted, so rounds run into the budget and
    past end-of-turn, where what they accepted and what they emit differ."""

    def __init__(self, drafter: Eagle3Drafter, prompt: list[int], continuation: list[int]) -> None:
        super().__init__(drafter, capacity=len(prompt) + len(continuation) + 16)
        self.prompt, self.continuation = prompt, continuation

    def draft(self, committed, committed_aux, start, k, to_target, sampling):  # type: ignore[no-untyped-def]
        # `committed` (extended now) starts at position `start`; the prompt's first token has no entry
        out = start + len(committed) - len(self.prompt) + 1  # tokens generated before this round
        drafts = (self.continuation[out : out + k] + [0] * k)[:k]
        return torch.tensor(drafts), None


@pytest.mark.parametrize("cut", ["budget", "end_of_turn"])
def test_al_counts_the_tokens_each_round_emitted_not_the_drafts_it_accepted(target: object, cut: str) -> None:
    """An independent count: (tokens generated - the prefill's one) / verification rounds. Rounds of K=5 emit
    6 tokens (1 + 6r after r rounds); the budget of 23 ends the fourth round after 4, and an end-of-turn
    token placed mid-round ends it early."""
    drafter, d2t = random_drafter(torch.arange(64), seed=0)
    prompt = [1, 2, 3, 4, 5]
    continuation = target_generate(target, prompt, 40, eos_ids=set())
    if cut == "budget":
        budget, eos, expected = 23, set[int](), continuation[:23]
    else:
        # the latest first occurrence that is not a round's last token: generation stops right there
        first = {tok: i for i, tok in reversed(list(enumerate(continuation)))}
        stops = [i for i in first.values() if i >= 2 and i % 6 != 0]
        assert stops, f"no usable end-of-turn position in {continuation}"
        stop = max(stops)
        budget, eos, expected = 40, {continuation[stop]}, continuation[: stop + 1]
    oracle = OracleDecoder(drafter, prompt, continuation)
    result = speculative_generate(target, drafter, d2t, (2, 4, 5), prompt, budget, 5, eos, decoder=oracle)
    assert result.tokens == expected
    rounds = len(result.accepted)
    assert acceptance(result.accepted, k=5).acceptance_length == pytest.approx((len(expected) - 1) / rounds)
    assert result.accepted[:-1] == [5] * (rounds - 1)  # every full round accepted all five drafts
    assert result.accepted[-1] < 5  # the last round's drafts were all accepted, not all emitted


def test_a_round_after_rejected_drafts_equals_one_over_the_committed_prefix() -> None:
    """Stale cache slots (rejected drafts, an earlier prompt) are masked, so the drafter needs no crop.

    The same code runs eagerly here and as a CUDA graph on a GPU (DraftDecoder._round), so this is also what
    the graph replays.
    """
    drafter, d2t = random_drafter(torch.arange(0, 64, 2), seed=7)
    to_target = torch.arange(d2t.numel()) + d2t
    tokens = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(1))
    aux = torch.randn(12, 3 * 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    greedy = Sampling()

    fresh = DraftDecoder(drafter, capacity=24)
    expected, _ = fresh.draft(tokens, aux, 0, 4, to_target, greedy)

    reused = DraftDecoder(drafter, capacity=24)
    reused.keys.fill_(1e4)  # whatever an earlier sequence left must never be seen
    reused.values.fill_(-1e4)
    reused.draft(tokens[:9], aux[:9], 0, 4, to_target, greedy)  # its 3 chained drafts fill slots 9..11
    got, _ = reused.draft(tokens[9:], aux[9:], 9, 4, to_target, greedy)
    assert got.tolist() == expected.tolist()
    with pytest.raises(ValueError, match="holds 24 entries"):
        reused.draft(tokens[:2], aux[:2], 20, 4, to_target, greedy)


def test_one_decoder_serves_prompts_of_different_lengths(target: object) -> None:
    drafter, d2t = random_drafter(torch.arange(64), seed=3)
    decoder = DraftDecoder(drafter, capacity=12 + 20 + 3 + 1)
    for prompt in ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3, 4], [9, 1, 2, 8]):
        alone = speculative_generate(target, drafter, d2t, (2, 4, 5), prompt, 20, 3, eos_ids=set())
        shared = speculative_generate(target, drafter, d2t, (2, 4, 5), prompt, 20, 3, set(), None, decoder)
        assert shared.tokens == alone.tokens == target_generate(target, prompt, 20, eos_ids=set())
        assert shared.accepted == alone.accepted


# ---- speculative sampling (temperature > 0) -----------------------------------------------------------


def test_verify_sampled_commits_tokens_distributed_as_the_target() -> None:
    """One round with K=3, a 6-token vocabulary and a draft distribution far from the target's: the first
    committed token follows p_0 (accepted draft or residual draw), whatever q is."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(4, 6, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(3, 6, generator=g, dtype=torch.float64) * 2, -1)
    q[:, 5] = 0.0  # a target token outside the draft vocabulary: only the residual can produce it
    q = q / q.sum(-1, keepdim=True)
    draws = 20000
    first, drafted = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    for _ in range(draws):
        drafts = torch.multinomial(q, 1, generator=g)[:, 0]
        _, committed = verify_sampled(drafts, q, p, g)
        first[committed[0]] += 1
        drafted[drafts[0]] += 1
    assert chi_square_p(first, p[0]) > 1e-3
    assert first[5] > 0  # the residual gave the token the drafter cannot propose
    # the same test rejects the drafter's own distribution: it has the power to catch a wrong sampler
    assert chi_square_p(drafted + 0.5, p[0]) < 1e-6


def _peaked(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # type: ignore[operator, union-attr]
    return model


def test_speculative_sampling_matches_the_target_distribution_through_real_models(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A tiny target (vocabulary 8) and a random drafter over 5 of its tokens: the first token produced by a
    verification round (the second generated token) follows the target's own two-step marginal."""
    path = save_tiny_llama(tmp_path_factory.mktemp("sample") / "t", layers=6, hidden=16, vocab=8, seed=3)
    model = _peaked(load_causal_lm(path, torch.device("cpu"), torch.float64), 60.0)
    torch.manual_seed(1)
    cfg = tiny_drafter_config(
        target_hidden_size=16, hidden_size=16, intermediate_size=32, target_vocab_size=8, draft_vocab_size=5
    )
    drafter = _peaked(Eagle3Drafter(cfg).double().eval(), 30.0)
    d2t = torch.tensor([0, 1, 3, 4, 6]) - torch.arange(5)
    prompt, temperature = [1, 5, 2], 1.0
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        second = torch.stack(
            [
                torch.softmax(model(input_ids=torch.tensor([[*prompt, u]])).logits[0, -1] / temperature, -1)
                for u in range(8)
            ]
        )
    expected = first @ second  # P(second token = v) = sum_u p(u) p(v | u)
    sampling = Sampling(temperature, torch.Generator().manual_seed(0))
    counts = torch.zeros(8, dtype=torch.float64)
    accepted = 0
    for _ in range(1500):
        # a budget of 3: the first round emits at most 2 tokens, so it counts at most one accepted draft
        result = speculative_generate(model, drafter, d2t, (1, 3, 4), prompt, 3, 3, set(), sampling)
        counts[result.tokens[1]] += 1
        accepted += result.accepted[0]
    kept = expected > 1e-3  # cells with (almost) no mass would blow up the statistic
    assert chi_square_p(counts[kept], expected[kept] / expected[kept].sum()) > 1e-3
    assert counts[~kept].sum() <= 3
    assert 0 < accepted < 1500  # the drafter is sometimes right and sometimes rejected: both paths ran
