"""The case space as axes, the pairwise covering table over them, and its coverage.

Each operation has its own axes (an axis an operation does not read is not one
of its axes: a dispatch has no ``intermediate_format``). :data:`AXES` lists the
values of every axis; the size axes take values where fast kernels tile,
unroll and split (hidden 64 to 2560 with the odd multiples of 512, intermediate
above 256, experts holding about 96, 160 and 300 rows: more than 128 and not a
multiple of 64). :func:`forbidden` is the one constraint: what the spec does
not allow (``num_topk > num_experts``, a repeated expert with one slot) and
what the float64 reference cannot run quickly (a cost cap on rows x hidden x
intermediate), each with its reason.

`grid_rows` generates, per operation, a pairwise covering array over
that operation's axes with ``allpairspy`` (every pair of values of any two axes
appears in at least one case, unless :func:`forbidden` rules the pair out),
then completes any pair the generator left out. A generated case's id is its
values (:attr:`Case.id`), never the generator's index, so ids are stable and
readable: ``backward[torch-ep2-k5-e6-h1536-i384-...-full-mt32-...]``.

:func:`coverage` answers, for any list of cases (hand-written ones included),
which pairs of axis values it covers, which it cannot (with the reason) and
which it misses; ``moe-ep conformance --coverage`` prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import combinations
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "AXES",
    "OP_AXES",
    "QUICK_AXES",
    "ROWS",
    "forbidden",
    "axis_values",
    "grid_rows",
    "fill",
    "tokens_per_rank",
    "coverage",
    "format_coverage",
    "Coverage",
]

#: Every axis and its values (the first value is the base: what a case that
#: does not vary the axis has).
AXES: Dict[str, Tuple[Any, ...]] = {
    "num_ranks": (1, 2, 3, 4),
    "num_topk": (1, 2, 3, 5, 8),
    "local_experts": (1, 2, 3, 8),
    "hidden": (64, 128, 256, 512, 1024, 1536, 2560),
    "intermediate": (32, 128, 256, 384, 512),
    "rows": ("few", "r96", "r160", "r300"),
    "input_format": ("bf16", "fp32", "fp16", "mxfp8", "nvfp4"),
    "weight_format": ("bf16", "fp32", "fp16", "mxfp8", "nvfp4"),
    "output_format": ("bf16", "mxfp8", "nvfp4"),
    "combine_format": ("bf16", "mxfp8", "nvfp4"),
    "intermediate_format": (None, "bf16", "mxfp8", "nvfp4"),
    "clamp": (None, 0.75, 7.3),
    "weights_in": ("fc1", "fc2"),
    "layout": ("dynamic", "static"),
    "routing": ("uniform", "skewed", "one_rank", "unused_mixed", "repeated"),
    "strided": (False, True),
    "router_format": ("fp32", "bf16", "fp16"),
    "index_format": ("int32", "int64"),
    "values": ("random", "large"),
    "cotangent": ("fp32", "bf16", "fp16"),
    "backward_operand_format": (None, "bf16"),
}

#: ``rows``: the mean number of rows a local expert receives. ``few``: 6 tokens
#: per rank (``tokens`` even); ``rN``: every rank holds ``max_tokens_per_rank``
#: = ceil(N * local_experts / num_topk) tokens (``tokens`` full), so that an
#: expert receives N rows on average (more where the routing is skewed).
ROWS = {"few": 0, "r96": 96, "r160": 160, "r300": 300}

_SHAPE = ("num_ranks", "num_topk", "local_experts", "hidden", "rows", "layout", "routing", "strided", "index_format")
_EXPERT = ("intermediate", "input_format", "weight_format", "intermediate_format", "clamp", "weights_in",
           "router_format", "values")

#: The axes of every operation, in generation order.
OP_AXES: Dict[str, Tuple[str, ...]] = {
    "forward": _SHAPE + _EXPERT + ("output_format", "combine_format"),
    "forward_stash": _SHAPE + ("intermediate", "input_format", "weight_format", "clamp", "router_format"),
    "backward": _SHAPE + _EXPERT + ("cotangent", "backward_operand_format"),
    "dispatch": _SHAPE + ("input_format", "router_format"),
    "combine": _SHAPE + ("output_format", "combine_format", "cotangent"),
    "dispatch_backward": _SHAPE + ("cotangent",),
    "combine_backward": _SHAPE + ("cotangent",),
}

#: Fewer values of an axis for some operations (the rest take :data:`AXES`): the
#: layered operations move rows, so four widths show their tiling; the stash is
#: the FC1 output, which the forward's covering array already crosses with the rest.
OP_VALUES: Dict[str, Dict[str, Tuple[Any, ...]]] = {
    op: {"hidden": (64, 512, 1536, 2560)} for op in ("dispatch", "combine", "dispatch_backward", "combine_backward")
}

#: ``--quick``: the most kernel-relevant axes (sizes, encodings, layout, the
#: backward mode) with fewer values, every other axis at its base value.
QUICK_AXES: Dict[str, Dict[str, Tuple[Any, ...]]] = {
    "forward": {
        "num_ranks": (1, 2, 4), "num_topk": (1, 2, 5), "hidden": (64, 512, 1536), "intermediate": (32, 384),
        "rows": ("few", "r160"), "input_format": ("bf16", "mxfp8", "nvfp4"),
        "weight_format": ("bf16", "mxfp8", "nvfp4"), "output_format": ("bf16", "mxfp8", "nvfp4"),
        "intermediate_format": (None, "mxfp8", "nvfp4"), "layout": ("dynamic", "static"),
    },
    "backward": {
        "num_ranks": (1, 2, 4), "num_topk": (1, 2, 5), "hidden": (64, 512, 1536), "intermediate": (32, 384),
        "rows": ("few", "r160"), "input_format": ("bf16", "mxfp8", "nvfp4"),
        "weight_format": ("bf16", "mxfp8", "nvfp4"), "clamp": (None, 0.75), "layout": ("dynamic", "static"),
        "backward_operand_format": (None, "bf16"),
    },
    "dispatch": {
        "num_ranks": (1, 2, 4), "num_topk": (1, 2, 8), "hidden": (64, 1536), "rows": ("few", "r160"),
        "input_format": ("bf16", "mxfp8", "nvfp4"), "layout": ("dynamic", "static"),
    },
    "combine": {
        "num_ranks": (1, 2, 4), "num_topk": (1, 2, 8), "hidden": (64, 1536), "rows": ("few", "r160"),
        "combine_format": ("bf16", "mxfp8", "nvfp4"), "layout": ("dynamic", "static"),
    },
}

#: The float64 reference's time per case, estimated (seconds on one core of a
#: 2-core CI machine): per operation, seconds per route x hidden x intermediate
#: (FC1 and FC2 of every route) and per weight element (decode, budgets and the
#: weight gradients pass over every weight a few times); the layered operations
#: per route x hidden element moved (combine encodes and budgets every row).
_SECONDS = {
    "forward": (1.0e-8, 8.0e-8), "forward_stash": (1.0e-8, 8.0e-8), "backward": (2.0e-8, 1.1e-7),
    "dispatch": (1.0e-7, 0.0), "combine": (1.0e-6, 0.0), "dispatch_backward": (2.0e-7, 0.0),
    "combine_backward": (2.0e-7, 0.0),
}
#: The cap on that estimate: the full table, and ``--quick``.
CASE_SECONDS = 1.0
QUICK_CASE_SECONDS = 0.1


def _tokens_per_rank(rows: str, local_experts: int, num_topk: int) -> int:
    n = ROWS[rows]
    return 6 if n == 0 else math.ceil(n * local_experts / num_topk)


def _routes(v: Mapping[str, Any]) -> int:
    return v["num_ranks"] * _tokens_per_rank(v["rows"], v["local_experts"], v["num_topk"]) * v["num_topk"]


def _cost(op: str, v: Mapping[str, Any]) -> float:
    """The estimated reference seconds of a case with sizes ``v``."""
    per_route, per_weight = _SECONDS[op]
    if op in ("forward", "forward_stash", "backward"):
        hi = v["hidden"] * v["intermediate"]
        weights = 3 * v["num_ranks"] * v["local_experts"] * hi
        return per_route * _routes(v) * hi + per_weight * weights
    return per_route * _routes(v) * v["hidden"]


def _cap(quick: bool) -> float:
    return QUICK_CASE_SECONDS if quick else CASE_SECONDS


def _min_cost(op: str, known: Mapping[str, Any]) -> float:
    """The least cost of any completion of ``known`` that the spec allows."""
    key = tuple(known.get(n) for n in ("num_ranks", "num_topk", "local_experts", "hidden", "intermediate", "rows"))
    return _min_cost_of(op, key)


@lru_cache(maxsize=None)
def _min_cost_of(op: str, key: Tuple[Any, ...]) -> float:
    n0, k0, l0, h0, i0, r0 = key
    best = math.inf
    for n in [n0] if n0 is not None else AXES["num_ranks"]:
        for k in [k0] if k0 is not None else AXES["num_topk"]:
            for l in [l0] if l0 is not None else AXES["local_experts"]:
                if k > n * l:
                    continue
                for rows in [r0] if r0 is not None else AXES["rows"]:
                    v = {"num_ranks": n, "num_topk": k, "local_experts": l, "rows": rows,
                         "hidden": h0 if h0 is not None else min(AXES["hidden"]),
                         "intermediate": i0 if i0 is not None else min(AXES["intermediate"])}
                    best = min(best, _cost(op, v))
    return best


def forbidden(op: str, known: Mapping[str, Any], quick: bool = False) -> Optional[str]:
    """Why no case of ``op`` can have the values ``known`` (any subset of the
    operation's axes), or None when one can."""
    k, n, l = known.get("num_topk"), known.get("num_ranks"), known.get("local_experts")
    if k is not None:
        most_n = n if n is not None else max(AXES["num_ranks"])
        most_l = l if l is not None else max(AXES["local_experts"])
        if k > most_n * most_l:
            return (f"num_topk {k} > num_experts, at most {most_n} ranks x {most_l} local experts "
                    f"(spec section 2: num_topk <= num_experts)")
    if known.get("routing") == "repeated" and k == 1:
        return "routing 'repeated' needs two slots (one slot cannot repeat an expert)"
    sizes = ("num_ranks", "num_topk", "local_experts", "hidden", "intermediate", "rows")
    if any(s in known for s in sizes):
        cost, cap = _min_cost(op, known), _cap(quick)
        if cost > cap:
            return f"the float64 reference's time, estimated >= {cost:.2g} s, is above the cap {cap:g} s per case"
    return None


# ----------------------------------------------------------------------------- cases <-> values


def axis_values(case: Any) -> Dict[str, Any]:
    """The axis values of any case of the main table (hand-written or generated):
    the axes of its operation, each mapped to the axis value it has (a value
    outside :data:`AXES`, e.g. 9 local experts, is kept and matches no pair)."""
    op = case.op
    names = OP_AXES.get(op, ())
    tokens = case.tokens_per_rank()
    routes_per_expert = sum(tokens) * case.num_topk / max(case.num_experts, 1)
    if routes_per_expert < 64:
        rows = "few"
    elif routes_per_expert <= 128:
        rows = "r96"
    elif routes_per_expert <= 256:
        rows = "r160"
    else:
        rows = "r300"
    every = {
        "num_ranks": case.num_ranks,
        "num_topk": case.num_topk,
        "local_experts": case.num_experts // case.num_ranks,
        "hidden": case.hidden,
        "intermediate": case.intermediate,
        "rows": rows,
        "input_format": case.input_format,
        "weight_format": case.weight_format,
        "output_format": case.output_format,
        "combine_format": case.combine_format,
        "intermediate_format": case.intermediate_format,
        "clamp": case.clamp_limit if case.clamp else None,
        "weights_in": case.weights_in,
        "layout": case.layout,
        "routing": case.routing,
        "strided": case.strided,
        "router_format": case.router_format,
        "index_format": case.index_format,
        "values": case.values,
        "cotangent": case.cotangent,
        "backward_operand_format": case.backward_operand_format,
    }
    return {name: every[name] for name in names}


def _domains(op: str, quick: bool) -> Dict[str, Tuple[Any, ...]]:
    if quick:
        return dict(QUICK_AXES.get(op, {}))
    return {name: OP_VALUES.get(op, {}).get(name, AXES[name]) for name in OP_AXES[op]}


def _pairs(domains: Mapping[str, Sequence[Any]]) -> Iterable[Tuple[str, Any, str, Any]]:
    for a, b in combinations(list(domains), 2):
        for va in domains[a]:
            for vb in domains[b]:
                yield a, va, b, vb


def _complete(op: str, domains: Mapping[str, Sequence[Any]], fixed: Mapping[str, Any], quick: bool) -> Optional[Dict[str, Any]]:
    """A full row with ``fixed`` in it that :func:`forbidden` allows (first fit,
    backtracking), or None."""
    names = [n for n in domains if n not in fixed]

    def search(i: int, row: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        if i == len(names):
            return row
        for value in domains[names[i]]:
            trial = {**row, names[i]: value}
            if forbidden(op, trial, quick) is None:
                found = search(i + 1, trial)
                if found is not None:
                    return found
        return None

    return search(0, dict(fixed)) if forbidden(op, fixed, quick) is None else None


@lru_cache(maxsize=None)
def _grid_rows(op: str, quick: bool) -> Tuple[Tuple[Tuple[str, Any], ...], ...]:
    from allpairspy import AllPairs

    domains = _domains(op, quick)
    names = list(domains)

    def allowed(row: List[Any]) -> bool:
        return forbidden(op, dict(zip(names, row)), quick) is None

    rows = [dict(zip(names, r)) for r in AllPairs([list(domains[n]) for n in names], filter_func=allowed)]
    covered = set()
    for r in rows:
        covered.update(_row_pairs(r))
    # allpairspy stops at the first row that adds no pair, which constraints make
    # early: the rest is completed greedily, one row per round, each value chosen
    # to cover the most pairs still open (ties: the first value).
    open_pairs = [p for p in _pairs(domains) if p not in covered and forbidden(op, {p[0]: p[1], p[2]: p[3]}, quick) is None]
    todo = set(open_pairs)
    for pair in open_pairs:
        if pair not in todo:
            continue
        a, va, b, vb = pair
        row = _greedy_row(op, domains, {a: va, b: vb}, todo, quick) or _complete(op, domains, {a: va, b: vb}, quick)
        if row is None:  # cannot happen: forbidden() allowed the pair
            raise RuntimeError(f"no {op} case has {a}={va!r} and {b}={vb!r}")
        rows.append(row)
        todo.difference_update(_row_pairs(row))
    unique = list({tuple((n, r[n]) for n in names): None for r in rows})
    return tuple(unique)


def _greedy_row(op: str, domains: Mapping[str, Sequence[Any]], fixed: Mapping[str, Any], todo: set,
                quick: bool) -> Optional[Dict[str, Any]]:
    row = dict(fixed)
    for name in domains:
        if name in row:
            continue
        best, best_gain = None, -1
        for value in domains[name]:
            trial = {**row, name: value}
            if forbidden(op, trial, quick) is not None:
                continue
            gain = sum(1 for other, ov in row.items()
                       if (other, ov, name, value) in todo or (name, value, other, ov) in todo)
            if gain > best_gain:
                best, best_gain = value, gain
        if best_gain < 0:
            return None
        row[name] = best
    return {n: row[n] for n in domains}


def _row_pairs(row: Mapping[str, Any]) -> Iterable[Tuple[str, Any, str, Any]]:
    for a, b in combinations(list(row), 2):
        yield a, row[a], b, row[b]


def grid_rows(quick: bool = False) -> List[Tuple[str, Dict[str, Any]]]:
    """The pairwise covering rows of every operation, as ``(op, axis values)``
    (``quick``: the :data:`QUICK_AXES` covering), in generation order; the case
    table (:mod:`.cases`) turns each into a case."""
    return [(op, dict(row)) for op in (QUICK_AXES if quick else OP_AXES) for row in _grid_rows(op, quick)]


def tokens_per_rank(rows: str, local_experts: int, num_topk: int) -> Optional[int]:
    """``max_tokens_per_rank`` of a ``rows`` value (every rank full), or None
    for ``few`` (6 tokens per rank)."""
    return _tokens_per_rank(rows, local_experts, num_topk) if ROWS[rows] else None


def fill(values: Mapping[str, Any]) -> Dict[str, Any]:
    """Every axis of :data:`AXES`: ``values``, the base value elsewhere (and, where
    ``local_experts`` is not given, the fewest local experts top-k allows)."""
    base = {name: AXES[name][0] for name in AXES}
    if "local_experts" not in values:
        n, k = values.get("num_ranks", base["num_ranks"]), values.get("num_topk", base["num_topk"])
        base["local_experts"] = min(l for l in AXES["local_experts"] if n * l >= k)
    return {**base, **values}


# ----------------------------------------------------------------------------- coverage


@dataclass
class Coverage:
    """The pairs of one operation's axis values in a table.

    Attributes:
        op: the operation.
        num_cases: its cases in the table.
        covered: pairs ``(axis, value, axis, value)`` some case has.
        cannot: pair -> the reason no case can have it (:func:`forbidden`).
        missing: pairs no case has although one could.
        unselected: pairs only cases outside the selection (other EP sizes) have.
    """

    op: str
    num_cases: int
    covered: List[Tuple[str, Any, str, Any]] = field(default_factory=list)
    cannot: Dict[Tuple[str, Any, str, Any], str] = field(default_factory=dict)
    missing: List[Tuple[str, Any, str, Any]] = field(default_factory=list)
    unselected: List[Tuple[str, Any, str, Any]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.covered) + len(self.cannot) + len(self.missing) + len(self.unselected)


def coverage(cases: Sequence[Any], quick: bool = False, num_ranks: Optional[Iterable[int]] = None,
             whole: Optional[Sequence[Any]] = None) -> List[Coverage]:
    """Per operation of :data:`OP_AXES`: which pairs of its axis values ``cases``
    cover. ``quick`` judges against the ``--quick`` axes (and cost cap);
    ``num_ranks`` keeps only those EP sizes on the ``num_ranks`` axis (a table
    selected with ``--ep-size``); a pair that only cases of ``whole`` (the table
    before that selection) have is ``unselected``, not missing."""
    wanted = None if num_ranks is None else set(num_ranks)
    out = []
    for op in OP_AXES:
        mine = [c for c in cases if c.op == op]
        if quick and op not in QUICK_AXES:
            if mine:
                out.append(Coverage(op, len(mine)))
            continue
        domains = _domains(op, quick)
        if wanted is not None and "num_ranks" in domains:
            domains["num_ranks"] = tuple(n for n in domains["num_ranks"] if n in wanted)
        seen, seen_whole = set(), set()
        for c in mine:
            v = axis_values(c)
            seen.update(_row_pairs({n: v[n] for n in domains}))
        for c in whole or ():
            if c.op == op:
                v = axis_values(c)
                seen_whole.update(_row_pairs({n: v[n] for n in domains}))
        cov = Coverage(op, len(mine))
        for pair in _pairs(domains):
            a, va, b, vb = pair
            if pair in seen:
                cov.covered.append(pair)
                continue
            reason = forbidden(op, {a: va, b: vb}, quick)
            if reason is not None:
                cov.cannot[pair] = reason
            elif pair in seen_whole:
                cov.unselected.append(pair)
            else:
                cov.missing.append(pair)
        out.append(cov)
    return out


def _pair_text(pair: Tuple[str, Any, str, Any]) -> str:
    a, va, b, vb = pair
    return f"{a}={va} x {b}={vb}"


def format_coverage(report: Sequence[Coverage], verbose: bool = False) -> str:
    """The text of ``moe-ep conformance --coverage``: per operation, the count
    of covered pairs, every pair that cannot be built (grouped by reason) and
    every pair missed; ``verbose`` lists the covered pairs too."""
    lines = []
    for cov in report:
        if not cov.total:
            lines.append(f"{cov.op}: {cov.num_cases} cases (no axes in this selection)")
            continue
        lines.append(
            f"{cov.op}: {cov.num_cases} cases; {len(cov.covered)} of {cov.total} pairs of axis values covered, "
            f"{len(cov.cannot)} cannot be built, {len(cov.missing)} missing"
            + (f", {len(cov.unselected)} only at the EP sizes not selected" if cov.unselected else "")
        )
        if verbose:
            for pair in cov.covered:
                lines.append(f"  covered: {_pair_text(pair)}")
        by_reason: Dict[str, List[str]] = {}
        for pair, reason in cov.cannot.items():
            by_reason.setdefault(reason.split(", estimated")[0] if ", estimated" in reason else reason, []).append(_pair_text(pair))
        for reason, pairs in by_reason.items():
            lines.append(f"  cannot ({reason}): {', '.join(pairs)}")
        for pair in cov.missing:
            lines.append(f"  MISSING: {_pair_text(pair)}")
    missing = sum(len(c.missing) for c in report)
    lines.append(f"{missing} pair(s) missing" if missing else "every pair that can be built is covered")
    return "\n".join(lines)
