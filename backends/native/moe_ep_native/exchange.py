"""The device exchange of the native layer (``moe_ep_layer_dispatch`` /
``moe_ep_layer_combine`` and the peer table), and its loopback provider.

The exchange kernels take the addresses of every rank's symmetric region from a
table and do not care where they come from. The loopback provider here builds
that table for ranks that are processes on ONE machine:

- CUDA layers: every rank exports its region as a CUDA IPC handle, the handles
  travel through a key-value store (``set(key, bytes)`` / ``get(key)``, e.g.
  ``torch.distributed``'s store) and every rank opens its peers' handles. This
  runs N ranks on one GPU (NCCL refuses two ranks on one GPU; CUDA IPC between
  processes on one GPU works): correctness, not speed (the contexts take turns).
- CPU layers (the CPU twin of the protocol, for CI): every rank's region is a
  file in ``/dev/shm`` mapped by every rank.

Framework-neutral: pointers and streams are plain integers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from typing import Any, List, Optional, Sequence


from ._capi import DType, LayerConfig, call, load
from .layer import Layer

__all__ = [
    "BAD_EXPERT_ID", "OVERFLOW", "TIMEOUT", "RANK_SUMS", "SLOT_ORDER", "IPC_HANDLE_BYTES", "with_exchange",
    "ExchangeLayer", "Loopback", "connect_loopback",
]

#: Error bits (MOE_EP_EXCHANGE_*).
BAD_EXPERT_ID = 1
OVERFLOW = 2
TIMEOUT = 4
#: moe_ep_combine_order.
RANK_SUMS = 0
SLOT_ORDER = 1
#: MOE_EP_IPC_HANDLE_BYTES.
IPC_HANDLE_BYTES = 64

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_PROTOTYPES = {
    "moe_ep_layer_exchange_info": (_I32, [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
    "moe_ep_layer_set_peers": (_I32, [_P, ctypes.POINTER(ctypes.c_uint64)]),
    "moe_ep_layer_ipc_handle": (_I32, [_P, _P, ctypes.c_size_t]),
    "moe_ep_layer_set_peers_ipc": (_I32, [_P, _P, ctypes.c_size_t]),
    "moe_ep_layer_dispatch": (_I32, [_P, _P, _I64, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "moe_ep_layer_combine": (_I32, [_P, _P, _I64, _P, _I32, _P, _I32, _P, _P, _P]),
    "moe_ep_layer_exchange_status": (_I32, [_P, _P, ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]),
}
_READY = False


def _load() -> None:
    global _READY
    if not _READY:
        lib = load()
        for name, (res, args) in _PROTOTYPES.items():
            fn = getattr(lib, name)  # ctypes caches the function object: call() finds these prototypes
            fn.restype, fn.argtypes = res, args
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
        self.provider: Optional["Loopback"] = None

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

    def dispatch(self, stream, num_tokens, row_bytes, tokens, topk_idx, topk_weights, out_tokens, out_weights,
                 out_route_metadata, out_group_sizes, out_tokens_per_expert, out_error) -> None:
        """``moe_ep_layer_dispatch`` (see the header for shapes)."""
        call("moe_ep_layer_dispatch", self._handle, stream, num_tokens, row_bytes, tokens, topk_idx, topk_weights,
             out_tokens, out_weights, out_route_metadata, out_group_sizes, out_tokens_per_expert, out_error)

    def combine(self, stream, num_tokens, y, out, row_values=None, out_values=None, out_error=None,
                y_bf16: bool = False, out_bf16: bool = False) -> None:
        """``moe_ep_layer_combine``: ``y`` ``[C, H]`` float32 rows, or bf16 bit patterns
        with ``y_bf16`` (e.g. the rows of a layer made with ``bf16_expert_out``);
        ``out`` ``[T, H]`` float32, or bf16 with ``out_bf16``."""
        dt = lambda bf16: int(DType.BF16 if bf16 else DType.F32)  # noqa: E731
        call("moe_ep_layer_combine", self._handle, stream, num_tokens, y, dt(y_bf16), out, dt(out_bf16), row_values,
             out_values, out_error)

    def status(self, stream: Optional[int] = None, clear: bool = False) -> int:
        """The layer's error record (waits for ``stream``)."""
        bits = ctypes.c_int32()
        call("moe_ep_layer_exchange_status", self._handle, stream, ctypes.byref(bits), int(bool(clear)))
        return int(bits.value)

    def close(self) -> None:
        super().close()
        if self.provider is not None:
            self.provider.close()
            self.provider = None


class Loopback:
    """The peer table of one rank built over a store (see the module doc); keeps
    the CPU mappings alive until :meth:`close`."""

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
