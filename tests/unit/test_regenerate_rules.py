"""The bookkeeping both regeneration paths share: which replies are kept and why a conversation stops."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from transformers import PreTrainedTokenizerFast

from eagle3_core.data.tokenize import TemplateError, TokenizedSample
from eagle3_core.steps.data import untrained_endings
from eagle3_core.store.records import ConversationRow, RegeneratedRow, RegenerationError
from eagle3_core.targets.regenerate import (
    MAX_LENGTH_RATIO,
    append_reply,
    conversation_length,
    dialogue_of,
    finish_row,
    prompt_batches,
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
