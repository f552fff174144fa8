"""Conversations: the normal form every source is turned into, sample ids, and the held-out split.

A conversation is a list of turns `(role, content)` with roles `system` (first only), `user` and
`assistant`, user and assistant alternating. Content is NFC-normalised, CRLF turned into LF and stripped at
both ends; nothing inside it changes (code keeps its indentation). The sample id is the sha256 of the
canonical JSON of the normalised turns, so the same conversation gets the same id from any source.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import unicodedata
from dataclasses import dataclass, field
from typing import Any

from eagle3_core.conventions import REJECT_REASONS

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
    turns: list[tuple[object, object]], *, require_assistant: bool, system_prompt: str | None = None
) -> Conversation:
    """Validate and normalise raw `(role, content)` pairs; raise RowRejected with the reason."""
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
        if not c:
            raise RowRejected("empty_content", f"turn {i} ({r}) is empty")
        normal.append((r, c))
    if any(r == "system" for r, _ in normal[1:]):
        raise RowRejected("wrong_shape", "a system turn may only come first")
    if system_prompt and normal[0][0] != "system":
        normal.insert(0, ("system", normalise_content(system_prompt)))
    dialogue = normal[1:] if normal[0][0] == "system" else normal
    if not dialogue or dialogue[0][0] != "user":
        raise RowRejected("wrong_shape", "the first non-system turn must be the user's")
    for i, ((r_prev, _), (r, _)) in enumerate(itertools.pairwise(dialogue)):
        if r == r_prev:
            raise RowRejected(
                "wrong_shape", f"turns {i} and {i + 1} are both {r}: user and assistant must alternate"
            )
    conv = Conversation(tuple(normal))
    if require_assistant and conv.assistant_turns == 0:
        raise RowRejected("no_assistant_turn", "no assistant turn and regeneration is off")
    return conv


def is_heldout(sample_id: str, fraction: float) -> bool:
    """A fixed split by sample id: the same conversation is held out from every source and every run."""
    return int(sample_id[:16], 16) < fraction * 2**64
