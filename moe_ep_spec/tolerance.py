"""How close a backend must be to the reference, and how that is checked.

A backend's result is compared with the reference element by element against
an error *budget* of the same shape. The budget is derived, not tuned: it is the
first-order bound on the error of an implementation that follows the spec with
float32 accumulation (the least the spec allows), plus one or two quantisation
steps of every rounding point where the backend and the reference may land on
neighbouring codes. The same rules apply to every backend; see
``docs/spec.md`` ("Tolerances") for the table and the derivation.

The building blocks, used by the reference to compute budgets:

* :func:`gamma` ``(n)``: the relative error bound of a float32 sum of ``n``
  terms, ``n u / (1 - n u)`` with ``u = 2^-24``, scaled by :data:`SAFETY`.
* :func:`format_step`: the distance between neighbouring representable values
  of a format around each reference value (bf16: one ulp; mxfp8/nvfp4: the
  block scale times the element grid's gap there).
* :data:`ROUNDING_STEPS`: how many steps a rounding point may differ by
  (1.5 for bf16; 2 for block formats, whose block scale may also differ by one
  step when the block maximum sits on a scale boundary).

:func:`compare` checks a result against the reference with a budget and returns
a :class:`Comparison` whose ``ratio`` is the worst error as a multiple of the
budget (``<= 1`` passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union, cast

import numpy as np

from .formats import (
    E2M1_VALUES,
    E4M3_VALUES,
    BlockScaledTensor,
    MoeFormat,
    dequantize,
    parse_format,
    quantize,
)

__all__ = [
    "FP32_UNIT_ROUNDOFF",
    "SAFETY",
    "ROUNDING_STEPS",
    "gamma",
    "format_step",
    "rounding_allowance",
    "Comparison",
    "compare",
]

#: Unit roundoff of float32, the accumulation precision the spec requires at least.
FP32_UNIT_ROUNDOFF = 2.0**-24
#: Factor on every accumulation bound: covers summation order, fused multiply-add
#: and the few float32 operations of SiLU (exp, division) per element.
SAFETY = 2.0
#: Quantisation steps by which a rounding point may differ from the reference.
#: bf16: half a step on each side, and the backend's value may sit in the next
#: binade (step doubled): 1/2 + 1/2 * 2 = 1.5. Block formats: the block scale may
#: also differ by one step, which doubles the element grid's gap: 2.
ROUNDING_STEPS = {MoeFormat.BF16: 1.5, MoeFormat.MXFP8: 2.0, MoeFormat.NVFP4: 2.0}

_E4M3_GAPS = np.append(np.diff(E4M3_VALUES), E4M3_VALUES[-1] - E4M3_VALUES[-2])
_E2M1_GAPS = np.append(np.diff(E2M1_VALUES), E2M1_VALUES[-1] - E2M1_VALUES[-2])


def gamma(n: int) -> float:
    """Relative error bound of a float32 reduction of length ``n`` (times :data:`SAFETY`)."""
    nu = max(int(n), 1) * FP32_UNIT_ROUNDOFF
    return SAFETY * nu / (1.0 - nu)


def format_step(values: np.ndarray, fmt: Union[MoeFormat, str, None], axis: int = -1) -> np.ndarray:
    """Per element of ``values`` (float64, exact reference values): the gap to the
    next representable value of ``fmt`` above ``|value|``, given the block scale
    ``values`` itself would get. Zero for ``fmt=None`` (no rounding).

    bf16: ``2^(max(floor(log2|v|), -126) - 7)``. mxfp8: scale times the E4M3 gap
    at ``|v| / s``. nvfp4: scale times the E2M1 gap at ``|v| / s``, and for a
    block whose scale rounds to zero, the smallest nvfp4 step there.
    """
    v = np.asarray(values, dtype=np.float64)
    if fmt is None:
        return np.zeros_like(v)
    fmt = parse_format(fmt)
    mag = np.abs(np.where(np.isfinite(v), v, 0.0))
    if fmt is MoeFormat.BF16:
        _, exp = np.frexp(np.where(mag > 0, mag, 1.0))
        e = np.where(mag > 0, np.maximum(exp - 1, -126), -126)
        return np.ldexp(1.0, e - 7)
    q = cast(BlockScaledTensor, quantize(v, fmt, axis=axis))
    ax = q.axis
    block = q.block_size
    n = v.shape[ax]
    if fmt is MoeFormat.MXFP8:
        scale = np.ldexp(1.0, q.scale_codes().astype(np.int64) - 127)
        grid, gaps = E4M3_VALUES, _E4M3_GAPS
    else:
        scale = q.scale.astype(np.float64)
        scale = np.where(np.isnan(scale), 0.0, scale)
        grid, gaps = E2M1_VALUES, _E2M1_GAPS
    scale_full = np.take(np.repeat(scale, block, axis=ax), np.arange(n), axis=ax)
    safe = np.where(scale_full > 0, scale_full, 1.0)
    idx = np.clip(np.searchsorted(grid, mag / safe, side="right") - 1, 0, len(grid) - 1)
    step = gaps[idx] * scale_full
    if fmt is MoeFormat.NVFP4:
        # A scale that rounded to zero flushed the block; the smallest non-zero
        # nvfp4 step is 0.5 * 2^-9 (E2M1 0.5 at the smallest E4M3 scale).
        step = np.where(scale_full > 0, step, 0.5 * 2.0**-9)
    return step


def rounding_allowance(values: np.ndarray, fmt: Union[MoeFormat, str, None], axis: int = -1) -> np.ndarray:
    """:func:`format_step` times :data:`ROUNDING_STEPS` of the format (0 for None)."""
    if fmt is None:
        return np.zeros_like(np.asarray(values, dtype=np.float64))
    fmt = parse_format(fmt)
    return ROUNDING_STEPS[fmt] * format_step(values, fmt, axis=axis)


@dataclass(frozen=True)
class Comparison:
    """The outcome of comparing one result with the reference.

    Attributes:
        name: what was compared (e.g. ``"rank 1 output"``).
        ok: every element within budget, and NaN exactly where the reference has NaN.
        ratio: the worst ``|got - ref| / budget`` (0 when equal everywhere;
            ``inf`` for an error where the budget is 0, or a NaN mismatch).
        max_abs_error: the worst ``|got - ref|`` over finite elements.
        worst_index: the index of the worst element, or None for empty arrays.
        worst_got, worst_ref, worst_budget: the values there.
        detail: extra text (NaN mismatches, shape problems).
    """

    name: str
    ok: bool
    ratio: float
    max_abs_error: float
    worst_index: Optional[Tuple[int, ...]]
    worst_got: float = 0.0
    worst_ref: float = 0.0
    worst_budget: float = 0.0
    detail: str = ""

    def describe(self) -> str:
        """A sentence that makes sense on its own in a failure report."""
        if self.worst_index is None:
            return f"{self.name}: empty, nothing to compare"
        text = (
            f"{self.name}: worst element {self.worst_index}: got {self.worst_got!r}, reference {self.worst_ref!r}, "
            f"error {abs(self.worst_got - self.worst_ref):.3g} = {self.ratio:.3g} x budget {self.worst_budget:.3g}"
        )
        return text + (f"; {self.detail}" if self.detail else "")


def _decoded(x: Any) -> np.ndarray:
    if isinstance(x, BlockScaledTensor):
        return dequantize(x, np.float64)
    return np.asarray(x).astype(np.float64)


def compare(name: str, got: Any, ref: Any, budget: Union[np.ndarray, float]) -> Comparison:
    """Compare ``got`` with ``ref`` (plain arrays or BlockScaledTensors, compared as
    decoded values) element by element against ``budget`` (broadcastable).

    NaN must appear exactly where the reference has NaN; +-inf must match exactly.
    """
    g, r = _decoded(got), _decoded(ref)
    if g.shape != r.shape:
        return Comparison(name, False, float("inf"), float("inf"), None, detail=f"shape {g.shape} != reference {r.shape}")
    if g.size == 0:
        return Comparison(name, True, 0.0, 0.0, None)
    b = np.broadcast_to(np.asarray(budget, dtype=np.float64), r.shape)
    nan_g, nan_r = np.isnan(g), np.isnan(r)
    inf_mismatch = (np.isinf(g) | np.isinf(r)) & ~(nan_g | nan_r) & (g != r)
    bad_special = (nan_g != nan_r) | inf_mismatch
    finite = np.isfinite(g) & np.isfinite(r)
    err = np.where(finite, np.abs(g - r), 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / b)
    ratio = np.where(bad_special, np.inf, ratio)
    flat = int(np.argmax(ratio))
    worst = tuple(int(i) for i in np.unravel_index(flat, r.shape))
    worst_ratio = float(ratio[worst])
    detail = ""
    if bad_special.any():
        first = tuple(int(i) for i in np.argwhere(bad_special)[0])
        detail = (
            f"{int(bad_special.sum())} element(s) with NaN/inf where the reference differs, first at {first}: "
            f"got {g[first]!r}, reference {r[first]!r}"
        )
    return Comparison(
        name=name,
        ok=worst_ratio <= 1.0,
        ratio=worst_ratio,
        max_abs_error=float(err.max()),
        worst_index=worst,
        worst_got=float(g[worst]),
        worst_ref=float(r[worst]),
        worst_budget=float(b[worst]),
        detail=detail,
    )
