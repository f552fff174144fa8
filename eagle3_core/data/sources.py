"""Reading conversation sources row by row, each row with its location and its exact raw bytes.

Sources: JSONL and Parquet files whose rows are OpenAI `messages`, ShareGPT `conversations` (`from`/`value`)
or plain `prompt` rows, and the `chitchat-dataset` package (a `.json` file is read as JSONL too). A row's raw
bytes feed the digest that pins what ingest has already consumed, so a source that changed under us is
detected, not silently re-sharded.

A file is named in the store (ledger.json, inbox.json, row sources, rejects) by `stored_name`: a name that is
not valid UTF-8 (Linux allows any bytes but "/" and NUL) is written with each undecodable byte as `\\xNN`, so
JSON can hold it, the same file gets the same name on every run, and its bytes can be read back.

A line may start with a UTF-8 byte-order mark (a file saved by a Windows editor has one on its first line,
files concatenated together one on each part's first line): it is not part of the row, and a line holding
nothing else is blank. The raw bytes keep it, so the digests of rows an earlier ingest consumed stay the same.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Any, BinaryIO

from eagle3_core.config import ChitchatSource, Eagle3Config, FileSource, SourceFormat
from eagle3_core.data.conversation import Conversation, Location, RowRejected, build_conversation
from eagle3_core.errors import ConfigError, SourceUnreadableError

CHITCHAT_NAME = "chitchat-dataset"
CHITCHAT_REQUIREMENT = "chitchat-dataset==0.9.0"  # as pyproject.toml pins it
FILE_SUFFIXES = {".jsonl", ".json", ".parquet"}
BOM = "\ufeff".encode()


@dataclass(frozen=True)
class RawRow:
    location: Location
    raw: bytes  # exactly what was read (a JSONL line without its newline, or canonical JSON of a record)
    record: Any = None  # the decoded record where the reader decodes it itself (Parquet, chitchat)


@dataclass(frozen=True)
class ResolvedSource:
    """One concrete source: a single file, or the chitchat package. Globs expand to several of these."""

    name: str  # stable across runs: the path relative to the config's directory, or "chitchat-dataset"
    spec: FileSource | ChitchatSource
    path: Path | None = None
    # The inbox's files: opened with O_NOFOLLOW, so a file swapped for a symbolic link after the inbox
    # checked it is not read either (an OSError, ELOOP, instead).
    no_follow: bool = False

    def rows(self) -> Iterator[RawRow]:
        if isinstance(self.spec, ChitchatSource):
            return _chitchat_rows(self.spec.limit)
        assert self.path is not None
        if self.path.suffix == ".parquet":
            return _parquet_rows(self.path, self.name, self.no_follow)
        return jsonl_rows(self.path, self.name, self.no_follow)


def resolve_sources(cfg: Eagle3Config) -> list[ResolvedSource]:
    """Expand globs (sorted, so new files come in a stable order) and check every file exists."""
    out: list[ResolvedSource] = []
    named: dict[str, Path] = {}
    for index, spec in enumerate(cfg.data.sources):
        if isinstance(spec, ChitchatSource):
            # refused before any row is read (an image whose packages were installed --no-deps)
            if importlib.util.find_spec("chitchat_dataset") is None:
                raise SourceUnreadableError(
                    f"data.sources[{index}]: kind chitchat reads the {CHITCHAT_NAME} package, which is not "
                    f"installed: pip install {CHITCHAT_REQUIREMENT}"
                )
            out.append(ResolvedSource(CHITCHAT_NAME, spec))
            continue
        pattern = str(cfg.resolve(spec.path))
        matches = sorted(Path(p) for p in glob(pattern))
        if not matches:
            raise FileNotFoundError(f"data.sources: {spec.path!r} matches no file (looked for {pattern})")
        for p in matches:
            name = _relative_name(p, cfg.root)
            if p.suffix not in FILE_SUFFIXES:
                raise ConfigError(
                    f"data.sources[{index}].path: {spec.path!r} matches {name}, which is not a .jsonl, .json "
                    "or .parquet file; narrow the pattern to the conversation files"
                )
            _check_name_unique(named, name, p)
            out.append(ResolvedSource(name, spec, p))
    return out


def _relative_name(path: Path, root: Path) -> str:
    try:
        return stored_name(str(path.resolve().relative_to(root.resolve())))
    except ValueError:
        return stored_name(str(path.resolve()))


def stored_name(name: str) -> str:
    """A file name as the store records it: itself when it is valid UTF-8; else its bytes as the system gave
    them (`os.fsencode` undoes Python's surrogate escapes), each byte that does not decode written `\\xNN` and
    each backslash doubled, so the escape reads back to the exact bytes. The surrogate-escaped str Python gives
    for such a name cannot be written as UTF-8 JSON at all: the ledger, inbox.json and every row naming the
    file would fail to save, on every run."""
    raw = os.fsencode(name)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.replace(b"\\", b"\\\\").decode("utf-8", errors="backslashreplace")


def _check_name_unique(named: dict[str, Path], name: str, path: Path) -> None:
    """Two files whose stored names are alike (a UTF-8 name with a literal `\\xNN` beside the file whose byte
    that is) would share one ledger entry: refused, naming both. One file matched by two globs is no clash."""
    other = named.setdefault(name, path)
    if other.resolve() != path.resolve():
        raise ConfigError(
            f"data.sources: {name} would name two files, whose bytes are {os.fsencode(other)!r} and "
            f"{os.fsencode(path)!r}; rename one of them"
        )


def open_binary(path: Path, no_follow: bool = False) -> BinaryIO:
    """`path` opened for reading bytes; with `no_follow`, a symbolic link is refused (OSError, ELOOP)."""
    if not no_follow:
        return open(path, "rb")
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")


def jsonl_rows(path: Path, name: str, no_follow: bool = False) -> Iterator[RawRow]:
    with open_binary(path, no_follow) as f:
        for number, line in enumerate(f, start=1):
            raw = line.rstrip(b"\r\n")
            if raw.removeprefix(BOM).strip():
                yield RawRow(Location(name, number), raw)


def _parquet_rows(path: Path, name: str, no_follow: bool) -> Iterator[RawRow]:
    number = 0
    with open_binary(path, no_follow) as f:
        for records in _parquet_records(f, name):
            for record in records:
                number += 1
                raw = json.dumps(record, ensure_ascii=False, sort_keys=True, default=str).encode("utf-8")
                yield RawRow(Location(name, number), raw, record)


def _parquet_records(f: BinaryIO, name: str) -> Iterator[list[Any]]:
    """The file's rows as Python records, a batch at a time; what pyarrow cannot decode is a
    SourceUnreadableError naming the file (`_undecodable`)."""
    import pyarrow.parquet as pq

    with _undecodable(name):
        batches = pq.ParquetFile(f).iter_batches(batch_size=1024)
    while True:
        with _undecodable(name):
            batch = next(batches, None)
            records = None if batch is None else batch.to_pylist()
        if records is None:
            return
        yield records


@contextmanager
def _undecodable(name: str) -> Iterator[None]:
    """A file pyarrow cannot decode raises whatever the failing layer raises: ArrowInvalid (a ValueError) for
    a truncated file, a bare OSError for a corrupt page, ArrowNotImplementedError or ArrowTypeError for what
    it does not support, OverflowError for a duration past Python's range, KeyError for a time zone this
    machine does not know. Each is the file's fault, and is told as one: one line naming it, which the inbox
    records as a refusal and `eagle3 ingest` prints. An OSError with an errno is the system's (a read that
    failed), and a MemoryError the machine's: neither says anything of the file, so both go on as they are."""
    from pyarrow.lib import ArrowException

    try:
        yield
    except MemoryError:
        raise
    except OSError as err:
        if err.errno is not None:
            raise
        raise _unreadable(name, err) from err
    except (ArrowException, ValueError, TypeError, LookupError, ArithmeticError) as err:
        raise _unreadable(name, err) from err


def _unreadable(name: str, err: Exception) -> SourceUnreadableError:
    said = " ".join(str(err).split())  # on one line: pyarrow's messages may span several
    return SourceUnreadableError(f"{name}: not readable as Parquet ({type(err).__name__}: {said})")


def _chitchat_rows(limit: int | None) -> Iterator[RawRow]:
    import chitchat_dataset

    data = chitchat_dataset.Dataset()
    for number, (key, conv) in enumerate(data.items(), start=1):
        if limit is not None and number > limit:
            return
        raw = json.dumps({"id": key, **conv}, ensure_ascii=False, sort_keys=True).encode("utf-8")
        yield RawRow(Location(f"{CHITCHAT_NAME}:{key}", number), raw, conv)


def chitchat_turns(conv: dict[str, Any]) -> list[tuple[object, object]]:
    """A chitchat conversation is groups of utterances by alternating senders; the first sender is the user."""
    groups = conv.get("messages")
    if not isinstance(groups, list) or not groups:
        raise RowRejected("wrong_shape", "chitchat record without messages")
    first_sender = groups[0][0].get("sender") if groups[0] else None
    turns: list[tuple[object, object]] = []
    for group in groups:
        if not group:
            raise RowRejected("empty_content", "an empty message group")
        role = "user" if group[0].get("sender") == first_sender else "assistant"
        turns.append((role, "\n".join(str(u.get("text", "")) for u in group)))
    return turns


def decode_record(row: RawRow) -> Any:
    if row.record is not None:
        return row.record
    try:
        text = row.raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RowRejected("invalid_utf8", f"byte {err.start}: {err.reason}") from None
    try:
        # The byte-order mark goes as the utf-8-sig codec drops it, but after decoding, so that an invalid
        # byte's offset above counts from the start of the line.
        return json.loads(text.removeprefix("\ufeff"))
    except json.JSONDecodeError as err:
        raise RowRejected("malformed_json", f"column {err.colno}: {err.msg}") from None
    except RecursionError:
        # json's parser recurses once per nested array or object: one row of 100,000 "[" would otherwise stop
        # the whole file (and, in the inbox, every tick at that file)
        raise RowRejected(
            "malformed_json", "arrays or objects nested too deeply for Python's JSON parser"
        ) from None


def record_turns(record: Any, fmt: SourceFormat) -> list[tuple[object, object]]:
    """The (role, content) pairs of a decoded record, in the given format (or the one its keys show)."""
    if not isinstance(record, dict):
        raise RowRejected("wrong_shape", f"a row must be a JSON object, got {type(record).__name__}")
    if fmt == "auto":
        fmt = _detect_format(record)
    if fmt == "messages":
        return _pairs(record.get("messages"), "messages", "role", "content")
    if fmt == "sharegpt":
        return _pairs(record.get("conversations"), "conversations", "from", "value")
    prompt = record.get("prompt")
    if not isinstance(prompt, str):
        raise RowRejected("wrong_shape", "'prompt' must be a string")
    system = record.get("system")
    turns: list[tuple[object, object]] = (
        [("system", system)] if isinstance(system, str) and system.strip() else []
    )
    return [*turns, ("user", prompt)]


def _detect_format(record: dict[str, Any]) -> SourceFormat:
    for key, fmt in (("messages", "messages"), ("conversations", "sharegpt"), ("prompt", "prompt")):
        if key in record:
            return fmt  # type: ignore[return-value]
    raise RowRejected(
        "wrong_shape", f"no 'messages', 'conversations' or 'prompt' field (keys: {sorted(record)[:8]})"
    )


def _pairs(turns: Any, field: str, role_key: str, content_key: str) -> list[tuple[object, object]]:
    if not isinstance(turns, list):
        raise RowRejected("wrong_shape", f"'{field}' must be a list")
    out: list[tuple[object, object]] = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise RowRejected(
                "wrong_shape", f"{field}[{i}] must be an object with '{role_key}' and '{content_key}'"
            )
        out.append((turn[role_key], _text_content(turn[content_key], i)))
    return out


def _text_content(content: Any, index: int) -> object:
    """OpenAI content may be a list of parts; only text parts are accepted."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise RowRejected("wrong_shape", f"turn {index}: only text content parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def parse_row(
    row: RawRow, source: ResolvedSource, *, require_assistant: bool, system_prompt: str | None
) -> Conversation:
    """One raw row to a normalised conversation, cut before an empty turn (`Conversation.dropped` says so);
    raises RowRejected naming the reason."""
    record = decode_record(row)
    if isinstance(source.spec, ChitchatSource):
        turns = chitchat_turns(record)
    else:
        turns = record_turns(record, source.spec.format)
    return build_conversation(
        turns, require_assistant=require_assistant, system_prompt=system_prompt, keep_before_empty=True
    )
