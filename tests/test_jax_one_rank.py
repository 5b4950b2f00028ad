"""The jax layer at one rank (EP 1): the exchanges become local gathers.

At ``num_ranks == 1`` :func:`moe_ep_jax.core.to_experts` and ``to_sources``
skip the byte packing and the all-to-all and gather every part straight from
its rows. These tests hold the shortcut to the general path bit for bit:

- against ``_to_experts_exchange`` / ``_to_sources_exchange`` run at one rank
  with the ``capacity`` exchange (the one XLA:CPU can run);
- against the ``ragged`` exchange by emulating ``ragged_all_to_all`` in numpy
  with the very offsets and sizes that exchange passes (XLA:CPU cannot run it);
- end to end: the fused layer, its gradients and the layered dispatch/combine
  with the shortcut against the same program with the general path patched in.

Payloads are random bit patterns plus explicit -0.0, quiet and signalling NaNs
with payloads, in every dtype the layer moves (bf16, float32, int32, float16,
mxfp8 and nvfp4 codes and scales), so a conversion anywhere would show.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any, Callable, Dict, List, Sequence, Tuple

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax = pytest.importorskip("jax")
pytest.importorskip("moe_ep_jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from moe_ep_spec import MoeEpConfig  # noqa: E402
from moe_ep_spec.inputs import random_world  # noqa: E402

from moe_ep_jax import api as A  # noqa: E402
from moe_ep_jax import core  # noqa: E402
from moe_ep_jax import formats as F  # noqa: E402
from moe_ep_jax.backend import XLA_CPU_FAST_COMPILE  # noqa: E402
from moe_ep_jax.kernels import DEFAULT_KERNELS  # noqa: E402

_AXIS = "ep"


# ----------------------------------------------------------------------------- helpers


def _mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[:1]), (_AXIS,))


def _compile(fn: Callable, *args: Any) -> Any:
    opts = XLA_CPU_FAST_COMPILE if jax.default_backend() == "cpu" else None
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile(opts) if opts else lowered.compile()


def _shard(fn: Callable) -> Callable:
    return jax.shard_map(fn, mesh=_mesh(), in_specs=P(_AXIS), out_specs=P(_AXIS))


def _bits(x: Any) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}")) if a.dtype != np.bool_ else a


def _assert_same_bits(what: str, got: Any, want: Any) -> None:
    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype == w.dtype, f"{what}: dtype {g.dtype}, expected {w.dtype}"
    assert g.shape == w.shape, f"{what}: shape {g.shape}, expected {w.shape}"
    gb, wb = _bits(g), _bits(w)
    bad = np.argwhere(gb != wb)
    if bad.size:
        first = tuple(int(i) for i in bad[0])
        raise AssertionError(
            f"{what}: {len(bad)} of {gb.size} elements differ in their bits; first at {first}: "
            f"got 0x{int(gb[first]):x} ({g[first]!r}), expected 0x{int(wb[first]):x} ({w[first]!r})"
        )


def _random_bits(rng: np.random.Generator, shape: Tuple[int, ...], dtype: Any, specials: Sequence[int]) -> np.ndarray:
    """``[shape] dtype`` from random bit patterns; every even row holds one of
    ``specials`` (bit patterns, in turn) at a column that moves with the row."""
    dtype = np.dtype(dtype)
    ut = np.dtype(f"uint{8 * dtype.itemsize}")
    u = rng.integers(0, np.iinfo(ut).max, size=shape, dtype=ut, endpoint=True)
    by_row = u.reshape(shape[0], int(np.prod(shape[1:], dtype=np.int64)))
    for r in range(0, shape[0], 2):
        by_row[r, (3 * r) % by_row.shape[1]] = specials[(r // 2) % len(specials)]
    return u.view(dtype)


# -0.0, quiet NaNs with payloads, signalling NaNs, -NaN, +-inf, a subnormal
_SPECIAL = {
    np.dtype(jnp.bfloat16): (0x8000, 0x7FC1, 0x7F81, 0xFFC3, 0x7F80, 0xFF80, 0x0001),
    np.dtype(np.float32): (0x80000000, 0x7FC00123, 0x7FA00001, 0xFFC00042, 0x7F800000, 0x00000001),
    np.dtype(np.float16): (0x8000, 0x7E01, 0x7D01, 0xFE03, 0x7C00, 0x0001),
    np.dtype(jnp.float8_e4m3fn): (0x80, 0x7F, 0xFF, 0x01),
    np.dtype(jnp.float8_e8m0fnu): (0xFF, 0x00, 0x7F),
    np.dtype(np.uint8): (0x00, 0xFF, 0x80),
    np.dtype(np.int32): (0xFFFFFFFF, 0, 0x7FFFFFFF),
}


def _payload(rng: np.random.Generator, rows: int, hidden: int) -> List[np.ndarray]:
    """The parts of one exchange, ``[rows, ...]`` each: a bf16 row, an mxfp8
    row (codes, scales), an nvfp4 row (codes, scales), float32 and int32
    per-row values and a float16 ``[rows, 2, 3]`` block."""
    mx = F.BlockScaled(
        _random_bits(rng, (rows, hidden), jnp.float8_e4m3fn, _SPECIAL[np.dtype(jnp.float8_e4m3fn)]),
        _random_bits(rng, (rows, -(-hidden // 32)), jnp.float8_e8m0fnu, _SPECIAL[np.dtype(jnp.float8_e8m0fnu)]),
        "mxfp8", hidden, 1,
    )
    nv = F.BlockScaled(
        _random_bits(rng, (rows, -(-hidden // 2)), np.uint8, _SPECIAL[np.dtype(np.uint8)]),
        _random_bits(rng, (rows, -(-hidden // 16)), jnp.float8_e4m3fn, _SPECIAL[np.dtype(jnp.float8_e4m3fn)]),
        "nvfp4", hidden, 1,
    )
    out = [_random_bits(rng, (rows, hidden), jnp.bfloat16, _SPECIAL[np.dtype(jnp.bfloat16)])]
    out += core.tensor_parts(mx) + core.tensor_parts(nv)
    out += [
        _random_bits(rng, (rows,), np.float32, _SPECIAL[np.dtype(np.float32)]),
        _random_bits(rng, (rows,), np.int32, _SPECIAL[np.dtype(np.int32)]),
        _random_bits(rng, (rows, 2, 3), np.float16, _SPECIAL[np.dtype(np.float16)]),
    ]
    return [np.asarray(p) for p in out]


def _routing(rng: np.random.Generator, tokens: int, k: int, experts: int, *, unused: float, skip: Sequence[int] = (),
             bad: bool = False) -> np.ndarray:
    """``[T, K] int32``: distinct experts per token (never those in ``skip``),
    a share ``unused`` of slots -1, and with ``bad`` one id ``E`` (an input error)."""
    allowed = np.array([e for e in range(experts) if e not in skip])
    idx = np.stack([rng.choice(allowed, size=k, replace=len(allowed) < k) for _ in range(tokens)]) if tokens else \
        np.zeros((0, k), np.int64)
    idx = np.where(rng.random(idx.shape) < unused, -1, idx).astype(np.int32)
    if bad:
        idx.reshape(-1)[idx.size // 2] = experts
    return idx


class _Case:
    def __init__(self, name: str, config: MoeEpConfig, tokens: int, idx: np.ndarray, error: bool) -> None:
        self.name, self.config, self.tokens, self.idx, self.error = name, config, tokens, idx, error


def _cases() -> List[_Case]:
    rng = np.random.default_rng(2024)
    base = dict(hidden=48, intermediate=16, num_ranks=1)
    cases = []

    def add(name: str, tokens: int, error: bool = False, **kw: Any) -> None:
        routing = kw.pop("routing")
        config = MoeEpConfig(max_tokens_per_rank=max(tokens, 1), **{**base, **kw})
        cases.append(_Case(name, config, tokens, routing(config), error))

    # -1 slots, experts repeated across tokens, expert 5 empty; dynamic layout (C = T*K)
    add("dynamic", 13, num_experts=8, num_topk=3,
        routing=lambda c: _routing(rng, 13, 3, 8, unused=0.25, skip=(5,)))
    # aligned slabs with padding rows and a buffer larger than T*K
    add("static_aligned", 11, num_experts=8, num_topk=2, recv_capacity=2 * 11 + 8 * 3 + 5, expert_alignment=4,
        routing=lambda c: _routing(rng, 11, 2, 8, unused=0.2, skip=(0, 6)))
    # every slot routed, every expert used, one expert
    add("one_expert", 9, num_experts=1, num_topk=1, routing=lambda c: _routing(rng, 9, 1, 1, unused=0.0))
    # nothing routed at all
    add("all_unused", 6, num_experts=4, num_topk=2, routing=lambda c: np.full((6, 2), -1, np.int32))
    # a bad expert id: the plan's error flag, every row zero
    add("bad_id", 10, True, num_experts=8, num_topk=2, recv_capacity=40, expert_alignment=4,
        routing=lambda c: _routing(rng, 10, 2, 8, unused=0.2, bad=True))
    # aligned counts above the buffer: the overflow error
    add("overflow", 10, True, num_experts=8, num_topk=2, recv_capacity=12, expert_alignment=4,
        routing=lambda c: _routing(rng, 10, 2, 8, unused=0.0))
    return cases


CASES = _cases()


def _spec(config: MoeEpConfig, tokens: int, exchange: str) -> core.LayerSpec:
    return core.LayerSpec(config=config, axis_name=_AXIS, num_tokens=tokens,
                          capacity=core.buffer_rows(config, tokens), exchange=exchange, kernels=DEFAULT_KERNELS)


def _exchanges(case: _Case, send_parts: List[np.ndarray], buf_parts: List[np.ndarray]) -> Dict[str, Any]:
    """Both directions, at one rank, by the shortcut (under the ``ragged`` and
    the ``capacity`` spec) and by the capacity exchange; plus what the ragged
    exchange would pass to ``ragged_all_to_all``."""
    ns = len(send_parts)
    cap_spec = _spec(case.config, case.tokens, "capacity")
    rag_spec = _spec(case.config, case.tokens, "ragged")

    def body(idx: jax.Array, *parts: jax.Array) -> Any:
        send, buf = list(parts[:ns]), list(parts[ns:])
        plan = core.make_plan(cap_spec, idx)
        lay = core.layout(cap_spec, plan)
        return {
            "to_experts": {
                "shortcut_capacity": core.to_experts(cap_spec, plan, lay, send),
                "shortcut_ragged": core.to_experts(rag_spec, plan, lay, send),
                "exchange": core._to_experts_exchange(cap_spec, plan, lay, send),
            },
            "to_sources": {
                "shortcut_capacity": core.to_sources(cap_spec, plan, lay, buf),
                "shortcut_ragged": core.to_sources(rag_spec, plan, lay, buf),
                "exchange": core._to_sources_exchange(cap_spec, plan, lay, buf),
            },
            "ragged_args": {
                "to_experts": core._ragged_to_experts_args(lay),
                "to_sources": core._ragged_to_sources_args(rag_spec, lay),
            },
            "route_pos": plan.route_pos,
            "error": lay.error[None],
        }

    fn = jax.shard_map(body, mesh=_mesh(), in_specs=P(_AXIS), out_specs=P(_AXIS))
    args = [jax.device_put(a, NamedSharding(_mesh(), P(_AXIS))) for a in [case.idx] + send_parts + buf_parts]
    return jax.tree_util.tree_map(np.asarray, _compile(fn, *args)(*args))


def _emulate_ragged(src: np.ndarray, out_rows: int, args: Sequence[np.ndarray]) -> np.ndarray:
    """``ragged_all_to_all`` from one rank to itself, on bits: chunk i of
    ``src`` (``input_offsets[i]``, ``send_sizes[i]`` rows) lands at
    ``output_offsets[i]`` of a zero buffer."""
    in_off, send_sizes, out_off, recv_sizes = (np.asarray(a) for a in args)
    assert np.array_equal(send_sizes, recv_sizes), "one rank sends itself what it receives"
    s = _bits(src)
    out = np.zeros((out_rows,) + s.shape[1:], s.dtype)
    for i in range(len(in_off)):
        n = int(send_sizes[i])
        out[out_off[i] : out_off[i] + n] = s[in_off[i] : in_off[i] + n]
    return out.view(src.dtype)


# ----------------------------------------------------------------------------- the exchanges


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_one_rank_gathers_equal_the_exchanges_bit_for_bit(case: _Case) -> None:
    rng = np.random.default_rng(7)
    tk = case.tokens * case.config.num_topk
    cap = core.buffer_rows(case.config, case.tokens)
    # rows past the routes (to_experts) and padding rows (to_sources) hold garbage, never zeros:
    # neither may be read
    send_parts = _payload(rng, tk, case.config.hidden)
    buf_parts = _payload(rng, cap, case.config.hidden)
    got = _exchanges(case, send_parts, buf_parts)
    assert bool(got["error"][0]) == case.error, f"{case.name}: plan error {got['error'][0]}, expected {case.error}"
    route_pos = got["route_pos"]

    for direction, src_parts, rows in (("to_experts", send_parts, cap), ("to_sources", buf_parts, tk)):
        res = got[direction]
        args = got["ragged_args"][direction]
        for i, src in enumerate(src_parts):
            what = f"{case.name} {direction} part {i} ({src.dtype}{list(src.shape[1:])})"
            want = res["exchange"][i]
            assert want.shape == (rows,) + src.shape[1:], f"{what}: reference shape {want.shape}"
            _assert_same_bits(f"{what}: shortcut vs capacity exchange", res["shortcut_capacity"][i], want)
            _assert_same_bits(f"{what}: shortcut under exchange='ragged'", res["shortcut_ragged"][i], want)
            # the ragged exchange: its all-to-all, then (to_sources) its read at the send positions
            if direction == "to_experts":
                ragged = _emulate_ragged(src, cap, args)
            else:
                back = _emulate_ragged(src, max(tk, 1), args)
                ragged = back[np.clip(route_pos, 0, max(tk - 1, 0))]
                keep = (route_pos >= 0).reshape((-1,) + (1,) * (src.ndim - 1))
                ragged = np.where(keep, _bits(ragged), 0).view(src.dtype)
            _assert_same_bits(f"{what}: shortcut vs emulated ragged exchange", res["shortcut_capacity"][i], ragged)
            if case.error:
                assert not _bits(want).any(), f"{what}: an error must leave every row zero"
    if case.name == "dynamic":  # enough routed rows that every special bit pattern travels, both ways
        for direction, src_parts in (("to_experts", send_parts), ("to_sources", buf_parts)):
            for i, src in enumerate(src_parts):
                specials = {int(v) for v in np.asarray(_SPECIAL[src.dtype], np.int64) % (1 << (8 * src.dtype.itemsize))}
                moved = {int(v) for v in np.unique(_bits(got[direction]["shortcut_capacity"][i]))}
                assert specials <= moved, f"{direction} part {i}: bit patterns {specials - moved} never moved"


def test_one_rank_with_no_tokens_gives_zero_rows() -> None:
    # T*K == 0: the general path cannot trace this (its byte packing reshapes 0 rows), so the
    # expectation is written out: all-zero buffers of the parts' dtypes, and no route rows
    config = MoeEpConfig(num_experts=4, hidden=48, intermediate=16, num_topk=2, num_ranks=1, recv_capacity=8,
                         expert_alignment=2)
    spec = _spec(config, 0, "ragged")
    rng = np.random.default_rng(3)
    send_parts, buf_parts = _payload(rng, 0, config.hidden), _payload(rng, 8, config.hidden)
    ns = len(send_parts)

    def body(idx: jax.Array, *parts: jax.Array) -> Any:
        plan = core.make_plan(spec, idx)
        lay = core.layout(spec, plan)
        return core.to_experts(spec, plan, lay, list(parts[:ns])), core.to_sources(spec, plan, lay, list(parts[ns:]))

    args = [np.zeros((0, 2), np.int32)] + send_parts + buf_parts
    bufs, rows = jax.tree_util.tree_map(np.asarray, _compile(_shard(body), *args)(*args))
    for i, (src, b, r) in enumerate(zip(send_parts, bufs, rows)):
        assert b.dtype == src.dtype and b.shape == (8,) + src.shape[1:] and not _bits(b).any(), f"part {i}: {b!r}"
        assert r.dtype == src.dtype and r.shape == (0,) + src.shape[1:], f"part {i}: {r.shape}"


# ----------------------------------------------------------------------------- the layer


def _layer_body(config: MoeEpConfig, exchange: str, kernels: Any = None) -> Callable:
    """Every path through both exchanges: the fused layer and its VJP, the
    training stash, the layered dispatch and combine and their gradients."""

    def body(x, w1, w2, idx, tw, g):  # type: ignore[no-untyped-def]
        plain = config.replace(generate_c=False)
        kw = dict(exchange=exchange, kernels=kernels)
        out, pull = jax.vjp(lambda x, w1, w2, tw: A.moe_ep(x, w1, w2, idx, tw, config=plain, **kw), x, w1, w2, tw)
        grads = pull(g.astype(out.dtype))
        _, c, meta = A.moe_ep(x, w1, w2, idx, tw, config=config, **kw)

        def layered(x, tw):  # type: ignore[no-untyped-def]
            toks, w, handle = A.ep_dispatch(x, idx, tw, config=config, **kw)
            return jnp.sum(A.ep_combine(toks * w[:, None], handle).astype(jnp.float32) * g)

        toks, w, handle = A.ep_dispatch(x, idx, tw, config=config, **kw)
        back = A.ep_combine(toks * 2.0, handle)
        return out, grads, c, meta, toks, w, handle.route_metadata, back, jax.grad(layered, argnums=(0, 1))(x, tw)

    return body


@pytest.mark.parametrize("layout", ["dynamic", "static"])
def test_one_rank_layer_equals_the_exchange_path_bit_for_bit(layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = 12
    config = MoeEpConfig(num_experts=4, hidden=64, intermediate=32, num_topk=2, num_ranks=1, max_tokens_per_rank=rows,
                         output_format="bf16", combine_format="nvfp4", gate_up_clamp=0.75, generate_c=True)
    if layout == "static":
        config = config.replace(recv_capacity=40, expert_alignment=8)
    (world,) = random_world(config, num_tokens=rows, input_format="fp32", seed=12, routing="unused_mixed")
    g = np.random.default_rng(13).standard_normal((rows, config.hidden)).astype(jnp.bfloat16).astype(np.float32)
    x = world.activation.copy()
    x[0, :3] = [np.nan, -0.0, np.inf]  # a routed token's NaN, -0 and inf travel through both paths alike
    args = [x, world.fc1_weight, world.fc2_weight, np.asarray(world.topk_idx, np.int32), world.topk_weights, g]

    def run(exchange: str) -> Tuple[str, List[np.ndarray]]:
        fn = _shard(_layer_body(config, exchange))
        text = jax.jit(fn).lower(*args).as_text()
        return text, [np.asarray(a) for a in jax.tree_util.tree_leaves(_compile(fn, *args)(*args))]

    text, fast = run("ragged")  # at one rank the ragged spec compiles on CPU: it has no all-to-all left
    assert "all_to_all" not in text, "the one-rank layer still lowers to an all-to-all"
    _, fast_cap = run("capacity")
    calls: Counter = Counter()

    def spy(name: str, fn: Callable) -> Callable:
        def traced(*args: Any) -> Any:
            calls[name] += 1
            return fn(*args)

        return traced

    with monkeypatch.context() as m:
        m.setattr(core, "_dispatch_local", core._dispatch_exchange)  # the one-rank dispatch's gathers, too
        m.setattr(core, "_tokens_to_experts_local",  # and the backward's (cotangent rows to the experts)
                  lambda spec, plan, lay, rows: core.to_experts(spec, plan, lay, core.send_rows(spec, plan, rows)))
        m.setattr(core, "to_experts", spy("to_experts", core._to_experts_exchange))
        m.setattr(core, "to_sources", spy("to_sources", core._to_sources_exchange))
        _, slow = run("capacity")
    # the patch took: each direction of the fused layer, its VJP, the stash run, the layered
    # dispatch/combine and their VJPs went the general way (6 each, traced once)
    assert calls == Counter({"to_experts": 6, "to_sources": 6}), calls
    assert len(fast) == len(slow) == len(fast_cap), f"leaf counts {len(fast)}, {len(slow)}, {len(fast_cap)}"
    for i, (a, b, c) in enumerate(zip(fast, slow, fast_cap)):
        _assert_same_bits(f"{layout} leaf {i}: shortcut vs exchange path", a, b)
        _assert_same_bits(f"{layout} leaf {i}: ragged vs capacity spec", a, c)


def test_round_to_bf16_of_bfloat16_is_the_float32_path_bit_for_bit() -> None:
    """A bfloat16 input skips the float32 pass (the stash the native layer returns):
    every bit pattern, NaN payloads included, rounds as through float32."""
    from jax import lax

    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    x = jnp.asarray(bits.view(jnp.bfloat16))
    got = np.asarray(jax.jit(F.round_to_bf16)(x)).view(np.uint16)

    def via_float32(v):
        r = F._bf16_bits(F._bits(v))
        return lax.bitcast_convert_type(lax.shift_right_logical(r, np.uint32(16)).astype(jnp.uint16), jnp.bfloat16)

    want = np.asarray(jax.jit(via_float32)(x)).view(np.uint16)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, (f"{bad.size} of 65536 bf16 patterns round differently, e.g. {bits[bad[0]]:#06x} -> "
                           f"{got[bad[0]]:#06x}, through float32 {want[bad[0]]:#06x}")


@pytest.mark.parametrize("combine,output", [("mxfp8", "bf16"), ("bf16", "bf16"), ("bf16", "nvfp4"),
                                            ("nvfp4", "mxfp8")])
@pytest.mark.parametrize("method", ["gather_rows", "reduce_rows", "expert_forward_output"])
def test_one_rank_native_paths_equal_xla_bit_for_bit(method: str, combine: str, output: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """jax-ffi at one rank gathers rows with the native moe_ep_permute_rows (FfiKernels.gather_rows);
    the fused forward runs the experts and the combine in two native calls
    (FfiKernels.expert_forward_output: the layer object, then moe_ep_combine_reduce_encode,
    which sums each token's routes straight from the buffer, rounding unrounded rows through a
    block combine format as it reads them, and encodes the output), or, without that method,
    gets the rows rounded by the layer object (expert_forward_combined) and sums them with
    moe_ep_combine_reduce (FfiKernels.reduce_rows), the layered combine's with XLA's bf16
    round trip. Every output of the layer is the same bits as without the method (XLA's
    gathers; the general combine: encode, gather, decode, slot sum, NaN select, encode)."""
    ffi = pytest.importorskip("moe_ep_jax_ffi.kernels")
    rows = 10
    config = MoeEpConfig(num_experts=4, hidden=64, intermediate=32, num_topk=3, num_ranks=1, max_tokens_per_rank=rows,
                         output_format=output, combine_format=combine, generate_c=True, recv_capacity=48,
                         expert_alignment=4)
    (world,) = random_world(config, num_tokens=rows, input_format="bf16", seed=21, routing="unused_mixed")
    g = np.random.default_rng(22).standard_normal((rows, config.hidden)).astype(jnp.bfloat16).astype(np.float32)
    x = world.activation.copy()
    x[1, :2] = [np.nan, -0.0]
    args = [x, world.fc1_weight, world.fc2_weight, np.asarray(world.topk_idx, np.int32), world.topk_weights, g]
    calls: Counter = Counter()
    native = getattr(ffi.FfiKernels, method)

    def counted(self: Any, *a: Any, **kw: Any) -> Any:
        calls[method] += 1
        return native(self, *a, **kw)

    def run() -> List[np.ndarray]:
        body = _layer_body(config, "capacity", kernels=ffi.FfiKernels())
        if output != "bf16":  # no jax.grad through block-scaled codes: the forward and the layered ops
            body = _layer_body(config.replace(output_format="bf16"), "capacity", kernels=ffi.FfiKernels())
            base = body

            def body(x, w1, w2, idx, tw, g):  # type: ignore[no-untyped-def]
                out = A.moe_ep(x, w1, w2, idx, tw, config=config, exchange="capacity", kernels=ffi.FfiKernels())
                return out, base(x, w1, w2, idx, tw, g)

        fn = _shard(body)
        return [np.asarray(a) for a in jax.tree_util.tree_leaves(_compile(fn, *args)(*args))]

    with monkeypatch.context() as m:
        m.setattr(ffi.FfiKernels, method, counted)
        if method == "reduce_rows":  # the fused forward's own sum comes first when present
            m.delattr(ffi.FfiKernels, "expert_forward_output")
        fast = run()
    assert calls[method] > 0, f"the one-rank layer never called FfiKernels.{method}"
    with monkeypatch.context() as m:
        m.delattr(ffi.FfiKernels, method)
        if method != "gather_rows":  # neither sum: the general combine
            m.delattr(ffi.FfiKernels, "reduce_rows" if method == "expert_forward_output" else "expert_forward_output")
        slow = run()
    assert len(fast) == len(slow), f"leaf counts {len(fast)} and {len(slow)}"
    for i, (a, b) in enumerate(zip(fast, slow)):
        _assert_same_bits(f"leaf {i}: with FfiKernels.{method} vs without", a, b)


@pytest.mark.parametrize("fmt,combine", [("mxfp8", "mxfp8"), ("nvfp4", "bf16"), ("mxfp8", "bf16")])
def test_one_rank_block_scaled_rows_decode_straight_from_the_tokens(fmt: str, combine: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """jax-ffi at one rank decodes the buffer's block-scaled rows straight from the token
    rows by route id (FfiKernels.dequantize_bf16_gather, given the dispatch's source by
    expert_forward_output): every output is the same bits as decoding the gathered rows (the
    source withheld), one block bf16 cannot hold still takes the float32 path, and a
    forward-only program keeps no gather of the codes (XLA drops the unused one)."""
    ffi = pytest.importorskip("moe_ep_jax_ffi.kernels")
    rows = 12
    config = MoeEpConfig(num_experts=4, hidden=64, intermediate=32, num_topk=3, num_ranks=1, max_tokens_per_rank=rows,
                         output_format="bf16", combine_format=combine, generate_c=True, recv_capacity=48,
                         expert_alignment=4)
    (world,) = random_world(config, num_tokens=rows, input_format="bf16", seed=31, routing="unused_mixed")
    kern = ffi.FfiKernels()

    def run(x_np: np.ndarray) -> List[np.ndarray]:
        x = F.quantize(jnp.asarray(x_np, jnp.float32), fmt, axis=1)
        args = (x, jnp.asarray(world.fc1_weight, jnp.bfloat16), jnp.asarray(world.fc2_weight, jnp.bfloat16),
                jnp.asarray(world.topk_idx, jnp.int32), jnp.asarray(world.topk_weights, jnp.float32))

        def body(x, w1, w2, idx, tw):  # type: ignore[no-untyped-def]
            return A.moe_ep(x, w1, w2, idx, tw, config=config, exchange="capacity", kernels=kern)

        return [np.asarray(a) for a in jax.tree_util.tree_leaves(_compile(_shard(body), *args)(*args))]

    calls: Counter = Counter()
    gather = ffi.FfiKernels.dequantize_bf16_gather
    fused = ffi.FfiKernels.expert_forward_output

    def counted(self: Any, *a: Any, **kw: Any) -> Any:
        calls["gather"] += 1
        return gather(self, *a, **kw)

    def without_source(self: Any, *a: Any, tokens: Any = None, token_route: Any = None, **kw: Any) -> Any:
        return fused(self, *a, **kw)

    tiny = world.activation.copy()
    tiny[2, :32] = 3 * 2.0**-136  # mxfp8: a block bf16 cannot hold (the float32 path); nvfp4 holds every value
    for name, x_np in (("random", world.activation), ("one inexact block", tiny)):
        with monkeypatch.context() as m:
            m.setattr(ffi.FfiKernels, "dequantize_bf16_gather", counted)
            fast = run(x_np)
        assert calls["gather"] > 0, "the one-rank layer never decoded the rows from the tokens"
        calls.clear()
        with monkeypatch.context() as m:
            m.setattr(ffi.FfiKernels, "expert_forward_output", without_source)
            m.setattr(ffi.FfiKernels, "dequantize_bf16_gather", counted)
            slow = run(x_np)
        assert calls["gather"] == 0
        assert len(fast) == len(slow)
        for i, (a, b) in enumerate(zip(fast, slow)):
            _assert_same_bits(f"{name}, leaf {i}: rows from the tokens vs from the gathered rows", a, b)
        assert not np.isnan(fast[0]).any(), f"{name}: a NaN reached the output"

    plain = config.replace(generate_c=False)
    x = F.quantize(jnp.asarray(world.activation, jnp.float32), fmt, axis=1)
    args = (x, jnp.asarray(world.fc1_weight, jnp.bfloat16), jnp.asarray(world.fc2_weight, jnp.bfloat16),
            jnp.asarray(world.topk_idx, jnp.int32), jnp.asarray(world.topk_weights, jnp.float32))
    text = _compile(_shard(lambda x, w1, w2, idx, tw: A.moe_ep(x, w1, w2, idx, tw, config=plain, exchange="capacity",
                                                               kernels=kern)), *args).as_text()
    assert "moe_ep_dequantize_bf16_gather" in text
    gathers = [ln for ln in text.splitlines() if 'custom_call_target="moe_ep_permute_rows"' in ln]
    outside = [ln for ln in gathers if "/cond/branch" not in ln]  # the float32 fallback gathers when it runs
    assert not outside, f"the forward-only program still gathers the codes: {outside[0][:200]}"
    experts = [ln for ln in text.splitlines() if 'custom_call_target="moe_ep_expert_forward"' in ln]
    assert experts and all("bf16[0,64]" in ln for ln in experts), (
        f"the forward-only program asks the layer object for a stash: {experts[0][:300] if experts else 'no call'}")


@pytest.mark.parametrize("output", ["bf16", "mxfp8", "nvfp4"])
def test_one_rank_fused_output_of_an_input_error_is_xla_nan(output: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An input error inside jit (an expert id out of range) turns every output to NaN: the
    fused one-rank combine (moe_ep_combine_reduce_encode's error flag) gives the bits of the
    general combine's NaN select and encode, and a program without the error is finite."""
    ffi = pytest.importorskip("moe_ep_jax_ffi.kernels")
    rows = 8
    config = MoeEpConfig(num_experts=4, hidden=64, intermediate=32, num_topk=2, num_ranks=1, max_tokens_per_rank=rows,
                         output_format=output, combine_format="mxfp8", recv_capacity=32, expert_alignment=4)
    (world,) = random_world(config, num_tokens=rows, input_format="bf16", seed=41)
    good = np.asarray(world.topk_idx, np.int32)
    bad = good.copy()
    bad[3, 1] = config.num_experts

    def run(idx: np.ndarray) -> List[np.ndarray]:
        args = (jnp.asarray(world.activation, jnp.bfloat16), jnp.asarray(world.fc1_weight, jnp.bfloat16),
                jnp.asarray(world.fc2_weight, jnp.bfloat16), jnp.asarray(idx), jnp.asarray(world.topk_weights))

        def body(x, w1, w2, idx, tw):  # type: ignore[no-untyped-def]
            return A.moe_ep(x, w1, w2, idx, tw, config=config, exchange="capacity", kernels=ffi.FfiKernels())

        return [np.asarray(a) for a in jax.tree_util.tree_leaves(_compile(_shard(body), *args)(*args))]

    for name, idx in (("an expert id out of range", bad), ("no error", good)):
        fast = run(idx)
        with monkeypatch.context() as m:
            m.delattr(ffi.FfiKernels, "expert_forward_output")
            m.delattr(ffi.FfiKernels, "reduce_rows")
            slow = run(idx)
        assert len(fast) == len(slow)
        for i, (a, b) in enumerate(zip(fast, slow)):
            _assert_same_bits(f"{output}, {name}, leaf {i}: fused vs the general combine", a, b)
        if output == "bf16":
            nan = np.isnan(fast[0].astype(np.float32))
        else:
            nan_code = {"mxfp8": 0xFF, "nvfp4": 0x7F}[output]
            nan = fast[1].view(np.uint8) == nan_code  # every block's scale: the NaN code
        assert nan.all() if idx is bad else not nan.any(), f"{output}, {name}: NaN blocks {nan.sum()} of {nan.size}"
