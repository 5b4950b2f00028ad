"""Conformance reports: JSON (every case) and markdown (one table per backend)."""

from __future__ import annotations

import json
import math
import platform
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from .cases import OPERATIONS
from .expectations import Entry
from .runner import CaseResult

__all__ = ["Record", "Report"]

FINAL_OUTCOMES = ("passed", "failed", "skipped", "xfailed", "xpassed")


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

    def counts(self, backend: Optional[str] = None) -> Dict[str, int]:
        c = {o: 0 for o in FINAL_OUTCOMES}
        for rec in self.records:
            if backend is None or rec.result.backend == backend:
                c[rec.outcome] += 1
        return c

    def worst_passing(self, backend: str) -> float:
        ratios = [r.result.ratio for r in self.records if r.result.backend == backend and r.outcome == "passed"]
        return max(ratios, default=0.0)

    # ------------------------------------------------------------------ JSON

    def to_json(self) -> Dict[str, Any]:
        return {
            "schema": "moe-ep-conformance/1",
            "python": platform.python_version(),
            "environment": self.environment,
            "backends": self.backends,
            "summary": {name: self.counts(name) for name in self.backends},
            "stale_expectations": [{"pattern": e.pattern, "source": e.source, "reason": e.reason} for e in self.stale],
            "cases": [r.as_dict() for r in self.records],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    # -------------------------------------------------------------- markdown

    def to_markdown(self) -> str:
        out: List[str] = ["# MoeEp conformance report", ""]
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
                f". Worst error/budget of a passing case: {self.worst_passing(name):.3g}."
            )
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
