"""Usage checks shared by ``moe-ep conformance`` and the pytest plugin: they run
before any case, so that a mistake stops the run at once with a sentence that
says what to change (not after the whole run, and not as a run of no tests)."""

from __future__ import annotations

from typing import Any, List, Optional

import moe_ep_spec
from moe_ep_spec.cli import check_output_file

from .cases import all_cases

__all__ = ["lookup_backend", "check_ep_sizes", "check_report_path", "plugin_failures"]


def plugin_failures(registry: Any) -> List[str]:
    """One sentence per backend plugin that failed to import or register."""
    try:
        return [str(f) for f in registry.failures()]
    except Exception as exc:  # noqa: BLE001 - a report header must not crash the run
        return [f"the plugin list could not be read: {type(exc).__name__}: {exc}"]


def lookup_backend(registry: Any, name: str) -> moe_ep_spec.MoeEpBackend:
    """The backend ``name``; a plugin of that name that failed to load is named
    with its error (instead of a bare "no backend named ...")."""
    try:
        return registry.get_backend(name)
    except moe_ep_spec.BackendNotFoundError:
        for f in registry.failures():
            if f.name == name:
                dist = f" (distribution {f.distribution})" if f.distribution else ""
                raise moe_ep_spec.BackendError(
                    f"backend {name!r} cannot be tested: its plugin {f.name!r}{dist} failed to "
                    f"{'import' if f.stage == 'import' else 'register'}: {type(f.exception).__name__}: {f.exception}"
                ) from None
        raise


def check_ep_sizes(sizes: Optional[List[int]], quick: bool) -> None:
    """Every asked EP size must be one the table has (else nothing would run)."""
    if not sizes:
        return
    have = sorted({c.num_ranks for c in all_cases(quick=quick)})
    missing = sorted(set(sizes) - set(have))
    if missing:
        raise moe_ep_spec.MoeEpError(
            f"--ep-size {', '.join(str(n) for n in missing)}: the {'quick' if quick else 'full'} table has no case "
            f"with that EP size; it has EP sizes {', '.join(str(n) for n in have)}"
        )


def check_report_path(option: str, path: Optional[str]) -> None:
    """A report path must be writable before the run starts (not after it, when
    the results would be lost): ``moe-ep``'s one rule for every report file."""
    check_output_file(option, path)
