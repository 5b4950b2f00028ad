"""Float32 inputs that exercise every corner of the block formats, shared by
the tests of the jax formats and of the jax-ffi handlers."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np

GOLDEN = Path(__file__).parent / "data" / "golden_formats.npz"


def load_golden() -> Dict[str, np.ndarray]:
    """The golden vectors of tests/data/golden_formats.npz, by key."""
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


def format_inputs() -> Tuple[Dict[str, np.ndarray], List[np.ndarray]]:
    """``(golden, [rows, odd, special])``: the golden vectors (by key), their
    input rows stacked ``[R, 64] float32``; ``[16, 45]`` values over 12
    decades (partial last blocks); ``[9, 67]`` rows holding NaN, +-Inf, signed
    zeros, subnormals (XLA:CPU threads flush these unless the code keeps them),
    values near float32's top, the smallest subnormal, and subnormal blocks
    that still encode to nonzero codes (scale 2^-127)."""
    golden = load_golden()
    rng = np.random.default_rng(0)
    rows = np.concatenate([golden[k] for k in golden if k.endswith("/input")])
    odd = (rng.standard_normal((16, 45)) * 10.0 ** rng.integers(-6, 6, (16, 1))).astype(np.float32)
    special = rng.standard_normal((9, 67)).astype(np.float32)
    special[1, 3], special[2, 40], special[3] = np.nan, -np.inf, 0.0
    special[3, 5] = -0.0
    special[4] *= np.float32(2.0**-140)
    special[5] *= np.float32(2.0**126)
    special[6, 60] = np.inf
    special[7, :20] = np.float32(2.0**-149)  # the smallest subnormal
    special[8] *= np.float32(2.0**-128)
    return golden, [rows, odd, special]


_GOLDEN_PARTS = {"bf16": ("bf16_bits",), "mxfp8": ("mxfp8_data_bits", "mxfp8_scale_bits"),
                 "nvfp4": ("nvfp4_data_packed", "nvfp4_scale_bits")}


def golden_codes(golden: Dict[str, np.ndarray], fmt: str) -> List[np.ndarray]:
    """The golden codes of ``fmt`` for the stacked rows of :func:`format_inputs`:
    ``[bf16 bits]`` or ``[data codes, scale codes]``, as uint arrays."""
    return [np.concatenate([golden[k.replace("input", part)] for k in golden if k.endswith("/input")])
            for part in _GOLDEN_PARTS[fmt]]
