"""Entry point of the ``example-loopback`` backend (group ``moe_ep_spec.backends``).

This module is imported whenever anyone lists backends, so it stays light: it
imports ``moe_ep_spec`` (already loaded by then) and, inside the hook, the
backend class, whose module needs nothing beyond the standard library.
"""

from __future__ import annotations

from typing import Callable

import moe_ep_spec


@moe_ep_spec.hookimpl
def register_backends(register: Callable[..., None]) -> None:
    """Register the one backend of this distribution, ``example-loopback``."""
    from .backend import ExampleLoopbackBackend

    register(ExampleLoopbackBackend())
