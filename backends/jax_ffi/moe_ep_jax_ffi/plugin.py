"""Entry point of the ``jax-ffi`` backend (group ``moe_ep_spec.backends``).

Imports nothing heavy: neither jax nor the native extension. The backend
registers even when the extension is not built; it then reports itself
unavailable, with the reason and how to build it.
"""

from __future__ import annotations

from typing import Callable

import moe_ep_spec


@moe_ep_spec.hookimpl
def register_backends(register: Callable[..., None]) -> None:
    from .backend import JaxFfiBackend

    register(JaxFfiBackend())
