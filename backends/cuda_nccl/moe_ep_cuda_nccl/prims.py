"""The native core's kernels and NCCL transport as the torch layer's primitives.

:class:`NativePrimitives` overrides :class:`moe_ep_torch.core.Primitives`:
every codec, the grouped SwiGLU MLP forward and backward and the slot
reduction run in ``libmoe_ep_native`` (C ABI, through ctypes) on the tensors'
own memory, enqueued on the current CUDA stream; the count exchange and the
row exchanges run over the native NCCL transport (one communicator per
process group, bootstrapped through ``torch.distributed``'s store). The plan,
the payload packing, the error sharing and the autograd formula are the torch
layer's (:mod:`moe_ep_torch.core`, :mod:`moe_ep_torch.api`).

CPU tensors (the development mode of :data:`CPU_ENV`) run the native core's
CPU kernels, with ``torch.distributed`` (gloo) moving the rows.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from moe_ep_native import _capi as C
from moe_ep_native.comm import Communicator, unique_id
from moe_ep_native.layer import Layer, layer_config
from moe_ep_spec import errors as E
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.formats import MoeFormat
from moe_ep_torch import core
from moe_ep_torch import formats as TF

__all__ = ["NativePrimitives", "NATIVE", "CPU_ENV", "TIMEOUT_ENV", "close_communicators"]

#: ``1``: the backend runs on CPU tensors too (native CPU kernels, gloo): for
#: testing this front-end on machines without a GPU.
CPU_ENV = "MOE_EP_CUDA_NCCL_ON_CPU"
#: Seconds every host-side wait of the NCCL transport may take (default 300).
TIMEOUT_ENV = "MOE_EP_CUDA_NCCL_TIMEOUT_S"

_FORMAT = {MoeFormat.BF16: C.Format.BF16, MoeFormat.MXFP8: C.Format.MXFP8, MoeFormat.NVFP4: C.Format.NVFP4}
_BLOCK = {MoeFormat.MXFP8: 32, MoeFormat.NVFP4: 16}


def ptr(t: torch.Tensor) -> Optional[int]:
    """The address of a contiguous tensor's data; None (NULL) when it is empty."""
    return t.data_ptr() if t.numel() else None


def where(t: torch.Tensor) -> Tuple[int, Optional[int]]:
    """``(moe_ep_device, stream)`` of a tensor: CUDA and its device's current stream, or CPU.

    Raises:
        DeviceError: the tensor is on a CUDA device other than the current one (the
            native kernels and the communicator work on the current device).
    """
    if t.is_cuda:
        current = torch.cuda.current_device()
        if t.device.index != current:
            raise E.DeviceError(
                f"cuda-nccl runs on the current CUDA device cuda:{current}; got a tensor on {t.device} "
                f"(call torch.cuda.set_device({t.device.index}) in this rank first)"
            )
        return 1, torch.cuda.current_stream(t.device).cuda_stream or None
    return 0, None


def quantize(x: torch.Tensor, fmt: MoeFormat) -> Any:
    """``x`` (float32, encoded along its last axis) in ``fmt``: a bfloat16 tensor or a TorchBlockScaled."""
    x = x.float().contiguous()
    n = int(x.shape[-1])
    outer = x.numel() // n if n else 0
    dev, stream = where(x)
    lead = tuple(x.shape[:-1])
    if fmt is MoeFormat.BF16:
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        C.call("moe_ep_quantize", dev, stream, int(C.Format.BF16), ptr(x), outer, n, 1, ptr(out), None)
        return out
    data_n = n if fmt is MoeFormat.MXFP8 else -(-n // 2)
    data = torch.empty(lead + (data_n,), dtype=torch.uint8, device=x.device)
    scale = torch.empty(lead + (-(-n // _BLOCK[fmt]),), dtype=torch.uint8, device=x.device)
    C.call("moe_ep_quantize", dev, stream, int(_FORMAT[fmt]), ptr(x), outer, n, 1, ptr(data), ptr(scale))
    return TF.from_raw(data, scale, fmt, n)


def dequantize(t: TF.TorchBlockScaled) -> torch.Tensor:
    """float32 values of a TorchBlockScaled (blocked along its last axis), exactly."""
    data, scale = (p.contiguous() for p in TF.raw(t))
    shape = t.shape
    out = torch.empty(shape, dtype=torch.float32, device=data.device)
    n = int(t.n)
    outer = out.numel() // n if n else 0
    dev, stream = where(data)
    C.call("moe_ep_dequantize", dev, stream, int(_FORMAT[t.format]), ptr(data), ptr(scale), outer, n, 1, ptr(out))
    return out


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


class NativePrimitives(core.Primitives):
    """The torch layer over ``libmoe_ep_native``: kernels and NCCL transport."""

    name = "cuda-nccl"

    def __init__(self) -> None:
        self._comms: Dict[Tuple[str, int], Tuple[Any, Communicator]] = {}
        self._generation: Dict[str, int] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------- transport

    def communicator(self, group: Any) -> Communicator:
        """This rank's NCCL communicator for ``group`` (collective on first use:
        rank 0 of the group makes a unique id and passes it through the default
        store; every rank joins on its current CUDA device)."""
        name = group.group_name
        key = (name, id(group))
        with self._lock:
            entry = self._comms.get(key)
            if entry is not None and not entry[1].closed:
                return entry[1]
            if torch.cuda.is_current_stream_capturing():
                raise E.MoeEpError(
                    "cuda-nccl: the NCCL communicator of this process group does not exist yet and cannot be made "
                    "during CUDA-graph capture; run the layer once before capturing it"
                )
            gen = self._generation.get(name, 0)
            self._generation[name] = gen + 1
        from torch.distributed.distributed_c10d import _get_default_store

        store = dist.PrefixStore(f"moe_ep_cuda_nccl/{name}/{gen}/", _get_default_store())
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank == 0:
            store.set("unique_id", unique_id())
        uid = store.get("unique_id")  # waits at most the store's timeout
        timeout = float(os.environ.get(TIMEOUT_ENV, "300"))
        comm = Communicator(bytes(uid), size, rank, torch.cuda.current_device(), timeout)
        with self._lock:
            self._comms[key] = (group, comm)  # the group is kept so that its id stays unique
        return comm

    def close(self, group: Optional[Any] = None) -> None:
        """Destroy the communicator of ``group`` (every one when None)."""
        with self._lock:
            keys = [k for k, (g, _) in self._comms.items() if group is None or g is group]
            entries = [self._comms.pop(k) for k in keys]
        errors = []
        for _, comm in entries:
            try:
                comm.close()
            except Exception as exc:  # noqa: BLE001 - close them all, then report
                errors.append(exc)
        if errors:
            raise errors[0]

    def _collective(self, group: Any, fn: Any) -> None:
        """Run ``fn(communicator)``; a transport failure closes and forgets the
        communicator (it is unusable) before the error propagates."""
        comm = self.communicator(group)
        try:
            fn(comm)
        except E.TransportError:
            with self._lock:
                for key in [k for k, (_, c) in self._comms.items() if c is comm]:
                    del self._comms[key]
            try:
                comm.close()
            except E.NativeError:
                pass  # the original error is the one to report
            raise

    def all_gather(self, row: torch.Tensor, group: Any) -> torch.Tensor:
        if not row.is_cuda:
            return super().all_gather(row, group)
        row = row.contiguous()
        _, stream = where(row)
        out = torch.empty((dist.get_world_size(group),) + tuple(row.shape), dtype=row.dtype, device=row.device)
        nbytes = row.numel() * row.element_size()
        self._collective(group, lambda comm: comm.all_gather(stream or 0, ptr(row), ptr(out), nbytes))
        return out

    def all_to_all(self, x: torch.Tensor, send_counts: List[int], recv_counts: List[int], group: Any) -> torch.Tensor:
        if not x.is_cuda:
            return super().all_to_all(x, send_counts, recv_counts, group)
        x = x.contiguous()
        out = torch.empty((sum(recv_counts),) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        row_bytes = x.element_size()
        for d in x.shape[1:]:
            row_bytes *= int(d)
        if row_bytes == 0:
            return out
        _, stream = where(x)
        self._collective(
            group, lambda comm: comm.exchange(stream or 0, ptr(x), send_counts, ptr(out), recv_counts, row_bytes)
        )
        return out

    # ----------------------------------------------------------------- codecs

    def decode(self, t: Any) -> torch.Tensor:
        if isinstance(t, TF.TorchBlockScaled):
            return dequantize(t)
        return t.float()

    def decode_weight(self, w: Any) -> Any:
        if isinstance(w, TF.TorchBlockScaled):
            return dequantize(w).transpose(1, 2).contiguous()
        return w

    def forward_operands(self, activation: Any, tokens: Any, fc1: Any, fc2: Any) -> Tuple[Any, Any, Any]:
        """The layer's operands from the buffer rows ``tokens`` (the activation's
        encoding) and the weights: bf16 ones stay bf16 (the tensor-core path) when
        the rows and both weights are plain bf16 tensors; everything else is
        decoded to float32."""
        if all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in (tokens, fc1, fc2)):
            return tokens, fc1, fc2
        return self.decode(tokens), self.decode(fc1), self.decode(fc2)

    def round_trip(self, values: torch.Tensor, fmt: Optional[MoeFormat]) -> torch.Tensor:
        if fmt is None:
            return values
        return self.decode(quantize(values, fmt))

    def encode_output(self, config: MoeEpConfig, values: torch.Tensor) -> Any:
        return quantize(values, config.output_format)

    # ---------------------------------------------------------------- experts

    def experts_forward(self, config, plan, x, w, fc1, fc2):
        y, c = expert_forward(config, x, w, fc1, fc2, _slab_sizes(plan, x.device))  # y after the combine round trip
        if not config.static_layout:
            return y, c  # every row is a route (rows of no expert, none here, the layer zeroes)
        valid = plan.valid_rows.unsqueeze(1)
        return torch.where(valid, y, torch.zeros_like(y)), torch.where(valid, c, torch.zeros_like(c))

    def experts_backward(self, config, plan, x, w, fc1, fc2, fc1_c, dy):
        return expert_backward(config, x, w, fc1, fc2, fc1_c, dy, _slab_sizes(plan, x.device))

    def sum_slots(self, plan: Any, send_rows: torch.Tensor) -> torch.Tensor:
        k, t = plan.num_topk, plan.num_tokens
        route_pos = torch.full((t * k,), -1, dtype=torch.int32, device=send_rows.device)
        route_pos[plan.send_route] = torch.arange(plan.send_route.numel(), dtype=torch.int32, device=send_rows.device)
        return combine_reduce(send_rows, route_pos, t, k)


def _slab_sizes(plan: Any, device: torch.device) -> torch.Tensor:
    """``[E_local] int32``: every local expert's slab size in the buffer (aligned ones in
    the static layout: the native kernels then give the padding rows zero outputs)."""
    offsets = plan.expert_offsets
    return torch.tensor([b - a for a, b in zip(offsets[:-1], offsets[1:])], dtype=torch.int32, device=device)


#: The layer objects of this process: (configuration, device, operand dtype) -> Layer.
_LAYERS: Dict[Tuple[Any, ...], Layer] = {}
_LAYERS_LOCK = threading.Lock()


def layer_for(config: MoeEpConfig, rows: int, device: torch.device, bf16: bool, backward: bool) -> Layer:
    """The native layer object for ``config`` on ``device`` with at least ``rows``
    rows (made once, remade larger when a step needs more rows: a dynamic layout
    grows by a quarter at a time, so steady state allocates nothing)."""
    cuda_device = device.index if device.type == "cuda" else None
    key = (config, cuda_device, bf16)
    with _LAYERS_LOCK:
        layer = _LAYERS.get(key)
        if layer is not None and layer.max_rows >= rows and (layer.with_backward or not backward):
            return layer
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise E.MoeEpError(
                f"cuda-nccl: the native layer for {rows} rows does not exist yet and cannot be made during CUDA-graph "
                f"capture; run the layer (forward and backward, as captured) once before capturing it"
            )
        max_rows = rows if layer is None else max(rows, layer.max_rows + layer.max_rows // 4)
        with_backward = backward or config.generate_c or (layer is not None and layer.with_backward)
        if layer is not None:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the old workspaces may still be in use
            layer.close()
            del _LAYERS[key]
        made = Layer(layer_config(config, max_rows=max_rows, cuda_device=cuda_device, bf16_operands=bf16,
                                  with_backward=with_backward))
        _LAYERS[key] = made
        return made


def _operands(x: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor) -> Tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bf16, x, fc1, fc2)``: all three bf16 when they all are, else all float32; contiguous."""
    if x.dtype == fc1.dtype == fc2.dtype == torch.bfloat16:
        return True, x.contiguous(), fc1.contiguous(), fc2.contiguous()
    return False, _f32(x), _f32(fc1), _f32(fc2)


def expert_forward(
    config: MoeEpConfig, x: torch.Tensor, w: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor, group_sizes: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The native layer's experts forward on tensors: ``(y [C, H] float32, fc1_c [C, 2I] bfloat16)``:
    ``y`` after the combine round trip, the stash of the FC1 output. ``x``, ``fc1``, ``fc2``
    bf16 (the tensor-core path on CUDA) or any float dtype (float32 kernels);
    ``group_sizes`` ``[E_local] int32`` on the rows' device: slab sizes from row 0."""
    bf16, x, fc1, fc2 = _operands(x, fc1, fc2)
    w = _f32(w)
    gs = group_sizes.to(torch.int32).contiguous()  # every operand bound to a name: alive until the call returns
    rows, h, i = int(x.shape[0]), config.hidden, config.intermediate
    layer = layer_for(config, rows, x.device, bf16, backward=False)
    y = torch.empty((rows, h), dtype=torch.float32, device=x.device)
    c = torch.empty((rows, 2 * i), dtype=torch.bfloat16, device=x.device)
    _, stream = where(x)
    layer.experts_forward(stream, rows, ptr(x), ptr(w), ptr(fc1), ptr(fc2), ptr(gs), ptr(y), ptr(c))
    return y, c


def expert_backward(
    config: MoeEpConfig,
    x: torch.Tensor,
    w: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    fc1_c: torch.Tensor,
    dy: torch.Tensor,
    group_sizes: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native layer's experts backward on tensors: float32 ``(dx [C, H], dw [C],
    dfc1 [E_local, H, 2I], dfc2 [E_local, I, H])`` from the bf16 stash ``fc1_c`` and
    the cotangent rows ``dy`` ``[C, H]`` (bfloat16 passes as is, others as float32)."""
    bf16, x, fc1, fc2 = _operands(x, fc1, fc2)
    w = _f32(w)
    dy_bf16 = dy.dtype == torch.bfloat16
    dy = dy.contiguous() if dy_bf16 else _f32(dy)
    stash = fc1_c.to(torch.bfloat16).contiguous()
    gs = group_sizes.to(torch.int32).contiguous()
    rows, h = int(x.shape[0]), config.hidden
    layer = layer_for(config, rows, x.device, bf16, backward=True)
    dx = torch.empty((rows, h), dtype=torch.float32, device=x.device)
    dw = torch.empty((rows,), dtype=torch.float32, device=x.device)
    dfc1 = torch.empty(fc1.shape, dtype=torch.float32, device=x.device)
    dfc2 = torch.empty(fc2.shape, dtype=torch.float32, device=x.device)
    _, stream = where(x)
    layer.experts_backward(
        stream, rows, ptr(x), ptr(w), ptr(fc1), ptr(fc2), ptr(stash), ptr(dy), ptr(gs), ptr(dx), ptr(dw), ptr(dfc1),
        ptr(dfc2), dy_bf16=dy_bf16,
    )
    return dx, dw, dfc1, dfc2


def combine_reduce(rows: torch.Tensor, route_pos: torch.Tensor, num_tokens: int, num_topk: int) -> torch.Tensor:
    """``moe_ep_combine_reduce``: ``[T, ...]`` float32, ``sum_k rows[route_pos[t*K+k]]``
    in slot order from +0 (``route_pos`` ``[T*K] int32``, -1 adds nothing)."""
    tail = tuple(rows.shape[1:])
    hidden = 1
    for d in tail:
        hidden *= int(d)
    flat = _f32(rows).reshape(rows.shape[0], hidden)
    pos = route_pos.to(torch.int32).contiguous()
    out = torch.empty((num_tokens, hidden), dtype=torch.float32, device=rows.device)
    dev, stream = where(flat)
    C.call(
        "moe_ep_combine_reduce", dev, stream, ptr(flat), int(flat.shape[0]), ptr(pos), num_tokens, num_topk, hidden,
        ptr(out),
    )
    return out.reshape((num_tokens,) + tail)


#: The primitives of the ``cuda-nccl`` backend (one set of communicators per process).
NATIVE = NativePrimitives()


def close_communicators(group: Optional[Any] = None) -> None:
    """Destroy this process's NCCL communicators of ``group`` (all when None), and
    with them (group None) the native layer objects; call it before
    ``torch.distributed.destroy_process_group``. Runs at exit too."""
    NATIVE.close(group)
    if group is None:
        with _LAYERS_LOCK:
            layers = list(_LAYERS.values())
            _LAYERS.clear()
        for layer in layers:
            layer.close()


atexit.register(lambda: close_communicators() if NATIVE._comms or _LAYERS else None)
