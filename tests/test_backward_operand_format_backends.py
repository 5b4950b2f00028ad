"""The pure-Python backends (``torch``, ``jax``) in both backward modes
(``backward_operand_format`` None and bf16, spec section 9.2), judged by the
reference's budgets (section 13.3), and each mode's results outside the other
mode's budgets (so a backend that ignores the field fails)."""

from __future__ import annotations

from typing import List

import numpy as np
import pytest

import moe_ep_spec
from moe_ep_spec import MoeEpConfig
from moe_ep_spec.formats import BF16
from moe_ep_spec.inputs import random_world
from moe_ep_spec.launch import call_world
from moe_ep_spec.tolerance import compare

REF = moe_ep_spec.get_backend("reference")
GRADS = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")

#: (id, config fields, tokens per rank, cotangent dtype, input format)
WORLDS = [
    ("ep1-fc1-f32", dict(num_ranks=1, num_experts=4, apply_topk_in_fc1=True), [9], np.float32, "bf16"),
    ("ep2-fc2-clamp-bf16cot", dict(num_ranks=2, num_experts=4, apply_topk_in_fc1=False, gate_up_clamp=1.5), [6, 3],
     BF16, "bf16"),
    ("ep2-fc1-static-f32-fp32in", dict(num_ranks=2, num_experts=4, max_tokens_per_rank=6, recv_capacity=32,
                                        expert_alignment=4), [6, 0], np.float32, "fp32"),
    ("ep1-fc2-mxfp8in-f16cot", dict(num_ranks=1, num_experts=2, apply_topk_in_fc1=False, num_topk=1), [5], np.float16,
     "mxfp8"),
]


def _backend(name: str):
    if name not in [b.name for b in moe_ep_spec.list_backends()]:
        pytest.skip(f"backend {name!r} is not installed")
    backend = moe_ep_spec.get_backend(name)
    if not backend.availability():
        pytest.skip(f"backend {name!r}: {backend.availability().reason}")
    return backend


def _case(fields, tokens, cot, input_format, mode):
    base = dict(hidden=64, intermediate=32, num_topk=2, generate_c=True)
    base.update(fields)
    config = MoeEpConfig(backward_operand_format=mode, **base)
    world = random_world(config, num_tokens=tokens, input_format=input_format, routing="unused_mixed", seed=len(tokens))
    rng = np.random.default_rng(sum(tokens))
    grad = [rng.normal(size=(w.topk_idx.shape[0], config.hidden)).astype(cot) for w in world]
    stash = [f.stash for f in REF.forward(config, world)]
    return config, world, grad, stash


def _ratios(config, world, grad, stash, got) -> List[float]:
    want, budget = REF.backward_and_budget(config, world, grad, stash)
    out = []
    for r in range(config.num_ranks):
        for name in GRADS:
            c = compare(f"rank {r} {name}", getattr(got[r], name), getattr(want[r], name), getattr(budget[r], name))
            assert c.ok or not np.isnan(c.ratio), c.describe()
            out.append((c.ratio, c))
    return out


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize(
    "backend_name,device",
    [("torch", "cpu"), ("jax", None),
     pytest.param("torch", "cuda", marks=pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device"))],
    ids=["torch", "jax", "torch-cuda"],
)
@pytest.mark.parametrize("wid,fields,tokens,cot,input_format", WORLDS, ids=[w[0] for w in WORLDS])
def test_backend_backward_in_both_modes(backend_name, device, wid, fields, tokens, cot, input_format):
    """torch on CUDA runs its bf16 GEMMs with float32 output for bf16 inputs."""
    backend = _backend(backend_name)
    results = {}
    for mode in (None, "bf16"):
        config, world, grad, stash = _case(fields, tokens, cot, input_format, mode)
        reason = backend.capabilities.unsupported(config, "backward")
        if reason:
            pytest.skip(reason)
        devices = None if device is None else [device] * config.num_ranks
        got = call_world(backend, "backward", config, world, grad, stash, devices=devices)
        for ratio, c in _ratios(config, world, grad, stash, got):
            assert c.ok, f"{backend_name} {wid} mode {mode}: {c.describe()}"
        results[mode] = (config, world, grad, stash, got)
    # Each mode's results against the other mode's budgets: the modes must differ
    # beyond them (the bf16 rounding points are really applied, and only in bf16).
    for judged, produced in ((None, "bf16"), ("bf16", None)):
        config, world, grad, stash, _ = results[judged]
        got = results[produced][4]
        worst = max(ratio for ratio, _ in _ratios(config, world, grad, stash, got))
        assert worst > 1.0, f"{backend_name} {wid}: mode {produced}'s results pass mode {judged}'s budgets"


def test_jax_rounding_points_are_not_converts_xla_may_remove() -> None:
    # XLA on GPU (xla_allow_excess_precision, on by default) removes an f32 -> bf16 -> f32
    # convert pair, so a rounding point written as astype(bfloat16) is skipped there (the
    # bf16-operand backward then computed the exact mode's numbers on a GPU, off the
    # budgets). The XLA provider rounds with moe_ep_jax.formats.round_to_bf16 (integer
    # arithmetic on the bits): its lowered bf16-operand backward converts nothing to bf16.
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from moe_ep_jax.kernels import XlaKernels

    cfg = MoeEpConfig(num_experts=2, hidden=8, intermediate=4, num_topk=1, num_ranks=1,
                      backward_operand_format="bf16", gate_up_clamp=1.0)
    rng = np.random.default_rng(0)
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    args = (f32(6, 8), f32(6), f32(2, 8, 8), f32(2, 4, 8), f32(6, 8).astype(jnp.bfloat16), f32(6, 8),
            jnp.asarray([3, 3], jnp.int32))
    text = jax.jit(lambda x, w, w1, w2, c, dy, gs: XlaKernels().expert_backward(cfg, x, w, w1, w2, c, dy, gs)).lower(
        *args).as_text()
    converts = [ln for ln in text.splitlines() if "stablehlo.convert " in ln and "xbf16>" in ln.split("->")[-1]]
    assert not converts, "rounding points as converts to bf16 (XLA on GPU may drop them):\n" + "\n".join(converts)
