"""The ``jax`` backend's grouped GEMMs at scale: ``jax.lax.ragged_dot`` lowers
densely on CPU and GPU (every row against every expert, ``[C, G, N]``), which at
the real shape (hidden 7168, intermediate 2048, 32 local experts, top-8, 4096
tokens) asked for tens of GiB. Above ``DENSE_GEMM_MAX_BYTES`` the XLA provider runs
one GEMM per (row tile, expert) pair instead. These tests check the tiled GEMMs'
values, the backend on them against the reference, and that they bound the
compiled program's temporary memory where the dense lowering does not."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import moe_ep_spec  # noqa: E402
from moe_ep_spec import MoeEpConfig  # noqa: E402
from moe_ep_spec.inputs import random_world  # noqa: E402
from moe_ep_spec.tolerance import compare  # noqa: E402

from moe_ep_jax import kernels as K  # noqa: E402
from moe_ep_jax.api import shard_moe_ep  # noqa: E402
from moe_ep_jax.backend import JaxBackend  # noqa: E402

REF = moe_ep_spec.get_backend("reference")


def _groups(rng, num_rows, num_groups):
    sizes = rng.multinomial(num_rows - 5, np.ones(num_groups) / num_groups).astype(np.int32)
    sizes[1] = 0  # an empty slab; the last 5 rows belong to no expert
    return sizes


def test_tiled_gemms_equal_the_per_expert_products():
    rng = np.random.default_rng(0)
    c, k, n, g = 600, 48, 40, 5  # three tiles, slab boundaries inside them
    sizes = _groups(rng, c, g)
    lhs = rng.normal(size=(c, k)).astype(np.float32)
    rhs = rng.normal(size=(g, k, n)).astype(np.float32)
    other = rng.normal(size=(c, n)).astype(np.float32)
    lhs[int(sizes[0]) - 1, 3] = np.nan  # the last row of expert 0 shares a tile with expert 2
    offs = np.concatenate([[0], np.cumsum(sizes)])
    want = np.zeros((c, n))
    want_t = np.zeros((g, k, n))
    for e in range(g):
        sl = slice(offs[e], offs[e + 1])
        with np.errstate(invalid="ignore"):
            want[sl] = lhs[sl].astype(np.float64) @ rhs[e]
            want_t[e] = lhs[sl].T.astype(np.float64) @ other[sl]
    got = np.asarray(jax.jit(K._gemm_tiled)(lhs, rhs, sizes))
    got_tr = np.asarray(jax.jit(lambda a, b, s: K._gemm_tiled(a, b, s, rhs_transposed=True))(
        lhs, np.swapaxes(rhs, 1, 2).copy(), sizes))
    got_t = np.asarray(jax.jit(K._gemm_t_tiled)(lhs, other, sizes))
    assert got.dtype == got_t.dtype == np.float32
    for a, b in ((got, want), (got_tr, want), (got_t, want_t)):
        assert np.array_equal(np.isnan(a), np.isnan(b))  # the NaN stays in its row / its expert
        ok = ~np.isnan(b)
        assert np.allclose(a[ok], b[ok], rtol=1e-5, atol=1e-4)
    assert not got[offs[-1]:].any()  # rows after the last slab are 0
    assert not got_t[1].any()  # the empty expert's gradient is 0
    # bf16 operands stay a bf16 GEMM with float32 accumulation: exact products.
    lb, rb = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
    got_b = np.asarray(jax.jit(K._gemm_tiled)(lb, rb, sizes))
    dense = np.asarray(jax.jit(K._gemm)(lb, rb, sizes))
    ok = ~np.isnan(dense)
    assert np.allclose(got_b[ok], dense[ok], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("mode", [None, "bf16"])
def test_backend_on_tiled_gemms_conforms(monkeypatch, mode):
    monkeypatch.setattr(K, "DENSE_GEMM_MAX_BYTES", 0)  # every grouped GEMM tiled
    backend = JaxBackend()  # its own executable cache: compiled with the patch in place
    config = MoeEpConfig(num_experts=8, hidden=96, intermediate=48, num_topk=3, num_ranks=2, generate_c=True,
                         apply_topk_in_fc1=False, gate_up_clamp=2.0, backward_operand_format=mode)
    world = random_world(config, num_tokens=[90, 40], routing="skewed", seed=3)  # slabs across 256-row tiles
    rng = np.random.default_rng(4)
    grad = [rng.normal(size=(w.topk_idx.shape[0], config.hidden)).astype(np.float32) for w in world]
    ref_fwd, fwd_budget = REF.forward_and_budget(config, world)
    got_fwd = backend.forward(config, world)
    for r in range(config.num_ranks):
        c = compare(f"rank {r} output", got_fwd[r].output, ref_fwd[r].output, fwd_budget[r].output)
        assert c.ok, c.describe()
    stash = [f.stash for f in ref_fwd]
    want, budget = REF.backward_and_budget(config, world, grad, stash)
    got = backend.backward(config, world, grad, stash)
    for r in range(config.num_ranks):
        for name in ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"):
            c = compare(f"rank {r} {name}", getattr(got[r], name), getattr(want[r], name), getattr(budget[r], name))
            assert c.ok, c.describe()


def _temp_bytes(config, num_tokens, grad: bool) -> int:
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    f = shard_moe_ep(config, mesh)
    h, i, e, k = config.hidden, config.intermediate, config.num_experts, config.num_topk
    s = jax.ShapeDtypeStruct
    args = (s((num_tokens, h), jnp.bfloat16), s((e, h, 2 * i), jnp.bfloat16), s((e, i, h), jnp.bfloat16),
            s((num_tokens, k), jnp.int32), s((num_tokens, k), jnp.float32))
    if grad:
        fn = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2, 4)))
    else:
        fn = jax.jit(f)
    return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward+backward"])
def test_temp_memory_is_rows_and_weights_not_rows_times_experts(monkeypatch, grad):
    """hidden 256, intermediate 128, 32 experts, top-8, 512 tokens (4096 routes): the
    program's temporary memory stays within a few float32 row buffers ``[C, H + 2I]``
    plus two float32 copies of the weights (XLA:CPU widens bf16 GEMM operands); the
    dense lowering (``[C, G, N]``) needs several times that."""
    config = MoeEpConfig(num_experts=32, hidden=256, intermediate=128, num_topk=8, max_tokens_per_rank=512)
    routes = 512 * 8
    weights_f32 = 32 * 3 * 256 * 128 * 4
    bound = 8 * routes * (256 + 2 * 128) * 4 + 2 * weights_f32
    monkeypatch.setattr(K, "DENSE_GEMM_MAX_BYTES", 0)  # as at the real shape: every grouped GEMM tiled
    tiled = _temp_bytes(config, 512, grad)
    monkeypatch.setattr(K, "DENSE_GEMM_MAX_BYTES", 1 << 62)
    dense = _temp_bytes(config, 512, grad)
    assert tiled <= bound, f"tiled grouped GEMMs: temp {tiled / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"
    assert dense > bound, f"the dense lowering fits the bound ({dense / 2**20:.1f} MiB): the test shows nothing"
