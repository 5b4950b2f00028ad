"""The ``jax`` backend: formats, jit, custom_vjp gradients, collectives, errors.

XLA exposes one CPU device unless ``--xla_force_host_platform_device_count`` is
in ``XLA_FLAGS`` when jax starts, so this module sets it (4 devices) before
anything imports jax. The conformance suite runs on the backend as well (the
main job in .ci/run); these tests cover what the suite cannot see: the JAX-facing
API inside ``jax.shard_map``, ``jax.grad``, the compiled HLO, vmap, the mesh axis.
"""

from __future__ import annotations

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

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import moe_ep_spec  # noqa: E402
from moe_ep_spec import MoeEpConfig, Stash  # noqa: E402
from moe_ep_spec.formats import BF16, dequantize, quantize, round_to_bf16  # noqa: E402
from moe_ep_spec.inputs import random_world  # noqa: E402
from moe_ep_spec.tolerance import compare  # noqa: E402

from moe_ep_jax import api as A  # noqa: E402
from moe_ep_jax import formats as F  # noqa: E402
from moe_ep_jax.backend import XLA_CPU_FAST_COMPILE, JaxBackend  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REF = moe_ep_spec.get_backend("reference")
NDEV = len(jax.devices())

pytestmark = pytest.mark.skipif(
    NDEV < 2, reason=f"jax was imported before this module could ask XLA for 4 CPU devices; it has {NDEV}"
)
#: Tests of a 4-rank world (on CPU there are 4 devices; a 2-GPU machine runs the others).
needs4 = pytest.mark.skipif(NDEV < 4, reason=f"needs 4 devices; jax has {NDEV}")

_COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "collective-permute", "reduce-scatter", "ragged-all-to-all")


# ----------------------------------------------------------------------------- helpers


def _mesh(n: int, axis: str = "ep") -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (axis,))


def _compile(fn, *args):
    """jit + compile with the backend's fast CPU compile options (same arithmetic)."""
    opts = XLA_CPU_FAST_COMPILE if jax.default_backend() == "cpu" else None
    lowered = jax.jit(fn).lower(*args)
    return lowered.compile(opts) if opts else lowered.compile()


def _put(mesh: Mesh, per_rank, rows: int, fill=0):
    """Pad every rank's ``[rows_r, ...]`` to ``rows`` and shard the concatenation over ``ep``."""
    padded = []
    for a in per_rank:
        a = np.asarray(a)
        out = np.full((rows,) + a.shape[1:], fill, dtype=a.dtype)
        out[: a.shape[0]] = a
        padded.append(out)
    return jax.device_put(np.concatenate(padded), NamedSharding(mesh, P(mesh.axis_names[0])))


def _world_args(mesh: Mesh, world, rows: int):
    return [
        _put(mesh, [w.activation for w in world], rows),
        _put(mesh, [w.fc1_weight for w in world], world[0].fc1_weight.shape[0]),
        _put(mesh, [w.fc2_weight for w in world], world[0].fc2_weight.shape[0]),
        _put(mesh, [np.asarray(w.topk_idx, np.int32) for w in world], rows, -1),
        _put(mesh, [w.topk_weights for w in world], rows),
    ]


def _sharded_world(n: int, rows: int, num_experts: int, hidden: int, intermediate: int, seed: int):
    """``(config, world, mesh, args)``: a top-2 layer over ``n`` devices with ``rows``
    tokens a rank, random float32 inputs, and those inputs sharded over the mesh."""
    config = MoeEpConfig(num_experts=num_experts, hidden=hidden, intermediate=intermediate, num_topk=2, num_ranks=n,
                         max_tokens_per_rank=rows)
    world = random_world(config, num_tokens=rows, input_format="fp32", seed=seed)
    mesh = _mesh(n)
    return config, world, mesh, _world_args(mesh, world, rows)


def _bf16_exact(rng, shape):
    """float32 values that are bf16 numbers: a bf16 output's cotangent is then exactly this."""
    return rng.standard_normal(shape).astype(np.float32).astype(BF16).astype(np.float32)


def _collectives(compiled_text: str) -> Counter:
    found = []
    for line in compiled_text.splitlines():
        line = line.split(", metadata=")[0]
        found += re.findall(r"\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", line)
    return Counter(found)


def _stash(c, meta, n):
    cap = c.shape[0] // n
    out = []
    for r in range(n):
        m = np.asarray(meta[r * cap : (r + 1) * cap])
        keep = int((m[:, 0] >= 0).sum())
        out.append(Stash(np.asarray(c[r * cap : r * cap + keep]), m[:keep].astype(np.int32)))
    return out


# ----------------------------------------------------------------------------- formats


from format_inputs import format_inputs as _format_inputs  # noqa: E402 - the shared corner-case inputs
from format_inputs import golden_codes as _golden_codes  # noqa: E402


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4"])
def test_formats_match_the_spec_bit_for_bit(fmt: str) -> None:
    golden, inputs = _format_inputs()
    quant = jax.jit(F.quantize, static_argnums=(1, 2))
    for x in inputs:
        finite = ~np.isnan(x)
        if fmt == "bf16":
            ours = np.asarray(quant(x, fmt, -1)).view(np.uint16)
            assert np.array_equal(ours[finite], round_to_bf16(x).view(np.uint16)[finite])
            continue
        for axis in (1, 0):
            ours = quant(x, fmt, axis)
            spec = quantize(x, fmt, axis=axis)
            assert np.array_equal(np.asarray(ours.data).view(np.uint8), spec.data_codes()), (fmt, axis, x.shape)
            assert np.array_equal(np.asarray(ours.scale).view(np.uint8), spec.scale_codes()), (fmt, axis, x.shape)
            decoded = np.asarray(jax.jit(F.dequantize)(ours))
            assert np.array_equal(decoded, spec.dequantize(np.float32), equal_nan=True)
    # the independent golden vectors, code by code
    rows = inputs[0]
    want = _golden_codes(golden, fmt)
    ours = quant(rows, fmt, -1)
    if fmt == "bf16":
        assert np.array_equal(np.asarray(ours).view(np.uint16), want[0])
    else:
        assert np.array_equal(np.asarray(ours.data).view(np.uint8), want[0])
        assert np.array_equal(np.asarray(ours.scale).view(np.uint8), want[1])


def test_every_code_decodes_like_the_spec() -> None:
    from moe_ep_spec.formats import FLOAT8_E4M3, FLOAT8_E8M0

    rng = np.random.default_rng(1)
    scales = np.array([0, 1, 2, 100, 127, 130, 200, 254, 255], dtype=np.uint8)
    data = np.tile(np.arange(256, dtype=np.uint8), (len(scales), 1))  # every E4M3 code under every scale
    mx = moe_ep_spec.BlockScaledTensor(
        data=data.view(FLOAT8_E4M3), scale=np.repeat(scales[:, None], 8, axis=1).view(FLOAT8_E8M0),
        format="mxfp8", shape=data.shape, axis=1,
    )
    nv = moe_ep_spec.BlockScaledTensor(  # random nibbles under every E4M3 scale code, NaN and negatives included
        data=rng.integers(0, 256, (256, 8), dtype=np.uint8), scale=np.arange(256, dtype=np.uint8)[:, None].view(FLOAT8_E4M3),
        format="nvfp4", shape=(256, 16), axis=1,
    )
    for t in (mx, nv):
        ours = np.asarray(jax.jit(F.dequantize)(F.from_numpy(t)))
        assert np.array_equal(ours, dequantize(t, np.float32), equal_nan=True), t.format
        back = F.to_numpy(F.from_numpy(t))
        assert np.array_equal(back.data_codes(), t.data_codes()) and np.array_equal(back.scale_codes(), t.scale_codes())


# ----------------------------------------------------------------------------- forward and gradients


@needs4
def test_jit_forward_in_block_formats_matches_the_reference() -> None:
    n, rows = 4, 6
    config = MoeEpConfig(
        num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=n, max_tokens_per_rank=rows,
        output_format="nvfp4", combine_format="mxfp8", intermediate_format="nvfp4", gate_up_clamp=0.75,
        apply_topk_in_fc1=False, generate_c=True, recv_capacity=40, expert_alignment=4,
    )
    world = random_world(config, num_tokens=[6, 0, 3, 5], input_format="mxfp8", weight_format="nvfp4", seed=3)
    mesh = _mesh(n)
    args = [  # the global block-scaled activation, every rank padded to 6 rows of zero codes
        F.BlockScaled(_put(mesh, [w.activation.data for w in world], rows), _put(mesh, [w.activation.scale for w in world], rows),
                      "mxfp8", config.hidden, 1),
    ]
    for name in ("fc1_weight", "fc2_weight"):
        ts = [getattr(w, name) for w in world]
        args.append(F.BlockScaled(_put(mesh, [t.data for t in ts], ts[0].data.shape[0]),
                                  _put(mesh, [t.scale for t in ts], ts[0].scale.shape[0]), "nvfp4", ts[0].shape[1], 1))
    args += [_put(mesh, [np.asarray(w.topk_idx, np.int32) for w in world], rows, -1), _put(mesh, [w.topk_weights for w in world], rows)]
    fn = jax.shard_map(partial(A.moe_ep, config=config), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    out, c, meta = _compile(fn, *args)(*args)
    ref, budget = REF.forward(config, world), REF.forward_budget(config, world)
    for r, t in enumerate([6, 0, 3, 5]):
        got = moe_ep_spec.BlockScaledTensor(
            np.asarray(out.data[r * rows : r * rows + t]), np.asarray(out.scale[r * rows : r * rows + t]),
            "nvfp4", (t, config.hidden), 1)
        assert compare(f"rank {r}", got, ref[r].output, budget[r].output).ok
        assert np.array_equal(np.asarray(meta[r * 40 : (r + 1) * 40]), ref[r].route_metadata)
        assert compare(f"rank {r} c", np.asarray(c[r * 40 : (r + 1) * 40]), ref[r].fc1_c, budget[r].fc1_c).ok
        assert not np.asarray(out.data[r * rows + t : (r + 1) * rows]).view(np.uint8).any()  # padding tokens: zero


@pytest.mark.parametrize("weights_in", ["fc1", "fc2"])
@needs4
def test_jax_grad_equals_the_spec_backward(weights_in: str) -> None:
    n, rows, counts = 4, 6, [5, 2, 6, 0]
    config = MoeEpConfig(
        num_experts=8, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows,
        gate_up_clamp=0.75, apply_topk_in_fc1=weights_in == "fc1",
    )
    cfg_c = config.replace(generate_c=True)
    world = random_world(config, num_tokens=counts, input_format="fp32", seed=4, routing="unused_mixed")
    rng = np.random.default_rng(5)
    gy = [_bf16_exact(rng, (t, config.hidden)) for t in counts]
    mesh = _mesh(n)
    args = _world_args(mesh, world, rows) + [_put(mesh, gy, rows)]

    @partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def step(x, w1, w2, idx, tw, g):
        def loss(x, w1, w2, tw):
            return jnp.sum(A.moe_ep(x, w1, w2, idx, tw, config=config).astype(jnp.float32) * g)

        grads = jax.grad(loss, argnums=(0, 1, 2, 3))(x, w1, w2, tw)
        _, c, meta = A.moe_ep(x, w1, w2, idx, tw, config=cfg_c)
        return grads, c, meta

    (gx, g1, g2, gw), c, meta = _compile(step, *args)(*args)
    stash = _stash(c, meta, n)
    want = REF.backward(cfg_c, world, gy, stash)
    budget = REF.backward_budget(cfg_c, world, gy, stash)
    el = config.num_local_experts
    for r, t in enumerate(counts):
        got = {
            "grad_activation": np.asarray(gx[r * rows : r * rows + t]),
            "grad_fc1_weight": np.asarray(g1[r * el : (r + 1) * el]),
            "grad_fc2_weight": np.asarray(g2[r * el : (r + 1) * el]),
            "grad_topk_weights": np.asarray(gw[r * rows : r * rows + t]),
        }
        for name, value in got.items():
            assert value.dtype == np.float32
            c_ = compare(f"rank {r} {name}", value, getattr(want[r], name), getattr(budget[r], name))
            assert c_.ok, c_.describe()
        # padding rows (tokens that do not exist) get exactly zero gradients
        assert not np.asarray(gx[r * rows + t : (r + 1) * rows]).any()
        assert not np.asarray(gw[r * rows + t : (r + 1) * rows]).any()


@needs4
def test_two_stacked_layers_keep_separate_routing_state() -> None:
    n, rows = 4, 4
    config = MoeEpConfig(num_experts=8, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows)
    w_a = random_world(config, num_tokens=rows, input_format="fp32", seed=6, routing="skewed")
    w_b = random_world(config, num_tokens=rows, input_format="fp32", seed=7, routing="unused_mixed")
    mesh = _mesh(n)
    a, b = _world_args(mesh, w_a, rows), _world_args(mesh, w_b, rows)
    g = _put(mesh, [_bf16_exact(np.random.default_rng(8), (rows, config.hidden)) for _ in range(n)], rows)
    layer = partial(A.moe_ep, config=config)

    @partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def both(x, a1, a2, ai, aw, b1, b2, bi, bw, g):
        def stacked(x, a1, a2, aw, b1, b2, bw):
            h = layer(x, a1, a2, ai, aw).astype(jnp.float32)
            return layer(h, b1, b2, bi, bw)

        out, pull = jax.vjp(stacked, x, a1, a2, aw, b1, b2, bw)
        grads = pull(g.astype(out.dtype))
        # the same, one layer at a time: each VJP must use its own plan
        h, pull_a = jax.vjp(lambda x, a1, a2, aw: layer(x, a1, a2, ai, aw), x, a1, a2, aw)
        out_b, pull_b = jax.vjp(lambda h, b1, b2, bw: layer(h, b1, b2, bi, bw), h.astype(jnp.float32), b1, b2, bw)
        gh, gb1, gb2, gbw = pull_b(g.astype(out_b.dtype))
        gx, ga1, ga2, gaw = pull_a(gh.astype(h.dtype))
        return out, grads, out_b, (gx, ga1, ga2, gaw, gb1, gb2, gbw)

    args = [a[0], a[1], a[2], a[3], a[4], b[1], b[2], b[3], b[4], g]
    out, grads, out_b, chained = _compile(both, *args)(*args)
    assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(out_b).view(np.uint16))
    for got, want in zip(grads, chained):
        assert np.array_equal(np.asarray(got), np.asarray(want))
    assert np.asarray(grads[1]).any() and np.asarray(grads[4]).any()


def test_layered_dispatch_and_combine_differentiate_like_the_spec() -> None:
    n, rows = 2, 5
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows,
                         recv_capacity=24, expert_alignment=4)
    world = random_world(config, num_tokens=rows, input_format="fp32", seed=9, routing="unused_mixed")
    mesh = _mesh(n)
    x, _, _, idx, tw = _world_args(mesh, world, rows)
    gy = [_bf16_exact(np.random.default_rng(10), (rows, config.hidden)) for _ in range(n)]
    g = _put(mesh, gy, rows)

    @partial(jax.shard_map, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    def step(x, idx, tw, g):
        def loss(x, tw):
            toks, w, handle = A.ep_dispatch(x, idx, tw, config=config)
            y = toks * w[:, None]  # the caller applies the router weight
            return jnp.sum(A.ep_combine(y, handle).astype(jnp.float32) * g)

        toks, w, handle = A.ep_dispatch(x, idx, tw, config=config)
        return jax.grad(loss, argnums=(0, 1))(x, tw), toks, w, handle

    (gx, gw), toks, w, handle = _compile(step, x, idx, tw, g)(x, idx, tw, g)
    # expected: combine_backward gives dL/dy per row; y = tokens * w
    ref_d = REF.dispatch(config, [moe_ep_spec.DispatchInputs(wd.activation, wd.topk_idx, wd.topk_weights) for wd in world])
    handles = [d.handle for d in ref_d]
    dy = REF.combine_backward(config, handles, gy)
    g_tok = [(d_ * d.topk_weights[:, None]).astype(np.float32) for d_, d in zip(dy, ref_d)]
    g_w = [np.sum(d_ * np.asarray(d.tokens, np.float32), axis=1).astype(np.float32) for d_, d in zip(dy, ref_d)]
    want = REF.dispatch_backward(config, handles, g_tok, g_w)
    budget = REF.dispatch_backward_budget(config, handles, g_tok, g_w)
    for r in range(n):
        assert np.array_equal(np.asarray(handle.route_metadata[r * 24 : (r + 1) * 24]), handles[r].route_metadata)
        assert np.array_equal(np.asarray(toks[r * 24 : (r + 1) * 24]), ref_d[r].tokens)
        for name, got in (("grad_tokens", gx[r * rows : (r + 1) * rows]), ("grad_topk_weights", gw[r * rows : (r + 1) * rows])):
            # products in float32: one extra rounding per term on top of the slot sum's budget
            b = getattr(budget[r], name) + 2 * 2.0**-24 * np.abs(getattr(want[r], name)) + 1e-6
            c_ = compare(f"rank {r} {name}", np.asarray(got), getattr(want[r], name), b)
            assert c_.ok, c_.describe()


# ----------------------------------------------------------------------------- the compiled program


@needs4
def test_compiled_hlo_has_exactly_the_designed_collectives() -> None:
    n, rows = 4, 4
    config, world, mesh, args = _sharded_world(n, rows, 8, 32, 16, seed=11)

    fwd = jax.shard_map(partial(A.moe_ep, config=config), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))

    def train(x, w1, w2, idx, tw):
        out, pull = jax.vjp(lambda x, w1, w2, tw: A.moe_ep(x, w1, w2, idx, tw, config=config), x, w1, w2, tw)
        return out, pull(out)

    train_sm = jax.shard_map(train, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    # forward: the plan's all-gather of [E + 1] int32, dispatch and combine all-to-alls
    assert _collectives(_compile(fwd, *args).as_text()) == Counter({"all-gather": 1, "all-to-all": 2})
    # backward adds two all-to-alls (cotangent out, gradients back); the plan is reused
    assert _collectives(_compile(train_sm, *args).as_text()) == Counter({"all-gather": 1, "all-to-all": 4})
    # no resharding around the op: inputs and outputs stay sharded over ep
    compiled = _compile(fwd, *args)
    assert all(s.spec == P("ep") for s in jax.tree_util.tree_leaves(compiled.output_shardings))
    # the ragged exchange (GPU/TPU) lowers to ragged_all_to_all only; XLA:CPU cannot compile it
    ragged = jax.shard_map(partial(_train_ragged, config=config), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    text = jax.jit(ragged).lower(*args).as_text()
    assert text.count("stablehlo.all_to_all") + text.count('"all_to_all"') == 0
    assert len(re.findall(r"ragged_all_to_all", text)) >= 4


def _train_ragged(x, w1, w2, idx, tw, *, config):
    out, pull = jax.vjp(lambda x, w1, w2, tw: A.moe_ep(x, w1, w2, idx, tw, config=config, exchange="ragged"), x, w1, w2, tw)
    return out, pull(out)


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda", "tpu"), reason="ragged_all_to_all needs a GPU or TPU")
@pytest.mark.parametrize("layout", ["dynamic", "static"])
def test_ragged_and_capacity_exchanges_agree_bit_for_bit(layout: str) -> None:
    n, rows = 2, 8
    config = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=n, max_tokens_per_rank=rows,
                         output_format="bf16", combine_format="nvfp4", gate_up_clamp=0.75, generate_c=True)
    if layout == "static":
        config = config.replace(recv_capacity=40, expert_alignment=8)
    world = random_world(config, num_tokens=[8, 3], input_format="fp32", seed=12, routing="unused_mixed")
    mesh = _mesh(n)
    args = _world_args(mesh, world, rows)
    g = _put(mesh, [_bf16_exact(np.random.default_rng(13), (rows, config.hidden)) for _ in range(n)], rows)

    def body(x, w1, w2, idx, tw, g, *, exchange):
        plain = config.replace(generate_c=False)
        out, pull = jax.vjp(lambda x, w1, w2, tw: A.moe_ep(x, w1, w2, idx, tw, config=plain, exchange=exchange), x, w1, w2, tw)
        grads = pull(g.astype(out.dtype))
        _, c, meta = A.moe_ep(x, w1, w2, idx, tw, config=config, exchange=exchange)
        toks, w, handle = A.ep_dispatch(x, idx, tw, config=config, exchange=exchange)
        back = A.ep_combine(toks * 2.0, handle)
        return out, c, meta, grads, toks, w, handle.route_metadata, back

    outs = {}
    for ex in ("ragged", "capacity"):
        fn = jax.shard_map(partial(body, exchange=ex), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
        outs[ex] = jax.tree_util.tree_leaves(jax.tree_util.tree_map(np.asarray, _compile(fn, *args, g)(*args, g)))
    for a, b in zip(outs["ragged"], outs["capacity"]):
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
    ref = REF.forward(config, world)
    out = outs["ragged"][0]
    budget = REF.forward_budget(config, world)
    for r in range(n):
        assert compare(f"rank {r}", out[r * rows : r * rows + [8, 3][r]], ref[r].output, budget[r].output).ok


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda", "tpu"), reason="ragged_all_to_all needs a GPU or TPU")
def test_ragged_exchange_compiles_to_exactly_the_designed_collectives() -> None:
    n, rows = 2, 8
    config, world, mesh, args = _sharded_world(n, rows, 8, 64, 32, seed=14)
    fwd = jax.shard_map(partial(A.moe_ep, config=config, exchange="ragged"), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    train = jax.shard_map(partial(_train_ragged, config=config), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    assert _collectives(_compile(fwd, *args).as_text()) == Counter({"all-gather": 1, "ragged-all-to-all": 2})
    assert _collectives(_compile(train, *args).as_text()) == Counter({"all-gather": 1, "ragged-all-to-all": 4})


# ----------------------------------------------------------------------------- errors


def test_vmap_raises_a_capability_error() -> None:
    n, rows = 2, 4
    config, world, mesh, (x, w1, w2, idx, tw) = _sharded_world(n, rows, 4, 32, 16, seed=13)
    batched = jax.vmap(lambda x, w1, w2, i, t: A.moe_ep(x, w1, w2, i, t, config=config), in_axes=(0, None, None, 0, 0))
    fn = jax.shard_map(batched, mesh=mesh, in_specs=(P(None, "ep"), P("ep"), P("ep"), P(None, "ep"), P(None, "ep")),
                       out_specs=P(None, "ep"))
    stack = lambda a: jnp.stack([a, a])  # noqa: E731
    with pytest.raises(moe_ep_spec.CapabilityError, match="capability: jax.vmap"):
        jax.jit(fn).lower(stack(x), w1, w2, stack(idx), stack(tw))


def test_a_mesh_without_the_ep_axis_is_a_config_error() -> None:
    n, rows = 2, 4
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows)
    world = random_world(config, num_tokens=rows, input_format="fp32", seed=14)
    data_mesh = _mesh(n, "data")
    args = _world_args(data_mesh, world, rows)
    fn = jax.shard_map(partial(A.moe_ep, config=config), mesh=data_mesh, in_specs=P("data"), out_specs=P("data"))
    with pytest.raises(moe_ep_spec.ConfigError, match="axis_name must name the EP axis.*got 'ep'") as err:
        jax.jit(fn).lower(*args)
    assert err.value.field == "axis_name"
    with pytest.raises(moe_ep_spec.ConfigError, match="mesh must have the EP axis 'ep'.*axes \\('data',\\)"):
        A.shard_moe_ep(config, data_mesh)
    with pytest.raises(moe_ep_spec.ConfigError, match="must equal num_ranks = 4; got 2"):
        A.shard_moe_ep(config.replace(num_ranks=4), _mesh(2))
    # outside any shard_map the axis is unbound too
    w = world[0]
    with pytest.raises(moe_ep_spec.ConfigError, match="axis_name"):
        A.moe_ep(jnp.asarray(w.activation), jnp.asarray(w.fc1_weight), jnp.asarray(w.fc2_weight),
                 jnp.asarray(w.topk_idx), jnp.asarray(w.topk_weights), config=config)


def test_trace_time_checks_raise_the_spec_errors() -> None:
    n, rows = 2, 4
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows)
    world = random_world(config, num_tokens=rows, input_format="fp32", seed=15)
    mesh = _mesh(n)
    x, w1, w2, idx, tw = _world_args(mesh, world, rows)
    run = lambda cfg, *a: jax.jit(jax.shard_map(partial(A.moe_ep, config=cfg), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))).lower(*a)  # noqa: E731
    with pytest.raises(moe_ep_spec.CapacityError, match="max_tokens_per_rank = 2; got 4"):
        run(config.replace(max_tokens_per_rank=2), x, w1, w2, idx, tw)
    with pytest.raises(moe_ep_spec.ShapeError, match=r"topk_idx must have shape \(num_tokens, num_topk\) = \(4, 2\)"):
        run(config, x, w1, w2, idx[:, :1], tw)
    with pytest.raises(moe_ep_spec.DTypeError, match="topk_idx must have dtype in"):
        run(config, x, w1, w2, idx.astype(jnp.float32), tw)
    with pytest.raises(moe_ep_spec.ShapeError, match="fc1_weight must have shape"):
        run(config, x, w2, w2, idx, tw)


def test_data_dependent_errors_poison_every_rank_inside_jit_and_raise_on_the_host() -> None:
    n, rows = 2, 4
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=n, max_tokens_per_rank=rows,
                         recv_capacity=4)
    world = random_world(config, num_tokens=rows, input_format="fp32", seed=16, routing="one_rank")
    mesh = _mesh(n)
    args = _world_args(mesh, world, rows)
    fn = jax.shard_map(partial(A.moe_ep, config=config), mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    out = np.asarray(_compile(fn, *args)(*args)).astype(np.float32)
    assert np.isnan(out).all()  # rank 0 receives 16 routes into 4 rows: nothing moves, NaN everywhere
    with pytest.raises(moe_ep_spec.CapacityError, match="rank 0: received rows .* <= recv_capacity = 4; got 16"):
        A.check_routing(config, [w.topk_idx for w in world])
    bad = [w.topk_idx.copy() for w in world]
    bad[1][2, 1] = 7
    with pytest.raises(moe_ep_spec.RoutingIndexError, match=r"rank 1: .* got 7 at \(token 2, slot 1\)"):
        A.check_routing(config, bad)


def test_world_backend_rejects_bad_input_before_running() -> None:
    backend = JaxBackend()
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2, max_tokens_per_rank=8,
                         generate_c=True)
    world = random_world(config, num_tokens=[3, 5], input_format="bf16", seed=17)
    fwd = backend.forward(config, world)
    grads = [np.ones((w.topk_idx.shape[0], 32), np.float32) for w in world]
    stash = [f.stash for f in fwd]
    broken = [Stash(s.fc1_c, s.route_metadata.copy()) for s in stash]
    broken[1].route_metadata[0, 2] += 1
    before = len(backend._cache)
    with pytest.raises(moe_ep_spec.StashError, match="rank 1: route_metadata must equal"):
        backend.backward(config, world, grads, broken)
    with pytest.raises(moe_ep_spec.CapacityError, match="recv_capacity = 2"):
        backend.dispatch(config.replace(recv_capacity=2),
                         [moe_ep_spec.DispatchInputs(w.activation, w.topk_idx, w.topk_weights) for w in world])
    assert len(backend._cache) == before  # nothing was compiled or run
    got = backend.backward(config, world, grads, stash)
    want, budget = REF.backward(config, world, grads, stash), REF.backward_budget(config, world, grads, stash)
    for r in range(2):
        assert compare("gx", got[r].grad_activation, want[r].grad_activation, budget[r].grad_activation).ok
    # `moe-ep conformance --isolate` pickles world backends into fresh processes
    import pickle

    clone = pickle.loads(pickle.dumps(backend))
    assert not clone._cache and clone.forward(config, world)[1].output.shape == (5, 32)


def test_plugin_is_light_and_availability_explains_too_few_devices() -> None:
    code = (
        "import sys, moe_ep_jax.plugin, moe_ep_jax.backend; assert 'jax' not in sys.modules, 'jax imported early'\n"
        "import jax; jax.devices()\n"  # started before the backend could ask for devices: one CPU device
        "from moe_ep_jax.backend import JaxBackend\n"
        "a = JaxBackend().availability(); print(bool(a)); print(a.reason)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "False" and "1 CPU device" in lines[1] and "XLA_FLAGS" in lines[1]
    assert JaxBackend().availability()
    assert JaxBackend().capabilities.num_ranks == tuple(range(1, NDEV + 1))


# ----------------------------------------------------------------------------- docs


@needs4
def test_the_docs_example_runs() -> None:
    text = (ROOT / "docs" / "jax.md").read_text()
    blocks = re.findall(r"```python jax-example\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/jax.md has no ```python jax-example blocks"
    namespace: dict = {"__name__": "jax_doc_example"}
    exec(compile("\n".join(blocks), "docs/jax.md", "exec"), namespace)
    assert namespace["ok"] is True
