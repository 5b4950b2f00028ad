"""``cuda-nccl``: the world-level MoeEp backend over the native core's CUDA
kernels and NCCL transport, one process per rank.

It is the ``torch`` backend (:class:`moe_ep_torch.backend.TorchBackend`: the
numpy conversions, the plan, the error sharing, dispatch/combine and the
stash checks) with :data:`moe_ep_cuda_nccl.prims.NATIVE` as its primitives.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from functools import partial
from typing import Any, Callable, Optional

from moe_ep_spec.backend import Availability, Capabilities, Launch, installed_version
from moe_ep_torch.backend import TorchBackend

__all__ = ["CudaNcclBackend", "CPU_ENV"]

__version__ = "0.1.0"

#: See :data:`moe_ep_cuda_nccl.prims.CPU_ENV` (kept here so that detection imports nothing heavy).
CPU_ENV = "MOE_EP_CUDA_NCCL_ON_CPU"
#: See :data:`moe_ep_cuda_nccl.device_exchange.EXCHANGE_ENV`: ``device`` runs the world-level
#: calls over the device exchange (:mod:`moe_ep_cuda_nccl.device_world`).
EXCHANGE_ENV = "MOE_EP_CUDA_NCCL_EXCHANGE"


def _on_cpu() -> bool:
    return os.environ.get(CPU_ENV, "") == "1"


def _device_exchange() -> bool:
    """Whether ``MOE_EP_CUDA_NCCL_EXCHANGE=device`` (checked again, strictly, when a call runs)."""
    return os.environ.get(EXCHANGE_ENV, "") == "device"


def _cuda_device_count() -> Optional[int]:
    """CUDA devices the driver shows this process (``CUDA_VISIBLE_DEVICES``
    applies), asked through the driver library without importing torch; None
    when there is no usable driver."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        if cuda.cuInit(0) != 0:
            return None
        count = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return None
        return count.value
    except (OSError, AttributeError):
        return None


def _native_availability() -> Optional[Availability]:
    """The native core's part of the availability check (installed, loading, built
    with CUDA and NCCL; the CPU test mode needs neither): an Availability when that
    decides (unavailable, or available in the CPU mode), None to go on checking."""
    if importlib.util.find_spec("moe_ep_native") is None:
        return Availability(False, "moe-ep-native is not installed (pip install backends/native)")
    try:
        import moe_ep_native

        moe_ep_native.load()
    except Exception as exc:  # noqa: BLE001 - report, never raise
        return Availability(False, f"the native core did not load: {type(exc).__name__}: {exc}")
    if _on_cpu():
        return Availability(True)
    if not moe_ep_native.has_cuda():
        return Availability(
            False, "libmoe_ep_native was built without CUDA (rebuild with MOE_EP_NATIVE_CUDA=1 MOE_EP_NATIVE_NCCL=1)"
        )
    if not moe_ep_native.has_nccl() and not _device_exchange():
        return Availability(
            False, "libmoe_ep_native was built without the NCCL transport (rebuild with MOE_EP_NATIVE_NCCL=1)"
        )
    return None


def _unless_unavailable(base: Availability) -> Optional[Availability]:
    """The torch backend's answer ``base`` when it says unavailable, else the native
    core's part (:func:`_native_availability`): an Availability that decides, or None."""
    if not base.available:
        return base
    return _native_availability()


class CudaNcclBackend(TorchBackend):
    """MoeEp on CUDA: the native core's kernels (codecs, grouped SwiGLU MLP
    forward and backward, Form-A reduction) and its NCCL transport (count
    all-gather, grouped send/receive of rows), driven from PyTorch.

    Every format, both router-weight placements, the clamp, the stash, the
    backward and dispatch/combine in both layouts, at any EP size. With
    ``MOE_EP_CUDA_NCCL_ON_CPU=1`` it also runs on CPU tensors (the native CPU
    kernels, gloo in place of NCCL): a test mode for machines without a GPU.

    With ``MOE_EP_CUDA_NCCL_EXCHANGE=device`` every call runs over the native
    layer's device exchange instead of NCCL, with a gloo process group
    (:mod:`moe_ep_cuda_nccl.device_world`): ranks may then share one GPU.
    """

    name = "cuda-nccl"
    version = __version__

    def __init__(self) -> None:
        devices = ("cuda", "cpu") if _on_cpu() else ("cuda",)
        self.capabilities = Capabilities(launch=Launch.PROCESS_PER_RANK, devices=devices)

    @property
    def prims(self) -> Any:
        from .prims import NATIVE

        return NATIVE

    def availability(self) -> Availability:
        decided = _unless_unavailable(super().availability())
        if decided is not None:
            return decided
        import torch

        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device is visible to torch (torch.cuda.is_available() is False)")
        return Availability(True)

    def framework_versions(self) -> dict:
        import moe_ep_native

        out = super().framework_versions()
        out["moe_ep_native"] = moe_ep_native.build_info()
        out["native_nccl"] = "yes" if moe_ep_native.has_nccl() else "no"
        out["exchange"] = "device (loopback provider, gloo group)" if _device_exchange() else "nccl"
        return out

    def torch_layer(self, host_sync: Optional[bool] = None) -> Callable[..., Any]:
        """The functional layer :class:`moe_ep_torch.module.MoeEpLayer` runs on
        this backend: None (the default): the fastest conforming path,
        :func:`moe_ep_cuda_nccl.api.moe_ep_default` (the device exchange in the static
        layout sized from ``max_tokens_per_rank``); True or False:
        :func:`moe_ep_cuda_nccl.api.moe_ep` with that ``host_sync`` (False: the
        static-shape mode; its exchange as that function chooses). Imports the torch
        layer now, so a missing piece fails here, not in the first forward."""
        from .api import moe_ep, moe_ep_default

        if host_sync is None:
            return moe_ep_default
        return partial(moe_ep, host_sync=host_sync)

    # ------------------------------------------------- the device exchange (MOE_EP_CUDA_NCCL_EXCHANGE=device)

    @staticmethod
    def _world() -> Any:
        """:mod:`moe_ep_cuda_nccl.device_world` when the device exchange is asked for, else None."""
        from . import device_exchange

        if not device_exchange.enabled():  # raises ConfigError on a value other than nccl / device
            return None
        from . import device_world

        return device_world

    def _via_world(self, op: str, config: Any, *args: Any) -> Any:
        """The world-level op ``op``: over the device exchange when it is enabled, else the torch backend's."""
        world = self._world()
        if world is None:
            return getattr(super(), f"{op}_rank")(config, *args)
        self.require(config, op)
        return getattr(world, op)(config, *args)

    def forward_rank(self, config, ctx, inputs):  # type: ignore[no-untyped-def]
        return self._via_world("forward", config, ctx, inputs)

    def backward_rank(self, config, ctx, inputs, grad_output, stash):  # type: ignore[no-untyped-def]
        return self._via_world("backward", config, ctx, inputs, grad_output, stash)

    def dispatch_rank(self, config, ctx, inputs):  # type: ignore[no-untyped-def]
        return self._via_world("dispatch", config, ctx, inputs)

    def combine_rank(self, config, ctx, handle, expert_out):  # type: ignore[no-untyped-def]
        return self._via_world("combine", config, ctx, handle, expert_out)

    def combine_backward_rank(self, config, ctx, handle, grad_output):  # type: ignore[no-untyped-def]
        return self._via_world("combine_backward", config, ctx, handle, grad_output)

    def dispatch_backward_rank(self, config, ctx, handle, grad_tokens, grad_topk_weights):  # type: ignore[no-untyped-def]
        return self._via_world("dispatch_backward", config, ctx, handle, grad_tokens, grad_topk_weights)

    def quick_availability(self) -> Availability:
        """From what is installed, without importing torch (``moe-ep backends``):
        the torch backend's check, the native core loaded and built with CUDA
        and NCCL, a torch build with CUDA, and a CUDA device the driver shows."""
        decided = _unless_unavailable(super().quick_availability())
        if decided is not None:
            return decided
        version = installed_version("torch") or ""
        if version.endswith("+cpu"):
            return Availability(False, f"torch {version} is a CPU-only build (install a CUDA build of torch)")
        if not _cuda_device_count():
            return Availability(False, "no CUDA device is visible (the CUDA driver libcuda.so.1 reports none or is missing)")
        return Availability(True)
