"""The device exchange of the native layer (``moe_ep_layer_dispatch`` /
``moe_ep_layer_combine``).

CPU (CI): the CPU twin of the protocol, one rank per thread over host memory
(the very count table, offsets, flags, step numbers and bounded waits the CUDA
kernels use): the expert-major rows, weights, metadata and slab sizes equal the
spec's routing order for random routings (empty ranks, T = 0, repeated experts,
-1 slots), the combine equals the slot-order sum (bit for bit in SLOT_ORDER,
and in RANK_SUMS where a token's routes live on one rank), bf16 expert-output
rows sum to the very bits of float32 rows of the same values, buffers are reused
over steps, bad ids and overflow give the same error bits on every rank, and a
peer that never arrives gives TIMEOUT within the bound. The front-end
(``moe_ep(..., host_sync=False, exchange="device")``) against the static mode in
the CPU mode, through the /dev/shm loopback provider.

CUDA (skipped without a GPU): the same checks with the kernels, N processes on
ONE GPU through the CUDA IPC loopback provider.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
import pytest

pytest.importorskip("moe_ep_native")

from moe_ep_native._capi import Format, LayerConfig, call, has_cuda  # noqa: E402
from moe_ep_native.exchange import (  # noqa: E402
    BAD_EXPERT_ID, LOW_LATENCY, OVERFLOW, RANK_SUMS, SLOT_ORDER, THROUGHPUT, TIMEOUT, ExchangeLayer, with_exchange,
)
from moe_ep_native.layer import layer_config  # noqa: E402
from moe_ep_spec import DTypeError, MoeEpConfig, NativeArgumentError  # noqa: E402


def _ptr(a):
    return a.ctypes.data if a is not None and a.size else None


def _config(n, el, k, hidden=8):
    return MoeEpConfig(num_experts=n * el, hidden=hidden, intermediate=4, num_topk=k, num_ranks=n)


def _layers(n, el, k, cap, tmax, row_bytes, align=1, order=RANK_SUMS, timeout_s=20.0, hidden=8, bf16_out=False,
            mode=THROUGHPUT):
    cfg = _config(n, el, k, hidden)  # combine_format bf16 (the default): bf16 expert-output rows allowed
    layers = []
    for r in range(n):
        base = layer_config(cfg, max_rows=cap, cuda_device=None, bf16_operands=False, with_backward=False,
                            bf16_expert_out=bf16_out)
        layers.append(ExchangeLayer(with_exchange(base, num_ranks=n, rank=r, num_topk=k, max_tokens=tmax,
                                                  token_bytes=row_bytes, expert_alignment=align, timeout_s=timeout_s,
                                                  combine_order=order, mode=mode)))
    regions = [lay.exchange_info()[1] for lay in layers]
    for lay in layers:
        lay.set_peers(regions)
    return layers


def _parallel(fns):
    """Run one function per rank in threads (ctypes releases the GIL); re-raise the first error."""
    out, errs = [None] * len(fns), []

    def run(i):
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001
            errs.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errs:
        raise errs[0]
    return out


def _dispatch(layer, tokens, idx, w, cap, el):
    t, rb = tokens.shape
    out = dict(
        tokens=np.full((cap, rb), 0xAB, np.uint8), w=np.full(cap, 7.0, np.float32),
        meta=np.full((cap, 4), 99, np.int32), gs=np.full(el, -5, np.int32), tpe=np.full(el, -5, np.int32),
        err=np.full(1, -1, np.int32),
    )
    layer.dispatch(None, t, rb, _ptr(tokens), _ptr(idx), _ptr(w), _ptr(out["tokens"]), _ptr(out["w"]),
                   _ptr(out["meta"]), _ptr(out["gs"]), _ptr(out["tpe"]), _ptr(out["err"]))
    return out


def _combine(layer, t, y, k, values=None, out_bf16=False):
    out = np.full((t, y.shape[1]), 0x5A5A if out_bf16 else 5.0, np.uint16 if out_bf16 else np.float32)
    ov = np.full((t, k), 5.0, np.float32) if values is not None else None
    err = np.full(1, -1, np.int32)
    layer.combine(None, t, _ptr(y), _ptr(out), _ptr(values), _ptr(ov), _ptr(err), y_bf16=y.dtype == np.uint16,
                  out_bf16=out_bf16)
    return out, ov, int(err[0])


def _bf16_encode(f):
    """float32 -> bf16 bits: nearest, ties to even; NaN quieted with its sign (the spec's bf16 encoding)."""
    u = np.ascontiguousarray(f, np.float32).view(np.uint32).astype(np.uint64)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(f), ((u >> 16) | 0x40).astype(np.uint16), rne)


def _expected(idx_all, tok_all, w_all, n, el, k, align, cap):
    """The spec's routing order per destination rank (section 4, static layout 10.4)."""
    res = []
    for d in range(n):
        routes = []
        for s in range(n):
            for t in range(idx_all[s].shape[0]):
                for kk in range(k):
                    g = int(idx_all[s][t, kk])
                    if g >= 0 and g // el == d:
                        routes.append((g % el, s, t, kk))
        routes.sort()
        n_e = [sum(1 for r in routes if r[0] == e) for e in range(el)]
        off = np.concatenate([[0], np.cumsum([-(-c // align) * align for c in n_e])])
        rb = tok_all[0].shape[1]
        tokens = np.zeros((cap, rb), np.uint8)
        w = np.zeros(cap, np.float32)
        meta = np.full((cap, 4), -1, np.int32)
        seen = [0] * el
        for le, s, t, kk in routes:
            row = off[le] + seen[le]
            seen[le] += 1
            if row < cap:
                tokens[row] = tok_all[s][t]
                w[row] = w_all[s][t, kk]
                meta[row] = (le, s, t, kk)
        cut = np.minimum(off, cap)
        res.append(dict(tokens=tokens, w=w, meta=meta, gs=(cut[1:] - cut[:-1]).astype(np.int32),
                        tpe=np.asarray(n_e, np.int32), aligned=int(off[-1])))
    return res


def _routing(rng, n, el, k, t, empty_rank=None, repeat=False, unused=0.2):
    e = n * el
    idx = rng.integers(0, e, size=(t, k)).astype(np.int32)
    if empty_rank is not None:  # no route to that rank
        idx = np.where(idx // el == empty_rank, (idx + el) % e, idx).astype(np.int32)
    if repeat and t:
        idx[:, -1] = idx[:, 0]
    idx[rng.random((t, k)) < unused] = -1
    return idx


CASES = [  # n, el, k, tokens per rank, align, capacity, empty rank, repeated experts
    (1, 4, 2, (5,), 1, 16, None, False),
    (2, 3, 4, (6, 0), 1, 64, None, True),
    (2, 2, 3, (7, 5), 4, 64, 1, False),
    (4, 2, 2, (3, 0, 4, 2), 2, 64, 2, True),
    (3, 2, 5, (4, 4, 4), 8, 160, None, True),
]


@pytest.mark.parametrize("order", [RANK_SUMS, SLOT_ORDER], ids=["rank-sums", "slot-order"])
@pytest.mark.parametrize("case", CASES, ids=[f"ep{c[0]}-el{c[1]}-k{c[2]}-t{'_'.join(map(str, c[3]))}" for c in CASES])
def test_cpu_twin_dispatch_and_combine_follow_the_routing_order(case, order) -> None:
    n, el, k, ts, align, cap, empty, repeat = case
    rng = np.random.default_rng(hash(case) % 2**32)
    hidden, rb = 8, 12
    tmax = max(ts) + 2
    layers = _layers(n, el, k, cap, tmax, rb + 4, align, order, hidden=hidden)
    try:
        for step in range(3):  # the same buffers over steps: step numbers, acknowledgements
            idx = [_routing(rng, n, el, k, t, empty, repeat) for t in ts]
            tok = [rng.integers(0, 256, size=(t, rb)).astype(np.uint8) for t in ts]
            w = [rng.standard_normal((t, k)).astype(np.float32) for t in ts]
            got = _parallel([lambda r=r: _dispatch(layers[r], tok[r], idx[r], w[r], cap, el) for r in range(n)])
            want = _expected(idx, tok, w, n, el, k, align, cap)
            for r in range(n):
                assert got[r]["err"][0] == 0
                np.testing.assert_array_equal(got[r]["meta"], want[r]["meta"], err_msg=f"rank {r} step {step}")
                np.testing.assert_array_equal(got[r]["tokens"], want[r]["tokens"])
                np.testing.assert_array_equal(got[r]["w"], want[r]["w"])
                np.testing.assert_array_equal(got[r]["gs"], want[r]["gs"])
                np.testing.assert_array_equal(got[r]["tpe"], want[r]["tpe"])
            # Combine: expert outputs per buffer row (padding rows NaN: never read), values per row.
            ys, vals = [], []
            for r in range(n):
                y = rng.standard_normal((cap, hidden)).astype(np.float32)
                y[want[r]["meta"][:, 0] < 0] = np.nan
                v = rng.standard_normal(cap).astype(np.float32)
                ys.append(y)
                vals.append(v)
            outs = _parallel([lambda r=r: _combine(layers[r], ts[r], ys[r], k, vals[r]) for r in range(n)])
            for s in range(n):
                out, ov, err = outs[s]
                assert err == 0
                slot_rows = np.zeros((ts[s], k, hidden), np.float32)
                slot_vals = np.zeros((ts[s], k), np.float32)
                dest = np.full((ts[s], k), -1)
                for d in range(n):
                    for row, (le, src, t, kk) in enumerate(want[d]["meta"]):
                        if src == s and le >= 0:
                            slot_rows[t, kk] = ys[d][row]
                            slot_vals[t, kk] = vals[d][row]
                            dest[t, kk] = d
                np.testing.assert_array_equal(ov, slot_vals)
                ref = np.zeros((ts[s], hidden), np.float32)
                for kk in range(k):  # slot order from +0 (moe_ep_combine_reduce)
                    ref = np.where((dest[:, kk] >= 0)[:, None], ref + slot_rows[:, kk], ref).astype(np.float32)
                one_rank = np.array([len(set(dest[t][dest[t] >= 0])) <= 1 for t in range(ts[s])], bool)
                # RANK_SUMS: per expert rank its routes in slot order from +0, then the ranks in rank order from +0
                rank_ref = np.zeros((ts[s], hidden), np.float32)
                for d in range(n):
                    part = np.zeros((ts[s], hidden), np.float32)
                    for kk in range(k):
                        part = np.where((dest[:, kk] == d)[:, None], part + slot_rows[:, kk], part).astype(np.float32)
                    has = (dest == d).any(axis=1)[:, None]
                    rank_ref = np.where(has, rank_ref + part, rank_ref).astype(np.float32)
                if order == SLOT_ORDER:
                    np.testing.assert_array_equal(out, ref)
                else:
                    np.testing.assert_array_equal(out[one_rank], ref[one_rank])
                    np.testing.assert_array_equal(out, rank_ref)
    finally:
        for lay in layers:
            lay.close()


def _bf16_rows(rng, shape):
    """Random bf16 bit patterns (uint16) with specials mixed in: -0, subnormals, infinities, NaN."""
    bits = (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    specials = np.array([0x8000, 0x0001, 0x807F, 0x0080, 0x7F80, 0xFF80, 0x7FC1, 0x7F7F], np.uint16)
    pick = rng.random(shape) < 0.05
    bits[pick] = specials[rng.integers(0, len(specials), size=int(pick.sum()))]
    return bits


def _as_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("order", [RANK_SUMS, SLOT_ORDER], ids=["rank-sums", "slot-order"])
@pytest.mark.parametrize("case", CASES, ids=[f"ep{c[0]}-el{c[1]}-k{c[2]}-t{'_'.join(map(str, c[3]))}" for c in CASES])
def test_cpu_twin_combine_of_bf16_rows_equals_float32_rows_of_the_same_values(case, order) -> None:
    n, el, k, ts, align, cap, empty, repeat = case
    rng = np.random.default_rng(hash(case) % 2**32 + 7)
    hidden, rb = 8, 12
    tmax = max(ts) + 2
    groups = [_layers(n, el, k, cap, tmax, rb, align, order, hidden=hidden, bf16_out=b) for b in (False, True)]
    try:
        for step in range(2):
            idx = [_routing(rng, n, el, k, t, empty, repeat) for t in ts]
            tok = [rng.integers(0, 256, size=(t, rb)).astype(np.uint8) for t in ts]
            w = [rng.standard_normal((t, k)).astype(np.float32) for t in ts]
            for layers in groups:
                got = _parallel([lambda r=r: _dispatch(layers[r], tok[r], idx[r], w[r], cap, el) for r in range(n)])
                assert all(g["err"][0] == 0 for g in got)
            bits = [_bf16_rows(rng, (cap, hidden)) for _ in range(n)]
            vals = [rng.standard_normal(cap).astype(np.float32) for _ in range(n)]
            f32 = _parallel([lambda r=r: _combine(groups[0][r], ts[r], _as_f32(bits[r]), k, vals[r]) for r in range(n)])
            b16 = _parallel([lambda r=r: _combine(groups[1][r], ts[r], bits[r], k, vals[r], out_bf16=step == 1)
                             for r in range(n)])
            for r in range(n):
                (o32, v32, e32), (o16, v16, e16) = f32[r], b16[r]
                assert e32 == e16 == 0
                if step == 1:  # a bf16 output: the bf16 encoding of the float32 sums
                    np.testing.assert_array_equal(o16, _bf16_encode(o32), err_msg=f"rank {r}: bf16 output")
                else:
                    np.testing.assert_array_equal(o16.view(np.uint32), o32.view(np.uint32), err_msg=f"rank {r}")
                np.testing.assert_array_equal(v16.view(np.uint32), v32.view(np.uint32))
    finally:
        for layers in groups:
            for lay in layers:
                lay.close()


def test_cpu_twin_combine_checks_the_alignment_of_y_by_its_dtype() -> None:
    """y is aligned to its element: 2 bytes for bf16 rows, 4 for float32 rows (the
    call's y_dtype, whatever the layer's expert_out_dtype); a y_dtype that is
    neither is refused with the rule."""
    el, k, cap, hidden = 2, 2, 8, 8
    idx = np.array([[0, 1], [1, -1]], np.int32)
    for layer_bf16 in (False, True):
        (layer,) = _layers(1, el, k, cap, 2, 4, hidden=hidden, bf16_out=layer_bf16)
        try:
            _dispatch(layer, np.ones((2, 4), np.uint8), idx, np.ones((2, 2), np.float32), cap, el)
            for bf16 in (False, True):
                size = 2 if bf16 else 4
                raw = np.zeros(cap * hidden * size + 8, np.uint8)
                out = np.zeros((2, hidden), np.float32)
                base = raw.ctypes.data + (-raw.ctypes.data) % 4  # 4-byte aligned
                with pytest.raises(NativeArgumentError, match=rf"y must be aligned to {size} bytes; got an address 1"):
                    layer.combine(None, 2, base + 1, _ptr(out), y_bf16=bf16)
                if bf16:
                    layer.combine(None, 2, base + 2, _ptr(out), y_bf16=True)  # 2-byte aligned is enough for bf16
                    np.testing.assert_array_equal(out, 0.0)
                else:
                    with pytest.raises(NativeArgumentError, match=r"must be aligned to 4 bytes; got an address 2"):
                        layer.combine(None, 2, base + 2, _ptr(out), y_bf16=False)
                layer.combine(None, 2, base, _ptr(out), y_bf16=bf16)
            with pytest.raises(NativeArgumentError, match=r"y_dtype must be MOE_EP_DTYPE_F32 \(0\), "
                                                          r"MOE_EP_DTYPE_BF16 \(1\), MOE_EP_Y_F32_MXFP8_ROUND_TRIP "
                                                          r"\(2\) or MOE_EP_Y_F32_NVFP4_ROUND_TRIP \(3\); got 7"):
                call("moe_ep_layer_combine", layer._handle, None, 2, base, 7, _ptr(out), 0, None, None, None)
            for fmt in (Format.MXFP8, Format.NVFP4):
                with pytest.raises(NativeArgumentError, match=rf"hidden must be a multiple of 128 with y_dtype "
                                                              rf"MOE_EP_Y_F32_{fmt.name}_ROUND_TRIP .*; got 8"):
                    layer.combine(None, 2, base, _ptr(out), y_round_trip=fmt)
            for bad in (True, Format.BF16):
                with pytest.raises(DTypeError, match=r"y_round_trip must be None, Format.MXFP8 or Format.NVFP4"):
                    layer.combine(None, 2, base, _ptr(out), y_round_trip=bad)
            layer.combine(None, 2, base, _ptr(out), y_bf16=bf16)  # the refused calls changed nothing
            with pytest.raises(NativeArgumentError, match=r"out_dtype must be MOE_EP_DTYPE_F32 \(0\) or "
                                                          r"MOE_EP_DTYPE_BF16 \(1\); got 5"):
                call("moe_ep_layer_combine", layer._handle, None, 2, base, 0, _ptr(out), 5, None, None, None)
        finally:
            layer.close()


@pytest.mark.parametrize("fault", ["bad-id", "overflow"])
def test_cpu_twin_errors_reach_every_rank(fault) -> None:
    n, el, k, cap = 2, 2, 2, 4
    layers = _layers(n, el, k, cap, 4, 4)
    try:
        idx = [np.array([[0, 1], [2, -1]], np.int32), np.array([[3, -1]], np.int32)]
        if fault == "bad-id":
            idx[1][0, 1] = 9
        else:
            idx[0] = np.array([[0, 1], [0, 1], [0, 1], [1, 0]], np.int32)  # 8 rows to rank 0 > cap 4
        tok = [np.ones((len(i), 4), np.uint8) for i in idx]
        w = [np.ones(i.shape, np.float32) for i in idx]
        got = _parallel([lambda r=r: _dispatch(layers[r], tok[r], idx[r], w[r], cap, el) for r in range(n)])
        bit = BAD_EXPERT_ID if fault == "bad-id" else OVERFLOW
        assert [g["err"][0] for g in got] == [bit, bit]
        y = np.zeros((cap, 8), np.float32)
        outs = _parallel([lambda r=r: _combine(layers[r], len(idx[r]), y, k) for r in range(n)])
        for out, _, err in outs:
            assert err == bit and np.isnan(out).all()
        assert [lay.status(clear=True) for lay in layers] == [bit, bit]
        assert [lay.status() for lay in layers] == [0, 0]
    finally:
        for lay in layers:
            lay.close()


def test_cpu_twin_peer_that_never_arrives_times_out_within_the_bound() -> None:
    n, el, k, cap = 2, 2, 2, 8
    layers = _layers(n, el, k, cap, 2, 4, timeout_s=0.5)
    try:
        idx = np.array([[0, 3]], np.int32)
        start = time.monotonic()
        got = _dispatch(layers[0], np.ones((1, 4), np.uint8), idx, np.ones((1, 2), np.float32), cap, el)  # rank 1 never comes
        elapsed = time.monotonic() - start
        assert got["err"][0] & TIMEOUT and elapsed < 5.0
        assert (got["meta"] == -1).all() and (got["tokens"] == 0).all()
        out, _, err = _combine(layers[0], 1, np.zeros((cap, 8), np.float32), k)
        assert err & TIMEOUT and np.isnan(out).all()
        assert layers[0].status() & TIMEOUT
    finally:
        for lay in layers:
            lay.close()


def test_exchange_config_is_checked_and_old_callers_are_unaffected() -> None:
    cfg = _config(2, 2, 2)
    base = layer_config(cfg, max_rows=4, cuda_device=None, bf16_operands=False, with_backward=False)
    assert base.ex_num_ranks == 0
    plain = ExchangeLayer(base)  # no exchange: the stages say so
    try:
        with pytest.raises(NativeArgumentError, match="ex_num_ranks >= 1"):
            plain.exchange_info()
    finally:
        plain.close()
    bad = with_exchange(layer_config(cfg, max_rows=4, cuda_device=None, bf16_operands=False, with_backward=False),
                        num_ranks=2, rank=2, num_topk=2, max_tokens=4, token_bytes=4)
    with pytest.raises(NativeArgumentError, match="ex_rank must be in"):
        ExchangeLayer(bad)
    bad_mode = with_exchange(layer_config(cfg, max_rows=4, cuda_device=None, bf16_operands=False, with_backward=False),
                             num_ranks=2, rank=0, num_topk=2, max_tokens=4, token_bytes=4, mode=2)
    with pytest.raises(NativeArgumentError, match=r"ex_mode must be MOE_EP_EXCHANGE_THROUGHPUT \(0\) or "
                                                  r"MOE_EP_EXCHANGE_LOW_LATENCY \(1\); got 2"):
        ExchangeLayer(bad_mode)
    good = ExchangeLayer(with_exchange(
        layer_config(cfg, max_rows=4, cuda_device=None, bf16_operands=False, with_backward=False),
        num_ranks=2, rank=0, num_topk=2, max_tokens=4, token_bytes=4))
    try:
        with pytest.raises(NativeArgumentError, match="peer table must be set first"):
            _dispatch(good, np.ones((1, 4), np.uint8), np.zeros((1, 2), np.int32), np.ones((1, 2), np.float32), 4, 2)
        size, base_addr = good.exchange_info()
        assert size > 0 and base_addr % 256 == 0
    finally:
        good.close()


# ----------------------------------------------------------------------------- the front-end

torch = pytest.importorskip("torch")

from moe_ep_spec.inputs import random_world  # noqa: E402

import exchange_workers as XW  # noqa: E402
from torch_workers import run_ranks  # noqa: E402

FRONT = MoeEpConfig(
    num_experts=8, hidden=64, intermediate=32, num_topk=3, num_ranks=2, max_tokens_per_rank=12,
    recv_capacity=48, expert_alignment=4, generate_c=True,
)


def _world(config, seed, tokens):
    world = random_world(config, num_tokens=list(tokens), seed=seed)
    rng = np.random.default_rng(seed + 100)
    grads = [rng.standard_normal((w.activation.shape[0], config.hidden)).astype(np.float32) for w in world]
    return world, grads


def _ok(results):
    for r, res in enumerate(results):
        assert not (isinstance(res, tuple) and res and res[0] == "error"), f"rank {r} failed:\n{res[1]}"
    return results


def _compare(results, exact_keys):
    for rank, res in enumerate(results):
        for step, (st, dv) in enumerate(zip(res["static"], res["device"])):
            for key, want in st.items():
                got = dv[key]
                if key in exact_keys:
                    assert np.array_equal(got, want, equal_nan=True), f"rank {rank} step {step}: {key} differs"
                else:
                    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=2e-2,
                                               err_msg=f"rank {rank} step {step}: {key}")


@pytest.mark.parametrize("world_size,tokens", [(2, (12, 1)), (4, (5, 12, 3, 7))], ids=["ep2", "ep4"])
def test_front_end_device_exchange_equals_the_static_mode_on_cpu(world_size, tokens) -> None:
    config = FRONT.replace(num_ranks=world_size, num_experts=4 * world_size, recv_capacity=24 * world_size)
    world, grads = _world(config, 11, tokens)
    results = _ok(run_ranks(XW.device_matches_static, world_size, config, world, grads, "slot", False, "cpu"))
    _compare(results, exact_keys=set(results[0]["static"][0]))  # slot order: everything bit for bit


def _check_round_trip_places(results, in_combine=True) -> None:
    # in_combine: whether the front-end takes the combine's round trip (nvfp4: at one rank only).
    places = [False, True] if in_combine else [False]
    for rank, res in enumerate(results):
        assert res["round_trip_in_combine"] == places, (
            f"rank {rank}: whether the exchange layers round in the combine: {res['round_trip_in_combine']}; "
            f"want {places}"
        )
        for key, want in res["experts"].items():
            assert np.array_equal(res["combine"][key], want, equal_nan=True), (
                f"rank {rank}: {key} with the round trip in the combine differs from the experts stage's"
            )


# A block-scaled combine format whose blocks the combine reads a warp's 128 columns at a time.
ROUND_TRIP = FRONT.replace(hidden=128, combine_format="mxfp8")
ROUND_TRIP_FORMATS = pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])


def _round_trip_config(fmt, world_size):
    return ROUND_TRIP.replace(combine_format=fmt, num_ranks=world_size, num_experts=4 * world_size,
                              recv_capacity=max(48, 24 * world_size))


@ROUND_TRIP_FORMATS
@pytest.mark.parametrize("world_size,tokens", [(1, (9,)), (2, (12, 5))], ids=["ep1", "ep2"])
@pytest.mark.parametrize("combine", ["slot", "rank"])
def test_front_end_round_trip_in_the_combine_is_bit_for_bit_on_cpu(fmt, world_size, tokens, combine) -> None:
    # nvfp4: the combine rounds at one rank; across ranks the experts stage does (bf16 rows).
    config = _round_trip_config(fmt, world_size)
    world, grads = _world(config, 31, tokens)
    _check_round_trip_places(_ok(run_ranks(XW.round_trip_places_agree, world_size, config, world, grads, combine,
                                           "cpu")), in_combine=fmt == "mxfp8" or world_size == 1)


def _check_inference(results) -> None:
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["fc1_c_none"], f"rank {rank} {name}: forward(stash=False) returned a stash"
            for key in ("moe_ep", "stash_false"):
                assert np.array_equal(r[key], r["forward_op"], equal_nan=True), (
                    f"rank {rank} {name}: the output of {key} (no stash written) differs from the training forward's"
                )


def test_front_end_inference_writes_no_stash_and_gives_the_same_output_on_cpu() -> None:
    world, _ = _world(FRONT, 41, (12, 7))
    _check_inference(_ok(run_ranks(XW.inference_skips_the_stash, 2, FRONT, world, "cpu")))


def test_front_end_rank_sums_stay_close_and_fixed_parts_are_exact_on_cpu() -> None:
    world, grads = _world(FRONT, 12, (12, 9))
    results = _ok(run_ranks(XW.device_matches_static, 2, FRONT, world, grads, "rank", False, "cpu"))
    _compare(results, exact_keys={"fc1_c", "route_metadata", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"})


@pytest.mark.parametrize("mutate,expected", [
    ("expert_id", r"RoutingIndexError: rank \d: topk_idx values must be in \[-1, num_experts\)"),
    ("overflow", r"CapacityError: rank \d: received rows after aligning"),
])
def test_front_end_errors_make_every_output_nan_on_cpu(mutate, expected) -> None:
    import re

    world, _ = _world(FRONT, 6, (12, 12))
    results = _ok(run_ranks(XW.device_errors, 2, FRONT, world, mutate, "cpu"))
    for rank, res in enumerate(results):
        assert res["all_nan"], f"rank {rank}: output not NaN"
        assert re.search(expected, res["error"]), f"rank {rank}: {res['error']!r}"
        assert res["good_is_finite"]


def test_front_end_peer_that_never_arrives_raises_transport_error_on_cpu() -> None:
    world, _ = _world(FRONT, 7, (6, 6))
    results = _ok(run_ranks(XW.device_timeout, 2, FRONT, world, "cpu", timeout=120))
    res = results[0]
    assert res["error"].startswith("TransportError") and res["all_nan"] and res["seconds"] < 30, res


# ----------------------------------------------------------------------------- CUDA: N ranks on ONE GPU

def _one_gpu() -> bool:
    try:
        return has_cuda() and torch.cuda.is_available() and torch.cuda.device_count() >= 1
    except Exception:  # noqa: BLE001
        return False


cuda = pytest.mark.skipif(not _one_gpu(), reason="needs a CUDA build of the native core and a GPU")


EXCHANGE_MODES = pytest.mark.parametrize("mode", ["throughput", "low_latency"])


@cuda
@pytest.mark.parametrize("world_size,tokens", [(1, (9,)), (2, (12, 1)), (4, (5, 12, 3, 7))], ids=["ep1", "ep2", "ep4"])
@pytest.mark.parametrize("combine", ["slot", "rank"])
@EXCHANGE_MODES
def test_cuda_loopback_device_exchange_on_one_gpu(world_size, tokens, combine, mode) -> None:
    # EP 1: the one-rank kernels (no exchange); 9 tokens x 3 routes on 4 experts take up to 39 aligned rows.
    config = FRONT.replace(num_ranks=world_size, num_experts=4 * world_size, recv_capacity=max(48, 24 * world_size))
    world, grads = _world(config, 21, tokens)
    results = _ok(run_ranks(XW.device_matches_static, world_size, config, world, grads, combine, False, "cuda", mode,
                            timeout=300))
    from moe_ep_native.exchange import MODES

    for rank, res in enumerate(results):
        assert res["modes"] == [MODES[mode]], f"rank {rank} ran exchange layers of modes {res['modes']}, not {mode}"
    # The exchange is exact; CUDA's float32 kernels against the CPU ones are compared within tolerance.
    _compare(results, exact_keys={"route_metadata"})


@cuda
@ROUND_TRIP_FORMATS
@pytest.mark.parametrize("world_size,tokens", [(1, (9,)), (2, (12, 5))], ids=["ep1", "ep2"])
@pytest.mark.parametrize("combine", ["slot", "rank"])
@EXCHANGE_MODES
def test_cuda_loopback_round_trip_in_the_combine_is_bit_for_bit(fmt, world_size, tokens, combine, mode) -> None:
    # combine_one (EP 1), combine_send (EP 2, throughput), combine_ll (EP 2, low latency); slot: copy_piece.
    # nvfp4: the combine rounds at one rank (combine_one); across ranks the experts stage does.
    config = _round_trip_config(fmt, world_size)
    world, grads = _world(config, 32, tokens)
    _check_round_trip_places(_ok(run_ranks(XW.round_trip_places_agree, world_size, config, world, grads, combine,
                                           "cuda", mode, timeout=300)), in_combine=fmt == "mxfp8" or world_size == 1)


@cuda
def test_cuda_inference_writes_no_stash_and_gives_the_same_output() -> None:
    config = FRONT.replace(num_ranks=1, num_experts=4, recv_capacity=48)
    world, _ = _world(config, 42, (9,))
    _check_inference(_ok(run_ranks(XW.inference_skips_the_stash, 1, config, world, "cuda", timeout=300)))


@cuda
@pytest.mark.parametrize("weight_in_fc1,clamp", [(True, None), (False, 6.0)], ids=["weight-in-fc1", "clamp"])
def test_cuda_fc1_swiglu_in_the_gemm_epilogue_is_bit_for_bit_the_pass(weight_in_fc1, clamp) -> None:
    # Enough rows an expert (capacity 1024 over 4 experts) and intermediate a multiple of 128: FC1
    # is the fused GEMM (cuda/gemm/fc1_swiglu_gemm.h) unless MOE_EP_FC1_EPILOGUE=pass.
    config = MoeEpConfig(num_experts=4, hidden=256, intermediate=128, num_topk=2, num_ranks=1,
                         max_tokens_per_rank=400, recv_capacity=1024, expert_alignment=8, generate_c=True,
                         intermediate_format="bf16", apply_topk_in_fc1=weight_in_fc1, gate_up_clamp=clamp)
    world, grads = _world(config, 43, (400,))
    res = _ok(run_ranks(XW.fc1_epilogue_fused_matches_pass, 1, config, world, grads, timeout=300))[0]
    for key, want in res["pass"].items():
        if key == "kernels":
            continue
        assert np.array_equal(res["fused"][key], want, equal_nan=True), (
            f"{key}: the fused FC1 epilogue differs from FC1's GEMM and the pass"
        )
    assert "MOE_EP_FC1_EPILOGUE must be unset, 'fused' or 'pass'; got 'fast'" in res["bad_value_error"], res
    # Last: under compute-sanitizer the profiler (CUPTI) sees no kernel.
    fused_kernels = [k for k in res["fused"]["kernels"] if "MoeEpGatedCollectiveMma" in k]
    assert fused_kernels, f"the fused FC1 did not run by default; kernels: {res['fused']['kernels']}"
    assert not any("MoeEpGatedCollectiveMma" in k for k in res["pass"]["kernels"]), "MOE_EP_FC1_EPILOGUE=pass ran it"


@cuda
@pytest.mark.parametrize("world_size,mutate", [(1, "expert_id"), (2, "expert_id"), (2, "overflow")],
                         ids=["ep1-expert_id", "ep2-expert_id", "ep2-overflow"])
@EXCHANGE_MODES
def test_cuda_loopback_errors(world_size, mutate, mode) -> None:
    # EP 1 (the one-rank kernels): a bad id only. One rank's all-to-one routes need no more aligned
    # rows than its good routes may (12 x 3 routes on 4 experts: 36 against up to 48), so the
    # overflow case needs the second rank's rows.
    config = FRONT if world_size == 2 else FRONT.replace(num_ranks=1, num_experts=4, recv_capacity=48)
    world, _ = _world(config, 6, (12,) * world_size)
    results = _ok(run_ranks(XW.device_errors, world_size, config, world, mutate, "cuda", mode, timeout=300))
    for res in results:
        assert res["all_nan"] and res["error"] and res["good_is_finite"], res


@cuda
@pytest.mark.parametrize("plan", ["block", "grid"])
@pytest.mark.parametrize("mutate", [None, "expert_id"], ids=["good", "expert_id"])
@EXCHANGE_MODES
def test_cuda_one_rank_plans_in_one_block_or_over_the_grid(plan, mutate, mode, monkeypatch) -> None:
    # EP 1's two dispatch plans (MOE_EP_ONE_RANK_PLAN forces one; by default the block up to
    # 4096 routes): the same rows, metadata and results as the static mode, and a bad id's NaN.
    monkeypatch.setenv("MOE_EP_ONE_RANK_PLAN", plan)
    config = FRONT.replace(num_ranks=1, num_experts=4, recv_capacity=48)
    if mutate is None:
        world, grads = _world(config, 21, (9,))
        _compare(_ok(run_ranks(XW.device_matches_static, 1, config, world, grads, "slot", False, "cuda", mode,
                               timeout=300)), exact_keys={"route_metadata"})
        return
    world, _ = _world(config, 6, (12,))
    for res in _ok(run_ranks(XW.device_errors, 1, config, world, mutate, "cuda", mode, timeout=300)):
        assert res["all_nan"] and res["error"] and res["good_is_finite"], res


# EP 1's kernels for few tokens (MOE_EP_ONE_RANK_FAST: dispatch_one_fused, dispatch_one_small,
# dispatch_place's finer pieces, combine_one_fine) and the ones they replace: T, K, E, alignment,
# capacity, max tokens, hidden, routing, MOE_EP_ONE_RANK_PLAN, token row bytes past 2 * hidden
# (not a multiple of 16: the two-kernel dispatch).
ONE_RANK_CASES = {
    "decode": (128, 8, 32, 1, 1024, 128, 7168, "distinct", None, 0),
    "decode-in-a-layer-for-more-tokens": (128, 8, 32, 16, 1024 + 32 * 15, 512, 7168, "distinct", None, 0),
    "aligned-repeats-unused": (100, 6, 20, 8, 600 + 20 * 7, 100, 640, "repeat", None, 0),
    "most-routes-of-the-block": (512, 8, 256, 1, 4096, 512, 256, "uniform", None, 0),
    "beyond-the-small-plan": (513, 8, 64, 2, 4104 + 64, 513, 256, "uniform", "block", 0),
    "grid-plan": (128, 8, 32, 1, 1024, 128, 512, "distinct", "grid", 0),
    "unaligned-rows": (40, 4, 8, 2, 160 + 8, 40, 128, "repeat", None, 4),
    "few": (3, 2, 4, 4, 16, 5, 128, "repeat", None, 0),
    "empty": (0, 4, 8, 1, 16, 4, 128, "uniform", None, 0),
    "bad-id": (64, 4, 16, 1, 256, 64, 384, "bad", None, 0),
    "overflow": (64, 4, 8, 4, 160, 64, 384, "uniform", None, 0),
}


def _one_rank_routing(rng, t, k, e, kind):
    if kind == "distinct":
        return np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    idx = rng.integers(0, e, size=(t, k)).astype(np.int32)
    idx[rng.random((t, k)) < 0.1] = -1
    if kind == "repeat" and t:
        idx[:, -1] = idx[:, 0]
    if kind == "bad" and t:
        idx[1, 0], idx[t // 2, k - 1] = e + 3, -7
    return idx


def _one_rank_run(case, device):
    """One EP 1 exchange layer of ``case`` on ``device`` ("cpu": the CPU twin, numpy buffers;
    "cuda": cuda:0, torch buffers): a dispatch and three combines (bf16 rows into bf16, float32
    rows with per-route values into float32, float32 rows through mxfp8's round trip into
    bf16), every output buffer filled with a marker first. Returns the inputs and the outputs."""
    t, k, e, align, cap, tmax, hidden, kind, _, row_pad = ONE_RANK_CASES[case]
    rng = np.random.default_rng(sum(map(ord, case)))
    idx = _one_rank_routing(rng, t, k, e, kind)
    w = rng.standard_normal((t, k)).astype(np.float32)
    rb = 2 * hidden + row_pad  # bf16 token rows (+ row_pad bytes)
    tok = rng.integers(0, 256, size=(t, rb)).astype(np.uint8)
    y_bf16 = (rng.standard_normal((cap, hidden)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # finite
    y_f32 = rng.standard_normal((cap, hidden)).astype(np.float32)
    values = rng.standard_normal(cap).astype(np.float32)
    cfg = MoeEpConfig(num_experts=e, hidden=hidden, intermediate=16, num_topk=k, num_ranks=1)
    base = layer_config(cfg, max_rows=cap, cuda_device=0 if device == "cuda" else None, bf16_operands=False,
                        with_backward=False)
    layer = ExchangeLayer(with_exchange(base, num_ranks=1, rank=0, num_topk=k, max_tokens=tmax, token_bytes=rb,
                                        expert_alignment=align))
    if device == "cuda":  # bf16 bits travel as int16 (torch's uint16 has few operations)
        dev = torch.device("cuda:0")
        stream = torch.cuda.current_stream(dev).cuda_stream
        wide = {np.dtype(np.uint16): np.int16}
        put = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(wide.get(a.dtype, a.dtype))).to(dev)  # noqa: E731
        ptr = lambda a: a.data_ptr() if a is not None and a.numel() else None  # noqa: E731
        back = lambda a, dtype: a.cpu().numpy().view(dtype)  # noqa: E731
    else:
        stream, put, ptr = None, np.ascontiguousarray, _ptr
        back = lambda a, dtype: np.asarray(a)  # noqa: E731
    try:
        layer.set_peers([layer.exchange_info()[1]])
        ins = {name: put(a) for name, a in dict(tok=tok, idx=idx, w=w, y_bf16=y_bf16, y_f32=y_f32,
                                                 values=values).items()}
        marks = dict(
            tokens=np.full((cap, rb), 0xAB, np.uint8), w=np.full(cap, 7.0, np.float32),
            meta=np.full((cap, 4), 99, np.int32), gs=np.full(e, -5, np.int32), tpe=np.full(e, -5, np.int32),
            err=np.full(1, -1, np.int32), bf16=np.full((t, hidden), 0x5A5A, np.uint16),
            bf16_err=np.full(1, -1, np.int32), f32=np.full((t, hidden), 5.0, np.float32),
            f32_values=np.full((t, k), 5.0, np.float32), f32_err=np.full(1, -1, np.int32),
            rt=np.full((t, hidden), 0x5A5A, np.uint16), rt_err=np.full(1, -1, np.int32),
        )
        outs = {name: put(a) for name, a in marks.items()}
        layer.dispatch(stream, t, rb, ptr(ins["tok"]), ptr(ins["idx"]), ptr(ins["w"]), ptr(outs["tokens"]),
                       ptr(outs["w"]), ptr(outs["meta"]), ptr(outs["gs"]), ptr(outs["tpe"]), ptr(outs["err"]))
        layer.combine(stream, t, ptr(ins["y_bf16"]), ptr(outs["bf16"]), out_error=ptr(outs["bf16_err"]),
                      y_bf16=True, out_bf16=True)
        layer.combine(stream, t, ptr(ins["y_f32"]), ptr(outs["f32"]), ptr(ins["values"]), ptr(outs["f32_values"]),
                      ptr(outs["f32_err"]))
        layer.combine(stream, t, ptr(ins["y_f32"]), ptr(outs["rt"]), out_error=ptr(outs["rt_err"]), out_bf16=True,
                      y_round_trip=Format.MXFP8)
        if device == "cuda":
            torch.cuda.synchronize(dev)
        got = {name: back(a, marks[name].dtype) for name, a in outs.items()}
    finally:
        layer.close()
    return dict(idx=idx, w=w, tok=tok, y_bf16=y_bf16, y_f32=y_f32, values=values), got


def _check_one_rank(case, inputs, got):
    """The outputs of _one_rank_run against the spec's routing order and slot-order sums from +0
    (the round trip's bits: the other tests'), or, with a bad id or an overflow, the error
    everywhere and NaN sums."""
    t, k, e, align, cap = ONE_RANK_CASES[case][:5]
    kind = ONE_RANK_CASES[case][7]
    want = _expected([inputs["idx"]], [inputs["tok"]], [inputs["w"]], 1, e, k, align, cap)[0]
    err = int(got["err"][0])
    expect_err = BAD_EXPERT_ID if kind == "bad" else (OVERFLOW if want["aligned"] > cap else 0)
    assert err == expect_err, f"{case}: dispatch error {err}, expected {expect_err}"
    for name in ("bf16_err", "f32_err", "rt_err"):
        assert int(got[name][0]) == err, f"{case}: {name} {int(got[name][0])} != the dispatch's {err}"
    for name in ("tokens", "w", "meta", "gs", "tpe"):
        if err != BAD_EXPERT_ID:  # the rows that fit are placed even on an overflow
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{case}: dispatch {name}")
    if err:
        assert np.isnan(got["f32"]).all() and np.isnan(got["f32_values"]).all(), case
        for name in ("bf16", "rt"):
            assert np.isnan(_as_f32(got[name])).all(), f"{case}: {name} not NaN"
        return
    rows = {(int(m[2]), int(m[3])): r for r, m in enumerate(got["meta"]) if m[0] >= 0}
    y_bf16 = _as_f32(inputs["y_bf16"])
    ref_bf16 = np.zeros((t, y_bf16.shape[1]), np.float32)
    ref_f32 = np.zeros((t, y_bf16.shape[1]), np.float32)
    ref_values = np.zeros((t, k), np.float32)
    for (tt, kk), r in sorted(rows.items(), key=lambda item: item[0]):  # slot order within a token, from +0
        ref_bf16[tt] = ref_bf16[tt] + y_bf16[r]
        ref_f32[tt] = ref_f32[tt] + inputs["y_f32"][r]
        ref_values[tt, kk] = inputs["values"][r]
    np.testing.assert_array_equal(got["bf16"], _bf16_encode(ref_bf16), err_msg=f"{case}: bf16 sums")
    np.testing.assert_array_equal(got["f32"].view(np.uint32), ref_f32.view(np.uint32), err_msg=f"{case}: f32 sums")
    np.testing.assert_array_equal(got["f32_values"], ref_values, err_msg=f"{case}: values")


@pytest.mark.parametrize("case", list(ONE_RANK_CASES))
def test_cpu_twin_one_rank_cases_follow_the_routing_order(case) -> None:
    # The cases of the CUDA test below on the CPU twin (the same expectations).
    _check_one_rank(case, *_one_rank_run(case, "cpu"))


@cuda
@pytest.mark.parametrize("case", list(ONE_RANK_CASES))
def test_cuda_one_rank_fast_kernels_give_the_earlier_kernels_bits(case, monkeypatch) -> None:
    # MOE_EP_ONE_RANK_FAST: every part on (the default: the fused dispatch where it applies), none,
    # the two-kernel dispatch, and each part alone: every output the same bits (the marker left
    # where nothing is written included), and the spec's values.
    plan = ONE_RANK_CASES[case][8]
    if plan is not None:
        monkeypatch.setenv("MOE_EP_ONE_RANK_PLAN", plan)
    runs = {}
    for fast in ("none", "all", "plan,place,combine", "fused", "plan", "place", "combine"):
        monkeypatch.setenv("MOE_EP_ONE_RANK_FAST", fast)
        inputs, runs[fast] = _one_rank_run(case, "cuda")
    for fast, got in runs.items():
        for name, ref in runs["none"].items():
            assert got[name].tobytes() == ref.tobytes(), f"{case}: MOE_EP_ONE_RANK_FAST={fast}: {name} differs"
    _check_one_rank(case, inputs, runs["all"])


@cuda
@EXCHANGE_MODES
def test_cuda_loopback_peer_that_never_arrives_raises_transport_error(mode) -> None:
    world, _ = _world(FRONT, 7, (6, 6))
    results = _ok(run_ranks(XW.device_timeout, 2, FRONT, world, "cuda", mode, timeout=300))
    res = results[0]
    assert res["error"].startswith("TransportError") and res["all_nan"] and res["seconds"] < 60, res


def test_front_end_validates_the_exchange_mode(monkeypatch) -> None:
    """MOE_EP_CUDA_NCCL_EXCHANGE_MODE picks the layer's ex_mode; anything else is a ConfigError."""
    from moe_ep_cuda_nccl import device_exchange as D
    from moe_ep_native.exchange import MODES
    from moe_ep_spec import errors as E

    assert D.MODE_ENV == "MOE_EP_CUDA_NCCL_EXCHANGE_MODE" and MODES == {"throughput": 0, "low_latency": 1}
    monkeypatch.delenv(D.MODE_ENV, raising=False)
    assert D._mode() == THROUGHPUT
    monkeypatch.setenv(D.MODE_ENV, "low_latency")
    assert D._mode() == LOW_LATENCY
    monkeypatch.setenv(D.MODE_ENV, "fast")
    with pytest.raises(E.ConfigError, match=r"MOE_EP_CUDA_NCCL_EXCHANGE_MODE must be one of 'throughput', "
                                            r"'low_latency'; got 'fast'"):
        D._mode()


def test_cpu_twin_runs_either_mode_with_the_same_results() -> None:
    """The mode only changes how CUDA launches a stage: CPU layers made in the low-latency
    mode give the throughput mode's dispatch and combine bit for bit (the twin has one path)."""
    n, el, k, cap, tmax, rb = 2, 2, 2, 16, 4, 8
    idx = [np.array([[0, 3], [1, -1], [2, 2]], np.int32), np.array([[3, 1]], np.int32)]
    rng = np.random.default_rng(5)
    tok = [rng.integers(0, 256, size=(i.shape[0], rb)).astype(np.uint8) for i in idx]
    w = [rng.standard_normal(i.shape).astype(np.float32) for i in idx]
    y = rng.standard_normal((cap, 8)).astype(np.float32)
    got = {}
    for mode in (THROUGHPUT, LOW_LATENCY):
        layers = _layers(n, el, k, cap, tmax, rb, mode=mode)
        try:
            disp = _parallel([lambda r=r: _dispatch(layers[r], tok[r], idx[r], w[r], cap, el) for r in range(n)])
            comb = _parallel([lambda r=r: _combine(layers[r], idx[r].shape[0], y, k)[0] for r in range(n)])
            got[mode] = [dict(d, out=c) for d, c in zip(disp, comb)]
        finally:
            for lay in layers:
                lay.close()
    for r in range(n):
        for key, want in got[THROUGHPUT][r].items():
            assert np.array_equal(got[LOW_LATENCY][r][key], want, equal_nan=True), f"rank {r}: {key} differs"


@cuda
@pytest.mark.parametrize("name, value, rule", [
    ("MOE_EP_ONE_RANK_FAST", "fused,fast", r"MOE_EP_ONE_RANK_FAST must be unset, 'all', 'none' or a comma-separated "
                                           r"list of fused, plan, place, combine; got 'fused,fast'"),
    ("MOE_EP_ONE_RANK_FAST", "off", r"MOE_EP_ONE_RANK_FAST must be unset, .*; got 'off'"),
    ("MOE_EP_ONE_RANK_PLAN", "blocks", r"MOE_EP_ONE_RANK_PLAN must be unset, 'block' or 'grid'; got 'blocks'"),
])
def test_cuda_one_rank_switches_reject_a_value_that_names_nothing(name, value, rule, monkeypatch) -> None:
    # A timing switch with a typo is an error naming the rule and the value, raised before any
    # kernel is enqueued, never a silent default.
    monkeypatch.setenv(name, value)
    with pytest.raises(NativeArgumentError, match=rf"moe_ep_layer_dispatch: {rule}"):
        _one_rank_run("few", "cuda")
