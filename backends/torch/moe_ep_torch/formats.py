"""The spec's formats in torch, bit-exact with :mod:`moe_ep_spec.formats`, on any device.

Every rounding is exact: mxfp8 data divides by a power of two (exact) and lets
torch's round-to-nearest-even float8 cast do the rounding; the nvfp4 scale
``E4M3(amax / 6)`` rounds a float32 quotient that can never land on an E4M3
midpoint unless it is one (see docs/spec.md, Formats); nvfp4 data compares
``|x|`` with the exactly representable ``midpoint * scale`` instead of rounding
an inexact quotient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from moe_ep_spec.errors import DTypeError, FormatError, ShapeError
from moe_ep_spec.formats import E2M1_VALUES, MoeFormat, parse_format

__all__ = ["TorchBlockScaled", "quantize", "dequantize", "round_trip", "decode", "decode_weight", "from_raw", "raw"]

#: torch's E8M0 and packed-FP4 dtypes where the installed torch has them (uint8 otherwise).
E8M0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
FP4X2 = getattr(torch, "float4_e2m1fn_x2", torch.uint8)

_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
_E2M1_MIDS = (_E2M1[:-1] + _E2M1[1:]) / 2
_BLOCK = {MoeFormat.MXFP8: 32, MoeFormat.NVFP4: 16}


@dataclass(frozen=True)
class TorchBlockScaled:
    """A block-scaled tensor in torch, blocked along the LAST axis.

    Attributes:
        data: mxfp8: ``[..., n] float8_e4m3fn``; nvfp4: ``[..., ceil(n/2)]
            float4_e2m1fn_x2`` (uint8 on a torch without it): two E2M1 codes a
            byte, element ``2j`` in the low nibble.
        scale: ``[..., ceil(n/B)]``: mxfp8 ``float8_e8m0fnu`` (uint8 on a torch
            without it), nvfp4 ``float8_e4m3fn``.
        format: :class:`MoeFormat` ``MXFP8`` or ``NVFP4``.
        n: the logical extent of the last axis.
    """

    data: torch.Tensor
    scale: torch.Tensor
    format: MoeFormat
    n: int

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.data.shape[:-1]) + (self.n,)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def validate(self) -> None:
        fmt = self.format
        block = _BLOCK.get(fmt)
        if block is None:
            raise FormatError(f"TorchBlockScaled.format must be mxfp8 or nvfp4; got {fmt}")
        want_data = torch.float8_e4m3fn if fmt is MoeFormat.MXFP8 else FP4X2
        want_scale = E8M0 if fmt is MoeFormat.MXFP8 else torch.float8_e4m3fn
        if self.data.dtype != want_data or self.scale.dtype != want_scale:
            raise DTypeError(
                f"{fmt.value} data/scale must have dtypes {want_data}/{want_scale}; got {self.data.dtype}/{self.scale.dtype}"
            )
        data_n = self.n if fmt is MoeFormat.MXFP8 else -(-self.n // 2)
        lead = tuple(self.data.shape[:-1])
        if self.data.shape[-1] != data_n or tuple(self.scale.shape) != lead + (-(-self.n // block),):
            raise ShapeError(
                f"{fmt.value} data {tuple(self.data.shape)} and scale {tuple(self.scale.shape)} do not describe "
                f"a tensor with last axis {self.n} (block {block})"
            )
        if self.data.device != self.scale.device:
            raise ShapeError(f"data on {self.data.device} and scale on {self.scale.device}")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[-1]
    pad = (-n) % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _unblock(x: torch.Tensor) -> torch.Tensor:
    """``[..., nblocks, block]`` -> ``[..., nblocks * block]`` with explicit
    extents: ``reshape(..., -1)`` cannot infer a size when there are zero rows
    (a rank with T = 0, or one that receives no route)."""
    return x.reshape(tuple(x.shape[:-2]) + (x.shape[-2] * x.shape[-1],))


def _mxfp8_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Smallest e with amax <= 448 * 2^e, exactly, clamped to [-127, 127]; -127 for 0."""
    safe = torch.where(amax > 0, amax, torch.full_like(amax, 448.0))
    e = torch.ceil(torch.log2(safe / 448.0)).to(torch.int32)
    four48 = torch.full_like(safe, 448.0)
    e = torch.where(safe > torch.ldexp(four48, e.float()), e + 1, e)
    e = torch.where(safe <= torch.ldexp(four48, (e - 1).float()), e - 1, e)
    e = torch.where(safe > torch.ldexp(four48, e.float()), e + 1, e)
    e = torch.clamp(e, -127, 127)
    return torch.where(amax > 0, e, torch.full_like(e, -127))


def quantize(x: torch.Tensor, fmt: MoeFormat) -> TorchBlockScaled:
    """Encode float32 ``x`` along its last axis (mxfp8 or nvfp4), bit-exact with the spec."""
    fmt = parse_format(fmt)
    x = x.float()
    n = x.shape[-1]
    blocks = _blocks(x, _BLOCK[fmt])
    finite = torch.isfinite(blocks)
    block_bad = ~finite.all(dim=-1)
    mag = torch.where(finite, blocks.abs(), torch.zeros_like(blocks))
    amax = mag.amax(dim=-1)
    if fmt is MoeFormat.MXFP8:
        e = _mxfp8_exponent(amax)
        scaled = torch.where(finite, blocks, torch.zeros_like(blocks)) / torch.ldexp(
            torch.ones_like(amax), e.float()
        ).unsqueeze(-1)
        data = torch.clamp(scaled, -448.0, 448.0).to(torch.float8_e4m3fn)
        codes = data.view(torch.uint8)
        # -0.0 keeps its sign through the cast; NaN blocks get all-NaN codes.
        codes = torch.where(block_bad.unsqueeze(-1), torch.full_like(codes, 0x7F), codes)
        codes = _unblock(codes)[..., :n].contiguous()
        scale = torch.where(block_bad, torch.full_like(e, 0xFF), e + 127).to(torch.uint8)
        return from_raw(codes, scale, fmt, n)
    # nvfp4: scale E4M3(amax / 6), saturating at 448
    s = torch.clamp(amax / 6.0, max=448.0).to(torch.float8_e4m3fn)
    s32 = s.float().unsqueeze(-1)
    mids = _E2M1_MIDS.to(x.device)
    idx = torch.zeros(mag.shape, dtype=torch.int32, device=x.device)
    for j in range(len(mids)):
        bound = mids[j] * s32
        idx += (mag > bound).int()
        if (j + 1) % 2 == 0:
            idx += (mag == bound).int()
    idx = torch.where(s32 > 0, idx, torch.zeros_like(idx))
    codes = (idx | torch.where(torch.signbit(blocks), 8, 0)).to(torch.uint8)
    codes = _unblock(codes)[..., :n]
    if n % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)
    scale_codes = torch.where(block_bad, torch.full_like(s.view(torch.uint8), 0x7F), s.view(torch.uint8))
    return from_raw(packed.contiguous(), scale_codes, fmt, n)


def raw(t: TorchBlockScaled) -> Tuple[torch.Tensor, torch.Tensor]:
    """The data and scale codes as ``uint8`` views (what moves and what indexing
    handles on every torch)."""
    return t.data.view(torch.uint8), t.scale.view(torch.uint8)


def from_raw(data: torch.Tensor, scale: torch.Tensor, fmt: MoeFormat, n: int) -> TorchBlockScaled:
    """A TorchBlockScaled from ``uint8`` data and scale codes, in torch's dtypes."""
    if fmt is MoeFormat.MXFP8:
        return TorchBlockScaled(data.view(torch.float8_e4m3fn), scale.view(E8M0), fmt, n)
    return TorchBlockScaled(data.view(FP4X2), scale.view(torch.float8_e4m3fn), fmt, n)


def dequantize(t: TorchBlockScaled) -> torch.Tensor:
    """Decode to float32 (exact, except float32 overflow for scales near 2^127)."""
    block = _BLOCK[t.format]
    data, scale_codes = raw(t)
    if t.format is MoeFormat.MXFP8:
        vals = data.view(torch.float8_e4m3fn).float()
        codes = scale_codes.to(torch.int32)
        scale = torch.where(
            codes == 0xFF,
            torch.full(codes.shape, float("nan"), device=codes.device),
            torch.ldexp(torch.ones(codes.shape, device=codes.device), (codes - 127).float()),
        )
    else:
        lut = _E2M1.to(data.device)
        lo = data & 0xF
        hi = data >> 4
        # explicit extents: a reshape with -1 fails on zero rows (0 elements)
        nib = torch.stack([lo, hi], dim=-1).reshape(tuple(data.shape[:-1]) + (2 * data.shape[-1],))[..., : t.n].long()
        vals = lut[nib & 7] * torch.where(nib & 8 > 0, -1.0, 1.0)
        scale = scale_codes.view(torch.float8_e4m3fn).float()
    full = scale.repeat_interleave(block, dim=-1)[..., : t.n]
    return vals * full


def round_trip(x: torch.Tensor, fmt: Optional[MoeFormat]) -> torch.Tensor:
    """``dequantize(quantize(x))`` along the last axis in float32; identity for None."""
    if fmt is None:
        return x
    fmt = parse_format(fmt)
    if fmt is MoeFormat.BF16:
        return x.to(torch.bfloat16).float()
    return dequantize(quantize(x, fmt))


def decode(x: "torch.Tensor | TorchBlockScaled") -> torch.Tensor:
    """Exact float32 value of a plain tensor or a block-scaled one."""
    if isinstance(x, TorchBlockScaled):
        return dequantize(x)
    return x.float()


def decode_weight(w: "torch.Tensor | TorchBlockScaled") -> torch.Tensor:
    """An expert weight ready for the GEMMs: a block-scaled weight arrives
    transposed (``[E, N, K]`` blocked along its last axis K, the reduction axis)
    and is decoded and transposed back to ``[E, K, N]``; a plain one passes
    through unchanged (its dtype kept, so CUDA can use the bf16 GEMMs)."""
    if isinstance(w, TorchBlockScaled):
        return dequantize(w).transpose(1, 2).contiguous()
    return w
