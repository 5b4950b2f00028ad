"""Conformance reports: JSON (every case) and markdown (one table per backend)."""

from __future__ import annotations

import json
import math
import platform
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .cases import OPERATIONS
from .expectations import Entry
from .runner import CaseResult, Check

__all__ = ["Record", "Report", "format_ratio", "is_code_step"]

FINAL_OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed")


def is_code_step(ratio: float) -> bool:
    """An error of exactly one budget. For a rounded result (bf16, mxfp8,
    nvfp4 codes) the budget where a rounding boundary lies within the
    propagated error is the distance to the neighbouring code, so an error of
    exactly 1 is the result landing on that neighbouring code: one step, which
    the spec allows there, not a result close to failing."""
    return ratio == 1.0


def format_ratio(ratio: float) -> str:
    """An error/budget in as few significant digits as show it (3 at least), never
    rounded up to ``1`` when it is below 1: ``0.456``, ``0.99998``, ``1``."""
    text = f"{ratio:.3g}"
    digits = 3
    while ratio < 1.0 and float(text) >= 1.0 and digits < 17:
        digits += 1
        text = f"{ratio:.{digits}g}"
    return text


@dataclass
class Record:
    """One test's final outcome (after expected-failure marks) and its result."""

    result: CaseResult
    outcome: str  # one of FINAL_OUTCOMES
    xfail_reason: str = ""

    def as_dict(self) -> Dict[str, Any]:
        r = self.result
        return {
            "id": r.test_id,
            "backend": r.backend,
            "case": r.case.id,
            "params": r.case.params,
            "outcome": self.outcome,
            "reason": r.reason if self.outcome != "xfailed" else (self.xfail_reason or r.reason),
            "error_over_budget": _json_float(r.ratio),
            "max_abs_error": _json_float(max((c.max_abs_error for c in r.checks), default=0.0)),
            "tolerance_factor": r.tolerance_factor,
            "duration_s": round(r.duration_s, 6),
            "checks": [
                {"name": c.name, "ok": c.ok, "error_over_budget": _json_float(c.ratio), "max_abs_error": _json_float(c.max_abs_error)}
                for c in r.checks
            ],
        }


def _json_float(x: float) -> Any:
    if math.isinf(x):
        return "inf"
    if math.isnan(x):
        return "nan"
    return x


@dataclass
class Report:
    """Everything a conformance run produced."""

    backends: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # name -> metadata
    records: List[Record] = field(default_factory=list)
    stale: List[Entry] = field(default_factory=list)
    environment: Dict[str, str] = field(default_factory=dict)
    #: Plugins that failed to load (one sentence each: name, stage, error).
    plugin_failures: List[str] = field(default_factory=list)

    def counts(self, backend: Optional[str] = None) -> Dict[str, int]:
        c = {o: 0 for o in FINAL_OUTCOMES}
        for rec in self.records:
            if backend is None or rec.result.backend == backend:
                c[rec.outcome] += 1
        return c

    def worst_passing(self, backend: str) -> float:
        ratios = [r.result.ratio for r in self.records if r.result.backend == backend and r.outcome == "passed"]
        return max(ratios, default=0.0)

    def worst_passing_case(self, backend: str) -> Optional[Tuple[Record, Check]]:
        """The passing case with the largest error/budget and its worst check
        (None when no case passed with a non-zero error)."""
        passed = [r for r in self.records if r.result.backend == backend and r.outcome == "passed" and r.result.checks]
        if not passed:
            return None
        rec = max(passed, key=lambda r: r.result.ratio)
        if rec.result.ratio <= 0:
            return None
        return rec, max(rec.result.checks, key=lambda c: c.ratio)

    def worst_below_a_step(self, backend: str) -> Optional[Tuple[Record, Check]]:
        """The passing check with the largest error/budget below 1, and its case:
        the worst of the errors that are not one code step (see :func:`is_code_step`);
        None when there is none above 0."""
        best: Optional[Tuple[Record, Check]] = None
        for r in self.records:
            if r.result.backend != backend or r.outcome != "passed":
                continue
            for c in r.result.checks:
                if 0 < c.ratio < 1.0 and (best is None or c.ratio > best[1].ratio):
                    best = (r, c)
        return best

    def worst_text(self, backend: str) -> str:
        """The worst passing error/budget in words: ``0.456``, or, when it is
        exactly one budget, ``1 step: an allowed neighbouring code`` and the worst
        of the other errors."""
        worst = self.worst_passing(backend)
        if not is_code_step(worst):
            return format_ratio(worst)
        text = "1 step: an allowed neighbouring code"
        other = self.worst_below_a_step(backend)
        if other is not None:
            text += f"; worst other error/budget {format_ratio(other[1].ratio)} ({other[0].result.test_id}, check '{other[1].name}')"
        else:
            text += "; every other error is 0"
        return text

    def total_time(self, backend: str) -> float:
        """Seconds the backend's cases took, reference included."""
        return sum(r.result.duration_s for r in self.records if r.result.backend == backend)

    def slowest(self, backend: str) -> Optional[Record]:
        recs = [r for r in self.records if r.result.backend == backend]
        return max(recs, key=lambda r: r.result.duration_s) if recs else None

    def skip_reasons(self, backend: str) -> List[Tuple[str, int, str]]:
        """``(reason, number of cases, first test id)`` of the backend's skips, most frequent first."""
        found: Dict[str, List[str]] = {}
        for r in self.records:
            if r.result.backend == backend and r.outcome == "skipped":
                found.setdefault(r.result.reason or "(no reason given)", []).append(r.result.test_id)
        return sorted(((k, len(v), v[0]) for k, v in found.items()), key=lambda x: (-x[1], x[0]))

    def summary_line(self, backend: str, version: str = "") -> str:
        """One line a user can act on: counts, time, the worst passing case and check, the slowest case."""
        c = self.counts(backend)
        text = (
            f"{backend}{' ' + version if version else ''}: {c['passed']} passed, {c['failed']} failed, "
            f"{c['skipped']} skipped, {c['xfailed']} xfailed, {c['xpassed']} xpassed in {self.total_time(backend):.1f} s; "
            f"worst passing error/budget {format_ratio(self.worst_passing(backend))}"
        )
        worst = self.worst_passing_case(backend)
        if worst is not None:
            rec, check = worst
            text += f" ({rec.result.test_id}, check '{check.name}', {rec.result.duration_s:.2f} s)"
            if is_code_step(check.ratio):
                text += ": " + self.worst_text(backend)
        slow = self.slowest(backend)
        if slow is not None:
            text += f"; slowest case {slow.result.test_id} ({slow.result.duration_s:.2f} s)"
        return text

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> Dict[str, Any]:
        """The ``--report-json`` report, schema ``moe-ep-conformance/1``: ``schema``;
        ``python``; ``environment`` (the variables of the header); ``backends``
        (``{name: {version, distribution, launch, devices, capabilities,
        framework_versions}}``, ``capabilities`` as ``Capabilities.as_dict()``);
        ``summary`` (``{name: {passed, failed, skipped, xfailed, xpassed}}``);
        ``details`` (``{name: {duration_s, worst_passing, worst_below_a_step, slowest,
        skip_reasons}}``); ``plugin_failures``; ``stale_expectations`` (``[{pattern,
        source, reason}]``); and ``cases``, one object per test that ran, in run
        order (:meth:`Record.as_dict`): ``id`` (the test id), ``backend``, ``case``
        (the case id), ``params`` (every axis of ``Case.params``), ``outcome``
        (``passed``, ``failed``, ``skipped``, ``xfailed``, ``xpassed``), ``reason``
        (the skip reason, the first failure's message, or an xfailed case's
        expectation reason), ``error_over_budget``, ``max_abs_error``,
        ``tolerance_factor``, ``duration_s`` and ``checks`` (``[{name, ok,
        error_over_budget, max_abs_error}]``; the messages are in the terminal
        output). Non-finite numbers are the strings ``"inf"`` and ``"nan"``, so the
        file is strict JSON."""
        return {
            "schema": "moe-ep-conformance/1",
            "python": platform.python_version(),
            "environment": self.environment,
            "backends": self.backends,
            "summary": {name: self.counts(name) for name in self.backends},
            "details": {name: self._details(name) for name in self.backends},
            "plugin_failures": list(self.plugin_failures),
            "stale_expectations": [{"pattern": e.pattern, "source": e.source, "reason": e.reason} for e in self.stale],
            "cases": [r.as_dict() for r in self.records],
        }

    def _details(self, backend: str) -> Dict[str, Any]:
        worst = self.worst_passing_case(backend)
        other = self.worst_below_a_step(backend)
        slow = self.slowest(backend)
        return {
            "duration_s": round(self.total_time(backend), 6),
            "worst_passing": None if worst is None else {
                "id": worst[0].result.test_id,
                "check": worst[1].name,
                "error_over_budget": _json_float(worst[1].ratio),
                "duration_s": round(worst[0].result.duration_s, 6),
                "code_step": is_code_step(worst[1].ratio),
            },
            "worst_below_a_step": None if other is None else {
                "id": other[0].result.test_id,
                "check": other[1].name,
                "error_over_budget": _json_float(other[1].ratio),
            },
            "slowest": None if slow is None else {"id": slow.result.test_id, "duration_s": round(slow.result.duration_s, 6)},
            "skip_reasons": [{"reason": r, "cases": n, "first": first} for r, n, first in self.skip_reasons(backend)],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    # -------------------------------------------------------------- markdown

    def to_markdown(self) -> str:
        """The ``--report-md`` report: the plugins that failed to load; one section
        per backend with its metadata, totals, time, worst passing and slowest case,
        one table, the failures (every failed and xpassed test id with the first line
        of its reason) and the skip reasons; then the stale expectations. The table's
        rows are operations, its columns the (EP size, output format) pairs; a cell
        is ``passed/failed/skipped``, then `` (N xf)`` for expected failures, then
        `` · W``, the worst error/budget (``inf`` for a structural failure or a
        non-zero error where the budget is 0), e.g. ``6/0/0 · 0.41``; an xpassed case
        counts as failed, and a cell with a failure is bold (``**4/1/0 · inf**``)."""
        out: List[str] = ["# MoeEp conformance report", ""]
        if self.plugin_failures:
            out.append("## Plugins that failed to load")
            out.append("")
            for text in self.plugin_failures:
                out.append(f"- {_one_line(text)}")
            out.append("")
        for name, meta in self.backends.items():
            counts = self.counts(name)
            out.append(f"## {name} {meta.get('version', '')}")
            out.append("")
            fw = ", ".join(f"{k} {v}" for k, v in meta.get("framework_versions", {}).items())
            out.append(
                f"Launch: {meta.get('launch', '?')}; devices: {', '.join(meta.get('devices', []))}; "
                f"distribution: {meta.get('distribution') or '?'}; frameworks: {fw or '?'}."
            )
            out.append("")
            out.append(
                "Totals: " + ", ".join(f"{counts[o]} {o}" for o in FINAL_OUTCOMES) +
                f". Worst error/budget of a passing case: {self.worst_text(name)}."
            )
            worst = self.worst_passing_case(name)
            slow = self.slowest(name)
            details = [f"Time: {self.total_time(name):.1f} s."]
            if worst is not None:
                details.append(
                    f"Worst passing case: `{worst[0].result.test_id}`, check '{worst[1].name}' "
                    f"({format_ratio(worst[1].ratio)} of its budget, {worst[0].result.duration_s:.2f} s)."
                )
            if slow is not None:
                details.append(f"Slowest case: `{slow.result.test_id}` ({slow.result.duration_s:.2f} s).")
            out.append("")
            out.append(" ".join(details))
            out.append("")
            out += self._table(name)
            out.append("")
            failed = [r for r in self.records if r.result.backend == name and r.outcome in ("failed", "xpassed")]
            if failed:
                out.append("### Failures")
                out.append("")
                for r in failed:
                    out.append(f"- `{r.result.test_id}` ({r.outcome}): {_one_line(r.result.reason)}")
                out.append("")
            skips = self.skip_reasons(name)
            if skips:
                out.append("### Skipped")
                out.append("")
                for reason, n, first in skips:
                    out.append(f"- {n} case(s): {_one_line(reason)} (e.g. `{first}`)")
                out.append("")
        if self.stale:
            out.append("## Stale expectation entries")
            out.append("")
            for e in self.stale:
                out.append(f"- `{e.pattern}` ({e.source}) matched no test")
            out.append("")
        out.append(
            "Cells: passed / failed / skipped (xfailed) cases of that operation, EP size and output format, "
            "and the worst error as a multiple of the spec's budget among the cases that ran."
        )
        return "\n".join(out) + "\n"

    def _table(self, backend: str) -> List[str]:
        cells: Dict[tuple, List[Record]] = defaultdict(list)
        columns = set()
        for r in self.records:
            if r.result.backend != backend:
                continue
            col = (r.result.case.num_ranks, r.result.case.output_format)
            columns.add(col)
            cells[(r.result.case.op, col)].append(r)
        cols = sorted(columns)
        header = "| operation | " + " | ".join(f"ep{n} {fmt}" for n, fmt in cols) + " |"
        lines = [header, "|---|" + "---|" * len(cols)]
        for op in OPERATIONS:
            if not any((op, c) in cells for c in cols):
                continue
            row = [op]
            for c in cols:
                recs = cells.get((op, c), [])
                row.append(_cell(recs))
            lines.append("| " + " | ".join(row) + " |")
        return lines

    def write_markdown(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_markdown())


def _cell(recs: Sequence[Record]) -> str:
    if not recs:
        return ""
    n_pass = sum(r.outcome == "passed" for r in recs)
    n_fail = sum(r.outcome in ("failed", "xpassed") for r in recs)
    n_skip = sum(r.outcome == "skipped" for r in recs)
    n_xf = sum(r.outcome == "xfailed" for r in recs)
    ran = [r.result.ratio for r in recs if r.outcome in ("passed", "failed", "xpassed", "xfailed")]
    worst = max(ran, default=None)
    text = f"{n_pass}/{n_fail}/{n_skip}"
    if n_xf:
        text += f" ({n_xf} xf)"
    if worst is not None:
        text += f" · {worst:.2g}" if math.isfinite(worst) else " · inf"
    if n_fail:
        text = f"**{text}**"
    return text


def _one_line(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first.replace("|", "\\|")
