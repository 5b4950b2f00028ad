"""Entry point of the ``jax`` backend (group ``moe_ep_spec.backends``).

Imports nothing heavy: jax is imported when the backend is first asked whether
it is available or used (after it has set ``XLA_FLAGS``, see
:mod:`moe_ep_jax.devices`).
"""

from __future__ import annotations

from typing import Callable

import moe_ep_spec


@moe_ep_spec.hookimpl
def register_backends(register: Callable[..., None]) -> None:
    from .backend import JaxBackend

    register(JaxBackend())
