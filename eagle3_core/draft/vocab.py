"""The draft vocabulary: the K most frequent loss-masked target token ids, and the maps between the two vocabs.

Conventions (those SGLang and vLLM load): `draft_to_target` holds the K selected target ids in ascending order;
`d2t[i] = draft_to_target[i] - i` is an int64 offset, so `target_id = i + d2t[i]`; `t2d` is a bool mask over
the target vocabulary, True where the id has a draft row.

A drafter's `lm_head` rows are bound to its mapping, so a mapping must never be rebuilt or swapped silently
(SpecForge PR #534, speculators PR #1081, SpecForge #602). Every mapping carries a fingerprint of the tokenizer,
the exact shards it was counted from (key and whole-shard checksum), K and the target vocab size;
`load_vocab_mapping` refuses a mapping whose fingerprint is not the one expected.

Counting reads only the `input_ids` and `loss_mask` tensors of each shard (a few bytes per token, against
kilobytes of hidden states per token). Those rows are not digest-checked: a sample's digest covers all four
of its tensors, so checking it would mean reading the hidden states too. `eagle3 verify` checks everything.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors.torch import load, save

from eagle3_core.errors import RecordError, StaleVocabMappingError
from eagle3_core.store.atomic import atomic_open
from eagle3_core.store.layout import VOCAB_INFO_FILE
from eagle3_core.store.records import VocabInfo, validation_message
from eagle3_core.store.shards import ShardReader, read_shard_header

SCHEMA = "eagle3.vocab_mapping/1"
DEFAULT_DRAFT_VOCAB_SIZE = 32000
TENSORS_FILE = "vocab_mapping.safetensors"


@dataclass
class VocabMapping:
    draft_to_target: torch.Tensor  # int64 [K], ascending target ids
    d2t: torch.Tensor  # int64 [K], target_id = i + d2t[i]
    t2d: torch.Tensor  # bool [target_vocab_size]
    target_vocab_size: int
    draft_vocab_size: int
    fingerprint: str
    coverage: float  # share of the counted loss-masked tokens whose id is in the draft vocab
    tokenizer_fingerprint: str
    shard_set: list[tuple[str, str]]  # (shard key, whole-shard checksum), sorted
    counted_tokens: int
    distinct_tokens: int
    padded: int  # ids selected beyond the observed ones (zero frequency), when K > distinct_tokens

    def info(self) -> VocabInfo:
        """Everything but the tensors."""
        return VocabInfo(
            schema=SCHEMA,
            fingerprint=self.fingerprint,
            tokenizer_fingerprint=self.tokenizer_fingerprint,
            target_vocab_size=self.target_vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            coverage=self.coverage,
            counted_tokens=self.counted_tokens,
            distinct_tokens=self.distinct_tokens,
            padded=self.padded,
            shard_set=self.shard_set,
        )


# ---- shard headers ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _ShardInfo:
    path: Path
    key: str
    checksum: str
    tokenizer_fingerprint: str | None


def _shard_infos(shard_paths: Sequence[Path]) -> list[_ShardInfo]:
    """Header facts of every shard, sorted by key; duplicate keys are refused (they would count twice)."""
    if not shard_paths:
        raise ValueError("no shards given: a vocab mapping needs at least one hidden-state shard")
    infos = []
    for path in shard_paths:
        meta = read_shard_header(Path(path))
        infos.append(_ShardInfo(Path(path), Path(path).stem, meta.checksum, meta.tokenizer_fingerprint))
    keys = [i.key for i in infos]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"shard keys given more than once: {', '.join(duplicates)}")
    return sorted(infos, key=lambda i: i.key)


def _common_tokenizer(infos: list[_ShardInfo]) -> str:
    """The one tokenizer fingerprint all shards share; a mixture, or a shard without one, is an error."""
    missing = [i.key for i in infos if not i.tokenizer_fingerprint]
    if missing:
        raise ValueError(f"shards without a recorded tokenizer_fingerprint: {', '.join(missing)}")
    groups: dict[str, list[str]] = {}
    for info in infos:
        groups.setdefault(str(info.tokenizer_fingerprint), []).append(info.key)
    if len(groups) > 1:
        detail = "; ".join(f"{fp[:12]}: {', '.join(keys)}" for fp, keys in sorted(groups.items()))
        raise ValueError(f"shards must share one tokenizer fingerprint, found {detail}")
    return next(iter(groups))


def _fingerprint(
    tokenizer_fingerprint: str, shard_set: list[tuple[str, str]], k: int, target_vocab_size: int
) -> str:
    blob = json.dumps(
        {
            "schema": SCHEMA,
            "tokenizer_fingerprint": tokenizer_fingerprint,
            "shards": [list(pair) for pair in shard_set],
            "draft_vocab_size": k,
            "target_vocab_size": target_vocab_size,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def _checked_tokenizer(infos: list[_ShardInfo], tokenizer_fingerprint: str) -> None:
    found = _common_tokenizer(infos)
    if found != tokenizer_fingerprint:
        raise ValueError(
            f"the shards were extracted with tokenizer {found[:12]}, not the expected {tokenizer_fingerprint[:12]}"
        )


def mapping_fingerprint(
    shard_paths: Sequence[Path],
    target_vocab_size: int,
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    *,
    tokenizer_fingerprint: str,
) -> str:
    """The fingerprint `build_vocab_mapping` would give, from the shard headers alone (no counting).

    This is the `expected_fingerprint` to pass to `load_vocab_mapping` before reusing a saved mapping.
    """
    infos = _shard_infos(shard_paths)
    _checked_tokenizer(infos, tokenizer_fingerprint)
    k = min(draft_vocab_size, target_vocab_size)
    return _fingerprint(tokenizer_fingerprint, [(i.key, i.checksum) for i in infos], k, target_vocab_size)


# ---- counting --------------------------------------------------------------------------------------------
def _count_shard(path: Path, vocab_size: int) -> torch.Tensor:
    with ShardReader(path) as reader:
        input_ids, loss_mask = reader.all_tokens()
    ids = input_ids[loss_mask.bool()].long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(
            f"{path}: loss-masked token ids span [{int(ids.min())}, {int(ids.max())}], outside a vocab of "
            f"{vocab_size}: the shard was not made with this target's tokenizer"
        )
    return torch.bincount(ids, minlength=vocab_size)


def count_loss_tokens(shard_paths: Sequence[Path], vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: how often each token id sits at a loss-masked position, over all shards."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in shard_paths:
        counts += _count_shard(Path(path), vocab_size)
    return counts


def _top_k(counts: torch.Tensor, k: int) -> torch.Tensor:
    """The k most frequent ids; ties go to the lower id, so unobserved ids pad in ascending order."""
    # A stable descending sort keeps equal counts in id order: deterministic on every platform.
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:k].sort().values


def _coverage(counts: torch.Tensor, selected: torch.Tensor) -> float:
    total = int(counts.sum())
    if total == 0:
        raise ValueError("the shards hold no loss-masked tokens: coverage is undefined")
    return int(counts[selected].sum()) / total


# ---- building --------------------------------------------------------------------------------------------
def _maps(draft_to_target: torch.Tensor, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = draft_to_target - torch.arange(draft_to_target.numel(), dtype=torch.int64)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    return d2t, t2d


def build_vocab_mapping(
    shard_paths: Sequence[Path],
    target_vocab_size: int,
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB_SIZE,
    *,
    tokenizer_fingerprint: str,
) -> VocabMapping:
    """Top-K loss-masked ids of the shards, K = min(draft_vocab_size, target_vocab_size).

    When the data holds fewer than K distinct ids (SpecForge #76) the rest is filled with unobserved ids in
    ascending order instead of failing; `padded` says how many.
    """
    if draft_vocab_size <= 0 or target_vocab_size <= 0:
        raise ValueError(
            f"vocab sizes must be positive (draft {draft_vocab_size}, target {target_vocab_size})"
        )
    infos = _shard_infos(shard_paths)
    _checked_tokenizer(infos, tokenizer_fingerprint)
    k = min(draft_vocab_size, target_vocab_size)
    counts = count_loss_tokens([i.path for i in infos], target_vocab_size)
    draft_to_target = _top_k(counts, k)
    d2t, t2d = _maps(draft_to_target, target_vocab_size)
    shard_set = [(i.key, i.checksum) for i in infos]
    distinct = int((counts > 0).sum())
    return VocabMapping(
        draft_to_target=draft_to_target,
        d2t=d2t,
        t2d=t2d,
        target_vocab_size=target_vocab_size,
        draft_vocab_size=k,
        fingerprint=_fingerprint(tokenizer_fingerprint, shard_set, k, target_vocab_size),
        coverage=_coverage(counts, draft_to_target),
        tokenizer_fingerprint=tokenizer_fingerprint,
        shard_set=shard_set,
        counted_tokens=int(counts.sum()),
        distinct_tokens=distinct,
        padded=max(0, k - distinct),
    )


def coverage_of(mapping: VocabMapping, shard_paths: Sequence[Path]) -> float:
    """Share of the shards' loss-masked tokens that the mapping's draft vocab holds: is reuse safe?"""
    _checked_tokenizer(_shard_infos(shard_paths), mapping.tokenizer_fingerprint)
    counts = count_loss_tokens(shard_paths, mapping.target_vocab_size)
    return _coverage(counts, mapping.draft_to_target)


# ---- saving and loading ----------------------------------------------------------------------------------
def save_vocab_mapping(mapping: VocabMapping, directory: Path) -> Path:
    """Write vocab_mapping.safetensors, then vocab_mapping.json, each atomically; returns the directory.

    The safetensors metadata carries the full info too, so it is the file of record; the JSON is for
    people and tools, and `load_vocab_mapping` refuses a pair whose fingerprints disagree (a torn save).
    """
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {"d2t": mapping.d2t, "t2d": mapping.t2d, "draft_to_target": mapping.draft_to_target}
    info = mapping.info()
    metadata = {"schema": SCHEMA, "fingerprint": mapping.fingerprint, "info": json.dumps(info.dump())}
    with atomic_open(directory / TENSORS_FILE, "wb") as f:
        f.write(save({n: t.contiguous() for n, t in tensors.items()}, metadata=metadata))
    info.write(directory / VOCAB_INFO_FILE)
    return directory


def _read_files(directory: Path) -> tuple[dict[str, torch.Tensor], VocabInfo]:
    blob = (directory / TENSORS_FILE).read_bytes()
    tensors = load(blob)
    header_len = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8 : 8 + header_len]).get("__metadata__", {})
    if metadata.get("schema") != SCHEMA:
        raise ValueError(
            f"{directory / TENSORS_FILE}: not a vocab mapping (schema {metadata.get('schema')!r})"
        )
    try:
        info = VocabInfo.model_validate(json.loads(metadata["info"]))
    except ValidationError as err:
        raise RecordError(validation_message(directory / TENSORS_FILE, err)) from None
    if VocabInfo.read(directory / VOCAB_INFO_FILE).fingerprint != info.fingerprint:
        raise StaleVocabMappingError(
            f"{directory}: {VOCAB_INFO_FILE} and {TENSORS_FILE} carry different fingerprints (an interrupted save?); "
            "rebuild the vocab mapping"
        )
    return tensors, info


def _inconsistency(mapping: VocabMapping) -> str | None:
    """What is wrong with a loaded mapping's tensors or fingerprint, or None."""
    k, v = mapping.draft_vocab_size, mapping.target_vocab_size
    d2t, t2d, dtt = mapping.d2t, mapping.t2d, mapping.draft_to_target
    if d2t.dtype != torch.int64 or dtt.dtype != torch.int64 or t2d.dtype != torch.bool:
        return f"dtypes d2t {d2t.dtype}, draft_to_target {dtt.dtype}, t2d {t2d.dtype}"
    if d2t.shape != (k,) or dtt.shape != (k,) or t2d.shape != (v,):
        return f"shapes d2t {tuple(d2t.shape)}, draft_to_target {tuple(dtt.shape)}, t2d {tuple(t2d.shape)}"
    if not bool((dtt[1:] > dtt[:-1]).all()) or int(dtt[0]) < 0 or int(dtt[-1]) >= v:
        return "draft_to_target is not strictly ascending within the target vocab"
    if not torch.equal(torch.arange(k) + d2t, dtt):
        return "d2t + arange(K) != draft_to_target"
    if int(t2d.sum()) != k or not bool(t2d[dtt].all()):
        return "t2d does not mark exactly the draft_to_target ids"
    # The fingerprint must be the one its own recorded inputs give, or an edited file could pass as current.
    if mapping.fingerprint != _fingerprint(mapping.tokenizer_fingerprint, mapping.shard_set, k, v):
        return "the fingerprint does not match the recorded tokenizer, shards and sizes"
    return None


def load_vocab_mapping(directory: Path, expected_fingerprint: str | None = None) -> VocabMapping:
    """Load a saved mapping, refusing it when its fingerprint is not `expected_fingerprint` (if given).

    Pass the fingerprint of the data and tokenizer being trained on (`mapping_fingerprint`), or that stored
    with the drafter being fine-tuned: a stale mapping silently misaligns every lm_head row.
    """
    tensors, info = _read_files(directory)
    if expected_fingerprint is not None and info.fingerprint != expected_fingerprint:
        raise StaleVocabMappingError(
            f"{directory}: the vocab mapping was built for fingerprint {info.fingerprint[:12]}, expected "
            f"{expected_fingerprint[:12]} (different tokenizer, shards or K); rebuild it, or train anew"
        )
    mapping = VocabMapping(
        draft_to_target=tensors["draft_to_target"],
        d2t=tensors["d2t"],
        t2d=tensors["t2d"],
        target_vocab_size=info.target_vocab_size,
        draft_vocab_size=info.draft_vocab_size,
        fingerprint=info.fingerprint,
        coverage=info.coverage,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
        shard_set=info.shard_set,
        counted_tokens=info.counted_tokens,
        distinct_tokens=info.distinct_tokens,
        padded=info.padded,
    )
    problem = _inconsistency(mapping)
    if problem:
        raise ValueError(f"{directory}: inconsistent vocab mapping ({problem}); rebuild it")
    return mapping
