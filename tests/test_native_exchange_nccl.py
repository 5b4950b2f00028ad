"""The NCCL peer provider of the device exchange (``moe_ep_layer_set_peers_nccl``,
``moe_ep_native.exchange.connect_nccl`` / ``connect``, ``MOE_EP_EXCHANGE_PEERS``).

CPU (CI): the answers without a GPU: a CPU layer and a build without the NCCL
transport say MOE_EP_ERR_UNSUPPORTED with the reason, a layer without an exchange
is an argument error, ``connect`` and the front-end validate the provider name,
and ``connect(..., "auto")`` takes the ``/dev/shm`` loopback for CPU layers.

CUDA + NCCL (skipped without a GPU and a build with the NCCL transport): at EP 1
on one GPU, dispatch and combine over the NCCL symmetric window give the very
bits of the same layer over its own region (the IPC loopback), over two steps;
a communicator that does not match the layer and a second call are refused;
closing the layer releases the window before the communicator; the front-end
with ``MOE_EP_EXCHANGE_PEERS=nccl`` at EP 1 equals the static mode.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

pytest.importorskip("moe_ep_native")

from moe_ep_native._capi import Status, call, has_cuda, has_nccl  # noqa: E402
from moe_ep_native.exchange import (  # noqa: E402
    PROVIDERS, SLOT_ORDER, ExchangeLayer, Loopback, NcclPeers, connect, connect_nccl, with_exchange,
)
from moe_ep_native.layer import layer_config  # noqa: E402
from moe_ep_spec import ConfigError, DTypeError, MoeEpConfig, NativeArgumentError, NativeError  # noqa: E402


def _layer(n, rank, cuda_device=None, el=4, k=2, cap=16, tmax=8, row_bytes=16, hidden=8, order=SLOT_ORDER):
    cfg = MoeEpConfig(num_experts=n * el, hidden=hidden, intermediate=4, num_topk=k, num_ranks=n)
    base = layer_config(cfg, max_rows=cap, cuda_device=cuda_device, bf16_operands=False, with_backward=False)
    return ExchangeLayer(with_exchange(base, num_ranks=n, rank=rank, num_topk=k, max_tokens=tmax,
                                       token_bytes=row_bytes, timeout_s=20.0, combine_order=order))


class _DictStore:
    """A thread-safe store with a waiting get (the part of torch.distributed's store the providers use)."""

    def __init__(self):
        self._d, self._cv = {}, threading.Condition()

    def set(self, key, value):
        with self._cv:
            self._d[key] = bytes(value)
            self._cv.notify_all()

    def get(self, key):
        with self._cv:
            assert self._cv.wait_for(lambda: key in self._d, timeout=30), f"store: no key {key!r}"
            return self._d[key]


# ----------------------------------------------------------------------------- CPU (CI)

def test_set_peers_nccl_on_a_cpu_layer_is_unsupported_with_the_reason() -> None:
    layer = _layer(1, 0)
    try:
        with pytest.raises(NativeError) as info:
            call("moe_ep_layer_set_peers_nccl", layer._handle, None)
        assert info.value.status == int(Status.UNSUPPORTED), info.value
        message = str(info.value)
        assert message.startswith("moe_ep_layer_set_peers_nccl: ")
        if has_nccl():  # with NCCL's device API (>= 2.28) the layer is refused; an older NCCL says it has none
            assert "CUDA layers only" in message or "has no device API" in message, message
        else:
            assert "no NCCL transport" in message and "set_peers_ipc" in message
        with pytest.raises(DTypeError, match="Communicator"):
            layer.set_peers_nccl(object())
        # Nothing was set: the layer still takes a peer table.
        layer.set_peers([layer.exchange_info()[1]])
    finally:
        layer.close()


def test_set_peers_nccl_needs_a_layer_with_an_exchange() -> None:
    cfg = MoeEpConfig(num_experts=4, hidden=8, intermediate=4, num_topk=2, num_ranks=1)
    plain = ExchangeLayer(layer_config(cfg, max_rows=4, cuda_device=None, bf16_operands=False, with_backward=False))
    try:
        with pytest.raises(NativeArgumentError, match="ex_num_ranks >= 1"):
            call("moe_ep_layer_set_peers_nccl", plain._handle, None)
    finally:
        plain.close()
    with pytest.raises(NativeArgumentError, match="layer must not be NULL"):
        call("moe_ep_layer_set_peers_nccl", None, None)


def test_closing_the_nccl_provider_first_closes_its_layer_before_the_communicator() -> None:
    """The layer's NCCL window needs the communicator: whichever is closed first, the
    layer goes before the communicator (a stand-in communicator records the order)."""
    from moe_ep_native.exchange import NcclPeers

    order = []

    class Comm:
        def close(self) -> None:
            order.append(("comm", layer.closed))

    for first in ("provider", "layer"):
        order.clear()
        layer = _layer(1, 0)
        layer.provider = peers = NcclPeers(Comm(), layer)
        (peers if first == "provider" else layer).close()
        assert order == [("comm", True)], f"{first} closed first: {order}"
        assert layer.closed and peers.comm is None and layer.provider is None
        peers.close()
        layer.close()  # both idempotent
        assert order == [("comm", True)]


def test_connect_validates_the_provider_and_nccl_needs_a_cuda_layer() -> None:
    assert PROVIDERS == ("ipc", "nccl", "auto")
    layer = _layer(1, 0)
    try:
        with pytest.raises(ConfigError, match=r"provider must be one of 'ipc', 'nccl', 'auto'; got 'shm'"):
            connect(layer, _DictStore(), "p", provider="shm")
        with pytest.raises(ConfigError, match="CUDA layers only"):
            connect_nccl(layer, _DictStore(), "p")
        with pytest.raises(ConfigError, match="CUDA layers only"):
            connect(layer, _DictStore(), "p", provider="nccl")
        assert layer.provider is None
    finally:
        layer.close()


def test_connect_auto_takes_the_shm_loopback_for_cpu_layers() -> None:
    n = 2
    layers = [_layer(n, r) for r in range(n)]
    store = _DictStore()
    got, errs = [None] * n, []

    def run(r):
        try:
            got[r] = connect(layers[r], store, "auto-cpu", provider="auto")
        except BaseException as exc:  # noqa: BLE001
            errs.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not errs, errs
        for r in range(n):
            assert isinstance(got[r], Loopback) and got[r].kind == "ipc" and layers[r].provider is got[r]
    finally:
        for lay in layers:
            lay.close()
    assert all(lay.provider is None for lay in layers)


def test_front_end_validates_moe_ep_exchange_peers(monkeypatch) -> None:
    pytest.importorskip("torch")
    from moe_ep_cuda_nccl import device_exchange as D
    from moe_ep_spec import errors as E

    assert D.PEERS_ENV == "MOE_EP_EXCHANGE_PEERS"
    monkeypatch.delenv(D.PEERS_ENV, raising=False)
    assert D._peers() == "auto"
    for value in PROVIDERS:
        monkeypatch.setenv(D.PEERS_ENV, value)
        assert D._peers() == value
    monkeypatch.setenv(D.PEERS_ENV, "lsa")
    with pytest.raises(E.ConfigError, match=r"MOE_EP_EXCHANGE_PEERS must be one of 'ipc', 'nccl', 'auto'; got 'lsa'"):
        D._peers()


# ----------------------------------------------------------------------------- CUDA + NCCL: EP 1 on one GPU

def _nccl_device_api() -> bool:
    """Whether this build's NCCL has the device API (NCCL >= 2.28): a CPU layer is then
    refused for being a CPU layer, else for the missing API."""
    layer = _layer(1, 0)
    try:
        call("moe_ep_layer_set_peers_nccl", layer._handle, None)
    except NativeError as exc:
        return "has no device API" not in str(exc)
    finally:
        layer.close()
    return False


def _nccl_gpu() -> bool:
    try:
        import torch

        return (has_cuda() and has_nccl() and torch.cuda.is_available() and torch.cuda.device_count() >= 1
                and _nccl_device_api())
    except Exception:  # noqa: BLE001
        return False


cuda_nccl = pytest.mark.skipif(not _nccl_gpu(), reason="needs a CUDA + NCCL build of the native core and a GPU")


def _hash_store():
    import torch.distributed as dist

    return dist.HashStore()


def _step(layer, inputs, cap, el, k, hidden):
    """One dispatch and one combine on cuda:0; every output as host numpy (bit patterns)."""
    import torch

    tokens, idx, w, y, values = inputs
    t, rb = tokens.shape
    dev = tokens.device
    out = dict(
        tokens=torch.full((cap, rb), 0xAB, dtype=torch.uint8, device=dev),
        w=torch.full((cap,), 7.0, device=dev), meta=torch.full((cap, 4), 99, dtype=torch.int32, device=dev),
        gs=torch.full((el,), -5, dtype=torch.int32, device=dev), tpe=torch.full((el,), -5, dtype=torch.int32, device=dev),
        err=torch.full((1,), -1, dtype=torch.int32, device=dev),
        out=torch.full((t, hidden), 5.0, device=dev), values=torch.full((t, k), 5.0, device=dev),
        cerr=torch.full((1,), -1, dtype=torch.int32, device=dev),
    )
    stream = torch.cuda.current_stream().cuda_stream
    p = lambda a: a.data_ptr() if a.numel() else None  # noqa: E731
    layer.dispatch(stream, t, rb, p(tokens), p(idx), p(w), p(out["tokens"]), p(out["w"]), p(out["meta"]), p(out["gs"]),
                   p(out["tpe"]), p(out["err"]))
    layer.combine(stream, t, p(y), p(out["out"]), p(values), p(out["values"]), p(out["cerr"]))
    torch.cuda.synchronize()
    res = {}
    for key, a in out.items():
        a = a.cpu()
        res[key] = a.view(torch.int32).numpy() if a.dtype == torch.float32 else a.numpy()
    return res


@cuda_nccl
def test_nccl_window_gives_the_bits_of_the_own_region_at_ep1() -> None:
    import torch

    torch.cuda.set_device(0)
    el, k, cap, hidden, rb = 4, 2, 16, 8, 16
    nccl_layer, own_layer = _layer(1, 0, cuda_device=0), _layer(1, 0, cuda_device=0)
    try:
        peers = connect(nccl_layer, _hash_store(), "nccl-ep1", provider="nccl")
        assert isinstance(peers, NcclPeers) and nccl_layer.provider is peers and peers.kind == "nccl"
        loop = connect(own_layer, _hash_store(), "ipc-ep1", provider="ipc")
        assert isinstance(loop, Loopback)
        rng = np.random.default_rng(7)
        dev = torch.device("cuda:0")
        for step, t in enumerate((5, 8)):  # two steps: the step numbers and acknowledgements in the window
            idx = rng.integers(-1, el, size=(t, k)).astype(np.int32)
            inputs = (
                torch.from_numpy(rng.integers(0, 256, size=(t, rb)).astype(np.uint8)).to(dev),
                torch.from_numpy(idx).to(dev),
                torch.from_numpy(rng.standard_normal((t, k)).astype(np.float32)).to(dev),
                torch.from_numpy(rng.standard_normal((cap, hidden)).astype(np.float32)).to(dev),
                torch.from_numpy(rng.standard_normal(cap).astype(np.float32)).to(dev),
            )
            got = _step(nccl_layer, inputs, cap, el, k, hidden)
            want = _step(own_layer, inputs, cap, el, k, hidden)
            assert got["err"][0] == 0 and got["cerr"][0] == 0, (step, got["err"], got["cerr"])
            for key in want:
                np.testing.assert_array_equal(got[key], want[key], err_msg=f"step {step}: {key}")
            assert nccl_layer.status(torch.cuda.current_stream().cuda_stream) == 0
        with pytest.raises(NativeArgumentError, match="the peers were set already"):
            nccl_layer.set_peers_nccl(peers.comm)
    finally:
        nccl_layer.close()  # the window first, then the communicator
        own_layer.close()
    assert nccl_layer.provider is None and peers.comm is None


@cuda_nccl
def test_nccl_provider_refuses_a_communicator_that_does_not_match_the_layer() -> None:
    import torch

    from moe_ep_native.comm import Communicator, unique_id

    torch.cuda.set_device(0)
    two = _layer(2, 0, cuda_device=0)  # a layer of two ranks, a communicator of one
    comm = Communicator(unique_id(), 1, 0, cuda_device=0, timeout_s=60)
    try:
        with pytest.raises(NativeArgumentError, match=r"comm's num_ranks must be the layer's config.ex_num_ranks = 2; got 1"):
            two.set_peers_nccl(comm)
        if torch.cuda.device_count() >= 2:
            other = _layer(1, 0, cuda_device=1)
            try:
                with pytest.raises(NativeArgumentError, match=r"comm's cuda_device must be the layer's config.cuda_device = 1; got 0"):
                    other.set_peers_nccl(comm)
            finally:
                other.close()
        # Refused before anything was made: the same communicator still serves a matching layer.
        one = _layer(1, 0, cuda_device=0)
        try:
            one.set_peers_nccl(comm)
        finally:
            one.close()
    finally:
        two.close()
        comm.close()


@cuda_nccl
def test_front_end_over_the_nccl_provider_equals_the_static_mode_at_ep1(monkeypatch) -> None:
    import exchange_workers as XW
    from moe_ep_spec.inputs import random_world
    from torch_workers import run_ranks

    monkeypatch.setenv("MOE_EP_EXCHANGE_PEERS", "nccl")  # the spawned rank inherits it
    config = MoeEpConfig(num_experts=4, hidden=64, intermediate=32, num_topk=3, num_ranks=1, max_tokens_per_rank=12,
                         recv_capacity=48, expert_alignment=4, generate_c=True)
    world = random_world(config, num_tokens=[12], seed=31)
    rng = np.random.default_rng(131)
    grads = [rng.standard_normal((w.activation.shape[0], config.hidden)).astype(np.float32) for w in world]
    (res,) = run_ranks(XW.device_matches_static, 1, config, world, grads, "slot", False, "cuda", timeout=300)
    assert not (isinstance(res, tuple) and res and res[0] == "error"), res[1]
    assert len(res["static"]) == len(res["device"]) >= 1, "every step of both modes must come back"
    for step, (st, dv) in enumerate(zip(res["static"], res["device"])):
        np.testing.assert_array_equal(dv["route_metadata"], st["route_metadata"], err_msg=f"step {step}")
        for key, want in st.items():  # CUDA's float32 kernels against the CPU ones: within tolerance
            np.testing.assert_allclose(dv[key].astype(np.float64), want.astype(np.float64), rtol=2e-2, atol=2e-2,
                                       err_msg=f"step {step}: {key}")
