"""Deliberately wrong backends: the conformance suite's own test subjects.

Every mutant is the reference (:class:`moe_ep_reference.ReferenceBackend`) with
exactly one rule of ``docs/spec.md`` broken; its docstring names the rule. The
suite must fail each of them (``tests/test_mutants.py``).

How a mutant breaks its rule: by overriding a ReferenceBackend method, or by
replacing functions of ``moe_ep_reference.world`` (or ``moe_ep_spec.formats``,
``moe_ep_spec.validation``, ``moe_ep_reference.backend``) *only for the
duration of one of its own world-level calls*: :func:`patched` swaps the
attributes in, holds a process-wide lock while they are in, and puts the
originals back in a ``finally``. The runner calls the backend under test and the
judging reference (``moe_ep_spec.get_backend("reference")``) one after the
other, never at the same time, so the reference never sees a patch. A mutant
must not be run concurrently with the reference from another thread.

``MUTANTS`` are the mutants the suite must catch; ``GAP_MUTANTS`` break rules
that the conformance table does not exercise at all today (see their docstrings);
the tests mark those as expected failures so that a suite fix shows up.
``BF16_BACKWARD_MUTANTS`` break the rounding points of the bf16-operand backward
(``backward_operand_format = "bf16"``, spec section 9.2); ``tests/test_mutants.py``
checks that the reference's budgets of that mode reject each of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple, Type

import numpy as np

import moe_ep_reference.backend as reference_backend_module
import moe_ep_reference.world as W
import moe_ep_spec.formats as F
import moe_ep_spec.validation as V
from moe_ep_spec.api import DispatchHandle
from moe_ep_spec.formats import BF16, BlockScaledTensor, MoeFormat, round_to_bf16, round_trip
from moe_ep_reference import ReferenceBackend

__all__ = ["MUTANTS", "GAP_MUTANTS", "ALL_MUTANTS", "BF16_BACKWARD_MUTANTS", "PATCH_TARGETS", "patched", "Mutant"]

#: Every (module, attribute) any mutant may replace; the tests check they are
#: all back to their originals after the mutants ran.
PATCH_TARGETS: Tuple[Tuple[Any, str], ...] = (
    (W, "plan"),
    (W, "gather"),
    (W, "scatter_slots"),
    (W, "sum_slots"),
    (W, "encode_output"),
    (W, "expert_forward"),
    (W, "expert_backward"),
    (W, "bf16_operand"),
    (W, "_clamp"),
    (W, "decode"),
    (F, "_mxfp8_scale_exponent"),
    (F, "_nearest_index"),
    (V, "check_topk"),
    (reference_backend_module, "round_trip"),
    (reference_backend_module, "_read_weights"),
)

_LOCK = threading.RLock()

#: A patch: (module, attribute, factory); the factory gets the current attribute
#: and returns its replacement.
Patch = Tuple[Any, str, Callable[[Any], Any]]


@contextlib.contextmanager
def patched(patches: Sequence[Patch]) -> Iterator[None]:
    """Replace module attributes for the duration of the ``with`` block only.

    The lock is held the whole time, so no other thread can run the reference
    while a patch is in; the originals are restored even when the block raises.
    """
    with _LOCK:
        saved: List[Tuple[Any, str, Any]] = []
        try:
            for module, attr, factory in patches:
                original = getattr(module, attr)
                saved.append((module, attr, original))
                setattr(module, attr, factory(original))
            yield
        finally:
            for module, attr, original in reversed(saved):
                setattr(module, attr, original)


class _ConfigView:
    """A read-only view of a MoeEpConfig with some fields overridden (only for
    the ``world`` functions, which read fields and validate nothing)."""

    def __init__(self, base: Any, **overrides: Any) -> None:
        self._base = base
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        overrides = self.__dict__["_overrides"]
        if name in overrides:
            return overrides[name]
        return getattr(self.__dict__["_base"], name)


_OPS = ("forward", "backward", "dispatch", "combine", "dispatch_backward", "combine_backward")


class Mutant(ReferenceBackend):
    """Base of the patching mutants: every world-level operation runs the
    reference with :meth:`patches` (for that operation) in place."""

    name = "mutant-base"
    version = "0.0.0+mutant"

    def patches(self, op: str) -> Sequence[Patch]:
        return ()

    def _run(self, op: str, *args: Any) -> Any:
        with patched(self.patches(op)):
            return getattr(super(), op)(*args)

    def forward(self, config, inputs):  # type: ignore[override]
        return self._run("forward", config, inputs)

    def backward(self, config, inputs, grad_output, stash):  # type: ignore[override]
        return self._run("backward", config, inputs, grad_output, stash)

    def dispatch(self, config, inputs):  # type: ignore[override]
        return self._run("dispatch", config, inputs)

    def combine(self, config, handles, expert_out):  # type: ignore[override]
        return self._run("combine", config, handles, expert_out)

    def dispatch_backward(self, config, handles, grad_tokens, grad_topk_weights):  # type: ignore[override]
        return self._run("dispatch_backward", config, handles, grad_tokens, grad_topk_weights)

    def combine_backward(self, config, handles, grad_output):  # type: ignore[override]
        return self._run("combine_backward", config, handles, grad_output)


def _halves_swapped(a: np.ndarray, i_size: int) -> np.ndarray:
    return np.concatenate([a[..., i_size:], a[..., :i_size]], axis=-1)


# ============================================================================ (a)


class GateUpSwapped(Mutant):
    """Section 3 / 5.1: FC1 columns ``[0, I)`` are gate and ``[I, 2I)`` are up.
    This backend reads gate from ``[I, 2I)`` and up from ``[0, I)``, consistently
    in the forward and the backward (the stash ``fc1_c`` keeps the spec's column
    order)."""

    name = "mutant-gate-up-swapped"

    def patches(self, op: str) -> Sequence[Patch]:
        def fwd(orig):
            def expert_forward(config, handle, x, w, fc1, fc2, with_bound=False):
                i = config.intermediate
                y, c, b = orig(config, handle, x, w, _halves_swapped(fc1, i), fc2, with_bound=with_bound)
                if b is not None:
                    b = (b[0], _halves_swapped(b[1], i))
                return y, _halves_swapped(c, i), b

            return expert_forward

        def bwd(orig):
            def expert_backward(config, handle, x, w, fc1, fc2, c, dy, with_bound=False):
                i = config.intermediate
                (dx, dw, dfc1, dfc2), b = orig(
                    config, handle, x, w, _halves_swapped(fc1, i), fc2, _halves_swapped(c, i), dy, with_bound=with_bound
                )
                return (dx, dw, _halves_swapped(dfc1, i), dfc2), b

            return expert_backward

        return [(W, "expert_forward", fwd), (W, "expert_backward", bwd)]


# ============================================================================ (b)


class ClampGateBothSides(Mutant):
    """Section 5.2: the clamp bounds the gate from above only, ``g = min(g, L)``.
    This backend clips the gate to ``[-L, L]`` (in the forward)."""

    name = "mutant-clamp-gate-both-sides"

    def patches(self, op: str) -> Sequence[Patch]:
        if op != "forward":
            return ()

        def factory(orig):
            def clamp(config, g, u):
                g, u = orig(config, g, u)
                limit = config.gate_up_clamp
                return (g, u) if limit is None else (np.maximum(g, -limit), u)

            return clamp

        return [(W, "_clamp", factory)]


# ============================================================================ (c), (d)


class RouterWeightTwice(Mutant):
    """Section 5.4: the router weight multiplies each route's expert output once.
    This backend applies it twice (``w^2``) in the forward."""

    name = "mutant-router-weight-twice"

    def patches(self, op: str) -> Sequence[Patch]:
        if op != "forward":
            return ()

        def factory(orig):
            def expert_forward(config, handle, x, w, fc1, fc2, with_bound=False):
                return orig(config, handle, x, w * w, fc1, fc2, with_bound=with_bound)

            return expert_forward

        return [(W, "expert_forward", factory)]


class RouterWeightIgnored(Mutant):
    """Section 5.4 / 9.2: the router weight multiplies each route's expert output.
    This backend never applies it (computes as if every weight were 1), in the
    forward and the backward."""

    name = "mutant-router-weight-ignored"

    def patches(self, op: str) -> Sequence[Patch]:
        def fwd(orig):
            def expert_forward(config, handle, x, w, fc1, fc2, with_bound=False):
                return orig(config, handle, x, np.ones_like(w), fc1, fc2, with_bound=with_bound)

            return expert_forward

        def bwd(orig):
            def expert_backward(config, handle, x, w, fc1, fc2, c, dy, with_bound=False):
                return orig(config, handle, x, np.ones_like(w), fc1, fc2, c, dy, with_bound=with_bound)

            return expert_backward

        return [(W, "expert_forward", fwd), (W, "expert_backward", bwd)]


# ============================================================================ (e), (f)


class UnusedSlotAsExpertZero(Mutant):
    """Section 4.4: a ``-1`` slot is never sent and contributes exactly zero.
    This backend treats ``-1`` as expert 0 (the route is sent, computed with the
    slot's router weight and summed)."""

    name = "mutant-unused-slot-as-expert-0"

    def patches(self, op: str) -> Sequence[Patch]:
        def factory(orig):
            def plan(config, topk_idx):
                return orig(config, [np.where(np.asarray(i) < 0, 0, i) for i in topk_idx])

            return plan

        return [(W, "plan", factory)]


class RoundRobinPlacement(Mutant):
    """Section 2 (derived values): expert placement is contiguous, expert ``e`` on
    rank ``e // num_local_experts``. This backend places expert ``e`` on rank
    ``e % num_ranks`` as local expert ``e // num_ranks`` (round-robin)."""

    name = "mutant-round-robin-placement"

    def patches(self, op: str) -> Sequence[Patch]:
        def factory(orig):
            def plan(config, topk_idx):
                n, el = config.num_ranks, config.num_local_experts
                moved = []
                for idx in topk_idx:
                    idx = np.asarray(idx, dtype=np.int64)
                    moved.append(np.where(idx >= 0, (idx % n) * el + idx // n, idx))
                return orig(config, moved)

            return plan

        return [(W, "plan", factory)]


# ============================================================================ (g)


class CombineRoundTripSkipped(Mutant):
    """Section 6.1 / 7: every route's expert output is round-tripped through
    ``combine_format`` before the slot sum. This backend skips that round trip
    (fused forward and layered combine); the output encode is kept."""

    name = "mutant-combine-round-trip-skipped"

    def patches(self, op: str) -> Sequence[Patch]:
        def fwd(orig):
            def expert_forward(config, handle, x, w, fc1, fc2, with_bound=False):
                return orig(_ConfigView(config, combine_format=None), handle, x, w, fc1, fc2, with_bound=with_bound)

            return expert_forward

        def identity(orig):
            return lambda x, fmt, axis=-1: np.asarray(x, dtype=np.float64)

        return [(W, "expert_forward", fwd), (reference_backend_module, "round_trip", identity)]


# ============================================================================ (h)


def _mxfp8_exponent_nearest(amax: np.ndarray) -> np.ndarray:
    safe = np.where((amax > 0) & np.isfinite(amax), amax, 448.0)
    with np.errstate(divide="ignore", over="ignore"):
        e = np.floor(np.log2(safe / 448.0) + 0.5).astype(np.int64)
    return np.clip(e, -127, 127)


class Mxfp8ScaleRoundedToNearest(Mutant):
    """Section 8.3 step 3: the mxfp8 block scale is ``2^ceil(log2(amax / 448))``
    (rounded *up*, so ``|x| / s <= 448``). This backend rounds the exponent to the
    nearest integer, so in about half the blocks ``|x| / s`` exceeds 448 and the
    block maximum saturates. Every mxfp8 encode it does (output, combine round
    trip, FC2 operand) is affected."""

    name = "mutant-mxfp8-scale-nearest"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(F, "_mxfp8_scale_exponent", lambda orig: _mxfp8_exponent_nearest)]


# ============================================================================ (i)


class Nvfp4NibblesSwapped(Mutant):
    """Section 8.4 step 5: element ``2j`` goes in the low nibble of byte ``j``.
    This backend's nvfp4 *output* packs element ``2j`` in the high nibble (its
    internal round trips are right)."""

    name = "mutant-nvfp4-nibbles-swapped"

    def patches(self, op: str) -> Sequence[Patch]:
        def factory(orig):
            def encode_output(config, values):
                out = orig(config, values)
                if not (isinstance(out, BlockScaledTensor) and out.format is MoeFormat.NVFP4):
                    return out
                d = out.data_codes()
                swapped = (((d & 0x0F) << 4) | (d >> 4)).astype(np.uint8)
                return BlockScaledTensor(data=swapped, scale=out.scale, format=out.format, shape=out.shape, axis=out.axis)

            return encode_output

        return [(W, "encode_output", factory)]


# ============================================================================ (j)


def _source_major(handle: DispatchHandle) -> DispatchHandle:
    """The same routes, rows in (src_rank, src_token, src_slot) order, padding at
    the end; ``backend_state`` keeps the spec's handle and the row map."""
    meta = handle.route_metadata
    valid = np.nonzero(meta[:, 0] >= 0)[0]
    vm = meta[valid]
    pos = valid[np.lexsort((vm[:, 3], vm[:, 2], vm[:, 1]))]  # spec row of every mutant row
    new_meta = np.full_like(meta, -1)
    new_meta[: len(pos)] = meta[pos]
    return DispatchHandle(
        rank=handle.rank,
        num_ranks=handle.num_ranks,
        num_tokens=handle.num_tokens,
        num_topk=handle.num_topk,
        route_metadata=new_meta,
        tokens_per_expert=handle.tokens_per_expert,
        expert_offsets=handle.expert_offsets,
        backend_state=(handle, pos),
    )


def _to_spec_rows(a: np.ndarray, pos: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a)
    out[pos] = a[: len(pos)]
    return out


def _to_mutant_rows(a: np.ndarray, pos: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a)
    out[: len(pos)] = a[pos]
    return out


class SourceMajorRows(Mutant):
    """Section 4.3: every rank-local per-route array (dispatched tokens and
    weights, ``route_metadata``, ``fc1_c``, per-row cotangents) is in
    expert-major order ``(local_expert, src_rank, src_token, src_slot)``. This
    backend lays its received rows out source-major ``(src_rank, src_token,
    src_slot)`` (padding last) and groups by expert only inside its expert
    kernel. It is self-consistent: its combine reads its own dispatch's rows, and
    its backward checks the stash against its own (source-major) plan."""

    name = "mutant-source-major-rows"

    def patches(self, op: str) -> Sequence[Patch]:
        def plan(orig):
            return lambda config, topk_idx: [_source_major(h) for h in orig(config, topk_idx)]

        def fwd(orig):
            def expert_forward(config, handle, x, w, fc1, fc2, with_bound=False):
                spec, pos = handle.backend_state
                y, c, b = orig(config, spec, _to_spec_rows(x, pos), _to_spec_rows(w, pos), fc1, fc2, with_bound=with_bound)
                if b is not None:
                    b = tuple(_to_mutant_rows(z, pos) for z in b)
                return _to_mutant_rows(y, pos), _to_mutant_rows(c, pos), b

            return expert_forward

        def bwd(orig):
            def expert_backward(config, handle, x, w, fc1, fc2, c, dy, with_bound=False):
                spec, pos = handle.backend_state
                s = lambda a: _to_spec_rows(a, pos)  # noqa: E731
                (dx, dw, dfc1, dfc2), b = orig(config, spec, s(x), s(w), fc1, fc2, s(c), s(dy), with_bound=with_bound)
                if b is not None:
                    b = (_to_mutant_rows(b[0], pos), _to_mutant_rows(b[1], pos), b[2], b[3])
                return (_to_mutant_rows(dx, pos), _to_mutant_rows(dw, pos), dfc1, dfc2), b

            return expert_backward

        return [(W, "plan", plan), (W, "expert_forward", fwd), (W, "expert_backward", bwd)]


# ============================================================================ (k)


class BackwardWithoutClampMask(Mutant):
    """Section 9.2: with a clamp, ``dg`` is masked by ``m_g = [g~ <= L]`` and
    ``du`` by ``m_u = [-L <= u~ <= L]``. This backend's backward uses the clamped
    values but no masks (gradient flows through the clamp)."""

    name = "mutant-backward-no-clamp-mask"

    def patches(self, op: str) -> Sequence[Patch]:
        if op != "backward":
            return ()

        def factory(orig):
            def expert_backward(config, handle, x, w, fc1, fc2, c, dy, with_bound=False):
                # Clamping the stash first gives the same clamped g, u but masks of all ones.
                i = config.intermediate
                g, u = W._clamp(config, c[:, :i], c[:, i:])
                return orig(config, handle, x, w, fc1, fc2, np.concatenate([g, u], axis=1), dy, with_bound=with_bound)

            return expert_backward

        return [(W, "expert_backward", factory)]


# ============================================================================ (l)


def _poison_padding(rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    rows = np.array(rows, copy=True)
    if rows.dtype.kind in "iu":
        rows[~valid] = np.iinfo(rows.dtype).max  # uint8 codes 0xFF: NaN scales, -6 nibbles
    else:
        with np.errstate(invalid="ignore"):
            rows[~valid] = np.nan  # float8_e4m3fn gets its NaN code 0x7F
    return rows


def _dense_padding_read(config, handles, rows, slots):
    """Add ``0 * (every padding row of every destination)`` to slot 0 of every
    token: what a combine that multiplies by a dense 0/1 scatter matrix does."""
    pads = [r[~h.valid_rows].sum(axis=0) for h, r in zip(handles, rows) if (~h.valid_rows).any()]
    if not pads:
        return slots
    with np.errstate(invalid="ignore"):
        leak = 0.0 * np.sum(pads, axis=0)
    out = []
    for s in slots:
        s = np.array(s, copy=True)
        if s.shape[0]:
            with np.errstate(invalid="ignore"):
                s[:, 0] = s[:, 0] + leak
        out.append(s)
    return out


def _dense_scatter(orig):
    def scatter_slots(config, handles, rows):
        return _dense_padding_read(config, handles, rows, orig(config, handles, rows))

    return scatter_slots


class PaddingNanLeak(Mutant):
    """Sections 10.4 / 10.5: in the static layout padding rows are defined (tokens
    zero, weights 0, ``fc1_c`` zero, cotangent rows zero) and never read, so a NaN
    cannot travel through them. This backend leaves padding as garbage (NaN
    tokens and weights, NaN scale codes), runs its expert GEMMs over whole aligned
    slabs (so ``fc1_c`` padding is garbage too), and its combine and
    dispatch_backward read every row with a dense 0/1 matrix (padding weighted 0,
    but ``0 * NaN = NaN`` reaches every token)."""

    name = "mutant-padding-nan-leak"

    def patches(self, op: str) -> Sequence[Patch]:
        def gather(orig):
            def gather_rows(handles, per_src, by_slot=False):
                return [_poison_padding(r, h.valid_rows) for h, r in zip(handles, orig(handles, per_src, by_slot=by_slot))]

            return gather_rows

        def slabs(handle: DispatchHandle) -> DispatchHandle:
            # the aligned slabs, padding included
            return dataclasses.replace(handle, tokens_per_expert=np.diff(handle.expert_offsets), backend_state=None)

        def fwd(orig):
            def expert_forward(config, handle, x, w, fc1, fc2, with_bound=False):
                return orig(config, slabs(handle), x, w, fc1, fc2, with_bound=with_bound)

            return expert_forward

        return [(W, "gather", gather), (W, "expert_forward", fwd), (W, "scatter_slots", _dense_scatter)]

    def _combine_slots(self, config, handles, expert_out):
        self._check_layered(config, "combine", handles, expert_out=expert_out)
        rows = []
        for h, y in zip(handles, expert_out):
            V.validate_expert_out(config, y, h)
            rows.append(round_trip(np.asarray(y, dtype=np.float64), config.combine_format, axis=-1))  # padding kept
        return W.scatter_slots(config, handles, rows)

    def _dispatch_backward_slots(self, config, handles, grad_tokens, grad_topk_weights):
        self._check_layered(config, "dispatch_backward", handles, grad_tokens=grad_tokens,
                            grad_topk_weights=grad_topk_weights)
        for r, (h, gt, gw) in enumerate(zip(handles, grad_tokens, grad_topk_weights)):
            V.validate_grad("grad_tokens", gt, (h.num_recv_rows, config.hidden), "(received rows, hidden)", r)
            V.validate_grad("grad_topk_weights", gw, (h.num_recv_rows,), "(received rows,)", r)
        gts = [np.asarray(g, dtype=np.float64) for g in grad_tokens]  # padding kept
        gws = [np.asarray(g, dtype=np.float64) for g in grad_topk_weights]
        return W.scatter_slots(config, handles, gts), W.scatter_slots(config, handles, gws)


class CombineReadsPadding(PaddingNanLeak):
    """Section 10.2 / 10.3: combine and dispatch_backward never read padding rows
    ("their content, NaN included, has no effect"). This backend's dispatch and
    forward are correct (padding zero), but its combine and dispatch_backward read
    every row through a dense 0/1 scatter matrix, so a NaN in a padding row
    reaches every token."""

    name = "mutant-combine-reads-padding"

    def patches(self, op: str) -> Sequence[Patch]:
        if op not in ("combine", "dispatch_backward"):
            return ()
        return [(W, "scatter_slots", _dense_scatter)]


# ============================================================================ extras


def _check_topk_without_range(config, topk_idx, topk_weights, num_tokens, rank=None):
    """validation.check_topk minus the ``[-1, num_experts)`` range check."""
    p = V._prefix(rank)
    if not isinstance(topk_idx, np.ndarray) or topk_idx.dtype not in V.INDEX_DTYPES:
        got = V._dtype_text(topk_idx.dtype) if isinstance(topk_idx, np.ndarray) else type(topk_idx).__name__
        raise V.DTypeError(f"{p}topk_idx must have dtype in ({V._dtype_names(V.INDEX_DTYPES)}); got {got}", name="topk_idx")
    shape = (num_tokens, config.num_topk)
    V.check_shape("topk_idx", tuple(topk_idx.shape), shape, "(num_tokens, num_topk)", rank)
    V.check_float_array("topk_weights", topk_weights, shape, "(num_tokens, num_topk)", rank)


class NoTopkRangeCheck(Mutant):
    """Sections 3 / 4.6 / 12: a ``topk_idx`` value outside ``[-1, num_experts)``
    raises RoutingIndexError before anything is computed. This backend does not
    check the range (out-of-range routes silently go nowhere)."""

    name = "mutant-no-topk-range-check"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(V, "check_topk", lambda orig: _check_topk_without_range)]


def _truncate_to_bf16(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v) & (v != 0)
    _, exp = np.frexp(np.where(finite, v, 1.0))
    quantum = np.ldexp(1.0, np.maximum(exp - 1, -126) - 7)
    out = np.where(finite, np.trunc(np.where(finite, v, 0.0) / quantum) * quantum, v)
    return out.astype(np.float32).astype(BF16)  # exact: out is on the bf16 grid


def _bf16_output_encode(with_: Callable[[np.ndarray], np.ndarray]) -> Sequence[Patch]:
    """Patches that encode a bf16 output with ``with_(values)`` instead of the
    spec's rounding (the other output formats as before)."""

    def factory(orig):
        def encode_output(config, values):
            if config.output_format is MoeFormat.BF16:
                return with_(values)
            return orig(config, values)

        return encode_output

    return [(W, "encode_output", factory)]


class Bf16OutputTruncated(Mutant):
    """Section 8.2: bf16 rounds to nearest, ties to even. This backend's bf16
    output encode truncates toward zero."""

    name = "mutant-bf16-output-truncated"

    def patches(self, op: str) -> Sequence[Patch]:
        return _bf16_output_encode(with_=_truncate_to_bf16)


def _sum_slots_bf16(per_slot: np.ndarray) -> np.ndarray:
    acc = np.zeros((per_slot.shape[0],) + per_slot.shape[2:], dtype=np.float64)
    for k in range(per_slot.shape[1]):
        acc = round_to_bf16(acc + per_slot[:, k]).astype(np.float64)
    return acc


class SlotSumInBf16(Mutant):
    """Sections 6.3 / 9.2 / 10.3: slot sums accumulate in float32 or wider. This
    backend accumulates every slot sum (combine, grad_activation, dispatch
    backward) in bfloat16."""

    name = "mutant-slot-sum-bf16"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(W, "sum_slots", lambda orig: _sum_slots_bf16)]


class TopkPlacementIgnored(Mutant):
    """Section 5.4: with ``apply_topk_in_fc1 = True`` the FC2 operand is
    ``R_int(w * h)``. This backend always applies the router weight after FC2,
    ``w * (R_int(h) * W2)``, whatever ``apply_topk_in_fc1`` says (equal in exact
    arithmetic, different once ``intermediate_format`` rounds)."""

    name = "mutant-topk-placement-ignored"

    def patches(self, op: str) -> Sequence[Patch]:
        if op != "forward":
            return ()

        def factory(orig):
            def expert_forward(config, handle, x, w, fc1, fc2, with_bound=False):
                return orig(_ConfigView(config, apply_topk_in_fc1=False), handle, x, w, fc1, fc2, with_bound=with_bound)

            return expert_forward

        return [(W, "expert_forward", factory)]


class StashAfterClamp(Mutant):
    """Sections 7 / 9.1: ``fc1_c`` is the bf16 rounding of ``c`` *before* the clamp.
    This backend stashes the clamped FC1 output."""

    name = "mutant-stash-after-clamp"

    def patches(self, op: str) -> Sequence[Patch]:
        if op != "forward":
            return ()

        def factory(orig):
            def expert_forward(config, handle, x, w, fc1, fc2, with_bound=False):
                y, c, b = orig(config, handle, x, w, fc1, fc2, with_bound=with_bound)
                i = config.intermediate
                g, u = W._clamp(config, c[:, :i], c[:, i:])
                return y, np.concatenate([g, u], axis=1), b

            return expert_forward

        return [(W, "expert_forward", factory)]


class ModifiesInputs(ReferenceBackend):
    """Section 3 ("Inputs are read-only") / 12: no operation may modify its
    inputs. This backend's forward zeroes the router weights of ``-1`` slots in
    place (its results are the reference's)."""

    name = "mutant-modifies-inputs"
    version = "0.0.0+mutant"

    def forward(self, config, inputs):  # type: ignore[override]
        out = super().forward(config, inputs)
        for inp in inputs:
            if isinstance(inp.topk_weights, np.ndarray) and inp.topk_weights.flags.writeable:
                inp.topk_weights[np.asarray(inp.topk_idx) < 0] = 0
        return out


# ============================================================================ gaps


def _read_weights_bf16_as_bits(topk_weights: np.ndarray) -> np.ndarray:
    w = np.asarray(topk_weights)
    if w.dtype == BF16:  # the bf16 bits land in the low half of a float32: tiny denormals
        return w.view(np.uint16).astype(np.uint32).view(np.float32).astype(np.float64)
    return w.astype(np.float32).astype(np.float64)


class Bf16RouterWeightAsBits(Mutant):
    """Section 3: bf16 ``topk_weights`` are converted *by value*; "a bf16 router
    weight must never be reinterpreted as float32 bits". This backend puts the
    bf16 bits in the low half of a float32. SUITE GAP: every conformance case uses
    float32 router weights (``random_world``), so no case can catch it."""

    name = "mutant-bf16-router-weight-bits"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(reference_backend_module, "_read_weights", lambda orig: _read_weights_bf16_as_bits)]


class UnusedSlotWeightProduct(ReferenceBackend):
    """Section 4.4: a ``-1`` slot contributes exactly zero, "not a product with zero
    (a NaN router weight in a -1 slot changes nothing)". This backend adds
    ``w * 0`` for -1 slots, so a NaN/inf router weight there makes the token NaN.
    SUITE GAP: no conformance case puts a non-finite router weight in a -1 slot."""

    name = "mutant-unused-slot-weight-product"
    version = "0.0.0+mutant"

    def forward(self, config, inputs):  # type: ignore[override]
        results = super().forward(config, inputs)
        out = []
        for res, inp in zip(results, inputs):
            w = np.asarray(inp.topk_weights).astype(np.float64)
            unused = np.asarray(inp.topk_idx) < 0
            bad_rows = (unused & ~np.isfinite(w)).any(axis=1)
            if bad_rows.any():
                vals = W.decode(res.output)
                vals[bad_rows] = np.nan
                res = type(res)(W.encode_output(config, vals), res.fc1_c, res.route_metadata)
            out.append(res)
        return out


def _mxfp8_exponent_float32_log2(amax: np.ndarray) -> np.ndarray:
    safe = np.where((amax > 0) & np.isfinite(amax), amax, 448.0)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        e = np.ceil(np.log2(safe.astype(np.float32) / np.float32(448.0))).astype(np.int64)
    return np.clip(e, -127, 127)


class Mxfp8ScaleFloat32Log2(Mutant):
    """Section 8.3: the exponent ``ceil(log2(amax / 448))`` must be evaluated
    exactly; float32 ``log2`` picks a scale one binade too small a few ulps above
    ``448 * 2^k`` (the bug the spec names). The scale code is one too small and
    the block's elements in the E4M3 subnormal range round differently (normal
    elements and the saturated maximum decode to the same values). SUITE GAP:
    random conformance data essentially never lands within a few ulps of a
    binade edge, and where the budget is non-zero (output encode) both scale
    codes are allowed anyway; only an exact round trip (combine's
    ``combine_format``) of a crafted row would catch it. The golden vectors of
    ``tests/test_formats.py`` cover ``moe_ep_spec.formats``, not backends."""

    name = "mutant-mxfp8-scale-float32-log2"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(F, "_mxfp8_scale_exponent", lambda orig: _mxfp8_exponent_float32_log2)]


# ============================================================================ format classes (issue 17)


def _round_bf16_ties_away(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(v) & (v != 0)
    _, exp = np.frexp(np.where(finite, v, 1.0))
    quantum = np.ldexp(1.0, np.maximum(exp - 1, -126) - 7)
    mag = np.floor(np.abs(np.where(finite, v, 0.0)) / quantum + 0.5) * quantum
    out = np.where(finite, np.copysign(mag, v), v)
    with np.errstate(over="ignore"):
        return out.astype(np.float32).astype(BF16)


class Bf16TiesAwayFromZero(Mutant):
    """Section 8.2: bf16 rounds to nearest, ties to even. This backend's bf16
    output encode rounds ties away from zero (right everywhere except on an exact
    tie, where the old budget admitted both neighbours)."""

    name = "mutant-bf16-ties-away"

    def patches(self, op: str) -> Sequence[Patch]:
        return _bf16_output_encode(with_=_round_bf16_ties_away)


def _ties_up_where(select: Callable[[Any, Any], bool]):
    """A ``formats._nearest_index`` that rounds exact ties up (away from zero)
    on the grids ``select(mids, scale)`` picks, and is the original elsewhere."""

    def factory(orig):
        def nearest(magnitude, mids, scale=1.0):
            if not select(mids, scale):
                return orig(magnitude, mids, scale)
            mag = np.asarray(magnitude, dtype=np.float64)
            idx = np.asarray(orig(mag, mids, scale))
            bounds = mids * np.asarray(scale, dtype=np.float64)[..., None] if np.ndim(scale) else mids * float(scale)
            if np.ndim(scale):
                at_tie = (mag[..., None] == bounds).any(axis=-1)
                tie_idx = np.argmax(mag[..., None] == bounds, axis=-1)
            else:
                j = np.clip(np.searchsorted(bounds, mag), 0, len(bounds) - 1)
                at_tie, tie_idx = mag == bounds[j], j
            return np.where(at_tie, tie_idx + 1, idx)

        return nearest

    return factory


class E4M3DataTiesUp(Mutant):
    """Section 8.3 step 4: mxfp8 data codes round to nearest, ties to the even
    code. This backend rounds E4M3 data ties away from zero."""

    name = "mutant-e4m3-ties-up"

    def patches(self, op: str) -> Sequence[Patch]:
        pick = lambda mids, scale: mids is F._E4M3_MIDS and np.ndim(scale) == 0 and float(scale) == 1.0  # noqa: E731
        return [(F, "_nearest_index", _ties_up_where(pick))]


class E2M1DataTiesUp(Mutant):
    """Section 8.4 step 4: nvfp4 element codes round to nearest, ties to the even
    code. This backend rounds E2M1 ties away from zero."""

    name = "mutant-e2m1-ties-up"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(F, "_nearest_index", _ties_up_where(lambda mids, scale: mids is F._E2M1_MIDS))]


class Nvfp4ScaleTiesUp(Mutant):
    """Section 8.4 step 2: the nvfp4 block scale is ``E4M3(amax / 6)``, ties to the
    even code. This backend rounds the scale's ties up (amax = 6 times an E4M3
    midpoint)."""

    name = "mutant-nvfp4-scale-ties-up"

    def patches(self, op: str) -> Sequence[Patch]:
        pick = lambda mids, scale: mids is F._E4M3_MIDS and np.ndim(scale) == 0 and float(scale) == 6.0  # noqa: E731
        return [(F, "_nearest_index", _ties_up_where(pick))]


class Mxfp8ScaleOffAtEdge(Mutant):
    """Section 8.3 step 3: ``e`` is the smallest integer with ``amax <= 448 * 2^e``.
    This backend computes ``floor(log2(amax / 448)) + 1``, one binade too large
    exactly at ``amax = 448 * 2^k`` (right everywhere else)."""

    name = "mutant-mxfp8-scale-off-at-448"

    def patches(self, op: str) -> Sequence[Patch]:
        def factory(orig):
            def exponent(amax):
                e = orig(amax)
                safe = np.where((amax > 0) & np.isfinite(amax), amax, 448.0)
                return np.clip(np.where(safe == np.ldexp(448.0, e), e + 1, e), -127, 127)

            return exponent

        return [(F, "_mxfp8_scale_exponent", factory)]


class NegativeZeroLost(Mutant):
    """Section 8.2 / 8.5: zeros keep their sign; a negative value that rounds to
    zero gives -0. This backend's bf16 output encode writes +0 for every zero."""

    name = "mutant-negative-zero-lost"

    def patches(self, op: str) -> Sequence[Patch]:
        def factory(orig):
            def encode_output(config, values):
                out = orig(config, values)
                if config.output_format is MoeFormat.BF16:
                    return np.where(out.astype(np.float32) == 0, np.float32(0), out.astype(np.float32)).astype(BF16)
                return out

            return encode_output

        return [(W, "encode_output", factory)]


def _sum_slots_literal(per_slot: np.ndarray) -> np.ndarray:
    if per_slot.shape[1] == 0:
        return np.zeros((per_slot.shape[0],) + per_slot.shape[2:])
    acc = np.array(per_slot[:, 0], dtype=np.float64, copy=True)
    for k in range(1, per_slot.shape[1]):
        acc = acc + per_slot[:, k]
    return acc


class SlotSumFromFirstSlot(Mutant):
    """Section 6.3: the slot sum starts from +0, so a sum of -0 terms is +0. This
    backend starts from slot 0 (``S = Y0 + Y1 + ...``), so an all -0 sum stays -0."""

    name = "mutant-slot-sum-from-first-slot"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(W, "sum_slots", lambda orig: _sum_slots_literal)]


class Mxfp8NanBlockDataZero(Mutant):
    """Section 8.3 step 1: a block holding NaN or inf gets scale code 0xFF and every
    data code 0x7F. This backend's mxfp8 output writes data codes 0x00 there (the
    block still decodes to NaN, so a decoded comparison cannot see it)."""

    name = "mutant-mxfp8-nan-block-data-zero"

    def patches(self, op: str) -> Sequence[Patch]:
        def factory(orig):
            def encode_output(config, values):
                out = orig(config, values)
                if not (isinstance(out, BlockScaledTensor) and out.format is MoeFormat.MXFP8):
                    return out
                nan_block = np.repeat(out.scale_codes() == 0xFF, 32, axis=1)[:, : out.shape[1]]
                data = np.where(nan_block, np.uint8(0), out.data_codes()).astype(np.uint8)
                return BlockScaledTensor(data.view(F.FLOAT8_E4M3), out.scale, out.format, out.shape, axis=1)

            return encode_output

        return [(W, "encode_output", factory)]


class SlotSumOneUlpHigh(Mutant):
    """Section 13 / 6.3: a float32 slot sum is exact when its terms fit 24 bits
    together, and the budget then allows no summation error. This backend's slot
    sum is one float32 ulp high (times ``1 + 2^-23``), inside the old ``gamma(K)``
    allowance: it lands on the wrong side of exact output ties."""

    name = "mutant-slot-sum-one-ulp-high"

    def patches(self, op: str) -> Sequence[Patch]:
        def factory(orig):
            return lambda per_slot: orig(per_slot) * (1.0 + 2.0**-23)

        return [(W, "sum_slots", factory)]


class DecodeNanScaleAsZero(Mutant):
    """Section 8.3 / 8.4 decode: a NaN scale code makes its whole block NaN. This
    backend decodes block-scaled inputs with a NaN scale as zero (a flush)."""

    name = "mutant-decode-nan-scale-as-zero"

    def patches(self, op: str) -> Sequence[Patch]:
        def factory(orig):
            def decode(t):
                out = orig(t)
                if isinstance(t, BlockScaledTensor):
                    codes = t.scale_codes()
                    nan = codes == 0xFF if t.format is MoeFormat.MXFP8 else (codes & 0x7F) == 0x7F
                    full = np.take(np.repeat(nan, t.block_size, axis=t.axis), np.arange(t.shape[t.axis]), axis=t.axis)
                    out = np.where(full, 0.0, out)
                return out

            return decode

        return [(W, "decode", factory)]


class DecodeMxfp8BeyondFloat32Finite(Mutant):
    """Section 8.5: an mxfp8 input of magnitude 2^128 or more decodes to +-inf
    (float32). This backend decodes it to its finite float64 value."""

    name = "mutant-decode-mxfp8-finite-beyond-float32"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(W, "decode", lambda orig: (lambda t: F.dequantize(t, np.float64)))]


#: The mutants the conformance suite must catch.
class CombineExpertSlabsSwapped(Mutant):
    """Section 6.3 (routing): combine returns every received row to its own (source
    token, slot). This backend swaps the rows of local experts 0 and 1 wholesale when
    their slabs have the same size (a kernel with two experts' offsets exchanged): the
    shapes still fit, so only the values can tell, and they can only when the two
    experts' outputs differ for the same token (the suite's expert-specific transform)."""

    name = "mutant-combine-expert-slabs-swapped"

    def patches(self, op: str) -> Sequence[Patch]:
        if op != "combine":
            return ()

        def factory(orig):
            def scatter_slots(config, handles, rows):
                swapped = []
                for h, r in zip(handles, rows):
                    r = np.array(r, copy=True)
                    first = np.flatnonzero(h.route_metadata[:, 0] == 0)
                    second = np.flatnonzero(h.route_metadata[:, 0] == 1)
                    if len(first) == len(second) and len(first):
                        r[first], r[second] = r[second].copy(), r[first].copy()
                    swapped.append(r)
                return orig(config, handles, swapped)

            return scatter_slots

        return [(W, "scatter_slots", factory)]


# ============================================================================ bf16-operand backward


class Bf16BackwardNotRounded(Mutant):
    """Section 9.2, backward operand format: with ``backward_operand_format`` bf16
    the cotangent, ``dc`` and ``w * h`` are rounded to bf16 before their GEMMs.
    This backend accepts the field and runs the exact backward (no rounding)."""

    name = "mutant-bf16-backward-not-rounded"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(W, "bf16_operand", lambda orig: lambda values: values)] if op == "backward" else ()


def _bf16_backward_mixed(take_from_exact: Sequence[int]) -> Callable[[Any], Any]:
    """An ``expert_backward`` factory: the bf16 mode's results, except the result
    indices ``take_from_exact`` (0 dx, 1 dw, 2 dfc1, 3 dfc2), which come from the
    exact mode run on the rounded cotangent: those GEMMs take an unrounded operand."""

    def factory(orig):
        def expert_backward(config, handle, x, w, fc1, fc2, c, dy, with_bound=False):
            rounded, bounds = orig(config, handle, x, w, fc1, fc2, c, dy, with_bound=with_bound)
            if config.backward_operand_format is None:
                return rounded, bounds
            exact, _ = orig(config.replace(backward_operand_format=None), handle, x, w, fc1, fc2, c,
                            round_to_bf16(dy).astype(np.float64))
            return tuple(exact[i] if i in take_from_exact else rounded[i] for i in range(4)), bounds

        return expert_backward

    return factory


class Bf16BackwardDcUnroundedInDW1(Mutant):
    """Section 9.2, backward operand format: ``dc_b = R_bf16(dc)`` is the operand of
    both ``dW1 += x^T dc_b`` and ``dx = dc_b W1^T``. This backend rounds ``dc`` for
    ``dx`` only; its ``dW1`` GEMM reads the float32 ``dc``."""

    name = "mutant-bf16-backward-dc-unrounded-in-dw1"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(W, "expert_backward", _bf16_backward_mixed((2,)))] if op == "backward" else ()


class Bf16BackwardWhUnrounded(Mutant):
    """Section 9.2, backward operand format: ``dW2 += R_bf16(w * h)^T dY_b`` in both
    router-weight placements. This backend rounds the cotangent and ``dc`` but
    runs ``dW2`` on the float32 ``w * h``."""

    name = "mutant-bf16-backward-wh-unrounded"

    def patches(self, op: str) -> Sequence[Patch]:
        return [(W, "expert_backward", _bf16_backward_mixed((3,)))] if op == "backward" else ()


class Bf16BackwardRoundsDh(Mutant):
    """Section 9.2, backward operand format: the rounding point is ``dc``, after the
    SwiGLU derivative. This backend rounds ``dh = w * (dY_b W2^T)`` to bf16 instead
    and feeds the float32 ``dc`` computed from it to ``dW1`` and ``dx`` (``dW2`` and
    ``dw`` as the spec says)."""

    name = "mutant-bf16-backward-rounds-dh"

    def patches(self, op: str) -> Sequence[Patch]:
        if op != "backward":
            return ()

        def factory(orig):
            def expert_backward(config, handle, x, w, fc1, fc2, c, dy, with_bound=False):
                rounded, bounds = orig(config, handle, x, w, fc1, fc2, c, dy, with_bound=with_bound)
                if config.backward_operand_format is None:
                    return rounded, bounds
                # Exact mode with the router weight folded into a bf16-rounded dh: the
                # weight is set to 1 and dY W2^T scaled by w must round as dh. Done per
                # row: dh_b = R(w a); dc from dh_b, unrounded.
                i = config.intermediate
                dx, dfc1 = np.zeros_like(rounded[0]), np.zeros_like(rounded[2])
                for e in range(config.num_local_experts):
                    lo, n = int(handle.expert_offsets[e]), int(handle.tokens_per_expert[e])
                    sl = slice(lo, lo + n)
                    g, u = W._clamp(config, c[sl, :i], c[sl, i:])
                    lim = config.gate_up_clamp
                    m_g = np.ones_like(g) if lim is None else (c[sl, :i] <= lim)
                    m_u = np.ones_like(u) if lim is None else (np.abs(c[sl, i:]) <= lim)
                    sig = 1.0 / (1.0 + np.exp(-g))
                    dh = round_to_bf16(w[sl, None] * (round_to_bf16(dy[sl]).astype(np.float64) @ fc2[e].T))
                    dh = dh.astype(np.float64)
                    dc = np.concatenate([dh * u * sig * (1.0 + g * (1.0 - sig)) * m_g, dh * g * sig * m_u], axis=1)
                    dfc1[e] = x[sl].T @ dc
                    dx[sl] = dc @ fc1[e].T
                return (dx, rounded[1], dfc1, rounded[3]), bounds

            return expert_backward

        return [(W, "expert_backward", factory)]


MUTANTS: Tuple[Type[ReferenceBackend], ...] = (
    GateUpSwapped,
    ClampGateBothSides,
    RouterWeightTwice,
    RouterWeightIgnored,
    UnusedSlotAsExpertZero,
    RoundRobinPlacement,
    CombineRoundTripSkipped,
    Mxfp8ScaleRoundedToNearest,
    Nvfp4NibblesSwapped,
    SourceMajorRows,
    BackwardWithoutClampMask,
    PaddingNanLeak,
    CombineReadsPadding,
    NoTopkRangeCheck,
    Bf16OutputTruncated,
    SlotSumInBf16,
    TopkPlacementIgnored,
    StashAfterClamp,
    ModifiesInputs,
    # Found as suite gaps by these mutants; caught since the table grew cases for them
    # (bf16 router weights, NaN weights in -1 slots, combine edge values).
    Bf16RouterWeightAsBits,
    UnusedSlotWeightProduct,
    Mxfp8ScaleFloat32Log2,
    # Format classes caught code for code by the format cases (operation "formats").
    Bf16TiesAwayFromZero,
    E4M3DataTiesUp,
    E2M1DataTiesUp,
    Nvfp4ScaleTiesUp,
    Mxfp8ScaleOffAtEdge,
    NegativeZeroLost,
    SlotSumFromFirstSlot,
    Mxfp8NanBlockDataZero,
    SlotSumOneUlpHigh,
    DecodeNanScaleAsZero,
    DecodeMxfp8BeyondFloat32Finite,
    # Routing with equal shapes, caught by the layered cases' expert-specific transform.
    CombineExpertSlabsSwapped,
)

#: Mutants of rules the conformance table does not exercise (known suite gaps): none.
GAP_MUTANTS: Tuple[Type[ReferenceBackend], ...] = ()

ALL_MUTANTS = MUTANTS + GAP_MUTANTS

#: The bf16-operand backward's mutants (checked against that mode's budgets directly).
BF16_BACKWARD_MUTANTS: Tuple[Type[ReferenceBackend], ...] = (
    Bf16BackwardNotRounded,
    Bf16BackwardDcUnroundedInDW1,
    Bf16BackwardWhUnrounded,
    Bf16BackwardRoundsDh,
)

_names: Dict[str, Type[ReferenceBackend]] = {}
for _cls in ALL_MUTANTS + BF16_BACKWARD_MUTANTS:
    assert _cls.name not in _names and _cls.name.startswith("mutant-"), _cls.name
    assert (_cls.__doc__ or "").strip(), f"{_cls.name} needs a docstring naming its rule"
    _names[_cls.name] = _cls
del _names, _cls
