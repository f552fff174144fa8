"""Shared pieces of the benchmarks: random-weight targets saved as HF directories, and the two timed paths."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_core.steps.data import WriteBehind, handover_dtype
from eagle3_core.store.records import ShardFacts
from eagle3_core.store.shards import ShardWriter
from eagle3_core.targets.base import HiddenStates, SampleFailure
from eagle3_core.targets.hf import TransformersTarget
from eagle3_core.toy.tokenizer import train_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "hello there, how are you today?"] * 50


def save_random_target(
    directory: Path,
    *,
    hidden: int,
    layers: int,
    vocab: int,
    intermediate: int,
    init_device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    heads: int | None = None,
    kv_heads: int | None = None,
) -> Path:
    """A random-weight Llama saved like a real checkpoint; on cuda a wide one initialises in seconds, and
    bfloat16 halves its files (a 5B-parameter target at hidden 7168 is 10 GB). Attention heads default to
    hidden / 64 of them and hidden / 128 key/value heads."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads or max(1, hidden // 64),
        num_key_value_heads=kv_heads or max(1, hidden // 128),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    with torch.device(init_device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(directory)
    del model
    train_tokenizer(CORPUS, vocab_size=300).save_pretrained(
        directory
    )  # ids are fed directly; any tokenizer loads
    return directory


def device_label(device: str) -> str:
    """A device's name as a results file names it: h200 for any H200, else its name in lower-case words."""
    return "h200" if "H200" in device else re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")


def random_sequences(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


def _sync(target: TransformersTarget) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize()


def plain_forward(target: TransformersTarget, batches: list[list[list[int]]]) -> float:
    """Seconds for the decoder's forward alone over the batches (right padded, nothing kept)."""
    _sync(target)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            width = max(len(s) for s in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for b, s in enumerate(batch):
                ids[b, : len(s)] = torch.tensor(s)
                mask[b, : len(s)] = 1
            target.decoder(
                input_ids=ids.to(target.device), attention_mask=mask.to(target.device), use_cache=False
            )
    _sync(target)
    return time.perf_counter() - t0


def extract_to_shard(
    target: TransformersTarget,
    batches: list[list[list[int]]],
    out: Path,
    held: list[list[HiddenStates | SampleFailure]] | None = None,
    threads: int = 4,
    facts: ShardFacts | None = None,
    first_id: int = 0,
    prompt_share: float = 0.0,
    store_dtype: str = "bfloat16",
    handover: torch.dtype | None = None,
) -> float:
    """Seconds to extract the batches into one shard the way the pipeline does (states from `held` if given).

    `facts` go into the shard header (the trainer needs `steps.data.extract_step`'s facts there); sample
    ids count up from `first_id`, so that several shards of one training set hold distinct ids. Each
    sample's first `prompt_share` of tokens is loss-masked (a chat's prompt), the rest counts. The states
    are stored in `store_dtype`, handed over by the target as extraction asks for them (`handover_dtype`: FP8
    quantised on the target's device where it can) unless `handover` names another dtype (bfloat16 for an FP8
    shard: quantised in the writer's threads instead).
    """
    seqs = [s for b in batches for s in b]
    dtype = handover or handover_dtype(store_dtype, target)
    _sync(target)
    t0 = time.perf_counter()
    with ShardWriter(
        out,
        sample_ids=[f"{first_id + i:064x}" for i in range(len(seqs))],
        lengths=[len(s) for s in seqs],
        hidden_size=target.info.hidden_size,
        store_dtype=store_dtype,
        facts=facts,
    ) as writer:
        start = 0
        with WriteBehind(writer, threads=threads) as behind:
            for n, batch in enumerate(batches):
                states = held[n] if held is not None else target.hidden_states(batch, dtype)
                rows = []
                for j, (seq, st) in enumerate(zip(batch, states, strict=True)):
                    ids = torch.tensor(seq, dtype=torch.int32)
                    mask = torch.ones_like(ids, dtype=torch.uint8)
                    mask[: int(len(seq) * prompt_share)] = 0
                    rows.append((start + j, ids, mask, st))
                behind.submit(rows)
                start += len(batch)
        writer.finalize()
    return time.perf_counter() - t0
