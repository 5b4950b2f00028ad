"""Rows of a benchmark run: their numbers, their ratios to the baselines, the
terminal table and the JSON report."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

from .model import OPS

__all__ = ["Row", "SCHEMA", "finish", "add_ratios", "format_table", "report", "STATUSES", "BASELINES"]

#: The JSON report's schema name; bumped when a field changes meaning.
SCHEMA = "moe-ep-bench/1"

#: Row statuses: measured, not run on purpose, not supported by the backend,
#: no driver for the backend, failed.
STATUSES = ("ok", "skipped", "unsupported", "no bench driver", "error")

#: Baseline names (the ``backend`` of baseline rows): the all-to-all (NCCL on
#: CUDA, gloo on CPU), the copy ceiling (peer copy GPU0 to GPU1 on 2+ ranks,
#: device-to-device on one, memcpy on CPU) and the GEMM roofline.
BASELINES = ("nccl", "gloo", "peer-copy", "d2d-copy", "memcpy", "grouped-gemm", "matmul")
_A2A = ("nccl", "gloo")
_COPY = ("peer-copy", "d2d-copy", "memcpy")
_GEMM = ("grouped-gemm", "matmul")


@dataclass
class Row:
    """One measurement (or one case that was not measured, with the reason).

    Attributes:
        backend: the backend's registry name, or a baseline's name (:data:`BASELINES`).
        kind: ``backend`` or ``baseline``.
        op: one of :data:`~moe_ep_bench.model.OPS`. Baselines take the op whose
            bytes or GEMMs they stand for.
        tokens: tokens per rank.
        format: ``bf16`` or ``mxfp8``: the tokens' encoding in dispatch, the
            combine and output format, the weights' encoding in the fused layer.
        status: one of :data:`STATUSES`; reason says why when not ``ok``.
        label: how it was measured (the function, the timer).
        median_ms, min_ms, max_ms: over the repeats; a repeat's time is the
            slowest rank's.
        samples_ms: every repeat's time.
        bytes: token-row bytes per rank (dispatch: received; combine: sent), mean
            over ranks and input sets; fused ops: dispatch plus combine bytes.
        bytes_remote: the part of ``bytes`` that crosses to or from another rank.
        gbps: ``bytes / median`` in GB/s (1e9 bytes per second).
        flops, tflops: expert GEMM operations per rank and their rate (fused ops and GEMM baselines).
        ratios: ``vs_nccl``, ``vs_peer_copy``, ``vs_roofline`` where that baseline
            was measured: baseline time over this row's time (1 = as fast as the
            baseline, below 1 slower).
        derived: the time is computed from other measurements (see label).
    """

    backend: str
    kind: str
    op: str
    tokens: int
    format: str
    ep_size: int
    device: str
    status: str = "ok"
    reason: str = ""
    label: str = ""
    median_ms: Optional[float] = None
    min_ms: Optional[float] = None
    max_ms: Optional[float] = None
    repeats: int = 0
    samples_ms: List[float] = field(default_factory=list)
    bytes: Optional[float] = None
    bytes_remote: Optional[float] = None
    gbps: Optional[float] = None
    flops: Optional[float] = None
    tflops: Optional[float] = None
    ratios: Dict[str, float] = field(default_factory=dict)
    derived: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.median_ms is not None

    def set_times(self, samples_ms: Sequence[float]) -> "Row":
        """Record the per-repeat times (ms) and the numbers that follow from them."""
        arr = np.asarray(list(samples_ms), dtype=np.float64)
        self.repeats = int(arr.size)
        if arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            self.status, self.reason = "error", f"invalid timings {[float(x) for x in arr[:8]]}"
            self.samples_ms = []
            return self
        self.samples_ms = [float(x) for x in arr]
        self.median_ms = float(np.median(arr))
        self.min_ms = float(arr.min())
        self.max_ms = float(arr.max())
        return finish(self)

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def finish(row: Row) -> Row:
    """Fill ``gbps`` and ``tflops`` from the median and the counted bytes and operations."""
    if row.median_ms is None or row.median_ms <= 0:
        return row
    seconds = row.median_ms / 1e3
    if row.bytes is not None:
        row.gbps = row.bytes / seconds / 1e9
    if row.flops is not None:
        row.tflops = row.flops / seconds / 1e12
    return row


def _find(rows: Iterable[Row], names: Sequence[str], op: str, tokens: int, fmt: str) -> Optional[Row]:
    for r in rows:
        if r.ok and r.backend in names and r.op == op and r.tokens == tokens and r.format == fmt:
            return r
    return None


def _ratio(base: Optional[float], time: float) -> Optional[float]:
    if base is None or not (base > 0) or not (time > 0):
        return None
    v = base / time
    return v if math.isfinite(v) and v > 0 else None


def add_ratios(rows: List[Row]) -> None:
    """Ratios of every measured row to the run's baselines (same op, tokens and format).

    dispatch/combine: ``vs_nccl`` = all-to-all time / time, ``vs_peer_copy`` =
    copy-ceiling time / time (both equal the ratios of GB/s: every row of a
    case counts the same bytes).
    forward: ``vs_roofline`` = forward grouped-GEMM time / time; ``vs_nccl`` =
    (all-to-all dispatch + combine time) / time. forward_backward: the same with
    the forward and backward GEMMs and twice the exchanges.
    """
    for row in rows:
        if not row.ok:
            continue
        row.ratios = {}
        t = row.median_ms
        if row.op in ("dispatch", "combine"):
            a2a = _find(rows, _A2A, row.op, row.tokens, row.format)
            copy = _find(rows, _COPY, row.op, row.tokens, row.format)
            for key, base in (("vs_nccl", a2a), ("vs_peer_copy", copy)):
                v = _ratio(base.median_ms if base else None, t)  # type: ignore[arg-type]
                if v is not None:
                    row.ratios[key] = v
        elif row.backend in _GEMM:
            row.ratios["vs_roofline"] = 1.0
        else:
            gemm = _find(rows, _GEMM, row.op, row.tokens, row.format)
            d = _find(rows, _A2A, "dispatch", row.tokens, row.format)
            c = _find(rows, _A2A, "combine", row.tokens, row.format)
            v = _ratio(gemm.median_ms if gemm else None, t)  # type: ignore[arg-type]
            if v is not None:
                row.ratios["vs_roofline"] = v
            if d is not None and c is not None:
                factor = 2.0 if row.op == "forward_backward" else 1.0
                v = _ratio(factor * (d.median_ms + c.median_ms), t)  # type: ignore[operator]
                if v is not None:
                    row.ratios["vs_nccl"] = v


# ----------------------------------------------------------------------------- output


def _order(row: Row) -> tuple:
    op = OPS.index(row.op) if row.op in OPS else len(OPS)
    return (op, row.format, row.tokens, 0 if row.kind == "backend" else 1, row.backend)


def _num(v: Optional[float], fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _note(r: Row) -> str:
    notes = ["derived"] if r.derived else []
    if r.backend == "peer-copy" and r.bytes_remote and r.median_ms:
        notes.append(f"link {r.bytes_remote / (r.median_ms / 1e3) / 1e9:.4g} GB/s")
    return "; ".join(notes)


def format_table(rows: Sequence[Row], header: str = "") -> str:
    """The terminal table: measured rows, then one line per group of rows that
    were not measured for the same reason."""
    cols = ["backend", "op", "format", "tokens", "median_ms", "GB/s", "TFLOP/s", "vs_nccl", "vs_peer", "vs_roofline", "note"]
    table = [cols]
    notes: Dict[tuple, List[Row]] = {}
    for r in sorted(rows, key=_order):
        if r.status != "ok":
            notes.setdefault((r.backend, r.status, r.reason), []).append(r)
            continue
        table.append(
            [
                r.backend,
                r.op,
                r.format,
                str(r.tokens),
                _num(r.median_ms, ".4g"),
                _num(r.gbps, ".4g"),
                _num(r.tflops, ".4g"),
                _num(r.ratios.get("vs_nccl"), ".3f"),
                _num(r.ratios.get("vs_peer_copy"), ".3f"),
                _num(r.ratios.get("vs_roofline"), ".3f"),
                _note(r),
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    right = {3, 4, 5, 6, 7, 8, 9}
    lines = [header] if header else []
    for row in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    for (backend, status, reason), group in notes.items():
        what = sorted({f"{g.op}/{g.format}/{g.tokens}" for g in group})
        shown = ", ".join(what[:6]) + (f", ... ({len(what)} cases)" if len(what) > 6 else "")
        text = reason if reason.startswith(status) else f"{status}: {reason}" if reason else status
        lines.append(f"{backend}: {text} [{shown}]")
    return "\n".join(lines)


def report(settings: dict, environment: dict, rows: Sequence[Row], command: str, plots: Sequence[str]) -> dict:
    """The JSON report."""
    import datetime

    return {
        "schema": SCHEMA,
        "created": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "settings": settings,
        "environment": environment,
        "definitions": {
            "median_ms": "median over the repeats of the slowest rank's time of one call",
            "bytes": "token-row bytes per rank: received in dispatch, sent in combine (mean over ranks and input "
            "sets); fused ops: dispatch plus combine bytes",
            "gbps": "bytes / median_ms, in 1e9 bytes per second",
            "tflops": "expert GEMM operations per rank / median_ms (forward 6*R*H*I, forward_backward 3x)",
            "vs_nccl": "all_to_all_single time (same bytes per peer) / time; fused ops: (dispatch + combine "
            "all-to-all time) / time, twice that for forward_backward",
            "vs_peer_copy": "copy ceiling time / time: GPU0->GPU1 peer copy of the rows rank 0 receives from other "
            "ranks (EP >= 2: its own rows counted free), device-to-device copy of all its rows (EP 1), memcpy on CPU",
            "vs_roofline": "grouped-GEMM time of the same expert shapes and rows / time",
        },
        "rows": [r.as_dict() for r in rows],
        "plots": list(plots),
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, allow_nan=False)
