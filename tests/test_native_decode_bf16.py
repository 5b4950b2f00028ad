"""``moe_ep_dequantize_bf16``: block-scaled codes decoded straight to bf16 operands.

Bit for bit against numpy (the exact decode of :mod:`moe_ep_spec.formats`, then
bf16 without rounding): every (code, scale) pair of both formats, random tensors
in every layout (blocks along any axis, partial blocks, the transposed weight
layout), the golden vectors. The inexact flag is set exactly when a value is not
a bf16 value, and such a value decodes to NaN; nvfp4 never sets it, mxfp8 only
at scale codes 0..2. The argument checks give the rule, the value and what is
allowed. The CUDA part (device machine) checks the CUDA kernels' every path
against the CPU entry.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

from native_core import native_or_skip

moe_ep_native = native_or_skip()

from format_inputs import load_golden  # noqa: E402
from moe_ep_native import host  # noqa: E402
from moe_ep_native._capi import Format, call  # noqa: E402
from moe_ep_spec import NativeArgumentError, NativeError  # noqa: E402
from moe_ep_spec import formats as F  # noqa: E402

NAN_BITS = 0x7FC0


def _expected(t: F.BlockScaledTensor) -> tuple:
    """``(bits [t.shape] uint16, inexact [t.shape] bool)``: the exact decode (float64),
    as float32 (the spec's decode: +-inf from 2^128 on), then its bf16 bits where bf16
    holds it exactly; 0x7FC0 for NaN and for values bf16 cannot hold."""
    v64 = F.dequantize(t, np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # float32 overflow to inf is the spec's decode
        v32 = v64.astype(np.float32)
    b = v32.astype(ml_dtypes.bfloat16)
    exact = b.astype(np.float64) == v32.astype(np.float64)  # inf == inf; NaN never
    nan = np.isnan(v64)
    return np.where(exact, b.view(np.uint16), NAN_BITS).astype(np.uint16), ~exact & ~nan


def _mxfp8(codes: np.ndarray, scales: np.ndarray, shape, axis=-1) -> F.BlockScaledTensor:
    return F.BlockScaledTensor(data=codes.astype(np.uint8).view(F.FLOAT8_E4M3),
                               scale=scales.astype(np.uint8).view(F.FLOAT8_E8M0), format="mxfp8", shape=shape, axis=axis)


def _nvfp4(packed: np.ndarray, scales: np.ndarray, shape, axis=-1) -> F.BlockScaledTensor:
    return F.BlockScaledTensor(data=packed.astype(np.uint8), scale=scales.astype(np.uint8).view(F.FLOAT8_E4M3),
                               format="nvfp4", shape=shape, axis=axis)


def _check(t: F.BlockScaledTensor, transpose: bool = False) -> np.ndarray:
    """Decode with the CPU entry, compare bit for bit; return the inexact mask."""
    got, inexact = host.dequantize_bf16(t, transpose=transpose)
    bits, bad = _expected(t)
    if transpose:
        bits, bad = np.swapaxes(bits, -1, -2), np.swapaxes(bad, -1, -2)
    g = got.view(np.uint16)
    diff = np.argwhere(g != bits)
    assert diff.size == 0, (f"{t.format.value} shape {t.shape} axis {t.axis}: {len(diff)} bf16 codes differ, first at "
                            f"{tuple(diff[0])}: got {g[tuple(diff[0])]:#06x}, want {bits[tuple(diff[0])]:#06x}")
    assert inexact == bool(bad.any()), f"inexact flag {inexact}, but {int(bad.sum())} values are not bf16 values"
    return bad


# ----------------------------------------------------------------------------- every code


def test_every_mxfp8_code_at_every_scale():
    """Row s holds the 256 E4M3 codes at scale code s (8 blocks of 32)."""
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)
    bad = _check(_mxfp8(codes, scales, (256, 256)))
    rows = np.flatnonzero(bad.any(axis=1))
    assert set(rows) <= {0, 1, 2}, f"inexact values at scale codes {rows}: only 0..2 can lie off bf16's grid"
    assert set(rows) == {0, 1, 2}
    # The inexact values are exactly the magnitudes below 2^-126 that are not multiples of 2^-133.
    v = np.abs(F.dequantize(_mxfp8(codes, scales, (256, 256)), np.float64))
    with np.errstate(invalid="ignore"):
        want = (v < 2.0**-126) & (np.mod(v, 2.0**-133) != 0) & ~np.isnan(v)
    np.testing.assert_array_equal(bad, want)


def test_every_mxfp8_row_sets_the_flag_alone():
    """The flag of each row decoded on its own: set exactly for the rows with an inexact value."""
    for s in (0, 1, 2, 3, 127, 254, 255):
        codes = np.arange(256, dtype=np.uint8)[None, :]
        scales = np.full((1, 8), s, np.uint8)
        bad = _check(_mxfp8(codes, scales, (1, 256)))
        assert bad.any() == (s <= 2), s


def test_every_nvfp4_code_at_every_scale():
    """Row s: the 16 E2M1 codes (twice: 32 elements, 2 blocks) at E4M3 scale code s; never inexact."""
    nib = np.arange(16, dtype=np.uint8)
    packed = np.tile(np.concatenate([nib[0::2] | (nib[1::2] << 4)] * 2), (256, 1))  # [256, 16] bytes = 32 elements
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 2, axis=1)
    bad = _check(_nvfp4(packed, scales, (256, 32)))
    assert not bad.any(), "nvfp4 (E2M1 x E4M3) is always a bf16 value"


def test_overflow_is_inf_not_inexact():
    """mxfp8 magnitudes >= 2^128 are +-inf, as the float32 decode (not flagged)."""
    codes = np.array([[0x7E, 0xFE, 0x40, 0x38] + [0] * 28], np.uint8)  # 448, -448, 2, 1
    got, inexact = host.dequantize_bf16(_mxfp8(codes, np.array([[254]], np.uint8), (1, 32)))
    g = got.view(np.uint16)[0]
    assert (g[0], g[1], g[2]) == (0x7F80, 0xFF80, 0x7F80) and g[3] == 0x7F00 and not inexact


def test_nan_blocks_and_codes_decode_to_nan_without_the_flag():
    codes = np.zeros((2, 32), np.uint8)
    codes[1, 5] = 0x7F
    got, inexact = host.dequantize_bf16(_mxfp8(codes, np.array([[0xFF], [127]], np.uint8), (2, 32)))
    g = got.view(np.uint16)
    assert (g[0] == NAN_BITS).all() and g[1, 5] == NAN_BITS and (np.delete(g[1], 5) == 0).all() and not inexact
    packed = np.full((1, 8), 0x21, np.uint8)
    got, inexact = host.dequantize_bf16(_nvfp4(packed, np.array([[0x7F]], np.uint8), (1, 16)))
    assert (got.view(np.uint16) == NAN_BITS).all() and not inexact


# ----------------------------------------------------------------------------- layouts


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape,axis", [((5, 70), -1), ((3, 64, 9), 1), ((4, 33, 3), 1), ((2, 3, 31), -1), ((7,), 0),
                                        ((3, 65, 2, 4), 1), ((0, 32), -1)])
def test_random_tensors_in_every_layout(fmt, shape, axis):
    rng = np.random.default_rng(sum(shape) + axis)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))).astype(np.float32)
    _check(F.quantize(x, fmt, axis=axis))


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("shape", [(2, 24, 64), (1, 72, 96), (3, 5, 33), (2, 8, 128), (1, 1, 1)])
def test_transposed_weights(fmt, shape):
    """An expert weight stored [E, N, K] (blocked along K) decodes to [E, K, N] in one call."""
    rng = np.random.default_rng(shape[1] * 7 + shape[2])
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-20, 20, shape))).astype(np.float32)
    t = F.quantize(x, fmt, axis=-1)
    _check(t, transpose=True)
    got, _ = host.dequantize_bf16(t, transpose=True)
    assert got.shape == (shape[0], shape[2], shape[1])


def test_tiny_values_are_nan_and_flagged_in_the_transposed_layout_too():
    x = np.ones((2, 3, 64), np.float32)
    x[1, 2, 32:] = 3 * 2.0**-136  # one block at scale code 0: E4M3 3 * 2^-9 -> 3 * 2^-136, not a bf16 value
    t = F.quantize(x, "mxfp8")
    bad = _check(t, transpose=True)
    assert bad[1, 2, 32:].all() and bad.sum() == 32
    got, inexact = host.dequantize_bf16(t, transpose=True)
    assert inexact and np.isnan(got[1, 32:, 2].astype(np.float32)).all()


def test_golden_vectors():
    golden = load_golden()
    cats = sorted({k.split("/")[0] for k in golden})
    for cat in cats:
        m = _mxfp8(golden[f"{cat}/mxfp8_data_bits"], golden[f"{cat}/mxfp8_scale_bits"], golden[f"{cat}/input"].shape)
        _check(m)
        n = _nvfp4(golden[f"{cat}/nvfp4_data_packed"], golden[f"{cat}/nvfp4_scale_bits"], golden[f"{cat}/input"].shape)
        assert not _check(n).any()


# ----------------------------------------------------------------------------- the flag


def _raw(fmt, data, scale, outer, n, inner, rows, out, flag, device=0, stream=None):
    p = (lambda a: None if a is None else a.ctypes.data)
    call("moe_ep_dequantize_bf16", device, stream, fmt, p(data), p(scale), outer, n, inner, rows, p(out),
         flag if isinstance(flag, (int, type(None))) else p(flag))


def test_the_flag_is_ored_never_cleared_and_may_be_null():
    codes = np.full((1, 32), 3, np.uint8)  # 3 * 2^-9 at scale code 0: inexact
    scale = np.zeros((1, 1), np.uint8)
    out = np.zeros((1, 32), np.uint16)
    flag = np.array([6], np.int32)
    _raw(Format.MXFP8, codes, scale, 1, 32, 1, 0, out, flag)
    assert flag[0] == 7 and (out == NAN_BITS).all()
    _raw(Format.MXFP8, codes, np.full((1, 1), 127, np.uint8), 1, 32, 1, 0, out, flag)
    assert flag[0] == 7, "an exact decode leaves the flag as it was"
    flag[0] = 0
    _raw(Format.MXFP8, codes, np.full((1, 1), 127, np.uint8), 1, 32, 1, 0, out, flag)
    assert flag[0] == 0 and (out == 0x3BC0).all()  # 3 * 2^-9 = 1.5 * 2^-8
    _raw(Format.MXFP8, codes, scale, 1, 32, 1, 0, out, None)
    assert (out == NAN_BITS).all()


# ----------------------------------------------------------------------------- argument checks


def test_argument_checks_name_the_rule_the_value_and_what_is_allowed():
    d = np.zeros((4, 32), np.uint8)
    s = np.zeros((4, 1), np.uint8)
    out = np.zeros((4, 32), np.uint16)
    flag = np.zeros(1, np.int32)
    cases = [
        (dict(fmt=Format.BF16), r"moe_ep_dequantize_bf16: fmt must be MOE_EP_FORMAT_MXFP8 \(2\) or MOE_EP_FORMAT_NVFP4 "
                                r"\(3\) \(the block-scaled formats; bf16 data is already bf16\); got 1"),
        (dict(fmt=Format.NONE), r"fmt must be MOE_EP_FORMAT_MXFP8 \(2\) or MOE_EP_FORMAT_NVFP4 \(3\).*; got 0"),
        (dict(fmt=9), r"; got 9"),
        (dict(outer=-1), r"outer must be >= 0; got -1"),
        (dict(n=-2), r"n must be >= 0; got -2"),
        (dict(inner=-3), r"inner must be >= 0; got -3"),
        (dict(rows=-1), r"transpose_rows must be >= 0; got -1"),
        (dict(rows=2, inner=2, outer=2, n=32), r"inner must be 1 when transpose_rows >= 1 \(the matrices are blocked "
                                               r"along their last axis\); got 2"),
        (dict(rows=3), r"outer must be a multiple of transpose_rows = 3 \(the view is \[outer / transpose_rows, "
                       r"transpose_rows, n\]\); got 4"),
        (dict(data=None), r"data must not be NULL; got NULL"),
        (dict(scale=None), r"scale must not be NULL; got NULL"),
        (dict(out=None), r"out must not be NULL; got NULL"),
        (dict(out_addr=out.ctypes.data + 1), r"out must be aligned to 2 bytes; got an address 1 bytes past a multiple of 2"),
        (dict(flag_addr=flag.ctypes.data + 2), r"out_inexact must be aligned to 4 bytes; got an address 2 bytes past a "
                                               r"multiple of 4"),
        (dict(stream=1), r"stream must be NULL for MOE_EP_DEVICE_CPU; got a non-NULL stream"),
        (dict(device=7), r"device must be MOE_EP_DEVICE_CPU \(0\) or MOE_EP_DEVICE_CUDA \(1\); got 7"),
    ]
    for change, message in cases:
        a = dict(fmt=Format.MXFP8, data=d, scale=s, outer=4, n=32, inner=1, rows=0, out=out, flag=flag, device=0,
                 stream=None)
        a.update(change)
        out_p = a.pop("out_addr", None) or (None if a["out"] is None else a["out"].ctypes.data)
        flag_p = a.pop("flag_addr", None) or a["flag"].ctypes.data
        before = out.copy()
        with pytest.raises(NativeArgumentError, match=message):
            call("moe_ep_dequantize_bf16", a["device"], a["stream"], a["fmt"],
                 None if a["data"] is None else a["data"].ctypes.data,
                 None if a["scale"] is None else a["scale"].ctypes.data, a["outer"], a["n"], a["inner"], a["rows"],
                 out_p, flag_p)
        np.testing.assert_array_equal(out, before, err_msg=f"{message}: the output was written before the check failed")


def test_empty_views_need_no_pointers():
    for outer, n, inner in ((0, 32, 1), (3, 0, 1), (3, 32, 0)):
        call("moe_ep_dequantize_bf16", 0, None, Format.NVFP4, None, None, outer, n, inner, 0, None, None)


def test_cuda_calls_in_a_build_without_cuda_say_so():
    if moe_ep_native.has_cuda():
        pytest.skip("this build has CUDA")
    with pytest.raises(NativeError, match="no CUDA implementation"):
        call("moe_ep_dequantize_bf16", 1, None, Format.MXFP8, None, None, 0, 0, 1, 0, None, None)


def test_host_binding_checks_its_arguments():
    with pytest.raises(Exception, match="takes a BlockScaledTensor"):
        host.dequantize_bf16(np.zeros(3, np.float32))  # type: ignore[arg-type]
    t = F.quantize(np.ones((4, 32), np.float32), "mxfp8", axis=0)
    with pytest.raises(Exception, match="blocked along its last axis"):
        host.dequantize_bf16(t, transpose=True)


# ----------------------------------------------------------------------------- CUDA (device machine)


def _cuda_ready() -> bool:
    try:
        import torch

        return moe_ep_native.has_cuda() and torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


needs_cuda = pytest.mark.skipif(not _cuda_ready(), reason="needs a GPU and moe-ep-native built with MOE_EP_NATIVE_CUDA=1")


def _cuda_decode(t: F.BlockScaledTensor, rows: int, offset: int = 0):
    """The CUDA entry on t's codes (data placed ``offset`` bytes into its buffer, to
    reach the element-by-element path): ``(bits, flag)``."""
    import torch

    outer, n, inner = host._view(t.shape, t.axis)
    data = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(-1).copy())
    scale = torch.from_numpy(np.ascontiguousarray(t.scale).view(np.uint8).reshape(-1).copy()).cuda()
    buf = torch.zeros(data.numel() + 32, dtype=torch.uint8, device="cuda")
    buf[offset : offset + data.numel()] = data.cuda()
    out_shape = t.shape if rows == 0 else t.shape[:-2] + (t.shape[-1], t.shape[-2])
    out = torch.full(out_shape, -1, dtype=torch.int16, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream or None
    fmt = Format.MXFP8 if t.format is F.MoeFormat.MXFP8 else Format.NVFP4
    call("moe_ep_dequantize_bf16", 1, stream, fmt, buf.data_ptr() + offset, scale.data_ptr(), outer, n, inner, rows,
         out.data_ptr(), flag.data_ptr())
    return out.cpu().numpy().view(np.uint16), bool(flag.item())


@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize(
    "shape,axis,transpose,offset",
    [
        ((64, 256), -1, False, 0),      # rows, 16-byte path
        ((37, 96), -1, False, 0),       # rows, 16-byte path (n a multiple of 32), ragged row count
        ((5, 70), -1, False, 0),        # rows, n not a multiple of the chunk: element by element
        ((64, 256), -1, False, 1),      # misaligned data: element by element
        ((3, 64, 9), 1, False, 0),      # inner > 1, not a multiple of 16: element by element
        ((3, 64, 32), 1, False, 0),     # inner a multiple of 16: 16 neighbours along inner a thread
        ((2, 33, 48), 1, False, 0),     # ... n odd (nvfp4's last byte row has no high row), a partial block
        ((4, 70, 16), 1, False, 0),     # ... a partial last block along n
        ((3, 64, 32), 1, False, 1),     # ... misaligned data: element by element
        ((2, 128, 256), -1, True, 0),   # transposed, whole tiles
        ((3, 72, 96), -1, True, 0),     # transposed, partial tiles in both directions
        ((2, 12, 64), -1, True, 0),     # transposed, R not a multiple of 8: element by element
        ((1, 8, 7168), -1, True, 0),    # transposed, many column tiles
    ],
)
def test_cuda_matches_the_cpu_entry_on_every_path(fmt, shape, axis, transpose, offset):
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-60, 60, shape))).astype(np.float32)
    if fmt == "mxfp8":
        flat = x.reshape(-1)
        flat[: min(64, flat.size)] = 3 * 2.0**-136  # inexact blocks (scale code 0)
    t = F.quantize(x, fmt, axis=axis)
    want, want_flag = host.dequantize_bf16(t, transpose=transpose)
    got, flag = _cuda_decode(t, t.shape[-2] if transpose else 0, offset)
    np.testing.assert_array_equal(got, want.view(np.uint16))
    assert flag == want_flag


@needs_cuda
def test_cuda_every_code_matches_the_cpu_entry():
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1))
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 8, axis=1)
    t = _mxfp8(codes, scales, (256, 256))
    want, want_flag = host.dequantize_bf16(t)
    got, flag = _cuda_decode(t, 0)
    np.testing.assert_array_equal(got, want.view(np.uint16))
    assert flag and want_flag
    got, flag = _cuda_decode(_mxfp8(codes[3:], scales[3:], (253, 256)), 0)
    assert not flag
    nib = np.arange(16, dtype=np.uint8)
    packed = np.tile(np.concatenate([nib[0::2] | (nib[1::2] << 4)] * 2), (256, 1))
    t = _nvfp4(packed, np.repeat(np.arange(256, dtype=np.uint8)[:, None], 2, axis=1), (256, 32))
    got, flag = _cuda_decode(t, 0)
    np.testing.assert_array_equal(got, host.dequantize_bf16(t)[0].view(np.uint16))
    assert not flag


@needs_cuda
def test_cuda_every_code_at_every_scale_blocked_along_the_middle_axis():
    """The 16-neighbours-along-inner path (jax's weight layout): every (code, scale) pair of
    both formats, each element with its own scale (scale code o for outer index o)."""
    codes = np.broadcast_to(np.arange(256, dtype=np.uint8), (256, 32, 256)).copy()  # [o, k, i] = i
    scales = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None, None], (256, 1, 256)).copy()  # [o, 0, i] = o
    t = _mxfp8(codes, scales, (256, 32, 256), axis=1)
    want, want_flag = host.dequantize_bf16(t)
    got, flag = _cuda_decode(t, 0)
    np.testing.assert_array_equal(got, want.view(np.uint16))
    assert flag and want_flag
    packed = np.broadcast_to(np.arange(256, dtype=np.uint8), (256, 16, 256)).copy()  # both nibbles of every byte
    t = _nvfp4(packed, np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None, None], (256, 2, 256)).copy(),
               (256, 32, 256), axis=1)
    got, flag = _cuda_decode(t, 0)
    np.testing.assert_array_equal(got, host.dequantize_bf16(t)[0].view(np.uint16))
    assert not flag


@needs_cuda
def test_cuda_mxfp8_scales_varying_along_inner_mix_both_decodes():
    """The mxfp8 middle-axis path decodes a thread's 16 neighbours with a bf16 multiply
    where all 16 scale codes are in 10..254, else element by element: scales that vary
    along inner (code (o + i + k // 32) % 256) put both kinds of chunk side by side, with
    NaN codes (0x7F, 0xFF) and the inexact codes 0..2 among them; rows 33 (a partial last
    block) check the rows loop's tail."""
    o_, n, inner = 7, 33, 256
    codes = ((np.arange(o_)[:, None, None] * 37 + np.arange(n)[None, :, None] * 11
              + np.arange(inner)[None, None, :]) % 256).astype(np.uint8)
    scales = ((np.arange(o_)[:, None, None] + np.arange(2)[None, :, None] * 5
               + np.arange(inner)[None, None, :]) % 256).astype(np.uint8)
    t = _mxfp8(codes, scales, (o_, n, inner), axis=1)
    want, want_flag = host.dequantize_bf16(t)
    got, flag = _cuda_decode(t, 0)
    np.testing.assert_array_equal(got, want.view(np.uint16))
    assert flag and want_flag
    fast = np.clip(scales, 10, 254)  # every chunk fast: the flag stays clear, NaN codes still NaN
    t = _mxfp8(codes, fast, (o_, n, inner), axis=1)
    want, want_flag = host.dequantize_bf16(t)
    got, flag = _cuda_decode(t, 0)
    np.testing.assert_array_equal(got, want.view(np.uint16))
    assert not flag and not want_flag
    assert (got.reshape(o_, n, inner)[codes & 0x7F == 0x7F] == 0x7FC0).all()


@needs_cuda
def test_cuda_decode_is_capturable_in_a_graph():
    import torch

    x = torch.randn(256, 512, device="cuda")
    from moe_ep_cuda_nccl import prims

    t = prims.quantize(x, F.MoeFormat.MXFP8)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    eager = prims.dequantize_bf16(t, flag)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        prims.dequantize_bf16(t, flag)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = prims.dequantize_bf16(t, flag)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), eager.view(torch.int16)) and int(flag.item()) == 0


# ----------------------------------------------------------------------------- rows where they lie


def _packed_rows(t: F.BlockScaledTensor, pad: int):
    """t's codes and scales (rows blocked along the last axis) packed as one byte row per
    row, ``[codes | scales | pad bytes]`` as a dispatch's packed rows: ``(blob, codes_bytes,
    row_bytes)``; the pad bytes are 0xFF (a NaN scale, were they ever read as one)."""
    d = np.ascontiguousarray(t.data).view(np.uint8).reshape(t.shape[0], -1)
    s = np.ascontiguousarray(t.scale).view(np.uint8).reshape(t.shape[0], -1)
    blob = np.full((t.shape[0], d.shape[1] + s.shape[1] + pad), 0xFF, np.uint8)
    blob[:, : d.shape[1]] = d
    blob[:, d.shape[1] : d.shape[1] + s.shape[1]] = s
    return blob, d.shape[1], blob.shape[1]


def _rows_call(device, stream, fmt, data_p, data_rb, scale_p, scale_rb, rows, n, out_p, flag_p):
    call("moe_ep_dequantize_bf16_rows", device, stream, fmt, data_p, data_rb, scale_p, scale_rb, rows, n, out_p, flag_p)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("rows,n,pad", [(6, 64, 0), (5, 70, 3), (3, 32, 16), (1, 7, 1)])
def test_rows_where_they_lie_decode_as_the_contiguous_rows(fmt, rows, n, pad):
    rng = np.random.default_rng(rows * n + pad)
    x = (rng.standard_normal((rows, n)) * np.exp2(rng.integers(-40, 40, (rows, n)))).astype(np.float32)
    if fmt == "mxfp8":
        x[0, : min(n, 32)] = 3 * 2.0**-136  # a block bf16 cannot hold: NaN and the flag
    t = F.quantize(x, fmt)
    want, want_flag = host.dequantize_bf16(t)
    blob, cb, rb = _packed_rows(t, pad)
    out = np.full((rows, n), 0x1234, np.uint16)
    flag = np.zeros(1, np.int32)
    fmt_code = Format.MXFP8 if fmt == "mxfp8" else Format.NVFP4
    _rows_call(0, None, fmt_code, blob.ctypes.data, rb, blob.ctypes.data + cb, rb, rows, n, out.ctypes.data,
               flag.ctypes.data)
    np.testing.assert_array_equal(out, want.view(np.uint16), err_msg=f"{fmt} rows {rows} x {n}, {pad} pad bytes")
    assert bool(flag[0]) == want_flag


def test_rows_argument_checks_name_the_rule_the_value_and_what_is_allowed():
    blob = np.zeros((4, 64), np.uint8)
    out = np.zeros((4, 32), np.uint16)
    flag = np.zeros(1, np.int32)
    cases = [
        (dict(fmt=Format.BF16), r"moe_ep_dequantize_bf16_rows: fmt must be MOE_EP_FORMAT_MXFP8 \(2\) or "
                                r"MOE_EP_FORMAT_NVFP4 \(3\).*; got 1"),
        (dict(rows=-1), r"outer must be >= 0; got -1"),
        (dict(data_rb=31), r"data_row_bytes must be >= the codes of one row \(32 for n = 32\); got 31"),
        (dict(scale_rb=0), r"scale_row_bytes must be >= the scales of one row \(1 for n = 32\); got 0"),
        (dict(fmt=Format.NVFP4, data_rb=15), r"data_row_bytes must be >= the codes of one row \(16 for n = 32\); got 15"),
        (dict(fmt=Format.NVFP4, scale_rb=1), r"scale_row_bytes must be >= the scales of one row \(2 for n = 32\); got 1"),
        (dict(data=None), r"data must not be NULL; got NULL"),
        (dict(out_addr=out.ctypes.data + 1), r"out must be aligned to 2 bytes"),
        (dict(stream=1), r"stream must be NULL for MOE_EP_DEVICE_CPU; got a non-NULL stream"),
    ]
    for change, message in cases:
        a = dict(fmt=Format.MXFP8, data=blob.ctypes.data, data_rb=64, scale_rb=64, rows=4, device=0, stream=None)
        a.update(change)
        out_p = a.pop("out_addr", None) or out.ctypes.data
        before = out.copy()
        with pytest.raises(NativeArgumentError, match=message):
            _rows_call(a["device"], a["stream"], a["fmt"], a["data"], a["data_rb"], blob.ctypes.data + 32,
                       a["scale_rb"], a["rows"], 32, out_p, flag.ctypes.data)
        np.testing.assert_array_equal(out, before, err_msg=f"{message}: the output was written before the check failed")
    _rows_call(0, None, Format.MXFP8, None, 32, None, 1, 0, 32, None, None)  # no rows: no pointers needed


@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("rows,n,pad", [(64, 256, 0), (37, 7168, 0), (9, 256, 8), (5, 70, 3)])
def test_cuda_rows_where_they_lie_match_the_cpu_entry(fmt, rows, n, pad):
    """Both CUDA paths: 16-byte chunks (row bytes a multiple of 16) and element by element."""
    import torch

    rng = np.random.default_rng(rows + n + pad)
    x = (rng.standard_normal((rows, n)) * np.exp2(rng.integers(-60, 60, (rows, n)))).astype(np.float32)
    if fmt == "mxfp8":
        x[0, :32] = 3 * 2.0**-136
    t = F.quantize(x, fmt)
    want, want_flag = host.dequantize_bf16(t)
    blob, cb, rb = _packed_rows(t, pad)
    dev = torch.from_numpy(blob).cuda()
    out = torch.full((rows, n), -1, dtype=torch.int16, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream or None
    fmt_code = Format.MXFP8 if fmt == "mxfp8" else Format.NVFP4
    _rows_call(1, stream, fmt_code, dev.data_ptr(), rb, dev.data_ptr() + cb, rb, rows, n, out.data_ptr(),
               flag.data_ptr())
    np.testing.assert_array_equal(out.cpu().numpy().view(np.uint16), want.view(np.uint16))
    assert bool(flag.item()) == want_flag


# ----------------------------------------------------------------------------- rows gathered by route id


def _gather_call(device, stream, fmt, data_p, data_rb, scale_p, scale_rb, num_tokens, route_p, num_topk, rows, n,
                 out_p, flag_p):
    call("moe_ep_dequantize_bf16_gather", device, stream, fmt, data_p, data_rb, scale_p, scale_rb, num_tokens, route_p,
         num_topk, rows, n, out_p, flag_p)


def _gather_case(fmt, tokens, n, k, rows, pad, seed):
    """Token rows (packed as a dispatch's byte rows), route ids of ``rows`` buffer rows (-1
    among them) and the bits the gather must give: the rows permuted by route id
    (moe_ep_permute_rows' rule) then decoded."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((tokens, n)) * np.exp2(rng.integers(-40, 40, (tokens, n)))).astype(np.float32)
    if fmt == "mxfp8":
        x[1, : min(n, 32)] = 3 * 2.0**-136  # a block bf16 cannot hold: NaN and the flag
    t = F.quantize(x, fmt)
    blob, cb, rb = _packed_rows(t, pad)
    route = rng.integers(0, tokens * k, rows).astype(np.int32)
    route[::4] = -1
    want_rows = host.permute_rows(blob, route, k)  # zero bytes for -1 (a zero code with a zero scale: +0)
    want = np.zeros((rows, n), np.uint16)
    live = route >= 0
    if live.any():
        sub = F.BlockScaledTensor(
            data=want_rows[live, :cb].copy().view(t.data.dtype).reshape((int(live.sum()),) + t.data.shape[1:]),
            scale=want_rows[live, cb : cb + t.scale.shape[1]].copy().view(t.scale.dtype),
            format=fmt, shape=(int(live.sum()), n), axis=-1)
        bits, want_flag = host.dequantize_bf16(sub)
        want[live] = bits.view(np.uint16)
    else:
        want_flag = False
    return blob, cb, rb, route, want, want_flag


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("tokens,n,k,rows,pad", [(6, 64, 3, 20, 0), (5, 70, 2, 9, 3), (4, 32, 1, 4, 16)])
def test_gather_decodes_the_routes_token_rows(fmt, tokens, n, k, rows, pad):
    """moe_ep_dequantize_bf16_gather: buffer row i is the decode of token row route[i] / K,
    zero bits for -1; the same bits as moe_ep_permute_rows then the rows' decode."""
    blob, cb, rb, route, want, want_flag = _gather_case(fmt, tokens, n, k, rows, pad, tokens * n + k)
    out = np.full((rows, n), 0x1234, np.uint16)
    flag = np.zeros(1, np.int32)
    fmt_code = Format.MXFP8 if fmt == "mxfp8" else Format.NVFP4
    _gather_call(0, None, fmt_code, blob.ctypes.data, rb, blob.ctypes.data + cb, rb, tokens, route.ctypes.data, k,
                 rows, n, out.ctypes.data, flag.ctypes.data)
    np.testing.assert_array_equal(out, want, err_msg=f"{fmt}: {tokens} tokens x {n}, K {k}, {rows} rows")
    assert bool(flag[0]) == want_flag


def test_gather_argument_checks_name_the_rule_the_value_and_what_is_allowed():
    blob = np.zeros((4, 64), np.uint8)
    route = np.array([0, 7, -1, 3], np.int32)
    out = np.zeros((4, 32), np.uint16)
    flag = np.zeros(1, np.int32)
    cases = [
        (dict(route=np.array([0, 8, -1, 3], np.int32)),
         r"moe_ep_dequantize_bf16_gather: route\[1\] must be -1 or in \[0, num_tokens \* num_topk\) = \[0, 8\); got 8"),
        (dict(route=np.array([0, 1, -2, 3], np.int32)), r"route\[2\] must be -1 or in .*; got -2"),
        (dict(k=0), r"num_topk must be >= 1; got 0"),
        (dict(tokens=-1), r"num_tokens must be >= 0; got -1"),
        (dict(route=None), r"route must not be NULL; got NULL"),
        (dict(fmt=Format.BF16), r"fmt must be MOE_EP_FORMAT_MXFP8 \(2\) or MOE_EP_FORMAT_NVFP4 \(3\)"),
    ]
    for change, message in cases:
        a = dict(fmt=Format.MXFP8, tokens=4, k=2, route=route)
        a.update(change)
        before = out.copy()
        with pytest.raises(NativeArgumentError, match=message):
            _gather_call(0, None, a["fmt"], blob.ctypes.data, 64, blob.ctypes.data + 32, 64, a["tokens"],
                         None if a["route"] is None else a["route"].ctypes.data, a["k"], 4, 32, out.ctypes.data,
                         flag.ctypes.data)
        np.testing.assert_array_equal(out, before, err_msg=f"{message}: the output was written before the check failed")
    _gather_call(0, None, Format.MXFP8, None, 32, None, 1, 0, None, 1, 0, 32, None, None)  # nothing to gather


@needs_cuda
def test_cuda_mxfp8_rows_every_scale_code_and_nan_code():
    """The mxfp8 rows' decode on CUDA (both entries: where the rows lie and gathered by route
    id) over every scale code 0..255, each with random codes and with a NaN code (0x7F, 0xFF)
    in one of its 8-code pieces: the pair-at-a-time bf16 path (scale codes 10..254, no NaN
    code) and the element-by-element one meet at their bounds with the CPU entry's bits."""
    import torch

    rng = np.random.default_rng(256)
    n = 64  # two blocks a row
    codes = rng.integers(0, 256, (512, n), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x11  # NaN codes only where placed below
    codes[1::2, 3] = 0x7F  # odd rows: a NaN code in piece 0
    codes[1::4, 40] = 0xFF  # and in piece 1 of block 1
    scale = np.stack([np.arange(256), np.arange(256)[::-1]], axis=1).repeat(2, axis=0).astype(np.uint8)
    t = F.BlockScaledTensor(data=codes.view(F.MoeFormat.MXFP8.data_dtype), scale=scale.view(F.MoeFormat.MXFP8.scale_dtype),
                            format="mxfp8", shape=(512, n), axis=-1)
    want, want_flag = host.dequantize_bf16(t)
    assert want_flag, "scale codes 0..2 hold values bf16 cannot: the flag"
    blob, cb, rb = _packed_rows(t, 0)
    dev = torch.from_numpy(blob).cuda()
    stream = torch.cuda.current_stream().cuda_stream or None
    out = torch.full((512, n), -1, dtype=torch.int16, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    _rows_call(1, stream, Format.MXFP8, dev.data_ptr(), rb, dev.data_ptr() + cb, rb, 512, n, out.data_ptr(),
               flag.data_ptr())
    np.testing.assert_array_equal(out.cpu().numpy().view(np.uint16), want.view(np.uint16), err_msg="rows")
    assert bool(flag.item())
    route = (np.arange(512)[::-1] * 2).astype(np.int32)  # buffer row i: token 511 - i, slot 0 (num_topk 2)
    out2 = torch.full((512, n), -1, dtype=torch.int16, device="cuda")
    flag.zero_()
    _gather_call(1, stream, Format.MXFP8, dev.data_ptr(), rb, dev.data_ptr() + cb, rb, 512, torch.from_numpy(route)
                 .cuda().data_ptr(), 2, 512, n, out2.data_ptr(), flag.data_ptr())
    np.testing.assert_array_equal(out2.cpu().numpy().view(np.uint16), want.view(np.uint16)[route // 2],
                                  err_msg="gathered rows")


@needs_cuda
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("tokens,n,k,rows,pad", [(64, 7168, 8, 600, 0), (9, 256, 2, 30, 8), (5, 70, 3, 17, 3)])
def test_cuda_gather_matches_the_cpu_entry(fmt, tokens, n, k, rows, pad):
    """Both CUDA paths (16-byte pieces; element by element), and an id out of range: a zero row."""
    import torch

    blob, cb, rb, route, want, want_flag = _gather_case(fmt, tokens, n, k, rows, pad, tokens + n + k)
    route[5] = tokens * k  # out of range: CUDA writes a zero row (the CPU entry rejects it)
    want[5] = 0  # (token 1, whose block bf16 cannot hold sets the flag, keeps other routes in every case)
    dev = torch.from_numpy(blob).cuda()
    rdev = torch.from_numpy(route).cuda()
    out = torch.full((rows, n), -1, dtype=torch.int16, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream or None
    fmt_code = Format.MXFP8 if fmt == "mxfp8" else Format.NVFP4
    _gather_call(1, stream, fmt_code, dev.data_ptr(), rb, dev.data_ptr() + cb, rb, tokens, rdev.data_ptr(), k, rows,
                 n, out.data_ptr(), flag.data_ptr())
    np.testing.assert_array_equal(out.cpu().numpy().view(np.uint16), want)
    assert bool(flag.item()) == want_flag
