"""Chat-template tokenisation with an assistant-only loss mask, and truncation that is counted.

A conversation is rendered once with the tokenizer's own chat template and tokenised once. Which characters
of that render carry loss is found from the template itself, never from hard-coded header strings: for
assistant turn `i`, the render of `messages[:i]` with the generation prompt is exactly what the target sees
before it starts answering, so it must be a prefix of the full render; what follows it, up to the end of the
`messages[:i+1]` render, is what the target produces for that turn: the content, then template text.

Masked characters, per assistant turn: from the start of the content through the end of the first
end-of-turn text after it (the target generates everything in between and stops on end-of-turn). Template
formatting after the end-of-turn (ChatML's trailing newline) is not generated, so it is not masked.

Characters to tokens: a token is masked iff its *last* character is masked, i.e. the character at
`end_offset - 1`. The end offset is the one a byte-level tokenizer reports the same way whether or not its
post-processor trims offsets: trimming moves the start of a token with a leading space past that space and
collapses a lone space token to zero width at the position *after* the space, so a start-offset rule would
mask the space that ends a generation prompt such as "Assistant: " (when trimmed) or miss the first content
token " I" that straddles it (when not). The last-character rule masks " I" (the target emits it) and not
the prompt's space, under both settings. The pieces of one multi-byte character share its offsets, so they
are masked together.

Arrays: `input_ids` is int32 and `loss_mask` uint8 (0/1), the dtypes of the shard file; both are read-only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from eagle3_core.config import TokenizeConfig
from eagle3_core.data.conversation import Conversation
from eagle3_core.errors import Eagle3Error, TargetError
from eagle3_core.store.atomic import json_object

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers prefers it to tokenizer_config.json's chat_template
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
TOKENIZER_FILE = "tokenizer.json"  # the fast tokenizer itself: ChatTokenizer needs one
# The JSON files of a tokenizer that transformers reads whole with json.load wherever they exist
TOKENIZER_JSON_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, "special_tokens_map.json", "added_tokens.json")
# Far above any real tokenizer file (Gemma 3's tokenizer.json, among the largest, is 33 MB): what is larger is
# refused unread, as transformers would hold all of it, and its parse, in memory
MAX_TOKENIZER_FILE_BYTES = 256 << 20

IdArray = npt.NDArray[np.int32]
MaskArray = npt.NDArray[np.uint8]
Span = tuple[int, int]


class TemplateError(Eagle3Error, ValueError):
    """The chat template does not render a conversation the way the loss mask needs; names the turn."""


@dataclass(frozen=True, eq=False)
class TokenizedSample:
    """One conversation as token ids and an assistant-only loss mask, after truncation.

    `eq=False`: numpy arrays have no single truth value, so samples compare by identity.
    """

    sample_id: str
    input_ids: IdArray
    loss_mask: MaskArray
    truncated_tokens: int  # tokens cut off the end by truncation (0 if none)
    truncated_loss_tokens: int = 0  # of those, tokens that carried loss

    def __post_init__(self) -> None:
        if self.input_ids.shape != self.loss_mask.shape or self.input_ids.ndim != 1:
            raise ValueError(
                f"{self.sample_id}: input_ids {self.input_ids.shape} and loss_mask {self.loss_mask.shape} "
                "must be 1-D and of one length"
            )
        self.input_ids.flags.writeable = False
        self.loss_mask.flags.writeable = False

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def truncated(self) -> bool:
        return self.truncated_tokens > 0


@dataclass(frozen=True)
class TokenizeCounts:
    """What tokenisation produced and what truncation lost; summed over samples, batches and shards."""

    samples: int = 0
    tokens: int = 0  # kept, after truncation
    loss_tokens: int = 0  # kept, after truncation
    truncated_samples: int = 0
    truncated_tokens: int = 0  # lost to truncation
    truncated_loss_tokens: int = 0  # lost to truncation and carrying loss
    no_loss_samples: int = 0  # no loss token left (no assistant turn, or all of it cut)

    @classmethod
    def of(cls, samples: Iterable[TokenizedSample]) -> TokenizeCounts:
        total = cls()
        for s in samples:
            total += cls(
                samples=1,
                tokens=s.length,
                loss_tokens=s.loss_tokens,
                truncated_samples=int(s.truncated),
                truncated_tokens=s.truncated_tokens,
                truncated_loss_tokens=s.truncated_loss_tokens,
                no_loss_samples=int(s.loss_tokens == 0),
            )
        return total

    def __add__(self, other: TokenizeCounts) -> TokenizeCounts:
        return TokenizeCounts(**{k: v + getattr(other, k) for k, v in self.as_dict().items()})

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class RenderedConversation:
    """A conversation rendered by the template, with the character spans that carry loss (sorted)."""

    sample_id: str
    text: str
    spans: tuple[Span, ...]


class ChatTokenizer:
    """Wraps a Hugging Face fast tokenizer that has a chat template.

    `end_of_turn` is the text that ends an assistant turn (Llama-3 instruct `<|eot_id|>`, ChatML
    `<|im_end|>`); by default the tokenizer's eos token. A base Llama-3 tokenizer's eos is
    `<|end_of_text|>`, which its template never writes after a turn: set `end_of_turn` there.
    """

    def __init__(self, tokenizer: Any, *, max_seq_len: int, end_of_turn: str | None = None) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError("a fast (Rust) tokenizer is needed: the loss mask is mapped through its offsets")
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("the tokenizer has no chat_template")
        eot = end_of_turn or tokenizer.eos_token
        if not eot:
            raise TemplateError(
                "no end-of-turn text: the tokenizer has no eos_token; set tokenize.end_of_turn"
            )
        if max_seq_len <= 0:
            raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.end_of_turn: str = eot

    @classmethod
    def from_config(cls, tokenizer: Any, config: TokenizeConfig) -> ChatTokenizer:
        return cls(tokenizer, max_seq_len=config.max_seq_len, end_of_turn=config.end_of_turn)

    def tokenize(self, conv: Conversation) -> TokenizedSample:
        return self.tokenize_many([conv])[0]

    def tokenize_many(self, convs: Sequence[Conversation]) -> list[TokenizedSample]:
        """Render every conversation, then tokenise all renders in one call (the Rust side batches)."""
        rendered = [self.render(c) for c in convs]
        if not rendered:
            return []
        enc = self.tokenizer(
            [r.text for r in rendered], add_special_tokens=False, return_offsets_mapping=True
        )
        return [
            self._sample(r, ids, offsets)
            for r, ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"], strict=True)
        ]

    def tokenize_batch(self, convs: Sequence[Conversation]) -> tuple[list[TokenizedSample], TokenizeCounts]:
        samples = self.tokenize_many(convs)
        return samples, TokenizeCounts.of(samples)

    def render(self, conv: Conversation) -> RenderedConversation:
        """The full render and its masked character spans; raises TemplateError naming the turn."""
        messages = conv.messages
        text = self._apply(messages, generation_prompt=False)
        spans = tuple(
            self._assistant_span(conv.sample_id, messages, i, text)
            for i, (role, _) in enumerate(conv.turns)
            if role == "assistant"
        )
        return RenderedConversation(conv.sample_id, text, spans)

    def _assistant_span(self, sample_id: str, messages: list[dict[str, str]], i: int, full: str) -> Span:
        where = f"{sample_id[:12]}: assistant turn {i}"
        if i == 0:
            raise TemplateError(f"{where}: no prompt before it, nothing to render a generation prompt from")
        prompt = self._apply(messages[:i], generation_prompt=True)
        if not full.startswith(prompt):
            raise TemplateError(
                f"{where}: the generation prompt render of the {i} turn(s) before it is not a prefix of the "
                f"full render (they differ from character {_first_difference(prompt, full)}); "
                "the template renders history differently from a live prompt"
            )
        upto = self._apply(messages[: i + 1], generation_prompt=False)
        if not full.startswith(upto):
            raise TemplateError(f"{where}: the render up to this turn is not a prefix of the full render")
        start, content = len(prompt), messages[i]["content"]
        if not full.startswith(content, start, len(upto)):
            raise TemplateError(
                f"{where}: the content does not follow the generation prompt "
                f"(found {full[start : start + 40]!r}); the template adds or changes text before it"
            )
        eot = full.find(self.end_of_turn, start + len(content), len(upto))
        if eot < 0:
            raise TemplateError(
                f"{where}: end-of-turn {self.end_of_turn!r} not found after the content "
                f"(turn suffix {full[start + len(content) : len(upto)]!r}); set tokenize.end_of_turn"
            )
        return start, eot + len(self.end_of_turn)

    def _apply(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise TemplateError(
                f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str"
            )
        return text

    def _sample(
        self, r: RenderedConversation, ids: Sequence[int], offsets: Sequence[tuple[int, int]]
    ) -> TokenizedSample:
        input_ids = np.asarray(ids, dtype=np.int32)
        mask = mask_from_offsets(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), r.spans)
        keep = self.max_seq_len
        return TokenizedSample(
            sample_id=r.sample_id,
            input_ids=input_ids[:keep].copy(),
            loss_mask=mask[:keep].copy(),
            truncated_tokens=max(0, len(input_ids) - keep),
            truncated_loss_tokens=int(mask[keep:].sum()),
        )


def mask_from_offsets(offsets: npt.NDArray[np.int64], spans: Sequence[Span]) -> MaskArray:
    """1 for each token whose last character (`end - 1`) lies in one of the sorted, disjoint spans."""
    if not spans:
        return np.zeros(len(offsets), dtype=np.uint8)
    starts = np.fromiter((s for s, _ in spans), dtype=np.int64, count=len(spans))
    ends = np.fromiter((e for _, e in spans), dtype=np.int64, count=len(spans))
    last = offsets[:, 1] - 1
    # The span that starts at or before each token's last character, if any, then whether it reaches it.
    idx = np.searchsorted(starts, last, side="right") - 1
    inside = (idx >= 0) & (last < ends[np.maximum(idx, 0)])
    return inside.astype(np.uint8)


def _first_difference(a: str, b: str) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def generation_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` in the chat template with the generation prompt: what the target answers.

    Regeneration and evaluation both render prompts here, so a drafter is measured on the prompts its
    training replies were generated from.
    """
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_tokenizer_files(model_dir: Path) -> None:
    """Refuse, in one TargetError naming the file, a tokenizer transformers cannot load: no tokenizer.json, or
    one of its JSON files (TOKENIZER_JSON_FILES) that is not a regular file, is larger than
    MAX_TOKENIZER_FILE_BYTES, or is not UTF-8, not JSON, nested too deeply for Python's parser, or not an
    object. transformers reads each whole and says none of this: a missing tokenizer.json is a request to
    install sentencepiece, a truncated one a JSONDecodeError, a nested one a RecursionError, all tracebacks, and
    a link to /dev/zero it reads until memory runs out."""
    if not os.path.lexists(model_dir / TOKENIZER_FILE):
        raise TargetError(
            f"{model_dir}: no {TOKENIZER_FILE}; eagle3 needs the target's fast tokenizer (a slow tokenizer's "
            f"files are not converted here: save the tokenizer with save_pretrained, which writes {TOKENIZER_FILE})"
        )
    for name in TOKENIZER_JSON_FILES:
        path = model_dir / name
        if os.path.lexists(path):
            _tokenizer_json(path)


def _tokenizer_json(path: Path) -> dict[str, Any]:
    return json_object(_read_bounded(path), path, TargetError)


def _read_bounded(path: Path) -> bytes:
    """The bytes of a tokenizer file: a regular file of at most MAX_TOKENIZER_FILE_BYTES, else TargetError.
    What is not a regular file (a device such as /dev/zero, a FIFO, a directory, a broken link) is not opened,
    and no more than the limit is read of a file that grows past it."""
    if not path.is_file():
        raise TargetError(f"{path}: not a regular file{_link_target(path)}")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKENIZER_FILE_BYTES + 1)
    except OSError as e:
        raise TargetError(f"{path}: cannot be read ({e.strerror or type(e).__name__})") from None
    if len(raw) > MAX_TOKENIZER_FILE_BYTES:
        raise TargetError(
            f"{path}: larger than {MAX_TOKENIZER_FILE_BYTES} bytes, far more than a tokenizer file holds"
        )
    return raw


def _link_target(path: Path) -> str:
    try:
        return f" (a link to {os.readlink(path)})" if path.is_symlink() else ""
    except OSError:  # replaced since: the refusal stands, without the target
        return ""


def check_chat_template(model_dir: Path) -> None:
    """Compile the target's chat templates the way transformers does, so that a syntax error names its file
    and line now: transformers reads the text without parsing it and fails at the first render, mid-run,
    naming neither. A directory with no template passes: ChatTokenizer refuses it where one is needed."""
    for where, text in _chat_templates(model_dir):
        _compile_template(where, text)


def _chat_templates(model_dir: Path) -> list[tuple[str, str]]:
    """(where, template text) for each template the tokenizer would load from `model_dir`."""
    jinja = model_dir / CHAT_TEMPLATE_FILE
    if os.path.lexists(jinja):
        try:
            return [(str(jinja), _read_bounded(jinja).decode("utf-8"))]
        except UnicodeDecodeError as e:
            raise TargetError(f"{jinja}: not UTF-8 text ({e.reason} at byte {e.start})") from e
    path = model_dir / TOKENIZER_CONFIG_FILE
    if not os.path.lexists(path):
        return []
    template = _tokenizer_json(path).get("chat_template")
    where = f"{path} field chat_template"
    if isinstance(template, str):
        return [(where, template)]
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        return [
            (f"{where} ({t.get('name')!r})", str(t.get("template", "")))
            for t in template
            if isinstance(t, dict)
        ]
    return []


def _compile_template(where: str, text: str) -> None:
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        lines = text.splitlines()
        line = lines[e.lineno - 1].strip() if 0 < e.lineno <= len(lines) else ""
        shown = f": {line[:80]}{' ...' if len(line) > 80 else ''}" if line else ""
        message = " ".join(e.message.split()) if e.message else "syntax error"
        raise TargetError(f"{where}: Jinja syntax error at line {e.lineno}{shown} ({message})") from e
