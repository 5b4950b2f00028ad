"""The conformance cases: one table, stable ids.

Every case is a :class:`Case`: one operation on one configuration with one kind
of input. Its id names every axis in a fixed order, e.g.
``ep2-k2-e8-out_mxfp8-comb_bf16-in_bf16-wt_bf16-skewed-even-w_fc1-clamp-dynamic``;
the test id adds the operation and the backend:
``forward[torch-ep2-k2-e8-out_mxfp8-...]``. Ids never depend on the order in
which cases are generated, and the random inputs of a case depend on its id
only, so a failure reproduces by id.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace
from typing import Dict, Iterable, List, Optional, Tuple

from moe_ep_spec import MoeEpConfig, MoeFormat

from .format_cases import format_cases

__all__ = [
    "OPERATIONS",
    "BAD_INPUTS",
    "Case",
    "full_cases",
    "quick_cases",
    "all_cases",
]

#: Operations, in report order.
OPERATIONS = (
    "forward",
    "forward_stash",
    "backward",
    "dispatch",
    "combine",
    "dispatch_backward",
    "combine_backward",
    "bad_input",
    "nan_isolation",
    "formats",
)

#: Bad inputs: kind -> (operation it is fed to, the error class name the spec requires).
BAD_INPUTS: Dict[str, Tuple[str, str]] = {
    "activation_shape": ("forward", "ShapeError"),
    "activation_dtype": ("forward", "DTypeError"),
    "weight_shape": ("forward", "ShapeError"),
    "topk_idx_shape": ("forward", "ShapeError"),
    "topk_idx_dtype": ("forward", "DTypeError"),
    "topk_weights_dtype": ("forward", "DTypeError"),
    "expert_id_too_high": ("forward", "RoutingIndexError"),
    "expert_id_below_minus_one": ("forward", "RoutingIndexError"),
    "too_many_tokens": ("forward", "CapacityError"),
    "block_scale_mismatch": ("forward", "ShapeError"),
    "world_size": ("forward", "ShapeError"),
    "hidden_not_divisible": ("config", "ConfigError"),
    "dispatch_expert_id_too_high": ("dispatch", "RoutingIndexError"),
    "dispatch_too_many_tokens": ("dispatch", "CapacityError"),
    "dispatch_block_scale_mismatch": ("dispatch", "ShapeError"),
    "recv_capacity_overflow": ("dispatch", "CapacityError"),
}

#: The operation whose capability a case needs.
_CAPABILITY_OP = {
    "forward": "forward",
    "forward_stash": "forward",
    "backward": "backward",
    "dispatch": "dispatch",
    "combine": "combine",
    "dispatch_backward": "dispatch_backward",
    "combine_backward": "combine_backward",
    "nan_isolation": "forward",
}

MAX_TOKENS_PER_RANK = 8
CLAMP_LIMIT = 0.75
STATIC_ALIGNMENT = 4


@dataclass(frozen=True)
class Case:
    """One conformance case.

    Attributes:
        op: one of :data:`OPERATIONS`.
        num_ranks, num_topk, num_experts, hidden, intermediate: the layer shape.
        output_format, combine_format, intermediate_format: the config formats.
        input_format: the activation's encoding (``fp32``, ``bf16``, ``mxfp8``,
            ``nvfp4``); weight_format: both weights' encoding.
        routing: one of ``uniform``, ``skewed``, ``one_rank``, ``unused_mixed``,
            ``all_unused``.
        tokens: ``even`` (6 per rank), ``uneven`` (5, 2, 7, 3 ...) or
            ``zero_rank`` (rank 0 has none, the others 4).
        weights_in: ``fc1`` (apply_topk_in_fc1) or ``fc2``.
        clamp: gate_up_clamp 0.75 (hit by about half the values) or none.
        layout: ``dynamic`` or ``static`` (recv_capacity = the worst case,
            expert_alignment = 4).
        bad: for ``bad_input``, a key of :data:`BAD_INPUTS`.
        router_format: ``fp32`` or ``bf16``: the dtype of ``topk_weights``
            (named in the id only when ``bf16``: ``tw_bf16``).
        values: ``random``, or ``edges`` (combine only: expert outputs whose
            blocks sit on mxfp8 scale boundaries and nvfp4 ties; id ``edges``).
        quick: part of the ``--quick`` subset.
    """

    op: str
    num_ranks: int
    num_topk: int
    num_experts: int
    hidden: int = 64
    intermediate: int = 32
    output_format: str = "bf16"
    combine_format: str = "bf16"
    intermediate_format: Optional[str] = None
    input_format: str = "bf16"
    weight_format: str = "bf16"
    routing: str = "uniform"
    tokens: str = "even"
    weights_in: str = "fc1"
    clamp: bool = False
    layout: str = "dynamic"
    bad: Optional[str] = None
    router_format: str = "fp32"
    values: str = "random"
    quick: bool = field(default=False, compare=False)

    # ------------------------------------------------------------------ naming

    @property
    def id(self) -> str:
        """Every axis, in a fixed order."""
        parts = [
            f"ep{self.num_ranks}",
            f"k{self.num_topk}",
            f"e{self.num_experts}",
            f"out_{self.output_format}",
            f"comb_{self.combine_format}",
        ]
        if self.intermediate_format is not None:
            parts.append(f"int_{self.intermediate_format}")
        parts += [
            f"in_{self.input_format}",
            f"wt_{self.weight_format}",
        ]
        if self.router_format != "fp32":
            parts.append(f"tw_{self.router_format}")
        parts += [
            self.routing,
            self.tokens,
            f"w_{self.weights_in}",
            "clamp" if self.clamp else "noclamp",
            self.layout,
        ]
        if self.values != "random":
            parts.append(self.values)
        if self.bad is not None:
            parts.append(f"bad_{self.bad}")
        return "-".join(parts)

    def test_id(self, backend: str) -> str:
        """``op[backend-id]``: the stable, greppable test id."""
        return f"{self.op}[{backend}-{self.id}]"

    @property
    def seed(self) -> int:
        """The inputs' random seed: a function of the id alone."""
        return zlib.crc32(f"{self.op}:{self.id}".encode()) & 0x7FFFFFFF

    @property
    def params(self) -> Dict[str, object]:
        """The axes as a dict (for JSON reports)."""
        return {
            "op": self.op,
            "num_ranks": self.num_ranks,
            "num_topk": self.num_topk,
            "num_experts": self.num_experts,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "output_format": self.output_format,
            "combine_format": self.combine_format,
            "intermediate_format": self.intermediate_format,
            "input_format": self.input_format,
            "weight_format": self.weight_format,
            "routing": self.routing,
            "tokens": self.tokens,
            "weights_in": self.weights_in,
            "clamp": self.clamp,
            "layout": self.layout,
            "bad": self.bad,
            "router_format": self.router_format,
            "values": self.values,
        }

    # ------------------------------------------------------------- realising

    def tokens_per_rank(self) -> List[int]:
        n = self.num_ranks
        if self.tokens == "even":
            return [6] * n
        if self.tokens == "uneven":
            return [(5, 2, 7, 3)[r % 4] for r in range(n)]
        if self.tokens == "zero_rank":
            return [0] + [4] * (n - 1)
        raise ValueError(f"tokens must be even, uneven or zero_rank; got {self.tokens!r}")

    def config(self) -> MoeEpConfig:
        """The :class:`MoeEpConfig` of the case."""
        base = MoeEpConfig(
            num_experts=self.num_experts,
            hidden=self.hidden,
            intermediate=self.intermediate,
            num_topk=self.num_topk,
            num_ranks=self.num_ranks,
            max_tokens_per_rank=MAX_TOKENS_PER_RANK,
            output_format=self.output_format,
            combine_format=self.combine_format,
            intermediate_format=self.intermediate_format,
            apply_topk_in_fc1=self.weights_in == "fc1",
            gate_up_clamp=CLAMP_LIMIT if self.clamp else None,
            generate_c=self.op in ("forward_stash", "backward"),
        )
        if self.layout == "static":
            worst = base.replace(expert_alignment=STATIC_ALIGNMENT, recv_capacity=1).worst_case_recv_rows()
            base = base.replace(recv_capacity=worst, expert_alignment=STATIC_ALIGNMENT)
        return base

    @property
    def capability_op(self) -> str:
        if self.op == "bad_input":
            return BAD_INPUTS[self.bad or ""][0]
        return _CAPABILITY_OP[self.op]

    def input_formats(self) -> Tuple[MoeFormat, ...]:
        """The encodings the backend must accept (bf16 stands for plain floats)."""
        out = []
        for name in (self.input_format, self.weight_format):
            out.append(MoeFormat.BF16 if name in ("fp32", "bf16") else MoeFormat(name))
        return tuple(out)


# --------------------------------------------------------------------------- the table

_EP = (1, 2, 4)
_FORMATS = ("bf16", "mxfp8", "nvfp4")


def _topologies(n: int) -> List[Tuple[int, int]]:
    """(num_topk, num_experts) for EP size n: top-1, top-2, top-8 of 16, one expert per rank."""
    topo = [(1, 2 * n), (2, 4 * n), (8, 16), (min(2, n), n)]
    return list(dict.fromkeys(topo))


def _k2(op: str, n: int, **kw: object) -> Case:
    return Case(op=op, num_ranks=n, num_topk=2, num_experts=4 * n, **kw)  # type: ignore[arg-type]


def _forward_cases() -> Iterable[Case]:
    for n in _EP:
        for k, e in _topologies(n):
            yield Case("forward", n, k, e, quick=(n == 2 and k == 2))
        for routing in ("skewed", "one_rank", "unused_mixed", "all_unused"):
            yield _k2("forward", n, routing=routing, quick=(n == 4 and routing == "unused_mixed"))
        for tokens in ("uneven", "zero_rank"):
            yield _k2("forward", n, tokens=tokens, quick=(n == 4 and tokens == "zero_rank"))
        for out in _FORMATS:
            for comb in _FORMATS:
                yield _k2(
                    "forward",
                    n,
                    output_format=out,
                    combine_format=comb,
                    quick=(n == 2 and (out, comb) in (("mxfp8", "nvfp4"), ("nvfp4", "mxfp8"))),
                )
    inputs = [
        ("fp32", "fp32"),
        ("bf16", "fp32"),
        ("mxfp8", "mxfp8"),
        ("nvfp4", "nvfp4"),
        ("mxfp8", "bf16"),
        ("bf16", "nvfp4"),
        ("nvfp4", "mxfp8"),
    ]
    for act, wt in inputs:
        yield _k2("forward", 2, input_format=act, weight_format=wt, quick=(act, wt) == ("nvfp4", "mxfp8"))
    for act in ("mxfp8", "nvfp4"):
        yield _k2("forward", 4, input_format=act, weight_format=act)
    yield _k2("forward", 2, router_format="bf16", routing="unused_mixed", quick=True)
    yield _k2("forward", 4, router_format="bf16", weights_in="fc2", clamp=True)
    for weights_in in ("fc1", "fc2"):
        for clamp in (False, True):
            for inter in (None, "bf16", "mxfp8", "nvfp4"):
                yield _k2(
                    "forward",
                    2,
                    weights_in=weights_in,
                    clamp=clamp,
                    intermediate_format=inter,
                    quick=clamp and (weights_in, inter) in (("fc2", "mxfp8"), ("fc1", "nvfp4")),
                )
    for n in (1, 4):
        yield _k2("forward", n, weights_in="fc2", clamp=True)


def _stash_cases() -> Iterable[Case]:
    for n in _EP:
        for layout in ("dynamic", "static"):
            for routing in ("uniform", "skewed"):
                yield _k2("forward_stash", n, layout=layout, routing=routing, quick=(n == 2 and routing == "skewed"))
    for layout in ("dynamic", "static"):
        yield _k2(
            "forward_stash", 2, layout=layout, output_format="mxfp8", combine_format="nvfp4", clamp=True,
            quick=(layout == "dynamic"),
        )
        yield _k2("forward_stash", 2, layout=layout, tokens="zero_rank", routing="unused_mixed")
        yield _k2("forward_stash", 4, layout=layout, routing="all_unused")
    yield Case("forward_stash", 4, 8, 16, layout="static")


def _backward_cases() -> Iterable[Case]:
    for n in _EP:
        for weights_in in ("fc1", "fc2"):
            for clamp in (False, True):
                yield _k2("backward", n, weights_in=weights_in, clamp=clamp, quick=(n == 2 and clamp))
    for routing in ("skewed", "one_rank", "unused_mixed", "all_unused"):
        yield _k2("backward", 2, routing=routing, clamp=True)
    yield _k2("backward", 4, tokens="zero_rank", clamp=True)
    yield _k2("backward", 2, tokens="uneven", layout="static", clamp=True)
    for act in ("mxfp8", "nvfp4"):
        yield _k2("backward", 2, input_format=act, weight_format=act, clamp=True)
    yield _k2("backward", 2, router_format="bf16", clamp=True, routing="unused_mixed")
    yield Case("backward", 4, 8, 16, clamp=True)
    yield Case("backward", 4, 2, 4, clamp=True, weights_in="fc2")


def _layered_cases() -> Iterable[Case]:
    for n in _EP:
        for layout in ("dynamic", "static"):
            for act in ("fp32", "bf16", "mxfp8", "nvfp4"):
                yield _k2("dispatch", n, layout=layout, input_format=act, quick=(n == 4 and layout == "static" and act == "nvfp4"))
            for out in _FORMATS:
                yield _k2(
                    "combine",
                    n,
                    layout=layout,
                    output_format=out,
                    combine_format=out,
                    quick=(n == 2 and layout == "static" and out == "mxfp8"),
                )
            for op in ("dispatch_backward", "combine_backward"):
                yield _k2(op, n, layout=layout, quick=(n == 4 and layout == "static"))
    for out, comb in (("bf16", "mxfp8"), ("bf16", "nvfp4"), ("mxfp8", "bf16"), ("nvfp4", "bf16"), ("mxfp8", "nvfp4")):
        yield _k2("combine", 2, output_format=out, combine_format=comb, quick=(out, comb) == ("bf16", "nvfp4"))
    for layout in ("dynamic", "static"):
        for routing in ("skewed", "one_rank", "unused_mixed", "all_unused"):
            for op in ("dispatch", "combine", "dispatch_backward", "combine_backward"):
                yield _k2(op, 2, layout=layout, routing=routing)
        for op in ("dispatch", "combine", "dispatch_backward", "combine_backward"):
            yield _k2(op, 4, layout=layout, tokens="zero_rank")
    yield Case("dispatch", 4, 8, 16, layout="static")
    yield _k2("dispatch", 2, router_format="bf16", routing="unused_mixed")
    for n in (1, 2):
        for comb in ("mxfp8", "nvfp4"):
            for out in ("bf16", comb):
                yield Case(
                    "combine", n, 1, 2 * n, combine_format=comb, output_format=out, values="edges",
                    quick=(n == 2 and out == "bf16"),
                )
    yield Case("combine", 4, 8, 16, layout="static", output_format="nvfp4", combine_format="mxfp8")


def _bad_input_cases() -> Iterable[Case]:
    for bad, (op, _) in BAD_INPUTS.items():
        layout = "static" if bad == "recv_capacity_overflow" else "dynamic"
        act = "mxfp8" if "block_scale" in bad else "bf16"
        out = "mxfp8" if bad == "hidden_not_divisible" else "bf16"
        for n in (1, 2):
            yield _k2("bad_input", n, bad=bad, layout=layout, input_format=act, output_format=out, quick=(n == 2))


def _nan_cases() -> Iterable[Case]:
    for n in (1, 2, 4):
        for out in _FORMATS:
            yield _k2(
                "nan_isolation", n, output_format=out, combine_format=out, routing="unused_mixed",
                quick=(n == 2 and out == "nvfp4"),
            )
    yield _k2("nan_isolation", 2, clamp=True, weights_in="fc2", intermediate_format="mxfp8", routing="unused_mixed")


def _dedupe(cases: Iterable[Case]) -> List[Case]:
    seen: Dict[Tuple[str, str], Case] = {}
    for c in cases:
        key = (c.op, c.id)
        if key in seen:
            if c.quick and not seen[key].quick:
                seen[key] = replace(seen[key], quick=True)
            continue
        seen[key] = c
    return list(seen.values())


def full_cases() -> List[Case]:
    """Every case of the table, in report order (operation, then generation order)."""
    cases = _dedupe(
        [
            *_forward_cases(),
            *_stash_cases(),
            *_backward_cases(),
            *_layered_cases(),
            *_bad_input_cases(),
            *_nan_cases(),
        ]
    )
    cases += format_cases()  # the code-for-code format cases (format_cases.py, operation "formats")
    order = {op: i for i, op in enumerate(OPERATIONS)}
    return sorted(cases, key=lambda c: order[c.op])


def quick_cases() -> List[Case]:
    """The representative subset behind ``--quick``: every operation, every format,
    both layouts and both launch-relevant EP sizes, in well under a minute on the
    reference."""
    return [c for c in full_cases() if c.quick]


def all_cases(quick: bool = False, num_ranks: Optional[Iterable[int]] = None) -> List[Case]:
    """The cases to run: full or quick, optionally restricted to some EP sizes."""
    cases = quick_cases() if quick else full_cases()
    if num_ranks is not None:
        wanted = set(num_ranks)
        cases = [c for c in cases if c.num_ranks in wanted]
    return cases
