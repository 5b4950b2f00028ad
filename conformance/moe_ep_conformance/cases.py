"""The conformance cases: one table, stable ids.

Every case is a :class:`Case`: one operation on one configuration with one kind
of input. Its id names every axis in a fixed order, e.g.
``ep2-k2-e8-out_mxfp8-comb_bf16-in_bf16-wt_bf16-skewed-even-w_fc1-clamp-dynamic``
(an axis at its base value is left out of the id only where the table below says
so: ``h64-i32``, ``mt8``, float32 router weights and cotangents, int32 ids,
contiguous arrays, random values, the clamp limit 0.75);
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

from .axes import fill, grid_rows, tokens_per_rank
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
#: Every error class of spec section 12 that an input can cause is tried on every
#: operation that takes that input (the forward's kinds are unprefixed; the others
#: carry their operation's prefix).
#: How each kind breaks its argument (on the last rank; "E_local + 1" etc. name the
#: broken size; the dispatch's and the backward's kinds repeat the forward's with
#: their prefix):
#:
#: - ``activation`` (dispatch: ``tokens``): ``activation_shape``,
#:   ``dispatch_tokens_shape`` ``[T, H + 1]``; ``activation_dtype``,
#:   ``dispatch_tokens_dtype`` float64; ``activation_wrong_axis`` mxfp8 blocked along
#:   axis 0 (FormatError); ``block_scale_mismatch`` the scale lost its last block
#:   column; ``dispatch_mixed_encodings`` float16 on one rank, bfloat16 on the others.
#: - ``fc1_weight``: ``weight_shape`` ``E_local + 1`` experts; ``weight_dtype``
#:   float64; ``weight_wrong_axis`` blocked along 2I; ``weight_block_scale_mismatch``.
#: - ``fc2_weight``: ``fc2_weight_shape`` ``[E_local, I + 1, H]``; ``fc2_weight_dtype``
#:   int32.
#: - ``topk_idx``: ``topk_idx_shape`` ``[T, K + 1]``; ``topk_idx_dtype`` float32;
#:   ``expert_id_too_high`` (``num_experts``), ``expert_id_below_minus_one`` (-2),
#:   ``expert_id_wraps_int32`` (int64 ``2^32 + 1``, 1 after a narrowing cast).
#: - ``topk_weights``: ``topk_weights_shape`` ``[T, K + 1]``; ``topk_weights_dtype``
#:   int32; ``topk_weights_float64``.
#: - backward ``grad_output``: ``backward_grad_shape`` ``[T, H + 1]``,
#:   ``backward_grad_dtype`` float64. ``fc1_c``: ``backward_stash_rows`` one row too
#:   many (``route_metadata`` too), ``backward_stash_width`` ``2I + 1`` columns,
#:   ``backward_stash_dtype`` float32, ``backward_stash_mismatch`` the stash of the
#:   last rank's tokens rotated by one (same rows, other metadata). ``route_metadata``:
#:   ``backward_route_metadata_shape`` 3 columns, ``backward_route_metadata_dtype``
#:   int64.
#: - combine ``expert_out``: ``combine_expert_out_shape`` one row too many,
#:   ``combine_expert_out_dtype`` float64.
#: - dispatch_backward: ``dispatch_backward_grad_shape`` ``[R, H + 1]``,
#:   ``dispatch_backward_grad_weights_shape`` ``[R + 1]``;
#:   ``dispatch_backward_grad_tokens_dtype``, ``dispatch_backward_grad_dtype`` float64.
#: - combine_backward ``grad_output``: ``combine_backward_grad_shape`` ``[T + 1, H]``,
#:   ``combine_backward_grad_dtype`` float64.
#: - every world argument: ``world_size``, ``dispatch_world_size``,
#:   ``backward_world_size``, ``combine_world_size``: one entry fewer than ``num_ranks``.
#: - limits: ``too_many_tokens`` ``T = max_tokens_per_rank + 1`` (both layouts; the
#:   backward's stash from a configuration without the bound);
#:   ``recv_capacity_overflow`` ``recv_capacity = expert_alignment``;
#:   ``recv_capacity_short`` one aligned row below the plan (the backward's stash has
#:   the plan's rows, so only the capacity check can answer).
#: - ``MoeEpConfig`` itself (ConfigError, never calling the backend):
#:   ``hidden_not_divisible`` (40, mxfp8 output), ``hidden_not_mxfp8_multiple`` (48),
#:   ``combine_hidden_not_nvfp4_multiple`` (40), ``intermediate_not_mxfp8_multiple``
#:   (48), ``intermediate_not_nvfp4_multiple`` (40).
BAD_INPUTS: Dict[str, Tuple[str, str]] = {
    "activation_shape": ("forward", "ShapeError"),
    "activation_dtype": ("forward", "DTypeError"),
    "activation_wrong_axis": ("forward", "FormatError"),
    "weight_shape": ("forward", "ShapeError"),
    "fc2_weight_shape": ("forward", "ShapeError"),
    "weight_dtype": ("forward", "DTypeError"),
    "topk_idx_shape": ("forward", "ShapeError"),
    "topk_idx_dtype": ("forward", "DTypeError"),
    "topk_weights_dtype": ("forward", "DTypeError"),
    "topk_weights_float64": ("forward", "DTypeError"),
    "expert_id_too_high": ("forward", "RoutingIndexError"),
    "expert_id_below_minus_one": ("forward", "RoutingIndexError"),
    "expert_id_wraps_int32": ("forward", "RoutingIndexError"),
    "too_many_tokens": ("forward", "CapacityError"),
    "block_scale_mismatch": ("forward", "ShapeError"),
    "world_size": ("forward", "ShapeError"),
    "forward_recv_capacity_overflow": ("forward", "CapacityError"),
    "hidden_not_divisible": ("config", "ConfigError"),
    # the validation of every array argument of every operation (wrong shape, wrong dtype)
    "fc2_weight_dtype": ("forward", "DTypeError"),
    "topk_weights_shape": ("forward", "ShapeError"),
    "weight_block_scale_mismatch": ("forward", "ShapeError"),
    "weight_wrong_axis": ("forward", "FormatError"),
    "dispatch_tokens_shape": ("dispatch", "ShapeError"),
    "dispatch_topk_idx_shape": ("dispatch", "ShapeError"),
    "dispatch_topk_idx_dtype": ("dispatch", "DTypeError"),
    "dispatch_topk_weights_shape": ("dispatch", "ShapeError"),
    "dispatch_topk_weights_dtype": ("dispatch", "DTypeError"),
    "backward_activation_shape": ("backward", "ShapeError"),
    "backward_weight_shape": ("backward", "ShapeError"),
    "backward_weight_dtype": ("backward", "DTypeError"),
    "backward_fc2_weight_dtype": ("backward", "DTypeError"),
    "backward_topk_idx_shape": ("backward", "ShapeError"),
    "backward_topk_idx_dtype": ("backward", "DTypeError"),
    "backward_topk_weights_shape": ("backward", "ShapeError"),
    "backward_topk_weights_dtype": ("backward", "DTypeError"),
    "backward_route_metadata_dtype": ("backward", "DTypeError"),
    "backward_route_metadata_shape": ("backward", "ShapeError"),
    "backward_stash_width": ("backward", "ShapeError"),
    "dispatch_backward_grad_tokens_dtype": ("dispatch_backward", "DTypeError"),
    "dispatch_backward_grad_weights_shape": ("dispatch_backward", "ShapeError"),
    # boundaries, one step past the limit (the limit itself is a passing case)
    "recv_capacity_short": ("dispatch", "CapacityError"),
    "forward_recv_capacity_short": ("forward", "CapacityError"),
    "backward_recv_capacity_short": ("backward", "CapacityError"),
    "dispatch_expert_id_below_minus_one": ("dispatch", "RoutingIndexError"),
    "backward_expert_id_below_minus_one": ("backward", "RoutingIndexError"),
    "hidden_not_mxfp8_multiple": ("config", "ConfigError"),
    "combine_hidden_not_nvfp4_multiple": ("config", "ConfigError"),
    "intermediate_not_mxfp8_multiple": ("config", "ConfigError"),
    "intermediate_not_nvfp4_multiple": ("config", "ConfigError"),
    "dispatch_expert_id_too_high": ("dispatch", "RoutingIndexError"),
    "dispatch_expert_id_wraps_int32": ("dispatch", "RoutingIndexError"),
    "dispatch_too_many_tokens": ("dispatch", "CapacityError"),
    "dispatch_block_scale_mismatch": ("dispatch", "ShapeError"),
    "dispatch_tokens_dtype": ("dispatch", "DTypeError"),
    "dispatch_tokens_wrong_axis": ("dispatch", "FormatError"),
    "dispatch_mixed_encodings": ("dispatch", "DTypeError"),
    "dispatch_topk_weights_float64": ("dispatch", "DTypeError"),
    "dispatch_world_size": ("dispatch", "ShapeError"),
    "recv_capacity_overflow": ("dispatch", "CapacityError"),
    "backward_stash_mismatch": ("backward", "StashError"),
    "backward_stash_rows": ("backward", "ShapeError"),
    "backward_stash_dtype": ("backward", "DTypeError"),
    "backward_expert_id_too_high": ("backward", "RoutingIndexError"),
    "backward_fc2_weight_shape": ("backward", "ShapeError"),
    "backward_activation_dtype": ("backward", "DTypeError"),
    "backward_too_many_tokens": ("backward", "CapacityError"),
    "backward_recv_capacity_overflow": ("backward", "CapacityError"),
    "backward_grad_shape": ("backward", "ShapeError"),
    "backward_grad_dtype": ("backward", "DTypeError"),
    "backward_world_size": ("backward", "ShapeError"),
    "combine_expert_out_shape": ("combine", "ShapeError"),
    "combine_expert_out_dtype": ("combine", "DTypeError"),
    "combine_world_size": ("combine", "ShapeError"),
    "dispatch_backward_grad_shape": ("dispatch_backward", "ShapeError"),
    "dispatch_backward_grad_dtype": ("dispatch_backward", "DTypeError"),
    "combine_backward_grad_shape": ("combine_backward", "ShapeError"),
    "combine_backward_grad_dtype": ("combine_backward", "DTypeError"),
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
HIDDEN = 64
INTERMEDIATE = 32

#: Token counts per rank (``tokens`` axis).
TOKENS = ("even", "uneven", "zero_rank", "full", "zero_full")
#: Plain-float encodings of an input (``fp16`` is made by the suite from float32).
PLAIN_FORMATS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Case:
    """One conformance case.

    Its :attr:`id` names the value of every axis (the id part of each below), an
    axis at its base value left out where it says "absent"; the test id adds the
    operation and the backend, ``{op}[{backend}-{case id}]``.

    Attributes:
        op: one of :data:`OPERATIONS`.
        num_ranks, num_topk, num_experts: the EP size (``ep{n}``: 1 to 4), top-k
            (``k{K}``: 1 to 8) and experts (``e{E}``: 1 to 320, int64 ids above
            255; local experts 1, 2, 3, 8 and others that are not powers of two).
        hidden, intermediate: ``h{H}-i{I}`` (absent for 64 and 32): hidden 32 to
            2560 (48 and 72 for block edges and partial input blocks),
            intermediate 16 to 512.
        output_format, combine_format, intermediate_format: the config formats,
            ``out_{fmt}``, ``comb_{fmt}``, ``int_{fmt}`` (absent when None):
            ``bf16``, ``mxfp8``, ``nvfp4`` (intermediate also None).
        input_format: the activation's encoding, weight_format: both weights'
            (``in_{enc}``, ``wt_{enc}``): ``fp32``, ``bf16``, ``fp16`` (plain
            arrays), ``mxfp8``, ``nvfp4``.
        routing (as is): ``uniform`` (K distinct experts), ``skewed`` (slot 0
            always expert 0), ``one_rank`` (every route to rank 0),
            ``unused_mixed`` (about a third of the slots -1), ``all_unused``,
            ``repeated`` (the last slot of every token repeats its slot 0's
            expert: a forced duplicate), ``id_edges`` (slot 0 expert
            ``num_experts - 1``, slot 1 expert 0, every third token's last slot -1).
        tokens (as is): ``even`` (6 per rank), ``uneven`` (5, 2, 7, 3 ...),
            ``zero_rank`` (rank 0 has none, the others 4), ``full`` (every rank
            ``max_tokens`` = ``max_tokens_per_rank``) or ``zero_full`` (rank 0
            none, the others ``max_tokens``).
        weights_in: ``fc1`` (apply_topk_in_fc1) or ``fc2`` (``w_fc1``, ``w_fc2``).
        clamp: gate_up_clamp ``clamp_limit`` (0.75 is hit by about half the
            values) or none (``clamp``, ``clamp{L}``, ``noclamp``).
        layout: ``dynamic`` (recv_capacity None) or ``static`` (recv_capacity =
            ``worst_case_recv_rows()``, expert_alignment = 4).
        capacity: ``exact`` (id ``cap_exact``): a static layout whose
            recv_capacity is the aligned rows the plan needs, exactly.
        bad: for ``bad_input``, a key of :data:`BAD_INPUTS` (id ``bad_{kind}``).
        router_format: ``fp32``, ``bf16`` or ``fp16``: the dtype of ``topk_weights``
            (id ``tw_{dtype}``, absent for float32).
        values (absent for ``random``): ``edges`` (combine only: every mxfp8
            block's maximum a few float32 ulps above ``448 * 2^k`` with elements
            in the E4M3 subnormal range, every nvfp4 block's maximum ``6 * s``
            with its other elements E2M1 midpoints times ``s``); ``large``
            (activations times 2^6: FC1 outputs in the hundreds, so SiLU sees
            large |g|, and outputs in the ten thousands, above the largest nvfp4
            block (6 * 448)); ``clamp_edges`` (one-hot activations and float32 FC1
            weights made of +-L, their float32 and bf16 neighbours, L/2, 2L and 0,
            so that every gate and up value sits on a clamp edge exactly: forward
            and backward, both placements, L = 0.75 and 0.7); ``bf16_ties``
            (one-hot activations and cotangents, gate 32, router weights 1.5, up
            and FC2 entries ``(1 + k * 2^-7) * 2^p``, so that most of ``w * h``
            and of ``dc`` lie on bf16 rounding ties; the backward in both modes).
        max_tokens: ``max_tokens_per_rank`` (id ``mt{N}`` when not 8).
        clamp_limit: the clamp L when ``clamp`` (id ``clamp{L}`` when not 0.75).
        cotangent: dtype of every cotangent and of combine's ``expert_out``:
            ``fp32``, ``bf16`` or ``fp16`` (id ``ct_...`` when not float32).
        index_format: ``int32`` or ``int64`` ``topk_idx`` (id ``id_int64``).
        strided: every array handed to the backend (inputs, cotangents, the
            stash, the codes and scales of block-scaled tensors) is a
            non-contiguous view (id ``strided``).
        backward_operand_format: None or ``bf16`` (id ``bop_bf16``).
        quick: part of the ``--quick`` subset.
    """

    op: str
    num_ranks: int
    num_topk: int
    num_experts: int
    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE
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
    max_tokens: int = MAX_TOKENS_PER_RANK
    clamp_limit: float = CLAMP_LIMIT
    cotangent: str = "fp32"
    index_format: str = "int32"
    strided: bool = False
    backward_operand_format: Optional[str] = None
    capacity: Optional[str] = None
    quick: bool = field(default=False, compare=False)

    # ------------------------------------------------------------------ naming

    @property
    def id(self) -> str:
        """Every axis, in a fixed order."""
        parts = [
            f"ep{self.num_ranks}",
            f"k{self.num_topk}",
            f"e{self.num_experts}",
        ]
        if (self.hidden, self.intermediate) != (HIDDEN, INTERMEDIATE):
            parts.append(f"h{self.hidden}-i{self.intermediate}")
        parts += [
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
        if self.index_format != "int32":
            parts.append(f"id_{self.index_format}")
        parts += [self.routing, self.tokens]
        if self.max_tokens != MAX_TOKENS_PER_RANK:
            parts.append(f"mt{self.max_tokens}")
        parts += [
            f"w_{self.weights_in}",
            ("clamp" if self.clamp_limit == CLAMP_LIMIT else f"clamp{self.clamp_limit:g}") if self.clamp else "noclamp",
            self.layout,
        ]
        if self.cotangent != "fp32":
            parts.append(f"ct_{self.cotangent}")
        if self.strided:
            parts.append("strided")
        if self.backward_operand_format is not None:
            parts.append(f"bop_{self.backward_operand_format}")
        if self.capacity is not None:
            parts.append(f"cap_{self.capacity}")
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
            "max_tokens": self.max_tokens,
            "clamp_limit": self.clamp_limit if self.clamp else None,
            "cotangent": self.cotangent,
            "index_format": self.index_format,
            "strided": self.strided,
            "backward_operand_format": self.backward_operand_format,
            "capacity": self.capacity,
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
        if self.tokens == "full":
            return [self.max_tokens] * n
        if self.tokens == "zero_full":
            return [0] + [self.max_tokens] * (n - 1)
        raise ValueError(f"tokens must be one of {TOKENS}; got {self.tokens!r}")

    def config(self) -> MoeEpConfig:
        """The :class:`MoeEpConfig` of the case."""
        base = MoeEpConfig(
            num_experts=self.num_experts,
            hidden=self.hidden,
            intermediate=self.intermediate,
            num_topk=self.num_topk,
            num_ranks=self.num_ranks,
            max_tokens_per_rank=self.max_tokens,
            output_format=self.output_format,
            combine_format=self.combine_format,
            intermediate_format=self.intermediate_format,
            apply_topk_in_fc1=self.weights_in == "fc1",
            gate_up_clamp=self.clamp_limit if self.clamp else None,
            generate_c=self.op in ("forward_stash", "backward"),
        )
        if self.backward_operand_format is not None:
            base = base.replace(backward_operand_format=self.backward_operand_format)
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
            out.append(MoeFormat.BF16 if name in PLAIN_FORMATS else MoeFormat(name))
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


#: The bad inputs of the first table, tried at EP 1 and 2 (their ids are kept).
_BAD_EP12 = (
    "activation_shape", "activation_dtype", "weight_shape", "topk_idx_shape", "topk_idx_dtype",
    "topk_weights_dtype", "expert_id_too_high", "expert_id_below_minus_one", "too_many_tokens",
    "block_scale_mismatch", "world_size", "hidden_not_divisible", "dispatch_expert_id_too_high",
    "dispatch_too_many_tokens", "dispatch_block_scale_mismatch", "recv_capacity_overflow",
)


#: Config-level bad inputs: kind -> the MoeEpConfig fields that break one rule
#: (the rest is the case's configuration); hidden_not_divisible keeps its first form.
CONFIG_BAD: Dict[str, Dict[str, object]] = {
    "hidden_not_divisible": dict(hidden=40, output_format="mxfp8"),
    "hidden_not_mxfp8_multiple": dict(hidden=48, output_format="mxfp8"),  # 48: a multiple of 16, not of 32
    "combine_hidden_not_nvfp4_multiple": dict(hidden=40, combine_format="nvfp4"),
    "intermediate_not_mxfp8_multiple": dict(intermediate=48, intermediate_format="mxfp8"),
    "intermediate_not_nvfp4_multiple": dict(intermediate=40, intermediate_format="nvfp4"),
}


def _bad_input_cases() -> Iterable[Case]:
    for bad, (op, _) in BAD_INPUTS.items():
        layout = "static" if bad.endswith(("recv_capacity_overflow", "recv_capacity_short")) else "dynamic"
        act = "mxfp8" if ("block_scale" in bad or "wrong_axis" in bad) and "weight" not in bad else "bf16"
        wt = "mxfp8" if bad in ("weight_block_scale_mismatch", "weight_wrong_axis") else "bf16"
        out = "mxfp8" if bad == "hidden_not_divisible" else "bf16"
        idx = "int64" if "wraps_int32" in bad else "int32"
        for n in (1, 2) if bad in _BAD_EP12 else (2,):
            yield _k2(
                "bad_input", n, bad=bad, layout=layout, input_format=act, weight_format=wt, output_format=out,
                index_format=idx, quick=(n == 2),
            )
    # T one past max_tokens_per_rank in the static layout too; one aligned row short on three ranks
    for bad in ("too_many_tokens", "dispatch_too_many_tokens", "backward_too_many_tokens"):
        yield _k2("bad_input", 2, bad=bad, layout="static")
    for bad in ("recv_capacity_short", "forward_recv_capacity_short", "backward_recv_capacity_short"):
        yield Case("bad_input", 3, 3, 9, bad=bad, layout="static", routing="repeated", tokens="uneven")
    # the backward's stash check with three ranks, the last rank's stash from another routing
    yield Case("bad_input", 3, 3, 9, bad="backward_stash_mismatch", routing="repeated", quick=True)
    yield Case("bad_input", 3, 3, 9, bad="forward_recv_capacity_overflow", layout="static")


def _nan_cases() -> Iterable[Case]:
    for n in (1, 2, 4):
        for out in _FORMATS:
            yield _k2(
                "nan_isolation", n, output_format=out, combine_format=out, routing="unused_mixed",
                quick=(n == 2 and out == "nvfp4"),
            )
    yield _k2("nan_isolation", 2, clamp=True, weights_in="fc2", intermediate_format="mxfp8", routing="unused_mixed")


def _wide_cases() -> Iterable[Case]:
    """Axes the first table did not vary: three ranks, top-k not a multiple of 4,
    more than 32 experts, local experts not a power of two, partial input blocks,
    hidden a multiple of 128, inexact clamp limits, large magnitudes, float16
    activations and router weights, int64 ids, non-float32 cotangents,
    non-contiguous arrays, T == max_tokens_per_rank and forced duplicate experts."""
    # three ranks, in every operation
    for k, e in ((1, 3), (3, 9), (5, 15), (2, 6)):
        yield Case("forward", 3, k, e, quick=(k, e) == (3, 9))
    yield Case("forward", 3, 3, 9, output_format="nvfp4", combine_format="mxfp8", intermediate_format="nvfp4",
               input_format="nvfp4", weight_format="mxfp8", tokens="uneven", clamp=True, clamp_limit=0.7)
    yield Case("forward", 3, 6, 39, output_format="mxfp8", tokens="full", routing="repeated", quick=True)
    for layout in ("dynamic", "static"):
        yield Case("forward_stash", 3, 3, 9, layout=layout, routing="repeated", tokens="uneven",
                   quick=(layout == "static"))
        yield Case("backward", 3, 3, 9, layout=layout, clamp=True, clamp_limit=0.7, tokens="uneven",
                   cotangent="bf16", quick=(layout == "dynamic"))
        for op in ("dispatch", "combine", "dispatch_backward", "combine_backward"):
            yield Case(op, 3, 3, 9, layout=layout, routing="repeated", tokens="uneven",
                       quick=(layout == "static" and op in ("dispatch", "combine")))
    yield Case("combine", 3, 5, 15, output_format="nvfp4", combine_format="mxfp8")
    yield Case("nan_isolation", 3, 3, 9, output_format="mxfp8", combine_format="nvfp4", routing="unused_mixed")
    # top-k not a multiple of 4; more than 32 experts; local experts not a power of two
    yield Case("forward", 2, 5, 40, routing="repeated", quick=True)
    yield Case("forward", 4, 6, 36, output_format="nvfp4", combine_format="nvfp4", tokens="full")
    yield Case("forward", 4, 7, 48, intermediate_format="mxfp8", weights_in="fc2", clamp=True)
    yield Case("forward_stash", 4, 6, 36, layout="static", routing="skewed")
    yield Case("backward", 2, 5, 40, routing="repeated", clamp=True, quick=True)
    yield Case("backward", 4, 6, 36, weights_in="fc2", tokens="full", cotangent="fp16")
    yield Case("dispatch", 4, 6, 36, layout="static", routing="repeated", input_format="mxfp8")
    yield Case("combine", 4, 6, 36, layout="static", routing="repeated", output_format="mxfp8", combine_format="nvfp4")
    yield Case("dispatch_backward", 2, 5, 40, routing="repeated", cotangent="fp16")
    yield Case("combine_backward", 4, 6, 36, layout="static", cotangent="bf16")
    # large expert ids (above 255: an 8-bit id or counter wraps), int64
    yield Case("forward", 3, 8, 288, index_format="int64", tokens="full", routing="repeated")
    yield Case("backward", 2, 4, 260, index_format="int64", tokens="full", clamp=True)
    yield Case("dispatch", 4, 6, 320, index_format="int64", tokens="full", layout="static")
    # partial input blocks: hidden 72 and intermediate 40 (neither a multiple of 32 or 16)
    part = dict(hidden=72, intermediate=40)
    for act, wt in (("mxfp8", "mxfp8"), ("nvfp4", "nvfp4"), ("nvfp4", "mxfp8")):
        yield _k2("forward", 2, input_format=act, weight_format=wt, quick=(act, wt) == ("nvfp4", "mxfp8"), **part)
    yield _k2("forward", 3 - 1, input_format="mxfp8", weight_format="nvfp4", intermediate_format="bf16",
              weights_in="fc2", clamp=True, **part)
    yield _k2("forward_stash", 2, input_format="nvfp4", weight_format="nvfp4", layout="static", **part)
    yield _k2("backward", 2, input_format="mxfp8", weight_format="nvfp4", clamp=True, quick=True, **part)
    for act in ("mxfp8", "nvfp4"):
        yield _k2("dispatch", 2, input_format=act, layout="static", quick=(act == "nvfp4"), **part)
    yield _k2("nan_isolation", 2, input_format="nvfp4", weight_format="mxfp8", routing="unused_mixed", **part)
    # hidden a multiple of 128 (several 32/16 blocks and tiles), intermediate 128
    h128 = dict(hidden=256, intermediate=128)
    yield _k2("forward", 2, output_format="mxfp8", combine_format="nvfp4", intermediate_format="mxfp8",
              quick=True, **h128)
    yield _k2("forward", 4, output_format="nvfp4", combine_format="mxfp8", input_format="nvfp4",
              weight_format="nvfp4", intermediate_format="nvfp4", weights_in="fc2", **h128)
    yield _k2("backward", 2, clamp=True, input_format="mxfp8", weight_format="mxfp8", **h128)
    yield _k2("combine", 2, output_format="nvfp4", combine_format="mxfp8", layout="static", **h128)
    # clamp limits that are not bf16 numbers
    for limit in (0.7, 1.3):
        yield _k2("forward", 2, clamp=True, clamp_limit=limit, output_format="mxfp8", quick=(limit == 0.7))
        yield _k2("backward", 2, clamp=True, clamp_limit=limit, weights_in="fc2")
    yield _k2("forward_stash", 2, clamp=True, clamp_limit=1.3)
    # large magnitudes: SiLU at large |g|, outputs above the largest nvfp4 block
    for out in _FORMATS:
        yield _k2("forward", 2, values="large", output_format=out, combine_format=out, quick=(out == "nvfp4"))
    yield _k2("forward", 2, values="large", clamp=True, clamp_limit=7.3, intermediate_format="nvfp4")
    yield _k2("forward", 4, values="large", input_format="mxfp8", weight_format="mxfp8", intermediate_format="mxfp8",
              weights_in="fc2")
    yield _k2("backward", 2, values="large", clamp=True, clamp_limit=7.3)
    yield _k2("backward", 2, values="large")
    yield _k2("nan_isolation", 2, values="large", output_format="nvfp4", combine_format="nvfp4", routing="unused_mixed")
    # float16 activations and router weights; int64 ids; cotangents in bf16 and fp16
    yield _k2("forward", 2, input_format="fp16", weight_format="fp16", quick=True)
    yield _k2("forward", 4, input_format="fp16", weight_format="bf16", router_format="fp16", index_format="int64",
              output_format="mxfp8")
    yield _k2("forward", 2, router_format="fp16", routing="unused_mixed", index_format="int64", quick=True)
    yield _k2("forward_stash", 2, input_format="fp16", router_format="fp16", index_format="int64", layout="static")
    yield _k2("backward", 2, input_format="fp16", weight_format="fp32", router_format="fp16", index_format="int64",
              cotangent="fp16", quick=True)
    yield _k2("backward", 2, router_format="bf16", cotangent="bf16", weights_in="fc2", clamp=True)
    yield _k2("dispatch", 2, input_format="fp16", router_format="fp16", index_format="int64", quick=True)
    for ct in ("bf16", "fp16"):
        for op in ("combine", "dispatch_backward", "combine_backward"):
            yield _k2(op, 2, cotangent=ct, layout="static" if ct == "fp16" else "dynamic",
                      quick=(ct == "bf16" and op == "combine"))
    # non-contiguous arrays, every operation
    for op in ("forward", "forward_stash", "backward", "dispatch", "combine", "dispatch_backward", "combine_backward"):
        yield _k2(op, 2, strided=True, index_format="int64" if op == "dispatch" else "int32",
                  cotangent="bf16" if op == "backward" else "fp32", quick=op in ("forward", "backward"))
    yield _k2("nan_isolation", 2, strided=True, routing="unused_mixed")
    # T == max_tokens_per_rank on every rank (the static worst case exactly full)
    for op in ("forward", "forward_stash", "backward", "dispatch", "combine"):
        yield _k2(op, 2, tokens="full", routing="one_rank", layout="static", quick=(op == "forward_stash"))
    yield Case("forward", 4, 8, 16, tokens="full", routing="repeated", layout="static")
    # forced duplicate experts in one token
    for op in ("forward", "forward_stash", "backward", "dispatch", "combine", "dispatch_backward"):
        yield _k2(op, 2, routing="repeated", quick=(op in ("dispatch_backward",)))
    yield _k2("nan_isolation", 4, routing="repeated", output_format="mxfp8", combine_format="mxfp8")


#: The operations that run on good inputs (not bad_input, nan_isolation, formats).
RUN_OPS = ("forward", "forward_stash", "backward", "dispatch", "combine", "dispatch_backward", "combine_backward")


def _boundary_cases() -> Iterable[Case]:
    """Every limit of the spec met exactly, in every operation (one step past it is a
    bad input): ``recv_capacity`` equal to the aligned rows of the plan (id
    ``cap_exact``); T = ``max_tokens_per_rank`` on every rank in both layouts; the
    largest and smallest expert ids (routing ``id_edges``: slot 0 of every token is
    expert num_experts - 1, slot 1 expert 0, about a third of the other slots -1);
    extents that are exactly a block multiple (hidden 48 and intermediate 48 with
    nvfp4, 32 with mxfp8); FC1 outputs on the clamp edges (values ``clamp_edges``:
    one-hot activations make FC1 exact, and the gate and up values sit at +-L, at
    their float32 and bf16 neighbours, and beyond)."""
    for op in RUN_OPS:
        yield _k2(op, 2, layout="static", capacity="exact", routing="skewed", quick=(op in ("forward", "backward")))
        yield Case(op, 3, 3, 9, layout="static", capacity="exact", routing="repeated", tokens="uneven")
        for layout in ("dynamic", "static"):
            yield _k2(op, 2, layout=layout, tokens="full")
        yield _k2(op, 2, routing="id_edges", quick=(op == "dispatch"))
        yield Case(op, 4, 3, 12, routing="id_edges", tokens="uneven", layout="static", index_format="int64")
    for op in ("forward", "forward_stash"):
        yield _k2(op, 2, hidden=48, intermediate=48, output_format="nvfp4", combine_format="nvfp4",
                  intermediate_format="nvfp4", input_format="nvfp4", weight_format="nvfp4")
        yield _k2(op, 2, hidden=32, intermediate=32, output_format="mxfp8", combine_format="mxfp8",
                  intermediate_format="mxfp8", input_format="mxfp8", weight_format="mxfp8")
    yield _k2("combine", 2, hidden=48, output_format="nvfp4", combine_format="nvfp4")
    yield _k2("backward", 2, hidden=48, intermediate=48, intermediate_format="nvfp4", input_format="nvfp4",
              weight_format="nvfp4", clamp=True)
    for op in ("forward", "forward_stash", "backward"):
        for limit in (0.75, 0.7):
            for weights_in in ("fc1", "fc2"):
                yield _k2(op, 2, values="clamp_edges", clamp=True, clamp_limit=limit, weights_in=weights_in,
                          input_format="fp32", weight_format="fp32",
                          quick=(op == "backward" and limit == 0.75 and weights_in == "fc1"))
    yield _k2("nan_isolation", 2, values="clamp_edges", clamp=True, input_format="fp32", weight_format="fp32",
              routing="unused_mixed")
    # grad_activation sums a token's K route gradients in an unspecified order (spec section 9.2): eight
    # routes of large, cancelling terms, two of them to one expert, where slot order and any other differ
    yield Case("backward", 2, 8, 16, routing="repeated", values="large", tokens="full", clamp=True, clamp_limit=7.3)


def _tie_cases() -> Iterable[Case]:
    """Backward cases whose ``w * h`` and ``dc`` lie on bf16 rounding ties (values
    ``bf16_ties``, runner.py): the bf16-operand mode rounds there, and both
    neighbours of a tie must pass (the exact mode's twin is made by
    :func:`_both_backward_modes`)."""
    for n, k, e in ((1, 1, 2), (2, 2, 8), (3, 3, 9)):
        for weights_in in ("fc1", "fc2"):
            yield Case("backward", n, k, e, values="bf16_ties", weights_in=weights_in, input_format="fp32",
                       weight_format="fp32", backward_operand_format="bf16", quick=(n == 2 and weights_in == "fc1"))
    yield Case("backward", 2, 2, 8, values="bf16_ties", input_format="fp32", weight_format="fp32",
               backward_operand_format="bf16", cotangent="bf16", layout="static", tokens="full")


def _empty_cases() -> Iterable[Case]:
    """A rank with no token (rank 0) and ranks receiving no route (every route goes
    to rank 0), in every operation and every format at that point."""
    empty = dict(tokens="zero_rank", routing="one_rank")
    for n in (2, 3):
        yield _k2("forward", n, **empty)
        for op in ("forward_stash", "backward", "dispatch", "dispatch_backward", "combine_backward"):
            for layout in ("dynamic", "static"):
                yield _k2(op, n, layout=layout, quick=(n == 2 and layout == "static" and op == "backward"), **empty)
    for fmt in ("mxfp8", "nvfp4"):
        other = "nvfp4" if fmt == "mxfp8" else "mxfp8"
        yield _k2("forward", 2, output_format=fmt, combine_format=other, intermediate_format=fmt,
                  input_format=fmt, weight_format=other, quick=(fmt == "nvfp4"), **empty)
        yield _k2("forward", 3, output_format=other, combine_format=fmt, intermediate_format=other,
                  input_format=other, weight_format=fmt, **empty)
        yield _k2("forward_stash", 2, output_format=fmt, combine_format=fmt, intermediate_format=fmt,
                  input_format=fmt, weight_format=fmt, layout="static", **empty)
        yield _k2("backward", 2, input_format=fmt, weight_format=other, intermediate_format=fmt, clamp=True, **empty)
        yield _k2("dispatch", 2, input_format=fmt, **empty)
        for layout in ("dynamic", "static"):
            yield _k2("combine", 2, output_format=fmt, combine_format=other, layout=layout,
                      quick=(fmt == "mxfp8" and layout == "dynamic"), **empty)
            yield _k2("combine", 2, output_format=fmt, combine_format=fmt, layout=layout, **empty)
    yield _k2("combine", 2, **empty)
    yield _k2("forward", 2, intermediate_format="bf16", input_format="fp16", **empty)
    # every rank receiving no route at all, in every format
    for fmt in _FORMATS:
        yield _k2("forward", 3, routing="all_unused", output_format=fmt, combine_format=fmt,
                  intermediate_format=None if fmt == "bf16" else fmt, input_format="nvfp4")
        yield _k2("combine", 3, routing="all_unused", output_format=fmt, combine_format=fmt, layout="static")


def _realistic_cases() -> Iterable[Case]:
    """Sizes where fast kernels tile, unroll and count (full table only, a few per EP
    size, kept small enough for the float64 reference): hidden in the thousands,
    intermediate in the hundreds, experts with hundreds of rows, a rank receiving
    tens of thousands of rows (more than 2^15: a 16-bit counter overflows)."""
    yield Case("forward", 1, 3, 6, hidden=2048, intermediate=128, tokens="full", max_tokens=32,
               routing="skewed", output_format="mxfp8", input_format="mxfp8")
    yield Case("forward", 2, 2, 4, hidden=128, intermediate=256, tokens="full", max_tokens=160,
               routing="skewed", output_format="nvfp4", combine_format="mxfp8")  # expert 0: 320 rows
    yield Case("forward", 2, 5, 6, hidden=32, intermediate=16, tokens="full", max_tokens=3400,
               routing="one_rank", layout="static")  # rank 0 receives 34000 rows
    yield Case("forward", 3, 3, 9, hidden=1152, intermediate=192, tokens="full", max_tokens=16,
               routing="skewed", intermediate_format="nvfp4", clamp=True, clamp_limit=7.3, values="large",
               weights_in="fc2")
    yield Case("forward", 4, 2, 12, hidden=2048, intermediate=128, tokens="zero_full", max_tokens=16,
               routing="skewed", output_format="mxfp8", combine_format="nvfp4", input_format="nvfp4")
    yield Case("forward_stash", 2, 2, 4, hidden=256, intermediate=256, tokens="full", max_tokens=128,
               routing="skewed", layout="static")
    yield Case("backward", 2, 2, 4, hidden=1024, intermediate=128, tokens="full", max_tokens=32,
               routing="skewed", clamp=True, clamp_limit=0.7)
    yield Case("backward", 4, 3, 12, hidden=640, intermediate=128, tokens="full", max_tokens=16,
               routing="repeated", weights_in="fc2", input_format="mxfp8")
    yield Case("dispatch", 3, 8, 24, hidden=256, intermediate=64, tokens="full", max_tokens=2048,
               routing="one_rank", layout="static", input_format="nvfp4")  # rank 0 receives 49152 rows
    yield Case("combine", 3, 8, 24, hidden=64, intermediate=32, tokens="full", max_tokens=1400,
               routing="one_rank", output_format="mxfp8", combine_format="nvfp4")  # 33600 rows on rank 0
    yield Case("dispatch_backward", 2, 3, 6, hidden=2048, intermediate=128, tokens="full", max_tokens=128,
               routing="skewed", layout="static")
    yield Case("combine_backward", 4, 6, 36, hidden=1024, intermediate=128, tokens="full", max_tokens=128,
               routing="skewed")


def _grid_case(op: str, values: Dict[str, object], quick: bool) -> Case:
    """The case of one row of the pairwise covering array (axes.py)."""
    v = fill(values)
    mt = tokens_per_rank(v["rows"], v["local_experts"], v["num_topk"])  # type: ignore[arg-type]
    extra: Dict[str, object] = dict(tokens="even") if mt is None else dict(tokens="full", max_tokens=mt)
    if v["clamp"] is not None:
        extra.update(clamp=True, clamp_limit=v["clamp"])
    return Case(
        op, v["num_ranks"], v["num_topk"], v["num_ranks"] * v["local_experts"],  # type: ignore[operator]
        hidden=v["hidden"], intermediate=v["intermediate"], output_format=v["output_format"],
        combine_format=v["combine_format"], intermediate_format=v["intermediate_format"],
        input_format=v["input_format"], weight_format=v["weight_format"], routing=v["routing"],
        weights_in=v["weights_in"], layout=v["layout"], router_format=v["router_format"], values=v["values"],
        cotangent=v["cotangent"], index_format=v["index_format"], strided=v["strided"],
        backward_operand_format=v["backward_operand_format"], quick=quick, **extra,  # type: ignore[arg-type]
    )


def _grid_cases() -> Iterable[Case]:
    """The pairwise covering array of every operation's axes (axes.py), and the
    smaller one over the most kernel-relevant axes that ``--quick`` runs."""
    for quick in (False, True):
        for op, values in grid_rows(quick):
            yield _grid_case(op, values, quick)


def _both_backward_modes(cases: List[Case]) -> List[Case]:
    """Every backward case of the hand-written table also in the bf16-operand
    mode (``backward_operand_format='bf16'``, id ``bop_bf16``); the covering
    array has the mode as an axis."""
    out = []
    for c in cases:
        out.append(c)
        if c.op == "backward":
            out.append(replace(c, backward_operand_format="bf16" if c.backward_operand_format is None else None))
    return out


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
            *_both_backward_modes(
                [
                    *_forward_cases(),
                    *_stash_cases(),
                    *_backward_cases(),
                    *_layered_cases(),
                    *_bad_input_cases(),
                    *_nan_cases(),
                    *_wide_cases(),
                    *_empty_cases(),
                    *_realistic_cases(),
                    *_boundary_cases(),
                    *_tie_cases(),
                ]
            ),
            *_grid_cases(),
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
