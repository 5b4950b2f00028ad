"""Run one conformance case on a backend and judge it against the reference.

:func:`run_case` is the whole judgement; the pytest plugin and the reports are
thin layers over it. A case is *skipped* only when the backend declared the
needed feature unsupported (reason ``capability: ...``); anything else that
cannot run *fails*: a backend that raises, returns the wrong type, shape or
dtype, or computes outside the spec's budget.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import pickle
import queue as queue_module
import re
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import moe_ep_spec
from moe_ep_spec import (
    BlockScaledTensor,
    DispatchInputs,
    Launch,
    MoeEpBackend,
    MoeEpConfig,
    MoeFormat,
    RankInputs,
    Stash,
)
from moe_ep_spec.formats import BF16
from moe_ep_spec.inputs import random_world
from moe_ep_spec.launch import call_world
from moe_ep_spec.tolerance import ForwardBudget

from .cases import BAD_INPUTS, CONFIG_BAD, Case
from .checks import Check, _close, _exact_ints, _exact_tensor, _expect_array, _kind
from .format_cases import check_format_case

__all__ = ["Check", "CaseResult", "run_case", "run_case_isolated", "run_cases"]


@dataclass
class CaseResult:
    """The outcome of one case on one backend.

    Attributes:
        test_id: ``op[backend-case id]``.
        backend: the backend's name.
        case: the :class:`Case`.
        outcome: ``passed``, ``failed`` or ``skipped``.
        reason: the skip reason (``capability: ...``) or the first failure's message.
        ratio: the worst error / budget over all checks (0 when all are exact).
        checks: every :class:`Check`.
        duration_s: wall time of the case, reference included.
        tolerance_factor: the budget multiplier applied (1 unless overridden).

    :attr:`failures` are the checks that failed; :meth:`describe` is the report
    a failed test prints.
    """

    test_id: str
    backend: str
    case: Case
    outcome: str
    reason: str = ""
    ratio: float = 0.0
    checks: List[Check] = field(default_factory=list)
    duration_s: float = 0.0
    tolerance_factor: float = 1.0

    @property
    def failures(self) -> List[Check]:
        return [c for c in self.checks if not c.ok]

    def describe(self) -> str:
        """A multi-line failure report that makes sense on its own."""
        lines = [f"{self.test_id}: {self.outcome}"]
        if self.outcome == "failed":
            if not self.checks or all(c.ok for c in self.checks):
                lines.append(f"  {self.reason}")
            for c in self.failures:
                lines.append(f"  {c.message}")
        elif self.reason:
            lines.append(f"  {self.reason}")
        return "\n".join(lines)


_SITE_PACKAGES = re.compile(r"""[^\s"'(]*[/\\](?:site|dist)-packages[/\\]""")


def _short_paths(text: str) -> str:
    """File paths inside an installation (``.../site-packages/pkg/mod.py``) as
    ``pkg/mod.py``: where the packages are installed says nothing about a failure."""
    return _SITE_PACKAGES.sub("", text)


class _Fail(Exception):
    """A structural failure detected while running a case."""


# ----------------------------------------------------------------------------- helpers


def _output_checks(name: str, config: MoeEpConfig, got: Any, ref: Any, budget: ForwardBudget, factor: float) -> List[Check]:
    fmt = config.output_format
    if fmt is MoeFormat.BF16:
        wrong = _expect_array(name, got, BF16, ref.shape)
        if wrong is not None:
            return [wrong]
        return [_close(name, got, ref, budget.output, factor)]
    if not isinstance(got, BlockScaledTensor) or got.format is not fmt or got.shape != ref.shape or got.axis != 1:
        return [
            Check(name, False, float("inf"), float("inf"), f"{name}: expected {_kind(ref)}; got {_kind(got)}")
        ]
    checks = [_close(name, got, ref, budget.output, factor)]
    lo, hi = budget.scale_codes  # type: ignore[misc]
    codes = got.scale_codes()
    # E8M0 codes and the non-negative E4M3 codes of nvfp4 scales both order like their values
    outside = (codes < lo) | (codes > hi)
    if outside.any():
        first = tuple(int(i) for i in np.argwhere(outside)[0])
        checks.append(
            Check(
                f"{name} scale codes",
                False,
                float("inf"),
                float("inf"),
                f"{name} scale codes: {int(outside.sum())} block(s) outside the allowed range, first block {first}: "
                f"got {int(codes[first]):#04x}, allowed [{int(lo[first]):#04x}, {int(hi[first]):#04x}] "
                f"(reference {int(ref.scale_codes()[first]):#04x})",
            )
        )
    else:
        checks.append(Check(f"{name} scale codes", True))
    return checks


def _snapshot(obj: Any) -> Any:
    return copy.deepcopy(obj)


def _same_inputs(before: Any, after: Any) -> bool:
    """Whether the inputs are bit for bit what they were (nothing was modified)."""
    if isinstance(before, (list, tuple)):
        return len(before) == len(after) and all(_same_inputs(b, a) for b, a in zip(before, after))
    if isinstance(before, BlockScaledTensor):
        return _same_inputs(before.data, after.data) and _same_inputs(before.scale, after.scale)
    if isinstance(before, np.ndarray):
        return before.shape == after.shape and before.tobytes() == after.tobytes()
    if hasattr(before, "__dataclass_fields__"):
        return all(_same_inputs(getattr(before, f), getattr(after, f)) for f in before.__dataclass_fields__)
    return True


#: numpy dtypes of the plain encodings and cotangents.
_PLAIN_DTYPES = {"fp32": np.dtype(np.float32), "bf16": BF16, "fp16": np.dtype(np.float16)}

#: Factor of the ``large`` values: activations times 2^6 (exact in every encoding).
_LARGE = 64.0


def _strided(a: np.ndarray) -> np.ndarray:
    """The same values as a non-contiguous view (every other element of a wider array)."""
    if a.ndim == 0:
        return a
    wide = np.zeros(a.shape[:-1] + (2 * a.shape[-1],), dtype=a.dtype)
    wide[..., ::2] = a
    view = wide[..., ::2]
    if view.size > 1 and view.flags.c_contiguous:  # a last extent of 1: stride the first axis instead
        wide = np.zeros((2 * a.shape[0],) + a.shape[1:], dtype=a.dtype)
        wide[::2] = a
        view = wide[::2]
    return view


def _plain(case: Case, a: np.ndarray) -> np.ndarray:
    return _strided(a) if case.strided else a


def _strided_any(x: Any) -> Any:
    """A plain array, or a block-scaled tensor's codes and scales, as non-contiguous views."""
    if isinstance(x, BlockScaledTensor):
        return BlockScaledTensor(_strided(x.data), _strided(x.scale), x.format, x.shape, axis=x.axis)
    return _strided(x)


def _stash_arg(case: Case, stash: Sequence[Stash]) -> List[Stash]:
    """The stash as the backward gets it: non-contiguous arrays when the case is strided."""
    if not case.strided:
        return list(stash)
    return [Stash(_strided(s.fc1_c), _strided(s.route_metadata)) for s in stash]


#: Router weight of the ``bf16_ties`` values: with g = 32 (SiLU(32) = 32 in float32) and
#: bf16 numbers u = (1 + k 2^-7) 2^p (k odd), w * h = 48 u lies on a bf16 rounding tie.
_TIE_WEIGHT = 1.5


def _tie_values(rng: np.random.Generator, shape: Tuple[int, ...]) -> np.ndarray:
    """bf16 numbers (1 + k 2^-7) 2^p, k odd and below 42 (so that 1.5 (1 + k 2^-7)
    stays in [1, 2) with a ninth significant bit: a bf16 tie), p in [-3, 3], random
    signs; a quarter of them powers of two."""
    k = 2 * rng.integers(0, 21, size=shape) + 1
    p = rng.integers(-3, 4, size=shape)
    v = (1.0 + k * 2.0**-7) * np.exp2(p)
    v = np.where(rng.random(shape) < 0.25, np.exp2(p), v)
    return (v * np.where(rng.random(shape) < 0.5, -1.0, 1.0)).astype(np.float32)


def _tie_world(config: MoeEpConfig, act: Any, fc1: Any, fc2: Any, tw: Any,
               rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Inputs whose backward puts ``w * h`` and ``dc`` on bf16 rounding ties (values
    ``bf16_ties``): one-hot activations (FC1 exact), gate 32, up from
    :func:`_tie_values`, FC2 from :func:`_tie_values`, router weights 1.5; with the
    one-hot cotangent rows of :meth:`_Runner.cot_for` the up half of ``dc`` is
    48 * FC2 entry (a tie) and the gate half 1.5 * FC2 entry * u (a tie where u is
    a power of two)."""
    t, h = act.shape
    one_hot = np.zeros((t, h), np.float32)
    one_hot[np.arange(t), np.arange(t) % h] = 1.0
    i = config.intermediate
    w1 = np.empty(fc1.shape, np.float32)
    w1[..., :i] = 32.0
    w1[..., i:] = _tie_values(rng, fc1.shape[:-1] + (i,))
    w2 = _tie_values(rng, fc2.shape)
    weights = np.full(tw.shape, _TIE_WEIGHT, np.float32)
    return one_hot.astype(act.dtype), w1.astype(fc1.dtype), w2.astype(fc2.dtype), weights.astype(tw.dtype)


def _clamp_edge_values(limit: float) -> np.ndarray:
    """float32 values on and around the clamp edges +-L: L and -L, their float32
    and bf16 neighbours, half and twice L, and 0."""
    f = np.float32(limit)
    up, down = np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(0))
    b = f.astype(BF16).astype(np.float32)  # L in bf16 (L itself when L is a bf16 number)
    b_up = (b.astype(np.float64) * (1 + 2.0**-7)).astype(np.float32)
    b_down = (b.astype(np.float64) * (1 - 2.0**-8)).astype(np.float32)
    edges = np.array([f, up, down, b, b_up, b_down, 0.5 * f, 2 * f, np.float32(0)], np.float32)
    return np.concatenate([edges, -edges])


def _clamp_edge_world(config: MoeEpConfig, act: Any, fc1: Any, rng: np.random.Generator) -> Tuple[np.ndarray, np.ndarray]:
    """One-hot activations (token t is e_(t mod H)) and float32 FC1 weights made of
    clamp-edge values: FC1 is exact, so every gate and up value sits where the case
    put it."""
    t, h = act.shape
    one_hot = np.zeros((t, h), np.float32)
    one_hot[np.arange(t), np.arange(t) % h] = 1.0
    vals = _clamp_edge_values(config.gate_up_clamp or 1.0)
    w1 = vals[rng.integers(0, len(vals), size=fc1.shape)].astype(np.float32)
    return one_hot.astype(act.dtype), w1.astype(fc1.dtype)


def _scaled(t: Any, factor: float) -> Any:
    """``t`` times a power of two, in its own encoding (exact)."""
    if isinstance(t, BlockScaledTensor):
        return moe_ep_spec.quantize(moe_ep_spec.dequantize(t, np.float64) * factor, t.format, axis=t.axis)
    return (np.asarray(t, np.float64) * factor).astype(t.dtype)


def _world(case: Case, config: MoeEpConfig, tokens: Optional[List[int]] = None) -> List[RankInputs]:
    """The case's inputs: :func:`random_world`, then the axes it does not make
    (float16 encodings and router weights, int64 ids, forced duplicate experts,
    large values, non-contiguous arrays)."""
    def gen(name: str) -> str:
        return "fp32" if name == "fp16" else name

    world = random_world(
        config,
        num_tokens=tokens if tokens is not None else case.tokens_per_rank(),
        routing="uniform" if case.routing in ("repeated", "id_edges") else case.routing,
        input_format=gen(case.input_format),
        weight_format=gen(case.weight_format),
        seed=case.seed,
        topk_weights_format=gen(case.router_format),
    )
    out = []
    for w in world:
        act, fc1, fc2, idx, tw = w.activation, w.fc1_weight, w.fc2_weight, w.topk_idx, w.topk_weights
        if case.values == "large":
            act = _scaled(act, _LARGE)
        if case.values == "clamp_edges":
            act, fc1 = _clamp_edge_world(config, act, fc1, np.random.default_rng(case.seed + 2))
        if case.values == "bf16_ties":
            act, fc1, fc2, tw = _tie_world(config, act, fc1, fc2, tw, np.random.default_rng(case.seed + 3))
        if case.input_format == "fp16":
            act = act.astype(np.float16)
        if case.weight_format == "fp16":
            fc1, fc2 = fc1.astype(np.float16), fc2.astype(np.float16)
        if case.router_format == "fp16":
            tw = tw.astype(np.float16)
        if case.routing == "repeated" and config.num_topk > 1:
            idx = idx.copy()
            idx[:, -1] = idx[:, 0]  # the last slot repeats slot 0's expert: two routes, one expert
        if case.routing == "id_edges" and idx.shape[0]:
            idx = idx.copy()
            idx[:, 0] = config.num_experts - 1  # the largest id
            if config.num_topk > 1:
                idx[:, 1] = 0  # the smallest
            idx[::3, -1] = -1  # and the unused slot
        idx = idx.astype(np.int64 if case.index_format == "int64" else np.int32)
        if case.strided:  # every array, the codes and scales of block-scaled tensors included
            act, fc1, fc2 = (_strided_any(x) for x in (act, fc1, fc2))
            idx, tw = _strided(idx), _strided(tw)
        out.append(RankInputs(act, fc1, fc2, idx, tw))
    return out


def _dispatch_world(world: Sequence[RankInputs]) -> List[DispatchInputs]:
    return [DispatchInputs(w.activation, w.topk_idx, w.topk_weights) for w in world]


def _cotangent(rng: np.random.Generator, shape: tuple, poison_rows: Optional[np.ndarray] = None) -> np.ndarray:
    """Random float32 with NaN in the rows a conforming backend never reads."""
    g = rng.standard_normal(shape).astype(np.float32)
    if poison_rows is not None and poison_rows.any():
        g[poison_rows] = np.nan
    return g


def _expert_factors(global_expert: np.ndarray, slot: np.ndarray, num_topk: int) -> Tuple[np.ndarray, np.ndarray]:
    """Per route: a factor of its global expert and an offset of its (expert, slot),
    distinct for neighbouring experts and slots."""
    a = 1.0 + ((global_expert * 7 + 3) % 16) / 8.0  # 1 .. 2.875 in steps of 1/8
    b = ((global_expert * 5 + slot * 3 + 1) % 11 - 5) / 4.0 + slot / (4.0 * num_topk)
    return a, b


def _expert_rows(config: MoeEpConfig, dispatched: Sequence[Any]) -> List[np.ndarray]:
    """The suite's own "expert MLP" between dispatch and combine, applied to the
    spec's dispatch (the reference's): row i becomes ``x_i * a[g] + b[g, k]`` for
    its global expert g and source slot k, float32, padding rows NaN. A backend
    that returns a row to the wrong token or slot, or reads a row of another
    expert, cannot pass by luck of equal values: rows differ by expert and slot."""
    out = []
    for d in dispatched:
        meta = d.handle.route_metadata
        valid = meta[:, 0] >= 0
        x = moe_ep_spec.dequantize(d.tokens, np.float64) if isinstance(d.tokens, BlockScaledTensor) else np.asarray(d.tokens, np.float64)
        g = d.handle.rank * config.num_local_experts + meta[:, 0].astype(np.int64)
        a, b = _expert_factors(g, meta[:, 3].astype(np.int64), config.num_topk)
        y = (x * a[:, None] + b[:, None]).astype(np.float32)
        y[~valid] = np.nan
        out.append(y)
    return out


def _edge_rows(rng: np.random.Generator, rows: np.ndarray, padding: np.ndarray, fmt: MoeFormat) -> np.ndarray:
    """Expert outputs on the formats' hard spots: every mxfp8 block's maximum a few
    float32 ulps above ``448 * 2^k`` (where a float32 ``log2`` picks the wrong
    scale) with some elements in the E4M3 subnormal range (where that wrong
    scale shows); every nvfp4 block's maximum ``6 * s`` with its other elements
    exact E2M1 midpoints times ``s`` (where a rounded reciprocal breaks ties)."""
    out = np.array(rows, dtype=np.float32, copy=True)
    n_rows, hidden = out.shape
    if fmt is MoeFormat.MXFP8:
        for r in range(n_rows):
            for b in range(0, hidden, 32):
                k = int(rng.integers(-8, 8))
                top = np.float32(448.0 * 2.0**k)
                for _ in range(int(rng.integers(0, 6))):
                    top = np.nextafter(top, np.float32(np.inf))
                block = rng.uniform(-1, 1, 32) * 448.0 * 2.0**k
                # E4M3-subnormal elements: they round differently when the scale is one binade off
                block[:4] = np.array([1.25, 1.75, 2.5, 3.5]) * 2.0 ** (k - 9) * np.where(rng.random(4) < 0.5, -1, 1)
                block = block[rng.permutation(32)]
                block[int(rng.integers(0, 32))] = top * (1 if rng.random() < 0.5 else -1)
                out[r, b : b + 32] = block.astype(np.float32)
    elif fmt is MoeFormat.NVFP4:
        ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
        scales = np.array([0.375, 0.75, 1.5, 3.0, 0.5, 1.25, 2.5], dtype=np.float32)  # E4M3 values, odd mantissas too
        for r in range(n_rows):
            for b in range(0, hidden, 16):
                s = scales[int(rng.integers(0, len(scales)))] * np.float32(2.0 ** int(rng.integers(-4, 4)))
                vals = ties[rng.integers(0, len(ties), 16)] * s * np.where(rng.random(16) < 0.5, -1, 1)
                vals[int(rng.integers(0, 16))] = 6.0 * s
                out[r, b : b + 16] = vals.astype(np.float32)
    if padding.any():
        out[padding] = np.nan
    return out


# ----------------------------------------------------------------------------- operations


class _Runner:
    def __init__(
        self, backend: MoeEpBackend, reference: MoeEpBackend, case: Case, timeout_s: float, factor: float, device: str
    ):
        self.backend = backend
        self.devices = _devices(device, case.num_ranks)
        self.reference = reference
        self.case = case
        self.config = case.config()
        if getattr(case, "capacity", None) == "exact":  # format cases have no capacity axis
            self.config = self.config.replace(recv_capacity=self.exact_capacity(self.config))
        self.timeout_s = timeout_s
        self.factor = factor
        self.rng = np.random.default_rng(case.seed + 1)

    def exact_capacity(self, config: MoeEpConfig) -> int:
        """The smallest ``recv_capacity`` the case's plan fits: on the fullest rank,
        the sum over its local experts of the routes rounded up to the alignment."""
        world = _world(self.case, config)
        dynamic = config.replace(recv_capacity=None, expert_alignment=1)
        a = config.expert_alignment
        rows = [int(sum(-(-int(n) // a) * a for n in d.tokens_per_expert))
                for d in self.reference.dispatch(dynamic, _dispatch_world(world))]
        return max(max(rows), 1)

    def cot(self, shape: tuple, poison_rows: Optional[np.ndarray] = None) -> np.ndarray:
        """A cotangent in the case's dtype (NaN in ``poison_rows``), non-contiguous when the case is."""
        g = _cotangent(self.rng, shape, poison_rows).astype(_PLAIN_DTYPES[self.case.cotangent])
        return _plain(self.case, g)

    def one_hot_cot(self, num_tokens: int, hidden: int) -> np.ndarray:
        """Cotangent rows e_(t mod H) in the case's dtype (values ``bf16_ties``)."""
        g = np.zeros((num_tokens, hidden), np.float32)
        g[np.arange(num_tokens), np.arange(num_tokens) % hidden] = 1.0
        return _plain(self.case, g.astype(_PLAIN_DTYPES[self.case.cotangent]))

    def rows(self, dispatched: Sequence[Any]) -> List[np.ndarray]:
        """The expert outputs (or token cotangents) of the dispatched rows: the
        expert-specific transform of :func:`_expert_rows`, in the case's dtype."""
        return [_plain(self.case, y.astype(_PLAIN_DTYPES[self.case.cotangent])) for y in _expert_rows(self.config, dispatched)]

    def call(self, op: str, *args: Any, config: Optional[MoeEpConfig] = None) -> List[Any]:
        return call_world(
            self.backend, op, config or self.config, *args, timeout_s=self.timeout_s, devices=self.devices
        )

    def call_unchanged(self, op: str, *args: Any, config: Optional[MoeEpConfig] = None) -> List[Any]:
        """Call the backend; fail the case if it modified its inputs or did not
        return one result per rank."""
        before = _snapshot(args)
        out = self.call(op, *args, config=config)
        if not _same_inputs(before, args):
            raise _Fail(f"{op} modified its inputs; the spec forbids changing any input")
        if len(out) != self.config.num_ranks:
            raise _Fail(f"{op} returned {len(out)} results; expected one per rank ({self.config.num_ranks})")
        return out

    # -- fused -------------------------------------------------------------

    def forward(self, stash: bool) -> List[Check]:
        cfg, ref_b = self.config, self.reference
        world = _world(self.case, cfg)
        got = self.call_unchanged("forward", world)
        ref, budgets = ref_b.forward_and_budget(cfg, world)  # type: ignore[attr-defined]
        checks: List[Check] = []
        for r in range(cfg.num_ranks):
            checks += _output_checks(f"rank {r} output", cfg, got[r].output, ref[r].output, budgets[r], self.factor)
            if stash:
                wrong = _expect_array(f"rank {r} fc1_c", got[r].fc1_c, BF16, ref[r].fc1_c.shape)
                checks.append(wrong or _close(f"rank {r} fc1_c", got[r].fc1_c, ref[r].fc1_c, budgets[r].fc1_c, self.factor))
                checks.append(
                    _exact_ints(f"rank {r} route_metadata", got[r].route_metadata, ref[r].route_metadata, np.int32)
                )
            elif got[r].fc1_c is not None or got[r].route_metadata is not None:
                checks.append(Check(f"rank {r} stash", False, float("inf"), 0.0,
                                    f"rank {r}: fc1_c and route_metadata must be None without generate_c"))
        return checks

    def backward(self) -> List[Check]:
        cfg, ref_b = self.config, self.reference
        world = _world(self.case, cfg)
        stash = _stash_arg(self.case, [f.stash for f in ref_b.forward(cfg, world)])
        grads = [self.cot((w.topk_idx.shape[0], cfg.hidden)) for w in world]
        if self.case.values == "bf16_ties":  # one-hot rows: dY W2^T is a column of FC2
            grads = [self.one_hot_cot(w.topk_idx.shape[0], cfg.hidden) for w in world]
        got = self.call_unchanged("backward", world, grads, stash)
        ref, budgets = ref_b.backward_and_budget(cfg, world, grads, stash)  # type: ignore[attr-defined]
        checks = []
        for r in range(cfg.num_ranks):
            for name in ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"):
                want = getattr(ref[r], name)
                wrong = _expect_array(f"rank {r} {name}", getattr(got[r], name, None), np.float32, want.shape)
                checks.append(wrong or _close(f"rank {r} {name}", getattr(got[r], name), want, getattr(budgets[r], name), self.factor))
        return checks

    def nan_isolation(self) -> List[Check]:
        """NaN/Inf in one token's activation (and NaN router weights in unused
        slots) must stay in that token: forward outputs, and with the backward
        a NaN cotangent, leave every other token finite and within budget."""
        cfg = self.config
        world = _world(self.case, cfg)
        last = cfg.num_ranks - 1
        poisoned: Dict[int, List[int]] = {0: [1]}
        poisoned.setdefault(last, []).append(2)
        new_world = []
        for r, w in enumerate(world):
            act = w.activation
            if isinstance(act, BlockScaledTensor):  # re-encode: the block holding the NaN/inf becomes a NaN block
                dec = moe_ep_spec.dequantize(act, np.float64)
                for t in poisoned.get(r, []):
                    dec[t, 3] = np.nan if t == 1 else np.inf
                act = moe_ep_spec.quantize(dec, act.format, axis=1)
            else:
                act = np.array(act, copy=True)
                for t in poisoned.get(r, []):
                    act[t, 3] = np.nan if t == 1 else np.inf
                act = _plain(self.case, act)
            weights = np.array(w.topk_weights, copy=True)
            weights[w.topk_idx < 0] = np.nan  # never read: -1 slots contribute exactly zero
            new_world.append(RankInputs(act, w.fc1_weight, w.fc2_weight, w.topk_idx, _plain(self.case, weights)))
        got = self.call_unchanged("forward", new_world)
        ref, budgets = self.reference.forward_and_budget(cfg, new_world)  # type: ignore[attr-defined]
        checks = []
        for r in range(cfg.num_ranks):
            keep = np.ones(new_world[r].topk_idx.shape[0], dtype=bool)
            keep[poisoned.get(r, [])] = False
            checks += self._clean_rows(f"rank {r} output", got[r].output, ref[r].output, budgets[r].output, keep)
        if self.backend.capabilities.unsupported(cfg.replace(generate_c=True), "backward") is None:
            cfg_c = cfg.replace(generate_c=True)
            clean_world = [RankInputs(w.activation, w.fc1_weight, w.fc2_weight, w.topk_idx, nw.topk_weights)
                           for w, nw in zip(world, new_world)]
            stash = _stash_arg(self.case, [f.stash for f in self.reference.forward(cfg_c, clean_world)])
            grads = []
            for r, w in enumerate(clean_world):
                g = _cotangent(self.rng, (w.topk_idx.shape[0], cfg.hidden))
                for t in poisoned.get(r, []):
                    g[t, 5] = np.nan
                grads.append(_plain(self.case, g.astype(_PLAIN_DTYPES[self.case.cotangent])))
            got_b = self.call_unchanged("backward", clean_world, grads, stash, config=cfg_c)
            ref_b, bud_b = self.reference.backward_and_budget(cfg_c, clean_world, grads, stash)  # type: ignore[attr-defined]
            for r in range(cfg.num_ranks):
                keep = np.ones(clean_world[r].topk_idx.shape[0], dtype=bool)
                keep[poisoned.get(r, [])] = False
                for name in ("grad_activation", "grad_topk_weights"):
                    checks += self._clean_rows(
                        f"rank {r} {name}", getattr(got_b[r], name), getattr(ref_b[r], name), getattr(bud_b[r], name), keep
                    )
        return checks

    def _clean_rows(self, name: str, got: Any, ref: Any, budget: np.ndarray, keep: np.ndarray) -> List[Check]:
        """The rows of the tokens that were not poisoned: finite and within budget."""
        if isinstance(ref, BlockScaledTensor) and not isinstance(got, BlockScaledTensor):
            return [Check(name, False, float("inf"), 0.0, f"{name}: expected {_kind(ref)}; got {_kind(got)}")]
        g_dec = moe_ep_spec.dequantize(got, np.float64) if isinstance(got, BlockScaledTensor) else np.asarray(got, np.float64)
        r_dec = moe_ep_spec.dequantize(ref, np.float64) if isinstance(ref, BlockScaledTensor) else np.asarray(ref, np.float64)
        if g_dec.shape != r_dec.shape:
            return [Check(name, False, float("inf"), 0.0, f"{name}: shape {g_dec.shape}, expected {r_dec.shape}")]
        axes = tuple(range(1, g_dec.ndim))
        leaked = ~np.isfinite(g_dec).all(axis=axes) & keep
        g_bad, r_bad = g_dec[~keep], r_dec[~keep]
        scrubbed = ~np.isfinite(r_bad) & np.isfinite(g_bad)
        checks = [
            Check(
                f"{name} poisoned tokens",
                not scrubbed.any(),
                float("inf") if scrubbed.any() else 0.0,
                0.0,
                f"{name}: {int(scrubbed.sum())} element(s) of the poisoned tokens are finite where the reference is "
                f"NaN/inf (a NaN must propagate, not be replaced)" if scrubbed.any() else "",
            ),
            Check(
                f"{name} clean tokens finite",
                not leaked.any(),
                float("inf") if leaked.any() else 0.0,
                0.0,
                f"{name}: a NaN/Inf of another token reached tokens {np.nonzero(leaked)[0].tolist()} "
                f"(it must stay in its own token)" if leaked.any() else "",
            )
        ]
        checks.append(_close(f"{name} clean tokens", g_dec[keep], r_dec[keep], np.asarray(budget)[keep], self.factor))
        return checks

    # -- layered -----------------------------------------------------------

    def _dispatch_both(self) -> tuple:
        cfg = self.config
        world = _world(self.case, cfg)
        dworld = _dispatch_world(world)
        got = self.call_unchanged("dispatch", dworld)
        ref = self.reference.dispatch(cfg, dworld)
        for r in range(cfg.num_ranks):
            g_rows = getattr(getattr(got[r], "handle", None), "num_recv_rows", None)
            if g_rows != ref[r].handle.num_recv_rows:
                raise _Fail(
                    f"rank {r}: dispatch made {g_rows} received rows; the spec's plan has {ref[r].handle.num_recv_rows} "
                    f"(run the dispatch cases first)"
                )
        return world, got, ref

    def dispatch(self) -> List[Check]:
        _, got, ref = self._dispatch_both()
        checks = []
        for r, (g, w) in enumerate(zip(got, ref)):
            checks.append(_exact_tensor(f"rank {r} tokens", g.tokens, w.tokens))
            checks.append(_exact_tensor(f"rank {r} topk_weights", g.topk_weights, w.topk_weights))
            checks.append(_exact_ints(f"rank {r} route_metadata", g.route_metadata, w.route_metadata, np.int32))
            checks.append(_exact_ints(f"rank {r} tokens_per_expert", g.tokens_per_expert, w.tokens_per_expert, np.int64))
            checks.append(_exact_ints(f"rank {r} expert_offsets", g.expert_offsets, w.expert_offsets, np.int64))
        return checks

    def combine(self) -> List[Check]:
        cfg = self.config
        _, got_d, ref_d = self._dispatch_both()
        if self.case.values == "edges":
            expert_out = [
                _cotangent(self.rng, (d.handle.num_recv_rows, cfg.hidden), ~d.handle.valid_rows) for d in ref_d
            ]
            expert_out = [_edge_rows(self.rng, y, ~d.handle.valid_rows, cfg.combine_format) for y, d in zip(expert_out, ref_d)]
        else:  # the expert-specific transform of the dispatched rows: a misrouted row cannot match by luck
            expert_out = self.rows(ref_d)
        got = self.call_unchanged("combine", [d.handle for d in got_d], expert_out)
        ref_handles = [d.handle for d in ref_d]
        ref = self.reference.combine(cfg, ref_handles, expert_out)
        budgets = self.reference.combine_budget(cfg, ref_handles, expert_out)  # type: ignore[attr-defined]
        checks = []
        for r in range(cfg.num_ranks):
            checks += _output_checks(f"rank {r} output", cfg, got[r], ref[r], budgets[r], self.factor)
        return checks

    def dispatch_backward(self) -> List[Check]:
        cfg = self.config
        _, got_d, ref_d = self._dispatch_both()
        g_tok = self.rows(ref_d)  # expert- and slot-specific rows
        g_w = [self.cot((d.handle.num_recv_rows,), ~d.handle.valid_rows) for d in ref_d]
        got = self.call_unchanged("dispatch_backward", [d.handle for d in got_d], g_tok, g_w)
        ref_handles = [d.handle for d in ref_d]
        ref = self.reference.dispatch_backward(cfg, ref_handles, g_tok, g_w)
        budgets = self.reference.dispatch_backward_budget(cfg, ref_handles, g_tok, g_w)  # type: ignore[attr-defined]
        checks = []
        for r in range(cfg.num_ranks):
            for name in ("grad_tokens", "grad_topk_weights"):
                want = getattr(ref[r], name)
                wrong = _expect_array(f"rank {r} {name}", getattr(got[r], name, None), np.float32, want.shape)
                checks.append(wrong or _close(f"rank {r} {name}", getattr(got[r], name), want, getattr(budgets[r], name), self.factor))
        return checks

    def combine_backward(self) -> List[Check]:
        cfg = self.config
        world, got_d, ref_d = self._dispatch_both()
        grads = [self.cot((w.topk_idx.shape[0], cfg.hidden)) for w in world]
        got = self.call_unchanged("combine_backward", [d.handle for d in got_d], grads)
        ref = self.reference.combine_backward(cfg, [d.handle for d in ref_d], grads)
        checks = []
        for r in range(cfg.num_ranks):
            checks.append(_exact_tensor(f"rank {r} grad_expert_out", got[r], ref[r]))
        return checks

    # -- bad input ---------------------------------------------------------

    def bad_input(self) -> List[Check]:
        bad = self.case.bad or ""
        op, error_name = BAD_INPUTS[bad]
        expected = getattr(moe_ep_spec, error_name)
        cfg = self.config
        if op == "config":
            fields = dict(CONFIG_BAD[bad])
            try:
                MoeEpConfig(**{**dict(num_experts=cfg.num_experts, hidden=cfg.hidden, intermediate=cfg.intermediate,
                                      num_topk=cfg.num_topk, num_ranks=cfg.num_ranks), **fields})
            except expected as exc:
                return [Check("config rejected", True, message=str(exc))]
            shown = ", ".join(f"{k}={v!r}" for k, v in fields.items())
            return [Check("config rejected", False, float("inf"), 0.0, f"MoeEpConfig({shown}) was accepted")]
        config, args = self._bad_call(bad, op)
        last = cfg.num_ranks - 1
        before = _snapshot(args)
        try:
            call_world(self.backend, op, config, *args, timeout_s=self.timeout_s, devices=self.devices)
        except expected as exc:
            checks = [Check(f"raises {error_name}", True, message=f"{type(exc).__name__}: {exc}")]
            if not str(exc).strip():
                checks.append(Check("error message", False, float("inf"), 0.0, f"{error_name} raised with an empty message"))
        except Exception as exc:  # noqa: BLE001 - the wrong error is a failure, not a crash of the suite
            checks = [
                Check(
                    f"raises {error_name}",
                    False,
                    float("inf"),
                    0.0,
                    f"bad input '{bad}' to {op} on rank {last}: expected moe_ep_spec.{error_name}; got "
                    f"{type(exc).__module__}.{type(exc).__name__}: {exc}",
                )
            ]
        else:
            checks = [
                Check(f"raises {error_name}", False, float("inf"), 0.0,
                      f"bad input '{bad}' to {op} on rank {last} was accepted; expected moe_ep_spec.{error_name}")
            ]
        if not _same_inputs(before, args):
            checks.append(Check("inputs unchanged", False, float("inf"), 0.0, f"the rejected {op} modified its inputs"))
        return checks

    def _bad_call(self, bad: str, op: str) -> Tuple[MoeEpConfig, List[Any]]:
        """The configuration and arguments of the bad call: the case's good
        inputs with one thing broken on the last rank (or in the world)."""
        cfg = self.config
        last = cfg.num_ranks - 1
        kind = bad
        for prefix in ("dispatch_backward_", "combine_backward_", "backward_", "combine_", "dispatch_"):
            if kind.startswith(prefix) and op == prefix[:-1]:
                kind = kind[len(prefix):]
                break
        if op == "backward":
            cfg = cfg.replace(generate_c=True)
        tokens = self.case.tokens_per_rank()
        if kind == "too_many_tokens":
            tokens[last] = cfg.max_tokens_per_rank + 1  # type: ignore[operator]
        world = _world(self.case, cfg, tokens)
        config = cfg
        if kind.endswith("recv_capacity_overflow"):
            config = cfg.replace(recv_capacity=cfg.expert_alignment)
        elif kind.endswith("recv_capacity_short"):  # one aligned row fewer than the plan needs
            exact = self.exact_capacity(cfg)
            if exact <= cfg.expert_alignment:
                raise _Fail(f"case construction: the plan needs {exact} rows, no room for a capacity one aligned "
                            f"row short (a conformance-suite bug, not the backend's)")
            config = cfg.replace(recv_capacity=exact - cfg.expert_alignment)
        if op in ("combine", "dispatch_backward", "combine_backward"):
            return config, self._bad_layered(kind, op, world)
        stash: List[Any] = []
        if op == "backward":
            if kind == "too_many_tokens":  # the stash of the over-long world, from a config without the bound
                stash = [f.stash for f in self.reference.forward(cfg.replace(max_tokens_per_rank=None), world)]
            elif kind.endswith("recv_capacity_short"):  # the stash of the exact capacity: the plan's rows, not C
                exact = cfg.replace(recv_capacity=config.recv_capacity + cfg.expert_alignment)
                stash = [f.stash for f in self.reference.forward(exact, _world(self.case, cfg))]
            elif kind.endswith("recv_capacity_overflow"):  # rows as the small capacity has them
                stash = [Stash(np.zeros((config.recv_capacity, 2 * cfg.intermediate), BF16),
                               np.full((config.recv_capacity, 4), -1, np.int32)) for _ in world]
            else:
                stash = [f.stash for f in self.reference.forward(cfg, world)]
        w = world[last]
        act, fc1, fc2, idx, weights = w.activation, w.fc1_weight, w.fc2_weight, np.array(w.topk_idx), w.topk_weights
        if kind in ("activation_shape", "tokens_shape"):
            act = np.zeros((act.shape[0], cfg.hidden + 1), dtype=act.dtype)
        elif kind in ("activation_dtype", "tokens_dtype"):
            act = np.asarray(act, dtype=np.float64)
        elif kind in ("activation_wrong_axis", "tokens_wrong_axis"):
            act = moe_ep_spec.quantize(moe_ep_spec.dequantize(act, np.float64), act.format, axis=0)
        elif kind == "mixed_encodings":
            act = np.asarray(act, dtype=np.float16)
        elif kind == "weight_shape":
            fc1 = np.zeros((cfg.num_local_experts + 1,) + tuple(fc1.shape[1:]), dtype=np.float32)
        elif kind == "fc2_weight_shape":
            fc2 = np.zeros((cfg.num_local_experts, cfg.intermediate + 1, cfg.hidden), dtype=np.float32)
        elif kind == "weight_dtype":
            fc1 = np.asarray(fc1, dtype=np.float64)
        elif kind == "fc2_weight_dtype":
            fc2 = np.asarray(fc2, dtype=np.int32)
        elif kind == "weight_block_scale_mismatch":
            fc1 = copy.deepcopy(fc1)
            object.__setattr__(fc1, "scale", fc1.scale[:, :-1])
        elif kind == "weight_wrong_axis":  # fc1 blocked along 2I instead of H
            fc1 = moe_ep_spec.quantize(moe_ep_spec.dequantize(fc1, np.float64), fc1.format, axis=2)
        elif kind == "topk_weights_shape":
            weights = np.ones((weights.shape[0], cfg.num_topk + 1), dtype=np.float32)
        elif kind == "topk_idx_shape":
            idx = np.zeros((idx.shape[0], cfg.num_topk + 1), dtype=idx.dtype)
        elif kind == "topk_idx_dtype":
            idx = idx.astype(np.float32)
        elif kind in ("topk_weights_dtype",):
            weights = np.ones(weights.shape, dtype=np.int32)
        elif kind == "topk_weights_float64":
            weights = np.asarray(weights, dtype=np.float64)
        elif kind == "expert_id_too_high":
            idx[0, 0] = cfg.num_experts
        elif kind == "expert_id_below_minus_one":
            idx[0, 0] = -2
        elif kind == "expert_id_wraps_int32":
            idx = idx.astype(np.int64)
            idx[0, 0] = 2**32 + 1  # int32(2^32 + 1) == 1, a valid expert: a narrowing cast hides it
        elif kind == "block_scale_mismatch":
            act = copy.deepcopy(act)
            object.__setattr__(act, "scale", act.scale[:, :-1])
        world[last] = RankInputs(act, fc1, fc2, idx, weights)
        if kind == "world_size" and op != "backward":
            world = world[:-1]
        if kind.endswith(("recv_capacity_overflow", "recv_capacity_short")):
            world = _world(self.case, cfg)
        if op == "dispatch":
            return config, [_dispatch_world(world)]
        if op == "forward":
            return config, [world]
        # backward
        grads = [self.cot((x.topk_idx.shape[0], cfg.hidden)) for x in world]
        if kind == "stash_mismatch":
            # the stash of another forward: the last rank's tokens in another order (same rows, other metadata)
            other = list(world)
            x = world[last]
            perm = np.roll(np.arange(x.topk_idx.shape[0]), 1)
            other[last] = RankInputs(x.activation, x.fc1_weight, x.fc2_weight, np.array(x.topk_idx)[perm],
                                     np.array(x.topk_weights)[perm])
            stash = [f.stash for f in self.reference.forward(cfg, other)]
        elif kind == "stash_rows":  # on every rank (see _bad_layered)
            stash = [Stash(np.concatenate([s.fc1_c, np.zeros((1, s.fc1_c.shape[1]), BF16)]),
                           np.concatenate([s.route_metadata, np.full((1, 4), -1, np.int32)])) for s in stash]
        elif kind == "stash_dtype":
            stash = [Stash(s.fc1_c.astype(np.float32), s.route_metadata) for s in stash]
        elif kind == "route_metadata_dtype":
            stash = [Stash(s.fc1_c, s.route_metadata.astype(np.int64)) for s in stash]
        elif kind == "route_metadata_shape":  # on every rank, as stash_rows
            stash = [Stash(s.fc1_c, np.ascontiguousarray(s.route_metadata[:, :3])) for s in stash]
        elif kind == "stash_width":
            stash = [Stash(np.concatenate([s.fc1_c, np.zeros((s.fc1_c.shape[0], 1), BF16)], axis=1), s.route_metadata)
                     for s in stash]
        elif kind == "grad_shape":
            grads[last] = np.zeros((grads[last].shape[0], cfg.hidden + 1), np.float32)
        elif kind == "grad_dtype":
            grads[last] = np.asarray(grads[last], np.float64)
        elif kind == "world_size":
            grads = grads[:-1]
        return config, [world, grads, stash]

    def _bad_layered(self, kind: str, op: str, world: List[RankInputs]) -> List[Any]:
        """Arguments of a bad combine / dispatch_backward / combine_backward: the
        backend's own handles of a good dispatch, one cotangent broken on every
        rank (a process-per-rank backend's other ranks would otherwise wait in
        the collective until the failed rank's world is torn down, seconds per
        case; the one-bad-rank path is tried by the forward, dispatch and
        backward kinds)."""
        cfg = self.config
        dispatched = self.call("dispatch", _dispatch_world(world))
        handles = [d.handle for d in dispatched]
        ref_d = self.reference.dispatch(cfg, _dispatch_world(world))
        if op == "combine_backward":
            grads = [self.cot((x.topk_idx.shape[0], cfg.hidden)) for x in world]
            if kind == "grad_shape":
                grads = [np.zeros((g.shape[0] + 1, cfg.hidden), np.float32) for g in grads]
            elif kind == "grad_dtype":
                grads = [np.asarray(g, np.float64) for g in grads]
            return [handles, grads]
        rows = self.rows(ref_d)
        if op == "combine":
            if kind == "expert_out_shape":
                rows = [np.zeros((y.shape[0] + 1, cfg.hidden), np.float32) for y in rows]
            elif kind == "expert_out_dtype":
                rows = [np.asarray(y, np.float64) for y in rows]
            elif kind == "world_size":
                rows = rows[:-1]
            return [handles, rows]
        g_w = [self.cot((d.handle.num_recv_rows,), ~d.handle.valid_rows) for d in ref_d]
        if kind == "grad_shape":
            rows = [np.zeros((y.shape[0], cfg.hidden + 1), np.float32) for y in rows]
        elif kind == "grad_dtype":
            g_w = [np.asarray(g, np.float64) for g in g_w]
        elif kind == "grad_tokens_dtype":
            rows = [np.asarray(y, np.float64) for y in rows]
        elif kind == "grad_weights_shape":
            g_w = [np.zeros((g.shape[0] + 1,), np.float32) for g in g_w]
        return [handles, rows, g_w]


_OPS: Dict[str, Callable[[_Runner], List[Check]]] = {
    "forward": lambda r: r.forward(stash=False),
    "forward_stash": lambda r: r.forward(stash=True),
    "backward": _Runner.backward,
    "dispatch": _Runner.dispatch,
    "combine": _Runner.combine,
    "dispatch_backward": _Runner.dispatch_backward,
    "combine_backward": _Runner.combine_backward,
    "bad_input": _Runner.bad_input,
    "nan_isolation": _Runner.nan_isolation,
}


def _formats(runner: _Runner) -> List[Check]:
    """Operation ``formats``: the code-for-code format cases (format_cases.py)."""
    return check_format_case(runner)


_OPS["formats"] = _formats


#: The values of ``device`` (the ``--device`` option).
DEVICES = ("cpu", "cuda", "cuda-shared")


def _devices(device: str, num_ranks: int) -> List[str]:
    """Per-rank devices: ``cpu`` for all, ``cuda`` -> ``cuda:0 .. cuda:n-1``, or
    ``cuda-shared`` -> ``cuda:0`` for every rank (one GPU shared by all ranks: for
    backends whose ranks can share a GPU, e.g. ``cuda-nccl`` with
    ``MOE_EP_CUDA_NCCL_EXCHANGE=device``; NCCL itself refuses it)."""
    if device == "cpu":
        return ["cpu"] * num_ranks
    if device == "cuda":
        return [f"cuda:{r}" for r in range(num_ranks)]
    if device == "cuda-shared":
        return ["cuda:0"] * num_ranks
    raise ValueError(f"device must be one of {DEVICES}; got {device!r}")


def run_case(
    backend: MoeEpBackend,
    case: Case,
    *,
    reference: Optional[MoeEpBackend] = None,
    timeout_s: float = 120.0,
    tolerance_factor: float = 1.0,
    device: str = "cpu",
) -> CaseResult:
    """Run ``case`` on ``backend``, judge it against the reference, never raise.

    ``device``: where a process-per-rank backend's ranks run (``cpu``; ``cuda``: rank
    r on ``cuda:r``; ``cuda-shared``: every rank on ``cuda:0``). World backends
    choose their own device."""
    reference = reference or moe_ep_spec.get_backend("reference")
    test_id = case.test_id(backend.name)
    start = time.perf_counter()
    result = CaseResult(test_id, backend.name, case, "passed", tolerance_factor=tolerance_factor)
    try:
        config = case.config()
        reason = backend.capabilities.unsupported(config, case.capability_op, case.input_formats())
        if reason is not None and case.op != "bad_input":
            result.outcome, result.reason = "skipped", reason
            return result
        if reason is not None and BAD_INPUTS[case.bad or ""][0] != "config":
            result.outcome, result.reason = "skipped", reason
            return result
        runner = _Runner(backend, reference, case, timeout_s, tolerance_factor, device)
        result.checks = _OPS[case.op](runner)
    except _Fail as exc:
        result.checks.append(Check("run", False, float("inf"), 0.0, str(exc)))
    except Exception as exc:  # noqa: BLE001 - a backend that cannot run the case fails it
        tb = traceback.format_exc(limit=-3)
        result.checks.append(
            Check("run", False, float("inf"), 0.0, _short_paths(f"backend raised {type(exc).__name__}: {exc}\n{tb}"))
        )
    finally:
        result.duration_s = time.perf_counter() - start
    failures = result.failures
    result.ratio = max((c.ratio for c in result.checks), default=0.0)
    if failures:
        result.outcome = "failed"
        result.reason = failures[0].message
    return result


#: Serialises the process starts of run_case_isolated (callers may use threads).
_SPAWN_LOCK = threading.Lock()

#: Seconds an isolated case's process gets to start (spawn, imports) on top of timeout_s.
_STARTUP_S = 10.0


def _isolated_main(backend: MoeEpBackend, case: Case, timeout_s: float, factor: float, device: str, out: Any) -> None:
    res = run_case(backend, case, timeout_s=timeout_s, tolerance_factor=factor, device=device)
    out.put(pickle.dumps(res))


def run_case_isolated(
    backend: MoeEpBackend, case: Case, *, timeout_s: float = 120.0, tolerance_factor: float = 1.0, device: str = "cpu"
) -> CaseResult:
    """:func:`run_case` in a fresh process, so that a world backend that hangs or
    crashes fails its case within ``timeout_s`` (plus 10 s for the process to
    start) instead of stopping the run.
    Process-per-rank backends already run in their own processes with a
    deadline: for them this is :func:`run_case`."""
    if backend.capabilities.launch is not Launch.WORLD:
        return run_case(backend, case, timeout_s=timeout_s, tolerance_factor=tolerance_factor, device=device)
    ctx = mp.get_context("spawn")
    with _SPAWN_LOCK:  # one process start at a time when callers run cases from several threads
        out = ctx.Queue()
        proc = ctx.Process(
            target=_isolated_main, args=(backend, case, timeout_s, tolerance_factor, device, out), daemon=True
        )
        start = time.perf_counter()
        proc.start()
    deadline = start + timeout_s + _STARTUP_S
    try:
        while True:
            try:
                return pickle.loads(out.get(timeout=0.1))
            except queue_module.Empty:
                if not proc.is_alive():  # a result may still be in the pipe
                    try:
                        return pickle.loads(out.get(timeout=1.0))
                    except queue_module.Empty:
                        pass
                    message = f"the case's process died with exit code {proc.exitcode} and no result"
                    break
                if time.perf_counter() > deadline:
                    message = f"no result within timeout_s = {timeout_s:g}: the backend hung"
                    break
        return CaseResult(
            case.test_id(backend.name),
            backend.name,
            case,
            "failed",
            reason=message,
            ratio=float("inf"),
            checks=[Check("run", False, float("inf"), 0.0, message)],
            duration_s=time.perf_counter() - start,
            tolerance_factor=tolerance_factor,
        )
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)


def run_cases(
    backend: MoeEpBackend,
    cases: Sequence[Case],
    *,
    timeout_s: float = 120.0,
    isolate: bool = False,
    device: str = "cpu",
) -> List[CaseResult]:
    """Run many cases (no pytest): the library entry point, used by the
    suite's own tests (mutants) and by scripts."""
    runner = run_case_isolated if isolate else run_case
    return [runner(backend, c, timeout_s=timeout_s, device=device) for c in cases]
