"""moe-ep-example-plugin: an example third-party MoeEp backend.

It registers one backend, ``example-loopback``, through the entry-point group
``moe_ep_spec.backends``: the shared numpy reference run one process per rank
(:attr:`moe_ep_spec.Launch.PROCESS_PER_RANK`). The ranks meet on loopback, rank 0
gathers every rank's arguments, runs the reference over the whole world and
sends each rank its result (see :mod:`moe_ep_example.exchange`).

It adds no numerics of its own; it shows how a process-per-rank backend is
packaged, registered, launched and checked with ``moe-ep conformance``.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "ExampleLoopbackBackend"]


def __getattr__(name: str):  # PEP 562: keep ``import moe_ep_example`` free of moe_ep_spec
    if name == "ExampleLoopbackBackend":
        from .backend import ExampleLoopbackBackend

        return ExampleLoopbackBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
