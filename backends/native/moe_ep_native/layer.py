"""The native layer object (``moe_ep_layer_*`` of the C ABI) over raw pointers.

A :class:`Layer` is one rank's expert computation for one configuration on one
device, made once: it owns its workspaces, so its stages allocate nothing and,
on CUDA, only enqueue work on the stream they are given (CUDA-graph
capturable). Framework-neutral: the stages take addresses (``int``, or
``None`` for an empty array) and a stream handle, so the PyTorch front-end
(``moe_ep_cuda_nccl``) and any other binding share it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import ConfigError
from moe_ep_spec.formats import MoeFormat

from ._capi import DType, Format, LayerConfig, call
from ._capi import LayerInfo as _RawLayerInfo

__all__ = ["Layer", "LayerInfo", "layer_config"]

#: flags of ``moe_ep_layer_experts_backward_ex`` (moe_ep_native.h).
BACKWARD_ACCUMULATE_WEIGHT_GRADS = 1
BACKWARD_WEIGHT_GRADS_BF16 = 2

_FORMAT = {None: Format.NONE, MoeFormat.BF16: Format.BF16, MoeFormat.MXFP8: Format.MXFP8, MoeFormat.NVFP4: Format.NVFP4}


@dataclass(frozen=True)
class LayerInfo:
    """What a layer runs.

    Attributes:
        tensor_cores: the expert GEMMs run on tensor cores (CUTLASS grouped GEMMs,
            bf16 operands); False: the float32 kernels.
        fc2_operand_planes: bf16 pieces the FC2 operand is split into on tensor
            cores (1 when it is exactly bf16, 3 otherwise; 0 without tensor cores).
        workspace_bytes: the memory the layer allocated.
    """

    tensor_cores: bool
    fc2_operand_planes: int
    workspace_bytes: int


def layer_config(
    config: MoeEpConfig,
    *,
    max_rows: int,
    cuda_device: Optional[int],
    bf16_operands: bool,
    with_backward: bool,
    bf16_expert_out: bool = False,
) -> LayerConfig:
    """The ``moe_ep_layer_config`` of one rank of ``config``.

    Args:
        max_rows: the most rows of the expert-major buffer a stage will take (>= 0).
        cuda_device: the CUDA device ordinal, or None for the CPU implementation.
        bf16_operands: x, fc1 and fc2 are bf16 (else float32).
        with_backward: also allocate what the backward needs.
        bf16_expert_out: the expert-output rows ``y`` of ``experts_forward`` (and the
            device exchange's combine) are bf16 instead of float32; needs
            ``config.combine_format`` bf16 or nvfp4 (the rows are bf16 values then: the
            same numbers in half the bytes).
    """
    if max_rows < 0:
        raise ConfigError(f"max_rows must be >= 0; got {max_rows}", field="max_rows", value=max_rows)
    clamp = config.gate_up_clamp
    return LayerConfig.make(
        device=0 if cuda_device is None else 1,
        cuda_device=0 if cuda_device is None else int(cuda_device),
        operand_dtype=int(DType.BF16 if bf16_operands else DType.F32),
        max_rows=int(max_rows),
        hidden=config.hidden,
        intermediate=config.intermediate,
        num_local_experts=config.num_local_experts,
        apply_topk_in_fc1=int(bool(config.apply_topk_in_fc1)),
        has_clamp=int(clamp is not None),
        gate_up_clamp=float(clamp) if clamp is not None else 0.0,
        intermediate_format=int(_FORMAT[config.intermediate_format]),
        combine_format=int(_FORMAT[config.combine_format]),
        with_backward=int(bool(with_backward)),
        expert_out_dtype=int(DType.BF16 if bf16_expert_out else DType.F32),
        backward_operand_format=int(_FORMAT[config.backward_operand_format]),
    )


class Layer:
    """A ``moe_ep_layer``: made by :meth:`__init__`, freed by :meth:`close` (or when collected).

    Raises (on creation): :class:`~moe_ep_spec.NativeArgumentError` for a bad
    configuration, :class:`~moe_ep_spec.NativeError` when memory cannot be had
    or the build lacks the device.
    """

    def __init__(self, config: LayerConfig) -> None:
        self._handle = ctypes.c_void_p()
        self.max_rows = int(config.max_rows)
        self.with_backward = bool(config.with_backward)
        self.bf16_operands = config.operand_dtype == DType.BF16
        self.bf16_expert_out = config.expert_out_dtype == DType.BF16
        self.bf16_backward = config.backward_operand_format == Format.BF16
        self.cuda_device: Optional[int] = int(config.cuda_device) if config.device == 1 else None
        call("moe_ep_layer_create", ctypes.byref(config), ctypes.byref(self._handle))
        raw = _RawLayerInfo()
        raw.struct_size = ctypes.sizeof(_RawLayerInfo)
        call("moe_ep_layer_get_info", self._handle, ctypes.byref(raw))
        self.info = LayerInfo(bool(raw.tensor_cores), int(raw.fc2_operand_planes), int(raw.workspace_bytes))

    @property
    def closed(self) -> bool:
        return not self._handle.value

    def close(self) -> None:
        """Free the layer after the work enqueued with it (idempotent)."""
        if self._handle.value:
            handle, self._handle = self._handle, ctypes.c_void_p()
            call("moe_ep_layer_destroy", handle)

    def __del__(self) -> None:  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:
            pass

    def experts_forward(self, stream: Optional[int], num_rows: int, x: Optional[int], w: Optional[int],
                        fc1: Optional[int], fc2: Optional[int], group_sizes: Optional[int], y: Optional[int],
                        fc1_c: Optional[int]) -> None:
        """``moe_ep_layer_experts_forward``: x ``[C, H]``, w ``[C] float32``, fc1
        ``[E_local, H, 2I]``, fc2 ``[E_local, I, H]`` (the layer's operand dtype),
        group_sizes ``[E_local] int32`` in; y ``[C, H]`` (after the combine round trip;
        float32, or bf16 for a layer made with ``bf16_expert_out``) and fc1_c
        ``[C, 2I] bf16`` (or None) out."""
        call("moe_ep_layer_experts_forward", self._handle, stream, num_rows, x, w, fc1, fc2, group_sizes, y, fc1_c)

    def experts_forward_mxfp8(
        self,
        stream: Optional[int],
        num_rows: int,
        x: Optional[int],
        w: Optional[int],
        fc1_codes: Optional[int],
        fc1_scales: Optional[int],
        fc2_codes: Optional[int],
        fc2_scales: Optional[int],
        group_sizes: Optional[int],
        y: Optional[int],
        fc1_c: Optional[int],
        inexact: Optional[int],
    ) -> None:
        """``moe_ep_layer_experts_forward_mxfp8``: :meth:`experts_forward` with mxfp8 weights
        read as stored: fc1_codes ``[E_local, 2I, H] uint8`` and fc1_scales ``[E_local, 2I,
        H / 32] uint8``, fc2_codes ``[E_local, H, I] uint8`` and fc2_scales ``[E_local, H,
        I / 32] uint8`` (each weight transposed, blocked along its contraction axis); x bf16
        (the layer's operand dtype must be bf16); inexact ``[1] int32`` (or None): 1 ORed in
        when a weight value is not a bf16 value (decoded to NaN, as the bf16 decode does).
        Raises :class:`~moe_ep_spec.NativeError` (unsupported) on CUDA without the
        tensor-core path or with hidden or intermediate not a multiple of 128."""
        call(
            "moe_ep_layer_experts_forward_mxfp8", self._handle, stream, num_rows, x, w, fc1_codes, fc1_scales,
            fc2_codes, fc2_scales, group_sizes, y, fc1_c, inexact,
        )

    def experts_forward_block_scaled(
        self,
        stream: Optional[int],
        weight_format: int,
        num_rows: int,
        x: Optional[int],
        w: Optional[int],
        fc1_codes: Optional[int],
        fc1_scales: Optional[int],
        fc2_codes: Optional[int],
        fc2_scales: Optional[int],
        group_sizes: Optional[int],
        y: Optional[int],
        fc1_c: Optional[int],
        inexact: Optional[int],
    ) -> None:
        """``moe_ep_layer_experts_forward_block_scaled``: :meth:`experts_forward` with
        block-scaled weights read as stored, ``weight_format`` :attr:`Format.MXFP8
        <moe_ep_native._capi.Format>` (as :meth:`experts_forward_mxfp8`) or ``Format.NVFP4``:
        fc1_codes ``[E_local, 2I, H / 2] uint8`` (two E2M1 codes a byte, element ``2j`` in
        the low nibble) and fc1_scales ``[E_local, 2I, H / 16] uint8`` (E4M3), fc2_codes
        ``[E_local, H, I / 2] uint8`` and fc2_scales ``[E_local, H, I / 16] uint8`` (each
        weight transposed, blocked along its contraction axis); x bf16 (the layer's operand
        dtype must be bf16); inexact ``[1] int32`` (or None): mxfp8's flag (nvfp4 never sets
        it). Raises :class:`~moe_ep_spec.NativeError` (unsupported) on CUDA without the
        tensor-core path or with hidden or intermediate not a multiple of 128."""
        call(
            "moe_ep_layer_experts_forward_block_scaled", self._handle, stream, weight_format, num_rows, x, w,
            fc1_codes, fc1_scales, fc2_codes, fc2_scales, group_sizes, y, fc1_c, inexact,
        )

    def experts_backward(self, stream: Optional[int], num_rows: int, x: Optional[int], w: Optional[int],
                         fc1: Optional[int], fc2: Optional[int], fc1_c: Optional[int], dy: Optional[int],
                         group_sizes: Optional[int], dx: Optional[int], dw: Optional[int], dfc1: Optional[int],
                         dfc2: Optional[int], dy_bf16: bool = False, accumulate: bool = False,
                         weight_grads_bf16: bool = False) -> None:
        """``moe_ep_layer_experts_backward_ex``: as :meth:`experts_forward` plus fc1_c
        ``[C, 2I] bf16`` and dy ``[C, H]`` (float32, or bf16 with ``dy_bf16``) in;
        dx ``[C, H]``, dw ``[C]``, dfc1 ``[E_local, H, 2I]``, dfc2 ``[E_local, I, H]``
        float32 out, with the layer's ``backward_operand_format``. ``accumulate``: dfc1
        and dfc2 hold float32 gradients (a ``main_grad``) and get this step's added
        (``MOE_EP_BACKWARD_ACCUMULATE_WEIGHT_GRADS``). ``weight_grads_bf16``: dfc1 and
        dfc2 are bf16 (uint16 bit patterns) and get the float32 gradients rounded to
        nearest even (``MOE_EP_BACKWARD_WEIGHT_GRADS_BF16``; a bf16 layer; not with
        ``accumulate``: the native call refuses both)."""
        flags = (BACKWARD_ACCUMULATE_WEIGHT_GRADS if accumulate else 0) | (
            BACKWARD_WEIGHT_GRADS_BF16 if weight_grads_bf16 else 0)
        call(
            "moe_ep_layer_experts_backward_ex", self._handle, stream, num_rows, x, w, fc1, fc2, fc1_c, dy,
            int(DType.BF16 if dy_bf16 else DType.F32), group_sizes, dx, dw, dfc1, dfc2, flags,
        )
