"""The bookkeeping both regeneration paths share: which replies are kept and why a conversation stops."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from eagle3_core.data.tokenize import TemplateError, TokenizedSample
from eagle3_core.steps.data import untrained_endings
from eagle3_core.store.records import (
    ConversationRow,
    RegeneratedRow,
    RegenerationError,
    conversation_id,
    reply_id,
)
from eagle3_core.targets.regenerate import (
    MAX_LENGTH_RATIO,
    SeededSampling,
    append_reply,
    conversation_length,
    dialogue_of,
    finish_row,
    prompt_batches,
    request_seed,
    sample_tokens,
)
from eagle3_core.toy.tokenizer import train_tokenizer

CORPUS = ["hello there, how are you doing today?", "great thanks, and you? I went for a run."] * 20


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return train_tokenizer(CORPUS, 300)


def _sample() -> ConversationRow:
    return ConversationRow.model_validate(
        {
            "id": "s1",
            "split": "train",
            "messages": [{"role": "user", "content": "hello there"}, {"role": "user", "content": "and?"}],
            "source": {"file": "c.jsonl", "line": 1},
        }
    )


def test_a_reply_that_fits_is_kept(tok: PreTrainedTokenizerFast) -> None:
    d, counts = dialogue_of(_sample(), None), Counter[str]()
    append_reply(d, "great thanks", True, counts, tok, max_seq_len=10_000)
    assert d.done[-1] == {"role": "assistant", "content": "great thanks"} and d.turns_regenerated == 1
    assert counts == Counter(replies=1, replies_cut_at_max_new_tokens=1)
    row = finish_row(d, counts)
    assert isinstance(row, RegeneratedRow) and row.stop == "complete"
    assert row.finish_reasons == ["length"] and row.cut_turns == [0]  # cut at max_new_tokens: marked


def test_a_reply_whose_conversation_exceeds_max_seq_len_stops_it_before_the_reply(
    tok: PreTrainedTokenizerFast,
) -> None:
    """The prompt fitted, but the reply within the template (its end-of-turn tokens included) does not: kept,
    it would be truncated at training. The conversation keeps the turns before it."""
    first = dialogue_of(_sample(), None)
    append_reply(first, "great thanks", False, Counter(), tok, max_seq_len=10_000)
    kept = conversation_length(tok, first.done)
    reply = "great thanks, and you? I went for a run."
    with_reply = [*first.done, {"role": "user", "content": "and?"}, {"role": "assistant", "content": reply}]
    exact = conversation_length(tok, with_reply)
    assert kept < exact

    fits, counts = dialogue_of(_sample(), None), Counter[str]()
    append_reply(fits, "great thanks", False, counts, tok, max_seq_len=exact)
    append_reply(fits, reply, False, counts, tok, max_seq_len=exact)  # exactly max_seq_len: kept
    assert fits.turns_regenerated == 2 and not fits.stop

    short, counts = dialogue_of(_sample(), None), Counter[str]()
    append_reply(short, "great thanks", False, counts, tok, max_seq_len=exact - 1)
    append_reply(short, reply, False, counts, tok, max_seq_len=exact - 1)
    assert short.stop == "context_limit" and short.turns_regenerated == 1
    assert short.done == first.done
    row = finish_row(short, counts)
    assert isinstance(row, RegeneratedRow) and row.stop == "context_limit"
    assert counts["stopped_context_limit"] == 1
    assert conversation_length(tok, [m.model_dump() for m in row.messages]) <= exact - 1


def test_no_room_for_the_first_reply_is_an_error_row(tok: PreTrainedTokenizerFast) -> None:
    d, counts = dialogue_of(_sample(), None), Counter[str]()
    append_reply(d, "great thanks", False, counts, tok, max_seq_len=3)
    row = finish_row(d, counts)
    assert isinstance(row, RegenerationError) and row.error == "context_limit" and row.messages == []
    assert counts["errors"] == 1


def test_prompts_are_batched_by_length_so_an_outlier_pads_no_short_prompt() -> None:
    lengths = [100] * 15 + [1752]
    assert prompt_batches(lengths, 16) == [list(range(15)), [15]]
    lengths = [40, 7, 300, 12, 90, 33, 41, 8, 620, 85, 20, 19]
    batches = prompt_batches(lengths, 3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # each prompt once
    for b in batches:
        assert len(b) <= 3 and max(lengths[i] for i in b) <= MAX_LENGTH_RATIO * min(lengths[i] for i in b)
    assert [lengths[b[0]] for b in batches] == sorted(lengths[b[0]] for b in batches)  # shortest first
    assert prompt_batches([5, 5, 5], 2) == [[0, 1], [2]]  # ties in input order


def test_on_a_gpu_prompts_fill_whole_batches_whatever_their_lengths() -> None:
    # a GPU batch costs its decode steps, not its padding: no length ratio splits it
    lengths = [100] * 15 + [1752, 90]
    assert prompt_batches(lengths, 16, max_ratio=None) == [[16, *range(15)], [15]]


def _sample_of(ids: list[int], mask: list[int], truncated: int = 0) -> TokenizedSample:
    return TokenizedSample("s", np.asarray(ids, np.int32), np.asarray(mask, np.uint8), truncated)


def test_a_cut_reply_keeps_its_tokens_and_loses_only_its_end_of_turn_from_the_loss() -> None:
    eot = 9
    # user, reply 0 (2 tokens + eot), user, reply 1 (1 token + eot): runs of loss are the replies
    sample = _sample_of([1, 2, 5, 6, eot, 3, 4, 7, eot], [0, 0, 1, 1, 1, 0, 0, 1, 1])
    assert untrained_endings(sample, [1], [eot]).loss_mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 0]
    assert untrained_endings(sample, [0, 1], [eot]).loss_mask.tolist() == [0, 0, 1, 1, 0, 0, 0, 1, 0]
    # truncation took reply 1's end-of-turn (and all of a later turn): nothing left to take out
    cut_short = _sample_of([1, 2, 5, 6, eot, 3, 4, 7], [0, 0, 1, 1, 1, 0, 0, 1], truncated=1)
    assert untrained_endings(cut_short, [1, 2], [eot]).loss_mask.tolist() == cut_short.loss_mask.tolist()
    with pytest.raises(TemplateError, match="assistant turn 0 was cut at max_new_tokens"):
        untrained_endings(_sample_of([1, 5, 6, 3], [0, 1, 1, 0]), [0], [eot])


# ---- several replies per conversation (regenerate.samples) ----------------------------------------------
def test_a_replys_id_keeps_the_conversation_id_for_reply_0_and_gives_it_back_for_every_reply() -> None:
    conversation = "0123456789abcdef" * 4  # a sample id as ingest makes it: sha256 in hex
    ids = [reply_id(conversation, r) for r in range(64)]
    assert ids[0] == conversation  # a store regenerated once keeps its ids
    assert len(set(ids)) == 64 and ids == [reply_id(conversation, r) for r in range(64)]  # distinct, fixed
    assert {conversation_id(i) for i in ids} == {conversation}
    assert conversation_id(reply_id("id-07", 3)) == "id-07" != reply_id("id-07", 3)
    with pytest.raises(ValueError):
        reply_id(conversation, -1)
    d = dialogue_of(_sample(), None, reply=2)
    assert d.id == reply_id("s1", 2) and dialogue_of(_sample(), None).id == "s1"
    append_reply(d, "great thanks", False, Counter(), train_tokenizer(CORPUS, 300), max_seq_len=10_000)
    assert finish_row(d, Counter()).id == reply_id("s1", 2)  # the row is the reply's


def test_every_reply_and_turn_has_a_seed_of_its_own_and_reply_0_keeps_the_conversations() -> None:
    conversation = "ab" * 32
    seeds = [request_seed(7, reply_id(conversation, r), turn) for r in range(8) for turn in range(4)]
    assert len(set(seeds)) == len(seeds)
    assert seeds == [request_seed(7, reply_id(conversation, r), turn) for r in range(8) for turn in range(4)]
    assert seeds[0] == request_seed(7, conversation, 0)  # what a run of one reply sends
    assert request_seed(8, conversation, 0) != seeds[0]  # and regenerate.seed moves them all


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


def test_a_seeded_rows_token_is_its_own_in_any_batch_and_at_any_step_its_own() -> None:
    """What a row samples depends on its seed, the step and its logits alone: not on the rows beside it, their
    order or their number, so a reply does not depend on how the work was batched (or resumed)."""
    logits = _logits(6, 50)
    seeds = torch.tensor([request_seed(0, reply_id("c", r), 0) for r in range(6)])
    batched = sample_tokens(logits, seeds, 3, 1.0, 0.9)
    alone = torch.cat([sample_tokens(logits[i : i + 1], seeds[i : i + 1], 3, 1.0, 0.9) for i in range(6)])
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    assert batched.tolist() == alone.tolist() == sample_tokens(logits, seeds, 3, 1.0, 0.9).tolist()
    assert sample_tokens(logits[order], seeds[order], 3, 1.0, 0.9).tolist() == batched[order].tolist()
    # uniform logits over 50 tokens, 64 seeds (or steps): about 36 distinct draws are expected
    flat = torch.zeros(64, 50)
    assert len(set(sample_tokens(flat, torch.arange(64), 0, 1.0, 1.0).tolist())) > 25
    steps = [int(sample_tokens(flat[:1], torch.tensor([5]), step, 1.0, 1.0)) for step in range(64)]
    assert len(set(steps)) > 25


def test_seeded_sampling_draws_from_the_tempered_softmax_within_top_p() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 40_000
    for temperature in (1.0, 0.5):
        drawn = sample_tokens(logits.expand(n, -1), torch.arange(n), 0, temperature, 1.0)
        frequencies = torch.bincount(drawn, minlength=6).float() / n
        expected = torch.softmax(logits[0] / temperature, -1)
        assert (frequencies - expected).abs().max() < 0.01, (frequencies, expected)
    # top_p 0.8: the smallest set whose probability reaches 0.8 (the first three here), renormalised
    probs = torch.softmax(logits[0], -1)
    assert probs[:2].sum() < 0.8 <= probs[:3].sum()
    drawn = sample_tokens(logits.expand(n, -1), torch.arange(n), 0, 1.0, 0.8)
    frequencies = torch.bincount(drawn, minlength=6).float() / n
    assert frequencies[3:].sum() == 0
    assert (frequencies[:3] - probs[:3] / probs[:3].sum()).abs().max() < 0.01


def test_the_seeded_processor_leaves_one_token_at_the_replys_own_step() -> None:
    """generate calls it with the prompt (left-padded to `width`) and the tokens so far: the step is the count
    of tokens past the width, so a row samples alike whatever the width its batch was padded to."""
    logits = _logits(3, 40)
    seeds = [11, 12, 13]
    narrow = SeededSampling(seeds, width=5, temperature=0.8, top_p=1.0)
    wide = SeededSampling(seeds, width=64, temperature=0.8, top_p=1.0)
    out = narrow(torch.zeros(3, 5 + 2, dtype=torch.long), logits)
    assert out.isfinite().sum(-1).tolist() == [1, 1, 1] and out.max(-1).values.eq(0).all()
    assert out.argmax(-1).tolist() == sample_tokens(logits, torch.tensor(seeds), 2, 0.8, 1.0).tolist()
    assert (
        wide(torch.zeros(3, 64 + 2, dtype=torch.long), logits).argmax(-1).tolist() == out.argmax(-1).tolist()
    )
