from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.draft.vocab import (
    TENSORS_FILE,
    build_vocab_mapping,
    count_loss_tokens,
    coverage_of,
    load_vocab_mapping,
    mapping_fingerprint,
    save_vocab_mapping,
)
from eagle3_core.errors import ShardCorruptError, StaleVocabMappingError
from eagle3_core.store.layout import VOCAB_INFO_FILE
from eagle3_core.store.records import ShardFacts
from eagle3_core.store.shards import ShardReader, ShardWriter, read_header

H = 4
TOK = "a" * 64
Sample = tuple[list[int], list[int]]  # (input_ids, loss_mask)


def _write(
    path: Path, samples: list[Sample], *, tokenizer: str | None = TOK, failed: tuple[int, ...] = ()
) -> Path:
    """A shard of the given token rows (hidden states random); samples in `failed` are marked failed."""
    ids = [f"{path.stem}-{i}".ljust(64, "0") for i in range(len(samples))]
    facts = ShardFacts(tokenizer_fingerprint=tokenizer)
    with ShardWriter(
        path,
        sample_ids=ids,
        lengths=[len(s[0]) for s in samples],
        hidden_size=H,
        store_dtype="float32",
        facts=facts,
    ) as w:
        for i, (input_ids, mask) in enumerate(samples):
            if i in failed:
                w.mark_failed(i, "test")
                continue
            n = len(input_ids)
            ids_t, mask_t = torch.tensor(input_ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8)
            w.write_sample(i, ids_t, mask_t, torch.randn(n, 3 * H), torch.randn(n, H))
        w.finalize()
    return path


def _counted(samples: list[Sample], vocab: int) -> list[int]:
    """Reference count, the slow obvious way."""
    counts = [0] * vocab
    for input_ids, mask in samples:
        for t, m in zip(input_ids, mask, strict=True):
            counts[t] += m
    return counts


# Loss-masked frequencies: 5 x4, 7 x3, 2 x2, 9 x1 (10 tokens); unmasked tokens 1, 3 and extra 7s/9s.
HAND: list[Sample] = [
    ([1, 5, 5, 7, 3], [0, 1, 1, 1, 0]),
    ([5, 2, 9, 7, 7], [1, 1, 1, 1, 0]),
    ([3, 5, 2, 7, 9], [0, 1, 1, 1, 0]),
]


def test_counts_only_loss_masked_positions(tmp_path: Path) -> None:
    a = _write(tmp_path / "a-00000.safetensors", HAND)
    counts = count_loss_tokens([a], 12)
    assert counts.dtype == torch.int64 and counts.shape == (12,)
    assert counts.tolist() == _counted(HAND, 12)
    assert {i: c for i, c in enumerate(counts.tolist()) if c} == {5: 4, 7: 3, 2: 2, 9: 1}
    b = _write(tmp_path / "a-00001.safetensors", HAND[:1])
    assert count_loss_tokens([a, b], 12).tolist() == _counted(HAND + HAND[:1], 12)
    with ShardReader(a) as r:  # the cheap per-sample read agrees with the full one
        ids, mask = r.tokens(1)
        assert ids.tolist() == HAND[1][0] and mask.tolist() == HAND[1][1]
        assert ids.dtype == torch.int32 and mask.dtype == torch.uint8


def test_a_failed_sample_contributes_nothing(tmp_path: Path) -> None:
    samples: list[Sample] = [([4, 4, 6], [1, 1, 1]), ([8, 8, 8], [1, 1, 1]), ([6, 3], [1, 0])]
    path = _write(tmp_path / "a-00000.safetensors", samples, failed=(1,))
    assert count_loss_tokens([path], 10).tolist() == _counted([samples[0], samples[2]], 10)
    with ShardReader(path) as r:
        ids, mask = r.all_tokens()
    assert ids[3:6].tolist() == [0, 0, 0] and mask[3:6].tolist() == [0, 0, 0]


def test_a_failed_sample_with_loss_masked_rows_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "a-00000.safetensors", [([4, 4], [1, 1]), ([8, 8], [1, 1])], failed=(1,))
    header, data_start = read_header(path)
    raw = bytearray(path.read_bytes())
    raw[data_start + header["loss_mask"]["data_offsets"][0] + 2] = 1  # first row of the failed sample
    path.write_bytes(bytes(raw))  # the header (and its checksum) is untouched
    with pytest.raises(ShardCorruptError, match="failed sample"):
        count_loss_tokens([path], 10)


def test_top_k_ordering_ties_and_maps(tmp_path: Path) -> None:
    # 5 x4, 7 x3, 2 x2, 9 x1 plus 0 x2: K=3 must take 5 and 7, then the lower id of the 0/2 tie.
    path = _write(tmp_path / "a-00000.safetensors", [*HAND, ([0, 0], [1, 1])])
    m = build_vocab_mapping([path], 12, 3, tokenizer_fingerprint=TOK)
    assert m.draft_to_target.tolist() == [0, 5, 7]
    assert m.d2t.dtype == torch.int64 and m.d2t.tolist() == [0, 4, 5]
    assert torch.equal(torch.arange(3) + m.d2t, m.draft_to_target)
    assert m.t2d.dtype == torch.bool and m.t2d.shape == (12,)
    assert m.t2d.nonzero().flatten().tolist() == [0, 5, 7]
    assert (m.draft_vocab_size, m.target_vocab_size, m.padded) == (3, 12, 0)
    assert (m.counted_tokens, m.distinct_tokens) == (12, 5)
    assert m.coverage == pytest.approx(9 / 12)


def test_coverage_arithmetic_by_hand(tmp_path: Path) -> None:
    path = _write(tmp_path / "a-00000.safetensors", HAND)
    m = build_vocab_mapping([path], 12, 2, tokenizer_fingerprint=TOK)
    assert m.draft_to_target.tolist() == [5, 7]
    assert m.coverage == pytest.approx(7 / 10)  # (4 fives + 3 sevens) of 10 loss-masked tokens
    assert coverage_of(m, [path]) == pytest.approx(7 / 10)


def test_k_above_the_distinct_tokens_pads_deterministically(tmp_path: Path) -> None:
    path = _write(tmp_path / "a-00000.safetensors", HAND)  # distinct loss-masked ids: 2, 5, 7, 9
    m = build_vocab_mapping([path], 12, 7, tokenizer_fingerprint=TOK)
    assert m.draft_to_target.tolist() == [0, 1, 2, 3, 5, 7, 9]  # unobserved 0, 1, 3 fill in, lowest first
    assert (m.padded, m.distinct_tokens, m.coverage) == (3, 4, 1.0)
    again = build_vocab_mapping([path], 12, 7, tokenizer_fingerprint=TOK)
    assert torch.equal(again.draft_to_target, m.draft_to_target) and again.fingerprint == m.fingerprint


def test_k_is_capped_at_the_target_vocab(tmp_path: Path) -> None:
    path = _write(tmp_path / "a-00000.safetensors", [([1, 2, 2, 6], [1, 1, 1, 1])])
    m = build_vocab_mapping([path], 8, tokenizer_fingerprint=TOK)  # default K = 32000
    assert m.draft_vocab_size == 8 and m.draft_to_target.tolist() == list(range(8))
    assert m.d2t.tolist() == [0] * 8 and bool(m.t2d.all()) and m.padded == 5


def test_token_ids_outside_the_target_vocab_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "a-00000.safetensors", HAND)
    with pytest.raises(ValueError, match="outside a vocab of 9"):
        build_vocab_mapping([path], 9, 4, tokenizer_fingerprint=TOK)


def test_fingerprint_follows_data_tokenizer_and_k(tmp_path: Path) -> None:
    a = _write(tmp_path / "a-00000.safetensors", HAND)
    b = _write(tmp_path / "b-00000.safetensors", [([5, 5, 7, 2], [1, 1, 1, 1])])
    ma = build_vocab_mapping([a], 12, 3, tokenizer_fingerprint=TOK)
    mb = build_vocab_mapping([b], 12, 3, tokenizer_fingerprint=TOK)
    assert ma.draft_to_target.tolist() == mb.draft_to_target.tolist() == [2, 5, 7]  # same ids, other data
    assert ma.fingerprint != mb.fingerprint
    assert build_vocab_mapping([a], 12, 4, tokenizer_fingerprint=TOK).fingerprint != ma.fingerprint
    assert mapping_fingerprint([a], 12, 3, tokenizer_fingerprint=TOK) == ma.fingerprint  # from headers alone
    both = build_vocab_mapping([b, a], 12, 3, tokenizer_fingerprint=TOK)
    assert [key for key, _ in both.shard_set] == ["a-00000", "b-00000"]
    assert both.fingerprint == build_vocab_mapping([a, b], 12, 3, tokenizer_fingerprint=TOK).fingerprint
    # Same key, rewritten with other rows: the shard checksum changes, so does the fingerprint.
    _write(a, HAND[:2])
    assert mapping_fingerprint([a], 12, 3, tokenizer_fingerprint=TOK) != ma.fingerprint


def test_tokenizer_fingerprints_must_agree(tmp_path: Path) -> None:
    a = _write(tmp_path / "a-00000.safetensors", HAND)
    b = _write(tmp_path / "b-00000.safetensors", HAND, tokenizer="b" * 64)
    with pytest.raises(ValueError, match=r"aaaaaaaaaaaa: a-00000; bbbbbbbbbbbb: b-00000"):
        build_vocab_mapping([a, b], 12, 3, tokenizer_fingerprint=TOK)
    with pytest.raises(ValueError, match="not the expected"):
        build_vocab_mapping([b], 12, 3, tokenizer_fingerprint=TOK)
    c = _write(tmp_path / "c-00000.safetensors", HAND, tokenizer=None)
    with pytest.raises(ValueError, match="without a recorded tokenizer_fingerprint: c-00000"):
        build_vocab_mapping([c], 12, 3, tokenizer_fingerprint=TOK)
    with pytest.raises(ValueError, match="more than once"):
        build_vocab_mapping([a, a], 12, 3, tokenizer_fingerprint=TOK)


def test_coverage_on_new_data_with_unseen_tokens(tmp_path: Path) -> None:
    m = build_vocab_mapping(
        [_write(tmp_path / "a-00000.safetensors", HAND)], 12, 2, tokenizer_fingerprint=TOK
    )
    new = _write(tmp_path / "b-00000.safetensors", [([5, 11, 11, 7, 10], [1, 1, 1, 0, 1])])
    assert coverage_of(m, [new]) == pytest.approx(1 / 4)  # 5 is drafted; 11, 11, 10 are not; 7 is unmasked
    other = _write(tmp_path / "c-00000.safetensors", HAND, tokenizer="c" * 64)
    with pytest.raises(ValueError, match="tokenizer"):
        coverage_of(m, [other])


def test_save_load_round_trip_and_stale_refusal(tmp_path: Path) -> None:
    m = build_vocab_mapping(
        [_write(tmp_path / "a-00000.safetensors", HAND)], 12, 3, tokenizer_fingerprint=TOK
    )
    out = save_vocab_mapping(m, tmp_path / "mapping")
    assert sorted(p.name for p in out.iterdir()) == [VOCAB_INFO_FILE, TENSORS_FILE]  # no temporaries left
    tensors = load_file(str(out / TENSORS_FILE))  # the plain safetensors reader sees the serving tensors
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert json.loads((out / VOCAB_INFO_FILE).read_text())["fingerprint"] == m.fingerprint
    back = load_vocab_mapping(out, m.fingerprint)
    assert torch.equal(back.d2t, m.d2t) and torch.equal(back.t2d, m.t2d)
    assert torch.equal(back.draft_to_target, m.draft_to_target)
    assert back.info() == m.info() and back.shard_set == m.shard_set
    assert load_vocab_mapping(out).fingerprint == m.fingerprint  # no expectation: loads
    with pytest.raises(StaleVocabMappingError, match="expected"):
        load_vocab_mapping(out, "0" * 64)


def test_load_refuses_torn_or_inconsistent_files(tmp_path: Path) -> None:
    path = _write(tmp_path / "a-00000.safetensors", HAND)
    m = build_vocab_mapping([path], 12, 3, tokenizer_fingerprint=TOK)
    out = save_vocab_mapping(m, tmp_path / "mapping")
    info = json.loads((out / VOCAB_INFO_FILE).read_text())
    (out / VOCAB_INFO_FILE).write_text(json.dumps({**info, "fingerprint": "f" * 64}))
    with pytest.raises(StaleVocabMappingError, match="different fingerprints"):
        load_vocab_mapping(out)
    m.d2t = m.d2t + 1  # offsets that no longer give draft_to_target
    save_vocab_mapping(m, out)
    with pytest.raises(ValueError, match="d2t"):
        load_vocab_mapping(out)
