"""Bench drivers: how each backend is timed.

``world``: backends of the world launch model known to the harness (the numpy
``reference``): the world-level calls, timed with ``time.perf_counter`` in this
process (:mod:`.world`). ``torch``: the torch backend, timed inside its ranks'
processes on the device with its own torch functions (:mod:`.torch_driver`,
which also hosts the baselines).

Other distributions may add a driver for their backend through the entry-point
group ``moe_ep_bench.drivers``: the entry point's name is the backend's name,
its object a callable ``drive(backend, settings, routings, progress) -> list of
moe_ep_bench.results.Row``. A backend with no driver is reported as
``no bench driver``.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Callable, Dict, Optional

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "driver_for"]

ENTRY_POINT_GROUP = "moe_ep_bench.drivers"

#: Backends the harness knows, and their driver.
BUILTIN: Dict[str, str] = {"reference": "world", "torch": "torch"}


def driver_for(name: str) -> Optional[Any]:
    """``"world"``, ``"torch"``, a third-party ``drive`` callable, or None."""
    if name in BUILTIN:
        return BUILTIN[name]
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            fn: Callable[..., Any] = ep.load()
            return fn
    return None
