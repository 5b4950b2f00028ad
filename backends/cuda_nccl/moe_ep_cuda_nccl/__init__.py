"""MoeEp on the native core's CUDA kernels and NCCL transport, for PyTorch: backend ``cuda-nccl``.

- :mod:`moe_ep_cuda_nccl.api`: ``moe_ep`` / ``moe_ep_backward`` (differentiable,
  host-synchronised or static-shape and CUDA-graph capturable),
  ``check_errors``, ``close_communicators``;
- :mod:`moe_ep_cuda_nccl.backend`: the world-level spec interface
  (``moe_ep_spec.get_backend("cuda-nccl")``);
- :mod:`moe_ep_cuda_nccl.prims`: the native kernels and transport as the torch
  layer's primitives; :mod:`moe_ep_cuda_nccl.static`: the static-shape mode;
  :mod:`moe_ep_cuda_nccl.device_exchange`: the static-shape mode over the native
  layer's device exchange; :mod:`moe_ep_cuda_nccl.device_world`: the world-level
  interface over it (``MOE_EP_CUDA_NCCL_EXCHANGE=device``; ranks may share one GPU).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
