"""Regeneration in process: every assistant turn replaced by the target's own reply, turn by turn.

The shard's conversations are taken in groups of prompts of about one length (their first prompts sorted by
token length, a group at most `batch_size` long and, on a CPU, its longest prompt at most twice its shortest,
so that no batch is left-padded to one long outlier), and each group is regenerated to its end before the next
one starts: turn t of every conversation of the group in one batch (again grouped by length), each prompt being
the conversation so far with the target's own earlier replies, so the drafter later learns the distribution
the target really produces. Outputs do not depend on the batches: rows come back in input order.

On a GPU the target can generate with a static KV cache (`regenerate.kv_cache: static` or `auto`), which
transformers compiles the decode step for: a dynamic cache grows every layer's keys and values by one token
each step, and at batch 512 with SmolLM2 on an H200 a decode step took ~127 ms. A static batch is left-padded to a multiple of
`STATIC_WIDTH_MULTIPLE` tokens so that the compiled step sees few shapes; the token ids do not change.

`regenerate.step: batched` (or `auto` on a GPU) decodes with eagle3's own batched target step instead of
`generate` (targets/batched.py `target_generate_batch`): the target's modules over a KV cache preallocated per
batch, the prompts prefilled in groups padded to their longest (`prefill_groups`), then every row stepped one
token at a time at its own position, each token chosen as `generate` chooses it: the argmax at temperature 0, else `sample_tokens`
with the row's seed at the token's index within the reply (`SeededSampling`'s step). A target it does not
compute (`step_of`: the families and the probe `GraphedTarget` runs, and no logits processor `generate` would
add from the target's generation config) is refused in one line, or, with `auto`, decoded by `generate`.

A conversation stops early, counted, when its prompt no longer fits `max_seq_len - max_new_tokens`, when the
conversation with a reply would exceed `max_seq_len`, when the target replies with nothing, or after
`max_turns`. A reply cut at `max_new_tokens` is kept, marked "length" in the row's `finish_reasons` (a
finished one "stop") and counted (`replies_cut_at_max_new_tokens`): extraction then leaves its end-of-turn
untrained, since the target never ended it there (steps/data.py).

With `regenerate.samples` n > 1 each conversation is regenerated n times, each reply a sample of its own:
reply 0 keeps the conversation's sample id, reply r the id `<id>~r` (store/records.py `reply_id`). Above
temperature 0 each row of a batch samples its next token with its own seed, `request_seed(seed, reply id,
turn)` (the seed the server path sends with that request), through `SeededSampling`: the noise a row draws
depends on that seed and the token's position alone, never on the batch it was put in or the RNG's state, so
the n replies to one prompt differ, and a resumed run samples what an uninterrupted one would.

Every finished reply goes to the shard's journal (eagle3_core/store/journal.py, the one the server path
keeps) as soon as it is done, so a run killed mid-shard keeps what it finished and the next run regenerates
only the rest. The rows come out in the conversations' order, then by reply, whatever the batches, and the
shard is written whole and atomically by the step, so a crash never leaves a duplicated or skipped sample.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_core.config import RegenerateConfig
from eagle3_core.data.conversation import normalise_content
from eagle3_core.data.tokenize import generation_prompt_ids
from eagle3_core.errors import ConfigError
from eagle3_core.store.journal import RegenerationJournal
from eagle3_core.store.records import (
    ConversationRow,
    JournalEntry,
    RegeneratedRow,
    RegenerationError,
    RegenerationRow,
    reply_id,
)
from eagle3_core.targets.batched import target_generate_batch
from eagle3_core.targets.graphed import PROBE_TOKENS, GraphedTarget, UnsupportedTargetError

MAX_LENGTH_RATIO = 2  # on a CPU, a batch's longest prompt is at most this many times as long as its shortest
STATIC_WIDTH_MULTIPLE = 64  # with a static cache, prompts are left-padded to a multiple of this many tokens
# the batched step's aux layers: TargetLayers gathers some layer's input a forward; regeneration reads none
NO_AUX = (0,)
# generation-config fields with which `generate` changes the logits before it chooses a token (greedy or
# seeded; the sampling warpers it never applies here), at their neutral values: the batched step applies none
GENERATE_PROCESSORS: dict[str, Any] = {
    "repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "sequence_bias": None,
    "min_length": 0,
    "min_new_tokens": 0,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "guidance_scale": 1.0,
    "num_beams": 1,
    "watermarking_config": None,
}


@dataclass
class Dialogue:
    """One reply to a conversation being regenerated: the turns kept so far and the user turns still to answer."""

    sample: ConversationRow
    done: list[dict[str, str]]
    pending_users: list[str]
    reply: int = 0  # which of the conversation's `regenerate.samples` replies
    turns_regenerated: int = 0
    stop: str = ""
    finish_reasons: list[str] = field(default_factory=list)  # per kept reply: "stop", or "length" (cut)
    counts: Counter[str] = field(default_factory=Counter)  # what regenerating it counted
    new_tokens: int = 0

    @property
    def finished(self) -> bool:
        return not self.pending_users or bool(self.stop)

    @property
    def id(self) -> str:
        """The sample id of this reply's row: the conversation's for reply 0 (store/records.py `reply_id`)."""
        return reply_id(self.sample.id, self.reply)


@dataclass
class RegenerationResult:
    rows: list[RegenerationRow]
    counts: Counter[str] = field(default_factory=Counter)
    new_tokens: int = 0  # of every row, the journaled ones included
    resumed: int = 0  # samples taken from the journal
    fresh_tokens: int = 0  # new tokens generated in this run
    step: str | None = None  # in process: the decode step taken (regenerate.step), generate or batched

    def add(self, entry: JournalEntry) -> None:
        """One sample's row, counts and tokens, in the order the rows are added."""
        self.rows.append(entry.row)
        self.counts.update(entry.counts)
        self.new_tokens += entry.new_tokens


@dataclass(frozen=True)
class RegenerationProgress:
    """Where a shard's regeneration stands: what its step logs after each batch."""

    samples_done: int  # finished, the ones taken from the journal included
    samples_total: int
    resumed: int  # of those, taken from the journal
    new_tokens: int  # generated in this run
    seconds: float  # since this run started

    def line(self) -> str:
        """`12/40 samples regenerated; 1834 new tokens, 55.2 tokens/s, ETA 1m31s` (ETA from this run's pace)."""
        fresh = self.samples_done - self.resumed
        left = self.samples_total - self.samples_done
        eta = duration(left * self.seconds / fresh) if fresh else "unknown"
        rate = self.new_tokens / max(self.seconds, 1e-9)
        return (
            f"{self.samples_done}/{self.samples_total} samples regenerated; "
            f"{self.new_tokens} new tokens, {rate:.1f} tokens/s, ETA {eta}"
        )


def duration(seconds: float) -> str:
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass(frozen=True)
class Reply:
    text: str  # decoded without special tokens, normalised as ingest normalises content
    tokens: int  # generated, the end-of-turn token not counted
    cut: bool  # stopped by max_new_tokens, not by an end-of-turn token


def dialogue_of(sample: ConversationRow, max_turns: int | None, reply: int = 0) -> Dialogue:
    system = [m.model_dump() for m in sample.messages if m.role == "system"]
    users = [m.content for m in sample.messages if m.role == "user"]
    return Dialogue(sample, system, users[:max_turns] if max_turns else users, reply)


def reply_units(samples: Sequence[ConversationRow], replies: int) -> list[tuple[ConversationRow, int]]:
    """Every (conversation, reply) to regenerate, in the order the shard's rows take: by conversation, then
    reply."""
    return [(s, r) for s in samples for r in range(replies)]


def request_seed(seed: int, sample_id: str, turn: int) -> int:
    """One seed per (sample, turn), from the configured seed, `sample_id` being the reply's own id (the
    replies to one conversation get different seeds): a sampled reply does not depend on the order the work
    happened to be scheduled in (a server's requests; a resumed run's batches) nor on how many replies were
    asked for."""
    digest = hashlib.sha256(f"{seed}:{sample_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


MASK32 = 0xFFFFFFFF
NOISE_ELEMENTS = 1 << 24  # noise is drawn for at most this many (row, token) pairs at a time: bounded memory


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (a bijection of [0, 2**32), each product below 2**59: exact in int64 on any device)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def uniform_noise(seeds: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1), row i's a function of `seeds[i]`, `step` and the token id alone: a
    row draws the same noise in any batch, on any device."""
    key = _mix32((seeds & MASK32) ^ _mix32(torch.full_like(seeds, step & MASK32)))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    # 23 bits: (bits + 0.5) / 2**23 is exact in float32 and below 1, so -log(u) is never 0
    bits = _mix32(key[:, None] ^ ids[None, :]) >> 9
    return (bits.to(torch.float32) + 0.5) / float(1 << 23)


def sample_tokens(
    logits: torch.Tensor, seeds: torch.Tensor, step: int, temperature: float, top_p: float
) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab], sampled at `temperature` from the smallest set of tokens
    whose probability reaches `top_p` (transformers' top-p rule), by the Gumbel-max trick on `uniform_noise`:
    the argmax of logits / temperature plus -log(-log(u)) is a draw from their softmax."""
    scaled = logits / temperature
    if top_p < 1.0:
        ordered, order = torch.sort(scaled, dim=-1)
        outside = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        outside[:, -1] = False  # the likeliest token always stays
        scaled = scaled.masked_fill(outside.scatter(1, order, outside), -float("inf"))
    tokens = torch.empty(len(logits), dtype=torch.int64, device=logits.device)
    rows = max(1, NOISE_ELEMENTS // logits.shape[1])
    for start in range(0, len(logits), rows):
        part = slice(start, start + rows)
        gumbel = -torch.log(-torch.log(uniform_noise(seeds[part], step, logits.shape[1])))
        tokens[part] = torch.argmax(scaled[part] + gumbel, dim=-1)
    return tokens


class SeededSampling:
    """A transformers logits processor that samples each row's next token with the row's own seed and leaves
    only that token possible, for `generate` to take greedily. `width` is the batch's (left-padded) prompt
    width: the token's position within the reply, the noise's step, is the length past it."""

    def __init__(self, seeds: Sequence[int], width: int, temperature: float, top_p: float) -> None:
        self.seeds = torch.tensor(list(seeds), dtype=torch.int64)
        self.width = width
        self.temperature = temperature
        self.top_p = top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seeds = self.seeds.to(scores.device)
        step = input_ids.shape[1] - self.width
        tokens = sample_tokens(scores.float(), seeds, step, self.temperature, self.top_p)
        chosen = torch.full_like(scores, -float("inf"))
        return chosen.scatter_(1, tokens[:, None], 0.0)


def prompt_batches(
    lengths: Sequence[int], batch_size: int, max_ratio: float | None = MAX_LENGTH_RATIO
) -> list[list[int]]:
    """Indices of prompts by length (ties in input order), in batches of at most `batch_size` whose longest
    prompt is at most `max_ratio` times the shortest: a batch is left-padded to its longest prompt, so on a
    CPU, where every padded position is computed, a long outlier is batched with prompts of its own length,
    never with short ones padded to it. None: no ratio (a GPU, where a batch costs its decode steps, each
    launch-bound whatever the padding, so fewer, fuller batches are faster: on an H200 with SmolLM2, batches
    cut at a ratio of 2 ran at 425-490 new tokens/s against 2,200 for a full batch of 256)."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        batch = batches[-1] if batches else []
        too_long = max_ratio is not None and lengths[i] > max_ratio * lengths[batch[0]] if batch else False
        if not batch or len(batch) == batch_size or too_long:
            batches.append([i])
        else:
            batch.append(i)
    return batches


class Regenerator:
    """Replaces assistant turns with a causal LM's replies (transformers `generate`, or eagle3's batched target
    step: `regenerate.step`)."""

    def __init__(self, model: Any, tokenizer: Any, cfg: RegenerateConfig, max_seq_len: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.max_prompt_tokens = max_seq_len - cfg.max_new_tokens
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        on_gpu = next(model.parameters()).device.type == "cuda"
        self.max_ratio: float | None = None if on_gpu else MAX_LENGTH_RATIO
        self.step, self.step_reason = step_of(cfg.step, model, on_gpu)
        self.static_cache = self.step == "generate" and uses_static_cache(cfg.kv_cache, model, on_gpu)

    def regenerate(
        self,
        samples: Sequence[ConversationRow],
        journal: RegenerationJournal | None = None,
        progress: Callable[[RegenerationProgress], None] = lambda _p: None,
        log: Callable[[str], None] = lambda _m: None,
    ) -> RegenerationResult:
        """Rows in the order of `samples`, `regenerate.samples` replies each (by reply); the replies in
        `journal` are taken from it, the others regenerated and appended to it one by one as they finish."""
        started = time.perf_counter()
        log(f"decoding with {self.step} ({self.step_reason})")
        units = reply_units(samples, self.cfg.samples)
        ids = [reply_id(s.id, r) for s, r in units]
        entries = journal.open(ids) if journal is not None else {}
        if journal is not None and journal.discarded:
            log(f"{journal.path.name}: discarded ({journal.discarded})")
        resumed = len(entries)
        fresh_tokens = 0

        def finish(group: Iterable[Dialogue]) -> None:
            for d in group:
                if d.finished and d.id not in entries:
                    row = finish_row(d, d.counts)
                    entry = JournalEntry(id=d.id, row=row, counts=dict(d.counts), new_tokens=d.new_tokens)
                    entries[d.id] = entry
                    if journal is not None:
                        journal.append(entry)

        def batch_done(group: list[Dialogue], new_tokens: int) -> None:
            nonlocal fresh_tokens
            fresh_tokens += new_tokens
            finish(group)
            seconds = time.perf_counter() - started
            progress(RegenerationProgress(len(entries), len(ids), resumed, fresh_tokens, seconds))

        todo = [
            dialogue_of(s, self.cfg.max_turns, r)
            for (s, r), i in zip(units, ids, strict=True)
            if i not in entries
        ]
        try:
            for group in self._groups(todo):
                self._regenerate_group(group, batch_done)
                finish(group)  # those stopped before a batch of theirs ran (context_limit)
        finally:
            if journal is not None:
                journal.close()
        result = RegenerationResult(rows=[], resumed=resumed, fresh_tokens=fresh_tokens, step=self.step)
        for i in ids:
            result.add(entries[i])
        return result

    def _groups(self, dialogues: list[Dialogue]) -> list[list[Dialogue]]:
        """The dialogues in groups of about one first-prompt length, regenerated one group after another."""
        lengths = [len(self._prompt_ids(d)) if d.pending_users else 0 for d in dialogues]
        return [
            [dialogues[i] for i in batch]
            for batch in prompt_batches(lengths, self.cfg.batch_size, self.max_ratio)
        ]

    def _regenerate_group(
        self, group: list[Dialogue], batch_done: Callable[[list[Dialogue], int], None]
    ) -> None:
        """Every turn of the group's dialogues, batch by batch (grouped by prompt length again each turn)."""
        while active := [d for d in group if not d.finished]:
            fits: list[tuple[Dialogue, list[int]]] = []
            for d in active:
                prompt = self._prompt_ids(d)
                if len(prompt) > self.max_prompt_tokens:
                    d.stop = "context_limit"
                else:
                    fits.append((d, prompt))
            for batch in prompt_batches([len(p) for _, p in fits], self.cfg.batch_size, self.max_ratio):
                chosen = [fits[i] for i in batch]
                # an active dialogue has kept every reply it got: its turn is the replies it has
                seeds = [request_seed(self.cfg.seed, d.id, d.turns_regenerated) for d, _ in chosen]
                replies = self.generate_batch([p for _, p in chosen], seeds)
                for (d, _), reply in zip(chosen, replies, strict=True):
                    d.new_tokens += reply.tokens
                    append_reply(d, reply.text, reply.cut, d.counts, self.tokenizer, self.max_seq_len)
                batch_done(group, sum(r.tokens for r in replies))

    def _prompt_ids(self, d: Dialogue) -> list[int]:
        return generation_prompt_ids(
            self.tokenizer, [*d.done, {"role": "user", "content": d.pending_users[0]}]
        )

    @torch.inference_mode()
    def generate_ids(self, prompts: list[list[int]], seeds: Sequence[int] | None = None) -> list[list[int]]:
        """The token ids `generate` returns after each prompt (an end-of-turn token then padding where a row
        stopped early), in the prompts' order. Above temperature 0 with `seeds` (one per prompt), each row
        samples with its own seed (`SeededSampling`); without, transformers samples from torch's RNG. The
        batched step (`regenerate.step`) gives the same ids, and samples only with seeds."""
        from transformers import LogitsProcessorList

        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if self.step == "batched":
            return self._batched_ids(prompts, seeds)
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        if self.static_cache:  # the cache (and the compiled decode step) takes few shapes, not one per width
            width = -(-width // STATIC_WIDTH_MULTIPLE) * STATIC_WIDTH_MULTIPLE
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[b, width - len(p) :] = torch.as_tensor(p)
            mask[b, width - len(p) :] = 1
        processors = LogitsProcessorList()
        if self.cfg.temperature > 0 and seeds is not None:
            processors.append(SeededSampling(seeds, width, self.cfg.temperature, self.cfg.top_p))
        # seeded, the processor samples and generate takes its one possible token greedily
        sampling = self.cfg.temperature > 0 and not processors
        cache: dict[str, str] = {"cache_implementation": "static"} if self.static_cache else {}
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=self.cfg.max_new_tokens,
            do_sample=sampling,
            temperature=self.cfg.temperature if sampling else None,
            top_p=self.cfg.top_p if sampling else None,
            top_k=None,
            logits_processor=processors,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            **cache,
        )
        rows: list[list[int]] = out[:, width:].tolist()
        return rows

    def _batched_ids(self, prompts: list[list[int]], seeds: Sequence[int] | None) -> list[list[int]]:
        """generate_ids by the batched target step: each reply through its first eos id, padded as generate
        pads it (to the longest reply)."""
        if self.cfg.temperature > 0 and seeds is None:
            raise ValueError("regenerate.step batched samples with a seed a row: none were given")
        device = next(self.model.parameters()).device
        row_seeds = torch.tensor(list(seeds or []), dtype=torch.int64, device=device)

        def choose(logits: torch.Tensor, rows: slice, step: int) -> torch.Tensor:
            """As generate chooses from the float32 logits: the argmax, or the row's seeded sample."""
            if self.cfg.temperature == 0:
                return logits.float().argmax(-1)
            return sample_tokens(logits.float(), row_seeds[rows], step, self.cfg.temperature, self.cfg.top_p)

        replies = target_generate_batch(
            self.model, NO_AUX, prompts, self.cfg.max_new_tokens, set(self.eos_ids), choose=choose
        )
        width = max(len(r) for r in replies)
        return [r + [self.pad_id] * (width - len(r)) for r in replies]

    def generate_batch(self, prompts: list[list[int]], seeds: Sequence[int] | None = None) -> list[Reply]:
        """The target's replies to a batch of prompts (token ids), in their order; `seeds`: generate_ids'."""
        replies = []
        for row in self.generate_ids(prompts, seeds):
            end = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            tokens = row if end is None else row[:end]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            replies.append(Reply(normalise_content(text), len(tokens), cut=end is None))
        return replies


def conversation_length(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of the whole conversation in the chat template, as tokenisation will count them."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def append_reply(
    d: Dialogue, reply: str, hit_limit: bool, counts: Counter[str], tokenizer: Any, max_seq_len: int
) -> None:
    """Keep the reply as the next assistant turn, unless the conversation with it no longer fits max_seq_len.

    The prompt was checked against `max_seq_len - max_new_tokens`, but the reply's text re-tokenised within
    the template (its end-of-turn tokens, merges across the boundary) can take more tokens than were
    generated: such a reply would be truncated at training, so the conversation stops before it.
    Both regeneration paths (in process and through a server) keep their replies here, so they stop, count
    and build rows alike.
    """
    user = d.pending_users.pop(0)
    if not reply:
        d.stop = "empty_reply"
        return
    turns = [*d.done, {"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    if conversation_length(tokenizer, turns) > max_seq_len:
        d.stop = "context_limit"
        return
    d.done = turns
    d.turns_regenerated += 1
    d.finish_reasons.append("length" if hit_limit else "stop")
    counts["replies"] += 1
    if hit_limit:
        counts["replies_cut_at_max_new_tokens"] += 1


def finish_row(d: Dialogue, counts: Counter[str]) -> RegenerationRow:
    """The regenerated row of a dialogue (an error row when no turn was regenerated); counts its stop."""
    if d.stop:
        counts[f"stopped_{d.stop}"] += 1
    if d.turns_regenerated == 0:
        counts["errors"] += 1
        return RegenerationError(
            id=d.id,
            source=d.sample.source,
            turns_regenerated=0,
            error=d.stop or "no_user_turn",
            messages=[],
        )
    return RegeneratedRow.model_validate(
        {
            "id": d.id,
            "source": d.sample.source,
            "turns_regenerated": d.turns_regenerated,
            "messages": d.done,
            "stop": d.stop or "complete",
            "finish_reasons": d.finish_reasons,
        }
    )


def uses_static_cache(kv_cache: str, model: Any, on_gpu: bool) -> bool:
    """Whether generation preallocates a static KV cache (`regenerate.kv_cache`; auto: on a GPU, where
    transformers then compiles the decode step). A static cache asked for that the target cannot use (a
    model transformers gives no Cache to, which would silently ignore it) is refused."""
    takes_a_cache = bool(model._supports_default_dynamic_cache())
    if kv_cache == "static" and not takes_a_cache:
        raise ConfigError(
            f"regenerate.kv_cache: static: the target ({type(model).__name__}) takes no transformers KV "
            "cache; set kv_cache: dynamic"
        )
    return takes_a_cache and (kv_cache == "static" or (kv_cache == "auto" and on_gpu))


def step_of(step: str, model: Any, on_gpu: bool) -> tuple[str, str]:
    """(the decode step `regenerate.step` takes for `model`, "generate" or "batched", why). generate never
    probes; auto takes batched only on a GPU; otherwise batched where it computes the model: the families and
    the probe `GraphedTarget` runs against transformers' forward (12 tokens), and no logits processor in the
    model's generation config that `generate` would apply. batched refuses a model it cannot compute
    (ConfigError, one line); auto takes generate and says why."""
    if step == "generate":
        return "generate", "regenerate.step generate"
    if step == "auto" and not on_gpu:
        return "generate", "regenerate.step auto: the batched step only on a GPU"
    try:
        GraphedTarget(model, NO_AUX, capacity=PROBE_TOKENS, graphs=False)
        config = getattr(model, "generation_config", None)
        added = [k for k, v in GENERATE_PROCESSORS.items() if getattr(config, k, None) not in (None, v, [])]
        if added:
            raise UnsupportedTargetError(
                f"{type(model).__name__}: its generation config sets {', '.join(added)}, which generate "
                "applies and the batched step does not"
            )
    except UnsupportedTargetError as err:
        if step == "batched":
            raise ConfigError(f"regenerate.step: batched: {err}; set step: generate (or auto)") from None
        return "generate", f"regenerate.step auto: {err}"
    return "batched", f"regenerate.step {step}"


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (configured, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(value)
    if not ids:
        raise ValueError(
            "the target has no eos token id (generation_config.eos_token_id or tokenizer.eos_token)"
        )
    return list(dict.fromkeys(ids))
