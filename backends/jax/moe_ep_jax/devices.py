"""Enough JAX devices for an EP world in one process, without importing jax early.

On a CPU-only machine XLA exposes one CPU device unless the flag
``--xla_force_host_platform_device_count=N`` is in ``XLA_FLAGS`` when the CPU
backend starts. The backend therefore sets it (``N`` =
``MOE_EP_JAX_CPU_DEVICES``, default 8) in ``os.environ`` before jax is first
imported in the process, keeping any other flags the user set. When jax was
imported earlier (with the flag or not), nothing can be changed any more: the
device count is whatever XLA started with, and :func:`device_report` says so.

Nothing here imports jax unless asked to.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Optional, Tuple

__all__ = ["DEFAULT_CPU_DEVICES", "cpu_device_target", "prepare_environment", "jax_imported", "device_report"]

#: CPU devices the backend asks XLA for when it may (``MOE_EP_JAX_CPU_DEVICES`` overrides).
DEFAULT_CPU_DEVICES = 8

_FLAG = "--xla_force_host_platform_device_count"
_FLAG_RE = re.compile(r"--xla_force_host_platform_device_count[= ](\d+)")


def cpu_device_target() -> int:
    """The CPU device count the backend asks for: ``MOE_EP_JAX_CPU_DEVICES`` or 8."""
    raw = os.environ.get("MOE_EP_JAX_CPU_DEVICES", "").strip()
    try:
        value = int(raw) if raw else DEFAULT_CPU_DEVICES
    except ValueError:
        value = DEFAULT_CPU_DEVICES
    return max(1, value)


def jax_imported() -> bool:
    """Whether jax has been imported in this process (XLA_FLAGS is read at its start)."""
    return "jax" in sys.modules


def flagged_count(flags: Optional[str] = None) -> Optional[int]:
    """The device count ``XLA_FLAGS`` asks for, or None."""
    m = _FLAG_RE.search(os.environ.get("XLA_FLAGS", "") if flags is None else flags)
    return int(m.group(1)) if m else None


def prepare_environment() -> None:
    """Before jax's first import: make ``XLA_FLAGS`` ask for
    :func:`cpu_device_target` CPU devices (a count already there, larger or
    not, is left alone: the user chose it). When jax is imported but has not
    started its backends yet, set ``jax_num_cpu_devices`` instead (unless the
    user set it or the flag). Otherwise nothing can change: a no-op."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not jax_imported():
        if flagged_count(flags) is None:
            os.environ["XLA_FLAGS"] = (flags + " " if flags else "") + f"{_FLAG}={cpu_device_target()}"
        return
    if flagged_count(flags) is not None:
        return
    try:
        import jax
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized() and xla_bridge.num_cpu_devices.value < 0:
            jax.config.update("jax_num_cpu_devices", cpu_device_target())
    except Exception:  # noqa: BLE001 - private API moved, or too late: leave it
        pass


def device_report() -> Tuple[str, int, str]:
    """``(platform, device count, problem)`` of the default JAX backend, importing
    jax (after :func:`prepare_environment`). ``problem`` is empty when a
    multi-rank world can run, else a sentence saying why not and what to do."""
    prepare_environment()
    import jax

    devices = jax.devices()
    platform = devices[0].platform
    problem = ""
    if platform == "cpu" and len(devices) < 2:
        problem = (
            f"jax runs on {len(devices)} CPU device; an EP world of n ranks needs n devices. jax was imported "
            f"before the jax backend could set XLA_FLAGS={_FLAG}={cpu_device_target()} (XLA_FLAGS is "
            f"{os.environ.get('XLA_FLAGS', '')!r}); set it in the environment, or import moe_ep_jax.backend / "
            f"call moe_ep_jax.devices.prepare_environment() before the first 'import jax'"
        )
    return platform, len(devices), problem
