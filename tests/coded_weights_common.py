"""What the tests of the block-scaled-weights forward share
(``test_native_mxfp8_weights.py``, ``test_native_nvfp4_weights.py``): pointers of numpy
arrays, output buffers filled with a marker, the bf16 layer's forward on decoded weight
values (the reference the codes forward must equal on CPU), and the CUDA skip mark."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np
import pytest

from moe_ep_native._capi import has_cuda
from moe_ep_spec import MoeEpConfig
from moe_ep_spec.formats import BF16

__all__ = ["ptr", "outputs", "forward_decoded", "cuda_available", "needs_cuda"]


def ptr(a: Optional[np.ndarray]) -> Optional[int]:
    """The address of a numpy array's data, None for None or an empty array."""
    return a.ctypes.data if a is not None and a.size else None


def outputs(rows: int, config: MoeEpConfig) -> Tuple[np.ndarray, np.ndarray]:
    """``(y [rows, H] float32 NaN, fc1_c [rows, 2I] uint16 0xFFFF)``: output buffers holding a
    marker, so that a rejected call can be seen to write nothing."""
    y = np.full((rows, config.hidden), np.nan, np.float32)
    c = np.full((rows, 2 * config.intermediate), 0xFFFF, np.uint16)
    return y, c


def forward_decoded(layer: Any, x: np.ndarray, w: np.ndarray, f1: np.ndarray, f2: np.ndarray, gs: np.ndarray,
                    config: MoeEpConfig) -> Tuple[np.ndarray, np.ndarray]:
    """The bf16 layer's forward (``moe_ep_layer_experts_forward``) on decoded weight values
    ``f1 [E, H, 2I]``, ``f2 [E, I, H]`` float32 (bf16 values or NaN: exactly bf16 bits)."""
    y, c = outputs(x.shape[0], config)
    b1, b2 = (np.ascontiguousarray(a.astype(BF16)).view(np.uint16) for a in (f1, f2))  # alive through the call
    layer.experts_forward(None, x.shape[0], ptr(x.view(np.uint16)), ptr(w), ptr(b1), ptr(b2), ptr(gs), ptr(y), ptr(c))
    return y, c


def cuda_available() -> bool:
    """A CUDA device and a native build with CUDA."""
    try:
        import torch
    except ImportError:
        return False
    return has_cuda() and torch.cuda.is_available()


needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device and a native build with CUDA")
