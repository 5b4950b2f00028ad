"""The MoeEp native kernel core: a framework-neutral C ABI and its numpy binding.

The library ``libmoe_ep_native`` (``include/moe_ep_native.h``) holds one rank's
numerics of the MoeEp operator (docs/spec.md): the routing plan and row
permutation, the grouped SwiGLU expert MLP forward and backward, the Form-A
combine reduction and the bf16 / mxfp8 / nvfp4 codecs, on the CPU and (when
built with ``MOE_EP_NATIVE_CUDA=1``) on CUDA streams. Its kernels never communicate;
the optional NCCL transport moves rows between ranks.

- :func:`library_path` / :func:`include_dir`: for bindings that load or link it
  (ctypes, a PyTorch extension);
- :mod:`moe_ep_native.host`: the CPU entry points on numpy arrays (what the
  tests use to check each kernel against the numpy reference);
- :mod:`moe_ep_native.comm`: the NCCL transport (``Communicator``), in builds
  with ``MOE_EP_NATIVE_NCCL=1``;
- :func:`build_info`, :func:`has_cuda`, :func:`has_nccl`, :func:`abi_version`.

The JAX FFI backend (``backends/jax_ffi``) compiles the same sources into its
extension and calls the same C ABI.
"""

from __future__ import annotations

from ._capi import (
    ABI_VERSION,
    Format,
    Status,
    abi_version,
    build_info,
    has_cuda,
    has_nccl,
    include_dir,
    library_path,
    load,
)

__version__ = "0.1.0"

__all__ = [
    "ABI_VERSION",
    "Format",
    "Status",
    "abi_version",
    "build_info",
    "has_cuda",
    "has_nccl",
    "include_dir",
    "library_path",
    "load",
]
