"""FP8 (e4m3) hidden states with one float32 scale per token and captured layer: half the bytes of bfloat16.

A row of states [T, groups * H] (the three aux layers side by side, or the final state alone) is split into its
`groups` blocks of H, and each block of each token is scaled by its own absolute maximum so that it spans
e4m3's whole range (largest finite value 448): `scale = amax / 448`, `q = round_e4m3(x / scale)`,
`x' = q * scale`. Per element the error is at most half a step of e4m3 at that magnitude, |x| / 16, plus half
its subnormal step, scale * 2^-10, and the block's largest value comes back exactly up to float32 rounding of the
scale. A block of zeros gets the scale 0 and comes back as zeros. NaN and inf have no FP8 representation worth
keeping (e4m3fn has no inf): a block holding one is refused (`NonFiniteStates`, with the count), so that its
sample can be marked failed with the reason rather than stored.

States are quantised from bfloat16 (`SOURCE_DTYPE`) wherever that happens, in the shard writer's threads or
on the target's device before the copy to the host (`quantize_rows`): the same function on the same values,
so both write the same bytes.

Bytes per token at hidden H with three aux layers: 4H (the states) + 16 (four scales), against 8H in bfloat16:
50.3% at H = 576, 50.05% at 4096, 50.03% at 7168.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_DTYPE = torch.float32
SOURCE_DTYPE = torch.bfloat16  # what a target hands over to be quantised, on its device or in the writer


class NonFiniteStates(ValueError):
    """A block of states to quantise holds NaN or inf; `count` is how many values."""

    def __init__(self, count: int) -> None:
        super().__init__(
            f"{count} non-finite value(s) (NaN or inf) in the hidden states; FP8 cannot store them"
        )
        self.count = count

    @property
    def reason(self) -> str:
        """The failed sample's reason in the shard header, whichever side found the values."""
        return f"non-finite hidden states: {self}"


class Quantized(NamedTuple):
    values: torch.Tensor  # [T, groups * H] float8_e4m3fn
    scales: torch.Tensor  # [T, groups] float32


def quantize(states: torch.Tensor, groups: int) -> Quantized:
    """`states` [T, groups * H] (any float dtype, any device) as FP8 with a scale per token and block."""
    x = _blocks(states, groups)
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        raise NonFiniteStates(int((~finite).sum()))
    return _scaled(x)


def quantize_rows(states: torch.Tensor, groups: int) -> tuple[Quantized, torch.Tensor]:
    """`quantize` without raising: also the count of non-finite values in each row, int64 [T] on the states'
    device, so a batch's samples are checked together in one copy to the host rather than one sync each.

    A row holding NaN or inf gets meaningless values and scales, which its caller must not store."""
    x = _blocks(states, groups)
    return _scaled(x), (~torch.isfinite(x)).flatten(1).sum(dim=1)


def _blocks(states: torch.Tensor, groups: int) -> torch.Tensor:
    """`states` [T, groups * H] as float32 blocks [T, groups, H]."""
    rows, width = states.shape
    if width % groups:
        raise ValueError(f"a row of width {width} does not split into {groups} equal blocks")
    # reshape, not view: .float() does not copy float32 input, which may be a strided slice
    return states.float().reshape(rows, groups, width // groups)


def _scaled(x: torch.Tensor) -> Quantized:
    """Blocks [T, G, H] as FP8 values [T, G * H] and their scales [T, G]: the one rounding both paths use."""
    rows, groups, width = x.shape
    amax = x.abs().amax(dim=-1, keepdim=True)  # [T, G, 1]
    scales = amax / FP8_MAX
    # a zero block divides by 1 and stays zero; the quotient is clamped as float rounding can pass 448
    scaled = (x / torch.where(scales > 0, scales, torch.ones_like(scales))).clamp(-FP8_MAX, FP8_MAX)
    return Quantized(scaled.to(FP8).view(rows, groups * width), scales.squeeze(-1).to(SCALE_DTYPE))


def dequantize(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """[T, groups * H] in `dtype` from FP8 `values` and their `scales` [T, groups], on their device."""
    rows, width = values.shape
    groups = scales.shape[-1]
    blocks = values.to(torch.float32).view(rows, groups, width // groups) * scales.float().unsqueeze(-1)
    return blocks.view(rows, width).to(dtype)


def bytes_per_token(hidden_size: int, num_aux: int = 3) -> int:
    """What one token's states take in FP8: its aux and final states, and a scale per block."""
    blocks = num_aux + 1
    return blocks * hidden_size + blocks * SCALE_DTYPE.itemsize
