"""Small real models for tests: transformers Llamas saved as HF directories, randomly initialised or with
weights set on purpose so that what they generate is known before they run."""

from __future__ import annotations

import itertools
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


SCRIPTED_REPLY = "that sounds like fun"


def save_scripted_chat_target(directory: Path, reply: str = SCRIPTED_REPLY, *, seed: int = 0) -> Path:
    """A Llama with the Llama-3 chat template whose greedy reply to every prompt is `reply`, then end-of-turn.

    Its output is constructed, not learned, so a test can assert on it on any CPU: every layer's output
    projections are zero, so the residual stream at each position is the token's own embedding and the
    model is a bigram table; lm_head maps the generation prompt's last token to the reply's first, each reply
    token to the next, and the last to <|eot_id|>, each with a logit margin of about 40 over every other
    token, far beyond what another kernel's rounding can move.
    """
    tokenizer = train_tokenizer(CORPUS, vocab_size=320)
    eot = int(tokenizer.convert_tokens_to_ids("<|eot_id|>"))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(str(rendered), add_special_tokens=False)
    chain = [prompt[-1], *tokenizer.encode(reply, add_special_tokens=False), eot]
    if len(set(chain)) != len(chain):
        raise ValueError(f"{reply!r} tokenizes to a repeated token (or the prompt's last one): no chain")
    torch.manual_seed(seed)
    hidden = 64
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.zero_()
        # After the final RMSNorm a token's state is its embedding scaled to norm sqrt(hidden), so this row's
        # logit is 5 * sqrt(hidden) = 40 for the token it follows and about 40 * cos(random pair) (|cos| < 0.5
        # at hidden 64 over a few rows) for any other
        for before, after in itertools.pairwise(chain):
            head[after] = 5.0 * embed[before] / embed[before].norm()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    GenerationConfig(
        eos_token_id=[eot], pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    ).save_pretrained(directory)
    return directory
