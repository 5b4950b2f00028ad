"""The native core's CUDA implementation against its CPU implementation,
kernel by kernel, through the C ABI (device memory and the stream come from
torch, used here only as a CUDA allocator). Formats, plan, permutation and the
combine reduction must agree bit for bit; the expert GEMMs within float32
rounding. Skipped without a GPU or a CUDA build (CI); run on a GPU
machine by ``python scripts/gpu.py test``, and under compute-sanitizer by its ``sanitize`` step."""

from __future__ import annotations

import ctypes
import zlib

import ml_dtypes
import numpy as np
import pytest

moe_ep_native = pytest.importorskip("moe_ep_native", reason="moe-ep-native is not installed")
torch = pytest.importorskip("torch", reason="torch allocates the device buffers of this test")
try:
    _HAS_CUDA_BUILD = moe_ep_native.has_cuda()
except FileNotFoundError:  # pragma: no cover
    _HAS_CUDA_BUILD = False
if not (_HAS_CUDA_BUILD and torch.cuda.is_available()):
    pytest.skip("needs a GPU and moe-ep-native built with MOE_EP_NATIVE_CUDA=1", allow_module_level=True)

from moe_ep_native import host  # noqa: E402
from moe_ep_native._capi import Format, call, load  # noqa: E402
from moe_ep_spec import MoeEpConfig, NativeArgumentError  # noqa: E402
from moe_ep_spec import formats as F  # noqa: E402

CUDA = 1
BF16_NP = np.dtype(ml_dtypes.bfloat16)
_FMT = {"bf16": Format.BF16, "mxfp8": Format.MXFP8, "nvfp4": Format.NVFP4}


_ALIVE: list = []


@pytest.fixture(autouse=True)
def _release_buffers():
    yield
    torch.cuda.synchronize()
    _ALIVE.clear()


def dev(a: np.ndarray) -> "torch.Tensor":
    """A device copy of ``a``'s bytes, kept alive until the test ends (a pointer
    taken from a temporary tensor would let the caching allocator reuse it)."""
    a = np.ascontiguousarray(a)
    t = torch.from_numpy(a.view(np.uint8).reshape(-1).copy()).cuda()
    _ALIVE.append(t)
    return t


def empty(nbytes: int, fill: int = 0xCD) -> "torch.Tensor":
    """Device bytes pre-filled with a sentinel, so that an unwritten output shows."""
    t = torch.full((max(1, nbytes),), fill, dtype=torch.uint8, device="cuda")
    _ALIVE.append(t)
    return t


def host_of(t: "torch.Tensor", dtype, shape) -> np.ndarray:
    torch.cuda.synchronize()
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return t[:n].cpu().numpy().view(dtype).reshape(shape)


def _captured(launches) -> "torch.cuda.CUDAGraph":
    """``launches()`` run once on a side stream (the warm-up, outside the capture),
    then captured into a CUDA graph, which is returned (not replayed)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launches()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    return graph


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _special_values(rng, shape):
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
    flat = x.reshape(-1)
    if flat.size:
        for k, v in ((13, 0.0), (17, -0.0), (29, 448.0 * 1.0625), (31, 2.5), (97, np.nan), (101, -np.inf)):
            flat[rng.choice(flat.size, max(1, flat.size // k), replace=False)] = v
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape,axis", [((33, 64), 1), ((5, 45), 1), ((3, 33, 4), 1), ((4, 6, 31), 2), ((0, 32), 1)])
def test_formats_cuda_equal_cpu(fmt, shape, axis):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, shape, axis)).encode()))
    x = _special_values(rng, shape)
    want = host.quantize(x, fmt, axis=axis)
    outer = int(np.prod(shape[:axis], dtype=np.int64))
    n = shape[axis]
    inner = int(np.prod(shape[axis + 1 :], dtype=np.int64))
    if fmt == "bf16":
        scale_shape = None
        wd = np.asarray(want).view(np.uint16)
    else:
        wd, ws = want.data.view(np.uint8), want.scale.view(np.uint8)
        scale_shape = ws.shape
    xd = dev(x)
    dd = empty(wd.nbytes)
    sd = None if scale_shape is None else empty(int(np.prod(scale_shape)))
    call("moe_ep_quantize", CUDA, stream(), _FMT[fmt], xd.data_ptr(), outer, n, inner, dd.data_ptr(),
         None if sd is None else sd.data_ptr())
    got_d = host_of(dd, wd.dtype, wd.shape)
    np.testing.assert_array_equal(got_d, wd, err_msg=f"CUDA {fmt} data codes differ from CPU")
    if sd is not None:
        np.testing.assert_array_equal(host_of(sd, np.uint8, ws.shape), ws, err_msg=f"CUDA {fmt} scale codes differ")
    out = empty(x.nbytes)
    call("moe_ep_dequantize", CUDA, stream(), _FMT[fmt], dd.data_ptr(), None if sd is None else sd.data_ptr(), outer,
         n, inner, out.data_ptr())
    got = host_of(out, np.float32, x.shape)
    ref = host.dequantize(want)
    assert np.array_equal(np.isnan(got), np.isnan(ref)) and np.array_equal(np.nan_to_num(got), np.nan_to_num(ref))


# Rows whose blocks hit the encoders' corners: subnormals, values near float32's top, a
# block of zeros but one huge value, amax below 448 * 2^-127 (the clamped mxfp8 scale),
# signed zeros, NaN and +-Inf.
def _corner_rows(rng, shape):
    x = _special_values(rng, shape)
    n = shape[1]
    x[1] = rng.standard_normal(n) * np.float32(2.0**-140)
    x[2] = rng.uniform(-1.0, 1.0, n) * np.float32(3.4e38)
    x[3] = np.where(rng.integers(0, 2, n) == 1, np.float32(-0.0), np.float32(0.0))
    x[3, 5] = np.float32(2.0**127)
    x[4] = rng.standard_normal(n) * np.float32(2.0**-128)
    x[5, 7], x[5, 20] = np.nan, np.inf
    return x


def _nvfp4_threshold_rows(rng) -> np.ndarray:
    """``[R, 16] float32`` blocks on every rounding threshold of nvfp4: a block whose
    largest magnitude is each of the 126 scale bounds 6 * (E4M3 midpoint) or one of its
    float32 neighbours (the only inputs where the hardware convert of fl(amax / 6) could
    round otherwise than the spec's bounds), and for every nonzero E4M3 scale s a block with amax 6 s whose other
    elements are the E2M1 thresholds (midpoints times s) and their neighbours, both signs."""
    e4m3 = np.arange(127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    bounds = (3.0 * (e4m3[:-1] + e4m3[1:])).astype(np.float32)
    assert np.array_equal(bounds.astype(np.float64), 3.0 * (e4m3[:-1] + e4m3[1:])), "the bounds are exact in float32"
    rows = []
    for b in bounds:
        for a in (np.nextafter(b, np.float32(0)), b, np.nextafter(b, np.float32(np.inf))):
            row = (rng.uniform(-1.0, 1.0, 16) * a).astype(np.float32)
            row[rng.integers(16)] = a if rng.integers(2) else -a
            rows.append(row)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    for s in e4m3[1:].astype(np.float32):
        t = mids * s
        for row in (np.concatenate([[6 * s], t, -np.nextafter(t, np.float32(0)), [0.0]]),
                    np.concatenate([[-6 * s], -t, np.nextafter(t, np.float32(np.inf)), [-0.0]])):
            rows.append(row.astype(np.float32))
    return np.stack(rows)


def test_nvfp4_cuda_every_rounding_threshold_is_the_specs():
    """The CUDA nvfp4 encoder (the scale from the hardware's E4M3 convert of the float32
    quotient; the element codes by the thresholds the FC2 epilogue's round trip shares)
    gives the spec's codes on every bound, on each side of it, and on every E2M1
    threshold at every scale."""
    x = _nvfp4_threshold_rows(np.random.default_rng(15))
    want = F.quantize(x, "nvfp4", axis=1)
    wd, ws = want.data_codes(), want.scale_codes()
    xd = dev(x)
    dd, sd = empty(wd.nbytes), empty(ws.nbytes)
    call("moe_ep_quantize", CUDA, stream(), Format.NVFP4, xd.data_ptr(), x.shape[0], x.shape[1], 1, dd.data_ptr(),
         sd.data_ptr())
    got_s = host_of(sd, np.uint8, ws.shape)
    bad = np.argwhere(got_s != ws)
    assert bad.size == 0, (f"scale codes differ from the spec's at blocks {bad[:4, 0].tolist()}: amax "
                           f"{[float(np.abs(x[r]).max()) for r in bad[:4, 0]]} got {got_s[bad[:4, 0], 0].tolist()} "
                           f"want {ws[bad[:4, 0], 0].tolist()}")
    got_d = host_of(dd, np.uint8, wd.shape)
    bad = np.argwhere(got_d != wd)
    assert bad.size == 0, f"data codes differ from the spec's at (block, byte) {bad[:4].tolist()}"


# Blocks along contiguous rows take the vec4 kernels when n is a multiple of the block and
# the buffers are aligned (offsets 0, 0), the element kernels otherwise: x shifted by 4
# bytes, data by 2 (still the vec4 path for nvfp4's 2-byte stores), n = 48 (ragged for
# mxfp8's 32, whole nvfp4 blocks). Every path must give the CPU's bytes.
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape,x_off,d_off", [((40, 96), 0, 0), ((40, 96), 4, 0), ((40, 96), 0, 2), ((7, 48), 0, 0)])
def test_formats_cuda_row_paths_equal_cpu(fmt, shape, x_off, d_off):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, shape, x_off, d_off)).encode()))
    x = _corner_rows(rng, shape)
    want = host.quantize(x, fmt, axis=1)
    if fmt == "bf16":
        wd, ws = np.asarray(want).view(np.uint16), None
    else:
        wd, ws = want.data.view(np.uint8), want.scale.view(np.uint8)
    xd = dev(np.concatenate([np.zeros(x_off, np.uint8), x.view(np.uint8).reshape(-1)]))
    dd = empty(d_off + wd.nbytes)
    sd = None if ws is None else empty(ws.size)
    sp = None if sd is None else sd.data_ptr()
    call("moe_ep_quantize", CUDA, stream(), _FMT[fmt], xd.data_ptr() + x_off, shape[0], shape[1], 1,
         dd.data_ptr() + d_off, sp)
    got_d = host_of(dd[d_off:], wd.dtype, wd.shape)
    np.testing.assert_array_equal(got_d, wd, err_msg=f"CUDA {fmt} data codes differ from CPU")
    if sd is not None:
        np.testing.assert_array_equal(host_of(sd, np.uint8, ws.shape), ws, err_msg=f"CUDA {fmt} scale codes differ")
    out = empty(x.nbytes)
    call("moe_ep_dequantize", CUDA, stream(), _FMT[fmt], dd.data_ptr() + d_off, sp, shape[0], shape[1], 1,
         out.data_ptr())
    got = host_of(out, np.float32, x.shape)
    ref = host.dequantize(want)
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    assert same.all(), f"{fmt} {shape}: the CUDA decode differs from the CPU's at {np.argwhere(~same)[:4].tolist()}"


@pytest.mark.parametrize("t,k,e", [(0, 2, 4), (1, 1, 1), (257, 4, 16), (1024, 8, 256), (700, 8, 12000)])
def test_plan_routes_cuda_equal_cpu(t, k, e):
    rng = np.random.default_rng(t + e)
    idx = rng.integers(-1, e, size=(t, k)).astype(np.int32)
    if idx.size > 2:
        idx.reshape(-1)[:2] = [e + 3, -5]
    want = host.plan_routes(idx, e)
    outs = [empty(4 * t * k) for _ in range(3)] + [empty(4 * (e + 1))]
    call("moe_ep_plan_routes", CUDA, stream(), dev(idx).data_ptr(), t, k, e, *[o.data_ptr() for o in outs])
    send, pos, exp = (host_of(o, np.int32, (t * k,)) for o in outs[:3])
    counts = host_of(outs[3], np.int32, (e + 1,))
    np.testing.assert_array_equal(send, want.send_route)
    np.testing.assert_array_equal(pos, want.route_pos)
    np.testing.assert_array_equal(exp, want.route_expert)
    np.testing.assert_array_equal(counts[:e], want.counts)
    assert counts[e] == want.num_bad


def test_permute_and_combine_cuda_equal_cpu():
    rng = np.random.default_rng(5)
    t, k, h = 300, 4, 130
    tokens = rng.integers(0, 256, size=(t, 2 * h + 3), dtype=np.uint8)
    plan = host.plan_routes(rng.integers(-1, 32, size=(t, k)).astype(np.int32), 32)
    want = host.permute_rows(tokens, plan.send_route, k)
    out = empty(want.nbytes)
    call("moe_ep_permute_rows", CUDA, stream(), dev(tokens).data_ptr(), t, k, tokens.shape[1],
         dev(plan.send_route).data_ptr(), t * k, out.data_ptr())
    np.testing.assert_array_equal(host_of(out, np.uint8, want.shape), want)

    rows = rng.standard_normal((t * k, h)).astype(np.float32)
    for pos in (plan.route_pos, None):
        want = host.combine_reduce(rows, pos, t, k)
        out = empty(want.nbytes)
        call("moe_ep_combine_reduce", CUDA, stream(), dev(rows).data_ptr(), t * k,
             None if pos is None else dev(pos).data_ptr(), t, k, h, out.data_ptr())
        np.testing.assert_array_equal(host_of(out, np.float32, want.shape), want, err_msg="combine_reduce")


@pytest.mark.parametrize("h", [64, 20, 13])  # 16-byte loads for both row dtypes; for float32 only; element by element
def test_combine_reduce_of_float32_and_bf16_rows_on_every_path(h):
    rng = np.random.default_rng(h)
    t, k, n = 29, 5, 120
    rows32 = rng.standard_normal((n, h)).astype(np.float32)
    rows16 = rows32.astype(BF16_NP)
    pos = rng.integers(-1, n, t * k).astype(np.int32)
    for rows, name in ((rows32, "moe_ep_combine_reduce"), (rows16, "moe_ep_combine_reduce_bf16")):
        want = host.combine_reduce(rows, pos, t, k)
        np.testing.assert_array_equal(want, host.combine_reduce(rows.astype(np.float32), pos, t, k),
                                      err_msg=f"{name}: the bf16 rows' sums are the float32 rows' sums")
        out = empty(want.nbytes)
        call(name, CUDA, stream(), dev(rows.view(np.uint16) if rows.dtype == BF16_NP else rows).data_ptr(), n,
             dev(pos).data_ptr(), t, k, h, out.data_ptr())
        np.testing.assert_array_equal(host_of(out, np.float32, want.shape), want, err_msg=f"{name}, hidden {h}")


def _wide_rows(h):
    """``(t, k, n, rows, pos)`` for the combine tests: 23 tokens of 8 slots over 150 float32
    rows of ``h`` values spanning 2^-140..2^100 (one NaN in row 7, row n - 1 all NaN and read
    by no route), and random route positions, -1 (unused) included."""
    rng = np.random.default_rng(h)
    t, k, n = 23, 8, 150
    rows = (rng.standard_normal((n, h)) * np.exp2(rng.integers(-140, 100, (n, 1)))).astype(np.float32)
    rows[7, 5] = np.nan
    rows[n - 1] = np.nan
    pos = rng.integers(-1, n - 1, t * k).astype(np.int32)
    return t, k, n, rows, pos


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("h", [7168, 64, 48, 40])  # four values a lane; 48: nvfp4's lanes, mxfp8 by blocks; 40: by blocks
def test_combine_reduce_round_trip_on_every_path(fmt, h):
    """moe_ep_combine_reduce_round_trip on CUDA: bit for bit the CPU entry (the spec's round
    trip of every row read, then the slot-order sum), with rows spanning 2^-140..2^100 (scale
    codes at both ends), a NaN in one row, unused slots and a NaN row no route reads."""
    t, k, n, rows, pos = _wide_rows(h)
    code = {"mxfp8": 2, "nvfp4": 3}[fmt]
    want = host.combine_reduce(rows, pos, t, k, round_trip=fmt)
    out = empty(want.nbytes)
    call("moe_ep_combine_reduce_round_trip", CUDA, stream(), code, dev(rows).data_ptr(), n, dev(pos).data_ptr(), t, k,
         h, out.data_ptr())
    np.testing.assert_array_equal(host_of(out, np.float32, want.shape), want, err_msg=f"{fmt}, hidden {h}")
    ident = rows[: t * k] if t * k <= n else np.resize(rows, (t * k, h))
    want = host.combine_reduce(ident, None, t, k, round_trip=fmt)
    out = empty(want.nbytes)
    call("moe_ep_combine_reduce_round_trip", CUDA, stream(), code, dev(ident).data_ptr(), t * k, None, t, k, h,
         out.data_ptr())
    np.testing.assert_array_equal(host_of(out, np.float32, want.shape), want, err_msg=f"{fmt}, hidden {h}, identity")


@pytest.mark.parametrize("out_format", ["bf16", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("rows_kind", ["float32", "bfloat16", "mxfp8", "nvfp4"])  # the last two: round trips
@pytest.mark.parametrize("h", [7168, 64, 48])  # a lane's 16-byte loads; 48: 32 columns a thread
def test_combine_reduce_encode_on_every_path(out_format, rows_kind, h):
    """moe_ep_combine_reduce_encode on CUDA: bit for bit the CPU entry (the sums, the round
    trip of every row read, the encode), with rows spanning 2^-140..2^100 (scale codes at both
    ends), a NaN in one row, unused slots, a NaN row no route reads, a route position past the
    rows (adds nothing on CUDA), and the error flag (all NaN)."""
    t, k, n, rows, pos = _wide_rows(h)
    rt = rows_kind if rows_kind in ("mxfp8", "nvfp4") else None
    rt_code = {None: 0, "mxfp8": 2, "nvfp4": 3}[rt]
    out_code = {"bf16": 1, "mxfp8": 2, "nvfp4": 3}[out_format]
    if rows_kind == "bfloat16":
        rows = rows.astype(BF16_NP)
    src = rows.view(np.uint16) if rows.dtype == BF16_NP else rows
    over = pos.copy()
    over[3] = n + 5  # CUDA adds nothing for it; the CPU entry rejects it, so the expectation sets -1 there
    expect_pos = over.copy()
    expect_pos[3] = -1
    for error in (False, True):
        want = host.combine_reduce_encode(rows, expect_pos, t, k, out_format, round_trip=rt, error=error)
        parts = [np.asarray(want.data).view(np.uint8), np.asarray(want.scale).view(np.uint8)] if out_format != "bf16" \
            else [np.asarray(want).view(np.uint16)]
        outs = [empty(p.nbytes) for p in parts]
        flag = dev(np.array([1 if error else 0], np.uint8))
        call("moe_ep_combine_reduce_encode", CUDA, stream(), 1 if rows_kind == "bfloat16" else 0, rt_code,
             dev(src).data_ptr(), n, dev(over).data_ptr(), t, k, h, flag.data_ptr(), out_code, outs[0].data_ptr(),
             outs[1].data_ptr() if len(outs) > 1 else None)
        for name, o, p in zip(("data", "scale"), outs, parts):
            got = host_of(o, p.dtype, p.shape)
            what = f"{out_format} of {rows_kind} rows, hidden {h}, error {error}: {name}"
            if out_format == "bf16":  # a NaN sum's payload is the device's (CUDA's additions give 0x7FFFFFFF)
                nan_got, nan_want = (got & 0x7FFF) > 0x7F80, (p & 0x7FFF) > 0x7F80
                np.testing.assert_array_equal(nan_got, nan_want, err_msg=f"{what}: NaN positions")
                got, p = np.where(nan_got, 0, got), np.where(nan_want, 0, p)
            np.testing.assert_array_equal(got, p, err_msg=what)


@pytest.mark.parametrize("row_bytes", [64, 12, 6, 5])  # the uint4, uint32, uint16 and byte copy paths
def test_permute_rows_every_copy_width(row_bytes):
    rng = np.random.default_rng(row_bytes)
    t, k = 37, 3
    tokens = rng.integers(0, 256, size=(t, row_bytes), dtype=np.uint8)
    route = rng.permutation(t * k).astype(np.int32)
    route[::5] = -1
    want = host.permute_rows(tokens, route, k)
    out = empty(want.nbytes)
    call("moe_ep_permute_rows", CUDA, stream(), dev(tokens).data_ptr(), t, k, row_bytes, dev(route).data_ptr(), t * k,
         out.data_ptr())
    np.testing.assert_array_equal(host_of(out, np.uint8, want.shape), want)


def test_a_nan_token_stays_in_its_row_on_cuda():
    config = _config()
    rng = np.random.default_rng(13)
    gs = np.array([20, 20], np.int32)
    e, h, i = 2, config.hidden, config.intermediate
    x = (rng.standard_normal((40, h)) / 4).astype(np.float32)
    x[7, 5] = np.nan
    w = rng.uniform(0.1, 1, 40).astype(np.float32)
    fc1 = (rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)).astype(np.float32)
    fc2 = (rng.standard_normal((e, i, h)) / np.sqrt(i)).astype(np.float32)
    desc = host.expert_desc(config, 40, e)
    ws_bytes = load().moe_ep_expert_forward_workspace(ctypes.byref(desc))
    y, c, ws = empty(4 * 40 * h), empty(4 * 40 * 2 * i), empty(ws_bytes)
    call("moe_ep_expert_forward", CUDA, stream(), ctypes.byref(desc), *[dev(a).data_ptr() for a in (x, w, fc1, fc2, gs)],
         y.data_ptr(), c.data_ptr(), ws.data_ptr(), ws_bytes)
    got = host_of(y, np.float32, (40, h))
    assert np.isnan(got[7]).all() and np.isfinite(np.delete(got, 7, axis=0)).all(), "NaN crossed rows"


def _config(**kw):
    return MoeEpConfig(num_experts=8, hidden=96, intermediate=64, num_topk=2, num_ranks=2, max_tokens_per_rank=64, **kw)


CASES = [dict(), dict(apply_topk_in_fc1=False), dict(gate_up_clamp=0.4), dict(apply_topk_in_fc1=False, gate_up_clamp=0.4),
         dict(intermediate_format="bf16"), dict(intermediate_format="mxfp8"), dict(intermediate_format="nvfp4"),
         dict(apply_topk_in_fc1=False, intermediate_format="mxfp8")]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{a}={b}" for a, b in kw.items()) or "default")
def test_experts_cuda_match_cpu(kw):
    config = _config(**kw)
    rng = np.random.default_rng(11)
    gs = np.array([37, 0, 70, 5], np.int32)
    c_rows = int(gs.sum()) + 9  # rows of no expert at the end
    e, h, i = len(gs), config.hidden, config.intermediate
    x = (rng.standard_normal((c_rows, h)) / 4).astype(np.float32)
    w = rng.uniform(0.1, 1, c_rows).astype(np.float32)
    fc1 = (rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)).astype(np.float32)
    fc2 = (rng.standard_normal((e, i, h)) / np.sqrt(i)).astype(np.float32)
    want = host.expert_forward(config, x, w, fc1, fc2, gs)
    desc = host.expert_desc(config, c_rows, e)
    lib = load()
    fwd_ws = lib.moe_ep_expert_forward_workspace(ctypes.byref(desc))
    y, c, ws = empty(4 * c_rows * h), empty(4 * c_rows * 2 * i), empty(fwd_ws)
    args = [dev(a).data_ptr() for a in (x, w, fc1, fc2, gs)]
    call("moe_ep_expert_forward", CUDA, stream(), ctypes.byref(desc), *args, y.data_ptr(), c.data_ptr(), ws.data_ptr(),
         fwd_ws)
    got_y, got_c = host_of(y, np.float32, (c_rows, h)), host_of(c, np.float32, (c_rows, 2 * i))
    np.testing.assert_allclose(got_c, want.c, rtol=0, atol=2e-5, err_msg="c")
    atol = 2e-5 if config.intermediate_format is None else 0.05  # a near-tie may round to the other code
    np.testing.assert_allclose(got_y, want.y, rtol=0, atol=atol, err_msg="y")
    if config.intermediate_format is not None:
        frac = np.mean(np.abs(got_y - want.y) > 2e-5)
        assert frac < 0.01, f"{frac:.2%} of y differ beyond float32 noise: the {config.intermediate_format} round trip disagrees"
    assert not got_y[-9:].any() and not got_c[-9:].any(), "rows of no expert must be zero"

    stash = F.round_to_bf16(want.c)
    dy = rng.standard_normal((c_rows, h)).astype(np.float32)
    gw = host.expert_backward(config, x, w, fc1, fc2, stash, dy, gs)
    bwd_ws = lib.moe_ep_expert_backward_workspace(ctypes.byref(desc))
    outs = [empty(4 * c_rows * h), empty(4 * c_rows), empty(4 * e * h * 2 * i), empty(4 * e * i * h), empty(bwd_ws)]
    call("moe_ep_expert_backward", CUDA, stream(), ctypes.byref(desc), *args[:4],
         dev(np.asarray(stash).view(np.uint16)).data_ptr(), dev(dy).data_ptr(), args[4], *[o.data_ptr() for o in outs],
         bwd_ws)
    for name, o, ref in zip(("dx", "dw", "dfc1", "dfc2"), outs, (gw.dx, gw.dw, gw.dfc1, gw.dfc2)):
        got = host_of(o, np.float32, ref.shape)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * max(1.0, np.abs(ref).max()), err_msg=name)
    assert not host_of(outs[2], np.float32, gw.dfc1.shape)[1].any(), "an expert without rows gets zero dfc1"


def test_cuda_entry_points_check_sizes_on_the_host():
    x = empty(64)
    with pytest.raises(NativeArgumentError, match="moe_ep_quantize: n must be >= 0; got -1"):
        call("moe_ep_quantize", CUDA, stream(), Format.MXFP8, x.data_ptr(), 1, -1, 1, x.data_ptr(), x.data_ptr())
    torch.cuda.synchronize()
    assert (x.cpu().numpy() == 0xCD).all()


def test_kernels_capture_in_a_cuda_graph_and_replay_on_new_inputs():
    """Every CUDA entry point only enqueues work (no sync, no allocation, no
    host read): a plan + forward + backward sequence is captured once in a CUDA
    graph, then replayed on new inputs written into the same buffers."""
    config = _config(intermediate_format="mxfp8", gate_up_clamp=0.5)
    rng = np.random.default_rng(21)
    gs = np.array([40, 0, 33, 7], np.int32)
    c_rows, e, h, i = int(gs.sum()) + 5, len(gs), config.hidden, config.intermediate
    t, k = 50, 2

    def inputs(seed):
        r = np.random.default_rng(seed)
        return dict(
            idx=r.integers(-1, 16, size=(t, k)).astype(np.int32),
            x=(r.standard_normal((c_rows, h)) / 4).astype(np.float32),
            w=r.uniform(0.1, 1, c_rows).astype(np.float32),
            dy=r.standard_normal((c_rows, h)).astype(np.float32),
        )

    fc1 = (rng.standard_normal((e, h, 2 * i)) / np.sqrt(h)).astype(np.float32)
    fc2 = (rng.standard_normal((e, i, h)) / np.sqrt(i)).astype(np.float32)
    first = inputs(1)
    buf = {name: dev(a) for name, a in first.items()}
    w1, w2, gsd = dev(fc1), dev(fc2), dev(gs)
    desc = host.expert_desc(config, c_rows, e)
    lib = load()
    fwd_ws, bwd_ws = (lib.moe_ep_expert_forward_workspace(ctypes.byref(desc)),
                      lib.moe_ep_expert_backward_workspace(ctypes.byref(desc)))
    plan = [empty(4 * t * k) for _ in range(3)] + [empty(4 * 17)]
    y, c, stash = empty(4 * c_rows * h), empty(4 * c_rows * 2 * i), empty(2 * c_rows * 2 * i)
    grads = [empty(4 * c_rows * h), empty(4 * c_rows), empty(4 * e * h * 2 * i), empty(4 * e * i * h)]
    ws_f, ws_b = empty(fwd_ws), empty(bwd_ws)
    c_view = c.view(torch.float32)[: c_rows * 2 * i]

    def sequence():
        s = stream()
        call("moe_ep_plan_routes", CUDA, s, buf["idx"].data_ptr(), t, k, 16, *[p.data_ptr() for p in plan])
        call("moe_ep_expert_forward", CUDA, s, ctypes.byref(desc), buf["x"].data_ptr(), buf["w"].data_ptr(),
             w1.data_ptr(), w2.data_ptr(), gsd.data_ptr(), y.data_ptr(), c.data_ptr(), ws_f.data_ptr(), fwd_ws)
        call("moe_ep_quantize", CUDA, s, Format.BF16, c.data_ptr(), c_rows, 2 * i, 1, stash.data_ptr(), None)
        call("moe_ep_expert_backward", CUDA, s, ctypes.byref(desc), buf["x"].data_ptr(), buf["w"].data_ptr(),
             w1.data_ptr(), w2.data_ptr(), stash.data_ptr(), buf["dy"].data_ptr(), gsd.data_ptr(),
             *[g.data_ptr() for g in grads], ws_b.data_ptr(), bwd_ws)

    graph = _captured(sequence)
    assert c_view.numel() == c_rows * 2 * i

    for seed in (2, 3):
        new = inputs(seed)
        for name, a in new.items():
            buf[name].copy_(torch.from_numpy(a.view(np.uint8).reshape(-1)))
        graph.replay()
        want_plan = host.plan_routes(new["idx"], 16)
        np.testing.assert_array_equal(host_of(plan[0], np.int32, (t * k,)), want_plan.send_route,
                                      err_msg=f"replay {seed}: send_route")
        want = host.expert_forward(config, new["x"], new["w"], fc1, fc2, gs)
        got_y = host_of(y, np.float32, (c_rows, h))
        np.testing.assert_allclose(got_y, want.y, rtol=0, atol=0.05, err_msg=f"replay {seed}: y")
        assert np.mean(np.abs(got_y - want.y) > 2e-5) < 0.01, f"replay {seed}: y does not follow the new inputs"
        want_g = host.expert_backward(config, new["x"], new["w"], fc1, fc2, F.round_to_bf16(want.c), new["dy"], gs)
        got_dx = host_of(grads[0], np.float32, (c_rows, h))
        np.testing.assert_allclose(got_dx, want_g.dx, rtol=0, atol=1e-3 * max(1.0, np.abs(want_g.dx).max()),
                                   err_msg=f"replay {seed}: dx")


def _plan_ids(rng, t, k, e, kind):
    if kind == "mixed":  # -1 slots and bad ids on both sides of [0, e) among the routed ones
        idx = rng.integers(-3, e + 2, size=(t, k)).astype(np.int32)
        if idx.size > 3:
            idx.reshape(-1)[:3] = [2**31 - 1, -(2**31), e]
        return idx
    if kind == "one":  # every id routed to one expert (the largest bucket possible)
        return np.full((t, k), e - 1, np.int32)
    if kind == "unrouted":
        return np.where(rng.random((t, k)) < 0.5, -1, e + 7).astype(np.int32)
    return rng.integers(0, e, size=(t, k)).astype(np.int32)  # "uniform"


@pytest.mark.parametrize("mode", ["auto", "single", "multi"])
@pytest.mark.parametrize("t,k,e,kind", [
    (4096, 8, 256, "uniform"),  # the layer's shape: 127 units (warps) in 32 blocks
    (4096, 8, 256, "mixed"),
    (4096, 8, 256, "one"),
    (4096, 8, 256, "unrouted"),
    (3000, 8, 1, "mixed"),  # E = 1
    (40000, 8, 8, "mixed"),  # the most units (1024), 32 rows per scan thread
    (5000, 5, 12000, "mixed"),  # one warp per block (its counters fill the shared memory)
    (2000, 16, 64, "uniform"),
    (33, 8, 256, "mixed"),  # multi: one unit of 264 >= E + 2 ids
    (10, 1, 1, "mixed"),
    (0, 4, 256, "mixed"),
])
def test_plan_routes_multi_block_equal_cpu(monkeypatch, mode, t, k, e, kind):
    """The plan's one-block and multi-block kernels (MOE_EP_PLAN_ROUTES forces
    one where it can run) against the CPU plan, bit for bit, over the cases
    where they differ: many units and blocks, unit boundaries that do not fall
    on warp steps, E = 1, large E, every id in one bucket, only unrouted ids."""
    if mode != "auto":
        monkeypatch.setenv("MOE_EP_PLAN_ROUTES", mode)
    rng = np.random.default_rng(t * 7 + k * 3 + e)
    idx = _plan_ids(rng, t, k, e, kind)
    want = host.plan_routes(idx, e)
    n = t * k
    outs = [empty(4 * n) for _ in range(3)] + [empty(4 * (e + 1))]
    for rep in range(2):  # a second call over the first one's outputs (the scratch rows live in route_pos)
        call("moe_ep_plan_routes", CUDA, stream(), dev(idx).data_ptr(), t, k, e, *[o.data_ptr() for o in outs])
        send, pos, exp = (host_of(o, np.int32, (n,)) for o in outs[:3])
        counts = host_of(outs[3], np.int32, (e + 1,))
        np.testing.assert_array_equal(send, want.send_route, err_msg=f"call {rep}: send_route")
        np.testing.assert_array_equal(pos, want.route_pos, err_msg=f"call {rep}: route_pos")
        np.testing.assert_array_equal(exp, want.route_expert, err_msg=f"call {rep}: route_expert")
        np.testing.assert_array_equal(counts[:e], want.counts, err_msg=f"call {rep}: counts")
        assert counts[e] == want.num_bad


def test_plan_routes_multi_block_replays_in_a_cuda_graph():
    """The multi-block plan (three kernels, no workspace) captured once and
    replayed on new ids written into the same buffer."""
    t, k, e = 4096, 8, 256
    n = t * k
    idx_d = dev(np.zeros((t, k), np.int32))
    outs = [empty(4 * n) for _ in range(3)] + [empty(4 * (e + 1))]

    def plan():
        call("moe_ep_plan_routes", CUDA, torch.cuda.current_stream().cuda_stream, idx_d.data_ptr(), t, k, e,
             *[o.data_ptr() for o in outs])

    graph = _captured(plan)
    for seed in (1, 2):
        ids = _plan_ids(np.random.default_rng(seed), t, k, e, "mixed")
        idx_d.copy_(torch.from_numpy(ids.view(np.uint8).reshape(-1)))
        graph.replay()
        torch.cuda.synchronize()
        want = host.plan_routes(ids, e)
        np.testing.assert_array_equal(host_of(outs[0], np.int32, (n,)), want.send_route, err_msg=f"replay {seed}")
        np.testing.assert_array_equal(host_of(outs[1], np.int32, (n,)), want.route_pos, err_msg=f"replay {seed}")
        np.testing.assert_array_equal(host_of(outs[2], np.int32, (n,)), want.route_expert, err_msg=f"replay {seed}")
        np.testing.assert_array_equal(host_of(outs[3], np.int32, (e + 1,))[:e], want.counts)
