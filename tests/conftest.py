"""Test-suite configuration: which tests are ``slow``.

``python -m pytest -q`` runs everything (CI does), in parallel workers
(pytest-xdist, ``-n auto`` in pyproject.toml). The working loop is
``python -m pytest -q -m "not slow"``: it leaves out the tests listed here,
the large tables that re-run whole conformance matrices in CPU stand-ins for
GPU modes, fresh virtual environments and the like, each of which takes tens of
seconds or minutes on a small machine. The marks are kept here, by test file and
test name, rather than in the test files, so that those stay as their owners
write them.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

__all__ = ["SLOW"]

#: test file -> the tests marked slow: a function's name (every parametrisation of it),
#: one parametrisation (``name[id]``), or ``*`` for the whole file.
#: Times are one serial run on the 2-core development machine.
SLOW: Dict[str, Tuple[str, ...]] = {
    # cuda-nccl in its CPU test mode: the full conformance table (about 230 s) and the
    # static mode against the synced one (15 to 40 s each); its availability, header and
    # transport tests stay in the working loop.
    "test_cuda_nccl.py": (
        "test_full_conformance_table_passes_in_cpu_mode",
        "test_static_mode_matches_the_synced_mode_bit_for_bit_on_cpu",
        "test_static_mode_errors_make_every_output_nan_and_check_errors_raise",
        "test_static_mode_needs_capacity_and_max_tokens",
    ),
    # cuda-nccl's device exchange in its CPU test mode: EP 4 against the static mode
    # (about 20 s), the peer that never arrives (a timeout, 13 s), the sums and the
    # error records (9 to 12 s each); EP 2 against the static mode stays in the loop.
    "test_native_exchange.py": (
        "test_front_end_device_exchange_equals_the_static_mode_on_cpu[ep4]",
        "test_front_end_rank_sums_stay_close_and_fixed_parts_are_exact_on_cpu",
        "test_front_end_errors_make_every_output_nan_on_cpu",
        "test_front_end_peer_that_never_arrives_raises_transport_error_on_cpu",
        # the combine's round trip at EP 2, both combine orders (about 24 s each); EP 1 stays in the loop
        "test_front_end_round_trip_in_the_combine_is_bit_for_bit_on_cpu[slot-ep2]",
        "test_front_end_round_trip_in_the_combine_is_bit_for_bit_on_cpu[rank-ep2]",
    ),
    # cuda-nccl's block-scaled inputs in its CPU test mode, two ranks per test: every mode against the
    # float32 forward (35 to 45 s per format pair), the values bf16 cannot hold (about 25 s each) and
    # the explicit training step (about 25 s each); the parity checks that need a GPU skip here anyway
    "test_cuda_nccl_block_scaled.py": (
        "test_every_mode_equals_the_float32_forward_on_cpu",
        "test_values_bf16_cannot_hold_fall_back_when_synced_and_are_nan_when_static",
        "test_explicit_training_step_takes_block_scaled_inputs_in_every_mode",
    ),
    # cuda-nccl's world-level backend over the device exchange in its CPU test mode: the full
    # conformance table at EP 2 and 4 (about 35 s); the quick tables stay in the loop.
    "test_cuda_nccl_device_conformance.py": ("test_full_table_at_ep_2_and_4_over_the_device_exchange_on_cpu",),
    # the bench's cuda-nccl, jax and jax-ffi drivers in spawned rank processes (13 s of setup), and
    # the quick run's tests at EP 2 (a second bench run in spawned ranks, about 40 s; EP 1 stays)
    "test_bench.py": (
        "test_other_drivers_time_the_layer_on_cpu",
        "test_quick_run_report_schema[ep2]",
        "test_quick_run_measures_every_backend_and_baseline[ep2]",
        "test_quick_run_counts_the_bytes_of_the_token_rows[ep2]",
        "test_quick_run_prints_a_table_and_progress[ep2]",
        "test_quick_run_times_training_through_the_module[ep2]",
        "test_quick_run_writes_png_plots[ep2]",
        "test_quick_run_uses_one_name_per_baseline[ep2]",
        "test_quick_run_table_has_one_number_style[ep2]",
        "test_weight_read_is_the_weights_at_the_runs_copy_bandwidth[ep2]",
    ),
    # CMake configures of the CUDA build (about 30 s together; CI compiles it in full)
    "test_native_build.py": ("*",),
    # the full conformance table on the reference (about 85 s; CI's main job runs it too); every
    # mutant against the quick table (10 to 15 s each, about 30 of them); the reference judged
    # again after every mutant ran in its process (under xdist it runs them all again: about
    # 290 s); the mutant table's own checks and the failure-report tests stay in the loop
    "test_mutants.py": ("test_reference_passes[full]", "test_mutant_is_caught", "test_reference_unaffected_after_mutants"),
    # a fresh virtual environment, an install and the conformance suite (about 30 s)
    "test_example_plugin.py": ("*",),
    # the quick conformance table through the native XLA FFI targets (about 30 s)
    "test_jax_ffi.py": ("test_conformance_quick_table_at_ep_1_and_2",),
    # the torch backend's tests in spawned gloo ranks, 20 to 70 s each on a loaded 2-core machine: the
    # second and third of each family (one of each stays in the loop: the expert-id error on every
    # rank, the fc1 training step, the mxfp8 explicit training step), autograd.grad against
    # .backward() and torch.library.opcheck
    "test_torch_backend.py": (
        "test_a_bad_rank_makes_every_rank_raise_the_same_error[shape-ShapeError]",
        "test_a_bad_rank_makes_every_rank_raise_the_same_error[config-ConfigError]",
        "test_two_rank_gloo_training_step_matches_the_reference_backward[fc2]",
        "test_block_scaled_training_step_through_the_explicit_api[nvfp4]",
        "test_autograd_grad_equals_loss_backward",
        "test_opcheck_passes_on_one_rank",
    ),
    # the training example: two ranks for 20 steps (about 10 s plus start-up)
    "test_torch_module.py": ("test_training_example_loss_decreases",),
}


# How many tests -m / -k left out: counted where the tests are collected (each xdist worker
# collects them all), reported by the process that prints the summary.
_DESELECTED = pytest.StashKey[int]()
_WORKER_DESELECTED = pytest.StashKey[int]()


def pytest_deselected(items: List[pytest.Item]) -> None:
    if not items:
        return
    config = items[0].config
    config.stash[_DESELECTED] = config.stash.get(_DESELECTED, 0) + len(items)
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: tell the controller
        workeroutput["moe_ep_deselected"] = config.stash[_DESELECTED]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """xdist's controller: every worker deselects the same tests; keep one worker's count."""
    count = getattr(node, "workeroutput", {}).get("moe_ep_deselected")
    config = getattr(node, "config", None)
    if count is not None and config is not None:
        config.stash[_WORKER_DESELECTED] = max(config.stash.get(_WORKER_DESELECTED, 0), count)


def pytest_terminal_summary(terminalreporter: object, exitstatus: int, config: pytest.Config) -> None:
    """Under xdist the summary line has no "deselected" count (the workers deselect): say it here."""
    count = config.stash.get(_WORKER_DESELECTED, 0)
    if count:
        why = " and ".join(f"{opt} {value!r}" for opt, value in (("-m", config.option.markexpr),
                                                                   ("-k", config.option.keyword)) if value)
        terminalreporter.write_line(f"{count} deselected by {why or '-m/-k'}")  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    for item in items:
        names = SLOW.get(item.path.name)
        if names is None:
            continue
        function = getattr(item, "originalname", None) or item.name.split("[")[0]
        if "*" in names or function in names or item.name in names:
            item.add_marker(pytest.mark.slow)
