"""moe-ep-spec: the MoeEp operator's contract.

The configuration (:class:`MoeEpConfig`), the formats (:class:`MoeFormat`,
:class:`BlockScaledTensor`, :func:`quantize`, :func:`dequantize`), the inputs and
results of every operation (:mod:`moe_ep_spec.api`), input validation
(:mod:`moe_ep_spec.validation`), the error hierarchy (:class:`MoeEpError`), the
backend interface (:class:`MoeEpBackend`, :class:`Capabilities`) and the
registry (:func:`get_backend`, :func:`list_backends`).

This package imports numpy, ml_dtypes and pluggy only; it never imports a
framework or a backend.
"""

from __future__ import annotations

from .api import (ROUTE_METADATA_COLUMNS, BackwardResult, DispatchGrads, DispatchHandle, DispatchInputs, DispatchResult,
                  ForwardResult, RankContext, RankInputs, Stash, Tensor)
from .backend import Availability, Capabilities, Launch, MoeEpBackend
from .config import MoeEpConfig
from .errors import (BackendError, BackendNotFoundError, BackendUnavailableError, CapabilityError, CapacityError,
                     ConfigError, DeviceError, DTypeError, FormatError, MoeEpError, MoeEpWarning, NativeArgumentError,
                     TransportError, NativeError, RoutingIndexError, ShapeError, StashError)
from .formats import BlockScaledTensor, MoeFormat, dequantize, parse_format, quantize, round_to_bf16, round_trip
from .hookspecs import ENTRY_POINT_GROUP, hookimpl, hookspec
from . import api, errors, inputs, tolerance, validation
from .registry import (InstalledPlugin, PluginFailure, Registry, get_backend, get_registry, list_backends,
                       plugin_failures, register_backend)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    # submodules
    "inputs", "tolerance", "validation",
    # config and formats
    "MoeEpConfig", "MoeFormat", "BlockScaledTensor", "parse_format", "quantize", "dequantize", "round_to_bf16",
    "round_trip",
    # operation inputs and results
    *api.__all__,
    # backends and registry
    "MoeEpBackend", "Capabilities", "Availability", "Launch", "ENTRY_POINT_GROUP", "hookimpl", "hookspec", "Registry",
    "PluginFailure", "InstalledPlugin", "get_registry", "get_backend", "list_backends", "plugin_failures",
    "register_backend",
    # errors
    *errors.__all__,
]
