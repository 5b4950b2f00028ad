"""Bench drivers: how each backend is timed.

``world``: backends of the world launch model known to the harness (the numpy
``reference``): the world-level calls, timed with ``time.perf_counter`` in this
process (:mod:`.world`). ``torch``: the backends with PyTorch tensors in and
out, ``torch`` and ``cuda-nccl``, timed inside their ranks' processes on the
device with their own torch functions (:mod:`.torch_driver`, which also hosts
the baselines). ``jax``: ``jax`` and ``jax-ffi``, the jitted layer inside
``jax.shard_map`` over a mesh of EP devices, in this process (:mod:`.jax_driver`).

Other distributions may add a driver for their backend through the entry-point
group ``moe_ep_bench.drivers``: the entry point's name is the backend's name,
its object a callable ``drive(backend, settings, routings, progress) -> list of
moe_ep_bench.results.Row``. ``--backend NAME`` of a backend with no driver is
refused before the run (exit 2); the default run leaves such a backend out and
prints a line naming it.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Callable, Dict, Optional

__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "driver_for"]

ENTRY_POINT_GROUP = "moe_ep_bench.drivers"

#: Backends the harness knows, and their driver.
BUILTIN: Dict[str, str] = {"reference": "world", "torch": "torch", "cuda-nccl": "torch", "jax": "jax", "jax-ffi": "jax"}


def driver_for(name: str) -> Optional[Any]:
    """``"world"``, ``"torch"``, ``"jax"``, a third-party ``drive`` callable, or None."""
    if name in BUILTIN:
        return BUILTIN[name]
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            fn: Callable[..., Any] = ep.load()
            return fn
    return None
