"""moe-ep-bench: ``moe-ep bench``, benchmarks of MoeEp backends against NCCL,
the peer-copy ceiling and the grouped-GEMM roofline (see docs/benchmarks.md).

Imports no framework: the torch driver imports torch in the rank processes it
spawns, matplotlib is imported only to write plots.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
