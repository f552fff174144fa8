"""Byte-level BPE tokenizers trained from scratch, wrapped as Hugging Face fast tokenizers with a chat template.

Byte-level means every string round-trips and no token is unknown. The special tokens of the template's
family are added as special tokens (one id each, never split or merged); the template renders the BOS
itself, so `__call__` adds nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from eagle3_core.toy.templates import LLAMA3_SPECIAL_TOKENS, LLAMA3_TEMPLATE

# Llama-3's pre-tokenizer split: unlike GPT-2's it keeps a run of newlines in one piece, so the "\n\n" after
# each chat header is one token, and it splits numbers into groups of at most three digits.
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _between_specials(texts: Iterable[str], specials: list[str]) -> Iterator[str]:
    """The pieces of each text between special-token strings, so no merge ever spans or builds one."""
    pattern = re.compile("|".join(re.escape(s) for s in specials))
    for text in texts:
        for piece in pattern.split(text):
            if piece:
                yield piece


def _train_backend(texts: Iterable[str], vocab_size: int, specials: list[str]) -> Tokenizer:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps token offsets contiguous (a leading space belongs to its token), which is what
    # mapping character spans of a rendered conversation onto tokens needs.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_between_specials(texts, specials), trainer)
    return backend


def train_tokenizer_with_template(
    texts: Iterable[str],
    vocab_size: int,
    special_tokens: Mapping[str, str],
    template: str,
    *,
    eos_key: str = "eos",
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` ids (special tokens included) for one chat-template family.

    `special_tokens` maps roles to token strings; the `bos` and `pad` keys, where present, become the
    tokenizer's bos/pad tokens, `eos_key` names the token that ends a turn (generation stops there), and the
    rest become extra special tokens.
    """
    specials = list(dict.fromkeys(special_tokens.values()))
    backend = _train_backend(texts, vocab_size, specials)
    named = {"bos_token": special_tokens.get("bos"), "eos_token": special_tokens[eos_key]}
    named["pad_token"] = special_tokens.get("pad")
    extra = [s for s in specials if s not in named.values()]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=template,
        extra_special_tokens=extra,
        **{k: v for k, v in named.items() if v is not None},
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """The toy target's tokenizer: Llama-3 chat template, `<|eot_id|>` as eos so generation stops at a turn's end."""
    return train_tokenizer_with_template(
        texts, vocab_size, LLAMA3_SPECIAL_TOKENS, LLAMA3_TEMPLATE, eos_key="eot"
    )
