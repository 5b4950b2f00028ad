"""The native core (backends/native, C ABI) on the CPU, kernel by kernel,
against the numpy reference: the formats bit for bit (golden vectors and
random data), the plan and permutation exactly, the combine reduction exactly,
and the expert MLP forward/backward within float32 rounding of a float64
computation. Also: every entry point rejects bad sizes with a message and
writes nothing."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import pytest

from native_core import native_or_skip

moe_ep_native = native_or_skip()

from format_inputs import load_golden  # noqa: E402
from moe_ep_native import host  # noqa: E402
from moe_ep_spec import MoeEpConfig, NativeArgumentError, NativeError  # noqa: E402
from moe_ep_spec.errors import FormatError  # noqa: E402
from moe_ep_spec import formats as F  # noqa: E402
from moe_ep_spec.errors import ShapeError  # noqa: E402

FORMATS = ["bf16", "mxfp8", "nvfp4"]


def _codes(t):
    if isinstance(t, F.BlockScaledTensor):
        return t.data.view(np.uint8), t.scale.view(np.uint8)
    return np.asarray(t).view(np.uint16), None


def _assert_same_encoding(got, want, what):
    gd, gs = _codes(got)
    wd, ws = _codes(want)
    assert gd.shape == wd.shape, f"{what}: data shape {gd.shape} != reference {wd.shape}"
    bad = np.flatnonzero(gd.reshape(-1) != wd.reshape(-1))
    assert bad.size == 0, f"{what}: {bad.size} data codes differ from the reference, first at flat index {bad[:5]}"
    if ws is not None:
        np.testing.assert_array_equal(gs, ws, err_msg=f"{what}: scale codes differ from the reference")


def _same_values(a, b):
    """Equal as floats, NaN where NaN, zeros with the same sign."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return bool(np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(np.nan_to_num(a), np.nan_to_num(b))
                and np.array_equal(np.signbit(a) & ~np.isnan(a), np.signbit(b) & ~np.isnan(b)))


# ----------------------------------------------------------------------------- library


def test_library_reports_itself():
    assert moe_ep_native.abi_version() == moe_ep_native.ABI_VERSION
    assert "moe_ep_native" in moe_ep_native.build_info()
    assert (moe_ep_native.include_dir() / "moe_ep_native.h").is_file()
    assert isinstance(moe_ep_native.has_cuda(), bool)


def test_cuda_call_without_cuda_is_unsupported():
    if moe_ep_native.has_cuda():
        pytest.skip("this build has CUDA")
    x = np.zeros(4, np.float32)
    out = np.zeros(4, np.uint16)
    with pytest.raises(NativeError, match="no CUDA implementation") as info:
        moe_ep_native._capi.call("moe_ep_quantize", 1, None, 1, x.ctypes.data, 4, 1, 1, out.ctypes.data, None)
    assert info.value.status_name == "MOE_EP_ERR_UNSUPPORTED" and not isinstance(info.value, NativeArgumentError)


def test_transport_without_nccl_is_unsupported_with_the_rebuild_hint():
    from moe_ep_native import comm

    if moe_ep_native.has_nccl():
        pytest.skip("this build has the NCCL transport")
    with pytest.raises(NativeError, match=r"moe_ep_comm_unique_id: this build of the native core has no NCCL transport "
                       r"\(rebuild with MOE_EP_NATIVE_CUDA=ON and MOE_EP_NATIVE_NCCL=ON") as info:
        comm.unique_id()
    assert info.value.status_name == "MOE_EP_ERR_UNSUPPORTED"
    with pytest.raises(NativeError, match="moe_ep_comm_init: this build .* no NCCL transport"):
        comm.Communicator(bytes(comm.UNIQUE_ID_BYTES), 2, 0, 0, timeout_s=1)
    moe_ep_native._capi.call("moe_ep_comm_destroy", None)  # NULL: nothing to do, in every build


def test_communicator_checks_the_unique_id_before_calling_the_library():
    from moe_ep_native import comm

    with pytest.raises(ValueError, match=r"uid must be 128 bytes \(from unique_id\(\)\); got 12 bytes"):
        comm.Communicator(bytes(12), 2, 0, 0)
    with pytest.raises(ValueError, match="uid must be 128 bytes .*; got str"):
        comm.Communicator("x" * 128, 2, 0, 0)  # type: ignore[arg-type]


def test_transport_status_maps_to_transport_error():
    from moe_ep_spec import TransportError

    assert issubclass(TransportError, NativeError)
    assert moe_ep_native.Status.COMM == 5
    assert moe_ep_native._capi.load().moe_ep_status_name(5) == b"MOE_EP_ERR_COMM"


# ----------------------------------------------------------------------------- formats


@pytest.fixture(scope="module")
def golden():
    return load_golden()


def test_golden_vectors(golden):
    cats = sorted({k.split("/")[0] for k in golden})
    assert cats, "no golden categories"
    for cat in cats:
        x = golden[f"{cat}/input"]
        np.testing.assert_array_equal(np.asarray(host.quantize(x, "bf16")).view(np.uint16), golden[f"{cat}/bf16_bits"],
                                      err_msg=f"bf16 codes of golden category {cat}")
        q = host.quantize(x, "mxfp8")
        np.testing.assert_array_equal(q.data.view(np.uint8), golden[f"{cat}/mxfp8_data_bits"], err_msg=f"mxfp8 {cat}")
        np.testing.assert_array_equal(q.scale.view(np.uint8), golden[f"{cat}/mxfp8_scale_bits"], err_msg=f"mxfp8 {cat}")
        q = host.quantize(x, "nvfp4")
        np.testing.assert_array_equal(q.data.view(np.uint8), golden[f"{cat}/nvfp4_data_packed"], err_msg=f"nvfp4 {cat}")
        np.testing.assert_array_equal(q.scale.view(np.uint8), golden[f"{cat}/nvfp4_scale_bits"], err_msg=f"nvfp4 {cat}")


def _special_values(rng, shape):
    """Random values across many binades, with ties, zeros of both signs,
    subnormals, saturating values, and a few NaN / Inf."""
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
    flat = x.reshape(-1)
    n = flat.size
    if n == 0:
        return x.astype(np.float32)
    pick = lambda k: rng.choice(n, size=max(1, n // k), replace=False)  # noqa: E731
    flat[pick(17)] = 0.0
    flat[pick(19)] = -0.0
    flat[pick(23)] = rng.choice([0.25, 0.75, 2.5, 5.0, 448.0 * 1.0625, 1e38, 3e-39, 1.5 * 2.0 ** -9], size=len(pick(23)))
    flat[pick(97)] = np.nan
    flat[pick(101)] = -np.inf
    return x.astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,axis", [((7, 64), -1), ((5, 45), 1), ((3, 33, 4), 1), ((2, 17, 3), 1), ((1,), 0),
                                        ((4, 6, 31), 2), ((0, 32), 1)])
def test_quantize_and_dequantize_match_the_reference(fmt, shape, axis):
    rng = np.random.default_rng(zlib.crc32(repr((fmt, shape, axis)).encode()))
    x = _special_values(rng, shape)
    got = host.quantize(x, fmt, axis=axis)
    want = F.quantize(x, fmt, axis=axis)
    _assert_same_encoding(got, want, f"quantize({fmt}, shape={shape}, axis={axis})")
    dec, ref = host.dequantize(got), F.dequantize(want, np.float32)
    assert dec.dtype == np.float32 and dec.shape == x.shape
    assert _same_values(dec, ref), f"dequantize({fmt}, shape={shape}) differs from the reference"


def test_blocks_without_specials_are_untouched_by_a_nan_block():
    x = np.ones((1, 64), np.float32)
    x[0, 3] = np.nan
    q = host.quantize(x, "mxfp8")
    dec = host.dequantize(q)
    assert np.isnan(dec[0, :32]).all(), "the block holding NaN must decode to NaN"
    np.testing.assert_array_equal(dec[0, 32:], 1.0, err_msg="the other block must be unaffected")


def test_quantize_rejects_float64_and_dequantize_plain_floats():
    with pytest.raises(Exception, match="x must be float32, float16 or bfloat16; got dtype float64"):
        host.quantize(np.zeros(4), "mxfp8")
    with pytest.raises(Exception, match="bfloat16 array; got dtype float32"):
        host.dequantize(np.zeros(4, np.float32))


# ----------------------------------------------------------------------------- routing


def _plan_reference(topk_idx, num_experts):
    flat = topk_idx.reshape(-1).astype(np.int64)
    routed = (flat >= 0) & (flat < num_experts)
    key = np.where(routed, flat, num_experts)
    send = np.argsort(key, kind="stable")
    pos = np.empty_like(send)
    pos[send] = np.arange(send.size)
    counts = np.bincount(key, minlength=num_experts + 1)[:num_experts]
    bad = int(((flat < -1) | (flat >= num_experts)).sum())
    return send, np.where(routed, pos, -1), np.where(routed, flat, -1), counts, bad


@pytest.mark.parametrize("num_tokens,num_topk,num_experts", [(0, 2, 4), (1, 1, 1), (37, 4, 16), (64, 8, 256), (5, 3, 2)])
def test_plan_routes_matches_a_stable_sort(num_tokens, num_topk, num_experts):
    rng = np.random.default_rng(num_tokens * 131 + num_experts)
    idx = rng.integers(-1, num_experts, size=(num_tokens, num_topk)).astype(np.int32)
    if idx.size > 3:
        idx.reshape(-1)[rng.choice(idx.size, 2, replace=False)] = [num_experts, -7]  # bad ids
    plan = host.plan_routes(idx, num_experts)
    send, pos, exp, counts, bad = _plan_reference(idx, num_experts)
    np.testing.assert_array_equal(plan.send_route, send, err_msg="send_route")
    np.testing.assert_array_equal(plan.route_pos, pos, err_msg="route_pos")
    np.testing.assert_array_equal(plan.route_expert, exp, err_msg="route_expert")
    np.testing.assert_array_equal(plan.counts, counts, err_msg="counts")
    assert plan.num_bad == bad


def test_permute_rows_moves_codes_unchanged_and_zeroes_unused_rows():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 256, size=(6, 5), dtype=np.uint8)  # row_bytes 5: not a multiple of 4
    route = np.array([11, 0, -1, 5, 3, -1, 1], np.int32)
    out = host.permute_rows(tokens, route, num_topk=2)
    want = np.where((route >= 0)[:, None], tokens[np.maximum(route, 0) // 2], 0)
    np.testing.assert_array_equal(out, want)


def test_permute_rows_rejects_a_route_out_of_range_and_writes_nothing():
    tokens = np.ones((2, 4), np.float32)
    with pytest.raises(NativeArgumentError, match=r"send_route\[1\] must be -1 or in \[0, 4\); got 4"):
        host.permute_rows(tokens, np.array([0, 4], np.int32), num_topk=2)


def test_record_step_ors_the_bits_and_keeps_the_most_aligned_rows():
    call = moe_ep_native._capi.call
    record = np.array([0b0100, 40], np.int64)
    err = np.array([0b0001], np.int32)
    tpe = np.array([0, 1, 7, 8, 9], np.int32)  # aligned to 8: 0 + 8 + 8 + 8 + 16 = 40
    call("moe_ep_record_step", 0, None, err.ctypes.data, tpe.ctypes.data, 5, 8, record.ctypes.data)
    assert record.tolist() == [0b0101, 40], "the bits OR-ed in; 40 rows is not above the record's 40"
    tpe[0] = 3  # one more aligned slab of 8
    err[0] = 0
    call("moe_ep_record_step", 0, None, err.ctypes.data, tpe.ctypes.data, 5, 8, record.ctypes.data)
    assert record.tolist() == [0b0101, 48], "no bits cleared; the record rises to this step's 48 rows"
    call("moe_ep_record_step", 0, None, err.ctypes.data, tpe.ctypes.data, 5, 1, record.ctypes.data)
    assert record.tolist() == [0b0101, 48], "alignment 1: 28 rows, below the record"


def test_record_step_on_cuda_gives_the_cpu_records():
    torch = pytest.importorskip("torch")
    if not (moe_ep_native.has_cuda() and torch.cuda.is_available()):
        pytest.skip("needs a CUDA build of the native core and a GPU")
    call = moe_ep_native._capi.call
    rng = np.random.default_rng(8)
    steps = [(int(rng.integers(0, 16)), rng.integers(0, 40, size=300).astype(np.int32), a) for a in (1, 8, 8, 128)]
    host_rec = np.array([0, 0], np.int64)
    dev_rec = torch.zeros(2, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream or None
    for bits, tpe, a in steps:
        err = np.array([bits], np.int32)
        call("moe_ep_record_step", 0, None, err.ctypes.data, tpe.ctypes.data, tpe.size, a, host_rec.ctypes.data)
        err_d, tpe_d = torch.from_numpy(err).cuda(), torch.from_numpy(tpe).cuda()
        call("moe_ep_record_step", 1, stream, err_d.data_ptr(), tpe_d.data_ptr(), tpe.size, a, dev_rec.data_ptr())
        assert dev_rec.cpu().tolist() == host_rec.tolist(), f"after a step of bits {bits}, alignment {a}"


def test_record_step_rejects_a_bad_alignment_and_writes_nothing():
    record = np.array([3, 5], np.int64)
    err, tpe = np.array([1], np.int32), np.array([9], np.int32)
    with pytest.raises(NativeArgumentError, match=r"alignment must be >= 1; got 0"):
        moe_ep_native._capi.call("moe_ep_record_step", 0, None, err.ctypes.data, tpe.ctypes.data, 1, 0,
                                 record.ctypes.data)
    assert record.tolist() == [3, 5]


def _routed_rows(seed, t, k, h, extra, unused, dtype):
    """``(rows, pos)``: ``t * k + extra`` random rows of ``h`` values in ``dtype``, the last
    all NaN (no route points at it), and a permutation of the routes' rows with the routes
    ``unused`` set to -1."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((t * k + extra, h)).astype(dtype)
    rows[-1] = np.nan
    pos = rng.permutation(t * k).astype(np.int32)
    pos[unused] = -1
    return rows, pos


def test_combine_reduce_sums_in_slot_order_and_skips_unused_slots():
    t, k, h = 9, 3, 16
    rows, pos = _routed_rows(4, t, k, h, 2, [2, 7, 8], np.float32)
    got = host.combine_reduce(rows, pos, t, k)
    want = np.zeros((t, h), np.float32)
    for kk in range(k):  # the spec's order, in float32
        p = pos.reshape(t, k)[:, kk]
        want = want + np.where((p >= 0)[:, None], rows[np.maximum(p, 0)], np.float32(0))
    np.testing.assert_array_equal(got, want)
    ident = host.combine_reduce(rows[: t * k], None, t, k)
    np.testing.assert_array_equal(ident, rows[: t * k].reshape(t, k, h).sum(axis=1, dtype=np.float32)
                                  if k == 1 else ((rows[0::3][:t] + rows[1::3][:t]) + rows[2::3][:t]))


def test_combine_reduce_of_bf16_rows_gives_the_float32_rows_sums():
    """moe_ep_combine_reduce_bf16: the rows read as bf16 bits, the sums bit for bit those of
    the same values in float32 (slot order from +0, unused slots add nothing)."""
    import ml_dtypes

    t, k, h = 11, 4, 24
    rows, pos = _routed_rows(14, t, k, h, 3, [0, 5, 6], ml_dtypes.bfloat16)
    got = host.combine_reduce(rows, pos, t, k)
    np.testing.assert_array_equal(got, host.combine_reduce(rows.astype(np.float32), pos, t, k))
    with pytest.raises(NativeArgumentError, match=r"moe_ep_combine_reduce_bf16: route_pos\[3\] must be -1 or in "):
        host.combine_reduce(rows, np.r_[pos[:3], 99, pos[4:]].astype(np.int32), t, k)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("h", [64, 40])  # whole blocks; a partial last block (40 = 32 + 8 = 2 * 16 + 8)
def test_combine_reduce_round_trip_is_the_round_trip_then_the_sum(fmt, h):
    """moe_ep_combine_reduce_round_trip: each route's row through the block format's round
    trip as it is read, then the slot-order sum: bit for bit the spec's encode and decode of
    every row (moe_ep_spec.formats) followed by moe_ep_combine_reduce; a NaN row no route
    reads and a row of NaN in one block stay out of the other tokens; the rows are not written."""
    rng = np.random.default_rng(h)
    t, k = 13, 4
    rows = (rng.standard_normal((t * k + 2, h)) * np.exp2(rng.integers(-30, 30, (t * k + 2, 1)))).astype(np.float32)
    rows[-1] = np.nan  # a row no route points at
    pos = rng.permutation(t * k).astype(np.int32)
    pos[[1, 9, 10]] = -1
    rows[pos[4], 3] = np.nan  # one block of the row of token 1's slot 0 is NaN after the round trip
    before = rows.copy()
    got = host.combine_reduce(rows, pos, t, k, round_trip=fmt)
    np.testing.assert_array_equal(rows, before)
    rounded = F.dequantize(F.quantize(rows, fmt, axis=-1)).astype(np.float32)
    want = host.combine_reduce(rounded, pos, t, k)
    np.testing.assert_array_equal(got, want)
    bad = np.isnan(got).any(axis=1)
    assert bad[1] and bad.sum() == 1, np.flatnonzero(bad)
    ident = host.combine_reduce(rows[: t * k], None, t, k, round_trip=fmt)
    np.testing.assert_array_equal(ident, host.combine_reduce(rounded[: t * k], None, t, k))


def _encoded_bits(t):
    """The bytes of an encoded array: (data, scale) of a BlockScaledTensor, (bits,) of bf16."""
    if isinstance(t, F.BlockScaledTensor):
        return np.asarray(t.data).view(np.uint8), np.asarray(t.scale).view(np.uint8)
    return (np.asarray(t).view(np.uint16),)


@pytest.mark.parametrize("out_format", ["bf16", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("rows_kind", ["float32", "bfloat16", "mxfp8", "nvfp4"])  # the last two: round trips
@pytest.mark.parametrize("h", [64, 40])
def test_combine_reduce_encode_is_the_sum_then_the_encode(out_format, rows_kind, h):
    """moe_ep_combine_reduce_encode: bit for bit moe_ep_quantize of the sums of
    moe_ep_combine_reduce (float32 or bf16 rows) or moe_ep_combine_reduce_round_trip, and of
    all-NaN sums when the error flag is set; a NaN in one route's row stays in its token."""
    rng = np.random.default_rng(h)
    t, k = 11, 4
    rows = (rng.standard_normal((t * k + 1, h)) * np.exp2(rng.integers(-20, 20, (t * k + 1, 1)))).astype(np.float32)
    rows[-1] = np.nan  # a row no route reads
    pos = rng.permutation(t * k).astype(np.int32)
    pos[[2, 7]] = -1
    rows[pos[5], 1] = np.nan  # token 1, slot 1
    rt = rows_kind if rows_kind in ("mxfp8", "nvfp4") else None
    if rows_kind == "bfloat16":
        rows = rows.astype(F.BF16)
    sums = host.combine_reduce(rows, pos, t, k, round_trip=rt)
    for error in (False, True):
        got = host.combine_reduce_encode(rows, pos, t, k, out_format, round_trip=rt, error=error)
        want = host.quantize(np.full_like(sums, np.nan) if error else sums, out_format)
        for a, b in zip(_encoded_bits(got), _encoded_bits(want)):
            np.testing.assert_array_equal(a, b, err_msg=f"{out_format} of {rows_kind} rows, error {error}")
    bad = np.isnan(sums).any(axis=1)
    assert bad[1] and bad.sum() == 1, np.flatnonzero(bad)


def test_combine_reduce_encode_checks_its_arguments():
    from moe_ep_native._capi import call
    rows = np.zeros((4, 32), np.float32)
    pos = np.array([0, 1, 2, 9], np.int32)
    with pytest.raises(NativeArgumentError, match=r"moe_ep_combine_reduce_encode: route_pos\[3\] must be -1 or in "
                                                  r"\[0, num_rows\) = \[0, 4\); got 9"):
        host.combine_reduce_encode(rows, pos, 2, 2, "mxfp8")
    data = np.full((2, 32), 7, np.uint8)  # a rejected call writes nothing
    scale = np.full((2, 1), 7, np.uint8)
    flag = np.zeros(1, np.uint8)

    def raw(rows_dtype, rt, out_format, p=None, s=scale):
        call("moe_ep_combine_reduce_encode", 0, None, rows_dtype, rt, rows.ctypes.data, 4, p, 2, 2, 32,
             flag.ctypes.data, out_format, data.ctypes.data, None if s is None else s.ctypes.data)

    with pytest.raises(NativeArgumentError, match=r"route_pos\[3\] must be -1"):
        raw(0, 2, 2, pos.ctypes.data)
    assert (data == 7).all() and (scale == 7).all()
    with pytest.raises(NativeArgumentError, match=r"rows_dtype must be MOE_EP_DTYPE_F32 \(0\) or MOE_EP_DTYPE_BF16 "
                                                  r"\(1\); got 2"):
        raw(2, 0, 2)
    with pytest.raises(NativeArgumentError, match=r"round_trip must be MOE_EP_FORMAT_NONE \(0\), MOE_EP_FORMAT_MXFP8 "
                                                  r"\(2\) or MOE_EP_FORMAT_NVFP4 \(3\); got 1"):
        raw(0, 1, 2)
    with pytest.raises(NativeArgumentError, match=r"rows_dtype must be MOE_EP_DTYPE_F32 when round_trip is set"):
        raw(1, 2, 2)
    with pytest.raises(NativeArgumentError, match=r"fmt must be MOE_EP_FORMAT_BF16 \(1\), MOE_EP_FORMAT_MXFP8 \(2\) "
                                                  r"or MOE_EP_FORMAT_NVFP4 \(3\); got 0"):
        raw(0, 0, 0)
    with pytest.raises(NativeArgumentError, match=r"scale must be NULL for MOE_EP_FORMAT_BF16"):
        raw(0, 0, 1)
    assert (data == 7).all() and (scale == 7).all()
    with pytest.raises(FormatError, match=r"round_trip must be None, 'mxfp8' or 'nvfp4'"):
        host.combine_reduce_encode(rows, None, 2, 2, "bf16", round_trip="bf16")


def test_combine_reduce_round_trip_checks_its_format_and_positions():
    rows = np.zeros((4, 32), np.float32)
    with pytest.raises(FormatError, match=r"round_trip must be None, 'mxfp8' or 'nvfp4' \(a block format\); got 'bf16'"):
        host.combine_reduce(rows, None, 2, 2, round_trip="bf16")
    with pytest.raises(NativeArgumentError, match=r"moe_ep_combine_reduce_round_trip: route_pos\[3\] must be -1 or in "
                                                  r"\[0, num_rows\) = \[0, 4\); got 9"):
        host.combine_reduce(rows, np.array([0, 1, 2, 9], np.int32), 2, 2, round_trip="mxfp8")
    from moe_ep_native._capi import call
    out = np.full((2, 32), 7.0, np.float32)  # a rejected call writes nothing, not even the tokens before the bad id
    with pytest.raises(NativeArgumentError, match=r"route_pos\[3\] must be -1"):
        call("moe_ep_combine_reduce_round_trip", 0, None, 2, rows.ctypes.data, 4,
             np.array([0, 1, 2, 9], np.int32).ctypes.data, 2, 2, 32, out.ctypes.data)
    assert (out == 7.0).all()
    with pytest.raises(NativeArgumentError, match=r"fmt must be MOE_EP_FORMAT_MXFP8 \(\d\) or MOE_EP_FORMAT_NVFP4 "
                                                  r"\(\d\): the block formats, whose round trip the sum applies; got 1"):
        call("moe_ep_combine_reduce_round_trip", 0, None, 1, rows.ctypes.data, 4, None, 2, 2, 32,
             np.zeros((2, 32), np.float32).ctypes.data)


def test_combine_reduce_rejects_bad_positions():
    rows = np.zeros((4, 2), np.float32)
    with pytest.raises(NativeArgumentError, match=r"route_pos\[3\] must be -1 or in \[0, num_rows\) = \[0, 4\); got 9"):
        host.combine_reduce(rows, np.array([0, 1, 2, 9], np.int32), 2, 2)
    with pytest.raises(NativeArgumentError, match="num_rows must be num_tokens \\* num_topk = 6 when route_pos is NULL; got 4"):
        host.combine_reduce(rows, None, 3, 2)


# ----------------------------------------------------------------------------- experts


def _expert_reference(config, x, w, fc1, fc2, group_sizes):
    """Section 5 in float64 (R_int through the numpy reference codecs)."""
    c_rows, i = x.shape[0], config.intermediate
    y = np.zeros((c_rows, config.hidden))
    c = np.zeros((c_rows, 2 * i))
    off = np.concatenate([[0], np.cumsum(group_sizes)])
    for e in range(len(group_sizes)):
        sl = slice(off[e], off[e + 1])
        ce = x[sl].astype(np.float64) @ fc1[e].astype(np.float64)
        c[sl] = ce
        g, u = ce[:, :i], ce[:, i:]
        if config.gate_up_clamp is not None:
            lim = config.gate_up_clamp
            g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
        h = g / (1.0 + np.exp(-g)) * u
        wc = w[sl, None].astype(np.float64)
        op = wc * h if config.apply_topk_in_fc1 else h
        op = F.round_trip(op, config.intermediate_format, axis=-1)
        z = op @ fc2[e].astype(np.float64)
        y[sl] = z if config.apply_topk_in_fc1 else wc * z
    return y, c


def _expert_inputs(config, seed, sizes, pad):
    """``(rng, group_sizes, (x, w, fc1, fc2))``: :func:`_buffer` for the slab ``sizes``,
    drawn from a generator seeded ``seed`` (returned for the test's further draws)."""
    rng = np.random.default_rng(seed)
    gs = np.array(sizes, np.int32)
    return rng, gs, _buffer(rng, config, gs, pad)


def _buffer(rng, config, group_sizes, pad):
    c_rows = int(sum(group_sizes)) + pad
    e = len(group_sizes)
    x = (rng.standard_normal((c_rows, config.hidden)) / 4).astype(np.float32)
    w = rng.uniform(0.1, 1.0, c_rows).astype(np.float32)
    x[sum(group_sizes):] = 0.0
    w[sum(group_sizes):] = 0.0
    fc1 = (rng.standard_normal((e, config.hidden, 2 * config.intermediate)) / np.sqrt(config.hidden)).astype(np.float32)
    fc2 = (rng.standard_normal((e, config.intermediate, config.hidden)) / np.sqrt(config.intermediate)).astype(np.float32)
    return x, w, fc1, fc2


EXPERT_CASES = [
    dict(apply_topk_in_fc1=True),
    dict(apply_topk_in_fc1=False),
    dict(apply_topk_in_fc1=True, gate_up_clamp=0.3),
    dict(apply_topk_in_fc1=False, gate_up_clamp=0.3),
]


def _config(**kw):
    return MoeEpConfig(num_experts=6, hidden=64, intermediate=32, num_topk=2, num_ranks=2, max_tokens_per_rank=16, **kw)


@pytest.mark.parametrize("kw", EXPERT_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_expert_forward_matches_float64_within_float32_rounding(kw):
    config = _config(**kw)
    _, gs, (x, w, fc1, fc2) = _expert_inputs(config, 7, [5, 0, 9], pad=3)
    out = host.expert_forward(config, x, w, fc1, fc2, gs)
    y_ref, c_ref = _expert_reference(config, x, w, fc1, fc2, gs)
    np.testing.assert_allclose(out.c, c_ref, rtol=0, atol=1e-5, err_msg="FC1 output c")
    np.testing.assert_allclose(out.y, y_ref, rtol=0, atol=1e-5, err_msg="expert output y")
    assert not out.y[14:].any() and not out.c[14:].any(), "rows of no expert must be zero"


@pytest.mark.parametrize("fmt", FORMATS)
def test_expert_forward_applies_the_intermediate_round_trip(fmt):
    config = _config(intermediate_format=fmt)
    rng = np.random.default_rng(8)
    gs = np.array([4, 6, 3], np.int32)
    x, w, fc1, fc2 = _buffer(rng, config, gs, pad=0)
    out = host.expert_forward(config, x, w, fc1, fc2, gs)
    y_ref, _ = _expert_reference(config, x, w, fc1, fc2, gs)
    y_plain, _ = _expert_reference(_config(), x, w, fc1, fc2, gs)
    err, step = np.abs(out.y - y_ref).max(), np.abs(y_plain - y_ref).max()
    assert step > 1e-4, f"the {fmt} round trip should move y; moved it by {step}"
    # away from ties the native result follows the rounded reference, not the unrounded one
    assert err < step / 4, f"y differs from the {fmt}-rounded reference by {err} (rounding moves it by {step})"


def _expert_backward_reference(config, x, w, fc1, fc2, stash, dy, group_sizes):
    i = config.intermediate
    cr, e_local = x.shape[0], len(group_sizes)
    dx, dw = np.zeros(x.shape), np.zeros(cr)
    dfc1, dfc2 = np.zeros(fc1.shape), np.zeros(fc2.shape)
    off = np.concatenate([[0], np.cumsum(group_sizes)])
    c = stash.astype(np.float64)
    for e in range(e_local):
        sl = slice(off[e], off[e + 1])
        g, u = c[sl, :i], c[sl, i:]
        gm = um = 1.0
        if config.gate_up_clamp is not None:
            lim = config.gate_up_clamp
            gm, um = (g <= lim).astype(float), ((u >= -lim) & (u <= lim)).astype(float)
            g, u = np.minimum(g, lim), np.clip(u, -lim, lim)
        sig = 1 / (1 + np.exp(-g))
        s = g * sig
        h = s * u
        wc, d = w[sl, None].astype(np.float64), dy[sl].astype(np.float64)
        w1, w2 = fc1[e].astype(np.float64), fc2[e].astype(np.float64)
        a = d @ w2.T
        if config.apply_topk_in_fc1:
            dfc2[e], dw[sl] = (wc * h).T @ d, (a * h).sum(1)
        else:
            dfc2[e], dw[sl] = h.T @ (wc * d), (d * (h @ w2)).sum(1)
        dh = a * wc
        dc = np.concatenate([dh * u * sig * (1 + g * (1 - sig)) * gm, dh * s * um], axis=1)
        dfc1[e] = x[sl].astype(np.float64).T @ dc
        dx[sl] = dc @ w1.T
    return dx, dw, dfc1, dfc2


@pytest.mark.parametrize("kw", EXPERT_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_expert_backward_matches_float64_within_float32_rounding(kw):
    config = _config(**kw)
    rng, gs, (x, w, fc1, fc2) = _expert_inputs(config, 9, [6, 0, 7], pad=2)
    stash = F.round_to_bf16(host.expert_forward(config, x, w, fc1, fc2, gs).c)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dy[13:] = 0.0
    got = host.expert_backward(config, x, w, fc1, fc2, stash, dy, gs)
    want = _expert_backward_reference(config, x, w, fc1, fc2, stash, dy, gs)
    for name, g, r in zip(("dx", "dw", "dfc1", "dfc2"), (got.dx, got.dw, got.dfc1, got.dfc2), want):
        np.testing.assert_allclose(g, r, rtol=0, atol=2e-5, err_msg=name)
    assert not got.dfc1[1].any() and not got.dfc2[1].any(), "an expert without rows gets zero gradients"
    assert not got.dx[13:].any() and not got.dw[13:].any(), "rows of no expert get zero gradients"


def test_a_nan_token_stays_in_its_row():
    config = _config()
    rng = np.random.default_rng(10)
    gs = np.array([4, 4, 4], np.int32)
    x, w, fc1, fc2 = _buffer(rng, config, gs, pad=0)
    x[5, 3] = np.nan
    y = host.expert_forward(config, x, w, fc1, fc2, gs).y
    assert np.isnan(y[5]).all() and np.isfinite(np.delete(y, 5, axis=0)).all()


def test_expert_entry_points_reject_bad_group_sizes_and_shapes():
    config = _config()
    rng = np.random.default_rng(11)
    x, w, fc1, fc2 = _buffer(rng, config, [2, 2, 2], pad=0)
    with pytest.raises(NativeArgumentError, match=r"group_sizes\[1\] must be >= 0; got -1"):
        host.expert_forward(config, x, w, fc1, fc2, np.array([2, -1, 2]))
    with pytest.raises(NativeArgumentError, match=r"sum\(group_sizes\) must be <= num_rows = 6; got 7"):
        host.expert_forward(config, x, w, fc1, fc2, np.array([2, 2, 3]))
    with pytest.raises(ShapeError, match=r"fc2 must have shape \(num_local_experts, intermediate, hidden\) = \(3, 32, 64\); got \(3, 64, 32\)"):
        host.expert_forward(config, x, w, fc1, np.swapaxes(fc2, 1, 2), np.array([2, 2, 2]))


def test_c_abi_checks_sizes_before_any_work():
    """Raw C ABI calls with broken sizes: each fails with INVALID_ARGUMENT and
    the output buffer keeps its sentinel bytes."""
    from moe_ep_native._capi import ExpertDesc, call

    out = np.full(8, 0xAB, np.uint8)
    x = np.zeros(8, np.float32)
    with pytest.raises(NativeArgumentError, match="moe_ep_quantize: n must be >= 0; got -3"):
        call("moe_ep_quantize", 0, None, 2, x.ctypes.data, 1, -3, 1, out.ctypes.data, out.ctypes.data)
    with pytest.raises(NativeArgumentError, match=r"fmt must be MOE_EP_FORMAT_BF16 \(1\), MOE_EP_FORMAT_MXFP8 \(2\) or MOE_EP_FORMAT_NVFP4 \(3\); got 7"):
        call("moe_ep_quantize", 0, None, 7, x.ctypes.data, 1, 8, 1, out.ctypes.data, out.ctypes.data)
    with pytest.raises(NativeArgumentError, match="scale must not be NULL"):
        call("moe_ep_quantize", 0, None, 2, x.ctypes.data, 1, 8, 1, out.ctypes.data, None)
    with pytest.raises(NativeArgumentError, match="stream must be NULL for MOE_EP_DEVICE_CPU"):
        call("moe_ep_quantize", 0, 1234, 1, x.ctypes.data, 1, 8, 1, out.ctypes.data, None)
    with pytest.raises(NativeArgumentError, match=r"device must be MOE_EP_DEVICE_CPU \(0\) or MOE_EP_DEVICE_CUDA \(1\); got 5"):
        call("moe_ep_quantize", 5, None, 1, x.ctypes.data, 1, 8, 1, out.ctypes.data, None)
    with pytest.raises(NativeArgumentError, match="num_experts must be >= 1; got 0"):
        call("moe_ep_plan_routes", 0, None, x.ctypes.data, 2, 2, 0, out.ctypes.data, out.ctypes.data, out.ctypes.data,
             out.ctypes.data)
    desc = ExpertDesc(num_rows=2, hidden=4, intermediate=2, num_local_experts=1, apply_topk_in_fc1=1, has_clamp=1,
                      gate_up_clamp=-1.0, intermediate_format=0)
    with pytest.raises(NativeArgumentError, match="desc.gate_up_clamp must be finite and > 0 when desc.has_clamp is 1; got -1"):
        call("moe_ep_expert_forward", 0, None, ctypes.byref(desc), *([x.ctypes.data] * 7), x.ctypes.data, 1 << 20)
    desc.has_clamp = 0
    with pytest.raises(NativeArgumentError, match="workspace_bytes must be >= "):
        call("moe_ep_expert_forward", 0, None, ctypes.byref(desc), *([x.ctypes.data] * 7), x.ctypes.data, 0)
    assert (out == 0xAB).all(), "a rejected call must write nothing"


C_PROGRAM = r"""
#include <stdio.h>
#include "moe_ep_native.h"

int main(void) {
  const float x[4] = {1.0f, -2.5f, 3.0e-3f, 448.0f};
  uint16_t bits[4];
  moe_ep_status st;
  if (moe_ep_abi_version() != MOE_EP_NATIVE_ABI_VERSION) return 2;
  st = moe_ep_quantize(MOE_EP_DEVICE_CPU, NULL, MOE_EP_FORMAT_BF16, x, 1, 4, 1, bits, NULL);
  if (st != MOE_EP_OK) return 3;
  printf("%04x %04x %04x %04x\n", bits[0], bits[1], bits[2], bits[3]);
  st = moe_ep_quantize(MOE_EP_DEVICE_CPU, NULL, MOE_EP_FORMAT_BF16, x, 1, -1, 1, bits, NULL);
  printf("%s: %s\n", moe_ep_status_name(st), moe_ep_last_error());
  return 0;
}
"""


def test_the_header_is_c_and_the_library_links_from_c(tmp_path):
    """A C99 program (-pedantic -Werror) includes moe_ep_native.h, links the
    shared library and calls it: the C ABI is C, not only C++."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on PATH")
    lib = moe_ep_native.library_path()
    src = tmp_path / "main.c"
    src.write_text(C_PROGRAM)
    exe = tmp_path / "main"
    build = subprocess.run(
        [cc, "-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", f"-I{moe_ep_native.include_dir()}", str(src),
         str(lib), f"-Wl,-rpath,{lib.parent}", "-o", str(exe)],
        capture_output=True, text=True, timeout=120,
    )
    assert build.returncode == 0, f"the C program did not build:\n{build.stderr}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"the C program failed with exit {run.returncode}: {run.stdout}{run.stderr}"
    lines = run.stdout.splitlines()
    want = F.round_to_bf16(np.array([1.0, -2.5, 3.0e-3, 448.0], np.float32)).view(np.uint16)
    assert lines[0].split() == [f"{b:04x}" for b in want]
    assert lines[1] == "MOE_EP_ERR_INVALID_ARGUMENT: moe_ep_quantize: n must be >= 0; got -1"


def test_data_errors_of_the_cpu_kernels_write_nothing():
    """The CPU kernels' value checks (a route id or row index out of range, a
    bad slab size) run before any output is written: the outputs keep their
    sentinel bytes."""
    from moe_ep_native._capi import call

    tokens = np.ones((2, 4), np.float32)
    dst = np.full((3, 4), -7.0, np.float32)
    with pytest.raises(NativeArgumentError, match=r"moe_ep_permute_rows: send_route\[2\] must be -1 or in \[0, 4\); got 4"):
        call("moe_ep_permute_rows", 0, None, tokens.ctypes.data, 2, 2, 16, np.array([0, 1, 4], np.int32).ctypes.data, 3,
             dst.ctypes.data)
    assert (dst == -7.0).all()
    rows, out = np.ones((4, 3), np.float32), np.full((2, 3), -7.0, np.float32)
    with pytest.raises(NativeArgumentError, match=r"moe_ep_combine_reduce: route_pos\[3\]"):
        call("moe_ep_combine_reduce", 0, None, rows.ctypes.data, 4, np.array([0, 1, 2, 4], np.int32).ctypes.data, 2, 2, 3,
             out.ctypes.data)
    assert (out == -7.0).all()
    config = _config()
    x, w, fc1, fc2 = _buffer(np.random.default_rng(12), config, [2, 2, 2], pad=0)
    desc = host.expert_desc(config, 6, 3)
    y, c = np.full((6, 64), -7.0, np.float32), np.full((6, 64), -7.0, np.float32)
    ws = np.zeros(1 << 16, np.uint8)
    with pytest.raises(NativeArgumentError, match=r"moe_ep_expert_forward: sum\(group_sizes\) must be <= num_rows = 6; got 9"):
        call("moe_ep_expert_forward", 0, None, ctypes.byref(desc), x.ctypes.data, w.ctypes.data, fc1.ctypes.data,
             fc2.ctypes.data, np.array([2, 3, 4], np.int32).ctypes.data, y.ctypes.data, c.ctypes.data, ws.ctypes.data,
             ws.size)
    assert (y == -7.0).all() and (c == -7.0).all()


def test_the_numpy_binding_rejects_what_would_wrap_or_misread():
    with pytest.raises(NativeArgumentError, match=r"topk_idx values must fit int32 \[-2\^31, 2\^31\); got 4294967297"):
        host.plan_routes(np.array([[2**32 + 1, -1]], np.int64), 4)
    with pytest.raises(NativeArgumentError, match="send_route values must fit int32"):
        host.permute_rows(np.ones((4, 2), np.float32), np.array([2**32 + 3], np.int64), 1)
    with pytest.raises(Exception, match=r"axis must be in \[-2, 2\) for a 2-d input; got 5"):
        host.quantize(np.ones((2, 32), np.float32), "mxfp8", axis=5)
    with pytest.raises(Exception, match="tokens must hold plain values"):
        host.permute_rows(np.array([[object()]], dtype=object), np.array([0], np.int32), 1)


def test_size_checks_do_not_overflow_and_pointers_must_be_aligned():
    from moe_ep_native._capi import ExpertDesc, call

    big = ExpertDesc(num_rows=0, hidden=2**33, intermediate=2**33, num_local_experts=1, apply_topk_in_fc1=1,
                     has_clamp=0, gate_up_clamp=0.0, intermediate_format=0)
    assert moe_ep_native.load().moe_ep_expert_forward_workspace(ctypes.byref(big)) == 0, "an impossible desc has no workspace"
    with pytest.raises(NativeArgumentError, match=r"desc.hidden \* 2 \* desc.intermediate must be <= "):
        call("moe_ep_expert_forward", 0, None, ctypes.byref(big), *([None] * 8), 0)
    x = np.zeros(9, np.float32)
    out = np.zeros(8, np.uint16)
    with pytest.raises(NativeArgumentError, match="moe_ep_quantize: x must be aligned to 4 bytes"):
        call("moe_ep_quantize", 0, None, 1, x.ctypes.data + 1, 1, 8, 1, out.ctypes.data, None)
    with pytest.raises(NativeArgumentError, match=r"num_experts must be <= 1073741824 \(2\^30\); got 1073741825"):
        call("moe_ep_plan_routes", 0, None, x.ctypes.data, 1, 1, 2**30 + 1, *([x.ctypes.data] * 4))


def test_combine_reduce_of_no_tokens_takes_an_empty_route_pos_whatever_the_rows() -> None:
    """A rank with T = 0 that still received rows (the static mode): its empty route_pos
    array reaches the C ABI as NULL (the torch front-end passes NULL for an empty tensor),
    which must not be held to the identity's rule num_rows == num_tokens * num_topk."""
    from moe_ep_native._capi import call

    rows = np.ones((5, 8), np.float32)
    call("moe_ep_combine_reduce", 0, None, rows.ctypes.data, 5, None, 0, 2, 8, None)
    with pytest.raises(NativeArgumentError, match=r"num_rows must be num_tokens \* num_topk = 2"):
        call("moe_ep_combine_reduce", 0, None, rows.ctypes.data, 5, None, 1, 2, 8, np.empty((1, 8), np.float32).ctypes.data)
