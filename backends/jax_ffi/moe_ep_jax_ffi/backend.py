"""``jax-ffi``: the ``jax`` backend's layer with the native core as its kernels.

:class:`JaxFfiBackend` is :class:`moe_ep_jax.backend.JaxBackend` (world launch:
one process drives a mesh of ``num_ranks`` devices, host-side validation,
padding, executables cached per operation and shape) whose kernel provider is
:class:`~moe_ep_jax_ffi.kernels.FfiKernels`: the formats, the routing plan, the
combine reduction and the grouped experts run in the native core through XLA
FFI, on the CPU, or on CUDA GPUs when the extension was built with
``MOE_EP_NATIVE_CUDA=ON``.

It registers whether or not the extension is built; ``availability()`` says
why it cannot run (extension not built, jax missing, too few CPU devices, jax
on CUDA with an extension built without CUDA).

Importing this module imports neither jax nor the extension.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any, Dict, Optional

from moe_ep_jax.backend import JaxBackend
from moe_ep_spec.backend import Availability, Capabilities

from . import __version__
from . import native

__all__ = ["JaxFfiBackend"]


class JaxFfiBackend(JaxBackend):
    """MoeEp in JAX over a device mesh, kernels from the native core (XLA FFI).

    Everything :class:`~moe_ep_jax.backend.JaxBackend` supports (every format,
    block-scaled inputs, both router-weight placements, the clamp, the stash,
    the backward, dispatch/combine in both layouts, EP sizes up to the device
    count).

    Args:
        exchange: as :class:`~moe_ep_jax.backend.JaxBackend` (``ragged``,
            ``capacity`` or None: automatic).
        kernels: the provider; default :class:`~moe_ep_jax_ffi.kernels.FfiKernels`
            (created on first use, so that constructing the backend imports nothing).
        fast_compile, cache_size: as :class:`~moe_ep_jax.backend.JaxBackend`.
    """

    name = "jax-ffi"
    version = __version__

    def __init__(
        self, exchange: Optional[str] = None, kernels: Any = None, fast_compile: Optional[bool] = None, cache_size: int = 512
    ) -> None:
        super().__init__(exchange=exchange, kernels=kernels, fast_compile=fast_compile, cache_size=cache_size)

    # ------------------------------------------------------------- description

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """The jax backend's, on the devices the extension has handlers for
        (``cpu``, and ``cuda`` when built with ``MOE_EP_NATIVE_CUDA=ON``)."""
        base = super().capabilities
        devices = ("cpu",)
        if not native.load_problem():
            try:
                if "CUDA" in native.platforms():
                    devices = ("cpu", "cuda")
            except Exception:  # noqa: BLE001 - describing must not raise
                pass
        return dataclasses.replace(base, devices=devices)

    def availability(self) -> Availability:
        if importlib.util.find_spec("jax") is None:
            return Availability(False, "jax is not installed (pip install 'jax>=0.10')")
        problem = native.load_problem()
        if problem:
            return Availability(False, problem)
        base = super().availability()
        if not base:
            return base
        try:
            registered = native.register()
            platform = native.jax_platform()
        except Exception as exc:  # noqa: BLE001 - report, never raise
            return Availability(False, f"registering the XLA FFI targets of moe_ep_jax_ffi._ffi failed: "
                                       f"{type(exc).__name__}: {exc}")
        if platform == "cuda" and "CUDA" not in registered:
            return Availability(
                False,
                "jax runs on CUDA GPUs but moe_ep_jax_ffi._ffi was built without the CUDA handlers; rebuild it with "
                "MOE_EP_NATIVE_CUDA=ON (and MOE_EP_CUDA_ARCHS for the GPUs, default 90): MOE_EP_NATIVE_CUDA=ON pip "
                "install --no-build-isolation -e backends/jax_ffi",
            )
        if platform not in ("cpu", "cuda"):
            return Availability(False, f"jax runs on {platform} devices; moe_ep_jax_ffi has XLA FFI handlers for "
                                       f"cpu and CUDA only")
        return Availability(True)

    def quick_availability(self) -> Availability:
        """From what is installed, without importing jax (``moe-ep backends``):
        the jax backend's check and the native extension built and loadable."""
        if importlib.util.find_spec("jax") is None:
            return Availability(False, "jax is not installed (pip install 'jax>=0.10')")
        problem = native.load_problem()
        if problem:
            return Availability(False, problem)
        return super().quick_availability()

    def framework_versions(self) -> dict:
        out = dict(super().framework_versions())
        ext = native.extension()
        out["native"] = ext.build_info()
        out["ffi_platforms"] = ",".join(native.platforms())
        out["kernels"] = repr(self._provider())
        return out

    # ------------------------------------------------------------------ running

    def _provider(self) -> Any:
        if self.kernels is None:
            from .kernels import FfiKernels

            self.kernels = FfiKernels()
        return self.kernels

    def _kw(self) -> Dict[str, Any]:
        kw = super()._kw()
        kw["kernels"] = self._provider()
        return kw
