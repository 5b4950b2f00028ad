"""The MoeEp conformance suite: every backend against the shared reference.

Library use (no pytest)::

    import moe_ep_spec
    from moe_ep_conformance import all_cases, run_cases

    results = run_cases(moe_ep_spec.get_backend("reference"), all_cases(quick=True))
    failed = [r.describe() for r in results if r.outcome == "failed"]

From the command line: ``moe-ep conformance --backend NAME [--quick]``.
"""

from __future__ import annotations

from .cases import BAD_INPUTS, OPERATIONS, Case, all_cases, full_cases, quick_cases
from .expectations import Expectations
from .runner import CaseResult, Check, run_case, run_case_isolated, run_cases

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "OPERATIONS",
    "BAD_INPUTS",
    "Case",
    "all_cases",
    "full_cases",
    "quick_cases",
    "Expectations",
    "Check",
    "CaseResult",
    "run_case",
    "run_case_isolated",
    "run_cases",
]
