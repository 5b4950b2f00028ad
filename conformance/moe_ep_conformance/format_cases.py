"""Format conformance: every encode point and every input decode, code for code.

The main table compares decoded values against a budget, which admits both
neighbours wherever a result may land on a rounding tie and cannot tell +0
from -0. The cases here build inputs, through the public forward API, whose
exact result at one encode point is known by construction, so the reference's
budget there is 0 and a conforming backend must produce the reference's codes
exactly: bf16 bits (+0 and -0 distinct), block scale codes and data codes (an
mxfp8 block with the NaN scale must have every data code 0x7F; an nvfp4 NaN
block's data codes are unspecified and not looked at).

How the exact values are made (H = 64, I = 32, ``intermediate_format`` bf16,
router weights 1, no clamp):

* token ``t``'s activation is the one-hot row ``e_t``, so FC1 is exact and
  ``c = fc1_weight[e][t]``: the stash ``fc1_c`` is the bf16 rounding of a chosen
  float32 row (cases ``stash``, ``decode_act`` with an identity FC1,
  ``decode_fc1``);
* the chosen FC1 row is ``g = 4`` and ``u = target / silu(4)`` (float32), so
  ``w * h`` is ``target`` within 2^-23 relative, and the intermediate rounding
  lands on a known code whenever ``target`` lies 2^-10 (relative) away from
  every rounding boundary (case ``intermediate``); with ``target = e_t`` the FC2
  operand is exactly the one-hot ``e_t``, so the route output is exactly
  ``fc2_weight[e][t]``, any chosen float32 row (cases ``output``, ``combine``,
  ``decode_fc2``);
* K = 1, or K = 2 with two terms that fit 24 bits together: the slot sum is
  exact in float32 whatever the order (``moe_ep_spec.tolerance.exact_reduction``).

Case ids: ``formats[backend-ep1-POINT-FORMAT-VALUES]``, e.g.
``formats[reference-ep1-output-bf16-ties]``. Every case checks itself: it fails
with a "case construction" message (a suite bug) if the reference's budget is
not 0 wherever the reference result is finite.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from moe_ep_spec import BlockScaledTensor, MoeEpConfig, MoeFormat, RankInputs
from moe_ep_spec.formats import BF16, FLOAT8_E4M3, FLOAT8_E8M0

from .checks import Check, _exact_ints, _expect_array, _kind

__all__ = ["FORMAT_POINTS", "FormatCase", "format_cases", "check_format_case", "HIDDEN", "INTERMEDIATE"]

HIDDEN = 64
INTERMEDIATE = 32
_SILU4 = 4.0 / (1.0 + np.exp(-4.0))

#: Encode points and what they observe: point -> (observed result, description).
FORMAT_POINTS: Dict[str, str] = {
    "output": "the output encode of an exact slot sum",
    "combine": "the per-route combine round trip of an exact expert output",
    "intermediate": "the FC2-operand rounding R_int of w*h placed 2^-10 away from every boundary",
    "stash": "the bf16 stash fc1_c of an exact FC1 output",
    "decode_act": "the decode of a block-scaled activation (seen through an identity FC1 in fc1_c)",
    "decode_fc1": "the decode of a block-scaled fc1_weight (seen through one-hot tokens in fc1_c)",
    "decode_fc2": "the decode of a block-scaled fc2_weight (seen through a one-hot FC2 operand in the output)",
}


# ----------------------------------------------------------------------------- value designs
# Every design returns the chosen values; the row count is the number of tokens.


def _pow2(k: int) -> float:
    return float(2.0**k)


def _bf16_tie_pairs() -> List[Tuple[float, float]]:
    """Pairs (a, b) of bf16 values whose exact sum is a bf16 rounding tie (or an
    edge): ties to even, the binade step, overflow to inf, x + (-x) = +0."""
    base = [
        (1.0, _pow2(-8)),  # 1 + 2^-8: tie, even code is 1.0
        (1.0, 3 * _pow2(-8)),  # tie, rounds up to 1 + 2^-6
        (-1.0, -_pow2(-8)),  # -1.0
        (1.0 + _pow2(-7), _pow2(-8)),  # odd lower neighbour: up
        (2.0 - _pow2(-7), _pow2(-8)),  # tie at the binade step: 2.0
        (1.0, -_pow2(-9)),  # 1 - 2^-9: tie below 1, even code is 1.0
        (0.5, _pow2(-9)),
        (1.0, _pow2(-8) + _pow2(-16)),  # just above the tie: up
        (1.0, -1.0),  # +0
        (-_pow2(-130), _pow2(-130)),  # +0
    ]
    out = []
    for k in (0, 37, -60, 100, -117):
        out += [(a * _pow2(k), b * _pow2(k)) for a, b in base]
    big = (2.0 - _pow2(-7)) * _pow2(127)
    out += [(big, _pow2(119)), (-big, -_pow2(119)), (big, _pow2(118))]  # tie to 2^128: inf; just below: finite
    return out


def _output_bf16_ties() -> Tuple[np.ndarray, np.ndarray]:
    pairs = _bf16_tie_pairs()
    a = np.zeros((len(pairs) // 2 + 1, HIDDEN))
    b = np.zeros_like(a)
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    for n, (x, y) in enumerate(pairs):
        flat_a[n * 31 % flat_a.size], flat_b[n * 31 % flat_a.size] = x, y
    return a, b


def _mxfp8_block(k: int, rng: np.random.Generator, top: float) -> np.ndarray:
    """32 values at scale 2^k: E4M3 ties, subnormal ties, signed tiny values that
    round to zero, and ``top`` (the block maximum, times 2^k)."""
    ties = [1.0625, 1.1875, 8.5, 9.5, 272.0, 1.5 * 2**-9, 0.5 * 2**-9, 2.5 * 2**-9, 3.5 * 2**-9, 0.25 * 2**-9]
    vals = ties + [-v for v in ties] + [448.0, 1.0, 3.0, 0.0, 13.0, -0.75, 1.25 * 2**-9, -1.75 * 2**-9, 100.0, -200.0, 0.1, 0.2]
    vals = np.array(vals[:32]) * _pow2(k)
    vals = vals[rng.permutation(32)]
    vals[int(rng.integers(0, 32))] = top * (1 if rng.random() < 0.5 else -1)
    return vals


def _combine_mxfp8(rows: int = 16) -> np.ndarray:
    """Expert outputs (float32) through the mxfp8 combine: block 0 has maximum
    exactly 448 * 2^k (scale 2^k), block 1 one float32 ulp above (scale 2^(k+1));
    elements on E4M3 ties at those scales. Rows of tiny blocks give E8M0 code 0."""
    rng = np.random.default_rng(1)
    out = np.zeros((rows, HIDDEN))
    for r in range(rows):
        k = int(rng.integers(-20, 20))
        out[r, :32] = _mxfp8_block(k, rng, 448.0 * _pow2(k))
        above = float(np.nextafter(np.float32(448.0 * _pow2(k)), np.float32(np.inf)))
        blk = _mxfp8_block(k + 1, rng, 1.0)  # ties at scale 2^(k+1); the scale 2^k would round them otherwise
        blk[np.argmax(np.abs(blk))] = above
        out[r, 32:] = blk
    # Tiny blocks: scale clamped to 2^-127 (code 0), subnormal E4M3 codes, values that round to -0.
    out[-1, :8] = [2.0**-134, -(2.0**-134), 3 * 2.0**-134, 5 * 2.0**-134, 7 * 2.0**-134, -(2.0**-136), 2.0**-140, -(2.0**-140)]
    out[-1, 8:32] = 0.0
    return out.astype(np.float32).astype(np.float64)


_E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def _nvfp4_block(scale: float, amax: float, rng: np.random.Generator) -> np.ndarray:
    vals = [t * scale for t in _E2M1_TIES] + [-t * scale for t in _E2M1_TIES] + [0.0]
    vals = np.array(vals[:15] + [amax])
    vals = vals[rng.permutation(16)]
    return vals


def _nvfp4_values(rows: int = 8) -> np.ndarray:
    """Blocks whose maximum is 6 times an E4M3 midpoint (the scale is a tie), a
    subnormal-scale tie, a scale that rounds to zero (block zeroed), saturation
    at 448 (amax / 6 = 464 and above); elements on E2M1 ties at the scale."""
    rng = np.random.default_rng(2)
    designs = [  # (scale the tie rounds to, block maximum)
        (1.0, 6 * 1.0625),  # 1.0625 between 1.0 (even) and 1.125: 1.0
        (1.25, 6 * 1.1875),  # 1.1875 between 1.125 and 1.25 (even): 1.25
        (2.0**-8, 6 * 1.5 * 2**-9),  # subnormal E4M3 tie: code 2
        (2.0**-9, 6 * 2.5 * 2**-9),  # subnormal tie 2.5 * 2^-9: code 2 (even)
        (0.0, 6 * 2.0**-10),  # amax / 6 = 2^-10: rounds to the zero scale, block zeroed
        (448.0, 6 * 464.0),  # the tie above 448 saturates to 448
        (448.0, 3072.0),
        (0.5, 6 * 0.53125),  # 0.53125 between 0.5 (even) and 0.5625: 0.5
        (16.0, 6 * 17.0),  # 17 between 16 (even) and 18
        (0.75, 6 * 0.78125),  # between 0.75 (code 0x36, even) and 0.8125
    ]
    out = np.zeros((rows, HIDDEN))
    n = 0
    for r in range(rows):
        for b in range(HIDDEN // 16):
            scale, amax = designs[n % len(designs)]
            n += 1
            out[r, 16 * b : 16 * b + 16] = _nvfp4_block(scale if scale else 2.0**-12, amax, rng)
    return out


def _bf16_exact(v: np.ndarray) -> np.ndarray:
    """Only the values that are bf16 numbers are kept (others become 0): the
    output cases go through a bf16 combine round trip, which must be exact."""
    v = np.asarray(v, dtype=np.float64)
    return np.where(v.astype(np.float32).astype(BF16).astype(np.float64) == v, v, 0.0)


def _output_mxfp8() -> Tuple[np.ndarray, np.ndarray]:
    """Slot 0: bf16 blocks with maximum 448 * 2^k, 451.5 * 2^k, E4M3 ties; slot 1:
    2^(k-15) on the maximum of some blocks, so that the exact sum is one float32
    ulp above 448 * 2^k (scale 2^(k+1))."""
    rng = np.random.default_rng(3)
    a = np.zeros((12, HIDDEN))
    b = np.zeros_like(a)
    for r in range(12):
        k = int(rng.integers(-30, 30))
        a[r, :32] = _bf16_exact(_mxfp8_block(k, rng, 448.0 * _pow2(k)))
        blk = _bf16_exact(_mxfp8_block(k + 1, rng, 448.0 * _pow2(k)))
        top = int(np.argmax(np.abs(blk)))
        if r % 2:
            b[r, 32 + top] = np.sign(blk[top]) * _pow2(k - 15)
        else:
            blk[top] = np.sign(blk[top]) * 451.5 * _pow2(k)  # the next bf16 above 448 * 2^k
        a[r, 32:] = blk
    a[-1, 40] = np.inf  # a non-finite block: scale 0xFF, every data code 0x7F
    return a, b


def _intermediate(fmt: str) -> np.ndarray:
    """Targets of w*h (``[T, I]``): 2^-10 (relative) above or below the ties of the
    format, block maxima 2^-10 away from scale boundaries."""
    rng = np.random.default_rng(4)
    rows = 8
    out = np.zeros((rows, INTERMEDIATE))
    for r in range(rows):
        side = 1.0 + (2.0**-10 if r % 2 else -(2.0**-10))
        if fmt == "bf16":
            k = int(rng.integers(-20, 20))
            out[r] = [(1.0 + (2 * j + 1) * 2.0**-8) * side * _pow2(k) * (-1) ** j for j in range(INTERMEDIATE)]
        elif fmt == "mxfp8":
            k = int(rng.integers(-20, 20))
            blk = _mxfp8_block(k, rng, 1.0) * np.where(np.arange(32) % 3 == 0, side, 1 / side)
            top = int(np.argmax(np.abs(blk)))
            blk[top] = np.sign(blk[top]) * 448.0 * _pow2(k) * side  # 2^-10 above or below the scale boundary
            out[r] = blk
        else:
            for b in range(INTERMEDIATE // 16):
                scale = [1.0, 1.25, 2.0**-8, 0.5][(r + b) % 4]
                blk = _nvfp4_block(scale, 6 * 1.0625 * scale, rng)
                out[r, 16 * b : 16 * b + 16] = blk * np.where(np.arange(16) % 2 == 0, side, 1 / side)
    return out


def _stash_ties() -> np.ndarray:
    """FC1 rows (float32) whose bf16 stash is a tie or an edge: ties to even,
    overflow to inf at (2 - 2^-8) * 2^127, subnormal ties, -0 for tiny negatives."""
    vals = [
        1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 1 - 2.0**-9, 1 + 2.0**-8 + 2.0**-23, 2 - 2.0**-8,
        (2 - 2.0**-8) * 2.0**127, -(2 - 2.0**-8) * 2.0**127, (2 - 2.0**-8 - 2.0**-16) * 2.0**127,
        2.0**-134, -(2.0**-134), 3 * 2.0**-134, 5 * 2.0**-134, -(2.0**-140), 2.0**-126 * (1 + 2.0**-8), -0.0, 0.0,
        (1 + 2.0**-8) * 2.0**-100, (1 + 3 * 2.0**-8) * 2.0**60, 1.5 * 2.0**-133, -(1 + 2.0**-8) * 2.0**90,
    ]
    out = np.zeros((8, 2 * INTERMEDIATE))
    flat = out.reshape(-1)
    for n in range(flat.size):
        flat[n] = vals[n % len(vals)] * (1 if (n // len(vals)) % 2 == 0 else -1)
    return out.astype(np.float32).astype(np.float64)


# ----------------------------------------------------------------------------- designed codes


def _mxfp8_codes(shape: Tuple[int, ...], axis: int, special: Sequence[int], rng: np.random.Generator) -> BlockScaledTensor:
    """A block-scaled mxfp8 tensor from designed codes: finite scale codes from
    2^-127 to 2^119 (values stay below float32's limit) and every data code; the
    lines ``special`` (index along the non-blocked last axis, or the first axis
    for activations) carry a NaN scale, a NaN data code, 2^127 scales with data
    below 2 (finite) and at 2 or more (beyond float32: +-inf)."""
    data = rng.integers(0, 256, size=shape).astype(np.uint8)
    data[(data & 0x7F) == 0x7F] = 0x3C  # NaN data codes only where designed
    scale_shape = BlockScaledTensor.scale_shape_for("mxfp8", shape, axis)
    finite_scales = np.array([0x00, 0x01, 0x10, 0x70, 0x7F, 0x85, 0xA0, 0xF6], np.uint8)
    scale = finite_scales[rng.integers(0, len(finite_scales), size=scale_shape)]
    line_axis = 0 if axis == 1 and len(shape) == 2 else len(shape) - 1
    for n, line in enumerate(special):
        sel_d = [slice(None)] * len(shape)
        sel_d[line_axis] = line
        sel_s = list(sel_d)
        kind = n % 4
        if kind == 0:
            scale[tuple(sel_s)] = 0xFF  # NaN scale: the block decodes to NaN
        elif kind == 1:
            idx = list(sel_d)
            idx[axis] = 3
            data[tuple(idx)] = 0x7F  # a NaN data code: that element decodes to NaN
        elif kind == 2:
            scale[tuple(sel_s)] = 0xFE  # 2^127
            data[tuple(sel_d)] &= 0xBF  # magnitudes below 2: finite
        else:
            scale[tuple(sel_s)] = 0xFE
            data[tuple(sel_d)] |= 0x40  # magnitudes 2 and above: beyond float32, +-inf
            data[(data & 0x7F) == 0x7F] = 0x7E
    return BlockScaledTensor(data.view(FLOAT8_E4M3), scale.view(FLOAT8_E8M0), MoeFormat.MXFP8, shape, axis=axis)


def _nvfp4_codes(shape: Tuple[int, ...], axis: int, special: Sequence[int], rng: np.random.Generator) -> BlockScaledTensor:
    """A block-scaled nvfp4 tensor from designed codes: every nibble (-0 included)
    and E4M3 scales that are zero, subnormal, 1, 448 and negative; the lines
    ``special`` carry the NaN scale codes 0x7F and 0xFF."""
    nib = rng.integers(0, 16, size=shape).astype(np.uint8)
    scale_shape = BlockScaledTensor.scale_shape_for("nvfp4", shape, axis)
    scales = np.array([0x00, 0x01, 0x07, 0x08, 0x38, 0x7E, 0xB8, 0x86, 0x3A, 0x50], np.uint8)
    scale = scales[rng.integers(0, len(scales), size=scale_shape)]
    line_axis = 0 if axis == 1 and len(shape) == 2 else len(shape) - 1
    for n, line in enumerate(special):
        sel = [slice(None)] * len(shape)
        sel[line_axis] = line
        scale[tuple(sel)] = 0x7F if n % 2 == 0 else 0xFF
    moved = np.moveaxis(nib, axis, -1)
    packed = (moved[..., 0::2] & 0xF) | ((moved[..., 1::2] & 0xF) << 4)
    data = np.ascontiguousarray(np.moveaxis(packed.astype(np.uint8), -1, axis))
    return BlockScaledTensor(data, scale.view(FLOAT8_E4M3), MoeFormat.NVFP4, shape, axis=axis)


# ----------------------------------------------------------------------------- worlds


def _designer_fc1(targets: np.ndarray) -> np.ndarray:
    """``[T, 2I]`` FC1 rows: gate 4, up ``target / silu(4)`` in float32, so that
    ``h = silu(4) * u`` is ``target`` within 2^-23 relative (0 exactly for 0)."""
    rows = np.zeros((targets.shape[0], 2 * INTERMEDIATE))
    rows[:, :INTERMEDIATE] = 4.0
    rows[:, INTERMEDIATE:] = (targets / _SILU4).astype(np.float32)
    return rows


def _one_hot_world(
    num_ranks: int,
    fc2: Sequence[Any],
    topk: int,
    fc1_rows: Sequence[np.ndarray] = (),
    activation: Optional[Any] = None,
    fc1: Optional[Sequence[Any]] = None,
) -> List[RankInputs]:
    """Every rank: one-hot tokens ``e_t`` (or ``activation``) routed to the global
    experts ``0..K-1`` in slot order, router weights 1.

    Args:
        fc2: per rank, ``[E_local, I, H]`` float32 or a block-scaled tensor.
        fc1_rows: per global expert, ``[T, 2I]`` float: FC1 row t of that expert
            (the rows from T on are zero); ignored when ``fc1`` is given.
        activation: ``[T, H]`` (default: the identity rows ``e_0 .. e_{T-1}``).
        fc1: per rank, ``[E_local, H, 2I]`` float32 or a block-scaled tensor.
    """
    world = []
    for r in range(num_ranks):
        w2 = fc2[r]
        el = w2.shape[0]
        if fc1 is None:
            t = fc1_rows[0].shape[0]
            w1 = np.zeros((el, HIDDEN, 2 * INTERMEDIATE), np.float32)
            for e in range(el):
                w1[e, :t] = fc1_rows[r * el + e]
        else:
            w1 = fc1[r]
            t = HIDDEN
        act = activation if activation is not None else np.eye(t, HIDDEN, dtype=np.float32)
        n_tok = act.shape[0]
        idx = np.tile(np.arange(topk, dtype=np.int32), (n_tok, 1))
        world.append(RankInputs(act, w1, w2, idx, np.ones((n_tok, topk), np.float32)))
    return world


def _num_experts(num_topk: int, num_ranks: int) -> int:
    """Experts 0..K-1 carry the slots; at least one expert per rank."""
    return num_topk if num_topk % num_ranks == 0 else num_ranks


def _route_world(num_ranks: int, values: Sequence[np.ndarray]) -> List[RankInputs]:
    """Route outputs designed exactly: token t of every rank gets, in slot k, the
    output ``values[k][t]`` of global expert k (``[T, H]`` float32 values)."""
    topk, t = len(values), values[0].shape[0]
    experts = _num_experts(topk, num_ranks)
    el = experts // num_ranks
    fc2 = np.zeros((experts, INTERMEDIATE, HIDDEN), np.float32)
    for k in range(topk):
        fc2[k, :t] = values[k]
    fc1_rows = [_designer_fc1(np.eye(t, INTERMEDIATE))] * experts
    return _one_hot_world(num_ranks, [fc2[r * el : (r + 1) * el] for r in range(num_ranks)], topk, fc1_rows)


# ----------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class FormatCase:
    """One format-conformance case (operation ``formats``).

    Attributes:
        point: the encode point or decode, a key of :data:`FORMAT_POINTS`.
        fmt: the format at that point (``bf16``, ``mxfp8``, ``nvfp4``).
        values: the value design (``ties``, ``binade``, ``scales``, ``codes``, ``subnormal``).
        num_ranks: EP size (1 or 2; with 2, slot k's expert lives on rank k).
        output_format, combine_format, intermediate_format: the configuration.
        input_format, weight_format: encodings (``fp32`` or a block format).
        num_topk: K (1, or 2 for sums of two terms).
        generate_c: whether the stash is returned (and checked instead of the output).
        quick: part of ``--quick``.
    """

    point: str
    fmt: str
    values: str
    num_ranks: int = 1
    output_format: str = "bf16"
    combine_format: str = "bf16"
    intermediate_format: Optional[str] = "bf16"
    input_format: str = "fp32"
    weight_format: str = "fp32"
    num_topk: int = 1
    generate_c: bool = False
    quick: bool = field(default=False, compare=False)

    op = "formats"
    bad = None

    @property
    def id(self) -> str:
        return f"ep{self.num_ranks}-{self.point}-{self.fmt}-{self.values}"

    def test_id(self, backend: str) -> str:
        return f"{self.op}[{backend}-{self.id}]"

    @property
    def seed(self) -> int:
        return zlib.crc32(f"{self.op}:{self.id}".encode()) & 0x7FFFFFFF

    @property
    def what(self) -> str:
        """A sentence naming what the case checks."""
        return f"{FORMAT_POINTS[self.point]} ({self.fmt}, {self.values})"

    @property
    def params(self) -> Dict[str, object]:
        return {
            "op": self.op, "point": self.point, "format": self.fmt, "values": self.values,
            "num_ranks": self.num_ranks, "num_topk": self.num_topk, "output_format": self.output_format,
            "combine_format": self.combine_format, "intermediate_format": self.intermediate_format,
            "input_format": self.input_format, "weight_format": self.weight_format, "generate_c": self.generate_c,
        }

    @property
    def capability_op(self) -> str:
        return "forward"

    def input_formats(self) -> Tuple[MoeFormat, ...]:
        return tuple(MoeFormat.BF16 if f == "fp32" else MoeFormat(f) for f in (self.input_format, self.weight_format))

    def config(self) -> MoeEpConfig:
        experts = _num_experts(self.num_topk, self.num_ranks)
        return MoeEpConfig(
            num_experts=experts, hidden=HIDDEN, intermediate=INTERMEDIATE, num_topk=self.num_topk,
            num_ranks=self.num_ranks, output_format=self.output_format, combine_format=self.combine_format,
            intermediate_format=self.intermediate_format, generate_c=self.generate_c,
        )

    def world(self) -> List[RankInputs]:
        """The inputs, built from the design (deterministic)."""
        return _WORLDS[(self.point, self.fmt, self.values)](self)

    @property
    def observes_stash(self) -> bool:
        return self.generate_c


def _w_output_bf16_ties(case: FormatCase) -> List[RankInputs]:
    a, b = _output_bf16_ties()
    return _route_world(case.num_ranks, [a, b])


def _w_output_bf16_subnormal(case: FormatCase) -> List[RankInputs]:
    v = np.zeros((2, HIDDEN))
    v[0, :8] = [-(2.0**-134), -(2.0**-136), 3 * 2.0**-134, 2.0**-134, 5 * 2.0**-134, 7 * 2.0**-134, -(2.0**-140), 2.0**-136]
    v[1, :4] = [-(2.0**-134), 2.0**-133, -(2.0**-132), 2.0**-135]
    return _route_world(case.num_ranks, [v])


def _w_output_mxfp8(case: FormatCase) -> List[RankInputs]:
    return _route_world(case.num_ranks, list(_output_mxfp8()))


def _w_output_nvfp4(case: FormatCase) -> List[RankInputs]:
    v = _bf16_exact(_nvfp4_values())
    v[-1, 63] = -np.inf  # a non-finite block: scale 0x7F
    return _route_world(case.num_ranks, [v])


def _w_combine_mxfp8(case: FormatCase) -> List[RankInputs]:
    return _route_world(case.num_ranks, [_combine_mxfp8()])


def _w_combine_nvfp4(case: FormatCase) -> List[RankInputs]:
    return _route_world(case.num_ranks, [_nvfp4_values().astype(np.float32).astype(np.float64)])


def _w_intermediate(case: FormatCase) -> List[RankInputs]:
    targets = _intermediate(case.fmt)
    fc1_rows = _designer_fc1(targets)
    w2 = np.zeros((INTERMEDIATE, HIDDEN))
    w2[:, :INTERMEDIATE] = np.eye(INTERMEDIATE)  # y = R_int(w * h) in the first I columns
    return _one_hot_world(case.num_ranks, [w2[None].astype(np.float32)] * case.num_ranks, 1, [fc1_rows] * case.num_ranks)


def _w_stash(case: FormatCase) -> List[RankInputs]:
    rows = _stash_ties()
    w2 = np.zeros((1, INTERMEDIATE, HIDDEN), np.float32)
    return _one_hot_world(case.num_ranks, [w2] * case.num_ranks, 1, [rows] * case.num_ranks)


def _w_decode_act(case: FormatCase) -> List[RankInputs]:
    rng = np.random.default_rng(case.seed)
    make = _mxfp8_codes if case.fmt == "mxfp8" else _nvfp4_codes
    act = make((32, HIDDEN), 1, [28, 29, 30, 31], rng)
    fc1 = [np.eye(HIDDEN, 2 * INTERMEDIATE, dtype=np.float32)[None]] * case.num_ranks  # c = x
    w2 = [np.zeros((1, INTERMEDIATE, HIDDEN), np.float32)] * case.num_ranks
    return _one_hot_world(case.num_ranks, w2, 1, activation=act, fc1=fc1)


def _w_decode_fc1(case: FormatCase) -> List[RankInputs]:
    rng = np.random.default_rng(case.seed)
    make = _mxfp8_codes if case.fmt == "mxfp8" else _nvfp4_codes
    fc1 = [make((1, HIDDEN, 2 * INTERMEDIATE), 1, [60, 61, 62, 63], rng) for _ in range(case.num_ranks)]
    w2 = [np.zeros((1, INTERMEDIATE, HIDDEN), np.float32)] * case.num_ranks
    return _one_hot_world(case.num_ranks, w2, 1, activation=np.eye(HIDDEN, dtype=np.float32), fc1=fc1)


def _w_decode_fc2(case: FormatCase) -> List[RankInputs]:
    rng = np.random.default_rng(case.seed)
    make = _mxfp8_codes if case.fmt == "mxfp8" else _nvfp4_codes
    fc2 = [make((1, INTERMEDIATE, HIDDEN), 1, [60, 61, 62, 63], rng) for _ in range(case.num_ranks)]
    fc1_rows = [_designer_fc1(np.eye(INTERMEDIATE))] * case.num_ranks
    return _one_hot_world(case.num_ranks, fc2, 1, fc1_rows)


_WORLDS: Dict[Tuple[str, str, str], Callable[[FormatCase], List[RankInputs]]] = {
    ("output", "bf16", "ties"): _w_output_bf16_ties,
    ("output", "bf16", "subnormal"): _w_output_bf16_subnormal,
    ("output", "mxfp8", "binade"): _w_output_mxfp8,
    ("output", "nvfp4", "scales"): _w_output_nvfp4,
    ("combine", "mxfp8", "binade"): _w_combine_mxfp8,
    ("combine", "nvfp4", "scales"): _w_combine_nvfp4,
    ("intermediate", "bf16", "near_ties"): _w_intermediate,
    ("intermediate", "mxfp8", "near_ties"): _w_intermediate,
    ("intermediate", "nvfp4", "near_ties"): _w_intermediate,
    ("stash", "bf16", "ties"): _w_stash,
    ("decode_act", "mxfp8", "codes"): _w_decode_act,
    ("decode_act", "nvfp4", "codes"): _w_decode_act,
    ("decode_fc1", "mxfp8", "codes"): _w_decode_fc1,
    ("decode_fc1", "nvfp4", "codes"): _w_decode_fc1,
    ("decode_fc2", "mxfp8", "codes"): _w_decode_fc2,
    ("decode_fc2", "nvfp4", "codes"): _w_decode_fc2,
}


def format_cases() -> List[FormatCase]:
    """Every format case, in a fixed order (``quick`` marks the ``--quick`` subset)."""
    c = FormatCase
    return [
        c("output", "bf16", "ties", num_topk=2, quick=True),
        c("output", "bf16", "ties", num_ranks=2, num_topk=2),
        c("output", "bf16", "subnormal", combine_format="mxfp8", quick=True),
        c("output", "mxfp8", "binade", output_format="mxfp8", num_topk=2, quick=True),
        c("output", "mxfp8", "binade", output_format="mxfp8", num_topk=2, num_ranks=2),
        c("output", "nvfp4", "scales", output_format="nvfp4", quick=True),
        c("combine", "mxfp8", "binade", combine_format="mxfp8", quick=True),
        c("combine", "nvfp4", "scales", combine_format="nvfp4", quick=True),
        c("intermediate", "bf16", "near_ties", intermediate_format="bf16"),
        c("intermediate", "mxfp8", "near_ties", intermediate_format="mxfp8", quick=True),
        c("intermediate", "nvfp4", "near_ties", intermediate_format="nvfp4"),
        c("stash", "bf16", "ties", intermediate_format=None, generate_c=True, quick=True),
        c("decode_act", "mxfp8", "codes", intermediate_format=None, input_format="mxfp8", generate_c=True, quick=True),
        c("decode_act", "nvfp4", "codes", intermediate_format=None, input_format="nvfp4", generate_c=True),
        c("decode_fc1", "mxfp8", "codes", intermediate_format=None, weight_format="mxfp8", generate_c=True),
        c("decode_fc1", "nvfp4", "codes", intermediate_format=None, weight_format="nvfp4", generate_c=True, quick=True),
        c("decode_fc2", "mxfp8", "codes", weight_format="mxfp8", quick=True),
        c("decode_fc2", "nvfp4", "codes", weight_format="nvfp4"),
    ]


# ----------------------------------------------------------------------------- the check


def _hex(v: int, width: int) -> str:
    return f"{int(v):#0{width + 2}x}"


def _first(mask: np.ndarray) -> Tuple[int, ...]:
    return tuple(int(i) for i in np.argwhere(mask)[0])


def _construction(name: str, budget: np.ndarray, ref_values: np.ndarray, case: FormatCase) -> List[Any]:
    loose = np.isfinite(ref_values) & (np.asarray(budget) != 0)
    if loose.any():
        at = _first(loose)
        return [Check(f"{name} construction", False, float("inf"), 0.0,
                      f"{name}: case construction: the reference's budget is {float(budget[at]):.3g}, not 0, at {at} "
                      f"(value {float(ref_values[at])!r}); the case must make the exact result known "
                      f"(a conformance-suite bug, not the backend's)")]
    return []


def _bf16_codes(name: str, got: Any, ref: np.ndarray, case: FormatCase) -> Any:
    wrong = _expect_array(name, got, BF16, ref.shape)
    if wrong is not None:
        return wrong
    g, r = got.view(np.uint16), ref.view(np.uint16)
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(ref.astype(np.float32))
    bad = (g != r) & ~both_nan
    if bad.any():
        at = _first(bad)
        return Check(name, False, float("inf"), float("inf"),
                     f"{name}: {int(bad.sum())} bf16 code(s) differ, first at {at}: got {_hex(g[at], 4)} "
                     f"({float(got[at])!r}), reference {_hex(r[at], 4)} ({float(ref[at])!r}); checks {case.what}, "
                     f"code for code (+0 and -0 differ)")
    return Check(name, True)


def _nibbles(t: BlockScaledTensor) -> np.ndarray:
    packed = np.moveaxis(t.data_codes(), t.axis, -1)
    nib = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))
    return np.moveaxis(nib[..., : t.shape[t.axis]], -1, t.axis)


def _block_codes(name: str, got: Any, ref: BlockScaledTensor, case: FormatCase) -> List[Any]:
    if not isinstance(got, BlockScaledTensor) or got.format is not ref.format or got.shape != ref.shape or got.axis != ref.axis:
        return [Check(name, False, float("inf"), float("inf"), f"{name}: expected {_kind(ref)}; got {_kind(got)}")]
    checks = []
    gs, rs = got.scale_codes(), ref.scale_codes()
    bad = gs != rs
    if ref.format is MoeFormat.NVFP4:  # both NaN codes (0x7F, 0xFF) mean NaN
        bad &= ~(((gs & 0x7F) == 0x7F) & ((rs & 0x7F) == 0x7F))
    if bad.any():
        at = _first(bad)
        checks.append(Check(f"{name} scale codes", False, float("inf"), float("inf"),
                            f"{name} scale codes: {int(bad.sum())} block(s) differ, first block {at}: got "
                            f"{_hex(gs[at], 2)}, reference {_hex(rs[at], 2)}; checks {case.what}"))
    else:
        checks.append(Check(f"{name} scale codes", True))
    if ref.format is MoeFormat.MXFP8:
        gd, rd = got.data_codes(), ref.data_codes()
        bad = gd != rd
        rule = "E4M3 data codes, ties to even; a NaN-scale block has every data code 0x7F"
    else:
        gd, rd = _nibbles(got), _nibbles(ref)
        nan_block = (rs & 0x7F) == 0x7F
        nan_el = np.repeat(nan_block, ref.block_size, axis=ref.axis)
        nan_el = np.take(nan_el, np.arange(ref.shape[ref.axis]), axis=ref.axis)
        bad = (gd != rd) & ~nan_el  # an nvfp4 NaN block's data codes are unspecified
        rule = "nvfp4 data nibbles, element 2j in the low nibble"
    if bad.any():
        at = _first(bad)
        checks.append(Check(f"{name} data codes", False, float("inf"), float("inf"),
                            f"{name} data codes: {int(bad.sum())} element(s) differ, first at {at}: got "
                            f"{_hex(gd[at], 2)}, reference {_hex(rd[at], 2)} ({rule}); checks {case.what}"))
    else:
        checks.append(Check(f"{name} data codes", True))
    return checks


def check_format_case(runner: Any) -> List[Any]:
    """Run a :class:`FormatCase` (``runner`` is the conformance runner holding the
    backend, the reference and the case) and judge it code for code."""
    case: FormatCase = runner.case
    cfg = runner.config
    world = case.world()
    got = runner.call_unchanged("forward", world)
    ref, budgets = runner.reference.forward_and_budget(cfg, world)
    checks: List[Any] = []
    for r in range(cfg.num_ranks):
        if case.observes_stash:
            name = f"rank {r} fc1_c"
            checks += _construction(name, budgets[r].fc1_c, ref[r].fc1_c.astype(np.float64), case)
            checks.append(_bf16_codes(name, getattr(got[r], "fc1_c", None), ref[r].fc1_c, case))
            checks.append(_exact_ints(f"rank {r} route_metadata", getattr(got[r], "route_metadata", None),
                                      ref[r].route_metadata, np.int32))
            continue
        name = f"rank {r} output"
        out = ref[r].output
        values = out.dequantize(np.float64) if isinstance(out, BlockScaledTensor) else out.astype(np.float64)
        checks += _construction(name, budgets[r].output, values, case)
        if budgets[r].scale_codes is not None:
            lo, hi = budgets[r].scale_codes
            if (lo != hi).any():
                checks.append(Check(f"{name} construction", False, float("inf"), 0.0,
                                    f"{name}: case construction: more than one scale code allowed at block "
                                    f"{_first(lo != hi)} (a conformance-suite bug, not the backend's)"))
        if isinstance(out, BlockScaledTensor):
            checks += _block_codes(name, got[r].output, out, case)
        else:
            checks.append(_bf16_codes(name, got[r].output, out, case))
    return checks
