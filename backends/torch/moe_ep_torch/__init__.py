"""MoeEp for PyTorch: backend ``torch`` (``moe_ep_spec.get_backend("torch")``).

The world-level spec interface lives in :mod:`moe_ep_torch.backend`; torch
users call :mod:`moe_ep_torch.api` (differentiable ``moe_ep``, ``dispatch`` and
``combine`` over a ``torch.distributed`` process group) or use the layer as a
module, :class:`moe_ep_torch.module.MoeEpLayer` (the experts' weights as
parameters, the process group, the backend ``torch`` or ``cuda-nccl``).
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
