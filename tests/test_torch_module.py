"""``moe_ep_torch.module.MoeEpLayer``: the layer as a torch.nn.Module, and the
training example that uses it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("moe_ep_torch")

import moe_ep_spec  # noqa: E402
from moe_ep_spec import MoeEpConfig, RankInputs  # noqa: E402
from moe_ep_spec.tolerance import compare  # noqa: E402

from torch_module_workers import layer_checks  # noqa: E402
from torch_workers import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _ok(results):
    for r in results:
        assert not (isinstance(r, tuple) and r and r[0] == "error"), r[1]
    return results


FORMATS = (None, "mxfp8")


@pytest.fixture(scope="module")
def two_ranks():
    """One 2-rank world for every check: the layer's forward with each weight
    format, and the constructor's errors."""
    config = MoeEpConfig(num_experts=4, hidden=64, intermediate=32, num_topk=2, num_ranks=2)
    error_config = MoeEpConfig(num_experts=2, hidden=32, intermediate=32, num_topk=1, num_ranks=2)
    results = _ok(run_ranks(layer_checks, 2, config, FORMATS, error_config, timeout=180))
    return config, results


@pytest.mark.parametrize("weight_format", FORMATS)
def test_layer_matches_the_reference_and_trains_every_input(two_ranks, weight_format):
    config, all_results = two_ranks
    results = [r["forward"][weight_format] for r in all_results]
    fmt = weight_format
    world = []
    for r in results:
        fc1, fc2 = r["fc1"], r["fc2"]
        if fmt is not None:  # what the layer hands the op: the weights quantized along their reduction axis
            fc1, fc2 = moe_ep_spec.quantize(fc1.astype(np.float32), fmt, axis=1), moe_ep_spec.quantize(
                fc2.astype(np.float32), fmt, axis=1
            )
        world.append(RankInputs(r["activation"], fc1, fc2, r["topk_idx"], r["topk_weights"].astype(np.float32)))
    ref, budgets = moe_ep_spec.get_backend("reference").forward_and_budget(config.replace(generate_c=False), world)
    for rank, r in enumerate(results):
        assert r["param_shapes"] == [(2, 64, 64), (2, 32, 64)]
        got = compare(f"rank {rank}", r["output"], ref[rank].output, budgets[rank].output)
        assert got.ok, got.describe()
        # with and without gradients (straight-through fake quantization vs block-scaled weights): same values
        assert (r["output"].view(np.uint16) == r["output_nograd"].view(np.uint16)).all()
        assert r["grads"] == [True, True, True, True]
        assert "backend='torch'" in r["repr"]


def test_layer_constructor_errors(two_ranks):
    errors = two_ranks[1][0]["errors"]
    texts = [f"{name}: {message}" for name, message in errors]
    assert texts[0].startswith("ConfigError: backend must be one of the torch-based backends ('torch', 'cuda-nccl'); got 'jax'")
    assert texts[1].startswith("DTypeError: dtype of the expert parameters must be torch.bfloat16 or torch.float32")
    assert texts[2] == "ConfigError: the process group's size must equal config.num_ranks = 3; got 2"
    assert texts[3].startswith("ConfigError: weight_format mxfp8 needs hidden to be a multiple of 32")
    assert texts[4].startswith("ConfigError: host_sync=False (the static-shape mode) needs backend 'cuda-nccl'")


def test_training_example_loss_decreases():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_moe_torch.py"), "--steps", "20", "--timeout", "60"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decreased" in proc.stdout.splitlines()[-1]


def test_a_backend_whose_torch_layer_cannot_load_is_unavailable_not_an_import_error(monkeypatch):
    """MoeEpLayer's backend lookup turns a torch layer that fails to load (a missing module,
    a native library of another ABI) into BackendUnavailableError naming the backend and the
    cause, as `moe-ep` reports an unavailable backend."""
    from moe_ep_spec import BackendUnavailableError, NativeError
    from moe_ep_torch import module

    for exc in (ImportError("No module named 'moe_ep_native'"), NativeError("libmoe_ep_native ABI version must be 9")):
        class Broken:
            def torch_layer(self, host_sync, exc=exc):
                raise exc

        monkeypatch.setattr(module, "get_backend", lambda name, require_available=False: Broken())
        with pytest.raises(BackendUnavailableError) as info:
            module._torch_layer("cuda-nccl", None)
        assert info.value.name == "cuda-nccl" and str(exc) in info.value.reason, info.value
        assert str(info.value).startswith("MoeEp backend 'cuda-nccl' is not available: its torch layer did not load: ")
