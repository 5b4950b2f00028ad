"""What a case's judgement is made of: :class:`Check` and the structural and
numeric comparisons shared by the runner and the format cases.

This module imports nothing of the suite, so that the case tables
(:mod:`.cases`, :mod:`.format_cases`) and the runner (:mod:`.runner`) can all
use it without an import circle: ``cases`` imports ``format_cases``;
``runner`` imports both; neither case module imports the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from moe_ep_spec import BlockScaledTensor
from moe_ep_spec.tolerance import compare

__all__ = ["Check"]


@dataclass(frozen=True)
class Check:
    """One judged result of a case (e.g. ``rank 1 output``).

    Attributes: ``name``; ``ok``; ``ratio`` (worst error / budget; 0 for exact
    matches, inf for structural mismatches); ``max_abs_error``; ``message`` (a
    sentence that makes sense on its own)."""

    name: str
    ok: bool
    ratio: float = 0.0
    max_abs_error: float = 0.0
    message: str = ""


def _kind(x: Any) -> str:
    if isinstance(x, BlockScaledTensor):
        return f"BlockScaledTensor({x.format.value}, shape={x.shape}, axis={x.axis})"
    if isinstance(x, np.ndarray):
        return f"ndarray({x.dtype.name}, shape={x.shape})"
    return type(x).__name__


def _close(name: str, got: Any, ref: Any, budget: Any, factor: float) -> Check:
    c = compare(name, got, ref, np.asarray(budget, dtype=np.float64) * factor)
    return Check(name, c.ok, c.ratio, c.max_abs_error, c.describe())


def _expect_array(name: str, got: Any, dtype: Any, shape: Sequence[int]) -> Optional[Check]:
    dtype = np.dtype(dtype)
    if not isinstance(got, np.ndarray) or got.dtype != dtype or tuple(got.shape) != tuple(shape):
        return Check(
            name,
            False,
            float("inf"),
            float("inf"),
            f"{name}: expected ndarray({dtype.name}, shape={tuple(shape)}); got {_kind(got)}",
        )
    return None


def _exact_ints(name: str, got: Any, ref: np.ndarray, dtype: Any = None) -> Check:
    """Integers must be equal, of the spec's dtype (``dtype``, default: the reference's)."""
    want = np.dtype(dtype) if dtype is not None else ref.dtype
    if not isinstance(got, np.ndarray) or got.dtype != want or got.shape != ref.shape:
        return Check(
            name, False, float("inf"), float("inf"),
            f"{name}: expected ndarray({want.name}, shape={ref.shape}); got {_kind(got)}",
        )
    bad = np.argwhere(got != ref)
    if bad.size:
        first = tuple(int(i) for i in bad[0])
        row = first[0] if ref.ndim > 1 else first
        return Check(
            name,
            False,
            float("inf"),
            float(np.abs(got.astype(np.int64) - ref.astype(np.int64)).max()),
            f"{name}: {len(bad)} element(s) differ, first at {first}: got {got[row].tolist()}, "
            f"reference {ref[row].tolist()} (integers must be exact)",
        )
    return Check(name, True)


def _exact_tensor(name: str, got: Any, ref: Any) -> Check:
    """Data movement: same encoding, same codes (or the same float values)."""
    if isinstance(ref, BlockScaledTensor):
        if (
            not isinstance(got, BlockScaledTensor)
            or got.format is not ref.format
            or got.shape != ref.shape
            or got.axis != ref.axis
        ):
            return Check(name, False, float("inf"), float("inf"), f"{name}: expected {_kind(ref)}; got {_kind(got)}")
        for part, g, r in (("data", got.data_codes(), ref.data_codes()), ("scale", got.scale_codes(), ref.scale_codes())):
            bad = np.argwhere(g != r)
            if bad.size:
                first = tuple(int(i) for i in bad[0])
                return Check(
                    name,
                    False,
                    float("inf"),
                    float("inf"),
                    f"{name}: {len(bad)} {part} code(s) differ, first at {first}: got {int(g[first]):#04x}, "
                    f"reference {int(r[first]):#04x} (codes must move unchanged)",
                )
        return Check(name, True)
    wrong = _expect_array(name, got, ref.dtype, ref.shape)
    if wrong is not None:
        return wrong
    c = compare(name, got, ref, 0.0)
    return Check(name, c.ok, c.ratio, c.max_abs_error, c.describe() + ("" if c.ok else " (must be exact)"))
