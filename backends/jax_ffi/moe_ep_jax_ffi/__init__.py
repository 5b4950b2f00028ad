"""MoeEp for JAX over the native kernel core: backend ``jax-ffi``.

The layer is :mod:`moe_ep_jax`'s (routing plan, exchange, expert-major layout,
``custom_vjp`` inside ``jax.shard_map``); the kernel provider is different:
:class:`~moe_ep_jax_ffi.kernels.FfiKernels` runs the formats, the routing plan,
the Form-A combine reduction and the grouped SwiGLU experts in the native C++
(and, when built with ``MOE_EP_NATIVE_CUDA=ON``, CUDA) core
(``backends/native/include/moe_ep_native.h``) through XLA FFI handlers compiled
into :mod:`moe_ep_jax_ffi._ffi`.

- :mod:`moe_ep_jax_ffi.native`: the extension, its targets and their registration
  with XLA (``jax.ffi.register_ffi_target``, CPU and CUDA).
- :mod:`moe_ep_jax_ffi.kernels`: :class:`~moe_ep_jax_ffi.kernels.FfiKernels`, the
  :class:`moe_ep_jax.kernels.ExpertKernels` provider over those targets; pass it as
  ``kernels=`` to :mod:`moe_ep_jax.api`.
- :mod:`moe_ep_jax_ffi.backend`: the world-launch backend ``jax-ffi`` the
  conformance suite runs.

Importing this package imports neither jax nor the extension. See ``docs/jax-ffi.md``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
