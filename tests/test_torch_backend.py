"""The ``torch`` backend: formats, autograd over gloo, opcheck, errors.

The conformance suite runs on it as well (the main job in .ci/run)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import moe_ep_spec  # noqa: E402
from moe_ep_spec import MoeEpConfig, Stash  # noqa: E402
from moe_ep_spec.formats import BF16, quantize  # noqa: E402
from moe_ep_spec.inputs import random_world  # noqa: E402
from moe_ep_spec.tolerance import compare  # noqa: E402

import torch_workers as W  # noqa: E402
from moe_ep_torch import formats as TF  # noqa: E402

REF = moe_ep_spec.get_backend("reference")


@pytest.mark.parametrize("rows", [0, 1, 3])
def test_packed_rows_round_trip_at_any_row_count(rows: int) -> None:
    """Per-route payload parts of odd byte widths (int32 metadata, 33 mxfp8 codes, one
    scale byte, a float32 weight) survive pack/unpack, one row included (a one-row slice
    keeps the blob's row stride, which a dtype view cannot take)."""
    from moe_ep_torch import core

    g = torch.Generator().manual_seed(rows)
    parts = [
        torch.randint(-5, 5, (rows, 3), dtype=torch.int32, generator=g),
        torch.randint(0, 255, (rows, 33), dtype=torch.uint8, generator=g),
        torch.randint(0, 255, (rows, 1), dtype=torch.uint8, generator=g),
        torch.randn(rows, generator=g),
    ]
    blob, layout = core.pack_rows(parts, rows)
    assert blob.shape == (rows, 12 + 33 + 1 + 4)
    back = core.unpack_rows(blob, layout)
    for i, (a, b) in enumerate(zip(parts, back)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"part {i} changed in the round trip"


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_torch_formats_match_the_spec_bit_for_bit(fmt: str) -> None:
    golden = np.load(__file__.rsplit("/", 1)[0] + "/data/golden_formats.npz")
    rng = np.random.default_rng(0)
    inputs = [golden[k] for k in golden.files if k.endswith("/input")]
    inputs.append((rng.standard_normal((64, 45)) * 10.0 ** rng.integers(-6, 6, (64, 1))).astype(np.float32))
    for x in inputs:
        ours = TF.quantize(torch.from_numpy(x), fmt)
        spec = quantize(x, fmt)
        assert np.array_equal(ours.data.view(torch.uint8).numpy(), spec.data_codes())
        assert np.array_equal(ours.scale.view(torch.uint8).numpy(), spec.scale_codes())
        assert np.array_equal(TF.dequantize(ours).numpy(), spec.dequantize(np.float32), equal_nan=True)


def _world(config: MoeEpConfig, tokens, seed: int = 0):
    return random_world(config, num_tokens=tokens, input_format="fp32", seed=seed, routing="unused_mixed")


def _grads(config, world, seed):
    rng = np.random.default_rng(seed)
    # bf16-exact cotangents: the bf16 output's gradient is then exactly this
    return [rng.standard_normal((w.activation.shape[0], config.hidden)).astype(np.float32).astype(BF16).astype(np.float32) for w in world]


@pytest.mark.parametrize("weights_in", ["fc1", "fc2"])
def test_two_rank_gloo_training_step_matches_the_reference_backward(weights_in: str) -> None:
    config = MoeEpConfig(
        num_experts=8, hidden=32, intermediate=16, num_topk=2, num_ranks=2, gate_up_clamp=0.75,
        apply_topk_in_fc1=weights_in == "fc1",
    )
    world = _world(config, [5, 3])
    gy = _grads(config, world, 1)
    got = W.run_ranks(W.training_step, 2, config, world, gy)
    assert not any(isinstance(g, tuple) for g in got), got
    cfg_c = config.replace(generate_c=True)
    ref_fwd = REF.forward(cfg_c, world)
    fwd_budget = REF.forward_budget(cfg_c, world)
    # The backward is judged from the stash the op itself made (and used), which
    # must in turn be within the forward's budget of the reference's.
    stash = [Stash(g["fc1_c"].view(BF16), g["route_metadata"]) for g in got]
    ref = REF.backward(cfg_c, world, gy, stash)
    budget = REF.backward_budget(cfg_c, world, gy, stash)
    for r in range(2):
        c = compare(f"rank {r} output", got[r]["output"].view(BF16), ref_fwd[r].output, fwd_budget[r].output)
        assert c.ok, c.describe()
        c = compare(f"rank {r} fc1_c", stash[r].fc1_c, ref_fwd[r].fc1_c, fwd_budget[r].fc1_c)
        assert c.ok, c.describe()
        assert np.array_equal(stash[r].route_metadata, ref_fwd[r].route_metadata)
        for name in ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"):
            c = compare(f"rank {r} {name}", got[r][name], getattr(ref[r], name), getattr(budget[r], name))
            assert c.ok, c.describe()


def test_autograd_grad_equals_loss_backward() -> None:
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2)
    world = _world(config, [4, 6], seed=3)
    gy = _grads(config, world, 4)
    a = W.run_ranks(W.autograd_grad, 2, config, world, gy)
    b = W.run_ranks(W.training_step, 2, config, world, gy)
    for r in range(2):
        for name in a[r]:  # the same loss, the same gradients
            assert np.array_equal(a[r][name], b[r][name]), (r, name)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_training_step_through_the_explicit_api(fmt: str) -> None:
    """moe_ep_forward_with_stash and moe_ep_backward take block-scaled inputs (autograd does
    not): the output, the stash and every gradient equal, bit for bit, those of the same
    step on the decoded values through the custom ops (every rounding is straight-through)."""
    config = MoeEpConfig(num_experts=4, hidden=64, intermediate=32, num_topk=2, num_ranks=2, gate_up_clamp=1.0)
    world = _world(config, [5, 3], seed=11)
    gy = _grads(config, world, 12)
    got = W.run_ranks(W.block_scaled_explicit_step, 2, config, world, gy, fmt)
    for r in range(2):
        assert isinstance(got[r], dict), f"rank {r} failed: {got[r]}"
        for name in ("output", "fc1_c", "route_metadata", "grad_activation", "grad_fc1_weight", "grad_fc2_weight",
                     "grad_topk_weights"):
            assert np.array_equal(got[r][name], got[r]["ref_" + name]), (
                f"rank {r} {fmt}: {name} through the explicit API differs from the decoded inputs' custom ops")
        assert np.isfinite(got[r]["grad_fc1_weight"]).all() and np.abs(got[r]["grad_fc1_weight"]).max() > 0
        stash_error, autograd_error = got[r]["errors"]
        assert stash_error.startswith("StashError: fc1_c must have") and "rows (the routes of topk_idx)" in stash_error
        assert autograd_error.startswith("CapabilityError:") and "moe_ep_forward_with_stash" in autograd_error


def test_opcheck_passes_on_one_rank() -> None:
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=1, gate_up_clamp=1.0)
    world = _world(config, [6], seed=5)
    assert W.run_ranks(W.opcheck, 1, config, world) == ["ok"]


@pytest.mark.parametrize(
    "mutate, expected",
    [
        ("expert_id", "RoutingIndexError"),
        ("shape", "ShapeError"),
        ("config", "ConfigError"),
    ],
)
def test_a_bad_rank_makes_every_rank_raise_the_same_error(mutate: str, expected: str) -> None:
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2)
    world = _world(config, [4, 4], seed=7)
    got = W.run_ranks(W.expect_error, 2, config, world, 1, mutate)
    assert all(g.startswith(expected + ":") for g in got), got
    if mutate == "expert_id":
        assert "rank 1: topk_idx values must be in [-1, num_experts) = [-1, 4); got 4 at (token 0, slot 0)" in got[1]
        assert "rank 0: rank 1 rejected its inputs with RoutingIndexError" in got[0]
    if mutate == "config":
        assert "the ranks disagree on the configuration" in got[0]


def test_process_group_size_must_match_num_ranks() -> None:
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2)
    world = _world(config, [4, 4], seed=8)
    one_rank = config.replace(num_ranks=1, num_experts=2)
    got = W.run_ranks(W.expect_error, 2, one_rank, world, -1, "none")
    assert all(g.startswith("ConfigError: rank ") and "the process group's size must equal num_ranks = 1; got 2" in g for g in got), got


CUDA2 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (run on the device machine)"
)


@CUDA2
def test_nccl_rejects_tensors_on_the_wrong_device() -> None:
    config = MoeEpConfig(num_experts=4, hidden=32, intermediate=16, num_topk=2, num_ranks=2)
    world = _world(config, [4, 4], seed=9)
    got = W.run_ranks(W.cuda_device_errors, 2, config, world, backend="nccl")
    for r, lines in enumerate(got):
        assert lines[0] == f"cpu tensors: DeviceError: rank {r}: an NCCL process group needs CUDA tensors; got tensors on cpu", lines
        assert lines[1].startswith(f"weight on cpu: DeviceError: rank {r}: fc1_weight must be on the activation's device cuda:{r}; got cpu"), lines


@CUDA2
def test_cuda_bf16_forward_uses_tensor_core_gemms_and_matches_the_reference() -> None:
    config = MoeEpConfig(num_experts=8, hidden=128, intermediate=64, num_topk=2, num_ranks=2)
    world = random_world(config, num_tokens=[33, 20], seed=10)  # bf16 activation and weights
    got = W.run_ranks(W.cuda_grouped_gemm_used, 2, config, world, backend="nccl")
    ref = REF.forward(config, world)
    budget = REF.forward_budget(config, world)
    for r in range(2):
        # A bf16 tensor-core GEMM with float32 output: grouped where torch can, else per expert.
        assert got[r]["path"] in ("grouped_mm", "mm_out_fp32"), got[r]
        print(f"rank {r}: GEMM path {got[r]['path']} ({got[r]['reason'] or 'grouped_mm ran'})")
        c = compare(f"rank {r} output", got[r]["output"].view(BF16), ref[r].output, budget[r].output)
        assert c.ok, c.describe()
