"""The plugin hook a backend package implements.

A backend distribution declares an entry point in the group
``moe_ep_spec.backends`` that names a module (or object) holding a
``register_backends`` implementation::

    # pyproject.toml
    [project.entry-points."moe_ep_spec.backends"]
    mybackend = "my_package.plugin"

    # my_package/plugin.py
    import moe_ep_spec

    @moe_ep_spec.hookimpl
    def register_backends(register):
        register(MyBackend())

Keep the plugin module light: import the framework (torch, jax ...) inside the
backend's methods or ``availability()``, not at module import time.
"""

from __future__ import annotations

from typing import Callable

import pluggy

__all__ = ["PROJECT_NAME", "ENTRY_POINT_GROUP", "hookspec", "hookimpl", "register_backends"]

PROJECT_NAME = "moe_ep_spec"
#: The entry-point group every backend, first-party or third-party, registers through.
ENTRY_POINT_GROUP = "moe_ep_spec.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def register_backends(register: Callable[..., None]) -> None:
    """Register backends by calling ``register(backend)`` once per backend.

    ``backend`` is a :class:`moe_ep_spec.MoeEpBackend` instance whose ``name`` is
    unique among the loaded plugins.
    """
