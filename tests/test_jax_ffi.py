"""The ``jax-ffi`` backend: the native core through XLA FFI as the jax layer's kernels.

What is checked here (the conformance suite checks the backend against the
reference; the main job runs its full table at EP 1, 2 and 4):

- :class:`FfiKernels` against :class:`XlaKernels`: the formats bit for bit (and
  against ``moe_ep_spec.formats``: NaN/Inf blocks, subnormals, odd and partial
  blocks, weights blocked along axis 1), the routing plan and the slot-order sum
  identical, the expert forward and backward in every input format, router-weight
  placement, clamp and intermediate format to float32 rounding;
- the handlers' own checks: every registered target called directly with
  ``jax.ffi.ffi_call`` and mismatched shapes or attributes raises with the rule,
  the value seen and what is allowed; data errors of the core come back with
  ``moe_ep_last_error()``;
- the layer: the compiled program calls the native targets and keeps exactly the
  jax backend's collectives; ``jax.grad`` through ``moe_ep`` with the native
  kernels equals the spec's backward;
- the backend: registration, availability (and its reason when the extension is
  not built), pickling, and the conformance suite's quick table at EP 1 and 2;
- CUDA handlers (skipped without a CUDA GPU and an extension built with
  ``MOE_EP_NATIVE_CUDA=ON``).

XLA exposes one CPU device unless ``--xla_force_host_platform_device_count`` is in
``XLA_FLAGS`` when jax starts, so this module asks for 4 before importing jax.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import subprocess
import sys
from collections import Counter
from functools import partial
from pathlib import Path

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
pytest.importorskip("moe_ep_jax")
native = pytest.importorskip("moe_ep_jax_ffi.native")

#: Why the extension cannot be imported ("" when built). Unbuilt, only the
#: availability test runs (in a subprocess); the others skip with this reason.
_PROBLEM = native.load_problem()

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_ep_spec  # noqa: E402
from moe_ep_spec import MoeEpConfig, Stash  # noqa: E402
from moe_ep_spec.formats import BF16, BlockScaledTensor, FLOAT8_E4M3, FLOAT8_E8M0  # noqa: E402
from moe_ep_spec.formats import dequantize as spec_dequantize  # noqa: E402
from moe_ep_spec.formats import quantize as spec_quantize  # noqa: E402
from moe_ep_spec.inputs import random_world  # noqa: E402
from moe_ep_spec.tolerance import compare  # noqa: E402

from moe_ep_jax import api as A  # noqa: E402
from moe_ep_jax import formats as F  # noqa: E402
from moe_ep_jax.backend import XLA_CPU_FAST_COMPILE  # noqa: E402
from moe_ep_jax.kernels import ExpertKernels, XlaKernels  # noqa: E402

if not _PROBLEM:
    from moe_ep_jax_ffi.backend import JaxFfiBackend
    from moe_ep_jax_ffi.kernels import FfiKernels

    KF, KX = FfiKernels(), XlaKernels()

ROOT = Path(__file__).resolve().parents[1]
REF = moe_ep_spec.get_backend("reference")
NDEV = len(jax.devices())
PLATFORM = native.jax_platform()

needs2 = pytest.mark.skipif(
    NDEV < 2,
    reason=f"needs 2 devices; jax has {NDEV} {PLATFORM} device(s)"
    + (" (jax was imported before XLA_FLAGS could ask for more)" if PLATFORM == "cpu" else ""),
)
#: The CUDA handlers: a CUDA GPU, and the extension built with MOE_EP_NATIVE_CUDA=ON.
CUDA = pytest.mark.skipif(
    PLATFORM != "cuda" or _PROBLEM != "" or "CUDA" not in (native.platforms() if not _PROBLEM else ()),
    reason="needs a CUDA GPU and moe_ep_jax_ffi built with MOE_EP_NATIVE_CUDA=ON (run on the device machine)",
)


def on_cpu(test):
    """Run ``test`` with jax's default device set to the CPU: it checks the CPU
    handlers' data checks (value errors the CUDA handlers cannot see without a
    host synchronisation; docs/native.md)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        with jax.default_device(jax.devices("cpu")[0]):
            return test(*args, **kwargs)

    return wrapper


@pytest.fixture(autouse=True)
def _needs_the_extension(request: pytest.FixtureRequest) -> None:
    if _PROBLEM and not getattr(request.function, "runs_unbuilt", False):
        pytest.skip(_PROBLEM)


_COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter", "ragged-all-to-all")


# ----------------------------------------------------------------------------- helpers


def _compile(fn, *args):
    """jit + compile (with the backend's fast CPU options: same arithmetic)."""
    opts = XLA_CPU_FAST_COMPILE if jax.default_backend() == "cpu" else None
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile(opts) if opts else lowered.compile()


def _run(fn, *args):
    return _compile(fn, *args)(*args)


def _codes(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


_PLAN_FIELDS = ("send_route", "route_pos", "route_expert", "counts")


from format_inputs import format_inputs as _format_inputs  # noqa: E402 - the shared corner-case inputs
from format_inputs import golden_codes as _golden_codes  # noqa: E402


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), ("ep",))


def _put(mesh: Mesh, per_rank, rows: int, fill=0):
    padded = []
    for a in per_rank:
        a = np.asarray(a)
        out = np.full((rows,) + a.shape[1:], fill, dtype=a.dtype)
        out[: a.shape[0]] = a
        padded.append(out)
    return jax.device_put(np.concatenate(padded), NamedSharding(mesh, P("ep")))


def _world_args(mesh: Mesh, world, rows: int, skip_activation: bool = False):
    return ([] if skip_activation else [_put(mesh, [w.activation for w in world], rows)]) + [
        _put(mesh, [w.fc1_weight for w in world], world[0].fc1_weight.shape[0]),
        _put(mesh, [w.fc2_weight for w in world], world[0].fc2_weight.shape[0]),
        _put(mesh, [np.asarray(w.topk_idx, np.int32) for w in world], rows, -1),
        _put(mesh, [w.topk_weights for w in world], rows),
    ]


def _collectives(text: str) -> Counter:
    found = []
    for line in text.splitlines():
        line = line.split(", metadata=")[0]
        found += re.findall(r"\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", line)
    return Counter(found)


def _ffi(target, results, *args, **attrs):
    """Call a registered target directly and wait for it (errors surface at execution)."""
    native.register()
    out = jax.ffi.ffi_call(target, results)(*args, **attrs)
    return jax.block_until_ready(out)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


# ----------------------------------------------------------------------------- the provider


def test_ffi_kernels_is_an_expert_kernels_provider() -> None:
    assert isinstance(KF, ExpertKernels) and isinstance(KX, ExpertKernels)
    assert KF == FfiKernels() and hash(KF) == hash(FfiKernels()) and KF != KX
    import pickle

    assert pickle.loads(pickle.dumps(KF)) == KF
    assert set(native.TARGETS) <= set(native.extension().registrations("cpu"))
    assert "cpu" in native.register()
    ext = native.extension()
    import moe_ep_native

    # The extension is compiled against the native core's header, and links the core itself.
    assert ext.abi_version() == ext.HEADER_ABI_VERSION == moe_ep_native.ABI_VERSION
    assert "moe_ep_native" in ext.build_info()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4"])
def test_formats_match_the_spec_bit_for_bit(fmt: str) -> None:
    golden, inputs = _format_inputs()
    quant = jax.jit(KF.quantize, static_argnums=(1, 2))
    dequant = jax.jit(KF.dequantize)
    for x in inputs:
        if fmt == "bf16":
            ours = quant(x, fmt, -1)
            assert ours.dtype == jnp.bfloat16 and ours.shape == x.shape
            bits = np.asarray(ours).view(np.uint16)
            assert np.array_equal(bits, np.asarray(jax.jit(KX.quantize, static_argnums=1)(x, fmt)).view(np.uint16))  # NaN payloads too
            spec = moe_ep_spec.formats.round_to_bf16(x)
            finite = ~np.isnan(x)
            assert np.array_equal(bits[finite], spec.view(np.uint16)[finite])
            assert np.array_equal(np.isnan(np.asarray(ours, np.float32)), np.isnan(x))
            continue
        for axis in (1, 0):
            ours = quant(x, fmt, axis)
            spec = spec_quantize(x, fmt, axis=axis)
            xla = jax.jit(KX.quantize, static_argnums=1)(x, fmt) if axis == 1 else None
            assert ours.data.dtype == np.dtype(spec.format.data_dtype) and ours.scale.dtype == spec.format.scale_dtype
            assert (ours.format, ours.n, ours.axis) == (spec.format, x.shape[axis], axis)
            assert np.array_equal(_codes(ours.data), spec.data_codes()), (fmt, axis, x.shape)
            assert np.array_equal(_codes(ours.scale), spec.scale_codes()), (fmt, axis, x.shape)
            if xla is not None:  # the protocol's last-axis encode: the XLA provider's exact result
                assert ours.data.dtype == xla.data.dtype and ours.scale.dtype == xla.scale.dtype
                assert np.array_equal(_codes(ours.data), _codes(xla.data)) and np.array_equal(_codes(ours.scale), _codes(xla.scale))
            decoded = np.asarray(dequant(ours))
            assert decoded.dtype == np.float32
            assert np.array_equal(decoded, spec.dequantize(np.float32), equal_nan=True)
    # the independent golden vectors, code by code
    rows = inputs[0]
    want = _golden_codes(golden, fmt)
    ours = quant(rows, fmt, -1)
    if fmt == "bf16":
        assert np.array_equal(np.asarray(ours).view(np.uint16), want[0])
    else:
        assert np.array_equal(_codes(ours.data), want[0]) and np.array_equal(_codes(ours.scale), want[1])


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_weights_blocked_along_axis_1_decode_and_encode_like_the_spec(fmt: str) -> None:
    rng = np.random.default_rng(3)
    for shape in ((3, 45, 7), (2, 64, 33), (1, 17, 1)):  # [E_local, n, inner]: odd n, partial blocks
        w = (rng.standard_normal(shape) * 10.0 ** rng.integers(-3, 3, (shape[0], 1, shape[2]))).astype(np.float32)
        w[0, 5, 0] = np.nan
        w[-1, -1, -1] = -np.inf
        spec = spec_quantize(w, fmt, axis=1)
        ours = jax.jit(KF.quantize, static_argnums=(1, 2))(w, fmt, 1)
        assert np.array_equal(_codes(ours.data), spec.data_codes()) and np.array_equal(_codes(ours.scale), spec.scale_codes())
        got = np.asarray(jax.jit(KF.dequantize)(F.from_numpy(spec)))
        assert np.array_equal(got, spec.dequantize(np.float32), equal_nan=True)
        assert np.array_equal(got, np.asarray(jax.jit(KX.dequantize)(F.from_numpy(spec))), equal_nan=True)


def test_every_code_decodes_like_the_spec() -> None:
    rng = np.random.default_rng(1)
    scales = np.array([0, 1, 2, 100, 127, 130, 200, 254, 255], dtype=np.uint8)
    data = np.tile(np.arange(256, dtype=np.uint8), (len(scales), 1))  # every E4M3 code under every scale
    mx = BlockScaledTensor(data=data.view(FLOAT8_E4M3), scale=np.repeat(scales[:, None], 8, axis=1).view(FLOAT8_E8M0),
                           format="mxfp8", shape=data.shape, axis=1)
    nv = BlockScaledTensor(data=rng.integers(0, 256, (256, 8), dtype=np.uint8),
                           scale=np.arange(256, dtype=np.uint8)[:, None].view(FLOAT8_E4M3), format="nvfp4", shape=(256, 16), axis=1)
    for t in (mx, nv):
        ours = np.asarray(jax.jit(KF.dequantize)(F.from_numpy(t)))
        assert np.array_equal(ours, spec_dequantize(t, np.float32), equal_nan=True), t.format


def test_plain_inputs_decode_with_astype_and_empty_tensors_run() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    for dt in (jnp.float32, jnp.float16, jnp.bfloat16):
        a = jnp.asarray(x, dt)
        got = KF.dequantize(a)
        assert got.dtype == jnp.float32 and np.array_equal(np.asarray(got), np.asarray(a.astype(jnp.float32)))
    for fmt in ("bf16", "mxfp8", "nvfp4"):  # run, not only traced: empty in, empty out
        e = jax.jit(KF.quantize, static_argnums=(1,))(jnp.zeros((0, 45), jnp.float32), fmt)
        d = jax.jit(KF.dequantize)(e)
        assert d.shape == (0, 45) and d.dtype == jnp.float32
    cfg = MoeEpConfig(num_experts=4, hidden=8, intermediate=4, num_topk=2, num_ranks=1)
    plan = KF.plan_routes(cfg, jnp.zeros((0, 2), jnp.int32))
    assert [getattr(plan, f).shape for f in _PLAN_FIELDS] == [(0,), (0,), (0,), (5,)]
    assert not np.asarray(plan.counts).any()
    assert KF.slot_sum(jnp.zeros((0, 8)), 0, 2).shape == (0, 8)
    assert KF.slot_sum(jnp.zeros((4, 0)), 2, 2).shape == (2, 0)


def test_plan_routes_is_identical_to_the_xla_provider() -> None:
    rng = np.random.default_rng(4)
    for t, k, e in ((1, 1, 1), (7, 2, 4), (16, 4, 8), (33, 3, 5), (64, 8, 16)):
        idx = rng.integers(-1, e, (t, k)).astype(np.int32)
        if t > 2:  # input errors: ids below -1 and at or above E are counted, never routed
            idx[1, 0], idx[2, k - 1] = -7, e + 3
            idx[0, 0] = e
        cfg = MoeEpConfig(num_experts=e, hidden=8, intermediate=4, num_topk=k, num_ranks=1)
        ours = jax.jit(partial(KF.plan_routes, cfg))(idx)
        want = jax.jit(partial(KX.plan_routes, cfg))(idx)
        for name in _PLAN_FIELDS:
            a, b = getattr(ours, name), getattr(want, name)
            assert a.dtype == jnp.int32 and a.shape == b.shape, name
            assert np.array_equal(np.asarray(a), np.asarray(b)), (name, t, k, e)
        bad = int(((idx < -1) | (idx >= e)).sum())
        assert int(ours.counts[e]) == bad and int(np.asarray(ours.counts[:e]).sum()) == int(((idx >= 0) & (idx < e)).sum())


def test_slot_sum_is_identical_to_the_xla_provider() -> None:
    rng = np.random.default_rng(5)
    for t, k, h in ((1, 1, 1), (9, 2, 32), (5, 8, 7)):
        rows = (rng.standard_normal((t * k, h)) * 1e3 ** rng.integers(-2, 3, (t * k, 1))).astype(np.float32)
        rows[0, 0] = -0.0
        if t * k > 3:
            rows[1, :2] = np.nan, np.inf
            rows[2, 0] = -np.inf
        ours = np.asarray(jax.jit(KF.slot_sum, static_argnums=(1, 2))(rows, t, k))
        want = np.asarray(jax.jit(KX.slot_sum, static_argnums=(1, 2))(rows, t, k))
        assert ours.dtype == np.float32 and ours.shape == (t, h)
        # equal values (NaN where NaN); zeros may differ in sign only: XLA's algebraic
        # simplifier folds the +0 start away (0 + x -> x), so a token whose slots all
        # hold -0 sums to -0 there, while the spec's ((+0 + Y0) + ...) gives +0
        assert np.array_equal(ours, want, equal_nan=True)
        nonzero = np.isfinite(want) & (want != 0)
        assert np.array_equal(ours[nonzero].view(np.uint32), want[nonzero].view(np.uint32))
        acc = np.zeros((t, h), np.float32)  # the spec in numpy: slot order from +0
        for s in range(k):
            acc = acc + rows.reshape(t, k, h)[:, s]
        finite = np.isfinite(acc)
        assert np.array_equal(ours[finite].view(np.uint32), acc[finite].view(np.uint32))  # bit for bit, zeros' signs too
        assert np.array_equal(np.isnan(ours), np.isnan(acc))
    # subnormal rows are summed exactly (the handler runs the core without flush-to-zero)
    tiny = np.full((4, 3), 2.0**-140, np.float32)
    got = np.asarray(KF.slot_sum(tiny, 2, 2))
    assert np.array_equal(got, np.full((2, 3), 2.0**-139, np.float32))


# ----------------------------------------------------------------------------- experts

_C, _H, _I, _EL = 24, 64, 32, 3
_GROUPS = np.array([5, 0, 11], np.int32)  # an empty expert; rows 16..23 belong to no expert
_INTER = [None, "bf16", "mxfp8", "nvfp4"]


def _expert_inputs(seed: int, fmt: str):
    rng = np.random.default_rng(seed)
    used = int(_GROUPS.sum())
    x = rng.standard_normal((_C, _H)).astype(np.float32)
    x[used:] = 0  # padding rows: zero tokens, weight 0
    w = rng.uniform(0.1, 1.0, _C).astype(np.float32)
    w[used:] = 0
    w1 = (rng.standard_normal((_EL, _H, 2 * _I)) / 8).astype(np.float32)
    w2 = (rng.standard_normal((_EL, _I, _H)) / 6).astype(np.float32)
    if fmt == "bf16":
        x, w1, w2 = (jnp.asarray(a, jnp.bfloat16) for a in (x, w1, w2))
    elif fmt in ("mxfp8", "nvfp4"):  # block-scaled along the reduction axes (tokens: H; FC1: H; FC2: I)
        x, w1, w2 = (F.from_numpy(spec_quantize(a, fmt, axis=1)) for a in (x, w1, w2))
    return x, jnp.asarray(w), w1, w2


def _close(name, got, want, rel=4e-6):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape, name
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = float(np.max(np.abs(got - want))) if got.size else 0.0
    assert err <= rel * scale, f"{name}: max |ffi - xla| = {err:.3g} > {rel:g} * {scale:.3g}"


def _close_bf16_operands(name, got, want, rel=4e-6):
    """:func:`_close` for the bf16-operand backward: a dc or w*h value within float32 noise of a
    bf16 tie may round to the other neighbour in the other provider (its float32 arithmetic
    differs in order), moving the elements it feeds (a row of dx, a column of dfc1) by a bf16
    step of one term: at most 10% of the elements may be off by more than ``rel`` (an operand
    left unrounded moves most of them), none by more than 2^-7 of the largest."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == np.float32 and got.shape == want.shape, name
    scale = max(float(np.max(np.abs(want))), 1e-30)
    err = np.abs(got.astype(np.float64) - want)
    off = float(np.mean(err > rel * scale)) if err.size else 0.0
    assert off <= 0.1, f"{name}: {off:.1%} of the elements differ by more than {rel:g} * {scale:.3g}"
    assert float(err.max(initial=0.0)) <= 2.0**-7 * scale, f"{name}: max |ffi - xla| = {err.max():.3g}"


# Every input format x router-weight placement x clamp; the intermediate format
# runs through all four so that every (intermediate, placement, clamp) triple is
# covered too (f + a + 2c is a bijection over f for each (a, c)).
_EXPERT_CASES = [
    (fmt, apply, clamp, _INTER[(f + a + 2 * c) % 4])
    for (f, fmt), (a, apply), (c, clamp) in itertools.product(
        enumerate(["fp32", "bf16", "mxfp8", "nvfp4"]), enumerate([True, False]), enumerate([None, 0.75])
    )
]


# The bf16-operand backward (backward_operand_format "bf16") on a few of them: both placements,
# with and without the clamp, plain and block-scaled inputs.
_BF16_BACKWARD_CASES = [(c, "bf16") for c in _EXPERT_CASES if c[0] in ("fp32", "mxfp8") and c[2] is None] + [
    (c, "bf16") for c in _EXPERT_CASES if c[0] == "bf16" and c[2] is not None]


@pytest.mark.parametrize("case,mode", [(c, None) for c in _EXPERT_CASES] + _BF16_BACKWARD_CASES)
def test_expert_forward_and_backward_match_the_xla_provider(case, mode) -> None:
    fmt, apply, clamp, inter = case
    cfg = MoeEpConfig(num_experts=_EL, hidden=_H, intermediate=_I, num_topk=2, num_ranks=1,
                      apply_topk_in_fc1=apply, gate_up_clamp=clamp, intermediate_format=inter,
                      backward_operand_format=mode)
    x, w, w1, w2 = _expert_inputs(6, fmt)
    dy = jnp.asarray(np.random.default_rng(7).standard_normal((_C, _H)).astype(np.float32))

    def fwd_bwd(kern, x, w, w1, w2, gs, dy):
        y, c = kern.expert_forward(cfg, x, w, w1, w2, gs)
        return (y, c), kern.expert_backward(cfg, x, w, w1, w2, F.round_to_bf16(c), dy, gs)

    (y, c), grads = _run(partial(fwd_bwd, KF), x, w, w1, w2, _GROUPS, dy)
    (y_x, c_x), grads_x = _run(partial(fwd_bwd, KX), x, w, w1, w2, _GROUPS, dy)
    _close("y", y, y_x)
    assert c.dtype == jnp.bfloat16  # the stash itself, from the layer object's epilogue
    _close("c (the stash)", np.asarray(c, np.float32), c_x, rel=2.0**-8)  # bf16 rounding + float32 rounding
    for name, a, b in zip(("dx", "dw", "dfc1", "dfc2"), grads, grads_x):
        if mode is None:
            _close(name, a, b)
        else:
            _close_bf16_operands(name, a, b)
    used = int(_GROUPS.sum())  # rows of no expert: exact zeros
    assert not np.asarray(y[used:]).any() and not np.asarray(c[used:]).any()
    assert not np.asarray(grads[0][used:]).any() and not np.asarray(grads[1][used:]).any()
    assert not np.asarray(grads[2][1]).any() and not np.asarray(grads[3][1]).any()  # the empty expert


# ----------------------------------------------------------------------------- block-scaled operands in bf16

#: An mxfp8 value bf16 cannot hold: E4M3 3 * 2^-9 at scale code 0 is 3 * 2^-136, not a
#: multiple of bf16's smallest subnormal 2^-133 (a block of such values gets scale code 0).
_TINY = np.float32(3 * 2.0**-136)


def test_dequantize_bf16_is_exact_or_nan_with_the_flag() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    for fmt in ("mxfp8", "nvfp4"):
        t = F.from_numpy(spec_quantize(x, fmt, axis=1))
        values, inexact = _run(KF.dequantize_bf16, t)
        assert values.dtype == jnp.bfloat16 and not bool(inexact), fmt
        want = np.asarray(spec_dequantize(spec_quantize(x, fmt, axis=1)), np.float32)
        assert np.array_equal(np.asarray(values, np.float32), want), f"{fmt}: exact bf16 values"
    x[2, :32] = _TINY  # one block of values bf16 cannot hold
    t = F.from_numpy(spec_quantize(x, "mxfp8", axis=1))
    assert int(np.asarray(t.scale, np.float32).reshape(6, 2)[2, 0] == 2.0**-127) == 1  # scale code 0
    values, inexact = _run(KF.dequantize_bf16, t)
    got = np.asarray(values, np.float32)
    assert bool(inexact)
    assert np.isnan(got[2, :32]).all() and np.isnan(got).sum() == 32, "exactly the values bf16 cannot hold are NaN"
    want = np.asarray(spec_dequantize(spec_quantize(x, "mxfp8", axis=1)), np.float32)
    ok = ~np.isnan(got)
    assert np.array_equal(got[ok], want[ok])
    with _raises("moe_ep_dequantize_bf16: attribute format must be 2 (mxfp8) or 3 (nvfp4); got 1"):
        _ffi("moe_ep_dequantize_bf16", [_sds((6, 64, 1), jnp.uint16), _sds((1,), jnp.int32)],
             jnp.zeros((6, 64, 1), jnp.uint16), jnp.zeros((6, 0, 1), jnp.uint8), jnp.zeros((1,), jnp.int32),
             format=np.int32(1), n=64)


@pytest.mark.parametrize("where", ["x", "fc1"])
def test_block_scaled_operands_run_in_bf16_and_fall_back_to_float32_when_bf16_cannot_hold_them(where) -> None:
    """mxfp8 inputs decode to bf16 operands (the tensor-core path on CUDA); a value bf16
    cannot hold makes the call take float32 operands instead (lax.cond on the decode's
    flag): the results equal the float32 operands' and hold no NaN."""
    cfg = MoeEpConfig(num_experts=_EL, hidden=_H, intermediate=_I, num_topk=2, num_ranks=1)
    x, w, w1, w2 = _expert_inputs(6, "fp32")
    x, w1, w2 = np.asarray(x), np.asarray(w1), np.asarray(w2)
    if where == "x":
        x = x.copy()
        x[1, :32] = _TINY
    else:
        w1 = w1.copy()
        w1[0, :32, 3] = _TINY  # fc1 [E, H, 2I] blocked along H
    enc = [F.from_numpy(spec_quantize(a, "mxfp8", axis=1)) for a in (x, w1, w2)]
    dec = [jnp.asarray(spec_dequantize(spec_quantize(a, "mxfp8", axis=1)), jnp.float32) for a in (x, w1, w2)]
    dy = jnp.asarray(np.random.default_rng(7).standard_normal((_C, _H)).astype(np.float32))

    def fwd_bwd(x, w, w1, w2, gs, dy):
        y, c = KF.expert_forward(cfg, x, w, w1, w2, gs)
        return (y, c), KF.expert_backward(cfg, x, w, w1, w2, F.round_to_bf16(c), dy, gs)

    (y, c), grads = _run(fwd_bwd, *enc[:1], w, *enc[1:], _GROUPS, dy)
    (y_f, c_f), grads_f = _run(fwd_bwd, dec[0], w, dec[1], dec[2], _GROUPS, dy)
    for name, a, b in (("y", y, y_f), ("c", c, c_f)) + tuple(zip(("dx", "dw", "dfc1", "dfc2"), grads, grads_f)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert not np.isnan(a).any(), f"{name}: a NaN of the bf16 decode reached the result"
        assert np.array_equal(a, b), f"{name}: the fallback must give the float32 operands' numbers"
    text = jax.jit(lambda x, w, w1, w2, gs: KF.expert_forward(cfg, x, w, w1, w2, gs)).lower(
        enc[0], w, enc[1], enc[2], _GROUPS).as_text()
    assert "moe_ep_dequantize_bf16" in text and ("cond" in text or "case" in text), "bf16 decode, then a choice"


# ----------------------------------------------------------------------------- handlers reject bad sizes


def _raises(match: str):
    return pytest.raises(Exception, match=re.escape(match))


def test_format_handlers_reject_bad_shapes_and_attributes() -> None:
    x = jnp.ones((2, 45, 1), jnp.float32)
    u8, u16 = jnp.uint8, jnp.uint16
    good = [_sds((2, 45, 1), u8), _sds((2, 2, 1), u8)]
    data, scale = _ffi("moe_ep_quantize", good, x, format=np.int32(2))  # mxfp8: fine
    assert data.shape == (2, 45, 1)
    with _raises("moe_ep_quantize: attribute format must be 1 (bf16), 2 (mxfp8) or 3 (nvfp4); got 7"):
        _ffi("moe_ep_quantize", good, x, format=np.int32(7))
    with _raises("moe_ep_quantize: x must have rank 3 [outer, n, inner]; got rank 2, shape [2, 45]"):
        _ffi("moe_ep_quantize", good, x[:, :, 0], format=np.int32(2))
    with _raises("moe_ep_quantize: scale must have shape [outer, ceil(n/32), inner] for mxfp8 = [2, 2, 1]; got [2, 1, 1]"):
        _ffi("moe_ep_quantize", [good[0], _sds((2, 1, 1), u8)], x, format=np.int32(2))
    with _raises("moe_ep_quantize: data must have shape [outer, ceil(n/2), inner] for nvfp4 = [2, 23, 1]; got [2, 45, 1]"):
        _ffi("moe_ep_quantize", [good[0], _sds((2, 3, 1), u8)], x, format=np.int32(3))
    with _raises("moe_ep_quantize: data must have dtype uint16 for format 1 (bf16); got uint8"):
        _ffi("moe_ep_quantize", [good[0], _sds((2, 0, 1), u8)], x, format=np.int32(1))
    with _raises("moe_ep_quantize: scale must have shape [outer, 0, inner] for bf16 (no scale) = [2, 0, 1]; got [2, 2, 1]"):
        _ffi("moe_ep_quantize", [_sds((2, 45, 1), u16), _sds((2, 2, 1), u8)], x, format=np.int32(1))
    out = _ffi("moe_ep_dequantize", [_sds((2, 45, 1), jnp.float32)], data, scale, format=np.int32(2), n=45)
    assert out[0].shape == (2, 45, 1)
    with _raises("moe_ep_dequantize: out must have shape [outer, n, inner] (n: attribute) = [2, 44, 1]; got [2, 45, 1]"):
        _ffi("moe_ep_dequantize", [_sds((2, 45, 1), jnp.float32)], data, scale, format=np.int32(2), n=44)
    with _raises("moe_ep_dequantize: attribute n must be >= 0; got -1"):
        _ffi("moe_ep_dequantize", [_sds((2, 45, 1), jnp.float32)], data, scale, format=np.int32(2), n=-1)
    with _raises("moe_ep_dequantize: data must have shape [outer, n, inner] = [2, 45, 1]; got [2, 44, 1]"):
        _ffi("moe_ep_dequantize", [_sds((2, 45, 1), jnp.float32)], data[:, :44], scale, format=np.int32(2), n=45)
    with _raises("moe_ep_dequantize: data must have dtype uint8 for format 3 (nvfp4); got float32"):
        _ffi("moe_ep_dequantize", [_sds((2, 45, 1), jnp.float32)], x, scale, format=np.int32(3), n=45)


@on_cpu
def test_routing_handlers_reject_bad_shapes_and_report_the_cores_errors() -> None:
    idx = jnp.asarray(np.array([[0, 1], [2, -1], [3, 3]], np.int32))
    i32 = jnp.int32
    res = [_sds((6,), i32)] * 3 + [_sds((5,), i32)]
    _ffi("moe_ep_plan_routes", res, idx, num_experts=4)
    with _raises("moe_ep_plan_routes: counts must have shape [num_experts + 1] = [5]; got [4]"):
        _ffi("moe_ep_plan_routes", res[:3] + [_sds((4,), i32)], idx, num_experts=4)
    with _raises("moe_ep_plan_routes: route_pos must have shape [T * K] = [6]; got [5]"):
        _ffi("moe_ep_plan_routes", [res[0], _sds((5,), i32), res[2], res[3]], idx, num_experts=4)
    with _raises("moe_ep_plan_routes: attribute num_experts must be >= 1; got 0"):
        _ffi("moe_ep_plan_routes", [res[0]] * 3 + [_sds((1,), i32)], idx, num_experts=0)
    with _raises("moe_ep_plan_routes: topk_idx must have rank 2 [T, K]; got rank 1, shape [6]"):
        _ffi("moe_ep_plan_routes", res, idx.reshape(-1), num_experts=4)

    rows = jnp.ones((6, 8), jnp.float32)
    (s,) = _ffi("moe_ep_slot_sum", [_sds((3, 8), jnp.float32)], rows, num_topk=2)
    assert np.array_equal(np.asarray(s), np.full((3, 8), 2.0, np.float32))
    with _raises("moe_ep_slot_sum: rows must have shape [T * K, H] (T: out's rows, K: attribute num_topk) = [9, 8]; got [6, 8]"):
        _ffi("moe_ep_slot_sum", [_sds((3, 8), jnp.float32)], rows, num_topk=3)
    with _raises("moe_ep_slot_sum: out must have shape [T, H] (H: rows' width) = [3, 8]; got [3, 7]"):
        _ffi("moe_ep_slot_sum", [_sds((3, 7), jnp.float32)], rows, num_topk=2)
    with _raises("moe_ep_slot_sum: attribute num_topk must be >= 1; got 0"):
        _ffi("moe_ep_slot_sum", [_sds((3, 8), jnp.float32)], rows, num_topk=0)

    # combine_reduce with route positions: the sum, then a data error the core rejects
    vals = jnp.asarray(np.arange(24, dtype=np.float32).reshape(4, 6))
    pos = jnp.asarray(np.array([2, -1, 0, 3], np.int32))  # token 0: row 2; token 1: rows 0, 3
    (out,) = _ffi("moe_ep_combine_reduce", [_sds((2, 6), jnp.float32)], vals, pos, num_topk=2, round_trip=np.int32(0))
    v = np.asarray(vals)
    assert np.array_equal(np.asarray(out), np.stack([0 + v[2], (0 + v[0]) + v[3]]))
    with _raises("moe_ep_combine_reduce: route_pos[3] must be -1 or in [0, num_rows) = [0, 4); got 9 [MOE_EP_ERR_INVALID_ARGUMENT]"):
        _ffi("moe_ep_combine_reduce", [_sds((2, 6), jnp.float32)], vals, pos.at[3].set(9), num_topk=2, round_trip=np.int32(0))
    with _raises("[MOE_EP_ERR_INVALID_ARGUMENT]"):
        _ffi("moe_ep_combine_reduce", [_sds((2, 6), jnp.float32)], vals, pos.at[0].set(-2), num_topk=2, round_trip=np.int32(0))
    with _raises("moe_ep_combine_reduce: route_pos must have shape [T * K] (T: out's rows) = [6]; got [4]"):
        _ffi("moe_ep_combine_reduce", [_sds((3, 6), jnp.float32)], vals, pos, num_topk=2, round_trip=np.int32(0))
    # bf16 rows are read as they are: the sums of their float32 values, bit for bit
    rows16 = jnp.asarray(np.random.default_rng(3).standard_normal((4, 16)), jnp.bfloat16)
    (o16,) = _ffi("moe_ep_combine_reduce", [_sds((2, 16), jnp.float32)], rows16, pos, num_topk=2, round_trip=np.int32(0))
    (o32,) = _ffi("moe_ep_combine_reduce", [_sds((2, 16), jnp.float32)], rows16.astype(jnp.float32), pos, num_topk=2, round_trip=np.int32(0))
    assert np.asarray(o16).tobytes() == np.asarray(o32).tobytes()
    with _raises("moe_ep_combine_reduce: rows must have dtype float32 or bfloat16; got float16"):
        _ffi("moe_ep_combine_reduce", [_sds((2, 6), jnp.float32)], vals.astype(jnp.float16), pos, num_topk=2, round_trip=np.int32(0))
    # round_trip: each row read through a block format's round trip, as the spec's encode and decode
    rows32 = jnp.asarray(np.random.default_rng(5).standard_normal((4, 64)) * 3.0, jnp.float32)
    for fmt, code in (("mxfp8", 2), ("nvfp4", 3)):
        (rt,) = _ffi("moe_ep_combine_reduce", [_sds((2, 64), jnp.float32)], rows32, pos, num_topk=2,
                     round_trip=np.int32(code))
        rounded = spec_dequantize(spec_quantize(np.asarray(rows32), fmt, axis=-1)).astype(np.float32)
        assert np.asarray(rt).tobytes() == np.stack([0 + rounded[2], (0 + rounded[0]) + rounded[3]]).tobytes(), fmt
    with _raises("moe_ep_combine_reduce: attribute round_trip must be 0 (none), 2 (mxfp8) or 3 (nvfp4); got 1"):
        _ffi("moe_ep_combine_reduce", [_sds((2, 64), jnp.float32)], rows32, pos, num_topk=2, round_trip=np.int32(1))
    with _raises("moe_ep_combine_reduce: rows must have dtype float32 when round_trip is set (the unrounded expert "
                 "outputs); got bfloat16"):
        _ffi("moe_ep_combine_reduce", [_sds((2, 16), jnp.float32)], rows16, pos, num_topk=2, round_trip=np.int32(2))

    # combine_reduce_encode: the sums (round trip as above), NaN on the error flag, the encode
    no, yes = jnp.asarray(False), jnp.asarray(True)
    for rt_code, rt_name in ((0, None), (2, "mxfp8"), (3, "nvfp4")):
        for fmt, code in (("mxfp8", 2), ("nvfp4", 3)):
            for flag in (no, yes):
                data_w = 32 if fmt == "nvfp4" else 64
                data, scale = _ffi("moe_ep_combine_reduce_encode", [_sds((2, data_w), jnp.uint8), _sds((2, 64 // (32 if fmt == "mxfp8" else 16)), jnp.uint8)],
                                   rows32, pos, flag, num_topk=2, round_trip=np.int32(rt_code), out_format=np.int32(code))
                sums = np.asarray(_ffi("moe_ep_combine_reduce", [_sds((2, 64), jnp.float32)], rows32, pos, num_topk=2,
                                       round_trip=np.int32(rt_code))[0])
                want = spec_quantize(np.full_like(sums, np.nan) if bool(flag) else sums, fmt, axis=-1)
                assert np.asarray(data).tobytes() == np.asarray(want.data).view(np.uint8).tobytes(), (rt_name, fmt, flag)
                assert np.asarray(scale).tobytes() == np.asarray(want.scale).view(np.uint8).tobytes(), (rt_name, fmt, flag)
    (b16, _) = _ffi("moe_ep_combine_reduce_encode", [_sds((2, 16), jnp.uint16), _sds((2, 0), jnp.uint8)], rows16, pos, no,
                    num_topk=2, round_trip=np.int32(0), out_format=np.int32(1))
    assert np.asarray(b16).tobytes() == np.asarray(o32).astype(jnp.bfloat16).tobytes()
    with _raises("moe_ep_combine_reduce_encode: attribute out_format must be 1 (bf16), 2 (mxfp8) or 3 (nvfp4); got 0"):
        _ffi("moe_ep_combine_reduce_encode", [_sds((2, 64), jnp.uint8), _sds((2, 2), jnp.uint8)], rows32, pos, no,
             num_topk=2, round_trip=np.int32(0), out_format=np.int32(0))
    with _raises("moe_ep_combine_reduce_encode: scale must have shape [T, ceil(H/B)] (B: the block; 0 for bf16) = [2, 2]; "
                 "got [2, 4]"):
        _ffi("moe_ep_combine_reduce_encode", [_sds((2, 64), jnp.uint8), _sds((2, 4), jnp.uint8)], rows32, pos, no,
             num_topk=2, round_trip=np.int32(0), out_format=np.int32(2))
    with _raises("moe_ep_combine_reduce_encode: error must hold one element (the layer's error flag); got [2]"):
        _ffi("moe_ep_combine_reduce_encode", [_sds((2, 64), jnp.uint8), _sds((2, 2), jnp.uint8)], rows32, pos,
             jnp.zeros((2,), jnp.bool_), num_topk=2, round_trip=np.int32(0), out_format=np.int32(2))
    with _raises("moe_ep_combine_reduce_encode: rows must have dtype float32 when round_trip is set"):
        _ffi("moe_ep_combine_reduce_encode", [_sds((2, 16), jnp.uint8), _sds((2, 0), jnp.uint8)], rows16, pos, no,
             num_topk=2, round_trip=np.int32(2), out_format=np.int32(1))

    # permute_rows: rows in send order, codes unchanged, -1 gives a zero row
    tokens = jnp.asarray(np.arange(12, dtype=np.uint8).reshape(3, 4))
    route = jnp.asarray(np.array([5, -1, 0, 3], np.int32))
    (dst,) = _ffi("moe_ep_permute_rows", [_sds((4, 4), jnp.uint8)], tokens, route, num_topk=2)
    t = np.asarray(tokens)
    assert np.array_equal(np.asarray(dst), np.stack([t[2], np.zeros(4, np.uint8), t[0], t[1]]))
    with _raises("moe_ep_permute_rows: dst must have dtype uint8 (the dtype of tokens); got int32"):
        _ffi("moe_ep_permute_rows", [_sds((4, 4), jnp.int32)], tokens, route, num_topk=2)
    with _raises("moe_ep_permute_rows: send_route[0] must be -1 or in [0, 6); got 6"):
        _ffi("moe_ep_permute_rows", [_sds((4, 4), jnp.uint8)], tokens, route.at[0].set(6), num_topk=2)


@on_cpu
def test_expert_handlers_reject_bad_shapes_and_report_the_cores_errors() -> None:
    c, h, i, el = 8, 16, 4, 2
    f32, bf16 = jnp.float32, jnp.bfloat16
    x, w = jnp.ones((c, h), f32), jnp.ones((c,), f32)
    w1, w2 = jnp.ones((el, h, 2 * i), f32) / 8, jnp.ones((el, i, h), f32) / 8
    gs = jnp.asarray(np.array([3, 2], np.int32))
    attrs = dict(apply_topk_in_fc1=True, has_clamp=False, gate_up_clamp=np.float32(0), intermediate_format=np.int32(0),
                 combine_format=np.int32(0), backward_operand_format=np.int32(0))
    res = [_sds((c, h), f32), _sds((c, 2 * i), bf16)]
    y, stash = _ffi("moe_ep_expert_forward", res, x, w, w1, w2, gs, **attrs)
    assert y.shape == (c, h) and not np.asarray(y[5:]).any() and stash.dtype == bf16
    fwd = partial(_ffi, "moe_ep_expert_forward")
    with _raises("moe_ep_expert_forward: fc2 must have shape [E_local, I, H] (from fc1) = [2, 4, 16]; got [2, 5, 16]"):
        fwd(res, x, w, w1, jnp.ones((el, i + 1, h), f32), gs, **attrs)
    with _raises("moe_ep_expert_forward: fc1's last axis (2I: gate then up columns) must be even and >= 2; got [2, 16, 7]"):
        fwd(res, x, w, w1[:, :, :7], w2, gs, **attrs)
    with _raises("moe_ep_expert_forward: w must have shape [C] (C: x's rows) = [8]; got [7]"):
        fwd(res, x, w[:7], w1, w2, gs, **attrs)
    with _raises("moe_ep_expert_forward: group_sizes must have shape [E_local] (from fc1) = [2]; got [3]"):
        fwd(res, x, w, w1, w2, jnp.zeros((3,), jnp.int32), **attrs)
    with _raises("moe_ep_expert_forward: fc1_c must have shape [C, 2I], or [0, 2I] for no stash = [8, 8]; got [8, 4]"):
        fwd([res[0], _sds((c, i), bf16)], x, w, w1, w2, gs, **attrs)
    with _raises("moe_ep_expert_forward: fc1_c must have shape [C, 2I], or [0, 2I] for no stash = [0, 8]; got [0, 4]"):
        fwd([res[0], _sds((0, i), bf16)], x, w, w1, w2, gs, **attrs)
    y0, none = fwd([res[0], _sds((0, 2 * i), bf16)], x, w, w1, w2, gs, **attrs)  # no stash asked for: the same y
    assert none.shape == (0, 2 * i) and np.asarray(y0).tobytes() == np.asarray(y).tobytes()
    with _raises("moe_ep_expert_forward: attribute intermediate_format must be 0 (none), 1 (bf16), 2 (mxfp8) or 3 (nvfp4); got 9"):
        fwd(res, x, w, w1, w2, gs, **{**attrs, "intermediate_format": np.int32(9)})
    # the layer's operands: one dtype, float32 or bfloat16
    with _raises("moe_ep_expert_forward: fc1 must have dtype float32 (the dtype of x: the layer's operand dtype); got bfloat16"):
        fwd(res, x, w, w1.astype(bf16), w2, gs, **attrs)
    with _raises("moe_ep_expert_forward: x must have dtype float32 or bfloat16; got float16"):
        fwd(res, x.astype(jnp.float16), w, w1.astype(jnp.float16), w2.astype(jnp.float16), gs, **attrs)
    with _raises("Wrong buffer dtype"):  # the stash result is bf16 (XLA's own binding check)
        fwd([res[0], _sds((c, 2 * i), f32)], x, w, w1, w2, gs, **attrs)
    # y is bf16 exactly when the combine format is bf16 (its rows are bf16 values)
    comb_bf16 = {**attrs, "combine_format": np.int32(1)}
    y16, _ = fwd([_sds((c, h), bf16), res[1]], x, w, w1, w2, gs, **comb_bf16)
    y32, _ = fwd(res, x, w, w1, w2, gs, **comb_bf16 | {"combine_format": np.int32(0)})
    assert np.asarray(y16.astype(f32)).tobytes() == np.asarray(y32.astype(bf16).astype(f32)).tobytes()
    with _raises("moe_ep_expert_forward: y must have dtype bfloat16 when combine_format is 1 (bf16: its rows are bf16 "
                 "values); got float32"):
        fwd(res, x, w, w1, w2, gs, **comb_bf16)
    with _raises("moe_ep_expert_forward: y must have dtype float32 unless combine_format is 1 (bf16); got bfloat16"):
        fwd([_sds((c, h), bf16), res[1]], x, w, w1, w2, gs, **{**attrs, "combine_format": np.int32(2)})
    # the core's own checks: a data error and a bad description, with its message
    with _raises("moe_ep_expert_forward: group_sizes[1] must be >= 0; got -3") as err:
        fwd(res, x, w, w1, w2, jnp.asarray(np.array([3, -3], np.int32)), **attrs)
    assert str(err.value).count("moe_ep_expert_forward") >= 1 and "MOE_EP_ERR_INVALID_ARGUMENT" in str(err.value)
    with _raises("sum(group_sizes) must be <= num_rows = 8; got 9"):
        fwd(res, x, w, w1, w2, jnp.asarray(np.array([4, 5], np.int32)), **attrs)
    with _raises("gate_up_clamp must be finite and > 0 when"):
        fwd(res, x, w, w1, w2, gs, **{**attrs, "has_clamp": True})
    with _raises("moe_ep_expert_forward: backward_operand_format must be 0 (exact) or 1 (bf16); got 2"):
        fwd(res, x, w, w1, w2, gs, **{**attrs, "backward_operand_format": np.int32(2)})

    bres = [_sds((c, h), f32), _sds((c,), f32), _sds((el, h, 2 * i), f32), _sds((el, i, h), f32)]
    dx, dw, d1, d2 = _ffi("moe_ep_expert_backward", bres, x, w, w1, w2, stash, x, gs, **attrs)
    assert dx.shape == (c, h) and d1.shape == (el, h, 2 * i)
    # a bf16 cotangent enters as is: the same gradients as its float32 value (exact on the CPU)
    got = _ffi("moe_ep_expert_backward", bres, x, w, w1, w2, stash, x.astype(bf16), gs, **attrs)
    for a, b in zip(got, (dx, dw, d1, d2)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    bwd = partial(_ffi, "moe_ep_expert_backward")
    with _raises("moe_ep_expert_backward: fc1_c must have shape [C, 2I] = [8, 8]; got [8, 4]"):
        bwd(bres, x, w, w1, w2, stash[:, :4], x, gs, **attrs)
    with _raises("moe_ep_expert_backward: dfc2 must have shape [E_local, I, H] = [2, 4, 16]; got [2, 16, 4]"):
        bwd(bres[:3] + [_sds((el, h, i), f32)], x, w, w1, w2, stash, x, gs, **attrs)
    with _raises("moe_ep_expert_backward: dy must have dtype float32 or bfloat16; got float16"):
        bwd(bres, x, w, w1, w2, stash, x.astype(jnp.float16), gs, **attrs)
    with _raises("Wrong buffer dtype"):  # fc1_c must be the bf16 stash (XLA's own binding check)
        bwd(bres, x, w, w1, w2, stash.astype(f32), x, gs, **attrs)


@on_cpu
def test_expert_handlers_keep_one_layer_object_per_configuration_and_device() -> None:
    """The handlers run the layer object's stages: one layer per (configuration,
    device, operand dtype), made on first use and grown (never per call);
    bf16 operands give a bf16 layer, everything else a float32 one. At one rank
    the forward the jax layer runs (y after the combine round trip) and the
    backward share it."""
    cfg = MoeEpConfig(num_experts=_EL, hidden=_H, intermediate=40, num_topk=2, num_ranks=1, gate_up_clamp=0.5)
    _, w, _, _ = _expert_inputs(21, "fp32")
    rng = np.random.default_rng(22)
    w1 = jnp.asarray((rng.standard_normal((_EL, _H, 80)) / 8).astype(np.float32))
    w2 = jnp.asarray((rng.standard_normal((_EL, 40, _H)) / 6).astype(np.float32))

    def mine():
        return [r for r in native.extension().layer_cache_info() if (r["hidden"], r["intermediate"], r["num_local_experts"]) == (_H, 40, _EL)]

    def step(x, w, w1, w2, gs):
        y, c = KF.expert_forward_combined(cfg, x, w, w1, w2, gs)
        return KF.expert_backward(cfg, x, w, w1, w2, c, y, gs)

    x = jnp.asarray(rng.standard_normal((_C, _H)).astype(np.float32))
    for _ in range(2):
        _run(step, x, w, w1, w2, _GROUPS)
    for _ in range(2):
        _run(step, x.astype(jnp.bfloat16), w, w1.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), _GROUPS)
    live = [r for r in mine() if r["live"]]
    assert sorted(r["operand_dtype"] for r in live) == ["bfloat16", "float32"], mine()
    assert all(r["max_rows"] == _C and r["with_backward"] and r["device"] == "cpu" for r in live), live
    assert all(r["combine_format"] == 1 for r in live), live  # bf16 (code 1): the forward's round trip
    made = len(mine())
    _run(step, x, w, w1, w2, _GROUPS)  # again: no new layer
    assert len(mine()) == made
    big = jnp.concatenate([x, x])  # more rows: a larger layer replaces the float32 one
    _run(step, big, jnp.concatenate([w, w]), w1, w2, _GROUPS)
    live = [r for r in mine() if r["live"] and r["operand_dtype"] == "float32"]
    assert len(mine()) == made + 1 and [r["max_rows"] for r in live] == [2 * _C]


# ----------------------------------------------------------------------------- the layer


def test_a_receive_overflow_poisons_the_output_with_nan_as_the_xla_provider_does() -> None:
    """recv_capacity below the routes received: the layer's error flag makes every
    output NaN; the native kernels must run on the cut slabs, not fail."""
    rows = 4
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=1, max_tokens_per_rank=rows,
                         recv_capacity=3)
    world = random_world(config.replace(recv_capacity=None), num_tokens=rows, input_format="fp32", seed=5)
    mesh = _mesh(1)
    args = _world_args(mesh, world, rows)
    routed = int((np.asarray(world[0].topk_idx) >= 0).sum())
    assert routed > 3, "the case must overflow the receive buffer"
    for kernels in (KX, KF):
        fwd = jax.shard_map(partial(A.moe_ep, config=config, kernels=kernels), mesh=mesh, in_specs=P("ep"),
                            out_specs=P("ep"))
        out = np.asarray(_run(fwd, *args)).astype(np.float32)
        assert np.isnan(out).all(), f"{type(kernels).__name__}: an overflow must poison every output with NaN"


@needs2
def test_the_layer_calls_the_native_targets_with_the_same_collectives() -> None:
    n, rows = 2, 4
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows,
                         combine_format="mxfp8", intermediate_format="nvfp4")
    world = random_world(config, num_tokens=rows, input_format="mxfp8", weight_format="fp32", seed=11)
    mesh = _mesh(n)
    args = [  # the block-scaled activation, every rank padded with zero codes
        F.BlockScaled(_put(mesh, [w.activation.data for w in world], rows), _put(mesh, [w.activation.scale for w in world], rows),
                      "mxfp8", config.hidden, 1),
    ] + _world_args(mesh, world, rows, skip_activation=True)

    def fwd(kernels):
        return jax.shard_map(partial(A.moe_ep, config=config, kernels=kernels), mesh=mesh, in_specs=P("ep"),
                             out_specs=P("ep"))

    text = _compile(fwd(KF), *args).as_text()
    for target in ("moe_ep_plan_routes", "moe_ep_dequantize", "moe_ep_expert_forward", "moe_ep_quantize", "moe_ep_slot_sum"):
        assert f'custom_call_target="{target}"' in text, target
    # exactly the collectives of the XLA-native provider (the exchange is the layer's, not the kernels')
    want = _collectives(_compile(fwd(KX), *args).as_text())
    assert _collectives(text) == want
    if PLATFORM == "cpu":
        assert want == Counter({"all-gather": 1, "all-to-all": 2})

    plain = random_world(config.replace(combine_format="bf16", intermediate_format=None), num_tokens=rows,
                         input_format="fp32", seed=12)
    pargs = _world_args(mesh, plain, rows)
    cfg = config.replace(combine_format="bf16", intermediate_format=None)

    def train(kernels):
        def step(x, w1, w2, idx, tw):
            out, pull = jax.vjp(lambda x, w1, w2, tw: A.moe_ep(x, w1, w2, idx, tw, config=cfg, kernels=kernels),
                                x, w1, w2, tw)
            return out, pull(out)

        return jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))

    text = _compile(train(KF), *pargs).as_text()
    assert 'custom_call_target="moe_ep_expert_backward"' in text
    want = _collectives(_compile(train(KX), *pargs).as_text())
    assert _collectives(text) == want
    if PLATFORM == "cpu":
        assert want == Counter({"all-gather": 1, "all-to-all": 4})


@needs2
@pytest.mark.parametrize("mode", [None, "bf16"], ids=["exact", "bf16_operands"])
@pytest.mark.parametrize("weights_in", ["fc1", "fc2"])
def test_jax_grad_with_the_native_kernels_equals_the_spec_backward(weights_in: str, mode) -> None:
    n, rows, counts = 2, 6, [5, 2]
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows,
                         gate_up_clamp=0.75, apply_topk_in_fc1=weights_in == "fc1", backward_operand_format=mode)
    cfg_c = config.replace(generate_c=True)
    world = random_world(config, num_tokens=counts, input_format="fp32", seed=13, routing="unused_mixed")
    rng = np.random.default_rng(14)
    gy = [rng.standard_normal((t, config.hidden)).astype(np.float32).astype(BF16).astype(np.float32) for t in counts]
    mesh = _mesh(n)
    args = _world_args(mesh, world, rows) + [_put(mesh, gy, rows)]

    @partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def step(x, w1, w2, idx, tw, g):
        def loss(x, w1, w2, tw):
            return jnp.sum(A.moe_ep(x, w1, w2, idx, tw, config=config, kernels=KF).astype(jnp.float32) * g)

        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w1, w2, tw)
        _, c, meta = A.moe_ep(x, w1, w2, idx, tw, config=cfg_c, kernels=KF)
        return grads, c, meta

    (gx, g1, g2, gw), c, meta = _run(step, *args)
    cap = c.shape[0] // n
    stash = []
    for r in range(n):
        m = np.asarray(meta[r * cap : (r + 1) * cap])
        keep = int((m[:, 0] >= 0).sum())
        stash.append(Stash(np.asarray(c[r * cap : r * cap + keep]), m[:keep].astype(np.int32)))
    want, budget = REF.backward(cfg_c, world, gy, stash), REF.backward_budget(cfg_c, world, gy, stash)
    el = config.num_local_experts
    for r, t in enumerate(counts):
        got = {
            "grad_activation": np.asarray(gx[r * rows : r * rows + t]),
            "grad_fc1_weight": np.asarray(g1[r * el : (r + 1) * el]),
            "grad_fc2_weight": np.asarray(g2[r * el : (r + 1) * el]),
            "grad_topk_weights": np.asarray(gw[r * rows : r * rows + t]),
        }
        for name, value in got.items():
            c_ = compare(f"rank {r} {name}", value, getattr(want[r], name), getattr(budget[r], name))
            assert c_.ok, c_.describe()
        assert not np.asarray(gx[r * rows + t : (r + 1) * rows]).any()


class _CastingFfiKernels(FfiKernels if not _PROBLEM else object):  # type: ignore[misc]
    """FfiKernels without ``with_bf16_weight_grads``: the layer's VJP casts float32 weight
    gradients to the weights' dtype (what every provider without it gets)."""

    with_bf16_weight_grads = None


@pytest.mark.parametrize("mode", [None, "bf16"], ids=["exact", "bf16_operands"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_weight_cotangents_come_out_of_the_native_layer_in_the_primal_dtype(dtype: str, mode) -> None:
    """jax.grad through moe_ep with FfiKernels: bf16 weights get bf16 cotangents that the native
    backward writes itself (its custom call's dfc1 and dfc2 results are bf16:
    MOE_EP_BACKWARD_WEIGHT_GRADS_BF16, no float32 gradient and no cast pass), bit for bit the
    cast of the float32 ones a provider without it returns; float32 weights keep float32.
    Two ranks where jax has two devices, else one (one GPU: the tensor-core path)."""
    n, rows = min(NDEV, 2), 6
    counts = [5, 2][:n]
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows,
                         gate_up_clamp=0.75, backward_operand_format=mode)
    world = random_world(config, num_tokens=counts, input_format="fp32", seed=21, routing="unused_mixed")
    rng = np.random.default_rng(22)
    gy = [rng.standard_normal((t, config.hidden)).astype(np.float32) for t in counts]
    mesh = _mesh(n)
    args = _world_args(mesh, world, rows) + [_put(mesh, gy, rows)]
    dt = jnp.dtype(dtype)

    def train(kernels):
        @partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        def step(x, w1, w2, idx, tw, g):
            def loss(w1, w2):
                y = A.moe_ep(x.astype(dt), w1, w2, idx, tw, config=config, kernels=kernels)
                return jnp.sum(y.astype(jnp.float32) * g)

            return jax.grad(loss, argnums=(0, 1))(w1.astype(dt), w2.astype(dt))

        return step

    compiled = _compile(train(KF), *args)
    calls = [ln for ln in compiled.as_text().splitlines() if 'custom_call_target="moe_ep_expert_backward"' in ln]
    assert calls, "the backward runs the native experts backward"
    el, h, i = config.num_local_experts, config.hidden, config.intermediate
    t = "bf16" if dtype == "bfloat16" else "f32"
    for ln in calls:
        assert f"{t}[{el},{h},{2 * i}]" in ln and f"{t}[{el},{i},{h}]" in ln, f"dfc1 and dfc2 must be {t}: {ln}"
    if dtype == "bfloat16":  # no float32 pass over the bf16 gradients after the call (the NaN poisoning keeps
        # bf16); read before XLA's passes, since XLA:CPU itself computes bf16 selects in float32
        lowered = jax.jit(train(KF)).lower(*args).as_text()
        f32_selects = [ln for ln in lowered.splitlines() if "select" in ln
                       and (f"tensor<{el}x{h}x{2 * i}xf32>" in ln or f"tensor<{el}x{i}x{h}xf32>" in ln)]
        assert not f32_selects, f"a float32 select over a weight gradient: {f32_selects[0]}"
    g1, g2 = compiled(*args)
    c1, c2 = _run(train(_CastingFfiKernels()), *args)
    bits = np.uint16 if dtype == "bfloat16" else np.uint32
    for g, c_, name in ((g1, c1, "fc1"), (g2, c2, "fc2")):
        assert g.dtype == dt and c_.dtype == dt, f"{name}: the cotangent has the primal dtype"
        np.testing.assert_array_equal(np.asarray(g).view(bits), np.asarray(c_).view(bits),
                                      err_msg=f"{name}: the native bf16 gradient is the cast of the float32 one")


# ----------------------------------------------------------------------------- the backend


def test_backend_is_registered_available_and_describes_its_kernels() -> None:
    b = moe_ep_spec.get_backend("jax-ffi")
    assert isinstance(b, JaxFfiBackend) and b.name == "jax-ffi" and b.distribution == "moe-ep-jax-ffi"
    assert b.availability()
    caps = b.capabilities
    assert caps.devices[0] == "cpu" and ("cuda" in caps.devices) == ("CUDA" in native.platforms())
    versions = b.framework_versions()
    assert versions["kernels"] == "FfiKernels()" and "moe_ep_native" in versions["native"]
    assert b._kw()["kernels"] == KF


@needs2
def test_world_backend_runs_pickles_and_rejects_bad_input_before_running() -> None:
    import pickle

    backend = JaxFfiBackend()
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2, max_tokens_per_rank=8,
                         generate_c=True, output_format="mxfp8")
    world = random_world(config, num_tokens=[3, 5], input_format="nvfp4", seed=15)
    got = backend.forward(config, world)
    want, budget = REF.forward(config, world), REF.forward_budget(config, world)
    for r in range(2):
        assert compare(f"rank {r}", got[r].output, want[r].output, budget[r].output).ok
    before = len(backend._cache)
    with pytest.raises(moe_ep_spec.CapacityError, match="recv_capacity = 2"):
        backend.forward(config.replace(recv_capacity=2), world)
    assert len(backend._cache) == before
    clone = pickle.loads(pickle.dumps(backend))
    assert not clone._cache and clone.forward(config, world)[1].output.shape == (5, 32)


@needs2
def test_conformance_quick_table_at_ep_1_and_2() -> None:
    from moe_ep_conformance import all_cases, run_cases

    cases = all_cases(quick=True, num_ranks=[1, 2])
    assert cases
    results = run_cases(JaxFfiBackend(), cases)
    failed = [r.describe() for r in results if r.outcome != "passed"]
    assert not failed, "\n".join(failed)


def test_unbuilt_extension_registers_and_reports_why_it_is_unavailable() -> None:
    code = (
        "import sys\n"
        "sys.modules['moe_ep_jax_ffi._ffi'] = None  # what an unbuilt extension looks like: ImportError\n"
        "import moe_ep_jax_ffi.plugin, moe_ep_jax_ffi.backend\n"
        "assert 'jax' not in sys.modules, 'jax imported early'\n"
        "import moe_ep_spec\n"
        "b = moe_ep_spec.get_backend('jax-ffi', require_available=False)\n"
        "a = b.availability(); print(type(b).__name__, bool(a)); print(a.reason)\n"
        "try:\n"
        "    moe_ep_spec.get_backend('jax-ffi')\n"
        "except moe_ep_spec.BackendUnavailableError as e:\n"
        "    print('unavailable:', e.name)\n"
    )
    env = dict(os.environ, MOE_EP_LOAD_PLUGINS="jax-ffi,reference")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "JaxFfiBackend False", lines
    assert "moe_ep_jax_ffi._ffi is not built" in lines[1] and "pip install --no-build-isolation -e backends/jax_ffi" in lines[1]
    assert lines[2] == "unavailable: jax-ffi"


test_unbuilt_extension_registers_and_reports_why_it_is_unavailable.runs_unbuilt = True  # type: ignore[attr-defined]


def test_native_docstring_describes_every_target() -> None:
    """The handlers' reference (operands, results, attributes) is native.py's module
    docstring, one entry per target; docs/jax-ffi.md links to it."""
    documented = re.findall(r"^``(moe_ep_\w+)``\n    ", native.__doc__ or "", flags=re.M)
    assert sorted(documented) == sorted(native.TARGETS), (documented, native.TARGETS)
    for entry in re.split(r"^``moe_ep_\w+``\n", native.__doc__ or "", flags=re.M)[1:]:
        assert "Operands:" in entry and "Results:" in entry and "Attributes:" in entry, entry
    assert "moe_ep_jax_ffi/native.py" in (ROOT / "docs" / "jax-ffi.md").read_text()


# ----------------------------------------------------------------------------- CUDA handlers


@CUDA
def test_cuda_handlers_formats_plan_and_sum_match_the_spec_and_the_xla_provider() -> None:
    assert "CUDA" in native.register()
    _, inputs = _format_inputs()
    for fmt in ("mxfp8", "nvfp4"):
        for x in inputs:
            ours = jax.jit(KF.quantize, static_argnums=(1, 2))(x, fmt, 1)
            spec = spec_quantize(x, fmt, axis=1)
            assert np.array_equal(_codes(ours.data), spec.data_codes()) and np.array_equal(_codes(ours.scale), spec.scale_codes())
            assert np.array_equal(np.asarray(jax.jit(KF.dequantize)(ours)), spec.dequantize(np.float32), equal_nan=True)
    rng = np.random.default_rng(16)
    idx = rng.integers(-1, 8, (33, 4)).astype(np.int32)
    idx[3, 1] = 9
    cfg = MoeEpConfig(num_experts=8, hidden=8, intermediate=4, num_topk=4, num_ranks=1)
    ours, want = jax.jit(partial(KF.plan_routes, cfg))(idx), jax.jit(partial(KX.plan_routes, cfg))(idx)
    for a, b in ((getattr(ours, f), getattr(want, f)) for f in _PLAN_FIELDS):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    rows = rng.standard_normal((33 * 4, 40)).astype(np.float32)
    s = jax.jit(KF.slot_sum, static_argnums=(1, 2))(rows, 33, 4)
    assert np.array_equal(np.asarray(s), np.asarray(jax.jit(KX.slot_sum, static_argnums=(1, 2))(rows, 33, 4)))


@CUDA
@pytest.mark.parametrize("mode", [None, "bf16"], ids=["exact", "bf16_operands"])
@pytest.mark.parametrize("fmt,apply,clamp,inter", [c for c in _EXPERT_CASES if c[0] in ("fp32", "nvfp4")])
def test_cuda_expert_handlers_match_the_cpu_handlers(fmt, apply, clamp, inter, mode) -> None:
    """fp32 inputs run the CUDA float32 kernels, nvfp4 ones (bf16 operands) the tensor cores;
    in the bf16-operand mode the latter is four bf16 GEMMs and the fused SwiGLU pass."""
    cfg = MoeEpConfig(num_experts=_EL, hidden=_H, intermediate=_I, num_topk=2, num_ranks=1,
                      apply_topk_in_fc1=apply, gate_up_clamp=clamp, intermediate_format=inter,
                      backward_operand_format=mode)
    x, w, w1, w2 = _expert_inputs(17, fmt)
    dy = np.random.default_rng(18).standard_normal((_C, _H)).astype(np.float32)

    def fwd_bwd(x, w, w1, w2, gs, dy):
        y, c = KF.expert_forward(cfg, x, w, w1, w2, gs)
        return (y, c), KF.expert_backward(cfg, x, w, w1, w2, F.round_to_bf16(c), dy, gs)

    gpu = jax.jit(fwd_bwd)(x, w, w1, w2, _GROUPS, dy)
    cpu_dev = jax.devices("cpu")[0]  # the CPU handlers: inputs committed to the host device
    want = jax.jit(fwd_bwd)(*jax.device_put((x, w, w1, w2, _GROUPS, dy), cpu_dev))
    for name, a, b in zip(("y", "c", "dx", "dw", "dfc1", "dfc2"), jax.tree_util.tree_leaves(gpu), jax.tree_util.tree_leaves(want)):
        if name == "c":  # the bf16 stash: one bf16 rounding of nearly equal values
            _close(f"cuda vs cpu {name}", np.asarray(a, np.float32), np.asarray(b, np.float32), rel=2.0**-8)
        elif mode is not None and name != "y":
            _close_bf16_operands(f"cuda vs cpu {name}", a, b)
        else:
            _close(f"cuda vs cpu {name}", a, b)


@CUDA
def test_cuda_conformance_quick_table() -> None:
    from moe_ep_conformance import all_cases, run_cases

    sizes = [n for n in (1, 2) if n <= NDEV]
    results = run_cases(JaxFfiBackend(), all_cases(quick=True, num_ranks=sizes))
    failed = [r.describe() for r in results if r.outcome != "passed"]
    assert not failed, "\n".join(failed)


# ----------------------------------------------------------------------------- in-place fills


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("error", [False, True], ids=["clear", "set"])
def test_poison_is_the_select_in_place(dtype, error) -> None:
    # moe_ep_poison: the bits of jnp.where(error, nan, x), x aliased (on the default device:
    # the CUDA fill on a GPU machine, the CPU handler here).
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((5, 7, 3)).astype(np.float32)).astype(dtype)
    x = x.at[0, 0, 0].set(jnp.inf).at[1, 2, 1].set(-0.0)
    flag = jnp.asarray(error)

    def f(e, a):
        return KF.poison(e, a * 1)  # a temporary, as the layer's gradients are: aliasing it is free

    got = _run(f, flag, x)
    want = jnp.where(flag, jnp.asarray(jnp.nan, x.dtype), x)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert np.array_equal(_codes(got), _codes(want)), f"{dtype}, error {error}: not the select's bits"
    assert "moe_ep_poison" in jax.jit(f).lower(flag, x).as_text(), "the fill is not the native target"


def test_poison_of_other_dtypes_and_empty_arrays_is_the_select() -> None:
    for x in (jnp.zeros((0, 4), jnp.float32), jnp.arange(6, dtype=jnp.float32).astype(jnp.float8_e4m3fn)):
        f = lambda e, a: KF.poison(e, a)  # noqa: E731
        got = _run(f, jnp.asarray(True), x)
        assert np.array_equal(np.isnan(np.asarray(got).astype(np.float32)), np.ones(x.shape, bool)), x.dtype
        assert "moe_ep_poison" not in jax.jit(f).lower(jnp.asarray(True), x).as_text(), x.dtype


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8", "uint8", "int32"])
def test_zero_rows_zeroes_exactly_the_listed_rows(dtype) -> None:
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.integers(1, 100, (9, 4, 3)).astype(np.float32)).astype(dtype)
    rows = jnp.asarray([2, -1, 7, 2, -1], jnp.int32)  # repeats and -1 (none)
    got = _run(lambda a, r: KF.zero_rows(a * 1, r), x, rows)
    want = np.asarray(x).copy()
    want[[2, 7]] = 0
    assert got.dtype == x.dtype and np.array_equal(_codes(got), _codes(want)), f"{dtype}: wrong rows zeroed"
    none = _run(lambda a, r: KF.zero_rows(a * 1, r), x, jnp.full((3,), -1, jnp.int32))
    assert np.array_equal(_codes(none), _codes(x)), f"{dtype}: rows -1 changed something"


@on_cpu
def test_zero_rows_rejects_a_row_outside_the_array_on_cpu() -> None:
    x = jnp.ones((4, 2), jnp.float32)
    with pytest.raises(Exception, match=r"row"):
        np.asarray(_run(lambda a, r: KF.zero_rows(a * 1, r), x, jnp.asarray([1, 4], jnp.int32)))
