"""The device exchange of the native layer (``moe_ep_layer_dispatch`` /
``moe_ep_layer_combine`` and the peer table), and its peer providers.

The exchange kernels take the addresses of every rank's symmetric region from a
table and do not care where they come from. The providers here build that table
(collectively, through a key-value store: ``set(key, bytes)`` / ``get(key)``,
e.g. ``torch.distributed``'s store):

- :func:`connect_loopback` ("ipc"), for ranks that are processes on ONE machine:
  - CUDA layers: every rank exports its region as a CUDA IPC handle, the handles
    travel through the store and every rank opens its peers' handles. This also
    runs N ranks on one GPU (NCCL refuses two ranks on one GPU; CUDA IPC between
    processes on one GPU works): correctness, not speed (the contexts take turns).
  - CPU layers (the CPU twin of the protocol, for CI): every rank's region is a
    file in ``/dev/shm`` mapped by every rank.
- :func:`connect_nccl` ("nccl"), CUDA layers on distinct GPUs of one NVLink
  domain: an NCCL communicator (its unique id through the store) and
  ``moe_ep_layer_set_peers_nccl``: the regions are one NCCL symmetric window,
  the table its LSA pointers (needs a build with the NCCL transport, run with the
  NCCL it was compiled against).
- :func:`connect` picks one ("auto": NCCL when the ranks are on distinct GPUs,
  the IPC loopback when some share one).

Framework-neutral: pointers and streams are plain integers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import uuid
import weakref
import warnings
from typing import Any, List, Optional, Sequence, Tuple, Union

from moe_ep_spec.errors import ConfigError, DTypeError, NativeError

from ._capi import DType, Format, LayerConfig, Status, call, has_nccl, load, set_prototypes
from .comm import Communicator, unique_id
from .layer import Layer

__all__ = [
    "BAD_EXPERT_ID", "OVERFLOW", "TIMEOUT", "RANK_SUMS", "SLOT_ORDER", "THROUGHPUT", "LOW_LATENCY", "MODES",
    "IPC_HANDLE_BYTES", "Y_F32_MXFP8_ROUND_TRIP", "Y_F32_NVFP4_ROUND_TRIP", "with_exchange",
    "PROVIDERS", "ExchangeLayer", "Loopback", "NcclPeers", "connect_loopback", "connect_nccl", "connect",
]

#: Error bits (MOE_EP_EXCHANGE_*).
BAD_EXPERT_ID = 1
OVERFLOW = 2
TIMEOUT = 4
#: moe_ep_combine_order.
RANK_SUMS = 0
SLOT_ORDER = 1
#: moe_ep_exchange_mode: five kernels per stage chained with programmatic dependent launch (many tokens) ...
THROUGHPUT = 0
#: ... or one cooperative kernel per stage (few tokens). The same results, bit for bit.
LOW_LATENCY = 1
#: The modes by name.
MODES = {"throughput": THROUGHPUT, "low_latency": LOW_LATENCY}
#: y_dtype of moe_ep_layer_combine (ABI 7): float32 rows each put through mxfp8's round trip as they are read.
Y_F32_MXFP8_ROUND_TRIP = 2
#: The same with nvfp4's round trip (ABI 11).
Y_F32_NVFP4_ROUND_TRIP = 3
#: The y_dtype of each round trip the combine applies, by moe_ep_format.
_ROUND_TRIP_Y_DTYPE = {int(Format.MXFP8): Y_F32_MXFP8_ROUND_TRIP, int(Format.NVFP4): Y_F32_NVFP4_ROUND_TRIP}
#: MOE_EP_IPC_HANDLE_BYTES.
IPC_HANDLE_BYTES = 64
#: The peer providers :func:`connect` takes.
PROVIDERS = ("ipc", "nccl", "auto")

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_PROTOTYPES = {
    "moe_ep_layer_exchange_info": (_I32, [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
    "moe_ep_layer_set_peers": (_I32, [_P, ctypes.POINTER(ctypes.c_uint64)]),
    "moe_ep_layer_ipc_handle": (_I32, [_P, _P, ctypes.c_size_t]),
    "moe_ep_layer_set_peers_ipc": (_I32, [_P, _P, ctypes.c_size_t]),
    "moe_ep_layer_set_peers_nccl": (_I32, [_P, _P]),
    "moe_ep_layer_dispatch": (_I32, [_P, _P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "moe_ep_layer_combine": (_I32, [_P, _P, _I64, _P, _I32, _P, _I32, _P, _P, _P]),
    "moe_ep_layer_exchange_status": (_I32, [_P, _P, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
}
_READY = False


def _load() -> None:
    global _READY
    if not _READY:
        set_prototypes(load(), _PROTOTYPES, "the native library", "exchange")
        _READY = True


def with_exchange(
    config: LayerConfig,
    *,
    num_ranks: int,
    rank: int,
    num_topk: int,
    max_tokens: int,
    token_bytes: int,
    expert_alignment: int = 1,
    timeout_s: float = 60.0,
    num_sms: int = 0,
    combine_order: int = RANK_SUMS,
    mode: int = THROUGHPUT,
) -> LayerConfig:
    """``config`` (a :func:`moe_ep_native.layer.layer_config`; its ``max_rows`` is
    the static capacity C) with the exchange fields set."""
    config.ex_num_ranks = int(num_ranks)
    config.ex_rank = int(rank)
    config.ex_num_topk = int(num_topk)
    config.ex_num_experts = int(num_ranks) * int(config.num_local_experts)
    config.ex_max_tokens = int(max_tokens)
    config.ex_token_bytes = int(token_bytes)
    config.ex_expert_alignment = int(expert_alignment)
    config.ex_timeout_ms = max(1, int(round(timeout_s * 1000)))
    config.ex_num_sms = int(num_sms)
    config.ex_combine_order = int(combine_order)
    config.ex_mode = int(mode)
    return config


class ExchangeLayer(Layer):
    """A :class:`~moe_ep_native.layer.Layer` made with the exchange fields: its
    experts stages plus :meth:`dispatch` and :meth:`combine` (collective)."""

    def __init__(self, config: LayerConfig) -> None:
        _load()
        super().__init__(config)
        self.num_ranks, self.rank = int(config.ex_num_ranks), int(config.ex_rank)
        self.num_topk = int(config.ex_num_topk)
        self.max_tokens, self.token_bytes = int(config.ex_max_tokens), int(config.ex_token_bytes)
        #: The bound of every wait of the exchange (0 in the config: the library's 60 s).
        self.timeout_s = (int(config.ex_timeout_ms) or 60000) / 1000.0
        #: What keeps the peer table valid (closed after the layer by :meth:`close`).
        self.provider: Optional[Union["Loopback", "NcclPeers"]] = None

    def exchange_info(self) -> "tuple[int, int]":
        """``(symmetric_bytes, own_region)``."""
        size, base = ctypes.c_uint64(), ctypes.c_uint64()
        call("moe_ep_layer_exchange_info", self._handle, ctypes.byref(size), ctypes.byref(base))
        return int(size.value), int(base.value)

    def set_peers(self, regions: Sequence[int]) -> None:
        table = (ctypes.c_uint64 * len(regions))(*[int(r) for r in regions])
        call("moe_ep_layer_set_peers", self._handle, table)

    def ipc_handle(self) -> bytes:
        buf = (ctypes.c_uint8 * IPC_HANDLE_BYTES)()
        call("moe_ep_layer_ipc_handle", self._handle, ctypes.cast(buf, _P), IPC_HANDLE_BYTES)
        return bytes(buf)

    def set_peers_ipc(self, handles: Sequence[bytes]) -> None:
        blob = b"".join(bytes(h) for h in handles)
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        call("moe_ep_layer_set_peers_ipc", self._handle, ctypes.cast(buf, _P), len(blob))

    def set_peers_nccl(self, comm: Communicator) -> None:
        """``moe_ep_layer_set_peers_nccl`` (collective over ``comm``): the peer table from an
        NCCL symmetric window the layer allocates and owns (released when the layer is
        closed, so ``comm`` must stay open until then).

        Raises:
            NativeError: ``MOE_EP_ERR_UNSUPPORTED`` in a build without the NCCL transport,
                for a CPU layer, when the running NCCL is not the one the library was built
                against, or when the ranks are not all in one NVLink (LSA) team (nothing
                is left set up then); TransportError on an NCCL failure or timeout.
            NativeArgumentError: ``comm`` does not match the layer (ranks, rank, device).
        """
        if not isinstance(comm, Communicator):
            raise DTypeError(f"comm must be a moe_ep_native.comm.Communicator; got {type(comm).__name__}",
                             name="comm", expected="moe_ep_native.comm.Communicator", got=type(comm).__name__)
        call("moe_ep_layer_set_peers_nccl", self._handle, comm._live())

    def dispatch(self, stream, num_tokens, row_bytes, tokens, topk_idx, topk_weights, out_tokens, out_weights,
                 out_route_metadata, out_group_sizes, out_tokens_per_expert, out_error) -> None:
        """``moe_ep_layer_dispatch`` (see the header for shapes)."""
        call("moe_ep_layer_dispatch", self._handle, stream, num_tokens, row_bytes, tokens, topk_idx, topk_weights,
             out_tokens, out_weights, out_route_metadata, out_group_sizes, out_tokens_per_expert, out_error)

    def combine(self, stream, num_tokens, y, out, row_values=None, out_values=None, out_error=None,
                y_bf16: bool = False, out_bf16: bool = False, y_round_trip: Optional[Format] = None) -> None:
        """``moe_ep_layer_combine``: ``y`` ``[C, H]`` float32 rows, or bf16 bit patterns
        with ``y_bf16`` (e.g. the rows of a layer made with ``bf16_expert_out``), or
        float32 rows that the combine puts through a block format's round trip as it reads
        them with ``y_round_trip`` ``Format.MXFP8`` (:data:`Y_F32_MXFP8_ROUND_TRIP`) or
        ``Format.NVFP4`` (:data:`Y_F32_NVFP4_ROUND_TRIP`), ``hidden % 128 == 0``; ``out``
        ``[T, H]`` float32, or bf16 with ``out_bf16``."""
        if y_round_trip is not None and int(y_round_trip) not in _ROUND_TRIP_Y_DTYPE:
            raise DTypeError(f"combine: y_round_trip must be None, Format.MXFP8 or Format.NVFP4; got {y_round_trip!r}",
                             name="y_round_trip", expected="None, Format.MXFP8 or Format.NVFP4", got=repr(y_round_trip))
        if y_bf16 and y_round_trip is not None:
            raise DTypeError("combine: y_round_trip reads float32 rows; y_bf16 must be False with it",
                             name="y", expected="float32 rows", got="bf16 rows")
        dt = lambda bf16: int(DType.BF16 if bf16 else DType.F32)  # noqa: E731
        y_dtype = dt(y_bf16) if y_round_trip is None else _ROUND_TRIP_Y_DTYPE[int(y_round_trip)]
        call("moe_ep_layer_combine", self._handle, stream, num_tokens, y, y_dtype, out, dt(out_bf16), row_values,
             out_values, out_error)

    def status(self, stream: Optional[int] = None, clear: bool = False) -> int:
        """The layer's error record (waits for ``stream``)."""
        bits = ctypes.c_int32()
        call("moe_ep_layer_exchange_status", self._handle, stream, ctypes.byref(bits), int(bool(clear)))
        return int(bits.value)

    def close(self) -> None:
        try:
            super().close()
        finally:  # the provider (an NCCL communicator) goes even when the layer's destroy reported an error
            if self.provider is not None:
                provider, self.provider = self.provider, None
                provider.close()


class Loopback:
    """The peer table of one rank built over a store (see the module doc); keeps
    the CPU mappings alive until :meth:`close`."""

    kind = "ipc"

    def __init__(self) -> None:
        self._maps: List[Any] = []
        self._anchors: List[Any] = []

    def close(self) -> None:
        self._anchors.clear()
        for m in self._maps:
            try:
                m.close()
            except (BufferError, ValueError):  # pragma: no cover - a view still alive
                pass
        self._maps.clear()


def _get(store: Any, key: str) -> bytes:
    value = store.get(key)
    return bytes(value)


def connect_loopback(layer: ExchangeLayer, store: Any, prefix: str) -> Loopback:
    """Fill ``layer``'s peer table (collective over the layer's ranks, through
    ``store``: ``set(key, bytes)``, ``get(key)`` waiting for the key). CUDA
    layers: CUDA IPC; CPU layers: ``/dev/shm`` files. Keys live under ``prefix``
    (unique per layer and group)."""
    n, rank = layer.num_ranks, layer.rank
    lb = Loopback()
    if layer.cuda_device is not None:
        store.set(f"{prefix}/ipc/{rank}", layer.ipc_handle())
        handles = [_get(store, f"{prefix}/ipc/{r}") for r in range(n)]
        layer.set_peers_ipc(handles)
    else:
        size, _ = layer.exchange_info()
        path = f"/dev/shm/moe_ep_exchange_{os.getpid()}_{uuid.uuid4().hex}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)  # zero-filled
        finally:
            os.close(fd)
        store.set(f"{prefix}/shm/{rank}", path.encode())
        paths = [_get(store, f"{prefix}/shm/{r}").decode() for r in range(n)]
        regions = []
        for p in paths:
            fd = os.open(p, os.O_RDWR)
            try:
                m = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            anchor = ctypes.c_char.from_buffer(m)
            lb._maps.append(m)
            lb._anchors.append(anchor)
            regions.append(ctypes.addressof(anchor))
        # Every rank has mapped every file: the names can go.
        store.set(f"{prefix}/mapped/{rank}", b"1")
        for r in range(n):
            _get(store, f"{prefix}/mapped/{r}")
        os.unlink(path)
        layer.set_peers(regions)
    layer.provider = lb
    return lb


class NcclPeers:
    """The NCCL provider of one rank (:func:`connect_nccl`): holds the communicator
    the layer's window lives on. :meth:`close` destroys it after the layer: called
    first on a layer still open, it closes that layer (whose window needs the
    communicator) before the communicator."""

    kind = "nccl"

    def __init__(self, comm: Communicator, layer: Optional["ExchangeLayer"] = None) -> None:
        self.comm: Optional[Communicator] = comm
        self._layer = None if layer is None else weakref.ref(layer)

    def close(self) -> None:
        layer = None if self._layer is None else self._layer()
        self._layer = None
        if layer is not None and not layer.closed:
            layer.close()  # the window first (ExchangeLayer.close comes back here for the communicator)
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.close()


def _unsupported(op: str, message: str) -> NativeError:
    return NativeError(message, op=op, status=int(Status.UNSUPPORTED), status_name="MOE_EP_ERR_UNSUPPORTED")


def connect_nccl(layer: ExchangeLayer, store: Any, prefix: str, timeout_s: Optional[float] = None) -> NcclPeers:
    """Fill a CUDA ``layer``'s peer table from an NCCL symmetric window (collective
    over the layer's ranks): rank 0 makes an NCCL unique id and shares it through
    ``store`` under ``prefix``, every rank joins the communicator on the layer's
    device (``timeout_s``: the bound of its waits, default the layer's) and calls
    :meth:`ExchangeLayer.set_peers_nccl`. The layer owns the window; the returned
    :class:`NcclPeers` (also ``layer.provider``) owns the communicator, which
    ``layer.close()`` destroys after the layer.

    Raises:
        ConfigError: a CPU layer.
        NativeError: ``MOE_EP_ERR_UNSUPPORTED`` (see :meth:`ExchangeLayer.set_peers_nccl`;
            a build without the NCCL transport says so on every rank, before the store);
            TransportError when the communicator does not form or NCCL fails.
    """
    if layer.cuda_device is None:
        raise ConfigError("connect_nccl: the NCCL provider serves CUDA layers only; got a CPU layer (use connect_loopback, "
                          "provider 'ipc')", field="provider", value="nccl")
    if not has_nccl():
        raise _unsupported(
            "moe_ep_layer_set_peers_nccl",
            "connect_nccl: this build of the native core has no NCCL transport (rebuild with MOE_EP_NATIVE_CUDA=1 "
            "and MOE_EP_NATIVE_NCCL=1; docs/native.md): use the IPC loopback (provider 'ipc')",
        )
    n, rank = layer.num_ranks, layer.rank
    key = f"{prefix}/nccl/uid"
    if rank == 0:
        store.set(key, unique_id())
    uid = _get(store, key)
    comm = Communicator(uid, n, rank, layer.cuda_device, timeout_s=layer.timeout_s if timeout_s is None else timeout_s)
    try:
        layer.set_peers_nccl(comm)
    except BaseException:
        try:
            comm.close()
        except NativeError:  # the set-up's error is the one to report
            pass
        raise
    peers = NcclPeers(comm, layer)
    layer.provider = peers
    return peers


def _where(cuda_device: int) -> Tuple[str, str]:
    """(this host, the CUDA device's UUID) of a device ordinal, through the CUDA driver
    (framework-neutral; ordinals as the runtime's: CUDA_VISIBLE_DEVICES applies)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # pragma: no cover - not Linux
        boot = ""
    host = f"{socket.gethostname()}/{boot}"
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise NativeError(f"connect: the CUDA driver (libcuda.so.1) could not be loaded: {exc}", op="connect") from None
    dev = ctypes.c_int()
    raw = ctypes.create_string_buffer(16)
    get_uuid = getattr(cu, "cuDeviceGetUuid_v2", None) or cu.cuDeviceGetUuid
    steps = (
        ("cuInit", lambda: cu.cuInit(0)),
        ("cuDeviceGet", lambda: cu.cuDeviceGet(ctypes.byref(dev), int(cuda_device))),
        ("cuDeviceGetUuid", lambda: get_uuid(raw, dev)),
    )
    for what, step in steps:
        code = step()
        if code != 0:
            raise NativeError(f"connect: {what} failed for CUDA device {cuda_device} (CUresult {code})", op="connect")
    return host, raw.raw.hex()


def connect(layer: ExchangeLayer, store: Any, prefix: str, provider: str = "auto") -> Union[Loopback, NcclPeers]:
    """Fill ``layer``'s peer table with one of :data:`PROVIDERS` (collective; keys under ``prefix``):

    - ``"ipc"``: :func:`connect_loopback` (CUDA IPC between processes of one host, or
      ``/dev/shm`` for CPU layers);
    - ``"nccl"``: :func:`connect_nccl` (CUDA layers on distinct GPUs of one NVLink domain);
    - ``"auto"``: CPU layers and one rank take the loopback; otherwise the ranks share
      (host, GPU UUID) through the store and take NCCL when every rank is on its own GPU,
      the IPC loopback when some share one (NCCL refuses two ranks on one GPU; all must be
      on one host then). When NCCL answers ``MOE_EP_ERR_UNSUPPORTED`` (no NCCL in the
      build, another NCCL at run time than at build time, ranks outside one NVLink
      team), the ranks fall back to the IPC loopback if they share one host (a warning
      says why), else the error is raised.

    Returns the provider object (also ``layer.provider``; ``layer.close()`` closes it).
    """
    if provider not in PROVIDERS:
        raise ConfigError(f"provider must be one of {', '.join(repr(p) for p in PROVIDERS)}; got {provider!r}",
                          field="provider", value=provider)
    if provider == "ipc":
        return connect_loopback(layer, store, prefix)
    if provider == "nccl":
        return connect_nccl(layer, store, prefix)
    if layer.cuda_device is None or layer.num_ranks == 1:
        return connect_loopback(layer, store, prefix)
    n, rank = layer.num_ranks, layer.rank
    host, gpu = _where(layer.cuda_device)
    store.set(f"{prefix}/where/{rank}", f"{host}\n{gpu}".encode())
    where = [_get(store, f"{prefix}/where/{r}").decode().split("\n") for r in range(n)]
    one_host = len({h for h, _ in where}) == 1
    distinct = len({g for _, g in where}) == n
    if not distinct:
        if not one_host:
            raise ConfigError(
                "connect: some ranks share a GPU (NCCL refuses that) and the ranks are on more than one host (the "
                "IPC loopback needs one): no peer provider fits; put every rank on its own GPU; got (host, GPU) per "
                f"rank: {[tuple(w) for w in where]}", field="provider", value="auto",
            )
        return connect_loopback(layer, store, prefix)
    try:
        return connect_nccl(layer, store, prefix)
    except NativeError as exc:
        if exc.status != int(Status.UNSUPPORTED) or not one_host:
            raise
        warnings.warn(f"connect: the NCCL peer provider is unsupported here, using the IPC loopback instead: {exc}",
                      RuntimeWarning, stacklevel=2)
        return connect_loopback(layer, store, prefix)
