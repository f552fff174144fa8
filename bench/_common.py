"""Shared set-up for the benchmarks: random-weight targets of a given shape, saved as HF directories."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_core.toy.tokenizer import train_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today?"] * 50


def save_random_target(directory: Path, *, hidden: int, layers: int, vocab: int, intermediate: int) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    train_tokenizer(CORPUS, vocab_size=300).save_pretrained(directory)  # ids are fed directly; any tokenizer loads
    return directory


def random_sequences(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]
