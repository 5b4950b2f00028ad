"""The native extension :mod:`moe_ep_jax_ffi._ffi` and its XLA FFI targets.

The extension compiles the MoeEp native core (``backends/native``, C ABI
``moe_ep_native.h``) together with one XLA FFI handler per entry point, for the
CPU always and for CUDA when built with ``MOE_EP_NATIVE_CUDA=ON``. Its targets,
registered under the same names for the platforms ``cpu`` and ``CUDA`` (XLA
picks by the platform it compiles for):

=========================  =================================================
target                     C ABI call
=========================  =================================================
``moe_ep_quantize``        ``moe_ep_quantize`` (bf16, mxfp8, nvfp4)
``moe_ep_dequantize``      ``moe_ep_dequantize``
``moe_ep_plan_routes``     ``moe_ep_plan_routes``
``moe_ep_permute_rows``    ``moe_ep_permute_rows``
``moe_ep_combine_reduce``  ``moe_ep_combine_reduce`` (with ``route_pos``)
``moe_ep_slot_sum``        ``moe_ep_combine_reduce`` (``route_pos`` NULL)
``moe_ep_expert_forward``  ``moe_ep_layer_experts_forward`` (a cached layer object)
``moe_ep_expert_backward`` ``moe_ep_layer_experts_backward`` (a cached layer object)
=========================  =================================================

Nothing here imports jax or the extension until asked (:func:`extension`,
:func:`register`).
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Dict, Optional, Tuple

from moe_ep_spec.formats import MoeFormat

__all__ = [
    "TARGETS",
    "FORMAT_CODES",
    "BUILD_HINT",
    "extension",
    "load_problem",
    "platforms",
    "jax_platform",
    "register",
    "registered_platforms",
]

#: Every target the extension registers (the same names on every platform).
TARGETS: Tuple[str, ...] = (
    "moe_ep_quantize",
    "moe_ep_dequantize",
    "moe_ep_dequantize_bf16",
    "moe_ep_dequantize_bf16_gather",
    "moe_ep_plan_routes",
    "moe_ep_permute_rows",
    "moe_ep_combine_reduce",
    "moe_ep_combine_reduce_encode",
    "moe_ep_slot_sum",
    "moe_ep_expert_forward",
    "moe_ep_expert_backward",
)

#: ``moe_ep_format`` codes of the C ABI (None: no rounding).
FORMAT_CODES: Dict[Optional[MoeFormat], int] = {
    None: 0,
    MoeFormat.BF16: 1,
    MoeFormat.MXFP8: 2,
    MoeFormat.NVFP4: 3,
}

#: How to build the extension (part of every "not built" message).
BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e backends/jax_ffi` from the repository root (needs "
    "CMake >= 3.21, a C++17 compiler, and scikit-build-core, nanobind and jax in the environment; set "
    "MOE_EP_NATIVE_CUDA=ON for the CUDA handlers); see docs/jax-ffi.md"
)

_lock = threading.Lock()
_registered: Dict[str, bool] = {}
_ext: Any = None
_ext_error: Optional[str] = None


def extension() -> Any:
    """The imported :mod:`moe_ep_jax_ffi._ffi`.

    Raises:
        ImportError: it is not built (or cannot be loaded); the message says
            why and how to build it.
    """
    global _ext, _ext_error
    if _ext is not None:
        return _ext
    try:
        _ext = importlib.import_module("moe_ep_jax_ffi._ffi")
    except ImportError as exc:
        _ext_error = (
            f"the native extension moe_ep_jax_ffi._ffi is not built or cannot be loaded "
            f"({type(exc).__name__}: {exc}); {BUILD_HINT}"
        )
        raise ImportError(_ext_error) from exc
    return _ext


def load_problem() -> str:
    """Empty when the extension imports, else why not (with how to build it). Never raises."""
    try:
        extension()
    except ImportError as exc:
        return str(exc)
    return ""


def jax_platform() -> str:
    """The platform of jax's default devices as the handlers name it: ``cpu``,
    ``cuda`` (jax reports NVIDIA GPUs as ``gpu``), ``rocm``, or jax's own name."""
    import jax

    dev = jax.devices()[0]
    if dev.platform in ("gpu", "cuda", "rocm"):
        version = str(getattr(dev.client, "platform_version", "") or "").lower()
        return "rocm" if dev.platform == "rocm" or "rocm" in version else "cuda"
    return dev.platform


def platforms() -> Tuple[str, ...]:
    """The XLA platforms the built extension has handlers for (``cpu``, and ``CUDA`` when built with it)."""
    return tuple(extension().platforms())


def register() -> Tuple[str, ...]:
    """Register every target with XLA for every platform the extension has
    handlers for (``jax.ffi.register_ffi_target``); idempotent and thread-safe.
    Returns the platforms registered.

    Raises:
        ImportError: the extension is not built.
    """
    if _registered.get("done"):
        return registered_platforms()
    with _lock:
        if _registered.get("done"):
            return registered_platforms()
        ext = extension()
        import jax

        for platform in ext.platforms():
            for name, handler in ext.registrations(platform).items():
                # A stage bundle ({"initialize": ..., "execute": ...}: the CUDA
                # expert stages) carries its command-buffer trait here; a single
                # handler reports its own traits.
                kw = {"traits": _command_buffer_trait()} if isinstance(handler, dict) else {}
                jax.ffi.register_ffi_target(name, handler, platform=platform, **kw)
            _registered[platform] = True
        _registered["done"] = True
    return registered_platforms()


def _command_buffer_trait() -> Any:
    """XLA's COMMAND_BUFFER_COMPATIBLE custom-call trait (the execute stage may be captured in a CUDA graph)."""
    from jaxlib import xla_client

    return xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE


def registered_platforms() -> Tuple[str, ...]:
    """The platforms whose targets :func:`register` has registered in this process."""
    return tuple(p for p in _registered if p != "done")
