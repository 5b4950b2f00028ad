"""The native extension :mod:`moe_ep_jax_ffi._ffi` and its XLA FFI targets.

The extension compiles the MoeEp native core (``backends/native``, C ABI
``moe_ep_native.h``) together with one XLA FFI handler per entry point, for the
CPU always and for CUDA when built with ``MOE_EP_NATIVE_CUDA=ON``. Its targets
(:data:`TARGETS`) are registered under the same names for the platforms ``cpu``
and ``CUDA`` (XLA picks by the platform it compiles for).

The handlers, for callers of ``jax.ffi.ffi_call``: buffers are dense row-major;
``[outer, n, inner]`` is the C ABI's view of a tensor blocked along ``n``.
Attributes are keyword arguments of the ``ffi_call`` (``np.int32`` for int32,
Python ``int`` for int64, ``np.float32`` for float, ``bool``). Formats are int32
codes (:data:`FORMAT_CODES`): 0 none, 1 bf16, 2 mxfp8, 3 nvfp4. Each entry gives
the C ABI call, the operands, the results and the attributes.

``moe_ep_quantize``
    ``moe_ep_quantize``. Operands: ``x [outer, n, inner] f32``. Results: ``data``:
    bf16 ``[outer, n, inner] u16``, mxfp8 ``[outer, n, inner] u8`` (E4M3), nvfp4
    ``[outer, ceil(n/2), inner] u8`` (two E2M1 codes a byte, low nibble first);
    ``scale [outer, ceil(n/B), inner] u8`` (E8M0 / E4M3; ``[outer, 0, inner]``
    for bf16). Attributes: ``format``.
``moe_ep_dequantize``
    ``moe_ep_dequantize``. Operands: ``data``, ``scale`` (as above). Results:
    ``out [outer, n, inner] f32``. Attributes: ``format``, ``n`` int64.
``moe_ep_dequantize_bf16``
    ``moe_ep_dequantize_bf16``. Operands: ``data``, ``scale`` (mxfp8 or nvfp4), ``flag_in [1] s32`` (zero;
    aliased to ``flag``: ``input_output_aliases={2: 1}``). Results: ``out
    [outer, n, inner] u16`` (exact bf16 bits; NaN where bf16 cannot hold one),
    ``flag [1] s32``. Attributes: ``format`` (2 or 3), ``n`` int64.
``moe_ep_dequantize_bf16_gather``
    ``moe_ep_dequantize_bf16_gather``. Operands: ``data [T, codes] u8``, ``scale [T, scales] u8``, ``route [C] s32``
    (-1: none), ``flag_in [1] s32`` (``input_output_aliases={3: 1}``). Results:
    ``out [C, n] u16`` (row i: token ``route[i] / num_topk``'s exact bf16 bits;
    zero for -1), ``flag [1] s32``. Attributes: ``format`` (2 or 3), ``n`` int64,
    ``num_topk`` int64.
``moe_ep_plan_routes``
    ``moe_ep_plan_routes``. Operands: ``topk_idx [T, K] s32``. Results:
    ``send_route [T*K] s32``, ``route_pos [T*K] s32``, ``route_expert [T*K] s32``,
    ``counts [E+1] s32`` (``counts[E]``: ids outside ``[-1, E)``). Attributes:
    ``num_experts`` int64.
``moe_ep_permute_rows``
    ``moe_ep_permute_rows``. Operands: ``tokens [T, ...]`` any whole-byte dtype,
    ``send_route [R] s32``. Results: ``dst [R, ...]`` (``dst[i] =
    tokens[send_route[i] / K]``, zero row for -1). Attributes: ``num_topk`` int64.
``moe_ep_combine_reduce``
    ``moe_ep_combine_reduce`` (with ``route_pos``). Operands: ``rows [R, H] f32
    or bf16``, ``route_pos [T*K] s32``. Results: ``out [T, H] f32`` (slot order
    from +0; -1 adds nothing). Attributes: ``num_topk`` int64, ``round_trip``
    int32 (0, or 2 / 3: each f32 row through that format's round trip first).
``moe_ep_combine_reduce_encode``
    ``moe_ep_combine_reduce_encode``. Operands: ``rows [R, H] f32 or bf16``, ``route_pos [T*K] s32``, ``error []
    bool``. Results: ``data``, ``scale``: the ``[T, H]`` sums encoded in
    ``out_format``, all NaN when ``error`` (bf16 ``[T, H] u16`` or ``bf16`` and ``[T, 0]``;
    mxfp8 ``[T, H] u8`` and ``[T, ceil(H/32)] u8``; nvfp4 ``[T, ceil(H/2)] u8``
    and ``[T, ceil(H/16)] u8``). Attributes: ``num_topk`` int64, ``round_trip``
    int32, ``out_format`` int32.
``moe_ep_slot_sum``
    ``moe_ep_combine_reduce`` (``route_pos`` NULL). Operands: ``rows [T*K, H]
    f32`` (row ``t*K+k``: token t's slot k). Results: ``out [T, H] f32``.
    Attributes: ``num_topk`` int64.
``moe_ep_poison``
    No C ABI call: the handler's own fill (a CUDA kernel on XLA's stream). Operands: ``x [...] f32, bf16
    or f16``, ``error [] bool``. Results: ``out``, aliasing ``x`` (``input_output_aliases={0: 0}``):
    every element the quiet NaN of its dtype (``jnp.asarray(jnp.nan, dtype)``'s bits) when ``error``,
    else ``x`` untouched (the flag is read on the device: nothing else is read or written).
    Attributes: none.
``moe_ep_zero_rows``
    No C ABI call: the handler's own fill (a CUDA kernel on XLA's stream). Operands: ``x [R, ...]`` any
    whole-byte dtype, ``rows [N] s32`` (-1: none). Results: ``out``, aliasing ``x``
    (``input_output_aliases={0: 0}``): ``x`` with each listed row's bytes zero, the others untouched
    (CPU rejects a row outside ``[-1, R)``; CUDA zeroes nothing for it). Attributes: none.
``moe_ep_expert_forward``
    ``moe_ep_layer_experts_forward`` (a cached layer object). Operands: ``x [C,
    H]``, ``w [C] f32``, ``fc1 [E_local, H, 2I]``, ``fc2 [E_local, I, H]`` (``x``,
    ``fc1``, ``fc2``: the layer's operand dtype, f32 or bf16), ``group_sizes
    [E_local] s32``. Results: ``y [C, H]`` after ``combine_format``'s round trip
    (f32, or bf16 when ``combine_format`` is 1), ``fc1_c [C, 2I] bf16`` (the
    stash; ``[0, 2I]``: none written). Attributes: ``apply_topk_in_fc1`` bool,
    ``has_clamp`` bool, ``gate_up_clamp`` float, ``intermediate_format`` int32,
    ``combine_format`` int32, ``backward_operand_format`` int32 (0 exact, 1 bf16:
    the backward's operands; the forward passes it too, so both share one layer).
``moe_ep_expert_backward``
    ``moe_ep_layer_experts_backward`` (a cached layer object). Operands: ``x``,
    ``w``, ``fc1``, ``fc2`` (as forward), ``fc1_c [C, 2I] bf16``, ``dy [C, H] f32
    or bf16``, ``group_sizes``. Results: ``dx [C, H] f32``, ``dw [C] f32``, ``dfc1
    [E_local, H, 2I]``, ``dfc2 [E_local, I, H]``: both f32, or both bf16 with bf16
    operands (``MOE_EP_BACKWARD_WEIGHT_GRADS_BF16``: the f32 gradients rounded to
    nearest even by the layer). Attributes: as forward (``combine_format`` only
    picks the layer object).

Besides the targets the extension exposes ``registrations(platform)``,
``platforms()``, ``abi_version()`` / ``HEADER_ABI_VERSION``, ``has_cuda()``,
``build_info()`` and ``layer_cache_info()``.

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
    "moe_ep_poison",
    "moe_ep_zero_rows",
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
