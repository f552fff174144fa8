"""Chat-template tokenisation: the assistant-only loss mask on two template families, and truncation counts.

The tokenizers are small byte-level BPEs trained here in a second; each is wrapped with the template of its
family. The central check decodes every contiguous run of masked tokens and compares it with the assistant
content plus the end-of-turn text, so a mask that is shifted by one token, takes a header or a newline, or
drops the end-of-turn fails.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from eagle3_core.config import TokenizeConfig
from eagle3_core.data.conversation import Conversation
from eagle3_core.data.tokenize import (
    ChatTokenizer,
    TemplateError,
    TokenizeCounts,
    TokenizedSample,
    mask_from_offsets,
)
from eagle3_core.toy.templates import (
    CHATML_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_TEMPLATE,
)


def _corpus() -> list[str]:
    subjects = ["I", "You", "We", "They", "The cat", "My friend", "A teacher", "The old man", "She", "He"]
    verbs = ["like", "see", "want", "found", "made", "read", "am", "need", "bought", "fixed"]
    objects = ["a book", "the sun", "some tea", "the garden", "fine weather", "a red car", "the answer"]
    tails = [".", "!", " today.", " again.", " at home.", "?"]
    sentences = [f"{s} {v} {o}{t}" for s, v, o, t in itertools.product(subjects, verbs, objects, tails)]
    # " I" mid-sentence makes the BPE merge "ĠI", a token that can straddle a prompt/answer boundary.
    asides = [f"Yes, I {v} {o}." for v, o in itertools.product(verbs, objects)]
    return random.Random(0).sample(sentences, 400) + asides + ["How are you?", "I am fine.", "Be nice."]


def _train_bpe(specials: list[str], *, trim_offsets: bool = True) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=trim_offsets)
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok


@dataclass(frozen=True)
class Family:
    name: str
    hf: PreTrainedTokenizerFast
    eot: str


def _llama3(template: str = LLAMA3_TEMPLATE, *, trim_offsets: bool = True) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(list(LLAMA3_SPECIAL_TOKENS.values()), trim_offsets=trim_offsets),
        bos_token=LLAMA3_SPECIAL_TOKENS["bos"],
        eos_token=LLAMA3_SPECIAL_TOKENS["eot"],
        chat_template=template,
    )


def _chatml(template: str = CHATML_TEMPLATE) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(list(CHATML_SPECIAL_TOKENS.values())),
        eos_token=CHATML_SPECIAL_TOKENS["eos"],
        chat_template=template,
    )


@pytest.fixture(scope="module")
def families() -> dict[str, Family]:
    return {
        "llama3": Family("llama3", _llama3(), "<|eot_id|>"),
        "chatml": Family("chatml", _chatml(), "<|im_end|>"),
    }


@pytest.fixture(params=["llama3", "chatml"])
def family(request: pytest.FixtureRequest, families: dict[str, Family]) -> Family:
    return families[request.param]


def conv(*turns: tuple[str, str]) -> Conversation:
    return Conversation(tuple(turns))


MULTI_TURN = conv(
    ("system", "Be nice."),
    ("user", "How are you?"),
    ("assistant", "I am fine."),
    ("user", "What did you read today?"),
    ("assistant", "I read a book at home."),
    ("user", "Again?"),
    ("assistant", "We read the answer again!"),
)


def masked_runs(sample: TokenizedSample, decode: Callable[[list[int]], str]) -> list[str]:
    """Decode each maximal run of consecutive masked tokens."""
    runs: list[str] = []
    ids = sample.input_ids.tolist()
    for is_masked, group in itertools.groupby(
        zip(ids, sample.loss_mask.tolist(), strict=True), key=lambda p: p[1]
    ):
        if is_masked:
            runs.append(decode([i for i, _ in group]))
    return runs


def decoder(hf: PreTrainedTokenizerFast) -> Callable[[list[int]], str]:
    def decode(ids: list[int]) -> str:
        text = hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        assert isinstance(text, str)
        return text

    return decode


def expected_runs(c: Conversation, eot: str) -> list[str]:
    return [content + eot for role, content in c.turns if role == "assistant"]


def test_masked_tokens_are_exactly_assistant_content_and_end_of_turn(family: Family) -> None:
    ct = ChatTokenizer(family.hf, max_seq_len=4096)
    sample = ct.tokenize(MULTI_TURN)
    decode = decoder(family.hf)
    assert masked_runs(sample, decode) == expected_runs(MULTI_TURN, family.eot)
    # The ids are the template render, unchanged, so the target sees what it sees when serving.
    assert decode(sample.input_ids.tolist()) == family.hf.apply_chat_template(
        MULTI_TURN.messages, tokenize=False
    )
    unmasked = decode(
        [i for i, m in zip(sample.input_ids.tolist(), sample.loss_mask.tolist(), strict=True) if not m]
    )
    for role, content in MULTI_TURN.turns:
        assert (content in unmasked) == (role != "assistant"), (role, content)
    assert "assistant" in unmasked and "user" in unmasked and "system" in unmasked
    assert sample.sample_id == MULTI_TURN.sample_id
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    assert set(sample.loss_mask.tolist()) == {0, 1}
    assert sample.truncated_tokens == 0 and sample.length == len(sample.input_ids)


def test_the_first_token_is_the_rendered_bos_without_a_second_one(families: dict[str, Family]) -> None:
    hf = families["llama3"].hf
    sample = ChatTokenizer(hf, max_seq_len=4096).tokenize(MULTI_TURN)
    bos = hf.convert_tokens_to_ids(LLAMA3_SPECIAL_TOKENS["bos"])
    assert sample.input_ids[0] == bos and sample.input_ids[1] != bos


def test_conversation_ending_with_a_user_turn_has_no_trailing_loss(family: Family) -> None:
    c = conv(("user", "Hi?"), ("assistant", "I am fine."), ("user", "They need a red car today."))
    sample = ChatTokenizer(family.hf, max_seq_len=4096).tokenize(c)
    assert masked_runs(sample, decoder(family.hf)) == ["I am fine." + family.eot]
    tail = decoder(family.hf)(sample.input_ids[sample.loss_mask.nonzero()[0][-1] + 1 :].tolist())
    assert "They need a red car today." in tail

    prompt_only = ChatTokenizer(family.hf, max_seq_len=4096).tokenize(
        conv(("system", "Be nice."), ("user", "Hi?"))
    )
    assert prompt_only.loss_tokens == 0 and prompt_only.length > 0


def test_unicode_and_newlines_in_content(family: Family) -> None:
    answer = "Größe: 5 €\n\n```py\nprint('hi')\n    return 1\n```\n日本語 🙂 done."
    c = conv(
        ("user", "Ünïcode — and\nnewlines?"), ("assistant", answer), ("user", "Ok 👍"), ("assistant", "Fine.")
    )
    sample = ChatTokenizer(family.hf, max_seq_len=4096).tokenize(c)
    assert masked_runs(sample, decoder(family.hf)) == expected_runs(c, family.eot)


def test_truncation_keeps_the_first_tokens_and_counts_what_is_lost(family: Family) -> None:
    full = ChatTokenizer(family.hf, max_seq_len=4096).tokenize(MULTI_TURN)
    cut = 9
    short = ChatTokenizer(family.hf, max_seq_len=full.length - cut).tokenize(MULTI_TURN)
    assert short.length == full.length - cut
    assert short.truncated_tokens == cut
    assert np.array_equal(short.input_ids, full.input_ids[:-cut])
    assert np.array_equal(short.loss_mask, full.loss_mask[:-cut])
    assert short.truncated_loss_tokens == int(full.loss_mask[-cut:].sum()) > 0
    assert short.loss_tokens + short.truncated_loss_tokens == full.loss_tokens


def test_a_sample_whose_assistant_part_is_cut_has_no_loss(family: Family) -> None:
    c = conv(("user", " ".join(["The old man bought some tea at home."] * 8)), ("assistant", "I am fine."))
    full = ChatTokenizer(family.hf, max_seq_len=4096).tokenize(c)
    first_masked = int(full.loss_mask.nonzero()[0][0])
    sample = ChatTokenizer(family.hf, max_seq_len=first_masked).tokenize(c)
    assert sample.loss_tokens == 0
    assert sample.truncated_tokens == full.length - first_masked
    assert sample.truncated_loss_tokens == full.loss_tokens
    counts = TokenizeCounts.of([sample])
    assert counts.no_loss_samples == 1 and counts.truncated_samples == 1


def test_batch_counts(family: Family) -> None:
    convs = [
        MULTI_TURN,
        conv(("user", "Hi?"), ("assistant", "I am fine.")),
        conv(("user", "Hi?")),
        conv(("user", " ".join(["We need a book again."] * 10)), ("assistant", "You need a book.")),
    ]
    full = ChatTokenizer(family.hf, max_seq_len=4096).tokenize_many(convs)
    limit = 40
    assert sorted(s.length > limit for s in full) == [False, False, True, True]  # the test means something
    samples, counts = ChatTokenizer(family.hf, max_seq_len=limit).tokenize_batch(convs)

    assert [s.sample_id for s in samples] == [c.sample_id for c in convs]
    assert counts.samples == 4
    assert counts.tokens == sum(min(f.length, limit) for f in full)
    assert counts.truncated_tokens == sum(max(0, f.length - limit) for f in full)
    assert counts.truncated_samples == 2
    assert counts.loss_tokens == sum(int(f.loss_mask[:limit].sum()) for f in full)
    assert counts.truncated_loss_tokens == sum(int(f.loss_mask[limit:].sum()) for f in full)
    assert counts.tokens + counts.truncated_tokens == sum(f.length for f in full)
    # The user-only conversation, and the long one whose answer lies past the limit.
    assert counts.no_loss_samples == 2
    assert counts + counts == TokenizeCounts(**{k: 2 * v for k, v in counts.as_dict().items()})


def test_batch_and_single_tokenisation_agree(family: Family) -> None:
    ct = ChatTokenizer(family.hf, max_seq_len=4096)
    other = conv(("user", "Hi?"), ("assistant", "I am fine."))
    batch = ct.tokenize_many([MULTI_TURN, other])
    for c, b in zip([MULTI_TURN, other], batch, strict=True):
        single = ct.tokenize(c)
        assert np.array_equal(single.input_ids, b.input_ids) and np.array_equal(single.loss_mask, b.loss_mask)
    assert ct.tokenize_many([]) == []


def test_from_config_uses_max_seq_len_and_end_of_turn(families: dict[str, Family]) -> None:
    hf = families["llama3"].hf
    ct = ChatTokenizer.from_config(hf, TokenizeConfig(max_seq_len=16, end_of_turn="<|eot_id|>"))
    assert ct.max_seq_len == 16 and ct.end_of_turn == "<|eot_id|>"
    assert ct.tokenize(MULTI_TURN).length == 16


def test_samples_are_read_only(families: dict[str, Family]) -> None:
    sample = ChatTokenizer(families["chatml"].hf, max_seq_len=4096).tokenize(MULTI_TURN)
    with pytest.raises(ValueError, match="read-only"):
        sample.loss_mask[0] = 1


# --- templates the mask cannot be derived from ---------------------------------------------------------


def _with_template(family: Family, template: str) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=family.hf.backend_tokenizer, eos_token=family.eot, chat_template=template
    )
    return hf


def test_generation_prompt_that_is_not_a_prefix_raises(families: dict[str, Family]) -> None:
    # History says "assistant", the live prompt says "model": the target would be trained on one and
    # served the other.
    bad = CHATML_TEMPLATE.replace("'<|im_start|>assistant\\n'", "'<|im_start|>model\\n'")
    assert bad != CHATML_TEMPLATE
    ct = ChatTokenizer(_with_template(families["chatml"], bad), max_seq_len=4096)
    with pytest.raises(TemplateError, match=r"assistant turn 2: the generation prompt .* not a prefix"):
        ct.tokenize(MULTI_TURN)


def test_text_inserted_before_the_content_raises(families: dict[str, Family]) -> None:
    thinking = CHATML_TEMPLATE.replace(
        "message['content'] + '<|im_end|>'",
        "(('<think></think>' if message['role'] == 'assistant' else '') + message['content']) + '<|im_end|>'",
    )
    assert thinking != CHATML_TEMPLATE
    ct = ChatTokenizer(_with_template(families["chatml"], thinking), max_seq_len=4096)
    with pytest.raises(TemplateError, match=r"assistant turn 2: the content does not follow .*<think>"):
        ct.tokenize(MULTI_TURN)


def test_missing_end_of_turn_raises(families: dict[str, Family]) -> None:
    ct = ChatTokenizer(families["llama3"].hf, max_seq_len=4096, end_of_turn="<|end_of_text|>")
    with pytest.raises(TemplateError, match=r"assistant turn 2: end-of-turn '<\|end_of_text\|>' not found"):
        ct.tokenize(MULTI_TURN)


def test_assistant_first_raises(families: dict[str, Family]) -> None:
    ct = ChatTokenizer(families["llama3"].hf, max_seq_len=4096)
    with pytest.raises(TemplateError, match="assistant turn 0"):
        ct.tokenize(conv(("assistant", "I am fine.")))


def test_slow_or_templateless_tokenizers_are_refused(families: dict[str, Family]) -> None:
    with pytest.raises(TemplateError, match="no chat_template"):
        ChatTokenizer(_with_template(families["llama3"], ""), max_seq_len=4096)

    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="fast"):
        ChatTokenizer(Slow(), max_seq_len=4096)


# --- the offsets rule -------------------------------------------------------------------------------------

# A plain template whose generation prompt ends in a space, so the first content token (" I") straddles the
# prompt/content boundary and, with trimmed offsets, a lone space token gets a zero-width offset there.
PLAIN_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- message['role'] + ': ' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}"
)


@pytest.mark.parametrize("trim_offsets", [True, False])
def test_a_token_straddling_the_prompt_boundary_is_masked_by_its_last_character(trim_offsets: bool) -> None:
    hf = _llama3(PLAIN_TEMPLATE, trim_offsets=trim_offsets)
    c = conv(("user", "Hi?"), ("assistant", "I am fine."), ("user", "Ok"), ("assistant", "🙂 ok"))
    sample = ChatTokenizer(hf, max_seq_len=4096).tokenize(c)
    tokens = hf.convert_ids_to_tokens(sample.input_ids.tolist())
    assert "ĠI" in tokens and "Ġ" in tokens  # the boundary cases this test is about do occur
    # "ĠI" holds the prompt's space and the answer's first letter; the target emits it, so it is masked
    # (a start-offset rule would drop it untrimmed). The lone space before the emoji is the prompt's: with
    # trimmed offsets it is zero-width at the answer's start, and a start-offset rule would mask it.
    assert masked_runs(sample, decoder(hf)) == [" I am fine.<|eot_id|>", "🙂 ok<|eot_id|>"]


def test_mask_from_offsets_uses_the_last_character() -> None:
    # Zero-width tokens are trimmed lone spaces: (5, 5) is the space at 4, (9, 9) the space at 8.
    offsets = np.array([[0, 3], [3, 5], [5, 5], [5, 8], [8, 9], [9, 9], [9, 12]], dtype=np.int64)
    assert mask_from_offsets(offsets, [(5, 9)]).tolist() == [0, 0, 0, 1, 1, 1, 0]
    assert mask_from_offsets(offsets, [(0, 3), (9, 12)]).tolist() == [1, 0, 0, 0, 0, 0, 1]
    assert mask_from_offsets(offsets, [(2, 5), (7, 8)]).tolist() == [1, 1, 1, 1, 0, 0, 0]
    assert mask_from_offsets(offsets, []).tolist() == [0] * 7
