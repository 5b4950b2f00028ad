"""How close a backend must be to the reference, and how that is checked.

A backend's result is compared with the reference element by element against
an error *budget* of the same shape. The budget is derived, not tuned: it bounds
the error of an implementation that follows the spec with float32 accumulation
(the least the spec allows), propagated to first order through every stage, and
it treats every rounding point exactly:

* an accumulation of ``n`` float32 terms errs by at most :func:`gamma` ``(n)``
  times the sum of the terms' magnitudes, plus :func:`underflow` ``(n)`` for
  the products and partial sums below float32's normal range; an accumulation
  that is exact in float32 whatever the order (:func:`exact_reduction`: every
  term a multiple of a common power of two ``q`` and the terms' magnitudes
  summing to less than ``2^24 q``) errs by nothing (:func:`reduction_bound`);
* a rounding point maps an error bound ``d`` on its input to
  :func:`rounding_error_bound`: the largest distance between the rounded
  reference value and the rounding of any value within ``d`` of it. Rounding is
  monotonic, so away from rounding boundaries this is 0 (the backend must then
  produce the same code), and where a boundary lies within ``d`` it is the
  distance to the neighbouring code(s). For block formats, where ``d`` lets the
  block maximum cross a scale boundary, the block scale may differ too.

Same rules for every backend; see ``docs/spec.md`` ("Tolerances").

:func:`compare` checks a result against the reference with a budget and returns
a :class:`Comparison` whose ``ratio`` is the worst error as a multiple of the
budget (``<= 1`` passes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import numpy as np

from .formats import (
    E2M1_VALUES,
    E4M3_VALUES,
    BlockScaledTensor,
    MoeFormat,
    block_scale,
    dequantize,
    parse_format,
    round_to_bf16,
    round_with_scale,
)

__all__ = [
    "FP32_UNIT_ROUNDOFF",
    "SAFETY",
    "FP32_MIN_NORMAL",
    "FP32_MIN_SUBNORMAL",
    "FP32_MAX",
    "gamma",
    "underflow",
    "quantum",
    "min_quantum",
    "dot_quantum",
    "exact_reduction",
    "reduction_bound",
    "rounding_error_bound",
    "product_bound",
    "allowed_scale_codes",
    "ForwardBudget",
    "Comparison",
    "compare",
]

#: Unit roundoff of float32, the accumulation precision the spec requires at least.
FP32_UNIT_ROUNDOFF = 2.0**-24
#: Factor on every accumulation bound: covers summation order, fused multiply-add
#: and the few float32 operations of SiLU (exp, division) per element.
SAFETY = 2.0
#: Inflation of an error bound before it is pushed through a rounding, so that a
#: float64 evaluation of ``v +- d`` can never land exactly on a tie by accident.
_WIDEN = 1.0 + 2.0**-40

_GRIDS = {
    MoeFormat.MXFP8: (E4M3_VALUES, np.append(np.diff(E4M3_VALUES), E4M3_VALUES[-1] - E4M3_VALUES[-2])),
    MoeFormat.NVFP4: (E2M1_VALUES, np.append(np.diff(E2M1_VALUES), E2M1_VALUES[-1] - E2M1_VALUES[-2])),
}


def gamma(n: int) -> float:
    """Relative error bound of a float32 reduction of length ``n`` (times :data:`SAFETY`)."""
    nu = max(int(n), 1) * FP32_UNIT_ROUNDOFF
    return SAFETY * nu / (1.0 - nu)


#: The smallest positive normal float32, ``2^-126``.
FP32_MIN_NORMAL = 2.0**-126
#: The smallest positive float32 (subnormal), ``2^-149``: twice the largest
#: absolute rounding error of a float32 result in the subnormal range.
FP32_MIN_SUBNORMAL = 2.0**-149
#: The largest finite float32.
FP32_MAX = float(np.finfo(np.float32).max)


def underflow(n: int) -> float:
    """Absolute error bound of a float32 reduction of length ``n`` from results
    below ``2^-126``, where relative bounds fail: each of its ``n`` products and
    ``n`` partial sums may round by ``2^-150`` absolute there, so ``SAFETY * n *
    2^-149`` (n taken as at least 1)."""
    return SAFETY * max(int(n), 1) * FP32_MIN_SUBNORMAL


def quantum(values: Any) -> np.ndarray:
    """The largest power of two that divides each value (the weight of its last
    significant bit).

    Args:
        values: ``[...]`` float (read exactly as float64).

    Returns:
        ``[...]`` float64: ``2^k`` with ``value = odd * 2^k``; ``+inf`` for a zero
        (a zero is a multiple of every power of two); NaN for NaN and +-inf.
    """
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v) & (v != 0)
    mant, exp = np.frexp(np.where(finite, np.abs(v), 1.0))  # |v| = mant * 2^exp, mant in [0.5, 1)
    ints = (mant * 2.0**53).astype(np.int64)  # exact: a 53-bit integer
    low = (ints & -ints).astype(np.float64)  # its lowest set bit
    q = np.ldexp(low, exp - 53)
    return np.where(finite, q, np.where(v == 0, np.inf, np.nan))


def min_quantum(values: Any, axis: int) -> np.ndarray:
    """:func:`quantum` minimised over ``axis`` (kept as a length-1 axis): a power
    of two that divides every value along it (``+inf`` when all are zero, NaN
    when one is not finite)."""
    return np.min(quantum(values), axis=axis, keepdims=True)


def dot_quantum(a: Any, b: Any, max_work: int = 1 << 22) -> np.ndarray:
    """A power of two dividing every product ``a[r, i] * b[i, j]`` of the matrix
    product ``a @ b`` (for :func:`exact_reduction`).

    Args:
        a: ``[n, k]`` float: the left operand; b: ``[k, m]`` float: the right one.
        max_work: above ``n * k * m`` elements the bound is the cheaper product of
            the row's and the column's :func:`min_quantum` (still valid, less tight).

    Returns:
        ``[n, m]`` float64: the smallest ``quantum(a[r, i]) * quantum(b[i, j])``
        over ``i`` (``+inf`` where every product is zero).
    """
    qa, qb = quantum(a), quantum(b)
    n, k = qa.shape
    m = qb.shape[1]
    if n * k * m > max_work:
        return min_quantum(a, axis=1) * min_quantum(b, axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        la, lb = np.log2(qa), np.log2(qb)
        return np.exp2(np.min(la[:, :, None] + lb[None, :, :], axis=1, initial=np.inf))


def exact_reduction(abs_sum: Any, common_quantum: Any) -> np.ndarray:
    """Whether a float32 reduction is exact in every order, blocking and FMA use.

    Args:
        abs_sum: ``[...]`` float64: the sum of the magnitudes of the terms (the
            products, for a dot product).
        common_quantum: broadcastable: a power of two that divides every term.

    Every partial sum of such terms is a multiple of ``q`` no larger than
    ``abs_sum``, so it is a float32 value when ``abs_sum < 2^24 q``,
    ``q >= 2^-149`` and ``abs_sum`` is within float32's range: then nothing
    rounds. For a product ``x_i * w_i`` of float32 values, ``q`` may be taken
    as the product of a power of two dividing every ``x_i`` and one dividing
    every ``w_i`` (:func:`min_quantum`).
    """
    a = np.asarray(abs_sum, dtype=np.float64)
    q = np.asarray(common_quantum, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return (q >= FP32_MIN_SUBNORMAL) & (a < q * 2.0**24) & (a <= FP32_MAX)


def reduction_bound(abs_sum: Any, n: int, exact: Any = False) -> np.ndarray:
    """The error bound of a float32 reduction of length ``n`` whose terms'
    magnitudes sum to ``abs_sum``: ``gamma(n) * abs_sum + underflow(n)``, and 0
    where ``exact`` (see :func:`exact_reduction`)."""
    a = np.asarray(abs_sum, dtype=np.float64)
    return np.where(exact, 0.0, gamma(n) * a + underflow(n))


def product_bound(lhs: Any, rhs: Any, lhs_error: Any = 0.0, rhs_error: Any = 0.0) -> np.ndarray:
    """The error bound of a float32-accumulated matrix product ``lhs @ rhs`` whose
    operands are off by at most ``lhs_error`` and ``rhs_error``.

    Args:
        lhs: ``[n, k]`` float64: the reference's left operand; rhs: ``[k, m]``
            float64: its right operand (values after any rounding point).
        lhs_error, rhs_error: broadcastable to the operands: how far a
            conforming backend's operands may be (0: they are the reference's,
            e.g. a rounded operand whose :func:`rounding_error_bound` is 0).

    Returns:
        ``[n, m]`` float64: ``lhs_error @ |rhs| + |lhs| @ rhs_error +
        reduction_bound(|lhs| @ |rhs|, k, exact)``, where ``exact`` holds for an
        output element whose row of ``lhs`` and column of ``rhs`` have no error
        and whose reduction is exact in float32 (:func:`exact_reduction` with
        :func:`dot_quantum`).
    """
    a = np.asarray(lhs, dtype=np.float64)
    b = np.asarray(rhs, dtype=np.float64)
    ea = np.broadcast_to(np.asarray(lhs_error, dtype=np.float64), a.shape)
    eb = np.broadcast_to(np.asarray(rhs_error, dtype=np.float64), b.shape)
    abs_a, abs_b = np.abs(a), np.abs(b)
    abs_sum = abs_a @ abs_b
    exact = exact_reduction(abs_sum, dot_quantum(a, b))
    exact &= (ea == 0).all(axis=1, keepdims=True) & (eb == 0).all(axis=0, keepdims=True)
    return ea @ abs_b + abs_a @ eb + reduction_bound(abs_sum, a.shape[1], exact)


def _half_gap(mag: np.ndarray, scale: np.ndarray, fmt: MoeFormat) -> np.ndarray:
    """Half the element-grid gap at magnitude ``mag`` under ``scale``: the most a
    rounding to that grid can move a value of that magnitude."""
    grid, gaps = _GRIDS[fmt]
    safe = np.where(scale > 0, scale, 1.0)
    idx = np.clip(np.searchsorted(grid, mag / safe, side="right") - 1, 0, len(grid) - 1)
    smallest = 0.5 * 2.0**-9 if fmt is MoeFormat.NVFP4 else 2.0**-9 * 2.0**-127
    return np.where(scale > 0, 0.5 * gaps[idx] * scale, 0.5 * smallest + mag)


def _block_view(v: np.ndarray, axis: int, block: int) -> Tuple[np.ndarray, int]:
    moved = np.moveaxis(v, axis, -1)
    n = moved.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        moved = np.concatenate([moved, np.zeros(moved.shape[:-1] + (pad,))], axis=-1)
    return moved.reshape(moved.shape[:-1] + (nb, block)), n


def _unblock(b: np.ndarray, n: int, axis: int) -> np.ndarray:
    return np.moveaxis(b.reshape(b.shape[:-2] + (b.shape[-2] * b.shape[-1],))[..., :n], -1, axis)


def rounding_error_bound(
    values: np.ndarray, error: np.ndarray, fmt: Union[MoeFormat, str, None], axis: int = -1
) -> np.ndarray:
    """Bound on ``|R(b) - R(v)|`` over every ``b`` with ``|b - v| <= error``.

    Args:
        values: ``[...]`` float64, the reference's exact values before rounding.
        error: broadcastable to ``values``: a bound on how far a conforming
            backend's values before rounding are from ``values``.
        fmt: the rounding (``None``: no rounding, the bound is ``error``).
        axis: the blocked axis for block formats.

    bf16 rounding is monotonic, so the bound is
    ``max(R(v + d) - R(v), R(v) - R(v - d))``: 0 unless a rounding boundary lies
    within ``d``. Block formats: when the block maximum cannot cross a scale
    boundary within the errors, the block scale is the reference's and the same
    monotonic bound applies element by element; otherwise the scale may differ,
    and the bound is ``d`` plus half a grid gap at each of the two scales.
    """
    v = np.asarray(values, dtype=np.float64)
    d = np.broadcast_to(np.asarray(error, dtype=np.float64), v.shape)
    if fmt is None:
        return np.array(d, copy=True)
    d = d * _WIDEN
    fmt = parse_format(fmt)
    v = np.where(np.isfinite(v), v, 0.0)  # NaN/inf must match exactly; no budget there
    if fmt is MoeFormat.BF16:
        with np.errstate(over="ignore", invalid="ignore"):
            r = round_to_bf16(v).astype(np.float64)
            up = round_to_bf16(v + d).astype(np.float64) - r
            down = r - round_to_bf16(v - d).astype(np.float64)
        return np.maximum(up, down)
    block = int(fmt.block_size)  # type: ignore[arg-type]
    vb, n = _block_view(v, axis, block)
    db, _ = _block_view(np.array(d), axis, block)
    mag = np.abs(vb)
    s_ref = block_scale(mag.max(axis=-1), fmt)[..., None]
    s_lo = block_scale(np.maximum(mag - db, 0.0).max(axis=-1), fmt)[..., None]
    s_hi = block_scale((mag + db).max(axis=-1), fmt)[..., None]
    fixed = (s_lo == s_hi) & (s_lo == s_ref)
    r = round_with_scale(vb, s_ref, fmt)
    up = round_with_scale(vb + db, s_ref, fmt) - r
    down = r - round_with_scale(vb - db, s_ref, fmt)
    same_scale = np.maximum(up, down)
    moving = db + _half_gap(mag + db, s_hi, fmt) + _half_gap(mag, s_ref, fmt)
    out = np.where(fixed, same_scale, np.maximum(same_scale, moving))
    return _unblock(out, n, axis)


def _scale_codes(scale: np.ndarray, fmt: MoeFormat) -> np.ndarray:
    if fmt is MoeFormat.MXFP8:
        _, exp = np.frexp(scale)  # scale = 2^(exp - 1) exactly
        return (exp - 1 + 127).astype(np.uint8)
    return np.searchsorted(E4M3_VALUES, scale).astype(np.uint8)


def allowed_scale_codes(
    values: np.ndarray, error: np.ndarray, fmt: Union[MoeFormat, str], axis: int = -1
) -> Tuple[np.ndarray, np.ndarray]:
    """The lowest and highest block scale code a conforming backend may produce.

    Args:
        values: float64 reference values before the encode; error: their error
            bound (broadcastable); fmt: mxfp8 or nvfp4; axis: the blocked axis.

    Returns:
        ``(lowest, highest)`` uint8 codes shaped like the scale: the codes of the
        smallest and the largest block maximum within the error bound. Where the
        bound cannot move the block maximum across a scale boundary both equal the
        reference's code. A block holding NaN or inf allows its NaN code only.
    """
    fmt = parse_format(fmt)
    v = np.asarray(values, dtype=np.float64)
    d = np.broadcast_to(np.asarray(error, dtype=np.float64), v.shape) * _WIDEN
    block = int(fmt.block_size)  # type: ignore[arg-type]
    vb, _ = _block_view(np.where(np.isfinite(v), v, 0.0), axis % v.ndim, block)
    db, _ = _block_view(np.array(d), axis % v.ndim, block)
    bad, _ = _block_view(np.where(np.isfinite(v), 0.0, 1.0), axis % v.ndim, block)
    mag = np.abs(vb)
    lo = _scale_codes(block_scale(np.maximum(mag - db, 0.0).max(axis=-1), fmt), fmt)
    hi = _scale_codes(block_scale((mag + db).max(axis=-1), fmt), fmt)
    nan_code = np.uint8(0xFF if fmt is MoeFormat.MXFP8 else 0x7F)
    nonfinite = bad.max(axis=-1) > 0
    lo = np.where(nonfinite, nan_code, lo)
    hi = np.where(nonfinite, nan_code, hi)
    return np.moveaxis(lo, -1, axis % v.ndim), np.moveaxis(hi, -1, axis % v.ndim)


@dataclass(frozen=True, eq=False)
class ForwardBudget:
    """The budgets of one rank's forward results.

    Attributes:
        output: ``[T, H]`` float64: the budget of the decoded output.
        scale_codes: for block-scaled outputs, ``(lowest, highest)`` uint8 arrays
            shaped like the output's scale (see :func:`allowed_scale_codes`); else None.
        fc1_c: ``[R, 2I]`` float64: the budget of the bf16 stash (0 in padding
            rows), or None without ``generate_c``.
    """

    output: np.ndarray
    scale_codes: Optional[Tuple[np.ndarray, np.ndarray]] = None
    fc1_c: Optional[np.ndarray] = None


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
            return f"{self.name}: {self.detail or 'empty, nothing to compare'}"
        if not (np.isfinite(self.worst_got) and np.isfinite(self.worst_ref)) and self.detail:
            return f"{self.name}: {self.detail}"
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
    err = np.abs(np.where(finite, g, 0.0) - np.where(finite, r, 0.0))
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
            f"got {float(g[first])!r}, reference {float(r[first])!r}"
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
