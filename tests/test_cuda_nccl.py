"""The cuda-nccl backend's PyTorch front-end.

On CPU (CI) the same front-end runs the native core's CPU kernels over gloo:
the static-shape mode against the host-synchronised one, bit for bit, its
error record, and the backend's availability report. The full conformance
table runs on CPU through ``MOE_EP_CUDA_NCCL_ON_CPU=1`` in
tests/test_conformance_suite.py. The CUDA tests (NCCL transport, CUDA-graph
capture and replay) need GPUs and run on a GPU machine
(``python scripts/gpu.py test``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("moe_ep_cuda_nccl")

import moe_ep_native  # noqa: E402
from moe_ep_spec import MoeEpConfig, get_backend  # noqa: E402
from moe_ep_spec.inputs import random_world  # noqa: E402

import cuda_nccl_workers as W  # noqa: E402
from torch_workers import run_ranks  # noqa: E402

CONFIG = MoeEpConfig(
    num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=2, max_tokens_per_rank=12,
    recv_capacity=40, expert_alignment=4, generate_c=True,
)


def _world(config: MoeEpConfig, seed: int, tokens=(12, 9)):
    world = random_world(config, num_tokens=list(tokens)[: config.num_ranks], seed=seed)
    rng = np.random.default_rng(seed + 100)
    grads = [rng.standard_normal((w.activation.shape[0], config.hidden)).astype(np.float32) for w in world]
    return world, grads


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_ready() -> bool:
    try:
        return moe_ep_native.has_cuda() and moe_ep_native.has_nccl()
    except Exception:  # noqa: BLE001
        return False


def _ok(results):
    for r, res in enumerate(results):
        assert not (isinstance(res, tuple) and res and res[0] == "error"), f"rank {r} failed:\n{res[1]}"
    return results


def test_unavailable_on_cpu_with_the_reason(monkeypatch) -> None:
    if _gpus() and _nccl_ready():
        pytest.skip("this machine can run cuda-nccl")
    monkeypatch.delenv("MOE_EP_CUDA_NCCL_ON_CPU", raising=False)
    backend = type(get_backend("cuda-nccl", require_available=False))()
    avail = backend.availability()
    assert not avail.available
    assert any(s in avail.reason for s in ("without CUDA", "without the NCCL transport", "no CUDA device")), avail.reason
    assert backend.capabilities.devices == ("cuda",)


def test_conformance_header_names_it_as_not_run_with_the_reason(tmp_path) -> None:
    if _gpus() and _nccl_ready():
        pytest.skip("this machine can run cuda-nccl")
    import os
    import subprocess
    import sys

    env = dict(os.environ, MOE_EP_LOAD_PLUGINS="reference,cuda-nccl")
    env.pop("MOE_EP_CUDA_NCCL_ON_CPU", None)
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep_spec.cli", "conformance", "--quick", "--ep-size", "1", "-k", "formats"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^backend cuda-nccl: not run, unavailable here: .*(without CUDA|NCCL|no CUDA device)", proc.stdout, re.M), (
        proc.stdout[:3000]
    )


def test_cpu_mode_is_available_and_declares_cpu(monkeypatch) -> None:
    monkeypatch.setenv("MOE_EP_CUDA_NCCL_ON_CPU", "1")
    from moe_ep_cuda_nccl.backend import CudaNcclBackend

    backend = CudaNcclBackend()
    assert backend.availability().available, backend.availability().reason
    assert "cpu" in backend.capabilities.devices


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"apply_topk_in_fc1": True, "gate_up_clamp": 1.5},
        {"combine_format": "mxfp8", "intermediate_format": "nvfp4"},
    ],
    ids=["bf16", "topk_in_fc1-clamp", "combine_mxfp8-intermediate_nvfp4"],
)
def test_static_mode_matches_the_synced_mode_bit_for_bit_on_cpu(variant) -> None:
    config = CONFIG.replace(**variant)
    world, grads = _world(config, seed=3)
    results = _ok(run_ranks(W.static_matches_synced, 2, config, world, grads, "cpu"))
    for rank, res in enumerate(results):
        for key, want in res["synced"].items():
            got = res["static"][key]
            assert np.array_equal(got, want, equal_nan=True), f"rank {rank}: static {key} differs from the synced mode"
        for key, got in res["autograd"].items():
            assert np.array_equal(got, res["static"][key]), f"rank {rank}: loss.backward() {key} differs from moe_ep_backward"
        assert (res["static"]["route_metadata"][:, 0] >= 0).any(), f"rank {rank}: no routed rows"


def test_static_mode_with_a_rank_of_no_tokens_matches_the_synced_mode_on_cpu() -> None:
    """A rank with T = 0 in the static mode (its empty route_pos reaches the native
    reduction as NULL): the same results as the synced mode on both ranks."""
    world, grads = _world(CONFIG, seed=5, tokens=(0, 9))
    results = _ok(run_ranks(W.static_matches_synced, 2, CONFIG, world, grads, "cpu"))
    assert results[0]["static"]["output"].shape[0] == 0
    for rank, res in enumerate(results):
        for key, want in res["synced"].items():
            assert np.array_equal(res["static"][key], want, equal_nan=True), f"rank {rank}: static {key} differs"


def test_static_mode_block_scaled_output_matches_the_synced_mode_on_cpu() -> None:
    config = CONFIG.replace(output_format="mxfp8", combine_format="mxfp8", intermediate_format="nvfp4")
    world, _ = _world(config, seed=5)
    results = _ok(run_ranks(W.static_block_scaled, 2, config, world, "cpu"))
    for rank, res in enumerate(results):
        assert res["data_equal"] and res["scale_equal"], f"rank {rank}: static mxfp8 output differs from the synced mode"


@pytest.mark.parametrize(
    "mutate,expected",
    [
        ("expert_id", r"RoutingIndexError: rank \d: topk_idx values must be in \[-1, num_experts\) = \[-1, 8\)"),
        ("overflow", r"CapacityError: rank \d: received rows after aligning .* must be <= recv_capacity = 40 on every rank; got 48"),
    ],
)
def test_static_mode_errors_make_every_output_nan_and_check_errors_raise(mutate: str, expected: str) -> None:
    # seed 6, 12 tokens a rank: aligned receive rows 32 and 28 (fit in 40); rank 1 routing
    # everything to expert 0 makes rank 0's 48
    world, _ = _world(CONFIG, seed=6, tokens=(12, 12))
    config = CONFIG
    results = _ok(run_ranks(W.static_errors, 2, config, world, mutate, "cpu"))


    for rank, res in enumerate(results):
        assert res["all_nan"], f"rank {rank}: output not NaN after a {mutate} on rank 1"
        assert re.search(expected, res["error"]), f"rank {rank}: check_errors gave {res['error']!r}"
        assert res["good_is_finite"], f"rank {rank}: a good call after the error was not finite"


def test_static_mode_needs_capacity_and_max_tokens() -> None:
    config = CONFIG.replace(recv_capacity=None, expert_alignment=1)
    world, grads = _world(config, seed=1)
    results = run_ranks(W.static_matches_synced, 2, config, world, grads, "cpu")
    for res in results:
        assert isinstance(res, tuple) and "ConfigError" in res[1] and "needs recv_capacity and max_tokens_per_rank" in res[1]


def test_transport_falls_back_to_torch_distributed_on_cpu() -> None:
    results = _ok(run_ranks(W.comm_exchange, 2, "cpu"))
    for rank, res in enumerate(results):
        assert res["gathered"] == [[r * 10 + j for j in range(5)] for r in range(2)]
        assert res["recv_ok"], f"rank {rank}: exchanged rows out of place"


def test_full_conformance_table_passes_in_cpu_mode(tmp_path) -> None:
    """The whole table (every operation, format and layout, EP 1, 2 and 4: 276 cases today) through the
    front-end, the native CPU kernels and gloo: what the GPU run checks on CUDA and NCCL."""
    import json
    import os
    import subprocess
    import sys

    report = tmp_path / "report.json"
    env = dict(os.environ, MOE_EP_CUDA_NCCL_ON_CPU="1", MOE_EP_LOAD_PLUGINS="reference,cuda-nccl")
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep_spec.cli", "conformance", "--backend", "cuda-nccl", "--report-json", str(report)],
        capture_output=True, text=True, timeout=1200, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(report.read_text())
    summary = re.search(r"cuda-nccl \S+: (\d+) passed, (\d+) failed, (\d+) skipped", proc.stdout)
    assert summary, proc.stdout[-2000:]
    passed, failed, skipped = map(int, summary.groups())
    assert passed >= 200 and failed == 0 and skipped == 0, summary.group(0)
    assert data, "empty report"


# ----------------------------------------------------------------------------- CUDA (device machine)

needs_gpus = pytest.mark.skipif(not (_gpus() and _nccl_ready()), reason="needs CUDA GPUs and a native build with NCCL")


def _gpu_config(world_size: int):
    """CONFIG over ``world_size`` ranks (4 experts each); skips when fewer GPUs are visible."""
    if _gpus() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    return CONFIG.replace(num_ranks=world_size, num_experts=4 * world_size)


@needs_gpus
@pytest.mark.parametrize("world_size", [1, 2])
def test_nccl_transport_exchanges_rows(world_size: int) -> None:
    if _gpus() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    results = _ok(run_ranks(W.comm_exchange, world_size, "cuda", backend="nccl"))
    for rank, res in enumerate(results):
        assert res["gathered"] == [[r * 10 + j for j in range(5)] for r in range(world_size)]
        assert res["recv_ok"], f"rank {rank}: exchanged rows out of place"


@needs_gpus
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_static_mode_matches_the_synced_mode(world_size: int) -> None:
    config = _gpu_config(world_size)
    world, grads = _world(config, seed=11)
    results = _ok(run_ranks(W.static_matches_synced, world_size, config, world, grads, "cuda", backend="nccl"))
    for rank, res in enumerate(results):
        for key, want in res["synced"].items():
            assert np.array_equal(res["static"][key], want, equal_nan=True), f"rank {rank}: static {key} differs"
        for key, got in res["autograd"].items():
            assert np.array_equal(got, res["static"][key]), f"rank {rank}: autograd {key} differs"


@needs_gpus
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_graph_captures_one_layer_and_replays_it_on_new_inputs(world_size: int) -> None:
    config = _gpu_config(world_size)
    worlds = [_world(config, seed=s, tokens=(12, 12)) for s in (21, 22, 23)]
    results = _ok(run_ranks(W.graph_replay, world_size, config, worlds, "cuda", backend="nccl"))
    for rank, res in enumerate(results):
        for i, flags in enumerate(res["replays"]):
            assert all(flags), f"rank {rank}: replay {i} differs from an eager call (output, 4 grads, finite): {flags}"
        assert res["distinct"], f"rank {rank}: replays on different inputs gave the same output"


@needs_gpus
def test_cuda_static_errors_raise_on_every_rank() -> None:
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    world, _ = _world(CONFIG, seed=6, tokens=(12, 12))
    results = _ok(run_ranks(W.static_errors, 2, CONFIG, world, "overflow", "cuda", backend="nccl"))
    for rank, res in enumerate(results):
        assert res["all_nan"] and "CapacityError" in res["error"] and res["good_is_finite"], res


@needs_gpus
@pytest.mark.parametrize("mode", [None, "bf16"], ids=["exact", "bf16_operands"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_module_paths_and_main_grad(monkeypatch, world_size: int, mode) -> None:
    """On CUDA, bf16 weights (the tensor-core path): MoeEpLayer's default path (the device
    exchange) agrees with the host-synchronised and static modes, and a float32 main_grad gets
    the weight gradient added in the weight-gradient GEMMs (init + the gradient the path
    writes into .grad, to that .grad's bf16 rounding), .grad left alone."""
    if _gpus() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    monkeypatch.setenv("MOE_EP_CUDA_NCCL_COMBINE", "slot")
    config = MODULE_CONFIG.replace(num_ranks=world_size, num_experts=4 * world_size, backward_operand_format=mode)
    world, grads = _world(config, seed=9)
    results = _ok(run_ranks(W.module_paths, world_size, config, world, grads, "cuda", "bfloat16", backend="nccl"))
    bf = lambda a: np.asarray(a).view(np.uint16).astype(np.uint32) << 16  # noqa: E731
    f32 = lambda a: bf(a).view(np.float32) if np.asarray(a).dtype == np.int16 else np.asarray(a, np.float32)  # noqa: E731
    for rank, res in enumerate(results):
        assert res["default_took_the_device_exchange"], f"rank {rank}: the default path did not make a device exchange"
        for path in ("synced", "static"):
            for key, want in res[path].items():
                got, want = f32(res["default"][key]), f32(want)
                scale = float(np.max(np.abs(want))) + 1e-30
                assert np.allclose(got, want, rtol=2.0**-7, atol=2.0**-8 * scale), f"rank {rank}: default {key} vs {path}"
        for path in ("default", "synced", "static"):
            got = res[f"{path}_main_grad"]
            assert got["grad_left_alone"], f"rank {rank}: {path}: .grad was written although main_grad exists"
            for i, name in ((0, "fc1"), (1, "fc2")):
                g = f32(res[path][f"grad_{name}_weight"])  # the bf16 .grad of the same path
                added = f32(got[f"main_{name}"]) - res["init"][i]
                tol = 2.0**-7 * np.abs(g) + 2.0**-20 * (np.abs(res["init"][i]) + np.max(np.abs(g)))
                assert np.all(np.abs(added - g) <= tol), f"rank {rank}: {path}: main_grad of {name} - init != grad"


@needs_gpus
@pytest.mark.parametrize("mode", [None, "bf16"], ids=["exact", "bf16_operands"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_cuda_module_bf16_weights_get_bf16_gradients_from_the_native_gemms(monkeypatch, world_size: int, mode) -> None:
    """On CUDA (the tensor-core path), bf16 weights without main_grad: the static and default
    paths ask the native backward for bf16 weight gradients and .grad is bf16; it agrees with
    the host-synchronised path's (float32 cast by autograd) to the tolerance the paths' own
    summation orders allow (test_cuda_module_paths_and_main_grad's)."""
    if _gpus() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    monkeypatch.setenv("MOE_EP_CUDA_NCCL_COMBINE", "slot")
    config = MODULE_CONFIG.replace(num_ranks=world_size, num_experts=4 * world_size, backward_operand_format=mode)
    world, grads = _world(config, seed=10)
    results = _ok(run_ranks(W.module_bf16_weight_grads, world_size, config, world, grads, "cuda", backend="nccl"))
    f32 = lambda a: (np.asarray(a).view(np.uint16).astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    for rank, res in enumerate(results):
        _check_bf16_weight_grads_asked(res, rank)
        for path in ("default", "static"):
            for key in ("grad_fc1_weight", "grad_fc2_weight"):
                got, want = f32(res[path][key]), f32(res["synced"][key])
                scale = float(np.max(np.abs(want))) + 1e-30
                assert np.allclose(got, want, rtol=2.0**-7, atol=2.0**-8 * scale), f"rank {rank}: {path}: {key}"


def _check_bf16_weight_grads_asked(res, rank: int) -> None:
    """The synced path got float32 weight gradients (cast by autograd); the default and static
    paths asked the native backward for bf16 ones and returned bf16 .grad."""
    assert res["synced"]["bf16_flags"] and not any(res["synced"]["bf16_flags"]), f"rank {rank}: synced: float32"
    for path in ("default", "static"):
        assert res[path]["bf16_flags"] and all(res[path]["bf16_flags"]), (
            f"rank {rank}: {path}: the native backward was not asked for bf16 weight gradients")
        assert res[path]["dtypes"] == ["torch.bfloat16", "torch.bfloat16"], f"rank {rank}: {path}"


# ----------------------------------------------------------------------------- MoeEpLayer's paths (CPU)

#: No recv_capacity: MoeEpLayer's default path sizes the static layout from max_tokens_per_rank.
MODULE_CONFIG = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=2, max_tokens_per_rank=12)


@pytest.mark.parametrize("mode", [None, "bf16"], ids=["exact", "bf16_operands"])
def test_module_default_path_is_the_device_exchange_and_main_grad_takes_the_weight_gradients(monkeypatch, mode) -> None:
    """MoeEpLayer(backend="cuda-nccl") with its defaults runs the device exchange in the static
    layout sized from max_tokens_per_rank: with the slot-order combine bit for bit the
    host-synchronised and static modes. Weights carrying a float32 main_grad get their gradient
    added there (in the native GEMMs, or one addition in the host-synchronised mode): init +
    the gradient the same path writes into .grad, bit for bit, and .grad stays None."""
    monkeypatch.setenv("MOE_EP_CUDA_NCCL_COMBINE", "slot")
    config = MODULE_CONFIG.replace(backward_operand_format=mode)
    world, grads = _world(config, seed=8)
    grads = [g.astype(np.float32).astype(np.float32) for g in grads]
    results = _ok(run_ranks(W.module_paths, 2, config, world, grads, "cpu", "float32"))
    for rank, res in enumerate(results):
        assert res["default_took_the_device_exchange"], f"rank {rank}: the default path did not make a device exchange"
        for path in ("synced", "static"):
            for key, want in res[path].items():
                assert np.array_equal(res["default"][key], want), f"rank {rank}: default {key} differs from {path}"
        for path in ("default", "synced", "static"):
            got = res[f"{path}_main_grad"]
            assert got["grad_left_alone"], f"rank {rank}: {path}: .grad was written although main_grad exists"
            for i, name in ((0, "fc1"), (1, "fc2")):
                want = res["init"][i] + res[path][f"grad_{name}_weight"]
                assert np.array_equal(got[f"main_{name}"], want), f"rank {rank}: {path}: main_grad of {name} != init + grad"
            assert np.array_equal(got["grad_activation"], res[path]["grad_activation"]), f"rank {rank}: {path}"


@pytest.mark.parametrize("mode", [None, "bf16"], ids=["exact", "bf16_operands"])
def test_module_bf16_weights_get_bf16_gradients_from_the_native_gemms(monkeypatch, mode) -> None:
    """bf16 weights without main_grad: the static and device-exchange paths ask the native
    backward for bf16 weight gradients (MOE_EP_BACKWARD_WEIGHT_GRADS_BF16: no cast pass) and
    .grad is, bit for bit, what the host-synchronised path's float32 gradient cast by autograd
    gives (the same float32 gradient rounded once to nearest even)."""
    monkeypatch.setenv("MOE_EP_CUDA_NCCL_COMBINE", "slot")
    config = MODULE_CONFIG.replace(backward_operand_format=mode)
    world, grads = _world(config, seed=9)
    results = _ok(run_ranks(W.module_bf16_weight_grads, 2, config, world, grads, "cpu"))
    for rank, res in enumerate(results):
        _check_bf16_weight_grads_asked(res, rank)
        for path in ("default", "static"):
            for key in ("grad_fc1_weight", "grad_fc2_weight", "grad_activation"):
                assert np.array_equal(res[path][key], res["synced"][key]), f"rank {rank}: {path}: {key} != synced's"


def test_main_grad_must_be_float32_of_the_weights_shape() -> None:
    from moe_ep_cuda_nccl.prims import main_grad_of
    from moe_ep_spec import DTypeError, ShapeError

    w = torch.nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert main_grad_of(w) is None
    w.main_grad = torch.zeros(2, 3)
    assert main_grad_of(w) is w.main_grad
    w.main_grad = torch.zeros(2, 3, dtype=torch.bfloat16)
    with pytest.raises(DTypeError, match="main_grad must be a contiguous float32 tensor"):
        main_grad_of(w)
    w.main_grad = torch.zeros(3, 2)
    with pytest.raises(ShapeError, match=r"main_grad must have the weight's shape \(2, 3\)"):
        main_grad_of(w)


def test_bf16_operand_backward_passes_the_conformance_cases_in_cpu_mode(tmp_path) -> None:
    """The quick table's backward cases in the bf16-operand mode (``bop_bf16``) through the
    front-end on CPU, the static ones over the device exchange."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, MOE_EP_CUDA_NCCL_ON_CPU="1", MOE_EP_LOAD_PLUGINS="reference,cuda-nccl",
               MOE_EP_CUDA_NCCL_EXCHANGE="device")
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep_spec.cli", "conformance", "--backend", "cuda-nccl", "--quick", "-k", "bop_bf16"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = re.search(r"cuda-nccl \S+: (\d+) passed, (\d+) failed", proc.stdout)
    assert summary and int(summary.group(1)) >= 8 and summary.group(2) == "0", proc.stdout[-2000:]
