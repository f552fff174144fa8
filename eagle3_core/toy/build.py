"""Build the toy chat target: a small Llama trained from scratch on chitchat, saved as a Hugging Face directory.

The demo and the tests need a real chat model whose weights nobody has to download: this one is built here,
deterministically from a seed, with the Llama-3 chat template, and cached by a key over everything that
shapes it. Training uses the loss on all tokens (user turns too): the model is tiny and the data small, so
every token's signal helps, and a drafter later learns whatever distribution the target has.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from eagle3_core.data.conversation import Conversation, RowRejected, build_conversation, is_heldout
from eagle3_core.data.sources import chitchat_turns
from eagle3_core.store.atomic import atomic_directory
from eagle3_core.store.digest import directory_fingerprint
from eagle3_core.store.locks import directory_lock
from eagle3_core.store.records import Record
from eagle3_core.toy.presets import ToyPreset, get_preset
from eagle3_core.toy.templates import LLAMA3_SPECIAL_TOKENS
from eagle3_core.toy.tokenizer import train_tokenizer

# Bump when a change here changes what a build produces: it is part of the cache key.
TOY_CODE_VERSION = "1"
HELDOUT_FRACTION = 0.02
REPORT_FILE = "toy_target.json"
SAMPLE_PROMPT = "hi how are you?"
SAMPLE_MAX_NEW_TOKENS = 32
EVAL_BATCH = 8
LOG_EVERY = 20
# CPU kernels split reductions by thread, so the thread count is part of what a build computes: fixed, a
# build gives the same files on one machine whatever its core count or load.
BUILD_THREADS = 2

Log = Callable[[str], None]


class ToyTargetReport(Record):
    """toy_target.json beside a toy target: what was built, from what, and how well it learned."""

    size: str
    seed: int
    steps: int
    params: int
    vocab_size: int
    num_layers: int
    train_conversations: int
    heldout_conversations: int
    rejected_rows: int
    train_tokens: int
    final_train_loss: float
    heldout_loss: float
    heldout_tokens: int
    sample_prompt: str
    sample_reply: str
    device: str
    kernels: str = "unknown"  # kernel_set() of the build (reports from before it was recorded: unknown)
    build_seconds: float
    fingerprint: str
    code_version: str = TOY_CODE_VERSION

    @classmethod
    def of_target(cls, directory: Path) -> ToyTargetReport:
        return cls.read(directory / REPORT_FILE)


# ---- data -------------------------------------------------------------------------------------------------


def _chitchat_conversations() -> tuple[list[Conversation], int]:
    """Chitchat rows as conversations (first sender = user); returns them and the count of rejected rows."""
    import chitchat_dataset

    conversations: list[Conversation] = []
    rejected = 0
    for row in chitchat_dataset.Dataset().values():
        try:
            conversations.append(build_conversation(chitchat_turns(row), require_assistant=True))
        except RowRejected:
            rejected += 1
    return conversations, rejected


def _split(conversations: list[Conversation]) -> tuple[list[Conversation], list[Conversation]]:
    train = [c for c in conversations if not is_heldout(c.sample_id, HELDOUT_FRACTION)]
    heldout = sorted(
        (c for c in conversations if is_heldout(c.sample_id, HELDOUT_FRACTION)), key=lambda c: c.sample_id
    )
    return train, heldout


def _tokenizer_texts(conversations: Sequence[Conversation]) -> Iterator[str]:
    # The text between the Llama-3 template's special tokens: the role, then "\n\n" + content, so that the
    # separator the template adds is learned along with the words.
    for conv in conversations:
        for role, content in conv.turns:
            yield role
            yield "\n\n" + content


def _encode(tokenizer: PreTrainedTokenizerFast, conversations: Sequence[Conversation]) -> list[list[int]]:
    if not conversations:
        return []  # the tokenizer rejects an empty batch
    texts = [str(tokenizer.apply_chat_template(c.messages, tokenize=False)) for c in conversations]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _token_stream(
    tokenizer: PreTrainedTokenizerFast, conversations: Sequence[Conversation], generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Tokenised conversations in a seeded random order, epoch after epoch.

    Encoded lazily in chunks, because a short build (xs, or a test's few steps) reads a fraction of one epoch,
    and kept (int32) once encoded, because a long one (m) reads several epochs.
    """
    chunk = 256
    encoded: dict[int, torch.Tensor] = {}
    while True:
        order = torch.randperm(len(conversations), generator=generator).tolist()
        for start in range(0, len(order), chunk):
            indices = order[start : start + chunk]
            missing = [i for i in indices if i not in encoded]
            for i, ids in zip(missing, _encode(tokenizer, [conversations[i] for i in missing]), strict=True):
                encoded[i] = torch.tensor(ids, dtype=torch.int32)
            yield from (encoded[i] for i in indices)


def _packed_batches(stream: Iterator[torch.Tensor], batch_size: int, seq_len: int) -> Iterator[torch.Tensor]:
    """Windows of `seq_len` tokens cut from the concatenated stream (every conversation starts with BOS)."""
    need = batch_size * seq_len
    buffer = torch.empty(0, dtype=torch.int32)
    while True:
        pieces, have = [buffer], len(buffer)
        while have < need:
            pieces.append(next(stream))
            have += len(pieces[-1])
        buffer = torch.cat(pieces)
        yield buffer[:need].long().view(batch_size, seq_len)
        buffer = buffer[need:]


# ---- model and training -----------------------------------------------------------------------------------


def _model_config(preset: ToyPreset, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=_stop_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )


def _stop_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """End of turn first (the tokenizer's eos), then end of text."""
    return [_token_id(tokenizer, LLAMA3_SPECIAL_TOKENS[k]) for k in ("eot", "eos")]


def _token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == tokenizer.unk_token_id:
        raise ValueError(f"{token!r} is not a single token of this tokenizer")
    return token_id


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _lr_lambda(preset: ToyPreset, steps: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warmup = min(preset.warmup_steps, max(steps - 1, 0))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(steps - warmup, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def _train(
    model: LlamaForCausalLM, batches: Iterator[torch.Tensor], preset: ToyPreset, steps: int, log: Log
) -> float:
    """Train for `steps` steps; returns the mean loss of the last (up to) LOG_EVERY steps."""
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=preset.weight_decay
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(preset, steps))
    model.train()
    recent: list[float] = []
    started = time.monotonic()
    for step in range(1, steps + 1):
        ids = next(batches).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        recent = [*recent[-(LOG_EVERY - 1) :], loss.item()]
        if step % LOG_EVERY == 0 or step == steps:
            rate = step * ids.numel() / (time.monotonic() - started)
            log(f"toy: step {step}/{steps} loss {sum(recent) / len(recent):.3f} ({rate:,.0f} tokens/s)")
    return sum(recent) / len(recent)


@torch.inference_mode()
def _heldout_loss(model: LlamaForCausalLM, sequences: list[list[int]], pad_id: int) -> tuple[float, int]:
    """Mean token cross-entropy over all predicted tokens of the held-out conversations, and their count."""
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    by_length = sorted(sequences, key=len)
    for start in range(0, len(by_length), EVAL_BATCH):
        batch = by_length[start : start + EVAL_BATCH]
        width = max(len(s) for s in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        ids, mask = ids.to(device), mask.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        total += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), reduction="sum"))
        count += int((labels != -100).sum())
    return total / max(count, 1), count


@torch.inference_mode()
def greedy_reply(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, user_message: str, max_new_tokens: int = 64
) -> str:
    """The model's greedy answer to one user message, special tokens removed."""
    model.eval()
    device = next(model.parameters()).device
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], add_generation_prompt=True, tokenize=False
    )
    input_ids = tokenizer(str(prompt), add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return str(tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)).strip()


# ---- the directory ----------------------------------------------------------------------------------------


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    # Set only now: while building, whole conversations (some longer than this) are encoded and then cut.
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.cpu().save_pretrained(out_dir)  # float32: autocast never changed the parameters
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=_stop_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(out_dir)


def build_toy_target(
    out_dir: Path,
    size: str | ToyPreset = "xs",
    seed: int = 0,
    *,
    steps: int | None = None,
    log: Log = print,
) -> ToyTargetReport:
    """Train the toy target and write it to `out_dir` as a Hugging Face model directory with its report.

    Reproducible on one machine: the same seed, preset and steps give identical files on its CPU, whatever the
    core count or load (CUDA kernels are not bitwise reproducible). Under another kernel set (ATen's vector
    kernels, which `kernel_set` names and the cache key covers; the BLAS library's own choice by CPU model,
    which it does not) the weights differ, and so do the replies: no test may depend on what the toy says.
    `size` is a preset name or a preset; `steps` overrides the preset's.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        return _build(out_dir, get_preset(size) if isinstance(size, str) else size, seed, steps, log)
    finally:
        torch.set_num_threads(threads)


def _build(out_dir: Path, preset: ToyPreset, seed: int, steps: int | None, log: Log) -> ToyTargetReport:
    started = time.monotonic()
    steps = preset.steps if steps is None else steps
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    conversations, rejected = _chitchat_conversations()
    train, heldout = _split(conversations)
    log(f"toy: {len(train)} training and {len(heldout)} held-out conversations ({rejected} rejected rows)")
    tokenizer = train_tokenizer(_tokenizer_texts(train), preset.vocab_size)
    with _device():
        model = LlamaForCausalLM(_model_config(preset, tokenizer))
    params = sum(p.numel() for p in model.parameters())
    log(f"toy: {preset.name} target, {params:,} parameters, {steps} steps on {_device().type}")
    batches = _packed_batches(_token_stream(tokenizer, train, generator), preset.batch_size, preset.seq_len)
    train_loss = _train(model, batches, preset, steps, log)
    eval_set = heldout[: preset.heldout_conversations]
    sequences = [ids[: preset.seq_len] for ids in _encode(tokenizer, eval_set)]
    loss, loss_tokens = _heldout_loss(model, sequences, int(tokenizer.pad_token_id))
    reply = greedy_reply(model, tokenizer, SAMPLE_PROMPT, SAMPLE_MAX_NEW_TOKENS)
    log(f"toy: held-out loss {loss:.3f} over {loss_tokens} tokens; {SAMPLE_PROMPT!r} -> {reply!r}")
    _save(model, tokenizer, out_dir)
    report = ToyTargetReport(
        size=preset.name,
        seed=seed,
        steps=steps,
        params=params,
        vocab_size=len(tokenizer),
        num_layers=preset.num_layers,
        train_conversations=len(train),
        heldout_conversations=len(eval_set),
        rejected_rows=rejected,
        train_tokens=steps * preset.batch_size * preset.seq_len,
        final_train_loss=train_loss,
        heldout_loss=loss,
        heldout_tokens=loss_tokens,
        sample_prompt=SAMPLE_PROMPT,
        sample_reply=reply,
        device=_device().type,
        kernels=kernel_set(),
        build_seconds=round(time.monotonic() - started, 2),
        fingerprint=directory_fingerprint(out_dir, exclude=REPORT_FILE),
    )
    report.write(out_dir / REPORT_FILE)
    return report


# ---- the cache --------------------------------------------------------------------------------------------


def kernel_set() -> str:
    """What, beside the recipe, decides the built weights: the device, torch's release and (on a CPU) the
    vector kernels ATen dispatches to (AVX512, AVX2, or DEFAULT under ATEN_CPU_CAPABILITY=default). Training
    rounds differently under each, and 170 optimizer steps carry the difference into every weight and into
    what the target replies."""
    device = _device().type
    kernels = torch.backends.cpu.get_cpu_capability() if device == "cpu" else torch.version.cuda
    return f"{device}-{torch.__version__}-{kernels}"


def cache_key(preset: ToyPreset, seed: int, steps: int | None = None) -> str:
    """A short hash of everything that shapes the built target."""
    steps = preset.steps if steps is None else steps
    spec = {
        "preset": preset.model_dump(),
        "seed": seed,
        "steps": steps,
        "code": TOY_CODE_VERSION,
        "kernels": kernel_set(),
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def ensure_toy_target(
    cache_root: Path, size: str = "xs", seed: int = 0, log: Log = print, *, steps: int | None = None
) -> Path:
    """The cached toy target's directory, built first if missing.

    A build goes to a temporary directory beside the final one and is renamed into place when complete, so a
    directory under the final name is always whole; a crash leaves only a temporary that the next call removes.
    """
    preset = get_preset(size)
    final = cache_root / f"toy-{size}-{cache_key(preset, seed, steps)}"
    if final.is_dir():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    waiting = f"toy: another process is building a target in {cache_root}; waiting for it"
    with directory_lock(cache_root, lambda: log(waiting)):
        if final.is_dir():  # built by the process we waited for
            return final
        return _build_into(final, preset, seed, steps, log)


def _build_into(final: Path, preset: ToyPreset, seed: int, steps: int | None, log: Log) -> Path:
    try:
        with atomic_directory(final) as temp:  # under the build lock: no live build's temporary is removed
            build_toy_target(temp, preset, seed, steps=steps, log=log)
    except FileExistsError:
        if not final.is_dir():
            raise
        log(f"toy: {final.name} was built concurrently; keeping that one")
    return final
