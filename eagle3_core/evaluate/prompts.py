"""Prompts to measure a drafter on: the store's held-out conversations, or a user's JSONL prompt file.

Held-out conversations (split "heldout" at ingest) are never regenerated, extracted or trained on. Each gives
its first `per_conversation` user turns as prompts, with the conversation's earlier turns as history.

A prompt file holds one JSON object per line in any format ingest reads (`messages`, ShareGPT
`conversations`, `prompt`), or MT-bench's `turns` (its first turn is the prompt). Trailing assistant turns
are dropped, so a full conversation is a prompt for its last reply. Rows that cannot be read are counted
and kept with their reason, as ingest keeps them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from eagle3_core.data.conversation import Conversation, RowRejected, build_conversation
from eagle3_core.data.sources import decode_record, jsonl_rows, record_turns, stored_name
from eagle3_core.data.tokenize import generation_prompt_ids
from eagle3_core.errors import Eagle3Error
from eagle3_core.store.layout import StoreLayout
from eagle3_core.store.records import ConversationRow, read_rows

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class EvalPrompt:
    id: str  # the sample id and turn, or file:line
    messages: Messages  # ends with the user turn the reply answers
    category: str | None = None  # a prompt file's `category` field: AL is reported per category too


@dataclass
class PromptSet:
    name: str
    prompts: list[EvalPrompt]
    rejected: list[dict[str, Any]] = field(default_factory=list)  # {"id", "reason", "detail"}

    @property
    def reject_counts(self) -> dict[str, int]:
        return dict(Counter(r["reason"] for r in self.rejected))


def _user_prefixes(conv: Conversation, limit: int | None) -> Iterator[Messages]:
    """Messages up to and with each user turn (a history of earlier turns), at most `limit` of them."""
    messages = conv.messages
    ends = [i for i, m in enumerate(messages) if m["role"] == "user"]
    for end in ends[:limit]:
        yield messages[: end + 1]


def heldout_prompts(
    store_root: Path, *, per_conversation: int, limit: int, holdout_fraction: float | None = None
) -> PromptSet:
    """The held-out conversations of every conversation shard, in shard and row order, up to `limit` prompts.

    None held out is an Eagle3Error that says how many conversations there are and, given the configured
    `holdout_fraction`, at which fraction none of them was held out (a small store can hold out none at 0.02).
    """
    layout = StoreLayout(store_root)
    shards = sorted(layout.root.glob("conversations/*.jsonl"))
    prompts: list[EvalPrompt] = []
    conversations = 0
    for shard in (s for s in shards if not s.name.endswith(".rejects.jsonl")):
        for sample in read_rows(shard, ConversationRow.model_validate):
            conversations += 1
            if sample.split != "heldout":
                continue
            conv = build_conversation([(m.role, m.content) for m in sample.messages], require_assistant=False)
            for turn, messages in enumerate(_user_prefixes(conv, per_conversation)):
                prompts.append(EvalPrompt(f"{sample.id[:16]}/{turn}", messages))
                if len(prompts) == limit:
                    return PromptSet("heldout", prompts)
    if not prompts:
        raise Eagle3Error(_no_heldout_message(layout.root, conversations, holdout_fraction))
    return PromptSet("heldout", prompts)


def _no_heldout_message(root: Path, conversations: int, holdout_fraction: float | None) -> str:
    if conversations == 0:
        return (
            f"{root}: no conversations to hold out prompts from (run `eagle3 ingest`), or pass --prompts FILE"
        )
    at = f" at data.holdout_fraction {holdout_fraction:g}" if holdout_fraction is not None else ""
    return (
        f"{root}: 0 of {conversations} conversations are held out{at} (the split is fixed by sample id at "
        "ingest; a larger fraction holds out more of a store ingested anew); evaluate on a prompt file: "
        "`eagle3 eval --prompts FILE`, or evaluate.prompt_files"
    )


def _turns(record: Any) -> list[tuple[object, object]]:
    if (
        isinstance(record, dict)
        and "turns" in record
        and not {"messages", "conversations", "prompt"} & set(record)
    ):
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise RowRejected("wrong_shape", "'turns' must be a non-empty list of strings")
        return [("user", turns[0])]
    return record_turns(record, "auto")


def _prompt_of(record: Any, system_prompt: str | None) -> Messages:
    conv = build_conversation(_turns(record), require_assistant=False, system_prompt=system_prompt)
    messages = conv.messages
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return messages


def _category(record: Any) -> str | None:
    category = record.get("category") if isinstance(record, dict) else None
    if category is None:
        return None
    if not isinstance(category, str) or not category.strip():
        raise RowRejected("wrong_shape", f"'category' must be a non-empty string, got {category!r}")
    return category.strip()


def file_prompts(path: Path, *, limit: int, system_prompt: str | None = None) -> PromptSet:
    """The prompts of a JSONL file, up to `limit`; unreadable rows are kept in `rejected` with their reason.

    The file is named as ingest names a source (`stored_name`), once, here: a name that is not UTF-8 (Linux
    allows any bytes) would otherwise put surrogates into the set's name and every prompt's id, and the report
    that holds them could not be written as JSON."""
    shown = stored_name(str(path))
    if not path.is_file():
        raise Eagle3Error(f"{shown}: no such prompt file (evaluate.prompt_files)")
    name = stored_name(path.name)
    result = PromptSet(PurePath(name).stem, [])
    for row in jsonl_rows(path, name):
        where = f"{name}:{row.location.line}"
        try:
            record = decode_record(row)
            result.prompts.append(EvalPrompt(where, _prompt_of(record, system_prompt), _category(record)))
        except RowRejected as err:
            result.rejected.append({"id": where, "reason": err.reason, "detail": err.detail})
        if len(result.prompts) == limit:
            break
    if not result.prompts:
        raise Eagle3Error(f"{shown}: no usable prompt ({result.reject_counts or 'the file is empty'})")
    return result


def encode(tokenizer: Any, messages: Messages) -> list[int]:
    """Token ids of the chat template with the generation prompt, exactly as regeneration renders prompts."""
    return generation_prompt_ids(tokenizer, messages)
