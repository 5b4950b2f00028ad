"""ctypes prototypes of the C ABI (``include/moe_ep_native.h``) and its error mapping."""

from __future__ import annotations

import ctypes
import enum
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from moe_ep_spec.errors import NativeArgumentError, NativeError, TransportError

__all__ = ["ABI_VERSION", "Format", "Status", "DType", "ExpertDesc", "LayerConfig", "LayerInfo", "library_path", "include_dir", "load", "call",
           "abi_version", "has_cuda", "has_nccl", "build_info"]

#: The ABI this binding was written for (MOE_EP_NATIVE_ABI_VERSION).
ABI_VERSION = 11

#: Set to a file path to load that library instead of the installed one.
LIBRARY_ENV = "MOE_EP_NATIVE_LIBRARY"

_LIB_NAMES = {"linux": "libmoe_ep_native.so", "darwin": "libmoe_ep_native.dylib", "win32": "moe_ep_native.dll"}


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    UNSUPPORTED = 2
    CUDA = 3
    INTERNAL = 4
    COMM = 5


class Format(enum.IntEnum):
    NONE = 0
    BF16 = 1
    MXFP8 = 2
    NVFP4 = 3


class ExpertDesc(ctypes.Structure):
    """``moe_ep_expert_desc``."""

    _fields_ = [
        ("num_rows", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_local_experts", ctypes.c_int64),
        ("apply_topk_in_fc1", ctypes.c_int32),
        ("has_clamp", ctypes.c_int32),
        ("gate_up_clamp", ctypes.c_float),
        ("intermediate_format", ctypes.c_int32),
    ]


class DType(enum.IntEnum):
    """``moe_ep_dtype``: the element type of a layer's operands."""

    F32 = 0
    BF16 = 1


class LayerConfig(ctypes.Structure):
    """``moe_ep_layer_config`` (versioned by ``struct_size``, which :meth:`make` sets)."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("cuda_device", ctypes.c_int32),
        ("operand_dtype", ctypes.c_int32),
        ("max_rows", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("num_local_experts", ctypes.c_int64),
        ("apply_topk_in_fc1", ctypes.c_int32),
        ("has_clamp", ctypes.c_int32),
        ("gate_up_clamp", ctypes.c_float),
        ("intermediate_format", ctypes.c_int32),
        ("combine_format", ctypes.c_int32),
        ("with_backward", ctypes.c_int32),
        # The device exchange (moe_ep_native.exchange); ex_num_ranks = 0: none.
        ("ex_num_ranks", ctypes.c_int32),
        ("ex_rank", ctypes.c_int32),
        ("ex_num_topk", ctypes.c_int32),
        ("ex_num_experts", ctypes.c_int64),
        ("ex_max_tokens", ctypes.c_int64),
        ("ex_token_bytes", ctypes.c_int64),
        ("ex_expert_alignment", ctypes.c_int64),
        ("ex_timeout_ms", ctypes.c_int64),
        ("ex_num_sms", ctypes.c_int32),
        ("ex_combine_order", ctypes.c_int32),
        # ABI 3: the dtype of the expert-output rows (DType; BF16 needs combine_format bf16).
        ("expert_out_dtype", ctypes.c_int32),
        ("ex_mode", ctypes.c_int32),
        # ABI 8: the backward's operand format (Format.NONE: exact; Format.BF16).
        ("backward_operand_format", ctypes.c_int32),
        ("reserved1", ctypes.c_int32),
    ]

    @classmethod
    def make(cls, **fields: Any) -> "LayerConfig":
        cfg = cls(**fields)
        cfg.struct_size = ctypes.sizeof(cls)
        return cfg


class LayerInfo(ctypes.Structure):
    """``moe_ep_layer_info``."""

    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("tensor_cores", ctypes.c_int32),
        ("fc2_operand_planes", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("workspace_bytes", ctypes.c_uint64),
    ]


def _lib_name() -> str:
    return _LIB_NAMES.get(sys.platform, _LIB_NAMES["linux"])


def library_path() -> Path:
    """The path of the installed ``libmoe_ep_native`` (or of ``$MOE_EP_NATIVE_LIBRARY``).

    Raises:
        FileNotFoundError: when the library was not built, naming where it looked.
    """
    override = os.environ.get(LIBRARY_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{LIBRARY_ENV}={override!r} does not name a file")
        return path
    here = Path(__file__).resolve().parent
    candidates = [here / "lib" / _lib_name()]
    # An editable install keeps the Python sources here and the built library in site-packages.
    candidates += [Path(p) / "moe_ep_native" / "lib" / _lib_name() for p in sys.path if p]
    for path in candidates:
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the native library {_lib_name()} is not built: install the package with "
        f"'pip install backends/native' (needs cmake >= 3.21 and a C++17 compiler); looked in "
        + ", ".join(str(c.parent) for c in candidates[:3])
    )


def include_dir() -> Path:
    """The directory holding ``moe_ep_native.h``."""
    here = Path(__file__).resolve().parent
    for path in (here / "include", here.parent / "include"):
        if (path / "moe_ep_native.h").is_file():
            return path
    raise FileNotFoundError(f"moe_ep_native.h not found next to {here}")


_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_I32 = ctypes.c_int
_DESC = ctypes.POINTER(ExpertDesc)

_PROTOTYPES = {
    "moe_ep_abi_version": (ctypes.c_int, []),
    "moe_ep_has_cuda": (ctypes.c_int, []),
    "moe_ep_build_info": (ctypes.c_char_p, []),
    "moe_ep_last_error": (ctypes.c_char_p, []),
    "moe_ep_status_name": (ctypes.c_char_p, [_I32]),
    "moe_ep_quantize": (_I32, [_I32, _P, _I32, _P, _I64, _I64, _I64, _P, _P]),
    "moe_ep_dequantize": (_I32, [_I32, _P, _I32, _P, _P, _I64, _I64, _I64, _P]),
    "moe_ep_dequantize_bf16": (_I32, [_I32, _P, _I32, _P, _P, _I64, _I64, _I64, _I64, _P, _P]),
    "moe_ep_dequantize_bf16_rows": (_I32, [_I32, _P, _I32, _P, _I64, _P, _I64, _I64, _I64, _P, _P]),
    "moe_ep_dequantize_bf16_gather": (_I32, [_I32, _P, _I32, _P, _I64, _P, _I64, _I64, _P, _I64, _I64, _I64, _P, _P]),
    "moe_ep_plan_routes": (_I32, [_I32, _P, _P, _I64, _I64, _I64, _P, _P, _P, _P]),
    "moe_ep_record_step": (_I32, [_I32, _P, _P, _P, _I64, _I64, _P]),
    "moe_ep_permute_rows": (_I32, [_I32, _P, _P, _I64, _I64, _I64, _P, _I64, _P]),
    "moe_ep_combine_reduce": (_I32, [_I32, _P, _P, _I64, _P, _I64, _I64, _I64, _P]),
    "moe_ep_combine_reduce_bf16": (_I32, [_I32, _P, _P, _I64, _P, _I64, _I64, _I64, _P]),
    "moe_ep_combine_reduce_round_trip": (_I32, [_I32, _P, _I32, _P, _I64, _P, _I64, _I64, _I64, _P]),
    "moe_ep_combine_reduce_encode": (_I32, [_I32, _P, _I32, _I32, _P, _I64, _P, _I64, _I64, _I64, _P, _I32, _P, _P]),
    "moe_ep_expert_forward_workspace": (ctypes.c_size_t, [_DESC]),
    "moe_ep_expert_backward_workspace": (ctypes.c_size_t, [_DESC]),
    "moe_ep_expert_forward": (_I32, [_I32, _P, _DESC, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_size_t]),
    "moe_ep_expert_backward": (_I32, [_I32, _P, _DESC, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_size_t]),
    "moe_ep_layer_create": (_I32, [ctypes.POINTER(LayerConfig), ctypes.POINTER(_P)]),
    "moe_ep_layer_destroy": (_I32, [_P]),
    "moe_ep_layer_get_info": (_I32, [_P, ctypes.POINTER(LayerInfo)]),
    "moe_ep_layer_experts_forward": (_I32, [_P, _P, _I64, _P, _P, _P, _P, _P, _P, _P]),
    "moe_ep_layer_experts_forward_mxfp8": (_I32, [_P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "moe_ep_layer_experts_forward_block_scaled": (_I32, [_P, _P, _I32, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P]),
    "moe_ep_layer_experts_backward": (_I32, [_P, _P, _I64, _P, _P, _P, _P, _P, _P, _I32, _P, _P, _P, _P, _P]),
    "moe_ep_layer_experts_backward_ex": (_I32, [_P, _P, _I64, _P, _P, _P, _P, _P, _P, _I32, _P, _P, _P, _P, _P, _I32]),
    "moe_ep_has_nccl": (ctypes.c_int, []),
    "moe_ep_comm_unique_id": (_I32, [_P, ctypes.c_size_t]),
    "moe_ep_comm_init": (_I32, [_P, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, _I64, ctypes.POINTER(_P)]),
    "moe_ep_comm_destroy": (_I32, [_P]),
    "moe_ep_comm_info": (_I32, [_P, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32)]),
    "moe_ep_comm_all_gather": (_I32, [_P, _P, _P, _P, _I64]),
    "moe_ep_comm_exchange": (_I32, [_P, _P, _P, ctypes.POINTER(_I64), _P, ctypes.POINTER(_I64), _I64]),
}

_LIB: Optional[ctypes.CDLL] = None


def set_prototypes(lib: ctypes.CDLL, prototypes: Dict[str, Tuple[Any, List[Any]]], library: str, part: str) -> None:
    """Give ``lib``'s functions their ``(restype, argtypes)``; a function the
    library does not export raises NativeError naming ``library`` and the
    binding's ``part`` (ctypes caches the function objects: calls find these)."""
    for name, (res, args) in prototypes.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise NativeError(
                f"{library} must export {name} (this binding's {part}); it does not: the library is older than "
                f"the package, rebuild it (pip install --no-build-isolation -e backends/native)",
                op=name,
            ) from None
        fn.restype, fn.argtypes = res, args


def load() -> ctypes.CDLL:
    """Load the library once (prototypes set) and check its ABI version."""
    global _LIB
    if _LIB is None:
        path = library_path()
        lib = ctypes.CDLL(str(path))
        set_prototypes(lib, _PROTOTYPES, str(path), "C ABI")
        got = lib.moe_ep_abi_version()
        if got != ABI_VERSION:
            raise NativeError(
                f"libmoe_ep_native ABI version must be {ABI_VERSION} (this binding); got {got}: rebuild the package",
                op="moe_ep_abi_version",
            )
        _LIB = lib
    return _LIB


def call(name: str, *args: Any) -> None:
    """Call a status-returning entry point; raise :class:`NativeArgumentError`
    (invalid argument) or :class:`NativeError` (anything else) on failure."""
    lib = load()
    status = getattr(lib, name)(*args)
    if status == Status.OK:
        return
    message = lib.moe_ep_last_error().decode("utf-8", "replace")
    status_name = lib.moe_ep_status_name(status).decode()
    cls = {Status.INVALID_ARGUMENT: NativeArgumentError, Status.COMM: TransportError}.get(status, NativeError)
    raise cls(message, op=name, status=int(status), status_name=status_name)


def abi_version() -> int:
    return int(load().moe_ep_abi_version())


def has_cuda() -> bool:
    """Whether the loaded library was built with the CUDA implementation."""
    return bool(load().moe_ep_has_cuda())


def has_nccl() -> bool:
    """Whether the loaded library was built with the NCCL transport."""
    return bool(load().moe_ep_has_nccl())


def build_info() -> str:
    return load().moe_ep_build_info().decode()
