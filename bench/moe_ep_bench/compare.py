"""A guard against speed regressions: a run's rows against a baseline's.

``moe-ep bench --compare BASELINE.json`` (after its run) and ``python -m
moe_ep_bench.compare RUN.json BASELINE.json`` (two files) print, row by row,
each measured time over the baseline's time of the same row, and fail (exit 1)
when a backend's row is slower than its baseline by more than the tolerance
(``--tolerance``, default 0.10: more than 10 % slower).

Rows are matched by their identity (:func:`identity`): the backend and how it
was measured, the op, the format, the tokens, the device and GPU model, the EP
size, the layer's shape and the settings that change what is timed. Rows of
one side only are listed, never judged. The baselines of the run (``copy``,
``grouped_gemm`` ...) are shown for context (a slower machine shows there) but
not judged.

A baseline file is a bench JSON report (``moe-ep bench --json``) or a file made
from several of them (``python -m moe_ep_bench.compare --make-baseline OUT.json
RUN1.json RUN2.json ...``: later files' rows replace earlier ones of the same
identity; an older baseline may be one of the files; schema :data:`BASELINE_SCHEMA`,
every row carrying its identity and its source). ``bench/baselines/`` holds one per device kind.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .results import sig

__all__ = ["BASELINE_SCHEMA", "DEFAULT_TOLERANCE", "Comparison", "compare", "identity", "load", "make_baseline", "main"]

#: The schema name of a file made by :func:`make_baseline`.
BASELINE_SCHEMA = "moe-ep-bench-baseline/1"

#: A row more than this fraction slower than its baseline fails the comparison.
DEFAULT_TOLERANCE = 0.10

# The identity's fields, in the order they are shown.
_SHOWN = ("backend", "variant", "op", "format", "tokens")


def _gpu(environment: Dict[str, Any], device: str) -> str:
    gpus = environment.get("gpus") or []
    if device == "cuda" and gpus:
        return str(gpus[0].get("name", "cuda"))
    return device


def identity(row: Dict[str, Any], settings: Dict[str, Any], environment: Dict[str, Any]) -> Dict[str, Any]:
    """What makes two rows the same measurement: the row's backend, kind,
    variant, op, format and tokens; the run's device and GPU model, EP size and
    layer shape; the intermediate_format of fused ops; the backward operand
    format of forward_backward rows (``none`` in reports older than the field);
    cuda-nccl's mode (and its exchange mode on the device exchange)."""
    device = row.get("device") or settings.get("device", "cpu")
    ident: Dict[str, Any] = {
        "backend": row["backend"],
        "kind": row.get("kind", "backend"),
        "variant": row.get("variant", ""),
        "op": row["op"],
        "format": row["format"],
        "tokens": int(row["tokens"]),
        "device": device,
        "gpu": _gpu(environment, device),
        "ep_size": int(row.get("ep_size") or settings["ep_size"]),
        "hidden": settings["hidden"],
        "intermediate": settings["intermediate"],
        "experts": settings["experts"],
        "topk": settings["topk"],
    }
    if row["op"] in ("forward", "forward_backward"):
        ident["intermediate_format"] = settings.get("intermediate_format") or "none"
    if row["op"] == "forward_backward" and ident["kind"] == "backend":
        ident["backward_operand_format"] = (
            row.get("backward_operand_format") or settings.get("backward_operand_format") or "none"
        )
    if row["backend"] == "cuda-nccl":
        ident["cuda_nccl_mode"] = settings.get("cuda_nccl_mode", "synced")
        if ident["cuda_nccl_mode"] == "device":
            ident["exchange_mode"] = settings.get("exchange_mode", "throughput")
    return ident


def _key(ident: Dict[str, Any]) -> Tuple[Tuple[str, Any], ...]:
    return tuple(sorted(ident.items()))


@dataclass
class _Entry:
    ident: Dict[str, Any]
    row: Dict[str, Any]
    source: str


def load(path: str) -> List[_Entry]:
    """The measured rows of a bench report or a baseline file, with their identities."""
    with open(path) as fh:
        doc = json.load(fh)
    return entries(doc, path)


def entries(doc: Dict[str, Any], source: str) -> List[_Entry]:
    """The measured rows of a loaded report or baseline document. A document that
    is not a bench report or baseline, or a baseline row without a positive
    ``median_ms``, raises ValueError naming the file."""
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: not a bench report or baseline (expected a JSON object; got {type(doc).__name__})")
    schema = str(doc.get("schema", ""))
    out: List[_Entry] = []
    if schema == BASELINE_SCHEMA:
        for i, row in enumerate(doc["rows"]):
            median = row.get("median_ms") if isinstance(row, dict) else None
            if isinstance(median, bool) or not isinstance(median, (int, float)) or not median > 0:
                raise ValueError(f"{source}: baseline row {i} needs a median_ms > 0 (milliseconds); got {median!r}")
            out.append(_Entry(dict(row["identity"]), row, row.get("source", source)))
        return out
    if not schema.startswith("moe-ep-bench/"):
        raise ValueError(f"{source}: not a bench report or baseline (schema {schema!r}; expected moe-ep-bench/N or "
                         f"{BASELINE_SCHEMA})")
    settings, environment = doc["settings"], doc.get("environment", {})
    for row in doc["rows"]:
        if row.get("status") == "ok" and row.get("median_ms"):
            out.append(_Entry(identity(row, settings, environment), row, source))
    return out


def make_baseline(paths: Sequence[str]) -> Dict[str, Any]:
    """One baseline from bench reports and baselines: every measured row, a later
    file's row replacing an earlier one of the same identity. A baseline among
    them brings its rows with their own sources and its list of reports, so a
    baseline is refreshed with new runs without the reports it was made from."""
    rows: Dict[Tuple[Tuple[str, Any], ...], Dict[str, Any]] = {}
    sources: List[Dict[str, Any]] = []
    for path in paths:
        with open(path) as fh:
            doc = json.load(fh)
        if isinstance(doc, dict) and doc.get("schema") == BASELINE_SCHEMA:
            sources.extend(s for s in doc.get("sources", []) if s not in sources)
        else:
            sources.append({"file": os.path.basename(path), "created": doc.get("created"),
                            "command": doc.get("command")})
        for e in entries(doc, os.path.basename(path)):
            rows[_key(e.ident)] = {
                "identity": e.ident,
                "median_ms": e.row["median_ms"],
                "min_ms": e.row.get("min_ms"),
                "max_ms": e.row.get("max_ms"),
                "label": e.row.get("label", ""),
                "source": e.source,
            }
    return {
        "schema": BASELINE_SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "sources": sources,
        "rows": list(rows.values()),
    }


@dataclass
class Comparison:
    """A run against a baseline.

    Attributes:
        lines: the printed report.
        slower: the judged rows slower than the baseline by more than the tolerance.
        matched: rows found on both sides.
        unmatched_run: identities measured in the run, not in the baseline.
        unmatched_baseline: identities in the baseline, not measured in the run.
    """

    lines: List[str] = field(default_factory=list)
    slower: List[Dict[str, Any]] = field(default_factory=list)
    matched: int = 0
    unmatched_run: List[Dict[str, Any]] = field(default_factory=list)
    unmatched_baseline: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.slower


def _what(ident: Dict[str, Any]) -> str:
    parts = [str(ident[k]) for k in _SHOWN if ident.get(k) not in (None, "")]
    extra = [f"{k} {ident[k]}" for k in ("backward_operand_format",) if k in ident]
    return " ".join(parts + extra)


def _differences(a: Dict[str, Any], b: Dict[str, Any]) -> str:
    keys = [k for k in ("gpu", "device", "ep_size", "hidden", "intermediate", "experts", "topk", "intermediate_format")
            if a.get(k) != b.get(k)]
    return ", ".join(f"{k} {a.get(k)} here, {b.get(k)} in the baseline" for k in keys)


def compare(run: Sequence[_Entry], baseline: Sequence[_Entry], tolerance: float = DEFAULT_TOLERANCE,
            baseline_name: str = "the baseline") -> Comparison:
    """Every run row against the baseline row of the same identity: the ratio
    run time / baseline time (medians); a backend row above ``1 + tolerance``
    is slower. Baselines of the run are shown, not judged."""
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0; got {tolerance}")
    base = {_key(e.ident): e for e in baseline}
    seen = set()
    result = Comparison()
    limit = 1.0 + tolerance
    table = [["backend", "op", "format", "tokens", "ms", "baseline ms", "ratio", "verdict"]]
    context = []
    for e in run:
        k = _key(e.ident)
        b = base.get(k)
        if b is None:
            result.unmatched_run.append(e.ident)
            continue
        seen.add(k)
        result.matched += 1
        ratio = e.row["median_ms"] / b.row["median_ms"]
        if e.ident["kind"] != "backend":
            context.append(f"{_what(e.ident)} {sig(ratio)}")
            continue
        verdict = "ok"
        if ratio > limit:
            verdict = f"SLOWER by {100 * (ratio - 1):.0f}%"
            result.slower.append({**e.ident, "ratio": ratio})
        elif ratio < 1.0 / limit:
            verdict = f"faster by {100 * (1 - ratio):.0f}%"
        name = e.ident["backend"] + (f"#{e.ident['variant']}" if e.ident.get("variant") else "")
        op = e.ident["op"] + (f" ({e.ident['backward_operand_format']})" if "backward_operand_format" in e.ident else "")
        table.append([name, op, e.ident["format"], str(e.ident["tokens"]), sig(e.row["median_ms"]),
                      sig(b.row["median_ms"]), sig(ratio), verdict])
    result.unmatched_baseline = [e.ident for k, e in base.items() if k not in seen]
    lines = [f"compare with {baseline_name}: time / baseline time per row; a backend row above "
             f"{sig(limit)} (--tolerance {tolerance:g}) is slower"]
    if len(table) > 1:
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for r in table:
            cells = [c.rjust(w) if 3 <= i < 7 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
            lines.append("  ".join(cells).rstrip())
    if context:
        lines.append("baselines of the run, time / baseline time (not judged): " + "; ".join(context))
    for ident in result.unmatched_run:
        lines.append(f"not in the baseline: {_what(ident)}")
    if result.unmatched_baseline and result.matched:
        lines.append(f"in the baseline but not measured here: {len(result.unmatched_baseline)} rows")
    if not result.matched and result.unmatched_run and result.unmatched_baseline:
        nearest = result.unmatched_baseline[0]
        why = _differences(result.unmatched_run[0], nearest)
        lines.append("no row matched the baseline" + (f" ({why})" if why else ""))
    if result.slower:
        names = ", ".join(f"{_what(s)} ({sig(s['ratio'])})" for s in result.slower)
        lines.append(f"compare: FAIL: {len(result.slower)} row(s) slower than the baseline by more than "
                     f"{100 * tolerance:g}%: {names}")
    else:
        lines.append(f"compare: ok: {result.matched} rows matched, none slower than the baseline by more than "
                     f"{100 * tolerance:g}%")
    # prose wrapped to 100 columns, the table as it is
    result.lines = [line if i in range(1, len(table) + 1) and len(table) > 1 else
                    textwrap.fill(line, width=100, subsequent_indent="  ", break_on_hyphens=False, break_long_words=False)
                    for i, line in enumerate(lines)]
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m moe_ep_bench.compare RUN.json BASELINE.json [--tolerance T]``
    (exit 0, 1 when a row is slower, 2 on a usage mistake) or ``--make-baseline
    OUT.json RUN.json...``."""
    from moe_ep_spec.cli import Parser, check_input_file, check_output_file, non_negative_float, run_parsed

    p = Parser(prog="python -m moe_ep_bench.compare",
               description="Compare a bench JSON report with a baseline, or make a baseline from reports.")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="RUN.json BASELINE.json; with --make-baseline: the reports (and baselines), oldest first")
    p.add_argument("--tolerance", type=non_negative_float, default=DEFAULT_TOLERANCE,
                   help=f"a row more than this fraction slower fails (default {DEFAULT_TOLERANCE})")
    p.add_argument("--make-baseline", metavar="OUT", help="write a baseline made from FILE... here")
    args = p.parse_args(argv)

    def run(args: argparse.Namespace) -> int:
        from moe_ep_spec.errors import MoeEpError

        for path in args.files:
            check_input_file("FILE", path)
        try:
            if args.make_baseline:
                check_output_file("--make-baseline", args.make_baseline)
                doc = make_baseline(args.files)
                with open(args.make_baseline, "w") as fh:
                    fh.write(json.dumps(doc, indent=2, allow_nan=False) + "\n")
                print(f"wrote {args.make_baseline}: {len(doc['rows'])} rows from {len(args.files)} reports")
                return 0
            if len(args.files) != 2:
                raise MoeEpError(f"give two files, RUN.json BASELINE.json; got {len(args.files)}")
            result = compare(load(args.files[0]), load(args.files[1]), args.tolerance, args.files[1])
        except (ValueError, KeyError) as exc:
            raise MoeEpError(f"cannot read the reports: {exc}") from None
        print("\n".join(result.lines))
        return 0 if result.ok else 1

    args.func = run
    return run_parsed(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
