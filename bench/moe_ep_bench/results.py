"""Rows of a benchmark run: their numbers, their ratios to the baselines, the
terminal table and the JSON report."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import numpy as np

from .model import OPS

__all__ = ["Row", "SCHEMA", "finish", "add_ratios", "format_table", "report", "STATUSES", "BASELINES", "RATIO_KEYS", "sig",
           "TABLE_WIDTH", "identity"]

#: The JSON report's schema name; bumped when a field changes meaning.
#: 2: one name per baseline (``all_to_all``, ``copy``, ``grouped_gemm``,
#: ``weight_read``) and ratio keys ``vs_<baseline>``; ``variant``, ``p25_ms``, ``p75_ms``.
SCHEMA = "moe-ep-bench/2"

#: Row statuses: measured, not run on purpose, not supported by the backend,
#: no driver for the backend, failed.
STATUSES = ("ok", "skipped", "unsupported", "no bench driver", "error")

#: The baselines, by the one name each has in the progress lines, the rows'
#: ``backend``, the table's ratio columns (``vs_<name>``) and the JSON ratio keys.
#: How a baseline was measured on this machine is the row's ``variant``.
#:
#: ``all_to_all``: ``torch.distributed.all_to_all_single`` of the same bytes per
#: peer (variant: the transport, ``nccl`` or ``gloo``). ``copy``: the copy
#: ceiling of dispatch/combine's bytes (variant ``peer`` cuda:0 -> cuda:1 at EP
#: >= 2, ``device`` on one GPU, ``host`` on CPU). ``grouped_gemm``: the expert
#: GEMMs alone, the compute roofline of the fused layer (variant
#: ``torch._grouped_mm`` or ``per-expert matmul``). ``weight_read``: the local
#: experts' weights read once at the device copy bandwidth measured in the run,
#: the memory roofline of the forward at decode sizes.
BASELINES = ("all_to_all", "copy", "grouped_gemm", "weight_read")
#: Ratio keys (``Row.ratios``) and table columns, in order.
RATIO_KEYS = tuple(f"vs_{b}" for b in BASELINES)


@dataclass
class Row:
    """One measurement (or one case that was not measured, with the reason).

    Attributes:
        backend: the backend's registry name, or a baseline's name (:data:`BASELINES`).
        kind: ``backend`` or ``baseline``.
        op: one of :data:`~moe_ep_bench.model.OPS`. Baselines take the op whose
            bytes or GEMMs they stand for.
        tokens: tokens per rank.
        format: ``bf16``, ``mxfp8`` or ``nvfp4``: the tokens' encoding in dispatch, the
            combine and output format, the weights' encoding in the fused layer.
        status: one of :data:`STATUSES`; reason says why when not ``ok``.
        label: how it was measured (the function, the timer).
        variant: how a baseline was measured here (the transport of
            ``all_to_all``, the kind of ``copy``, ...); empty for backends.
        median_ms, min_ms, max_ms, p25_ms, p75_ms: over the repeats; a
            repeat's time is the slowest rank's.
        samples_ms: every repeat's time.
        bytes: token-row bytes per rank (dispatch: received; combine: sent), mean
            over ranks and input sets; fused ops: dispatch plus combine bytes;
            ``weight_read``: the local experts' weight bytes.
        bytes_remote: the part of ``bytes`` that crosses to or from another rank.
        gbps: ``bytes / median`` in GB/s (1e9 bytes per second).
        flops, tflops: expert GEMM operations per rank and their rate (fused ops and GEMM baselines).
        ratios: ``vs_<baseline>`` (:data:`RATIO_KEYS`) where that baseline was
            measured: baseline time over this row's time (1 = as fast as the
            baseline, below 1 slower).
        derived: the time is computed from other measurements (see label).
        backward_operand_format: forward_backward rows of backends: the
            backward's operand format they ran with, ``none`` (exact) or
            ``bf16`` (``MoeEpConfig.backward_operand_format``); empty otherwise.
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
    variant: str = ""
    median_ms: Optional[float] = None
    min_ms: Optional[float] = None
    max_ms: Optional[float] = None
    p25_ms: Optional[float] = None
    p75_ms: Optional[float] = None
    repeats: int = 0
    samples_ms: List[float] = field(default_factory=list)
    bytes: Optional[float] = None
    bytes_remote: Optional[float] = None
    gbps: Optional[float] = None
    flops: Optional[float] = None
    tflops: Optional[float] = None
    ratios: Dict[str, float] = field(default_factory=dict)
    derived: bool = False
    backward_operand_format: str = ""

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
        self.p25_ms = float(np.percentile(arr, 25))
        self.p75_ms = float(np.percentile(arr, 75))
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


def _find(rows: Iterable[Row], name: str, op: str, tokens: int, fmt: str) -> Optional[Row]:
    for r in rows:
        if r.ok and r.kind == "baseline" and r.backend == name and r.op == op and r.tokens == tokens and r.format == fmt:
            return r
    return None


def _ratio(base: Optional[float], time: float) -> Optional[float]:
    if base is None or not (base > 0) or not (time > 0):
        return None
    v = base / time
    return v if math.isfinite(v) and v > 0 else None


def add_ratios(rows: List[Row]) -> None:
    """Ratios of every measured row to the run's baselines (same op, tokens and
    format), baseline time over the row's time.

    dispatch/combine: ``vs_all_to_all`` and ``vs_copy`` (both equal the ratios
    of GB/s: every row of a case counts the same bytes).
    forward: ``vs_grouped_gemm`` = the forward's grouped GEMMs' time / time;
    ``vs_weight_read`` = the time to read the local experts' weights once at
    the run's device copy bandwidth / time; ``vs_all_to_all`` = (all-to-all
    dispatch + combine time) / time. forward_backward: ``vs_grouped_gemm`` with
    the forward and backward GEMMs, ``vs_all_to_all`` with twice the exchanges.
    A baseline's own row has 1 for itself.
    """
    for row in rows:
        if not row.ok:
            continue
        row.ratios = {}
        t = row.median_ms
        if row.kind == "baseline" and row.backend in BASELINES:
            row.ratios[f"vs_{row.backend}"] = 1.0
            continue
        if row.op in ("dispatch", "combine"):
            pairs = [("all_to_all", _find(rows, "all_to_all", row.op, row.tokens, row.format)),
                     ("copy", _find(rows, "copy", row.op, row.tokens, row.format))]
            bases = [(name, b.median_ms if b else None) for name, b in pairs]
        else:
            gemm = _find(rows, "grouped_gemm", row.op, row.tokens, row.format)
            wr = _find(rows, "weight_read", row.op, row.tokens, row.format)
            d = _find(rows, "all_to_all", "dispatch", row.tokens, row.format)
            c = _find(rows, "all_to_all", "combine", row.tokens, row.format)
            factor = 2.0 if row.op == "forward_backward" else 1.0
            a2a = factor * (d.median_ms + c.median_ms) if d is not None and c is not None else None  # type: ignore[operator]
            bases = [("all_to_all", a2a), ("grouped_gemm", gemm.median_ms if gemm else None),
                     ("weight_read", wr.median_ms if wr else None)]
        for name, base in bases:
            v = _ratio(base, t)  # type: ignore[arg-type]
            if v is not None:
                row.ratios[f"vs_{name}"] = v


# ----------------------------------------------------------------------------- output


def _order(row: Row) -> tuple:
    op = OPS.index(row.op) if row.op in OPS else len(OPS)
    base = BASELINES.index(row.backend) if row.kind == "baseline" and row.backend in BASELINES else -1
    return (op, row.format, row.tokens, 0 if row.kind == "backend" else 1, base, row.backend)


#: Significant digits of every number in the table (the JSON keeps full precision).
SIG_DIGITS = 3


def sig(v: Optional[float], digits: int = SIG_DIGITS) -> str:
    """``v`` with ``digits`` significant digits in fixed-point notation, never an
    exponent: 45.1, 0.0968, 0.000588, 12346 (integers keep every digit); ``-``
    for None."""
    if v is None or not math.isfinite(v):
        return "-"
    if v == 0:
        return "0"
    exp = math.floor(math.log10(abs(v)))
    decimals = max(0, digits - 1 - exp)
    text = f"{round(v, decimals):.{decimals}f}"
    # rounding may have added a digit (0.0999 -> 0.100): keep `digits` significant ones
    if decimals > 0 and len(text.replace("-", "").replace(".", "").lstrip("0")) > digits:
        text = f"{round(v, decimals - 1):.{decimals - 1}f}"
    return text


def _note(r: Row) -> str:
    notes = [r.variant] if r.variant else []
    if r.backward_operand_format:
        notes.append(f"backward_operand_format {r.backward_operand_format}")
    if r.derived:
        notes.append("derived")
    if r.backend == "copy" and r.variant == "peer" and r.bytes_remote and r.median_ms:
        notes.append(f"link {sig(r.bytes_remote / (r.median_ms / 1e3) / 1e9)} GB/s")
    return "; ".join(notes)


#: The table's columns: units in the header, numbers in :func:`sig` style.
COLUMNS = ("backend", "op", "format", "tokens", "median ms", "min-max ms", "GB/s", "TFLOP/s") + RATIO_KEYS + ("note",)


#: The default table's width limit: it fits this many columns (``--wide``: every column in one table).
TABLE_WIDTH = 100

#: The default table's columns per op: the rate and the ratios that mean something for it.
_COMPACT = {
    "dispatch": ("GB/s", ("vs_all_to_all", "vs_copy")),
    "combine": ("GB/s", ("vs_all_to_all", "vs_copy")),
    "forward": ("TFLOP/s", ("vs_all_to_all", "vs_grouped_gemm", "vs_weight_read")),
    "forward_backward": ("TFLOP/s", ("vs_all_to_all", "vs_grouped_gemm", "vs_weight_read")),
}


def _columns(table: List[List[str]], right_from: int, right_to: int) -> List[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for row in table:
        cells = [c.rjust(w) if right_from <= i < right_to else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def _not_measured(rows: Sequence[Row]) -> List[str]:
    notes: Dict[tuple, List[Row]] = {}
    for r in sorted(rows, key=_order):
        if r.status != "ok":
            notes.setdefault((r.backend, r.status, r.reason), []).append(r)
    lines = []
    for (backend, status, reason), group in notes.items():
        what = sorted({f"{g.op}/{g.format}/{g.tokens}" for g in group})
        shown = ", ".join(what[:6]) + (f", ... ({len(what)} cases)" if len(what) > 6 else "")
        text = reason if reason.startswith(status) else f"{status}: {reason}" if reason else status
        lines.append(f"{backend}: {text} [{shown}]")
    return lines


def _compact_table(rows: Sequence[Row], header: str) -> str:
    """One table per op, each with the rate and the ratios of that op only; a
    backend row measured another way (its ``variant``: a pipelined twin, the
    module) gets a marker ``name#n`` explained under the tables, as do the
    baselines' variants."""
    measured = [r for r in sorted(rows, key=_order) if r.status == "ok"]
    lines = [header] if header else []
    marks: Dict[tuple, str] = {}
    for r in measured:
        if r.kind == "backend" and r.variant and (r.backend, r.variant) not in marks:
            marks[(r.backend, r.variant)] = f"{r.backend}#{sum(1 for k in marks if k[0] == r.backend) + 1}"
    for op in list(OPS) + sorted({r.op for r in measured} - set(OPS)):
        group = [r for r in measured if r.op == op]
        if not group:
            continue
        rate, keys = _COMPACT.get(op, ("GB/s", tuple(RATIO_KEYS)))
        keys = tuple(k for k in keys if any(k in r.ratios for r in group))
        title = op
        modes = sorted({r.backward_operand_format for r in group if r.backward_operand_format})
        if modes:
            title += f" (backward_operand_format {', '.join(modes)})"
        if lines:
            lines.append("")
        lines.append(title)
        table = [["backend", "format", "tokens", "median ms", rate, *keys]]
        for r in group:
            name = marks.get((r.backend, r.variant), r.backend)
            if r.kind == "backend" and r.backward_operand_format and len(modes) > 1:
                name += f" ({r.backward_operand_format})"
            value = r.gbps if rate == "GB/s" else r.tflops
            table.append([name, r.format, str(r.tokens), sig(r.median_ms), sig(value)] + [sig(r.ratios.get(k)) for k in keys])
        lines += _columns(table, 2, len(table[0]))
    notes = [f"{mark}: {backend} {variant}" for (backend, variant), mark in marks.items()]
    variants = {}
    for r in measured:
        if r.kind == "baseline" and r.variant:
            variants.setdefault(r.backend, r.variant)
    if variants:
        notes.append("baselines: " + ", ".join(f"{name} {variant}" for name, variant in variants.items()))
    if measured:
        notes.append("--wide: one table with the min-max range, both rates and every ratio")
    if notes:
        lines.append("")
        lines += notes
    lines += [textwrap.fill(line, width=TABLE_WIDTH, subsequent_indent="  ", break_on_hyphens=False)
              for line in _not_measured(rows)]
    return "\n".join(lines)


def format_table(rows: Sequence[Row], header: str = "", wide: bool = False) -> str:
    """The terminal table. Default: one table per op with the median, the op's
    rate and its ratios to the baselines, within :data:`TABLE_WIDTH` columns
    (for the project's backend names). ``wide``: one table of every measured
    row (the median and the min-max range over the repeats, both rates, every
    ratio, a note). Then one line per group of rows that were not measured for
    the same reason. Ratio columns no row has are left out."""
    if not wide:
        return _compact_table(rows, header)
    measured = [r for r in sorted(rows, key=_order) if r.status == "ok"]
    keys = [k for k in RATIO_KEYS if any(k in r.ratios for r in measured)]
    cols = [c for c in COLUMNS if c not in RATIO_KEYS or c in keys]
    table = [cols]
    for r in measured:
        spread = "-" if r.min_ms is None or r.max_ms is None else f"{sig(r.min_ms)}-{sig(r.max_ms)}"
        table.append(
            [r.backend, r.op, r.format, str(r.tokens), sig(r.median_ms), spread, sig(r.gbps), sig(r.tflops)]
            + [sig(r.ratios.get(k)) for k in keys]
            + [_note(r)]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    right = set(range(3, len(cols) - 1))
    lines = [header] if header else []
    for row in table:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines += _not_measured(rows)
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
            "R": "the rows a rank receives in dispatch: one per route whose expert lives there, its own routes "
            "included (T * K on average)",
            "row(fmt)": "the bytes of one token row: bf16 2*H, mxfp8 H + ceil(H/32)",
            "median_ms": "median over the repeats of the slowest rank's time of one call; min_ms, max_ms, p25_ms, "
            "p75_ms: the spread over the same repeats",
            "bytes": "dispatch: token-row bytes received per rank, R * row(fmt); combine: token-row bytes sent per "
            "rank, the same rows going back in combine_format; forward and forward_backward: dispatch plus combine "
            "bytes (mean over ranks and input sets). Router weights, routing metadata and whatever a backend "
            "chooses to move beyond the format (the torch backend sends float32 rows back in combine) are not "
            "counted. weight_read rows: the local experts' fc1 + fc2 bytes W(fmt) (see vs_weight_read)",
            "bytes_remote": "the part of bytes that comes from (goes to) other ranks",
            "gbps": "bytes / median_ms, in 1e9 bytes per second; the same bytes for every backend and baseline of a "
            "case, so GB/s ratios equal time ratios. On a weight_read row: the run's device copy bandwidth",
            "tflops": "flops / median_ms; flops: the expert GEMMs per rank, forward 2*R*H*2I + 2*R*I*H = 6*R*H*I, "
            "forward_backward three times that",
            "vs_all_to_all": "all_to_all_single time (same bytes per peer; variant: nccl or gloo) / time; forward: "
            "(dispatch + combine all-to-all time) / time; forward_backward: twice that (the backward exchanges the "
            "tokens and their gradients again)",
            "vs_copy": "copy ceiling time / time: variant peer (EP >= 2): cuda:0 -> cuda:1 copy of the rows rank 0 "
            "receives from other ranks (its own rows counted free), so the ceiling is the link; device (EP 1): "
            "device-to-device copy of all its rows; host (CPU): memcpy. The table's note gives the peer copy's link "
            "rate, bytes_remote / median_ms",
            "vs_grouped_gemm": "grouped-GEMM time / time: forward: FC1 [R, H] x [H, 2I] and FC2 [R, I] x [I, H] per "
            "local expert on this run's per-expert row counts; forward_backward: those plus the backward's four "
            "(dc.W1^T, x^T.dc, dy.W2^T, h^T.dy). The GEMMs run in bf16 for every format (the mxfp8 rows say "
            "'bf16 GEMM rate')",
            "vs_weight_read": "forward only: weight_read time / time, weight_read = W(fmt) / B: W(fmt) the bytes of "
            "one rank's local expert weights in the row's format, E_local * (2I * row(fmt, H) + H * row(fmt, I)) "
            "(fc1 blocked along H, fc2 along I; bf16 6 * E_local * H * I, 2.82 GB for 32 experts of the DeepSeek "
            "shape), B the bandwidth of a device copy measured in the same run (rank 0 copies its local bf16 fc1 "
            "and fc2 into fresh buffers, B = 2 * bytes copied / time, read plus write), per repeat, so the derived "
            "weight_read row has a spread too. At decode sizes the forward is bound by reading the weights, at "
            "prefill by the GEMMs: read vs_weight_read at small token counts and vs_grouped_gemm at large ones",
        },
        "rows": [r.as_dict() for r in rows],
        "plots": list(plots),
    }


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, allow_nan=False)
