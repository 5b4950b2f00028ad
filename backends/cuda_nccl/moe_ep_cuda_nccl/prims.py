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

Block-scaled operands (mxfp8, nvfp4 rows and weights) reach the experts as
:class:`BlockScaledOperand`: decoded to bf16 (``moe_ep_dequantize_bf16``: exact,
or NaN with a device flag where bf16 cannot hold a value) for the layer's
tensor-core path, or to float32 where bf16 is not exact; :func:`operands` says
how the choice is made in each mode (docs/cuda-nccl.md, "Block-scaled operands").
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from dataclasses import dataclass
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

__all__ = ["MainGrads", "WeightGradBuffers", "main_grad_of", "weight_grad_buffers", "NativePrimitives", "NATIVE", "CPU_ENV", "TIMEOUT_ENV", "close_communicators", "BlockScaledOperand",
           "dequantize_bf16", "operands", "inexact_decodes", "decoded_weight", "forget_decoded_weights",
           "WEIGHT_CACHE_ENV", "MXFP8_WEIGHTS_ENV", "NVFP4_WEIGHTS_ENV", "CODED_WEIGHTS_MAX_ROWS_PER_EXPERT",
           "coded_weights_path", "coded_weights_forward"]

#: ``1``: the backend runs on CPU tensors too (native CPU kernels, gloo): for
#: testing this front-end on machines without a GPU.
CPU_ENV = "MOE_EP_CUDA_NCCL_ON_CPU"
#: Seconds every host-side wait of the NCCL transport may take (default 300).
TIMEOUT_ENV = "MOE_EP_CUDA_NCCL_TIMEOUT_S"

_FORMAT = {MoeFormat.BF16: C.Format.BF16, MoeFormat.MXFP8: C.Format.MXFP8, MoeFormat.NVFP4: C.Format.NVFP4}
_BLOCK = {MoeFormat.MXFP8: 32, MoeFormat.NVFP4: 16}


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    """The address of a contiguous tensor's data; None (NULL) when it is empty or None."""
    return t.data_ptr() if t is not None and t.numel() else None


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


def dequantize_bf16(
    t: TF.TorchBlockScaled, inexact: Optional[torch.Tensor] = None, *, weight: bool = False
) -> torch.Tensor:
    """``moe_ep_dequantize_bf16``: the exact values of a TorchBlockScaled (blocked along
    its last axis) as bfloat16, in one pass (one kernel on CUDA).

    Args:
        t: rows ``[..., n]``; or, with ``weight``, an expert weight as stored:
            ``[E, N, K]`` blocked along K (the GEMM's reduction axis).
        inexact: ``[1] int32`` on ``t``'s device, or None: 1 is ORed in (on the
            device, no synchronisation) when some value is not a bf16 value.
    Returns:
        ``[..., n] bfloat16``, or ``[E, K, N] bfloat16`` for a weight (transposed
        back, as :func:`moe_ep_torch.formats.decode_weight`); NaN where bf16 cannot
        hold a value (mxfp8 magnitudes below 2^-126 off bf16's subnormal grid; nvfp4
        never).
    """
    data, scale = TF.raw(t)
    # Rows whose codes and scales lie in rows of their own (as a dispatch's packed byte rows
    # unpack: strided views into one buffer) are decoded where they lie; anything else is
    # made contiguous first.
    rows = (
        not weight and data.dim() == 2 and scale.dim() == 2 and data.stride(1) == 1 and scale.stride(1) == 1
        and data.stride(0) >= data.shape[1] and scale.stride(0) >= scale.shape[1]
    )
    if not rows:
        data, scale = data.contiguous(), scale.contiguous()
    if inexact is not None and (inexact.dtype != torch.int32 or inexact.numel() < 1 or inexact.device != data.device):
        raise E.DeviceError(
            f"dequantize_bf16: inexact must be an int32 tensor of >= 1 element on the codes' device {data.device}; "
            f"got {inexact.dtype} with {inexact.numel()} elements on {inexact.device}"
        )
    n = int(t.n)
    shape = t.shape
    if weight:
        out = torch.empty((shape[0], n, shape[1]), dtype=torch.bfloat16, device=data.device)
        transpose = int(shape[1])
    else:
        out = torch.empty(shape, dtype=torch.bfloat16, device=data.device)
        transpose = 0
    if out.numel() == 0:
        return out
    outer = out.numel() // n
    dev, stream = where(data)
    flag = None if inexact is None else inexact.data_ptr()
    if rows:
        C.call("moe_ep_dequantize_bf16_rows", dev, stream, int(_FORMAT[t.format]), ptr(data), int(data.stride(0)),
               ptr(scale), int(scale.stride(0)), int(data.shape[0]), n, ptr(out), flag)
        return out
    C.call("moe_ep_dequantize_bf16", dev, stream, int(_FORMAT[t.format]), ptr(data), ptr(scale), outer, n, 1,
           transpose, ptr(out), flag)
    return out


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


# ----------------------------------------------------------------------------- block-scaled operands


@dataclass(frozen=True)
class BlockScaledOperand:
    """A block-scaled operand of the experts, not decoded yet: the operand dtype of
    the layer (bf16 tensor cores or float32 kernels) is chosen with the other two
    operands in :func:`operands`.

    Attributes:
        source: the TorchBlockScaled, blocked along its last axis.
        weight: True for an expert weight (stored ``[E, N, K]`` blocked along K,
            decoded to ``[E, K, N]``); False for the buffer rows ``[C, H]``.
    """

    source: TF.TorchBlockScaled
    weight: bool

    @property
    def shape(self) -> Tuple[int, ...]:
        """The decoded operand's shape."""
        s = self.source.shape
        return (s[0], s[2], s[1]) if self.weight else s

    @property
    def device(self) -> torch.device:
        return self.source.device

    @property
    def exact_in_bf16(self) -> bool:
        """Known without looking at the values: nvfp4 always is (E2M1 x E4M3 has at
        most 6 significant bits in [2^-10, 2688]); so is an empty operand."""
        return self.source.format is MoeFormat.NVFP4 or self.source.data.numel() == 0

    def bf16(self, inexact: Optional[torch.Tensor]) -> torch.Tensor:
        """``self.shape`` bfloat16 (:func:`dequantize_bf16`); a weight's decode is kept
        between calls while the weight is unchanged (:func:`decoded_weight`)."""
        if self.weight:
            return decoded_weight(self.source, inexact)
        return dequantize_bf16(self.source, inexact, weight=False)

    def f32(self) -> torch.Tensor:
        """``self.shape`` float32, exact (the float32 kernels' operand)."""
        values = dequantize(self.source)
        return values.transpose(1, 2).contiguous() if self.weight else values


def _pending(t: Any, weight: bool) -> Any:
    """A TorchBlockScaled as a BlockScaledOperand; anything else unchanged. A weight
    that did not pass through :meth:`NativePrimitives.decode_weight` (the backward of
    ``moe_ep_torch.api.run_backward`` passes them as given) is the stored ``[E, N, K]``."""
    if isinstance(t, TF.TorchBlockScaled):
        return BlockScaledOperand(t, weight)
    return t


#: Per device: the static mode's record of inexact bf16 decodes ([1] int32, ORed by the decode kernels).
_RECORDS: Dict[Tuple[str, Optional[int]], torch.Tensor] = {}
#: Host-checked verdicts on mxfp8 weights: id(data) -> (the weight's _WeightTag, exact).
_VERDICTS: Dict[int, Tuple[Any, bool]] = {}
_OPERANDS_LOCK = threading.Lock()


def _record(device: torch.device) -> torch.Tensor:
    """``[1] int32`` on ``device``: the OR of the inexact flags of every decode whose
    flag the host did not read (made on first use, which must not be inside a CUDA-graph
    capture: a tensor made there would be zeroed by every replay)."""
    key = (device.type, device.index)
    with _OPERANDS_LOCK:
        rec = _RECORDS.get(key)
        if rec is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise E.MoeEpError(
                    "cuda-nccl: the record of inexact bf16 decodes on this device does not exist yet and cannot be "
                    "made during CUDA-graph capture; run the layer (forward and backward, as captured) once before "
                    "capturing it"
                )
            rec = _RECORDS[key] = torch.zeros(1, dtype=torch.int32, device=device)
        return rec


def inexact_decodes_anywhere(clear: bool = True) -> bool:
    """:func:`inexact_decodes` over every device that has a record (one synchronisation each)."""
    with _OPERANDS_LOCK:
        devices = [torch.device(kind, index) if index is not None else torch.device(kind) for kind, index in _RECORDS]
    found = False
    for device in devices:
        found |= inexact_decodes(device, clear=clear)
    return found


def inexact_decodes(device: Optional[torch.device] = None, clear: bool = True) -> bool:
    """Whether an operand decoded without a host check (the static modes, CUDA-graph
    replays, weights with a cached verdict) held a value bf16 cannot hold since the
    last clear: such values were decoded to NaN, so the results that depend on them
    are NaN. One host synchronisation. ``device``: the current CUDA device by default
    (the CPU for the CPU mode when no CUDA device is there)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with _OPERANDS_LOCK:
        rec = _RECORDS.get((device.type, device.index))
    if rec is None:
        return False
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # decodes may have run on any stream
    bad = bool(int(rec.item()))
    if clear:
        rec.zero_()
    return bad


def _verdict_key(t: TF.TorchBlockScaled) -> Tuple[Any, ...]:
    d, s = t.data, t.scale
    return (d.data_ptr(), s.data_ptr(), d._version, s._version, tuple(d.shape), t.format.value, str(d.device))


@dataclass(frozen=True)
class _WeightTag:
    """Which block-scaled weight a cache entry was made for: weak references to its codes
    and scales, and :func:`_verdict_key` (their memory, version counters, shape, format,
    device). An in-place update bumps a version counter: the entry no longer matches."""

    data: Any
    scale: Any
    key: Tuple[Any, ...]

    @staticmethod
    def of(t: TF.TorchBlockScaled, on_death: Any = None) -> "_WeightTag":
        return _WeightTag(weakref.ref(t.data, on_death), weakref.ref(t.scale), _verdict_key(t))

    def matches(self, t: TF.TorchBlockScaled) -> bool:
        return self.data() is t.data and self.scale() is t.scale and self.key == _verdict_key(t)


def _cached_verdict(t: TF.TorchBlockScaled) -> Optional[bool]:
    """The host-checked exactness of a weight's bf16 decode while it is the same weight
    (:class:`_WeightTag`), else None."""
    with _OPERANDS_LOCK:
        entry = _VERDICTS.get(id(t.data))
    if entry is None or not entry[0].matches(t):
        return None
    return entry[1]


def _remember_verdict(t: TF.TorchBlockScaled, exact: bool) -> None:
    with _OPERANDS_LOCK:
        if len(_VERDICTS) >= 256:  # forget the entries of dead tensors
            for k in [k for k, e in _VERDICTS.items() if e[0].data() is None]:
                del _VERDICTS[k]
        _VERDICTS[id(t.data)] = (_WeightTag.of(t), exact)


def _capturing(t: Any) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


#: ``0``: decode block-scaled weights on every call instead of keeping their bf16 decode.
WEIGHT_CACHE_ENV = "MOE_EP_CUDA_NCCL_WEIGHT_CACHE"


@dataclass
class _KeptDecode:
    """One kept bf16 decode of a block-scaled weight (:func:`decoded_weight`).

    Attributes:
        tag: the weight it was made for (the entry is dropped with the codes).
        decoded: ``[E, K, N] bfloat16``: the decode.
        flag: ``[1] int32``: the decode's own inexact flag (None for nvfp4: always exact).
        done: a CUDA event recorded after the decode on its stream (None on CPU).
        stream: that stream (None on CPU).
    """

    tag: _WeightTag
    decoded: torch.Tensor
    flag: Optional[torch.Tensor]
    done: Any
    stream: Any


#: The kept bf16 decodes of block-scaled weights, by id of the codes tensor.
_DECODED: Dict[int, _KeptDecode] = {}


def _weight_cache_on() -> bool:
    value = os.environ.get(WEIGHT_CACHE_ENV, "1")
    if value not in ("0", "1"):
        raise E.ConfigError(
            f"{WEIGHT_CACHE_ENV} must be '0' (decode weights every call) or '1' (keep the decode); got {value!r}",
            field=WEIGHT_CACHE_ENV, value=value,
        )
    return value == "1"


def _drop_decode(ref: Any, ident: int) -> None:
    """The weak reference's callback: forget the entry of codes that died. No lock: it may
    run inside a garbage collection on a thread that holds ``_OPERANDS_LOCK`` (dict reads
    and ``pop`` are atomic; a racing new entry for the same id is at worst decoded again)."""
    live = _DECODED.get(ident)
    if live is not None and live.tag.data is ref:
        _DECODED.pop(ident, None)


def decoded_weight(t: TF.TorchBlockScaled, inexact: Optional[torch.Tensor]) -> torch.Tensor:
    """A block-scaled expert weight (stored ``[E, N, K]``) as ``[E, K, N] bfloat16``
    (:func:`dequantize_bf16` with ``weight=True``), decoded once and kept while its codes
    and scales are the same tensor objects with the same memory and version counters
    (``_version``: an in-place update, an optimizer step, bumps it and the next call
    decodes again; the forward and the backward of one step share one decode).

    The decode's own inexact flag is kept with it and ORed into ``inexact`` on every
    use (one small device operation, no synchronisation), so a kept decode that
    holds NaN flags every call that uses it, as a fresh decode would.

    A write the version counter does not see (through ``.data``, a raw pointer, DLPack,
    another process) leaves the old decode in use: call :func:`forget_decoded_weights`
    after such a write, or set ``MOE_EP_CUDA_NCCL_WEIGHT_CACHE=0``.

    Not kept: inside a CUDA-graph capture (a replay must read the weight's memory
    as it is then, so the decode is captured), and with ``MOE_EP_CUDA_NCCL_WEIGHT_CACHE=0``.
    The memory kept is one bf16 copy of each live block-scaled weight; it is freed
    with the weight (a weak reference) or by :func:`forget_decoded_weights`.
    """
    if _capturing(t.data) or not _weight_cache_on():
        return dequantize_bf16(t, inexact, weight=True)
    ident = id(t.data)
    with _OPERANDS_LOCK:
        entry = _DECODED.get(ident)
    if entry is None or not entry.tag.matches(t):
        device = t.data.device
        flag = None if t.format is MoeFormat.NVFP4 else torch.zeros(1, dtype=torch.int32, device=device)
        decoded = dequantize_bf16(t, flag, weight=True)
        done = stream = None
        if device.type == "cuda":
            stream = torch.cuda.current_stream(device)
            done = torch.cuda.Event()
            done.record(stream)
        entry = _KeptDecode(_WeightTag.of(t, lambda ref, ident=ident: _drop_decode(ref, ident)), decoded, flag,
                            done, stream)
        with _OPERANDS_LOCK:
            _DECODED[ident] = entry
    elif entry.stream is not None and torch.cuda.current_stream(entry.decoded.device) != entry.stream:
        # A decode made on another stream: this stream waits for it, and its memory is not
        # reused before this stream's work on it is done (should the entry be dropped).
        stream = torch.cuda.current_stream(entry.decoded.device)
        stream.wait_event(entry.done)
        entry.decoded.record_stream(stream)
        if entry.flag is not None:
            entry.flag.record_stream(stream)
    if inexact is not None and entry.flag is not None:
        inexact.bitwise_or_(entry.flag)
    return entry.decoded


def forget_decoded_weights() -> None:
    """Free every kept bf16 decode of a block-scaled weight (:func:`decoded_weight`)."""
    with _OPERANDS_LOCK:
        _DECODED.clear()


def operands(x: Any, fc1: Any, fc2: Any, *, host_check: bool) -> Tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bf16, x, fc1, fc2)``: the layer's operands, contiguous, all bf16 (the
    tensor-core path on CUDA) or all float32, from plain tensors and
    :class:`BlockScaledOperand` s.

    - Plain tensors only: bf16 when all three are bf16 (as before).
    - With a block-scaled operand and every plain one bf16: the block-scaled ones are
      decoded to bf16 (:func:`dequantize_bf16`; weights transposed in the same pass).
      nvfp4 is exact in bf16 by construction. mxfp8 is exact unless a value lies below
      2^-126 off bf16's subnormal grid (scale codes 0..2 only), which the decode kernel
      turns into NaN and flags on the device. Then:

      - ``host_check`` (the host-synchronised mode, outside a CUDA-graph capture): the
        flags of the mxfp8 rows (every call) and of weights without a cached verdict
        come to the host in one read (one synchronisation; none when there is no such
        operand). Any inexact value: everything is decoded to float32 instead (exact,
        the float32 kernels), so the result never depends on a value bf16 rounded. A
        weight's verdict is kept while it is the same tensor with the same version
        (``_version``: in-place updates bump it); a weight known inexact goes straight
        to float32, one known exact is decoded without a read (a change that bypassed
        the version counter still decodes to NaN, recorded in :func:`inexact_decodes`).
      - no ``host_check`` (the static modes, CUDA-graph capture): no synchronisation is
        allowed, so the bf16 operands are used as decoded: every value is exact, or NaN
        where bf16 cannot hold it, so the results that depend on such a value are NaN
        (visibly not the spec's), and the device record of :func:`inexact_decodes` says so.
    - Otherwise (a plain float32 or float16 operand): everything float32.
    """
    ops = [x, fc1, fc2]
    pending = [isinstance(t, BlockScaledOperand) for t in ops]
    if not any(pending):
        return _operands(x, fc1, fc2)
    if not all(p or t.dtype == torch.bfloat16 for t, p in zip(ops, pending)):
        return _operands(x, fc1, fc2)  # float32 kernels: the block-scaled ones decode to float32
    first = ops[pending.index(True)]
    # The operands whose bf16 decode may be inexact (mxfp8 with values).
    maybe = [p and not t.exact_in_bf16 for t, p in zip(ops, pending)]
    check = [False] * 3
    if host_check and not _capturing(first):
        verdicts = [_cached_verdict(t.source) if m and t.weight else None for t, m in zip(ops, maybe)]
        if any(v is False for v in verdicts):
            return _operands(x, fc1, fc2)  # a weight known inexact: float32
        if any(m and v is None for m, v in zip(maybe, verdicts)):
            check = maybe  # a read is due: it covers every mxfp8 operand (no cached verdict trusted then)
    flags = torch.zeros(3, dtype=torch.int32, device=first.device) if any(check) else None
    rec = _record(first.device) if any(m and not c for m, c in zip(maybe, check)) else None
    decoded = [
        (t.bf16(flags[i : i + 1] if check[i] else rec if maybe[i] else None) if pending[i] else t)
        for i, t in enumerate(ops)
    ]
    if flags is None:
        return _operands(*decoded)
    bits = flags.tolist()  # the one host synchronisation
    for t, c, b in zip(ops, check, bits):
        if c and t.weight:
            _remember_verdict(t.source, b == 0)
    if any(bits):
        return _operands(x, fc1, fc2)  # a value bf16 cannot hold: float32 for all three (exact)
    return _operands(*decoded)


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
        """A block-scaled weight as a :class:`BlockScaledOperand` (decoded when the
        layer's operand dtype is chosen, :func:`operands`); a plain one unchanged."""
        return _pending(w, weight=True)

    def forward_operands(self, activation: Any, tokens: Any, fc1: Any, fc2: Any) -> Tuple[Any, Any, Any]:
        """The layer's operands from the buffer rows ``tokens`` (the activation's
        encoding) and the weights, as given: block-scaled ones as
        :class:`BlockScaledOperand` s. :meth:`experts_forward` / :func:`expert_forward`
        (and :func:`_operands`) turn them into all-bf16 operands (the tensor-core path)
        or all-float32 ones (:func:`operands`)."""
        return _pending(tokens, weight=False), _pending(fc1, weight=True), _pending(fc2, weight=True)

    def round_trip(self, values: torch.Tensor, fmt: Optional[MoeFormat]) -> torch.Tensor:
        if fmt is None:
            return values
        return self.decode(quantize(values, fmt))

    def encode_output(self, config: MoeEpConfig, values: torch.Tensor) -> Any:
        return quantize(values, config.output_format)

    # ---------------------------------------------------------------- experts

    def experts_forward(self, config, plan, x, w, fc1, fc2):
        # A core.Plan is the host-synchronised mode's: block-scaled operands may be checked on the host.
        y, c = expert_forward(config, x, w, fc1, fc2, _slab_sizes(plan, x.device),  # y after the combine round trip
                              host_check=isinstance(plan, core.Plan))
        if not config.static_layout:
            return y, c  # every row is a route (rows of no expert, none here, the layer zeroes)
        valid = plan.valid_rows.unsqueeze(1)
        return torch.where(valid, y, torch.zeros_like(y)), torch.where(valid, c, torch.zeros_like(c))

    def experts_backward(self, config, plan, x, w, fc1, fc2, fc1_c, dy):
        _, x, fc1, fc2 = operands(x, fc1, fc2, host_check=isinstance(plan, core.Plan))
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


def _operands(x: Any, fc1: Any, fc2: Any) -> Tuple[bool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(bf16, x, fc1, fc2)``: all three bf16 when they all are plain bf16 tensors, else
    all float32; contiguous. A :class:`BlockScaledOperand` still pending here (the float32
    fallbacks of :func:`operands`) is decoded to float32."""
    if any(isinstance(t, BlockScaledOperand) for t in (x, fc1, fc2)):
        x, fc1, fc2 = (t.f32() if isinstance(t, BlockScaledOperand) else t for t in (x, fc1, fc2))
    if x.dtype == fc1.dtype == fc2.dtype == torch.bfloat16:
        return True, x.contiguous(), fc1.contiguous(), fc2.contiguous()
    return False, _f32(x), _f32(fc1), _f32(fc2)


#: ``1`` (default): read mxfp8 weights' codes in the forward when the rows are few
#: (:func:`coded_weights_path`); ``0``: always their kept bf16 decode. On by default since
#: 2026-12-02, run 37 (an H200, the bench's decode shape, alternated in one call): 0.429 and
#: 0.427 of the weight read against the kept decode's 0.402 and 0.402; see
#: docs/cuda-nccl.md, "The block-scaled-weights forward".
MXFP8_WEIGHTS_ENV = "MOE_EP_CUDA_NCCL_MXFP8_WEIGHTS"
#: The same switch for nvfp4 weights (``1`` by default).
NVFP4_WEIGHTS_ENV = "MOE_EP_CUDA_NCCL_NVFP4_WEIGHTS"
#: The block-scaled-weights forward runs when the buffer has at most this many rows per
#: local expert on average: the bound up to which the kernels take their few-rows variant
#: (``mxw::kFewRowsPerExpert`` in ``mxfp8_weights_gemm.cuh``, which the nvfp4 kernel shares;
#: a test keeps the two equal), so a padded decode buffer (128 tokens, top-8, 32 experts,
#: alignment 16: 47 rows an expert) takes it too. Run 41 (an H200, FC1 of the decode shape,
#: mxfp8): 0.353 ms at 48 rows an expert against the kept decode's bf16 GEMM's 0.446 (at 64
#: rows 0.444 against 0.458: no longer worth the bound).
CODED_WEIGHTS_MAX_ROWS_PER_EXPERT = 48

_CODED_WEIGHTS_ENVS = {MoeFormat.MXFP8: MXFP8_WEIGHTS_ENV, MoeFormat.NVFP4: NVFP4_WEIGHTS_ENV}


def _coded_weights_switches() -> Dict[MoeFormat, bool]:
    """Each block format's switch (:data:`MXFP8_WEIGHTS_ENV`, :data:`NVFP4_WEIGHTS_ENV`), checked."""
    on = {}
    for fmt, name in _CODED_WEIGHTS_ENVS.items():
        value = os.environ.get(name, "1")
        if value not in ("0", "1"):
            raise E.ConfigError(
                f"{name} must be '0' (always the bf16 decode) or '1' (read the codes when rows are few); "
                f"got {value!r}",
                field=name, value=value,
            )
        on[fmt] = value == "1"
    return on


def coded_weights_path(config: MoeEpConfig, x: Any, fc1: Any, fc2: Any, *, host_check: bool) -> bool:
    """Whether the experts forward reads block-scaled weights' codes themselves
    (``moe_ep_layer_experts_forward_block_scaled``: grouped GEMMs that decode them to bf16
    in registers) instead of their kept bf16 decode (:func:`decoded_weight`): both weights
    :class:`BlockScaledOperand` s of one format, mxfp8 or nvfp4, on CUDA, x bf16 or
    block-scaled, hidden and intermediate multiples of 128, at most
    :data:`CODED_WEIGHTS_MAX_ROWS_PER_EXPERT` rows per local expert (the decode regime,
    where the weight read is the cost), and the format's switch (:data:`MXFP8_WEIGHTS_ENV`,
    :data:`NVFP4_WEIGHTS_ENV`) not ``0``. mxfp8 with ``host_check`` (outside a capture) also
    needs both weights' cached exact verdict (:func:`operands` makes it on the first call),
    so the weights' flags need no read: like a kept decode with a verdict, a value bf16
    cannot hold is NaN and lands in :func:`inexact_decodes`; nvfp4 is always exact. The
    values are those of the bf16 path; the sums may differ in order only (float32
    accumulation either way)."""
    switches = _coded_weights_switches()  # read before any operand: a bad value is an error on every call
    if not (isinstance(fc1, BlockScaledOperand) and isinstance(fc2, BlockScaledOperand)):
        return False
    fmt = fc1.source.format
    if not switches.get(fmt, False):
        return False
    for t in (fc1, fc2):
        if not (t.weight and t.source.format is fmt):
            return False
    if fc1.device.type != "cuda" or fc2.device != fc1.device:
        return False
    if not isinstance(x, BlockScaledOperand) and x.dtype != torch.bfloat16:
        return False
    if config.hidden % 128 or config.intermediate % 128:
        return False
    if int(x.shape[0]) > CODED_WEIGHTS_MAX_ROWS_PER_EXPERT * config.num_local_experts:
        return False
    if fmt is MoeFormat.MXFP8 and host_check and not _capturing(fc1.source.data):
        return all(_cached_verdict(t.source) is True for t in (fc1, fc2))
    return True


def coded_weights_forward(
    layer: Layer, config: MoeEpConfig, x: Any, w: torch.Tensor, fc1: BlockScaledOperand, fc2: BlockScaledOperand,
    group_sizes: torch.Tensor, y: torch.Tensor, fc1_c: Optional[torch.Tensor], *, host_check: bool,
) -> bool:
    """The layer's experts forward with the block-scaled weights' codes read directly
    (``moe_ep_layer_experts_forward_block_scaled``) into ``y`` and ``fc1_c``, for operands
    that passed :func:`coded_weights_path`: True when it ran; False when it does not apply
    after all (the layer has no tensor-core path, or x's host-checked decode is inexact),
    and the caller takes the bf16 path. x (bf16 or a :class:`BlockScaledOperand`) is
    decoded as :func:`operands` decodes it; mxfp8 weights' flag goes to the device record of
    :func:`inexact_decodes` (no read: their verdicts are cached, or no check is allowed)."""
    if not (layer.info.tensor_cores and layer.bf16_operands):
        return False
    device = fc1.device
    if isinstance(x, BlockScaledOperand):
        if x.exact_in_bf16:
            x = x.bf16(None)
        elif host_check and not _capturing(x.source.data):
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            decoded = x.bf16(flag)
            if int(flag.item()):  # the one host synchronisation, as operands() makes for mxfp8 rows
                return False
            x = decoded
        else:
            x = x.bf16(_record(device))
    x = x.contiguous()
    fmt = fc1.source.format
    rec = _record(device) if fmt is MoeFormat.MXFP8 else None
    w = _f32(w)
    gs = group_sizes.to(torch.int32).contiguous()  # every operand bound to a name: alive until the call returns
    c1, s1, c2, s2 = (t.contiguous() for t in (fc1.source.data, fc1.source.scale, fc2.source.data, fc2.source.scale))
    _, stream = where(x)
    layer.experts_forward_block_scaled(stream, int(_FORMAT[fmt]), int(x.shape[0]), ptr(x), ptr(w), ptr(c1), ptr(s1),
                                       ptr(c2), ptr(s2), ptr(gs), ptr(y), ptr(fc1_c),
                                       None if rec is None else ptr(rec))
    return True


def expert_forward(
    config: MoeEpConfig, x: torch.Tensor, w: torch.Tensor, fc1: torch.Tensor, fc2: torch.Tensor,
    group_sizes: torch.Tensor, *, host_check: bool = False, stash: bool = True,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The native layer's experts forward on tensors: ``(y [C, H] float32, fc1_c [C, 2I] bfloat16)``:
    ``y`` after the combine round trip, the stash of the FC1 output (None with ``stash``
    False: not written, when no backward follows). ``x``, ``fc1``, ``fc2``
    bf16 (the tensor-core path on CUDA), any float dtype (float32 kernels) or
    :class:`BlockScaledOperand` s (decoded by :func:`operands`, with a host check when
    ``host_check``: the host-synchronised mode; the static mode calls this directly,
    without); block-scaled weights at few rows are read as codes (:func:`coded_weights_path`);
    ``group_sizes`` ``[E_local] int32`` on the rows' device: slab sizes from row 0."""
    if coded_weights_path(config, x, fc1, fc2, host_check=host_check):
        rows = int(x.shape[0])
        layer = layer_for(config, rows, fc1.device, True, backward=False)
        y = torch.empty((rows, config.hidden), dtype=torch.float32, device=fc1.device)
        c = torch.empty((rows, 2 * config.intermediate), dtype=torch.bfloat16, device=fc1.device) if stash else None
        if coded_weights_forward(layer, config, x, w, fc1, fc2, group_sizes, y, c, host_check=host_check):
            return y, c
    bf16, x, fc1, fc2 = operands(x, fc1, fc2, host_check=host_check)
    w = _f32(w)
    gs = group_sizes.to(torch.int32).contiguous()  # every operand bound to a name: alive until the call returns
    rows, h, i = int(x.shape[0]), config.hidden, config.intermediate
    layer = layer_for(config, rows, x.device, bf16, backward=False)
    y = torch.empty((rows, h), dtype=torch.float32, device=x.device)
    c = torch.empty((rows, 2 * i), dtype=torch.bfloat16, device=x.device) if stash else None
    _, stream = where(x)
    layer.experts_forward(stream, rows, ptr(x), ptr(w), ptr(fc1), ptr(fc2), ptr(gs), ptr(y), ptr(c))
    return y, c


@dataclass(frozen=True)
class MainGrads:
    """Float32 weight-gradient accumulators (Megatron's ``main_grad`` convention) the
    backward adds its weight gradients into, in the native weight-gradient GEMMs
    (``MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS``): no separate cast or add.

    Attributes:
        fc1: ``[E_local, H, 2I]`` float32, or None: the FC1 weight's ``main_grad``.
        fc2: ``[E_local, I, H]`` float32, or None: the FC2 weight's ``main_grad``.
        bf16: with neither accumulator, on a bf16 layer: the weight gradients are
            written as bf16 by the weight-gradient GEMMs' epilogue
            (``MOE_EP_BACKWARD_WEIGHT_GRADS_BF16``: the float32 gradients rounded to
            nearest even, what a cast gives), for bf16 weight leaves: no cast pass.
    """

    fc1: Optional[torch.Tensor]
    fc2: Optional[torch.Tensor]
    bf16: bool = False


@dataclass(frozen=True)
class WeightGradBuffers:
    """Where the native backward writes the weight gradients (:func:`weight_grad_buffers`).

    Attributes:
        fc1: ``[E_local, H, 2I]`` float32 or bfloat16: dfc1.
        fc2: ``[E_local, I, H]`` float32 or bfloat16: dfc2.
        accumulate: the buffers are accumulators, added to.
        bf16: the buffers are bfloat16, written.
    """

    fc1: torch.Tensor
    fc2: torch.Tensor
    accumulate: bool
    bf16: bool


def main_grad_of(weight: Any) -> Optional[torch.Tensor]:
    """``weight.main_grad`` when the weight carries one (a float32, contiguous tensor of
    the weight's shape on its device), else None.

    Raises:
        DTypeError / ShapeError: a ``main_grad`` that is not float32, contiguous, of the
            weight's shape and device (the rule, and what it is).
    """
    grad = getattr(weight, "main_grad", None) if isinstance(weight, torch.Tensor) else None
    if grad is None:
        return None
    if not isinstance(grad, torch.Tensor) or grad.dtype != torch.float32 or not grad.is_contiguous():
        got = type(grad).__name__ if not isinstance(grad, torch.Tensor) else f"{grad.dtype}, contiguous {grad.is_contiguous()}"
        raise E.DTypeError(
            f"a weight's main_grad must be a contiguous float32 tensor (the gradient is accumulated there in float32); "
            f"got {got}",
            name="main_grad", expected="float32", got=got,
        )
    if tuple(grad.shape) != tuple(weight.shape) or grad.device != weight.device:
        raise E.ShapeError(
            f"a weight's main_grad must have the weight's shape {tuple(weight.shape)} on its device {weight.device}; "
            f"got {tuple(grad.shape)} on {grad.device}",
            name="main_grad", expected=tuple(weight.shape), got=tuple(grad.shape),
        )
    return grad


def weight_grad_buffers(fc1_shape: Any, fc2_shape: Any, device: torch.device, main_grads: Optional[MainGrads],
                        bf16_layer: bool = False) -> WeightGradBuffers:
    """Where the native backward writes the weight gradients. Without ``main_grads``:
    two new float32 tensors, written. With ``main_grads.bf16``, no accumulator and a bf16
    layer (``bf16_layer``): two new bfloat16 tensors, written. With accumulators: them
    (a zero-filled tensor for a weight without one), added to."""
    def new(shape: Any, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    if main_grads is None or (main_grads.fc1 is None and main_grads.fc2 is None):
        bf16 = main_grads is not None and main_grads.bf16 and bf16_layer
        dtype = torch.bfloat16 if bf16 else torch.float32
        return WeightGradBuffers(new(fc1_shape, dtype), new(fc2_shape, dtype), False, bf16)
    d1 = main_grads.fc1 if main_grads.fc1 is not None else torch.zeros(tuple(fc1_shape), dtype=torch.float32,
                                                                       device=device)
    d2 = main_grads.fc2 if main_grads.fc2 is not None else torch.zeros(tuple(fc2_shape), dtype=torch.float32,
                                                                       device=device)
    return WeightGradBuffers(d1, d2, True, False)


def expert_backward(
    config: MoeEpConfig,
    x: torch.Tensor,
    w: torch.Tensor,
    fc1: torch.Tensor,
    fc2: torch.Tensor,
    fc1_c: torch.Tensor,
    dy: torch.Tensor,
    group_sizes: torch.Tensor,
    main_grads: Optional[MainGrads] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The native layer's experts backward on tensors: float32 ``(dx [C, H], dw [C],
    dfc1 [E_local, H, 2I], dfc2 [E_local, I, H])`` from the bf16 stash ``fc1_c`` and
    the cotangent rows ``dy`` ``[C, H]`` (bfloat16 passes as is, others as float32);
    operands as :func:`expert_forward`; the backward's GEMM operands as
    ``config.backward_operand_format`` says. With ``main_grads``, dfc1 and dfc2 are the
    accumulators, this step's gradients added to them, or bfloat16 with
    ``main_grads.bf16`` on a bf16 layer (:func:`weight_grad_buffers`)."""
    bf16, x, fc1, fc2 = operands(x, fc1, fc2, host_check=False)
    w = _f32(w)
    dy_bf16 = dy.dtype == torch.bfloat16
    dy = dy.contiguous() if dy_bf16 else _f32(dy)
    stash = fc1_c.to(torch.bfloat16).contiguous()
    gs = group_sizes.to(torch.int32).contiguous()
    rows, h = int(x.shape[0]), config.hidden
    layer = layer_for(config, rows, x.device, bf16, backward=True)
    dx = torch.empty((rows, h), dtype=torch.float32, device=x.device)
    dw = torch.empty((rows,), dtype=torch.float32, device=x.device)
    g = weight_grad_buffers(fc1.shape, fc2.shape, x.device, main_grads, bf16_layer=bf16)
    _, stream = where(x)
    layer.experts_backward(
        stream, rows, ptr(x), ptr(w), ptr(fc1), ptr(fc2), ptr(stash), ptr(dy), ptr(gs), ptr(dx), ptr(dw), ptr(g.fc1),
        ptr(g.fc2), dy_bf16=dy_bf16, accumulate=g.accumulate, weight_grads_bf16=g.bf16,
    )
    return dx, dw, g.fc1, g.fc2


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
