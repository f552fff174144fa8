"""Small real models for tests: randomly initialised transformers Llamas saved as HF directories."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from eagle3_core.toy.tokenizer import train_tokenizer

# Each of the engines' drafter switches alone, and speculators' trainer defaults (its three flags); a test adds
# the sliding window that suits its own sequence length.
FLAG_VARIANTS: dict[str, dict[str, object]] = {
    "plain": {},
    "norm_before_fc": {"norm_before_fc": True},
    "fc_norm": {"fc_norm": True},
    "norm_output": {"norm_output": True},
    "norm_before_residual": {"norm_before_residual": True},
}
SPECULATORS_FLAGS: dict[str, object] = {
    "norm_before_fc": True,
    "norm_output": True,
    "norm_before_residual": True,
}

CORPUS = [
    "hello how are you today",
    "i am fine thank you and you",
    "what did you do this weekend",
    "i went hiking with my dog in the hills",
    "that sounds like a lot of fun",
    "do you like pizza or pasta more",
    "the weather is nice and sunny here",
    "my favourite colour is blue, what is yours?",
] * 20


def save_tiny_llama(
    directory: Path, *, layers: int = 8, hidden: int = 32, vocab: int = 256, seed: int = 0
) -> Path:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def save_tiny_chat_target(directory: Path, *, layers: int = 8, hidden: int = 32, seed: int = 0) -> Path:
    """A random-weight Llama with a real byte-level BPE tokenizer and the Llama-3 chat template."""
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    save_tiny_llama(directory, layers=layers, hidden=hidden, vocab=len(tokenizer), seed=seed)
    tokenizer.save_pretrained(directory)
    GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids("<|eot_id|>")],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    ).save_pretrained(directory)
    return directory
