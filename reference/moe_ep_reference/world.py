"""The MoeEp reference: a whole EP world of ``num_ranks`` ranks in one process.

Everything is computed in float64 from exactly decoded inputs; the spec's
rounding points (input decode, the optional FC2-operand rounding, the per-route
combine round trip, the final output encode, and the bf16 ``fc1_c`` stash) are
applied exactly where the spec puts them and nowhere else. float64 makes the
reference the exact-arithmetic limit for every practical shape: its own error
(about ``n * 2^-53`` relative for a reduction of length n) is millions of times
below the float32 accumulation a backend is allowed, so a tolerance budget
measures the backend's error alone.

The functions take and return per-rank lists; they validate nothing (the
backend class does) and never modify their inputs.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from moe_ep_spec.api import DispatchHandle, Tensor
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import CapacityError
from moe_ep_spec.formats import BlockScaledTensor, MoeFormat, dequantize, quantize, round_to_bf16, round_trip
from moe_ep_spec.tolerance import (
    FP32_MIN_NORMAL,
    FP32_MIN_SUBNORMAL,
    FP32_UNIT_ROUNDOFF,
    SAFETY,
    exact_reduction,
    gamma,
    dot_quantum,
    product_bound,
    quantum,
    reduction_bound,
    rounding_error_bound,
    underflow,
)

__all__ = [
    "plan",
    "gather",
    "scatter_slots",
    "encode_output",
    "decode",
    "expert_forward",
    "expert_backward",
    "bf16_operand",
    "sum_slots",
]


def decode(t: Tensor) -> np.ndarray:
    """The float64 value of a plain array or a BlockScaledTensor (spec section 8.5).

    Every input value is a float32 value and decodes exactly, except an mxfp8
    value of magnitude ``2^128`` or more (E4M3 >= 2 at scale ``2^127``), which is
    beyond float32's range and decodes to +-inf, as it does on every float32
    backend."""
    if isinstance(t, BlockScaledTensor):
        with np.errstate(over="ignore"):
            return dequantize(t, np.float32).astype(np.float64)  # exact below 2^128, +-inf above
    return dequantize(t, np.float64)


def plan(config: MoeEpConfig, topk_idx: Sequence[np.ndarray]) -> List[DispatchHandle]:
    """The routing plan of every rank, as the handle each rank's dispatch returns.

    Valid (token, slot) pairs of every source rank, in token-major order, go to
    the rank that holds their expert; every destination orders its rows
    expert-major: local expert, then source rank, then source token, then slot.
    Static layout: each expert's slab starts at a multiple of
    ``expert_alignment``, the buffer has ``recv_capacity`` rows, and padding
    rows have metadata -1. Raises :class:`CapacityError` when the aligned rows
    do not fit ``recv_capacity``.
    """
    el, n_ranks = config.num_local_experts, config.num_ranks
    per_dest: List[List[np.ndarray]] = [[] for _ in range(n_ranks)]
    for src, idx in enumerate(topk_idx):
        idx = np.asarray(idx, dtype=np.int64)
        t, k = np.nonzero(idx >= 0)  # row-major: token-major order
        e = idx[t, k]
        dest = e // el
        rows = np.stack([e % el, np.full_like(t, src), t, k], axis=1)
        for d in range(n_ranks):
            per_dest[d].append(rows[dest == d])
    handles = []
    for d in range(n_ranks):
        rows = np.concatenate(per_dest[d], axis=0) if per_dest[d] else np.zeros((0, 4), np.int64)
        rows = rows[np.argsort(rows[:, 0], kind="stable")]  # already (src, token, slot) ordered
        counts = np.bincount(rows[:, 0], minlength=el).astype(np.int64)
        if config.static_layout:
            align = config.expert_alignment
            slabs = -(-counts // align) * align
            offsets = np.concatenate([[0], np.cumsum(slabs)]).astype(np.int64)
            if offsets[-1] > config.recv_capacity:
                raise CapacityError(
                    f"rank {d}: received rows after aligning every expert's slab to expert_alignment = {align} "
                    f"must be <= recv_capacity = {config.recv_capacity}; got {int(offsets[-1])} "
                    f"({len(rows)} routes, per local expert {counts.tolist()})",
                    limit=config.recv_capacity,
                    got=int(offsets[-1]),
                )
            meta = np.full((config.recv_capacity, 4), -1, dtype=np.int32)
            for e in range(el):
                meta[offsets[e] : offsets[e] + counts[e]] = rows[rows[:, 0] == e]
        else:
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            meta = rows.astype(np.int32)
        handles.append(
            DispatchHandle(
                rank=d,
                num_ranks=n_ranks,
                num_tokens=int(np.shape(topk_idx[d])[0]),
                num_topk=config.num_topk,
                route_metadata=meta,
                tokens_per_expert=counts,
                expert_offsets=offsets,
            )
        )
    return handles


def gather(handles: Sequence[DispatchHandle], per_src: Sequence[np.ndarray], by_slot: bool = False) -> List[np.ndarray]:
    """Rows of per-source arrays, placed at every destination's received rows.

    ``per_src[r]`` is ``[T_r, ...]`` (indexed by source token) or, with
    ``by_slot``, ``[T_r, K, ...]`` (indexed by token and slot). Padding rows are
    zero. Returns one ``[R_d, ...]`` array per destination.
    """
    out = []
    for h in handles:
        meta = h.route_metadata
        valid = meta[:, 0] >= 0
        tail = per_src[0].shape[2:] if by_slot else per_src[0].shape[1:]
        rows = np.zeros((meta.shape[0],) + tail, dtype=per_src[0].dtype)
        for src in range(len(per_src)):
            sel = valid & (meta[:, 1] == src)
            if not sel.any():
                continue
            t = meta[sel, 2]
            rows[sel] = per_src[src][t, meta[sel, 3]] if by_slot else per_src[src][t]
        out.append(rows)
    return out


def scatter_slots(
    config: MoeEpConfig, handles: Sequence[DispatchHandle], rows: Sequence[np.ndarray]
) -> List[np.ndarray]:
    """Send every received row back to its (source token, slot).

    ``rows[d]`` is ``[R_d, ...]``. Returns per source rank ``[T, K, ...]`` float64;
    slots that carry no route (``-1``) are exactly zero. Padding rows are never read.
    """
    tail = rows[0].shape[1:]
    out = [np.zeros((h.num_tokens, config.num_topk) + tail, dtype=np.float64) for h in handles]
    for h, r in zip(handles, rows):
        meta = h.route_metadata
        valid = meta[:, 0] >= 0
        for src in range(len(handles)):
            sel = valid & (meta[:, 1] == src)
            if sel.any():
                out[src][meta[sel, 2], meta[sel, 3]] = r[sel]
    return out


def sum_slots(per_slot: np.ndarray) -> np.ndarray:
    """Sum ``[T, K, H]`` over K in slot order (the Form-A reduction)."""
    acc = np.zeros((per_slot.shape[0],) + per_slot.shape[2:], dtype=np.float64)
    for k in range(per_slot.shape[1]):
        acc = acc + per_slot[:, k]
    return acc


def encode_output(config: MoeEpConfig, values: np.ndarray) -> Tensor:
    """The final ``[T, H]`` encode in ``config.output_format`` (blocked along H)."""
    if config.output_format is MoeFormat.BF16:
        return round_to_bf16(values)
    return quantize(values, config.output_format, axis=1)


def _silu_parts(g: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    with np.errstate(over="ignore", invalid="ignore"):  # NaN/inf tokens stay in their rows
        sig = 1.0 / (1.0 + np.exp(-g))
        return sig, g * sig


def _clamp(config: MoeEpConfig, g: np.ndarray, u: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    limit = config.gate_up_clamp
    if limit is None:
        return g, u
    return np.minimum(g, limit), np.clip(u, -limit, limit)


def expert_forward(config: MoeEpConfig, handle: DispatchHandle, x: np.ndarray, w: np.ndarray, fc1: np.ndarray,
                   fc2: np.ndarray,
                   with_bound: bool = False) -> Tuple[np.ndarray, np.ndarray, Optional[Tuple[np.ndarray, np.ndarray]]]:
    """The SwiGLU experts of one rank on its received rows.

    Args:
        x: ``[R, H]`` float64 received rows (padding rows zero).
        w: ``[R]`` float64 router weights.
        fc1: ``[E_local, H, 2I]`` float64; fc2: ``[E_local, I, H]`` float64.
        with_bound: also return the error budget of every route's ``y``.

    Returns:
        ``y`` ``[R, H]`` float64 (after the combine-format round trip; padding
        rows zero), ``c`` ``[R, 2I]`` float64 (the FC1 output; padding zero) and,
        with ``with_bound``, the budgets ``([R, H], [R, 2I])``: how far a
        float32-accumulating implementation's ``y`` and bf16 ``fc1_c`` may be
        from these (see :mod:`moe_ep_spec.tolerance`), else None.
    """
    i_size, h_size = config.intermediate, config.hidden
    y = np.zeros((x.shape[0], h_size), dtype=np.float64)
    c_all = np.zeros((x.shape[0], 2 * i_size), dtype=np.float64)
    bound = np.zeros_like(y) if with_bound else None
    c_bound = np.zeros_like(c_all) if with_bound else None
    u32 = FP32_UNIT_ROUNDOFF * SAFETY
    for e in range(config.num_local_experts):
        lo = int(handle.expert_offsets[e])
        sl = slice(lo, lo + int(handle.tokens_per_expert[e]))
        if sl.start == sl.stop:
            continue
        c = x[sl] @ fc1[e] + 0.0  # a zero sum is +0 (spec 6.3), whatever the matmul's own zero sign
        c_all[sl] = c
        g, u = _clamp(config, c[:, :i_size], c[:, i_size:])
        sig, s = _silu_parts(g)
        h = s * u
        we = w[sl, None]
        op = we * h if config.apply_topk_in_fc1 else h
        op_r = round_trip(op, config.intermediate_format, axis=-1)
        z = op_r @ fc2[e] + 0.0
        ye = z if config.apply_topk_in_fc1 else we * z
        y[sl] = round_trip(ye, config.combine_format, axis=-1)
        if bound is None:
            continue
        # First-order propagation of float32 accumulation error (tolerance module);
        # a reduction that is exact in float32 whatever the order gets no allowance.
        abs_c = np.abs(x[sl]) @ np.abs(fc1[e])
        exact_c = exact_reduction(abs_c, dot_quantum(x[sl], fc1[e]))
        dc = reduction_bound(abs_c, h_size, exact_c)
        c_bound[sl] = rounding_error_bound(c, dc, MoeFormat.BF16)
        dh_dg = np.abs(u * sig * (1.0 + g * (1.0 - sig)))
        # Below float32's normal range relative bounds fail: sigmoid is 0 or
        # subnormal for g below about -87 (an absolute error up to 2^-126), and
        # s = g * sig, h = s * u may round to the subnormal grid.
        tiny = SAFETY * (
            np.abs(u) * (np.abs(g) * FP32_MIN_NORMAL + FP32_MIN_SUBNORMAL * (s != 0)) + FP32_MIN_SUBNORMAL * (h != 0)
        )
        dh = dh_dg * dc[:, :i_size] + np.abs(s) * dc[:, i_size:] + 4 * u32 * np.abs(h) + tiny
        if config.apply_topk_in_fc1:
            d_op = np.abs(we) * dh + (u32 * np.abs(op) + SAFETY * FP32_MIN_SUBNORMAL) * (op != 0)
        else:
            d_op = dh
        d_op = rounding_error_bound(op, d_op, config.intermediate_format, axis=-1)
        abs_z = np.abs(op_r) @ np.abs(fc2[e])
        exact_z = exact_reduction(abs_z, dot_quantum(op_r, fc2[e]))
        exact_z &= (d_op == 0).all(axis=1, keepdims=True)  # the backend's operand is the reference's
        dz = d_op @ np.abs(fc2[e]) + reduction_bound(abs_z, i_size, exact_z)
        if config.apply_topk_in_fc1:
            dy = dz
        else:
            exact_y = (dz == 0) & exact_reduction(np.abs(ye), quantum(we) * quantum(z))  # w * z exact in float32
            dy = np.abs(we) * dz + np.where(exact_y, 0.0, u32 * np.abs(ye) + SAFETY * FP32_MIN_SUBNORMAL)
        bound[sl] = rounding_error_bound(ye, dy, config.combine_format, axis=-1)
    return y, c_all, None if bound is None else (bound, c_bound)


def bf16_operand(values: np.ndarray) -> np.ndarray:
    """A backward GEMM operand rounded to bf16 (nearest, ties to even), as float64:
    the rounding points of ``backward_operand_format = "bf16"`` (spec section 9.2)."""
    return round_to_bf16(values).astype(np.float64)


def expert_backward(config: MoeEpConfig, handle: DispatchHandle, x: np.ndarray, w: np.ndarray, fc1: np.ndarray,
                    fc2: np.ndarray, c: np.ndarray, dy: np.ndarray,
                    with_bound: bool = False) -> Tuple[Tuple[np.ndarray, ...], Optional[Tuple[np.ndarray, ...]]]:
    """The spec backward of one rank's experts (straight-through roundings).

    With ``config.backward_operand_format`` bf16 the cotangent rows, ``dc``
    and ``w * h`` are rounded to bf16 (:func:`bf16_operand`) where section 9.2
    puts them, and their GEMMs take the rounded values; everything else is
    float64 as in the exact mode (None).

    Args:
        x, w, fc1, fc2: as :func:`expert_forward`.
        c: ``[R, 2I]`` float64, the stash ``fc1_c`` decoded (pre-clamp, unweighted).
        dy: ``[R, H]`` float64, the output cotangent of every route's token.
        with_bound: also return error budgets of the four results.

    Returns:
        ``(dx [R, H], dw [R], dfc1 [E_local, H, 2I], dfc2 [E_local, I, H])``
        float64 with padding rows zero, and the same four budgets (or None).
    """
    i_size, h_size, limit = config.intermediate, config.hidden, config.gate_up_clamp
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    dfc1, dfc2 = np.zeros_like(fc1), np.zeros_like(fc2)
    bounds = (np.zeros_like(dx), np.zeros_like(dw), np.zeros_like(dfc1), np.zeros_like(dfc2)) if with_bound else None
    u32 = FP32_UNIT_ROUNDOFF * SAFETY
    bf16_ops = config.backward_operand_format is not None
    for e in range(config.num_local_experts):
        lo = int(handle.expert_offsets[e])
        n_e = int(handle.tokens_per_expert[e])
        sl = slice(lo, lo + n_e)
        if n_e == 0:
            continue
        g_raw, u_raw = c[sl, :i_size], c[sl, i_size:]
        if limit is None:
            gate_mask = up_mask = np.ones_like(g_raw)
        else:
            gate_mask = (g_raw <= limit).astype(np.float64)
            up_mask = ((u_raw >= -limit) & (u_raw <= limit)).astype(np.float64)
        g, u = _clamp(config, g_raw, u_raw)
        sig, s = _silu_parts(g)
        h = s * u
        we = w[sl, None]
        dye = bf16_operand(dy[sl]) if bf16_ops else dy[sl]
        dy_w2t = dye @ fc2[e].T
        hw2 = h @ fc2[e]
        wh = we * h
        wh_op = bf16_operand(wh) if bf16_ops else wh
        if config.apply_topk_in_fc1:
            dfc2[e] = wh_op.T @ dye
            dw[sl] = np.sum(dy_w2t * h, axis=1)
        else:
            dfc2[e] = wh_op.T @ dye if bf16_ops else h.T @ (we * dye)
            dw[sl] = np.sum(dye * hw2, axis=1)
        dh = dy_w2t * we
        fg = u * sig * (1.0 + g * (1.0 - sig)) * gate_mask
        fu = s * up_mask
        dc = np.concatenate([dh * fg, dh * fu], axis=1)
        dc_op = bf16_operand(dc) if bf16_ops else dc
        dfc1[e] = x[sl].T @ dc_op
        dx[sl] = dc_op @ fc1[e].T
        if bounds is None:
            continue
        b_dx, b_dw, b_dfc1, b_dfc2 = bounds
        a_dyw = np.abs(dye) @ np.abs(fc2[e]).T  # bounds |dY W2^T|
        tiny = SAFETY * FP32_MIN_SUBNORMAL  # one float32 rounding in the subnormal range
        e_dh = (gamma(h_size) * a_dyw + u32 * a_dyw + underflow(h_size)) * np.abs(we) + tiny
        a_dh = a_dyw * np.abs(we)
        a_fg, a_fu = np.abs(fg), np.abs(fu)
        # Evaluating silu' in float32 errs relative to its terms, not to its value
        # (1 + g(1 - sig) cancels near g = -1.28): bound it by the terms' magnitudes.
        a_fg_terms = np.abs(u) * sig * (1.0 + np.abs(g) * (1.0 - sig)) * gate_mask
        # sigmoid in float32 is 0 or subnormal below g = -87: an absolute error up to 2^-126.
        sig_abs = SAFETY * FP32_MIN_NORMAL
        e_dc = np.concatenate(
            [
                e_dh * a_fg + 8 * u32 * a_dh * a_fg_terms + (a_dh * np.abs(u) * (1.0 + np.abs(g)) * sig_abs + tiny) * gate_mask,
                e_dh * a_fu + 4 * u32 * a_dh * a_fu + (a_dh * np.abs(g) * sig_abs + tiny) * up_mask,
            ],
            axis=1,
        )
        a_dc = np.concatenate([a_dh * a_fg, a_dh * a_fu], axis=1)
        a_wh = np.abs(wh)
        h_abs = np.abs(u) * np.abs(g) * sig_abs + tiny  # h's absolute error below the normal range
        if bf16_ops:
            # The bf16 operands: RB_bf16 of the float32 value's bound at each
            # rounding point, then the GEMM on the rounded operands; a GEMM whose
            # operands are the reference's (bound 0) and that is exact in float32
            # gets nothing.
            b_dc = rounding_error_bound(dc, e_dc, MoeFormat.BF16)
            b_dx[sl] = product_bound(dc_op, fc1[e].T, lhs_error=b_dc)
            b_dfc1[e] = product_bound(x[sl].T, dc_op, rhs_error=b_dc)
            # w*h from the exact stash: h's float32 evaluation (4 eps and the SiLU
            # underflow term), then one more rounding for the product with w.
            d_wh = np.abs(we) * (4 * u32 * np.abs(h) + h_abs) + (u32 * a_wh + tiny) * (wh != 0)
            b_wh = rounding_error_bound(wh, d_wh, MoeFormat.BF16)
            b_dfc2[e] = product_bound(wh_op.T, dye, lhs_error=b_wh.T)
        else:
            b_dfc1[e] = np.abs(x[sl]).T @ e_dc + gamma(n_e) * (np.abs(x[sl]).T @ a_dc) + underflow(n_e)
            b_dx[sl] = e_dc @ np.abs(fc1[e]).T + gamma(2 * i_size) * (a_dc @ np.abs(fc1[e]).T) + underflow(2 * i_size)
            b_dfc2[e] = (
                (gamma(n_e) + 4 * u32) * (a_wh.T @ np.abs(dye)) + (np.abs(we) * h_abs).T @ np.abs(dye) + underflow(n_e)
            )
        if config.apply_topk_in_fc1:
            b_dw[sl] = np.sum((gamma(h_size) * a_dyw + gamma(i_size) * a_dyw + 4 * u32 * a_dyw) * np.abs(h), axis=1)
            b_dw[sl] += np.sum(a_dyw * h_abs + underflow(h_size) * np.abs(h), axis=1) + underflow(i_size)
        else:
            a_hw2 = np.abs(h) @ np.abs(fc2[e])
            b_dw[sl] = np.sum(np.abs(dye) * (gamma(i_size) + gamma(h_size) + 4 * u32) * a_hw2, axis=1)
            b_dw[sl] += np.sum(np.abs(dye) * (h_abs @ np.abs(fc2[e]) + underflow(i_size)), axis=1) + underflow(h_size)
    return (dx, dw, dfc1, dfc2), bounds


def stack_tokens(tokens: Sequence[Tensor]) -> Optional[str]:
    """Why the ranks' tokens cannot travel together (different encodings), or None."""
    first = tokens[0]
    for r, t in enumerate(tokens[1:], start=1):
        if _encoding(first) != _encoding(t):
            return f"rank {r} passes {_encoding(t)} while rank 0 passes {_encoding(first)}"
    return None


def _encoding(t: Tensor) -> str:
    return t.format.value if isinstance(t, BlockScaledTensor) else t.dtype.name


def gather_tokens(handles: Sequence[DispatchHandle], tokens: Sequence[Tensor]) -> List[Tensor]:
    """Dispatch's data movement: received rows in the tokens' own encoding
    (block-scaled codes and scales move unchanged); padding rows zero codes."""
    if not isinstance(tokens[0], BlockScaledTensor):
        return gather(handles, tokens)
    fmt = tokens[0].format
    datas = gather(handles, [t.data for t in tokens])
    scales = gather(handles, [t.scale.view(np.uint8) for t in tokens])
    hidden = tokens[0].shape[1]
    return [
        BlockScaledTensor(data=d, scale=s.view(fmt.scale_dtype), format=fmt, shape=(d.shape[0], hidden), axis=1)
        for d, s in zip(datas, scales)
    ]
