"""Block-scaled operands in the cuda-nccl front-end (docs/cuda-nccl.md, "Block-scaled operands").

mxfp8 / nvfp4 rows and weights are decoded to bf16 (``moe_ep_dequantize_bf16``)
for the layer's tensor-core path where bf16 holds them exactly:

- :func:`moe_ep_cuda_nccl.prims.operands` in-process on CPU tensors: the choice
  of operand dtype, the host check of the host-synchronised mode (one read; the
  weights' verdicts kept per tensor version), the static mode's NaN and record,
  the float32 fallback;
- the layer end to end in the CPU mode (2 ranks, gloo): every mode equals the
  float32 forward of the same values bit for bit (the CPU layer's bf16 operands
  run the float32 kernels), the synchronised mode also with values bf16 cannot
  hold (it falls back to float32), the static mode turns exactly the results
  that depend on them into NaN and records it.
On CUDA the same tests run on a GPU machine (``python scripts/gpu.py test``).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("moe_ep_cuda_nccl")

from moe_ep_cuda_nccl import prims as P  # noqa: E402
from moe_ep_spec import MoeEpConfig  # noqa: E402
from moe_ep_spec.formats import MoeFormat  # noqa: E402
from moe_ep_spec.inputs import random_world  # noqa: E402
from moe_ep_torch import formats as TF  # noqa: E402

import cuda_nccl_block_scaled_workers as BW  # noqa: E402
from torch_workers import run_ranks  # noqa: E402

TINY = BW.TINY


def _rows(fmt: str, tiny: bool = False, seed: int = 0) -> TF.TorchBlockScaled:
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((6, 64)).astype(np.float32))
    if tiny:
        x[2, :32] = TINY
    return P.quantize(x, MoeFormat(fmt))


def _weight(fmt: str, tiny: bool = False, seed: int = 1) -> TF.TorchBlockScaled:
    """An expert weight as stored: [E, N, K] = [2, 48, 64] blocked along K."""
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal((2, 48, 64)).astype(np.float32))
    if tiny:
        w[1, 5, 32:] = TINY
    return P.quantize(w, MoeFormat(fmt))


class _Spy:
    """Counts the bf16 decodes and the flags they were given (None, the record, or a fresh slot)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = []
        real = P.dequantize_bf16

        def spy(t, inexact=None, *, weight=False):
            self.calls.append(("none" if inexact is None else "record" if inexact.numel() == 1 and
                               inexact.data_ptr() == P._record(inexact.device).data_ptr() else "read", weight))
            return real(t, inexact, weight=weight)

        monkeypatch.setattr(P, "dequantize_bf16", spy)


@pytest.fixture(autouse=True)
def _fresh_state(monkeypatch):
    """Fresh verdicts and record; the kept weight decodes off (the tests of operands() count
    decodes), except in the tests of decoded_weight, which turn them on."""
    monkeypatch.setenv(P.WEIGHT_CACHE_ENV, "0")
    P._VERDICTS.clear()
    P.forget_decoded_weights()
    P.inexact_decodes(torch.device("cpu"), clear=True)
    yield
    P._VERDICTS.clear()
    P.forget_decoded_weights()


def _ops(x, w1, w2):
    return P._pending(x, False), P._pending(w1, True), P._pending(w2, True)


# ----------------------------------------------------------------------------- operands()


@pytest.mark.parametrize("host_check", [True, False])
def test_block_scaled_rows_and_weights_become_exact_bf16_operands(monkeypatch, host_check):
    spy = _Spy(monkeypatch)
    x, w1, w2 = _rows("mxfp8"), _weight("mxfp8"), _weight("nvfp4")
    bf16, xo, w1o, w2o = P.operands(*_ops(x, w1, w2), host_check=host_check)
    assert bf16 and xo.dtype == w1o.dtype == w2o.dtype == torch.bfloat16
    assert torch.equal(xo.float(), P.dequantize(x))
    assert torch.equal(w1o.float(), P.dequantize(w1).transpose(1, 2))  # [E, K, N]
    assert torch.equal(w2o.float(), P.dequantize(w2).transpose(1, 2))
    # nvfp4 is exact by construction: no flag; mxfp8 flags read on the host, or the static record.
    want = "read" if host_check else "record"
    assert spy.calls == [(want, False), (want, True), ("none", True)]
    assert not P.inexact_decodes(torch.device("cpu"))


def test_plain_bf16_operands_join_block_scaled_ones_on_tensor_cores():
    x = _rows("nvfp4")
    w1 = torch.randn(2, 64, 48).to(torch.bfloat16)
    w2 = _weight("mxfp8")
    bf16, xo, w1o, w2o = P.operands(*_ops(x, w1, w2), host_check=True)
    assert bf16 and w1o.data_ptr() == w1.data_ptr()
    assert torch.equal(xo.float(), P.dequantize(x))


def test_a_float32_operand_makes_every_operand_float32():
    x = _rows("mxfp8")
    bf16, xo, w1o, w2o = P.operands(*_ops(x, torch.randn(2, 64, 48), _weight("mxfp8")), host_check=True)
    assert not bf16 and xo.dtype == w1o.dtype == w2o.dtype == torch.float32
    assert torch.equal(xo, P.dequantize(x))


def test_synced_mode_falls_back_to_float32_when_a_row_value_is_not_a_bf16_value(monkeypatch):
    spy = _Spy(monkeypatch)
    x = _rows("mxfp8", tiny=True)
    bf16, xo, w1o, _ = P.operands(*_ops(x, _weight("mxfp8"), _weight("mxfp8")), host_check=True)
    assert not bf16 and xo.dtype == torch.float32
    assert torch.equal(xo, P.dequantize(x)) and (xo[2, :32] == TINY).all()  # exact, not rounded, not NaN
    assert torch.equal(w1o, P.dequantize(_weight("mxfp8")).transpose(1, 2))
    assert [c[0] for c in spy.calls] == ["read"] * 3  # one read covered all three
    assert not P.inexact_decodes(torch.device("cpu")), "a checked decode is not recorded: it was not used"


def test_synced_mode_keeps_a_weights_verdict_per_tensor_version(monkeypatch):
    spy = _Spy(monkeypatch)
    rows = torch.randn(6, 64).to(torch.bfloat16)
    w1, w2 = _weight("mxfp8", tiny=True), _weight("mxfp8")
    assert not P.operands(*_ops(rows, w1, w2), host_check=True)[0]  # inexact: float32
    assert len(spy.calls) == 2
    assert not P.operands(*_ops(rows, w1, w2), host_check=True)[0]
    assert len(spy.calls) == 2, "a weight known inexact goes to float32 without decoding to bf16"
    # An in-place update bumps the version: checked again, now exact.
    with torch.no_grad():
        good = _weight("mxfp8", seed=5)
        w1.data.copy_(good.data)
        w1.scale.copy_(good.scale)
    bf16, _, w1o, _ = P.operands(*_ops(rows, w1, w2), host_check=True)
    assert bf16 and torch.equal(w1o.float(), P.dequantize(good).transpose(1, 2))
    assert spy.calls[2:] == [("read", True), ("read", True)]
    # Known exact, bf16 rows: decoded without a read (the static record guards them).
    assert P.operands(*_ops(rows, w1, w2), host_check=True)[0]
    assert spy.calls[4:] == [("record", True), ("record", True)]
    # mxfp8 rows need a read every call: it then covers the weights too.
    assert P.operands(*_ops(_rows("mxfp8"), w1, w2), host_check=True)[0]
    assert spy.calls[6:] == [("read", False), ("read", True), ("read", True)]


def test_static_mode_decodes_to_nan_and_records_it(monkeypatch):
    x = _rows("mxfp8", tiny=True)
    bf16, xo, _, _ = P.operands(*_ops(x, _weight("mxfp8"), _weight("nvfp4")), host_check=False)
    assert bf16
    nan = torch.isnan(xo.float())
    assert nan[2, :32].all() and nan.sum() == 32, "exactly the values bf16 cannot hold are NaN"
    assert torch.equal(xo.float()[~nan], P.dequantize(x)[~nan])
    assert P.inexact_decodes(torch.device("cpu")) and not P.inexact_decodes(torch.device("cpu"))


def test_check_errors_raises_a_static_inexact_decode_with_the_rule():
    from moe_ep_cuda_nccl import static
    from moe_ep_spec import FormatError, MoeEpConfig

    x = _rows("mxfp8", tiny=True)
    P.operands(*_ops(x, _weight("mxfp8"), _weight("nvfp4")), host_check=False)
    group = object()  # no static call recorded flags for it: only the decode record speaks
    config = MoeEpConfig(num_experts=2, hidden=64, intermediate=32, num_topk=1, num_ranks=1)
    monkeypatch_rank = pytest.MonkeyPatch()
    monkeypatch_rank.setattr(static.dist, "get_rank", lambda g: 0)
    try:
        with pytest.raises(FormatError, match=r"block-scaled operands must decode to bf16 exactly .* host_sync=True"):
            static.check_errors(config, group)
        static.check_errors(config, group)  # the record was cleared
    finally:
        monkeypatch_rank.undo()


def test_the_device_exchange_path_takes_bf16_operands_for_block_scaled_inputs():
    """device_exchange makes its layer bf16 for block-scaled (and bf16) inputs and decodes them
    without a host check (its mode never synchronises); a float32 input keeps it float32."""
    from moe_ep_cuda_nccl import device_exchange as DX

    rows, w1, w2 = _rows("mxfp8"), _weight("mxfp8"), _weight("nvfp4")
    assert DX._bf16(rows, w1, w2) and not DX._bf16(P.dequantize(rows), w1, w2)
    bf16, xo, w1o, w2o = P.operands(*_ops(rows, w1, w2), host_check=False)
    assert bf16 and xo.dtype == w1o.dtype == w2o.dtype == torch.bfloat16
    assert torch.equal(w2o.float(), P.dequantize(_weight("nvfp4")).transpose(1, 2))


def test_received_block_scaled_rows_are_decoded_where_they_lie():
    """The device exchange keeps the received codes and scales as views of its byte rows (no
    copy: 0.53 ms of the mxfp8 forward at issue 14's shape), and the bf16 decode of those
    views equals the decode of the contiguous rows, the inexact flag included; other parts
    (a float32 cotangent) are unpacked as before."""
    from moe_ep_cuda_nccl import device_exchange as DX
    from moe_ep_torch import core
    from moe_ep_torch import formats as TF

    for fmt in ("mxfp8", "nvfp4"):
        rows = _rows(fmt)
        codes, scales = TF.raw(rows)
        extra = torch.randn(codes.shape[0], 5)
        blob, layout = core.pack_rows([codes, scales, extra], codes.shape[0])
        parts = DX._received_parts(blob, layout)
        assert parts[0].data_ptr() == blob.data_ptr() and parts[1].data_ptr() == blob.data_ptr() + codes.shape[1]
        assert parts[0].stride(0) == blob.shape[1], "the codes are a strided view of the received rows"
        assert torch.equal(parts[2], extra) and parts[2].is_contiguous()
        got_flag, want_flag = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        got = P.dequantize_bf16(core.rebuild(rows, parts[:2]), got_flag)
        want = P.dequantize_bf16(rows, want_flag)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), fmt
        assert torch.equal(got_flag, want_flag)


def test_weights_that_skip_decode_weight_are_still_the_stored_transpose():
    """moe_ep_torch.api.run_backward hands forward_operands the weights as given."""
    w = _weight("mxfp8")
    x, w1, w2 = P.NATIVE.forward_operands(None, _rows("mxfp8"), w, P.NATIVE.decode_weight(w))
    assert isinstance(w1, P.BlockScaledOperand) and w1.weight and w1.shape == (2, 64, 48)
    assert isinstance(w2, P.BlockScaledOperand) and w2.weight and not x.weight


# ----------------------------------------------------------------------------- decoded_weight()


def test_a_weights_bf16_decode_is_kept_while_the_weight_is_unchanged(monkeypatch):
    monkeypatch.setenv(P.WEIGHT_CACHE_ENV, "1")
    spy = _Spy(monkeypatch)
    rows = torch.randn(6, 64).to(torch.bfloat16)
    w1, w2 = _weight("mxfp8"), _weight("nvfp4")
    first = P.operands(*_ops(rows, w1, w2), host_check=False)
    assert first[0] and len(spy.calls) == 2
    again = P.operands(*_ops(rows, w1, w2), host_check=False)
    assert len(spy.calls) == 2, "the second call decodes nothing"
    assert again[2] is first[2] and again[3] is first[3]
    assert torch.equal(again[2].float(), P.dequantize(w1).transpose(1, 2))
    # An in-place update (an optimizer step) bumps the version: decoded again, new values.
    with torch.no_grad():
        other = _weight("mxfp8", seed=7)
        w1.data.copy_(other.data)
        w1.scale.copy_(other.scale)
    third = P.operands(*_ops(rows, w1, w2), host_check=False)
    assert len(spy.calls) == 3 and spy.calls[2][1], "only the changed weight is decoded again"
    assert torch.equal(third[2].float(), P.dequantize(other).transpose(1, 2))
    assert third[3] is first[3]
    assert not P.inexact_decodes(torch.device("cpu"))


def test_a_kept_decode_that_holds_nan_flags_every_call_that_uses_it(monkeypatch):
    monkeypatch.setenv(P.WEIGHT_CACHE_ENV, "1")
    rows = torch.randn(6, 64).to(torch.bfloat16)
    w1, w2 = _weight("mxfp8", tiny=True), _weight("mxfp8")
    for call in range(3):
        bf16, _, w1o, _ = P.operands(*_ops(rows, w1, w2), host_check=False)
        assert bf16 and torch.isnan(w1o.float()).sum() == 32
        assert P.inexact_decodes(torch.device("cpu")), f"call {call}: the record must say so every time"
    # The synchronised mode reads the kept decode's flag too (no new decode), and falls back to float32.
    spy = _Spy(monkeypatch)
    P._VERDICTS.clear()  # no verdict: the host reads the flags of this call
    bf16, _, w1o, _ = P.operands(*_ops(rows, w1, w2), host_check=True)
    assert spy.calls == [], "both weights come from their kept decodes"
    assert not bf16 and (w1o[1, 32:, 5] == TINY).all()


def test_kept_decodes_die_with_their_weight_and_can_be_turned_off(monkeypatch):
    import gc

    monkeypatch.setenv(P.WEIGHT_CACHE_ENV, "1")
    w = _weight("mxfp8")
    P.decoded_weight(w, None)
    assert len(P._DECODED) == 1
    del w
    gc.collect()
    assert not P._DECODED, "the decode is freed with its weight"
    monkeypatch.setenv(P.WEIGHT_CACHE_ENV, "0")
    w = _weight("mxfp8")
    assert P.decoded_weight(w, None) is not P.decoded_weight(w, None) and not P._DECODED
    monkeypatch.setenv(P.WEIGHT_CACHE_ENV, "yes")
    with pytest.raises(P.E.ConfigError, match=r"MOE_EP_CUDA_NCCL_WEIGHT_CACHE must be '0' .* got 'yes'"):
        P.decoded_weight(w, None)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_coded_weights_switches_check_their_values_and_never_apply_off_cuda(monkeypatch, fmt):
    """MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS and MOE_EP_CUDA_NCCL_NVFP4_WEIGHTS are read before any
    operand: a value other than '0' or '1' is a ConfigError with the rule and the value,
    whatever the weights' format. Unset (on by default) or '1', CPU weights never take the
    block-scaled-weights forward (it is a CUDA kernel)."""
    config = MoeEpConfig(num_experts=2, hidden=128, intermediate=128, num_topk=1, num_ranks=1)
    w = P.BlockScaledOperand(_weight(fmt), weight=True)
    x = torch.zeros((4, 128), dtype=torch.bfloat16)
    for env in (P.MXFP8_WEIGHTS_ENV, P.NVFP4_WEIGHTS_ENV):
        monkeypatch.delenv(env, raising=False)
    assert not P.coded_weights_path(config, x, w, w, host_check=True)
    for env in (P.MXFP8_WEIGHTS_ENV, P.NVFP4_WEIGHTS_ENV):
        monkeypatch.setenv(env, "1")
        assert not P.coded_weights_path(config, x, w, w, host_check=True)
        monkeypatch.setenv(env, "on")
        with pytest.raises(P.E.ConfigError, match=rf"{env} must be '0' .* or '1' .*; got 'on'"):
            P.coded_weights_path(config, x, w, w, host_check=True)
        monkeypatch.delenv(env)


def test_coded_weights_row_bound_is_the_kernels():
    """The front-end takes the block-scaled-weights forward up to the rows an expert where
    the kernels pick their few-rows variant (``mxw::kFewRowsPerExpert`` in the CUDA header,
    which the nvfp4 kernel uses too), so the decode never lands on the variant for many
    rows through cuda-nccl."""
    import pathlib
    import re

    gemm = pathlib.Path(__file__).resolve().parents[1] / "backends" / "native" / "src" / "cuda" / "gemm"
    header = gemm / "mxfp8_weights_gemm.cuh"
    found = re.findall(r"constexpr int64_t kFewRowsPerExpert = (\d+);", header.read_text())
    assert len(found) == 1, f"{header} should define kFewRowsPerExpert once; found {found}"
    assert P.CODED_WEIGHTS_MAX_ROWS_PER_EXPERT == int(found[0]), (
        f"prims.CODED_WEIGHTS_MAX_ROWS_PER_EXPERT is {P.CODED_WEIGHTS_MAX_ROWS_PER_EXPERT}, the kernel's few-rows "
        f"bound {found[0]}")
    nv = (gemm / "nvfp4_weights_gemm.cuh").read_text()
    assert "mxw::kFewRowsPerExpert" in nv and "kFewRowsPerExpert =" not in nv, (
        "the nvfp4 kernel picks its variant by the mxfp8 header's bound")


def test_dequantize_bf16_checks_its_flag():
    from moe_ep_spec.errors import DeviceError

    with pytest.raises(DeviceError, match=r"inexact must be an int32 tensor of >= 1 element on the codes' device cpu; "
                                          r"got torch.int64 with 1 elements on cpu"):
        P.dequantize_bf16(_rows("mxfp8"), torch.zeros(1, dtype=torch.int64))


# ----------------------------------------------------------------------------- the layer, CPU mode

CONFIG = MoeEpConfig(
    num_experts=8, hidden=64, intermediate=32, num_topk=2, num_ranks=2, max_tokens_per_rank=12,
    recv_capacity=40, expert_alignment=4,
)


def _ok(results):
    for r, res in enumerate(results):
        assert not (isinstance(res, tuple) and res and res[0] == "error"), f"rank {r} failed:\n{res[1]}"
    return results


@pytest.mark.parametrize("act_fmt,w_fmt", [("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("mxfp8", "bf16"), ("bf16", "mxfp8"),
                                           ("nvfp4", "mxfp8")])
def test_every_mode_equals_the_float32_forward_on_cpu(act_fmt, w_fmt):
    world = random_world(CONFIG, num_tokens=[12, 9], seed=3)
    results = _ok(run_ranks(BW.block_scaled_modes, 2, CONFIG, world, act_fmt, w_fmt, "", "cpu"))
    for r, res in enumerate(results):
        for mode in ("synced", "static", "device"):
            for key in (mode, f"{mode}_again"):
                np.testing.assert_array_equal(res[key], res["f32"], err_msg=f"rank {r}: {key} differs from float32")
            assert not res[f"inexact_{mode}"]
        assert res["bf16_layer"], f"rank {r}: no layer took bf16 operands"


@pytest.mark.parametrize("tiny", ["act", "fc1"])
def test_values_bf16_cannot_hold_fall_back_when_synced_and_are_nan_when_static(tiny):
    world = random_world(CONFIG, num_tokens=[12, 9], seed=4)
    results = _ok(run_ranks(BW.block_scaled_modes, 2, CONFIG, world, "mxfp8", "mxfp8", tiny, "cpu"))
    nan_rows = []
    for r, res in enumerate(results):
        assert np.isfinite(torch.from_numpy(res["f32"]).view(torch.bfloat16).float().numpy()).all()
        for key in ("synced", "synced_again"):  # the host check sends them to float32: exact
            np.testing.assert_array_equal(res[key], res["f32"], err_msg=f"rank {r}: {key}")
        assert not res["inexact_synced"]
        # The static modes (NCCL and the device exchange) never synchronise: bf16 operands as decoded.
        static = torch.from_numpy(res["static"]).view(torch.bfloat16).float().numpy()
        nan = np.isnan(static).all(axis=1)
        assert np.isnan(static[nan]).all() and not np.isnan(static[~nan]).any(), "whole rows NaN, the rest finite"
        for key in ("static", "static_again", "device", "device_again"):
            np.testing.assert_array_equal(res[key][~nan], res["f32"][~nan], err_msg=f"rank {r}: {key}, other rows")
            assert np.isnan(torch.from_numpy(res[key]).view(torch.bfloat16).float().numpy()[nan]).all(), key
        nan_rows.append(np.flatnonzero(nan))
    if tiny == "act":
        assert list(nan_rows[0]) == [0] and nan_rows[1].size == 0, nan_rows
    else:
        assert sum(len(n) for n in nan_rows) > 0, "some token reaches a local expert 0"
    assert any(res["inexact_static"] for res in results), "the static mode recorded the inexact decode"
    assert any(res["inexact_device"] for res in results), "the device-exchange mode recorded it too"


def _explicit_step_is_the_bf16_steps(results, fmt):
    for r, res in enumerate(results):
        for key in [k for k in res if "/block/" in k]:
            want = res[key.replace("/block/", "/bf16/")]
            assert np.array_equal(res[key], want), f"rank {r} {fmt}: {key} differs from the same step on bf16 values"
        assert np.abs(res["device/block/grad_fc1_weight"]).max() > 0


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_explicit_training_step_takes_block_scaled_inputs_in_every_mode(fmt):
    """moe_ep_forward_with_stash and moe_ep_backward with block-scaled inputs: output,
    stash and gradients equal, bit for bit, the same calls on the decoded values as bf16
    (synced, static and device-exchange modes, 2 ranks on CPU)."""
    world = random_world(CONFIG, num_tokens=[12, 9], seed=5)
    rng = np.random.default_rng(6)
    gy = [rng.standard_normal((w.activation.shape[0], CONFIG.hidden)).astype(np.float32) for w in world]
    _explicit_step_is_the_bf16_steps(_ok(run_ranks(BW.explicit_training_step, 2, CONFIG, world, gy, fmt, "cpu")), fmt)


# ----------------------------------------------------------------------------- CUDA (device machine)


def _gpu_ready() -> bool:
    try:
        import moe_ep_native

        return torch.cuda.is_available() and moe_ep_native.has_cuda() and moe_ep_native.has_nccl()
    except Exception:  # noqa: BLE001
        return False


needs_gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs a GPU and a native build with CUDA and NCCL")
CONFIG_EP1 = CONFIG.replace(num_ranks=1, num_experts=4)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits).view(torch.bfloat16).float().numpy()


@needs_gpu
@pytest.mark.parametrize("act_fmt,w_fmt", [("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("bf16", "mxfp8")])
def test_cuda_tensor_cores_take_block_scaled_operands(act_fmt, w_fmt):
    """EP 1 on cuda:0: the synced and static modes run the tensor-core path (bit for bit
    the same), within one bf16 step of the float32 kernels on the same values."""
    world = random_world(CONFIG_EP1, num_tokens=[12], seed=3)
    (res,) = _ok(run_ranks(BW.block_scaled_modes, 1, CONFIG_EP1, world, act_fmt, w_fmt, "", "cuda", backend="nccl"))
    assert res["bf16_layer"]
    for key in ("synced_again", "static", "static_again"):
        np.testing.assert_array_equal(res[key], res["synced"], err_msg=key)
    np.testing.assert_array_equal(res["device_again"], res["device"], err_msg="device exchange, again")
    want = _bf16_values(res["f32"])
    slack = 1e-4 * np.sqrt(np.mean(want**2))  # float32 summation order in sums that cancel
    for key in ("synced", "device"):  # both on tensor cores (the device exchange: bf16 operands too)
        got = _bf16_values(res[key])
        assert np.all(np.abs(got - want) <= 2.0**-7 * np.abs(want) + slack), f"{key}: more than one bf16 step"


@needs_gpu
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_cuda_explicit_training_step_takes_block_scaled_inputs(fmt):
    """The explicit training step on cuda:0 (tensor cores) in every mode: bit for bit the
    same calls on the decoded values as bf16."""
    world = random_world(CONFIG_EP1, num_tokens=[12], seed=5)
    gy = [np.random.default_rng(6).standard_normal((12, CONFIG_EP1.hidden)).astype(np.float32)]
    _explicit_step_is_the_bf16_steps(
        _ok(run_ranks(BW.explicit_training_step, 1, CONFIG_EP1, world, gy, fmt, "cuda", backend="nccl")), fmt)


@needs_gpu
@pytest.mark.parametrize("tiny", ["act", "fc1"])
def test_cuda_values_bf16_cannot_hold(tiny):
    world = random_world(CONFIG_EP1, num_tokens=[12], seed=4)
    (res,) = _ok(run_ranks(BW.block_scaled_modes, 1, CONFIG_EP1, world, "mxfp8", "mxfp8", tiny, "cuda", backend="nccl"))
    for key in ("synced", "synced_again"):
        np.testing.assert_array_equal(res[key], res["f32"], err_msg=f"{key}: the float32 fallback")
    static = _bf16_values(res["static"])
    nan = np.isnan(static).all(axis=1)
    assert nan.any() and not np.isnan(static[~nan]).any() and res["inexact_static"]
    device = _bf16_values(res["device"])  # the device exchange never synchronises either: as the static mode
    assert np.array_equal(np.isnan(device).all(axis=1), nan) and res["inexact_device"]
    if tiny == "act":
        assert list(np.flatnonzero(nan)) == [0]
