"""The shared MoeEp reference implementation (numpy, float64), backend ``reference``."""

from __future__ import annotations

from .backend import ReferenceBackend, __version__

__all__ = ["ReferenceBackend", "__version__"]
