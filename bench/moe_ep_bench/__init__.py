"""moe-ep-bench: ``moe-ep bench``, benchmarks of MoeEp backends against the
baselines ``all_to_all``, ``copy``, ``grouped_gemm`` and ``weight_read`` (see
docs/benchmarks.md).

Imports no framework: the torch driver imports torch in the rank processes it
spawns, the jax driver imports jax when it runs, matplotlib is imported only to
write plots.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
