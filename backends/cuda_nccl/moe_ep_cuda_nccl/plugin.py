"""Entry point of the ``cuda-nccl`` backend (group ``moe_ep_spec.backends``).

Imports nothing heavy: torch and the native library load when the backend is used.
"""

from __future__ import annotations

from typing import Callable

import moe_ep_spec


@moe_ep_spec.hookimpl
def register_backends(register: Callable[..., None]) -> None:
    from .backend import CudaNcclBackend

    register(CudaNcclBackend())
