"""Small real models for tests: transformers Llamas saved as HF directories, randomly initialised or with
weights set on purpose so that what they generate is known before they run."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eagle3_core.draft.model import Eagle3Drafter
from eagle3_core.toy.tokenizer import train_tokenizer
from tests.fakes import tiny_drafter_config

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


# a six-layer target small enough for float64 decoding checks (tests of the graphed and batched target steps)
TINY_TARGET_SIZES = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}  # fmt: skip


def tiny_family_model(family: str) -> Any:
    """A random target of TINY_TARGET_SIZES in float64, eval mode: llama, qwen2 (biases on q, k, v) or qwen3
    (an RMSNorm on each head's queries and keys)."""
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY_TARGET_SIZES))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY_TARGET_SIZES))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**TINY_TARGET_SIZES, head_dim=8))
    return model.double().eval()


def random_drafter(t2d_ids: torch.Tensor, seed: int) -> tuple[Eagle3Drafter, torch.Tensor]:
    """(a random float64 drafter over a 64-token target, drafting the tokens `t2d_ids`; its d2t offsets)."""
    torch.manual_seed(seed)
    cfg = tiny_drafter_config(
        target_hidden_size=32,
        hidden_size=32,
        intermediate_size=64,
        target_vocab_size=64,
        draft_vocab_size=t2d_ids.numel(),
    )
    drafter = Eagle3Drafter(cfg).double().eval()
    return drafter, t2d_ids - torch.arange(t2d_ids.numel())


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of observed counts against expected probabilities."""
    expected = probs * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    return float(torch.special.gammaincc(torch.tensor((probs.numel() - 1) / 2), torch.tensor(stat / 2)))


def float64_target_and_drafter(
    directory: Path, vocab: int, seed: int
) -> tuple[torch.nn.Module, Eagle3Drafter, torch.Tensor]:
    """A tiny float64 Llama target of `vocab` tokens (6 layers, hidden 16) and a random full-vocabulary drafter
    of it with its d2t (zeros): decoding far from an argmax tie, and a vocabulary small enough that a random
    drafter is right often enough for rounds to accept 0, 1 and more drafts."""
    from eagle3_core.targets.hf import load_causal_lm

    path = save_tiny_llama(directory / "t", layers=6, hidden=16, vocab=vocab, seed=seed)
    model = load_causal_lm(path, torch.device("cpu"), torch.float64)
    torch.manual_seed(seed)
    cfg = tiny_drafter_config(
        target_hidden_size=16, hidden_size=16, intermediate_size=32, target_vocab_size=vocab,
        draft_vocab_size=vocab,
    )  # fmt: skip
    return model, Eagle3Drafter(cfg).double().eval(), torch.zeros(vocab, dtype=torch.long)
