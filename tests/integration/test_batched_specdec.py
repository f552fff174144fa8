"""Speculative decoding of many prompts at once (evaluate/batched.py) against one prompt at a time: the
batched target step computes the whole forward for every row at its own positions, greedy decoding gives
each prompt the same tokens (the target's own) and the same accepted drafts round by round as
`speculative_generate`, and sampled decoding keeps the target's distribution. Tiny float64 models keep every
comparison far from an argmax tie; a vocabulary of 8 makes a random drafter right often enough that rounds
accept 0, 1 and more drafts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from eagle3_core.evaluate.batched import speculative_generate_batch
from eagle3_core.evaluate.specdec import speculative_generate, target_generate
from eagle3_core.targets.batched import BatchedTarget, Sampling, target_generate_batch
from tests.helpers import chi_square_p, float64_target_and_drafter, tiny_family_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
AUX = (1, 3, 4)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_each_row_is_the_whole_forward_at_its_own_positions(family: str) -> None:
    model = tiny_family_model(family)
    rows = [list(range(3, 13)), [7, 1, 9, 4, 4, 2]]
    step = BatchedTarget(model, AUX, batch=2, capacity=32)
    for i, ids in enumerate(rows):  # a prefill a row, as the decoder runs it
        step.forward(torch.tensor([ids[:-3]]), torch.arange(len(ids) - 3)[None], slice(i, i + 1))
    tails = torch.tensor([ids[-3:] for ids in rows])  # then both rows at once, each at its own positions
    positions = torch.tensor([[len(ids) - 3 + j for j in range(3)] for ids in rows])
    logits, aux = step.forward(tails, positions)
    for i, ids in enumerate(rows):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        torch.testing.assert_close(logits[i], out.logits[0, -3:])
        torch.testing.assert_close(aux[i], torch.cat([out.hidden_states[k][0, -3:] for k in AUX], dim=-1))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_rows_decode_as_one_prompt_at_a_time(tmp_path: Path, k: int) -> None:
    model, drafter, d2t = float64_target_and_drafter(tmp_path, 8, seed=3)
    generator = torch.Generator().manual_seed(k)
    prompts = [torch.randint(0, 8, (n,), generator=generator).tolist() for n in (3, 9, 5, 14, 2, 7)]
    eos = {target_generate(model, prompts[0], 24, set())[6]}  # some rows stop early, at their own rounds
    batched = speculative_generate_batch(model, drafter, d2t, AUX, prompts, 24, k, eos)
    counts: set[int] = set()
    for prompt, result in zip(prompts, batched, strict=True):
        alone = speculative_generate(model, drafter, d2t, AUX, prompt, 24, k, eos)
        assert result.tokens == alone.tokens == target_generate(model, prompt, 24, eos)
        assert result.accepted == alone.accepted
        counts.update(result.accepted)
    assert len(counts) >= 2  # rows accepted different numbers of drafts: the rows' positions diverged
    assert target_generate_batch(model, AUX, prompts, 24, eos) == [r.tokens for r in batched]
    assert any(len(r.tokens) < 24 for r in batched) and any(len(r.tokens) == 24 for r in batched)


def test_sampled_rows_keep_the_target_distribution(tmp_path: Path) -> None:
    """1,500 rows of one prompt in one batch: the first token a verification round commits (the second
    generated) follows the target's own two-step marginal, as test_specdec checks one row at a time."""
    model, drafter, d2t = float64_target_and_drafter(tmp_path, 8, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)  # peaked, as test_specdec's: the drafter is right often enough
        drafter.lm_head.weight.mul_(30.0)
    prompt = [1, 5, 2]
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1], -1)
        second = torch.stack(
            [torch.softmax(model(input_ids=torch.tensor([[*prompt, u]])).logits[0, -1], -1) for u in range(8)]
        )
    expected = first @ second
    sampling = Sampling(1.0, torch.Generator().manual_seed(0))
    results = speculative_generate_batch(model, drafter, d2t, AUX, [prompt] * 1500, 3, 3, set(), sampling)
    counts = torch.zeros(8, dtype=torch.float64)
    for r in results:
        counts[r.tokens[1]] += 1
    kept = expected > 1e-3
    assert chi_square_p(counts[kept], expected[kept] / expected[kept].sum()) > 1e-3
    assert counts[~kept].sum() <= 3
    accepted = sum(r.accepted[0] for r in results)
    assert 0 < accepted < 1500


def test_measured_in_batches_acceptance_is_measure_s(tmp_path: Path) -> None:
    """measure_acceptance (batches of 4 over 6 prompts) gives measure's rounds at every K, and its greedy check
    counts a reply that differs from the reference."""
    from eagle3_core.evaluate.measure import DecodeSettings, measure, measure_acceptance

    model, drafter, d2t = float64_target_and_drafter(tmp_path, 8, seed=3)
    generator = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 8, (n,), generator=generator).tolist() for n in (3, 9, 5, 14, 2, 7)]
    settings = DecodeSettings((1, 3), 16)
    alone = measure(model, drafter, d2t, AUX, prompts, set(), settings)
    references = target_generate_batch(model, AUX, prompts, 16, set())
    batched = measure_acceptance(model, drafter, d2t, AUX, prompts, set(), settings, 4, references)
    for k in (1, 3):
        assert [r.accepted for r in batched.runs[k]] == [r.accepted for r in alone.runs[k]]
        assert batched.acceptance[k] == alone.acceptance[k]
    assert batched.greedy_mismatches == {1: 0, 3: 0}
    wrong = [[*r[:-1], (r[-1] + 1) % 8] for r in references]
    assert measure_acceptance(
        model, drafter, d2t, AUX, prompts, set(), settings, 4, wrong
    ).greedy_mismatches == {1: 6, 3: 6}


def test_every_rows_sampled_verification_at_once_is_the_one_row_rule() -> None:
    """verify_sampled_rows, one row at a time, takes the very draws verify_sampled takes from the same
    generator: the same accepted drafts and the same corrected token, on random rounds (rejections at every
    step, all accepted, and a draft equal to the target's distribution)."""
    from eagle3_core.evaluate.batched import verify_sampled_rows
    from eagle3_core.evaluate.specdec import verify_sampled

    k, vocab = 3, 6
    counts: set[int] = set()
    for seed in range(300):
        g = torch.Generator().manual_seed(seed)
        target = torch.softmax(torch.randn(k + 1, vocab, generator=g, dtype=torch.float64) * 2, -1)
        draft = torch.softmax(torch.randn(k, vocab, generator=g, dtype=torch.float64) * 2, -1)
        if seed % 10 == 0:
            draft = target[:k].clone()  # every draft accepted: the bonus token comes from the last row
        drafts = torch.multinomial(draft, 1, generator=g)[:, 0]
        one = verify_sampled(drafts, draft, target, torch.Generator().manual_seed(seed))[1]
        [rows] = verify_sampled_rows(
            drafts[None], draft[None], target[None], torch.Generator().manual_seed(seed)
        )
        assert rows == one
        counts.add(len(one) - 1)
    assert counts == {0, 1, 2, 3}


def test_prompts_prefilled_in_several_padded_groups_decode_as_one_prompt_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a prefill budget of 20 padded tokens the six prompts (2 to 14 tokens) are prefilled in groups of
    one to three rows, each padded to its longest: every row decodes as it does alone (float64)."""
    from eagle3_core.targets import batched

    monkeypatch.setattr(batched, "PREFILL_TOKENS", 20)
    model, drafter, d2t = float64_target_and_drafter(tmp_path, 8, seed=3)
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 8, (n,), generator=generator).tolist() for n in (3, 9, 5, 14, 2, 7)]
    groups = batched.prefill_groups(prompts)
    assert len(groups) > 2 and any(end - start > 1 for start, end in groups)
    assert [i for start, end in groups for i in range(start, end)] == list(range(len(prompts)))
    eos = {target_generate(model, prompts[0], 24, set())[6]}
    for result, prompt in zip(
        speculative_generate_batch(model, drafter, d2t, AUX, prompts, 24, 3, eos), prompts, strict=True
    ):
        alone = speculative_generate(model, drafter, d2t, AUX, prompt, 24, 3, eos)
        assert result.tokens == alone.tokens and result.accepted == alone.accepted
    assert target_generate_batch(model, AUX, prompts, 24, eos) == [
        target_generate(model, p, 24, eos) for p in prompts
    ]
