"""Conversations: the normal form every source is turned into, sample ids, and the held-out split.

A conversation is a list of turns `(role, content)` with roles `system` (first only), `user` and
`assistant`, user and assistant alternating. Content is NFC-normalised, CRLF turned into LF and stripped at
both ends; nothing inside it changes (code keeps its indentation). The sample id is the sha256 of the
canonical JSON of the normalised turns, so the same conversation gets the same id from any source.

A turn empty once normalised ends what ingest keeps of a conversation (`keep_before_empty`): the complete
exchanges before it are a sample (with regeneration on, a last user turn too: the target answers it), and the
turns from it on are dropped, counted under `EMPTY_CONTENT_TRUNCATED`. A conversation with nothing to keep
before its empty turn is rejected as `empty_content`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from eagle3_core.conventions import REJECT_REASONS

# Not a reject reason: the row is a sample, cut before its first empty turn; the rejects file keeps the row
# under this name, and the shard's manifest counts it under `truncated`.
EMPTY_CONTENT_TRUNCATED = "empty_content_truncated"

ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
}


class RowRejected(ValueError):
    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Location:
    """Where a row came from: a file (or package resource) and its 1-based record number."""

    file: str
    line: int

    def as_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line}


@dataclass(frozen=True)
class Conversation:
    turns: tuple[tuple[str, str], ...]
    dropped: str | None = None  # what was cut after the turns kept (an empty turn and those after it)
    sample_id: str = field(init=False)

    def __post_init__(self) -> None:
        canonical = json.dumps([list(t) for t in self.turns], ensure_ascii=False, separators=(",", ":"))
        object.__setattr__(self, "sample_id", hashlib.sha256(canonical.encode("utf-8")).hexdigest())

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.turns]

    @property
    def assistant_turns(self) -> int:
        return sum(1 for r, _ in self.turns if r == "assistant")


def normalise_content(text: str) -> str:
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n")).strip()


def normalise_role(role: object) -> str:
    if not isinstance(role, str):
        raise RowRejected("wrong_shape", f"role must be a string, got {type(role).__name__}")
    key = role.strip().lower()
    if key not in ROLE_ALIASES:
        raise RowRejected("unknown_role", f"unknown role {role!r}")
    return ROLE_ALIASES[key]


def build_conversation(
    turns: list[tuple[object, object]],
    *,
    require_assistant: bool,
    system_prompt: str | None = None,
    keep_before_empty: bool = False,
) -> Conversation:
    """Validate and normalise raw `(role, content)` pairs; raise RowRejected with the reason. An empty turn
    rejects the whole conversation, or with `keep_before_empty` ends it (the module's docstring says how)."""
    if not turns:
        raise RowRejected("wrong_shape", "no turns")
    normal: list[tuple[str, str]] = []
    for i, (role, content) in enumerate(turns):
        r = normalise_role(role)
        if not isinstance(content, str):
            raise RowRejected(
                "wrong_shape", f"turn {i}: content must be a string, got {type(content).__name__}"
            )
        c = normalise_content(content)
        if not c and not keep_before_empty:
            raise RowRejected("empty_content", f"turn {i} ({r}) is empty")
        normal.append((r, c))
    _check_order(normal)
    dropped = None
    empty = next((i for i, (_, c) in enumerate(normal) if not c), None)
    if empty is not None:
        normal, dropped = _before_empty(normal, empty, require_assistant)
    if system_prompt and normal[0][0] != "system":
        normal.insert(0, ("system", normalise_content(system_prompt)))
    conv = Conversation(tuple(normal), dropped)
    if require_assistant and conv.assistant_turns == 0:
        raise RowRejected("no_assistant_turn", "no assistant turn and regeneration is off")
    return conv


def _check_order(normal: list[tuple[str, str]]) -> None:
    """A system turn first if any, then user and assistant alternating from the user's: over every turn, the
    empty ones too, so a row whose shape is wrong is `wrong_shape` wherever its empty turn is."""
    if any(r == "system" for r, _ in normal[1:]):
        raise RowRejected("wrong_shape", "a system turn may only come first")
    dialogue = normal[1:] if normal[0][0] == "system" else normal
    if not dialogue or dialogue[0][0] != "user":
        raise RowRejected("wrong_shape", "the first non-system turn must be the user's")
    for i, ((r_prev, _), (r, _)) in enumerate(itertools.pairwise(dialogue)):
        if r == r_prev:
            raise RowRejected(
                "wrong_shape", f"turns {i} and {i + 1} are both {r}: user and assistant must alternate"
            )


def _before_empty(
    normal: list[tuple[str, str]], empty: int, require_assistant: bool
) -> tuple[list[tuple[str, str]], str]:
    """The complete exchanges before turn `empty` and what was dropped; RowRejected when none is complete.

    Without regeneration an exchange is a user turn and its reply, so a user turn left last is dropped too;
    with it, the assistant turns are the target's to write, and a user turn is an exchange to regenerate."""
    kept = normal[:empty]
    if require_assistant and kept and kept[-1][0] == "user":
        kept = kept[:-1]
    needed = "assistant" if require_assistant else "user"
    role = normal[empty][0]
    if not any(r == needed for r, _ in kept):
        before = (
            ", and no complete exchange comes before it"
            if any(r != "system" for r, _ in normal[:empty])
            else ""
        )
        raise RowRejected("empty_content", f"turn {empty} ({role}) is empty{before}")
    last = len(normal) - 1
    cut = f"turn {last}" if len(kept) == last else f"turns {len(kept)}-{last}"
    return kept, f"turn {empty} ({role}) is empty: {cut} of {last + 1} dropped"


def is_heldout(sample_id: str, fraction: float) -> bool:
    """A fixed split by sample id: the same conversation is held out from every source and every run."""
    return int(sample_id[:16], 16) < fraction * 2**64
