"""The native core's CPU entry points on numpy arrays.

Each function checks dtypes and shapes in Python (:class:`~moe_ep_spec.ShapeError`,
:class:`~moe_ep_spec.DTypeError`), allocates its outputs, and calls the C ABI
with ``MOE_EP_DEVICE_CPU``; a failure status raises
:class:`~moe_ep_spec.NativeArgumentError` or :class:`~moe_ep_spec.NativeError`
with the library's message. Nothing is returned uninitialised: the library
writes every output element.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import numpy as np

from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import DTypeError, FormatError, NativeArgumentError, ShapeError
from moe_ep_spec.formats import BF16, BlockScaledTensor, MoeFormat, block_axis, parse_format
from moe_ep_spec.validation import check_shape

from ._capi import DType, ExpertDesc, Format, Status, call, load

__all__ = ["quantize", "dequantize", "dequantize_bf16", "plan_routes", "permute_rows", "combine_reduce",
           "combine_reduce_encode", "expert_forward",
           "expert_backward", "RoutePlan", "ExpertOutputs", "ExpertGrads", "expert_desc"]

_CPU = 0
_FORMAT = {MoeFormat.BF16: Format.BF16, MoeFormat.MXFP8: Format.MXFP8, MoeFormat.NVFP4: Format.NVFP4}


def _ptr(a: Optional[np.ndarray]) -> Optional[int]:
    return None if a is None else a.ctypes.data


def _float32(x: Any, name: str) -> np.ndarray:
    """float32 (float16 / bfloat16 widen exactly); other dtypes are rejected."""
    a = np.asarray(x)
    if a.dtype in (np.float16, BF16):
        a = a.astype(np.float32)
    if a.dtype != np.float32:
        raise DTypeError(f"{name} must be float32, float16 or bfloat16; got dtype {a.dtype.name}", name=name,
                         expected="float32", got=a.dtype.name)
    return np.ascontiguousarray(a)


def _int32(x: Any, name: str) -> np.ndarray:
    """An int32 copy of an integer array whose values fit int32 (never wrapped)."""
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.integer):
        raise DTypeError(f"{name} must be an integer array; got dtype {a.dtype.name}", name=name, expected="int32",
                         got=a.dtype.name)
    if a.size and a.dtype.itemsize >= 4 and a.dtype != np.int32:
        lo, hi = int(a.min()), int(a.max())
        if lo < -(2**31) or hi > 2**31 - 1:
            bad = lo if lo < -(2**31) else hi
            raise NativeArgumentError(f"{name} values must fit int32 [-2^31, 2^31); got {bad}", op="moe_ep_native.host",
                                      status=int(Status.INVALID_ARGUMENT), status_name="MOE_EP_ERR_INVALID_ARGUMENT")
    return np.ascontiguousarray(a, dtype=np.int32)


def _view(shape: tuple, axis: int) -> tuple:
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    return outer, int(shape[axis]), inner


# ----------------------------------------------------------------------------- formats


def quantize(x: Any, fmt: Union[MoeFormat, str], *, axis: int = -1) -> Union[BlockScaledTensor, np.ndarray]:
    """Encode ``x`` (``[any shape]`` float32, or float16/bfloat16 widened exactly)
    in ``fmt`` along ``axis``: a ``bfloat16`` array for bf16, else a
    :class:`~moe_ep_spec.BlockScaledTensor` (the layout of :func:`moe_ep_spec.quantize`)."""
    fmt = parse_format(fmt)
    a = _float32(x, "x")
    if fmt is MoeFormat.BF16:
        out = np.empty(a.shape, np.uint16)
        call("moe_ep_quantize", _CPU, None, Format.BF16, _ptr(a), a.size, 1, 1, _ptr(out), None)
        return out.view(BF16)
    axis = block_axis(a.ndim, axis)
    outer, n, inner = _view(a.shape, axis)
    block = fmt.block_size
    data_n = -(-n // 2) if fmt is MoeFormat.NVFP4 else n
    data = np.empty(a.shape[:axis] + (data_n,) + a.shape[axis + 1 :], np.uint8)
    scale = np.empty(a.shape[:axis] + (-(-n // block),) + a.shape[axis + 1 :], np.uint8)
    call("moe_ep_quantize", _CPU, None, _FORMAT[fmt], _ptr(a), outer, n, inner, _ptr(data), _ptr(scale))
    return BlockScaledTensor(data=data.view(fmt.data_dtype), scale=scale.view(fmt.scale_dtype), format=fmt,
                             shape=tuple(a.shape), axis=axis)


def dequantize(t: Union[BlockScaledTensor, np.ndarray]) -> np.ndarray:
    """Decode a :class:`~moe_ep_spec.BlockScaledTensor` or a bfloat16 array to float32, exactly."""
    if isinstance(t, BlockScaledTensor):
        t.validate()
        outer, n, inner = _view(t.shape, t.axis)
        out = np.empty(t.shape, np.float32)
        data = np.ascontiguousarray(t.data).view(np.uint8)
        scale = np.ascontiguousarray(t.scale).view(np.uint8)
        call("moe_ep_dequantize", _CPU, None, _FORMAT[t.format], _ptr(data), _ptr(scale), outer, n, inner, _ptr(out))
        return out
    a = np.asarray(t)
    if a.dtype != BF16:
        raise DTypeError(f"dequantize takes a BlockScaledTensor or a bfloat16 array; got dtype {a.dtype.name}",
                         name="t", expected="bfloat16", got=a.dtype.name)
    bits = np.ascontiguousarray(a).view(np.uint16)
    out = np.empty(a.shape, np.float32)
    call("moe_ep_dequantize", _CPU, None, Format.BF16, _ptr(bits), None, bits.size, 1, 1, _ptr(out))
    return out


def dequantize_bf16(t: BlockScaledTensor, *, transpose: bool = False) -> Tuple[np.ndarray, bool]:
    """Decode a :class:`~moe_ep_spec.BlockScaledTensor` to bfloat16 without rounding
    (``moe_ep_dequantize_bf16``): ``(values, inexact)``.

    Returns:
        values: ``[t.shape] bfloat16``: the exact decoded values; NaN where bf16 cannot
            hold one (mxfp8 magnitudes below 2^-126 off bf16's subnormal grid). With
            ``transpose``: ``[t.shape[:-2] + (t.shape[-1], t.shape[-2])] bfloat16``,
            the last two axes swapped (needs ``t`` blocked along its last axis).
        inexact: whether some value was not a bf16 value.
    """
    if not isinstance(t, BlockScaledTensor):
        raise DTypeError(f"dequantize_bf16 takes a BlockScaledTensor; got {type(t).__name__}", name="t", got=type(t))
    t.validate()
    outer, n, inner = _view(t.shape, t.axis)
    rows = 0
    out_shape = t.shape
    if transpose:
        if len(t.shape) < 2 or t.axis != len(t.shape) - 1:
            raise ShapeError(
                f"dequantize_bf16(transpose=True) needs a tensor of >= 2 axes blocked along its last axis; got shape "
                f"{t.shape} blocked along axis {t.axis}", name="t", got=t.shape)
        rows = int(t.shape[-2])
        out_shape = t.shape[:-2] + (t.shape[-1], t.shape[-2])
    out = np.empty(out_shape, np.uint16)
    flag = np.zeros(1, np.int32)
    data = np.ascontiguousarray(t.data).view(np.uint8)
    scale = np.ascontiguousarray(t.scale).view(np.uint8)
    if out.size:
        call("moe_ep_dequantize_bf16", _CPU, None, _FORMAT[t.format], _ptr(data), _ptr(scale), outer, n, inner, rows,
             _ptr(out), _ptr(flag))
    return out.view(BF16), bool(flag[0])


# ----------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class RoutePlan:
    """One rank's routing plan (``moe_ep_plan_routes``).

    Attributes:
        send_route: ``[num_tokens * num_topk] int32``: route ids sorted by (expert,
            route id); routed ones first, then the unrouted ones in route order.
        route_pos: ``[num_tokens * num_topk] int32``: send position of each route id, -1 if unrouted.
        route_expert: ``[num_tokens * num_topk] int32``: expert of each route id, -1 if unrouted.
        counts: ``[num_experts] int32``: routes per expert.
        num_bad: expert ids outside ``[-1, num_experts)`` (input errors, not routed).
    """

    send_route: np.ndarray
    route_pos: np.ndarray
    route_expert: np.ndarray
    counts: np.ndarray
    num_bad: int


def plan_routes(topk_idx: Any, num_experts: int) -> RoutePlan:
    """Plan routes of ``topk_idx`` (``[num_tokens, num_topk]`` int, -1 = unused slot)."""
    idx = _int32(topk_idx, "topk_idx")
    if idx.ndim != 2:
        raise ShapeError(f"topk_idx must be 2-d (num_tokens, num_topk); got shape {idx.shape}", name="topk_idx")
    t, k = idx.shape
    send, pos, exp = (np.empty(t * k, np.int32) for _ in range(3))
    counts = np.empty(int(num_experts) + 1, np.int32) if num_experts >= 0 else np.empty(0, np.int32)
    call("moe_ep_plan_routes", _CPU, None, _ptr(idx), t, k, int(num_experts), _ptr(send), _ptr(pos), _ptr(exp),
         _ptr(counts))
    return RoutePlan(send, pos, exp, counts[:-1].copy(), int(counts[-1]))


def permute_rows(tokens: np.ndarray, send_route: Any, num_topk: int) -> np.ndarray:
    """``out[i] = tokens[send_route[i] // num_topk]`` (zero row where -1); any dtype, codes unchanged.

    Args:
        tokens: ``[num_tokens, ...]`` any dtype.
        send_route: ``[num_rows]`` int: route ids in ``[0, num_tokens * num_topk)`` or -1.
    """
    tok = np.ascontiguousarray(tokens)
    if tok.dtype.hasobject:
        raise DTypeError(f"tokens must hold plain values (rows are copied as bytes); got dtype {tok.dtype}",
                         name="tokens", got=str(tok.dtype))
    if tok.ndim < 1:
        raise ShapeError("tokens must have a row axis; got a scalar", name="tokens")
    route = _int32(send_route, "send_route").reshape(-1)
    out = np.empty((route.size,) + tok.shape[1:], tok.dtype)
    row_bytes = tok.dtype.itemsize * int(np.prod(tok.shape[1:], dtype=np.int64))
    call("moe_ep_permute_rows", _CPU, None, _ptr(tok), tok.shape[0], int(num_topk), row_bytes, _ptr(route),
         route.size, _ptr(out))
    return out


def _reduce_args(rows: Any, route_pos: Optional[Any], num_tokens: int, num_topk: int,
                 round_trip: Optional[str]) -> Tuple[Optional[MoeFormat], bool, np.ndarray, Optional[np.ndarray]]:
    """The checked arguments every combine_reduce entry takes: ``(round_trip format or None,
    bf16 rows?, rows [R, H] contiguous, route_pos [T*K] int32 or None)``."""
    fmt = None if round_trip is None else parse_format(round_trip, name="round_trip")
    if fmt is not None and fmt not in (MoeFormat.MXFP8, MoeFormat.NVFP4):
        raise FormatError(f"round_trip must be None, 'mxfp8' or 'nvfp4' (a block format); got {round_trip!r}")
    bf16 = fmt is None and np.asarray(rows).dtype == BF16
    r = np.ascontiguousarray(np.asarray(rows)) if bf16 else _float32(rows, "rows")
    if r.ndim != 2:
        raise ShapeError(f"rows must be 2-d (num_rows, hidden); got shape {r.shape}", name="rows")
    pos = None if route_pos is None else _int32(route_pos, "route_pos").reshape(-1)
    if pos is not None:
        check_shape("route_pos", pos.shape, (num_tokens * num_topk,), "(num_tokens * num_topk,)")
    return fmt, bf16, r, pos


def combine_reduce(rows: Any, route_pos: Optional[Any], num_tokens: int, num_topk: int,
                   round_trip: Optional[str] = None) -> np.ndarray:
    """Form-A reduction: ``out[t] = sum over slots k (in order, from +0) of rows[route_pos[t*K+k]]``.

    Args:
        rows: ``[num_rows, hidden] float32`` (float16 widened), or ``bfloat16``: summed
            from the bf16 rows themselves (``moe_ep_combine_reduce_bf16``, the same sums).
        route_pos: ``[num_tokens * num_topk]`` int (-1 = nothing), or None for row ``t*K+k``.
        round_trip: None, or ``"mxfp8"`` / ``"nvfp4"``: every row read goes through that
            format's round trip first (float32 rows only; ``moe_ep_combine_reduce_round_trip``).

    Returns:
        ``[num_tokens, hidden] float32``.
    """
    fmt, bf16, r, pos = _reduce_args(rows, route_pos, num_tokens, num_topk, round_trip)
    out = np.empty((int(num_tokens), r.shape[1]), np.float32)
    tail = (_ptr(r), r.shape[0], _ptr(pos), int(num_tokens), int(num_topk), r.shape[1], _ptr(out))
    if fmt is not None:
        call("moe_ep_combine_reduce_round_trip", _CPU, None, int(_FORMAT[fmt]), *tail)
    else:
        call("moe_ep_combine_reduce_bf16" if bf16 else "moe_ep_combine_reduce", _CPU, None, *tail)
    return out


def combine_reduce_encode(rows: Any, route_pos: Optional[Any], num_tokens: int, num_topk: int,
                          out_format: Union[MoeFormat, str], round_trip: Optional[str] = None,
                          error: bool = False) -> Union[BlockScaledTensor, np.ndarray]:
    """:func:`combine_reduce`'s sums (``round_trip`` as there), all NaN when ``error``,
    encoded in ``out_format`` along the last axis in the same pass
    (``moe_ep_combine_reduce_encode``): the bits of ``quantize(sums, out_format)``.

    Args:
        rows: ``[num_rows, hidden] float32`` (float16 widened), or ``bfloat16`` (with no round trip).
        route_pos: ``[num_tokens * num_topk]`` int (-1 = nothing), or None for row ``t*K+k``.
        out_format: bf16, mxfp8 or nvfp4.
        round_trip: None, ``"mxfp8"`` or ``"nvfp4"``.
        error: the layer's data-dependent error flag: every sum NaN before the encode.

    Returns:
        ``[num_tokens, hidden]``: a ``bfloat16`` array, or a
        :class:`~moe_ep_spec.BlockScaledTensor` blocked along axis 1.
    """
    fmt = parse_format(out_format, name="out_format")
    rt, bf16, r, pos = _reduce_args(rows, route_pos, num_tokens, num_topk, round_trip)
    t, h = int(num_tokens), r.shape[1]
    flag = np.array([1 if error else 0], np.uint8)
    if fmt is MoeFormat.BF16:
        data, scale = np.empty((t, h), np.uint16), None
    else:
        data = np.empty((t, -(-h // 2) if fmt is MoeFormat.NVFP4 else h), np.uint8)
        scale = np.empty((t, -(-h // fmt.block_size)), np.uint8)
    call("moe_ep_combine_reduce_encode", _CPU, None, DType.BF16 if bf16 else DType.F32,
         int(_FORMAT[rt]) if rt is not None else int(Format.NONE), _ptr(r), r.shape[0], _ptr(pos), t, int(num_topk),
         h, _ptr(flag), int(_FORMAT[fmt]), _ptr(data), _ptr(scale))
    if scale is None:
        return data.view(BF16)
    return BlockScaledTensor(data=data.view(fmt.data_dtype), scale=scale.view(fmt.scale_dtype), format=fmt,
                             shape=(t, h), axis=1)


# ----------------------------------------------------------------------------- experts


def expert_desc(config: MoeEpConfig, num_rows: int, num_local_experts: int) -> ExpertDesc:
    """The ``moe_ep_expert_desc`` of a configuration and buffer size."""
    fmt = config.intermediate_format
    return ExpertDesc(
        num_rows=int(num_rows), hidden=config.hidden, intermediate=config.intermediate,
        num_local_experts=int(num_local_experts), apply_topk_in_fc1=int(config.apply_topk_in_fc1),
        has_clamp=int(config.gate_up_clamp is not None),
        gate_up_clamp=float(config.gate_up_clamp or 0.0),
        intermediate_format=int(Format.NONE if fmt is None else _FORMAT[fmt]),
    )


@dataclass(frozen=True)
class ExpertOutputs:
    """``y [C, H] float32``: expert outputs before the combine round trip;
    ``c [C, 2I] float32``: FC1 outputs before the clamp."""

    y: np.ndarray
    c: np.ndarray


@dataclass(frozen=True)
class ExpertGrads:
    """``dx [C, H]``, ``dw [C]``, ``dfc1 [E_local, H, 2I]``, ``dfc2 [E_local, I, H]``, float32."""

    dx: np.ndarray
    dw: np.ndarray
    dfc1: np.ndarray
    dfc2: np.ndarray


def _expert_operands(config: MoeEpConfig, x: Any, w: Any, fc1: Any, fc2: Any, group_sizes: Any) -> tuple:
    xs, ws, w1, w2 = _float32(x, "x"), _float32(w, "w"), _float32(fc1, "fc1"), _float32(fc2, "fc2")
    gs = _int32(group_sizes, "group_sizes")
    h, i = config.hidden, config.intermediate
    if xs.ndim != 2:
        raise ShapeError(f"x must be 2-d (num_rows, hidden); got shape {xs.shape}", name="x")
    c = xs.shape[0]
    if w1.ndim != 3:
        raise ShapeError(f"fc1 must be 3-d (num_local_experts, hidden, 2 * intermediate); got shape {w1.shape}", name="fc1")
    e = w1.shape[0]
    check_shape("x", xs.shape, (c, h), "(num_rows, hidden)")
    check_shape("w", ws.shape, (c,), "(num_rows,)")
    check_shape("fc1", w1.shape, (e, h, 2 * i), "(num_local_experts, hidden, 2 * intermediate)")
    check_shape("fc2", w2.shape, (e, i, h), "(num_local_experts, intermediate, hidden)")
    check_shape("group_sizes", gs.shape, (e,), "(num_local_experts,)")
    return xs, ws, w1, w2, gs, expert_desc(config, c, e)


def expert_forward(config: MoeEpConfig, x: Any, w: Any, fc1: Any, fc2: Any, group_sizes: Any) -> ExpertOutputs:
    """Section 5 on an expert-major buffer (``moe_ep_expert_forward``).

    Args:
        x: ``[C, H] float32``: decoded rows; w: ``[C] float32`` router weights;
        fc1: ``[E_local, H, 2I] float32``; fc2: ``[E_local, I, H] float32``;
        group_sizes: ``[E_local]`` int: slab sizes (>= 0, sum <= C).
    """
    xs, ws, w1, w2, gs, desc = _expert_operands(config, x, w, fc1, fc2, group_sizes)
    lib = load()
    ws_bytes = lib.moe_ep_expert_forward_workspace(ctypes.byref(desc))
    work = np.empty(max(1, ws_bytes), np.uint8)
    y = np.empty((desc.num_rows, desc.hidden), np.float32)
    c = np.empty((desc.num_rows, 2 * desc.intermediate), np.float32)
    call("moe_ep_expert_forward", _CPU, None, ctypes.byref(desc), _ptr(xs), _ptr(ws), _ptr(w1), _ptr(w2), _ptr(gs),
         _ptr(y), _ptr(c), _ptr(work), ws_bytes)
    return ExpertOutputs(y, c)


def expert_backward(config: MoeEpConfig, x: Any, w: Any, fc1: Any, fc2: Any, fc1_c: Any, dy: Any,
                    group_sizes: Any) -> ExpertGrads:
    """Section 9.2 on an expert-major buffer (``moe_ep_expert_backward``).

    Args:
        x, w, fc1, fc2, group_sizes: as :func:`expert_forward`;
        fc1_c: ``[C, 2I] bfloat16``: the stash; dy: ``[C, H] float32``: output cotangents.
    """
    xs, ws, w1, w2, gs, desc = _expert_operands(config, x, w, fc1, fc2, group_sizes)
    stash = np.asarray(fc1_c)
    if stash.dtype != BF16:
        raise DTypeError(f"fc1_c must be bfloat16; got dtype {stash.dtype.name}", name="fc1_c", expected="bfloat16",
                         got=stash.dtype.name)
    check_shape("fc1_c", stash.shape, (desc.num_rows, 2 * desc.intermediate), "(num_rows, 2 * intermediate)")
    stash_bits = np.ascontiguousarray(stash).view(np.uint16)
    dys = _float32(dy, "dy")
    check_shape("dy", dys.shape, (desc.num_rows, desc.hidden), "(num_rows, hidden)")
    lib = load()
    ws_bytes = lib.moe_ep_expert_backward_workspace(ctypes.byref(desc))
    work = np.empty(max(1, ws_bytes), np.uint8)
    e = desc.num_local_experts
    dx = np.empty((desc.num_rows, desc.hidden), np.float32)
    dw = np.empty(desc.num_rows, np.float32)
    dfc1 = np.empty((e, desc.hidden, 2 * desc.intermediate), np.float32)
    dfc2 = np.empty((e, desc.intermediate, desc.hidden), np.float32)
    call("moe_ep_expert_backward", _CPU, None, ctypes.byref(desc), _ptr(xs), _ptr(ws), _ptr(w1), _ptr(w2),
         _ptr(stash_bits), _ptr(dys), _ptr(gs), _ptr(dx), _ptr(dw), _ptr(dfc1), _ptr(dfc2), _ptr(work), ws_bytes)
    return ExpertGrads(dx, dw, dfc1, dfc2)
