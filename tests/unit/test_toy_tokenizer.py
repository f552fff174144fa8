"""The toy target's tokenizer: byte-level BPE with chat-template special tokens, trained in a second."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from eagle3_core.toy.templates import (
    CHATML_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    LLAMA3_SPECIAL_TOKENS,
    LLAMA3_TEMPLATE,
)
from eagle3_core.toy.tokenizer import train_tokenizer, train_tokenizer_with_template

CORPUS = [
    "hello there, how are you doing today?",
    "I'm doing great thanks! Just got back from a run in the park.",
    "What did you have for dinner?\nPasta with tomatoes and basil.",
    "My favourite numbers are 12345 and 3.14159, naturally.",
    "Café crème, naïve façade, 東京, and an emoji 🎉 or two 🎉.",
    "  indented code:\n    def f(x):\n        return x * 2\n",
] * 20

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi how are you?"},
    {"role": "assistant", "content": "great, you?"},
]

VOCAB = 400


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return train_tokenizer(CORPUS, VOCAB)


@pytest.mark.parametrize(
    "text",
    [
        "hello there",
        "Café crème 東京 🎉🎉 never seen: ж, ß, ✓",
        "  leading and trailing spaces  \n\n\ttab\r\nwindows",
        "digits 1234567890 and punctuation ?!...",
        "",
    ],
)
def test_round_trip(tok: PreTrainedTokenizerFast, text: str) -> None:
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text


def test_vocab_size_is_exact_and_training_is_deterministic(tok: PreTrainedTokenizerFast) -> None:
    assert len(tok) == VOCAB
    again = train_tokenizer(CORPUS, VOCAB)
    assert again.get_vocab() == tok.get_vocab()
    assert again("Café crème, naïve façade")["input_ids"] == tok("Café crème, naïve façade")["input_ids"]


@pytest.mark.parametrize("name", sorted(LLAMA3_SPECIAL_TOKENS))
def test_special_tokens_are_single_ids(tok: PreTrainedTokenizerFast, name: str) -> None:
    token = LLAMA3_SPECIAL_TOKENS[name]
    token_id = tok.convert_tokens_to_ids(token)
    assert isinstance(token_id, int)
    assert tok(token)["input_ids"] == [token_id]
    embedded = tok(f"a{token}b")["input_ids"]
    assert embedded.count(token_id) == 1
    assert tok.decode(embedded, skip_special_tokens=True) == "ab"


def test_named_special_tokens_and_no_automatic_bos(tok: PreTrainedTokenizerFast) -> None:
    assert tok.bos_token == "<|begin_of_text|>"
    assert tok.eos_token == "<|eot_id|>"
    assert tok.pad_token == "<|finetune_right_pad_id|>"
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert tok.bos_token_id not in tok("hello there")["input_ids"]


def test_chat_template_renders_llama3(tok: PreTrainedTokenizerFast) -> None:
    rendered = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi how are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\ngreat, you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"]
    assert ids == tok(rendered)["input_ids"]
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert ids.count(tok.eos_token_id) == len(MESSAGES)


def test_header_separator_is_one_token() -> None:
    # The Llama-3 split keeps "\n\n" together; the corpus must contain it for BPE to learn the merge.
    tok = train_tokenizer(["user"] * len(CORPUS) + ["\n\n" + t for t in CORPUS], VOCAB)
    ids = tok.apply_chat_template(MESSAGES[1:2], add_generation_prompt=True)["input_ids"]
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens[:5] == ["<|begin_of_text|>", "<|start_header_id|>", "user", "<|end_header_id|>", "ĊĊ"]


def test_offsets_map_tokens_onto_the_text(tok: PreTrainedTokenizerFast) -> None:
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    enc = tok(text, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    assert len(offsets) == len(enc["input_ids"])
    # ASCII only, so every token covers whole characters: the spans tile the text exactly.
    assert all(end0 == start1 for (_, end0), (start1, _) in itertools.pairwise(offsets))
    assert "".join(text[s:e] for s, e in offsets) == text
    for token_id, (s, e) in zip(enc["input_ids"], offsets, strict=True):
        assert tok.decode([token_id]) == text[s:e]
    # The assistant's content is exactly the tokens whose spans fall inside it.
    start = text.index("great, you?")
    end = start + len("great, you?")
    inside = [i for i, (s, e) in zip(enc["input_ids"], offsets, strict=True) if s >= start and e <= end]
    assert tok.decode(inside) == "great, you?"


def test_offsets_of_multibyte_characters(tok: PreTrainedTokenizerFast) -> None:
    text = "東京 🎉 ok"
    enc = tok(text, return_offsets_mapping=True)
    assert all(0 <= s <= e <= len(text) for s, e in enc["offset_mapping"])
    spans = [text[s:e] for s, e in enc["offset_mapping"]]
    assert "東" in spans and "京" in spans
    assert any("🎉" in span for span in spans)


def test_save_and_load(tok: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token == "<|eot_id|>"
    assert loaded.chat_template == LLAMA3_TEMPLATE
    assert loaded.apply_chat_template(MESSAGES)["input_ids"] == tok.apply_chat_template(MESSAGES)["input_ids"]
    assert (
        loaded("Café 🎉", return_offsets_mapping=True)["offset_mapping"]
        == tok("Café 🎉", return_offsets_mapping=True)["offset_mapping"]
    )


def test_chatml_tokenizer_is_built_the_same_way() -> None:
    tok = train_tokenizer_with_template(CORPUS, VOCAB, CHATML_SPECIAL_TOKENS, CHATML_TEMPLATE, eos_key="eos")
    assert tok.bos_token is None
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    for token in CHATML_SPECIAL_TOKENS.values():
        assert tok(token)["input_ids"] == [tok.convert_tokens_to_ids(token)]
    rendered = tok.apply_chat_template(MESSAGES[1:], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>user\nhi how are you?<|im_end|>\n"
        "<|im_start|>assistant\ngreat, you?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tok.decode(tok(rendered)["input_ids"]) == rendered
