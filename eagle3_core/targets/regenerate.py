"""Regeneration in process: every assistant turn replaced by the target's own reply, turn by turn.

Turn t of every conversation in the shard is generated in batches (prompts sorted by length, left padded),
each prompt being the conversation so far with the target's own earlier replies, so the drafter later learns
the distribution the target really produces. A conversation stops early, counted, when its prompt no longer
fits `max_seq_len - max_new_tokens`, when the conversation with a reply would exceed `max_seq_len`, when
the target replies with nothing, or after `max_turns`. The output keeps the sample id of the conversation
it came from: results are keyed by id, and the shard is written whole and atomically, so a crash never
leaves a duplicated or skipped sample.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3_core.config import RegenerateConfig
from eagle3_core.data.conversation import normalise_content
from eagle3_core.data.tokenize import generation_prompt_ids
from eagle3_core.store.records import ConversationRow, RegeneratedRow, RegenerationError, RegenerationRow


@dataclass
class Dialogue:
    """One conversation being regenerated: the turns kept so far and the user turns still to answer."""

    sample: ConversationRow
    done: list[dict[str, str]]
    pending_users: list[str]
    turns_regenerated: int = 0
    stop: str = ""


@dataclass
class RegenerationResult:
    rows: list[RegenerationRow]
    counts: Counter[str] = field(default_factory=Counter)
    new_tokens: int = 0


def dialogue_of(sample: ConversationRow, max_turns: int | None) -> Dialogue:
    system = [m.model_dump() for m in sample.messages if m.role == "system"]
    users = [m.content for m in sample.messages if m.role == "user"]
    return Dialogue(sample, system, users[:max_turns] if max_turns else users)


class Regenerator:
    """Replaces assistant turns with a causal LM's replies (transformers `generate`)."""

    def __init__(self, model: Any, tokenizer: Any, cfg: RegenerateConfig, max_seq_len: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.max_seq_len = max_seq_len
        self.max_prompt_tokens = max_seq_len - cfg.max_new_tokens
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    def regenerate(
        self, samples: Sequence[ConversationRow], progress: Callable[[int, int], None] = lambda _d, _t: None
    ) -> RegenerationResult:
        torch.manual_seed(self.cfg.seed)
        dialogues = [dialogue_of(s, self.cfg.max_turns) for s in samples]
        result = RegenerationResult(rows=[])
        total_turns = sum(len(d.pending_users) for d in dialogues)
        done_turns = 0
        while active := [d for d in dialogues if d.pending_users and not d.stop]:
            prompts = [self._prompt_ids(d) for d in active]
            fits = [(d, p) for d, p in zip(active, prompts, strict=True) if len(p) <= self.max_prompt_tokens]
            for d in active:
                if not any(d is f for f, _ in fits):
                    d.stop = "context_limit"
            fits.sort(key=lambda dp: len(dp[1]))
            for start in range(0, len(fits), self.cfg.batch_size):
                batch = fits[start : start + self.cfg.batch_size]
                replies, new_tokens = self._generate([p for _, p in batch])
                result.new_tokens += new_tokens
                for (d, _), (reply, hit_limit) in zip(batch, replies, strict=True):
                    append_reply(d, reply, hit_limit, result.counts, self.tokenizer, self.max_seq_len)
                done_turns += len(batch)
                progress(done_turns, total_turns)
        for d in dialogues:
            result.rows.append(finish_row(d, result.counts))
        return result

    def _prompt_ids(self, d: Dialogue) -> list[int]:
        return generation_prompt_ids(
            self.tokenizer, [*d.done, {"role": "user", "content": d.pending_users[0]}]
        )

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]]) -> tuple[list[tuple[str, bool]], int]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[b, width - len(p) :] = torch.as_tensor(p)
            mask[b, width - len(p) :] = 1
        sampling = self.cfg.temperature > 0
        out = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=self.cfg.max_new_tokens,
            do_sample=sampling,
            temperature=self.cfg.temperature if sampling else None,
            top_p=self.cfg.top_p if sampling else None,
            top_k=None,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        replies, new_tokens = [], 0
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            tokens = row if cut is None else row[:cut]
            new_tokens += len(tokens)
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            replies.append((normalise_content(text), cut is None))
        return replies, new_tokens


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
            id=d.sample.id,
            source=d.sample.source,
            turns_regenerated=0,
            error=d.stop or "no_user_turn",
            messages=[],
        )
    return RegeneratedRow.model_validate(
        {
            "id": d.sample.id,
            "source": d.sample.source,
            "turns_regenerated": d.turns_regenerated,
            "messages": d.done,
            "stop": d.stop or "complete",
        }
    )


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
