"""FP8 shards (extract.store_dtype fp8_e4m3): states and their scales stored, read back dequantised within the
FP8 bound, a corrupted scale found by verify, NaN refused per sample, half the bytes of bfloat16, and the
training loader's copy as stored or dequantised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_core.store.fp8 import FP8, quantize
from eagle3_core.store.records import ShardFacts
from eagle3_core.store.shards import ShardCorruptError, ShardReader, ShardWriter, read_header
from eagle3_core.store.stats import verify_shard

H = 64


def _samples(lengths: list[int], seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32),
            torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8),
            torch.randn(n, 3 * H, generator=g) * torch.tensor([1.0, 30.0, 900.0]).repeat_interleave(H),
            torch.randn(n, H, generator=g),
        )
        for n in lengths
    ]


def _write(path: Path, data: list[tuple[torch.Tensor, ...]], dtype: str = "fp8_e4m3") -> None:
    lengths = [len(d[0]) for d in data]
    with ShardWriter(
        path, sample_ids=[f"{i:064x}" for i in range(len(data))], lengths=lengths, hidden_size=H,
        store_dtype=dtype, facts=ShardFacts(aux_layer_ids=[2, 4, 5]),
    ) as w:  # fmt: skip
        for i, d in enumerate(data):
            w.write_sample(i, *d)
        w.finalize()


def _within_fp8(got: torch.Tensor, want: torch.Tensor, groups: int) -> bool:
    blocks = want.view(want.shape[0], groups, -1)
    scale = blocks.abs().amax(-1, keepdim=True) / 448
    bound = blocks.abs() / 16 + scale * 2.0**-10 + blocks.abs() / 128  # + bfloat16's rounding of the result
    return bool(((got.float().view_as(blocks) - blocks).abs() <= bound).all())


def test_an_fp8_shard_reads_back_within_the_fp8_bound_and_verifies(tmp_path: Path) -> None:
    path = tmp_path / "t-00000.safetensors"
    data = _samples([7, 3, 11])
    _write(path, data)
    tensors = load_file(str(path))  # the reference safetensors reader takes FP8 too
    assert tensors["aux_hidden_states"].dtype == FP8 and tensors["aux_scales"].shape == (21, 3)
    assert tensors["last_scales"].shape == (21, 1)
    with ShardReader(path) as r:
        assert r.verify() == []
        for i, (ids, mask, aux, last) in enumerate(data):
            s = r.sample(i)
            assert torch.equal(s.input_ids, ids) and torch.equal(s.loss_mask, mask)
            assert s.aux_hidden_states.dtype == torch.bfloat16
            assert _within_fp8(s.aux_hidden_states, aux, 3) and _within_fp8(s.last_hidden_states, last, 1)


def test_a_token_s_states_take_at_most_51_percent_of_their_bfloat16_bytes(tmp_path: Path) -> None:
    data = _samples([200, 300])
    _write(tmp_path / "fp8.safetensors", data)
    _write(tmp_path / "bf16.safetensors", data, "bfloat16")
    states = ("aux_hidden_states", "last_hidden_states", "aux_scales", "last_scales")

    def state_bytes(name: str) -> int:
        header, _ = read_header(tmp_path / f"{name}.safetensors")
        return sum(header[t]["data_offsets"][1] - header[t]["data_offsets"][0] for t in states if t in header)

    assert state_bytes("fp8") == 500 * (4 * H + 16) and state_bytes("bf16") == 500 * 2 * 4 * H
    assert state_bytes("fp8") / state_bytes("bf16") <= 0.51 + 16 / (8 * H)  # the scales weigh more at H = 64


def test_a_corrupted_scale_is_found_by_verify_and_refused_by_the_reader(tmp_path: Path) -> None:
    path = tmp_path / "t-00000.safetensors"
    _write(path, _samples([5, 6]))
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    scales_end = len(raw) - 11 * 4  # last_scales [11, 1] float32 end the file; aux_scales [11, 3] before them
    raw[scales_end - 5] ^= 0x40  # a byte of the last token's third aux scale
    path.write_bytes(bytes(raw))
    assert 8 + header_len < scales_end - 5
    assert not verify_shard(path).ok
    with pytest.raises(ShardCorruptError, match="fails its checksum"), ShardReader(path) as r:
        r.sample(1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_sample_with_a_non_finite_state_is_failed_with_the_reason(tmp_path: Path, bad: float) -> None:
    path = tmp_path / "t-00000.safetensors"
    data = _samples([4, 5, 6])
    data[1][2][3, 7] = bad
    _write(path, data)
    with ShardReader(path) as r:
        assert r.sample_ids == [f"{0:064x}", f"{2:064x}"] and r.verify() == []
        assert r.meta.failed == {f"{1:064x}": "non-finite hidden states: 1 non-finite value(s) (NaN or inf) "
                                 "in the hidden states; FP8 cannot store them"}  # fmt: skip


def test_the_loader_copies_fp8_as_stored_or_dequantised(tmp_path: Path) -> None:
    path = tmp_path / "t-00000.safetensors"
    data = _samples([6])
    _write(path, data)
    with ShardReader(path) as r:
        want = r.sample(0)
        stored = {
            "input_ids": torch.empty(4, dtype=torch.int32),
            "loss_mask": torch.empty(4, dtype=torch.uint8),
            "aux_hidden_states": torch.empty(4, 3 * H, dtype=FP8),
            "last_hidden_states": torch.empty(4, H, dtype=FP8),
            "aux_scales": torch.empty(4, 3),
            "last_scales": torch.empty(4, 1),
        }
        r.copy_sample_into(0, stored)  # a cut to 4 rows
        as_bf16 = {
            "input_ids": torch.empty(6, dtype=torch.int32),
            "loss_mask": torch.empty(6, dtype=torch.uint8),
            "aux_hidden_states": torch.empty(6, 3 * H, dtype=torch.bfloat16),
            "last_hidden_states": torch.empty(6, H, dtype=torch.bfloat16),
        }
        r.copy_sample_into(0, as_bf16)
    assert torch.equal(as_bf16["aux_hidden_states"], want.aux_hidden_states)
    assert torch.equal(as_bf16["last_hidden_states"], want.last_hidden_states)
    assert torch.equal(stored["input_ids"], data[0][0][:4])
    scales = stored["aux_scales"].repeat_interleave(H, dim=1)
    back = (stored["aux_hidden_states"].float() * scales).to(torch.bfloat16)
    assert torch.equal(back, want.aux_hidden_states[:4])


def _writer(path: Path, lengths: list[int], dtype: str = "fp8_e4m3") -> ShardWriter:
    return ShardWriter(
        path, sample_ids=[f"{i:064x}" for i in range(len(lengths))], lengths=lengths, hidden_size=H,
        store_dtype=dtype, facts=ShardFacts(aux_layer_ids=[2, 4, 5]),
    )  # fmt: skip


def test_pre_quantised_states_are_written_as_the_writer_would_quantise_them(tmp_path: Path) -> None:
    data = _samples([7, 3, 11])
    _write(tmp_path / "writer.safetensors", data)
    with _writer(tmp_path / "given.safetensors", [7, 3, 11]) as w:
        for i, (ids, mask, aux, last) in enumerate(data):
            a, z = quantize(aux, 3), quantize(last, 1)
            w.write_sample(i, ids, mask, a.values, z.values, aux_scales=a.scales, last_scales=z.scales)
        w.finalize()
    assert (tmp_path / "given.safetensors").read_bytes() == (tmp_path / "writer.safetensors").read_bytes()


def _bad_cases() -> dict[str, tuple[dict[str, torch.Tensor | None], str]]:
    _, _, aux, last = _samples([5])[0]
    a, z = quantize(aux, 3), quantize(last, 1)
    good: dict[str, torch.Tensor | None] = {
        "aux": a.values, "last": z.values, "aux_scales": a.scales, "last_scales": z.scales,
    }  # fmt: skip
    return {
        "bfloat16 states": (
            {**good, "aux": aux.bfloat16()},
            "must be torch.float8_e4m3fn, got aux torch.bfloat16",
        ),
        "last scales [T]": (
            {**good, "last_scales": z.scales[:, 0]},
            r"last_scales must be .*\(5, 1\), got .*\(5,\)",
        ),
        "aux scales [T, 1]": ({**good, "aux_scales": a.scales[:, :1]}, r"aux_scales must be .*\(5, 3\)"),
        "float64 scales": ({**good, "aux_scales": a.scales.double()}, "aux_scales must be torch.float32"),
        "no last scales": ({**good, "last_scales": None}, "last_scales must be .*, got none"),
        "FP8 without scales": ({**good, "aux_scales": None, "last_scales": None}, "aux_scales must be"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_pre_quantised_states_of_the_wrong_dtype_or_scale_shape_are_refused_naming_the_sample(
    tmp_path: Path, case: str
) -> None:
    given, message = _bad_cases()[case]
    ids, mask = _samples([5])[0][:2]
    with _writer(tmp_path / "t.safetensors", [3, 5]) as w:
        with pytest.raises(ValueError, match=rf"sample 1 \(000000000000\).*{message}"):
            w.write_sample(
                1, ids, mask, given["aux"], given["last"],
                aux_scales=given["aux_scales"], last_scales=given["last_scales"],
            )  # fmt: skip
        assert w.digests == [None, None]  # nothing of it was written
        w.abort()


def test_pre_quantised_states_are_refused_by_a_shard_that_stores_no_scales(tmp_path: Path) -> None:
    ids, mask, aux, last = _samples([4])[0]
    a, z = quantize(aux, 3), quantize(last, 1)
    with _writer(tmp_path / "t.safetensors", [4], "bfloat16") as w:
        with pytest.raises(ValueError, match=r"sample 0 \(000000000000\): .* given to a bfloat16 shard"):
            w.write_sample(0, ids, mask, a.values, z.values, aux_scales=a.scales, last_scales=z.scales)
        w.abort()
