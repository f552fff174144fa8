"""FP8 hidden states with a scale per token and layer block: the error bound per element, zeros, extremes,
non-finite values refused and counted, and the bytes against bfloat16."""

from __future__ import annotations

import pytest
import torch

from eagle3_core.store.fp8 import (
    FP8,
    NonFiniteStates,
    bytes_per_token,
    dequantize,
    quantize,
    quantize_rows,
)

H = 64


def _bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Half an e4m3 step at each value's magnitude, plus half the subnormal step of its block's scale."""
    per_element_scale = scales.repeat_interleave(x.shape[1] // scales.shape[1], dim=1)
    return x.abs() / 16 + per_element_scale * 2.0**-10 + x.abs() * 1e-6


def test_every_element_comes_back_within_half_an_e4m3_step_across_a_wide_range() -> None:
    g = torch.Generator().manual_seed(0)
    # log-normal magnitudes over ten decades, random signs: in one row, values 1e-5 beside 1e5
    x = torch.randn(32, 3 * H, generator=g).sign() * torch.exp(5 * torch.randn(32, 3 * H, generator=g))
    q = quantize(x, groups=3)
    assert q.values.dtype == FP8 and q.values.shape == x.shape and q.scales.shape == (32, 3)
    back = dequantize(q.values, q.scales, torch.float32)
    assert bool(((back - x).abs() <= _bound(x, q.scales)).all())
    # each block's largest value is the top of e4m3's range, so it comes back to float32 rounding
    amax = x.view(32, 3, H).abs().amax(-1)
    got = back.view(32, 3, H).abs().amax(-1)
    assert torch.allclose(got, amax, rtol=1e-6, atol=0)


def test_each_block_has_its_own_scale() -> None:
    x = torch.ones(2, 3 * H)
    x[:, H : 2 * H] *= 1000.0  # the middle layer a thousand times larger
    q = quantize(x, groups=3)
    assert torch.allclose(q.scales, torch.tensor([[1.0, 1000.0, 1.0]] * 2) / 448)
    assert torch.equal(dequantize(q.values, q.scales, torch.float32), x)  # powers-of-two friendly: exact


def test_a_block_of_zeros_stays_zeros_with_scale_zero() -> None:
    x = torch.randn(4, 2 * H)
    x[1, :H] = 0.0
    q = quantize(x, groups=2)
    assert float(q.scales[1, 0]) == 0.0
    back = dequantize(q.values, q.scales, torch.float32)
    assert bool((back[1, :H] == 0).all()) and bool(torch.isfinite(back).all())


@pytest.mark.parametrize("magnitude", [1e-30, 1e30])
def test_huge_and_tiny_rows_keep_their_relative_precision(magnitude: float) -> None:
    x = torch.randn(8, H, generator=torch.Generator().manual_seed(1)) * magnitude
    q = quantize(x, groups=1)
    back = dequantize(q.values, q.scales, torch.float32)
    assert bool(torch.isfinite(back).all())
    assert bool(((back - x).abs() <= _bound(x, q.scales) * 1.0001).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_is_refused_and_counted(bad: float) -> None:
    x = torch.randn(4, 3 * H)
    x[2, 5] = bad
    x[3, 7] = bad
    with pytest.raises(NonFiniteStates, match="2 non-finite value") as err:
        quantize(x, groups=3)
    assert err.value.count == 2


def test_quantize_rows_counts_each_row_s_non_finite_values_and_quantises_the_others_as_quantize() -> None:
    x = (torch.randn(6, 3 * H) * 50).to(torch.bfloat16)
    x[1, 5], x[1, 2 * H + 9], x[4, 0] = float("nan"), float("inf"), float("-inf")
    q, bad = quantize_rows(x, groups=3)
    assert bad.tolist() == [0, 2, 0, 0, 1, 0] and bad.dtype == torch.int64
    finite = torch.tensor([0, 2, 3, 5])
    want = quantize(x[finite], groups=3)  # the same bytes as quantize's, row by row
    assert torch.equal(q.values[finite].view(torch.uint8), want.values.view(torch.uint8))
    assert torch.equal(q.scales[finite], want.scales)
    with pytest.raises(NonFiniteStates) as err:
        quantize(x, groups=3)
    assert err.value.count == int(bad.sum())
    assert err.value.reason == f"non-finite hidden states: {err.value}"  # the failed sample's reason


def test_bfloat16_input_and_output() -> None:
    x = torch.randn(5, 3 * H).to(torch.bfloat16)
    q = quantize(x, groups=3)
    back = dequantize(q.values, q.scales)
    assert back.dtype == torch.bfloat16
    assert bool(
        ((back.float() - x.float()).abs() <= _bound(x.float(), q.scales) + x.float().abs() / 128).all()
    )


def test_a_row_that_does_not_split_into_the_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="width 10 does not split into 3 equal blocks"):
        quantize(torch.ones(2, 10), groups=3)


@pytest.mark.parametrize("hidden", [576, 4096, 7168])
def test_a_token_takes_at_most_51_percent_of_its_bfloat16_bytes(hidden: int) -> None:
    bf16 = 2 * 4 * hidden  # three aux layers and the final state, two bytes each
    q = quantize(torch.randn(3, 3 * hidden), groups=3), quantize(torch.randn(3, hidden), groups=1)
    measured = sum(t.values[0].numel() * t.values.element_size() + t.scales[0].numel() * 4 for t in q)
    assert measured == bytes_per_token(hidden) and measured / bf16 <= 0.51
