"""Entry point of the ``reference`` backend (group ``moe_ep_spec.backends``).

The reference registers through the same hook a third-party plugin uses.
"""

from __future__ import annotations

from typing import Callable

import moe_ep_spec


@moe_ep_spec.hookimpl
def register_backends(register: Callable[..., None]) -> None:
    from .backend import ReferenceBackend

    register(ReferenceBackend())
