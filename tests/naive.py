"""An independent, per-token MoeEp implementation for the tests.

Written from the design brief (``design/moe-ep-v1.md`` sections 1, 3 and 4)
alone: it does not import ``moe_ep_reference``. It only uses the format
round trips of :mod:`moe_ep_spec.formats`, which have their own golden-vector
tests.

Everything is a plain loop over (source rank, token, slot) in float64:

* :func:`naive_forward` computes the fused forward (output, the training stash
  ``fc1_c`` and ``route_metadata``), or with ``exact=True`` the same math with
  every rounding point replaced by the identity (for finite differences).
* :func:`naive_plan` lays out every destination rank's received rows
  (expert-major order, static-layout padding).
* :func:`naive_backward` is section 3 of the brief, route by route.
* :func:`make_world` builds random world inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from moe_ep_spec.api import RankInputs
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.formats import BlockScaledTensor, dequantize, quantize, round_to_bf16, round_trip

__all__ = [
    "NaiveCapacityError",
    "NaivePlan",
    "NaiveRank",
    "NaiveGrads",
    "decode",
    "naive_plan",
    "naive_forward",
    "naive_backward",
    "route_forward",
    "make_world",
    "grid_world",
    "output_bits",
]


class NaiveCapacityError(Exception):
    """The aligned received rows of some rank exceed ``recv_capacity``."""


def decode(t) -> np.ndarray:
    """Exact float64 value of a plain float array or a BlockScaledTensor."""
    if isinstance(t, BlockScaledTensor):
        return dequantize(t, np.float64)
    return np.asarray(t).astype(np.float64)


def _weights(topk_weights, exact: bool) -> np.ndarray:
    w = np.asarray(topk_weights)
    if exact:
        return w.astype(np.float64)
    return w.astype(np.float32).astype(np.float64)  # "read as fp32"


# ------------------------------------------------------------------ routing


@dataclass
class NaivePlan:
    """One destination rank's received rows.

    Attributes:
        rows: ``[R, 4]`` int64 ``(local_expert, src_rank, src_token, src_slot)``,
            ``-1`` rows are padding (static layout).
        counts: ``[E_local]`` routes per local expert.
        offsets: ``[E_local + 1]`` slab starts (aligned in the static layout).
    """

    rows: np.ndarray
    counts: np.ndarray
    offsets: np.ndarray


def naive_plan(config: MoeEpConfig, topk_idx: Sequence[np.ndarray]) -> List[NaivePlan]:
    """Expert-major received rows of every rank, from the brief's rules."""
    el = config.num_local_experts
    routes: List[List[Tuple[int, int, int, int]]] = [[] for _ in range(config.num_ranks)]
    for src, idx in enumerate(topk_idx):
        idx = np.asarray(idx)
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e < 0:
                    continue
                routes[e // el].append((e % el, src, t, k))
    plans = []
    for d in range(config.num_ranks):
        rs = sorted(routes[d])
        counts = np.array([sum(1 for r in rs if r[0] == e) for e in range(el)], dtype=np.int64)
        if config.recv_capacity is None:
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            rows = np.array(rs, dtype=np.int64).reshape(len(rs), 4)
        else:
            a = config.expert_alignment
            offsets = [0]
            for e in range(el):
                offsets.append(offsets[-1] + int(math.ceil(counts[e] / a)) * a)
            offsets = np.array(offsets, dtype=np.int64)
            if offsets[-1] > config.recv_capacity:
                raise NaiveCapacityError(f"rank {d}: {int(offsets[-1])} aligned rows > {config.recv_capacity}")
            rows = np.full((config.recv_capacity, 4), -1, dtype=np.int64)
            for e in range(el):
                mine = [r for r in rs if r[0] == e]
                for j, r in enumerate(mine):
                    rows[offsets[e] + j] = r
        plans.append(NaivePlan(rows=rows, counts=counts, offsets=offsets))
    return plans


# ------------------------------------------------------------------ forward


def _silu(g: np.ndarray) -> np.ndarray:
    return g * (1.0 / (1.0 + np.exp(-g)))


def route_forward(
    config: MoeEpConfig,
    x: np.ndarray,
    w: float,
    w1: np.ndarray,
    w2: np.ndarray,
    exact: bool = False,
) -> Tuple[np.ndarray, np.ndarray]:
    """One route through one SwiGLU expert: returns ``(y, c)`` in float64.

    ``y`` is after the combine-format round trip (none when ``exact``).
    """
    i_size = config.intermediate
    c = x @ w1
    g, u = c[:i_size], c[i_size:]
    limit = config.gate_up_clamp
    if limit is not None:
        g = np.minimum(g, limit)
        u = np.minimum(np.maximum(u, -limit), limit)
    h = _silu(g) * u
    fmt_i = None if exact else config.intermediate_format
    if config.apply_topk_in_fc1:
        y = round_trip(w * h, fmt_i, axis=-1) @ w2
    else:
        y = w * (round_trip(h, fmt_i, axis=-1) @ w2)
    if not exact:
        y = round_trip(y, config.combine_format, axis=-1)
    return y, c


@dataclass
class NaiveRank:
    """The naive forward's result for one rank.

    Attributes:
        output: ``[T, H]`` in ``output_format`` (float64 when exact).
        presum: ``[T, H]`` float64, the slot sum before the output encode.
        fc1_c: ``[R, 2I]`` bfloat16 (float64 when exact), padding rows zero.
        c: ``[R, 2I]`` float64 un-rounded FC1 outputs.
        route_metadata: ``[R, 4]`` int32.
        plan: the :class:`NaivePlan` of this rank.
    """

    output: object
    presum: np.ndarray
    fc1_c: np.ndarray
    c: np.ndarray
    route_metadata: np.ndarray
    plan: NaivePlan


def naive_forward(config: MoeEpConfig, inputs: Sequence[RankInputs], exact: bool = False) -> List[NaiveRank]:
    """The fused forward, token by token. ``exact``: no rounding anywhere
    (weights not read as float32 either), float64 output."""
    el, i_size, h_size = config.num_local_experts, config.intermediate, config.hidden
    plans = naive_plan(config, [inp.topk_idx for inp in inputs])
    fc1 = [decode(inp.fc1_weight) for inp in inputs]
    fc2 = [decode(inp.fc2_weight) for inp in inputs]
    c_rows = [dict() for _ in inputs]  # per destination: (le, src, t, k) -> c
    presums = []
    for src, inp in enumerate(inputs):
        x_all = decode(inp.activation)
        w_all = _weights(inp.topk_weights, exact)
        idx = np.asarray(inp.topk_idx)
        n_tok = x_all.shape[0]
        presum = np.zeros((n_tok, h_size), dtype=np.float64)
        for t in range(n_tok):
            acc = np.zeros(h_size, dtype=np.float64)
            for k in range(config.num_topk):
                e = int(idx[t, k])
                if e < 0:
                    continue  # contributes exactly zero
                dest, le = e // el, e % el
                y, c = route_forward(config, x_all[t], float(w_all[t, k]), fc1[dest][le], fc2[dest][le], exact)
                c_rows[dest][(le, src, t, k)] = c
                acc = acc + y
            presum[t] = acc
        presums.append(presum)
    results = []
    for d, plan in enumerate(plans):
        c = np.zeros((plan.rows.shape[0], 2 * i_size), dtype=np.float64)
        for j, row in enumerate(plan.rows):
            if row[0] >= 0:
                c[j] = c_rows[d][tuple(int(v) for v in row)]
        if exact:
            out, stash = presums[d], c
        else:
            out = quantize(presums[d], config.output_format, axis=1)
            stash = round_to_bf16(c)
        results.append(
            NaiveRank(
                output=out,
                presum=presums[d],
                fc1_c=stash,
                c=c,
                route_metadata=plan.rows.astype(np.int32),
                plan=plan,
            )
        )
    return results


def output_bits(t) -> Tuple[np.ndarray, ...]:
    """Raw bits of an encoded output (bf16 array or BlockScaledTensor), for
    bit-exact comparisons."""
    if isinstance(t, BlockScaledTensor):
        return (t.data_codes().copy(), t.scale_codes().copy())
    return (np.asarray(t).view(np.uint16).copy(),)


# ------------------------------------------------------------------ backward


@dataclass
class NaiveGrads:
    grad_activation: np.ndarray
    grad_fc1_weight: np.ndarray
    grad_fc2_weight: np.ndarray
    grad_topk_weights: np.ndarray


def naive_backward(
    config: MoeEpConfig,
    inputs: Sequence[RankInputs],
    grad_output: Sequence[np.ndarray],
    fc1_c: Sequence[np.ndarray],
    route_metadata: Sequence[np.ndarray],
    exact_weights: bool = False,
) -> List[NaiveGrads]:
    """Section 3 of the brief, one route at a time, float64.

    ``fc1_c[d]`` / ``route_metadata[d]``: destination rank d's stash (rows
    with metadata -1 are padding and ignored).
    """
    i_size, limit = config.intermediate, config.gate_up_clamp
    xs = [decode(inp.activation) for inp in inputs]
    ws = [_weights(inp.topk_weights, exact_weights) for inp in inputs]
    fc1 = [decode(inp.fc1_weight) for inp in inputs]
    fc2 = [decode(inp.fc2_weight) for inp in inputs]
    out = [
        NaiveGrads(
            grad_activation=np.zeros_like(xs[r]),
            grad_fc1_weight=np.zeros_like(fc1[r]),
            grad_fc2_weight=np.zeros_like(fc2[r]),
            grad_topk_weights=np.zeros(np.shape(inputs[r].topk_idx), dtype=np.float64),
        )
        for r in range(len(inputs))
    ]
    for d in range(len(inputs)):
        cs = np.asarray(fc1_c[d]).astype(np.float64)
        for j, row in enumerate(np.asarray(route_metadata[d])):
            le, src, t, k = (int(v) for v in row)
            if le < 0:
                continue
            x, w, dy = xs[src][t], ws[src][t, k], np.asarray(grad_output[src]).astype(np.float64)[t]
            w1, w2 = fc1[d][le], fc2[d][le]
            g_raw, u_raw = cs[j, :i_size], cs[j, i_size:]
            if limit is None:
                gate_pass = np.ones(i_size)
                up_pass = np.ones(i_size)
                g, u = g_raw, u_raw
            else:
                gate_pass = (g_raw <= limit).astype(np.float64)
                up_pass = ((u_raw >= -limit) & (u_raw <= limit)).astype(np.float64)
                g = np.minimum(g_raw, limit)
                u = np.minimum(np.maximum(u_raw, -limit), limit)
            sig = 1.0 / (1.0 + np.exp(-g))
            s = g * sig
            h = s * u
            dy_w2t = w2 @ dy  # (dY W2^T), shape I
            if config.apply_topk_in_fc1:
                dw2 = np.outer(w * h, dy)
                dw = float(np.dot(dy_w2t, h))
            else:
                dw2 = np.outer(h, w * dy)
                dw = float(np.dot(dy, h @ w2))
            dh = dy_w2t * w
            dg = dh * u * sig * (1.0 + g * (1.0 - sig)) * gate_pass
            du = dh * s * up_pass
            dc = np.concatenate([dg, du])
            out[d].grad_fc1_weight[le] += np.outer(x, dc)
            out[d].grad_fc2_weight[le] += dw2
            out[src].grad_activation[t] += w1 @ dc
            out[src].grad_topk_weights[t, k] = dw
    return out


# ------------------------------------------------------------------ worlds


def _encode(values: np.ndarray, fmt, plain_dtype) -> object:
    """Encode weights/activations: ``fmt`` None -> plain ``plain_dtype``;
    mxfp8/nvfp4 -> block-scaled along axis 1."""
    if fmt is None or fmt == "plain":
        return values.astype(plain_dtype)
    return quantize(values, fmt, axis=1)


def make_world(
    config: MoeEpConfig,
    seed: int,
    tokens_per_rank: Sequence[int],
    *,
    routing: str = "distinct",
    unused_prob: float = 0.2,
    activation_format: Optional[str] = None,
    weight_format: Optional[str] = None,
    fc1_format: Optional[str] = None,
    fc2_format: Optional[str] = None,
    activation_dtype=np.float32,
    weight_dtype=np.float32,
    topk_weight_dtype=np.float32,
    index_dtype=np.int64,
    act_scale: float = 1.0,
    one_expert: int = 0,
) -> List[RankInputs]:
    """Random inputs for every rank.

    routing: ``"distinct"`` (K different experts per token), ``"duplicates"``
    (drawn with replacement, so ids repeat within a token), ``"one_expert"``
    (every valid slot goes to ``one_expert``), ``"none"`` (every slot -1).
    ``unused_prob``: chance that a slot is -1. Formats: None for plain arrays of
    the given dtypes, ``"mxfp8"``/``"nvfp4"`` for block-scaled along axis 1.
    ``weight_format`` sets both fc1 and fc2 unless they are given.
    """
    rng = np.random.default_rng(seed)
    h, i, k, e_all, el = config.hidden, config.intermediate, config.num_topk, config.num_experts, config.num_local_experts
    fc1_format = fc1_format if fc1_format is not None else weight_format
    fc2_format = fc2_format if fc2_format is not None else weight_format
    world = []
    for r in range(config.num_ranks):
        n = int(tokens_per_rank[r])
        act = rng.normal(0.0, act_scale, size=(n, h))
        w1 = rng.normal(0.0, 1.0 / math.sqrt(h), size=(el, h, 2 * i))
        w2 = rng.normal(0.0, 1.0 / math.sqrt(i), size=(el, i, h))
        if routing == "distinct":
            idx = np.stack([rng.permutation(e_all)[:k] for _ in range(n)]) if n else np.zeros((0, k), np.int64)
        elif routing == "duplicates":
            idx = rng.integers(0, e_all, size=(n, k))
            if n:
                idx[:, -1] = idx[:, 0]  # at least one repeated id per token
        elif routing == "one_expert":
            idx = np.full((n, k), one_expert)
        elif routing == "none":
            idx = np.full((n, k), -1)
        else:
            raise ValueError(routing)
        idx = idx.reshape(n, k)
        if unused_prob:
            idx = np.where(rng.random((n, k)) < unused_prob, -1, idx)
        weights = rng.uniform(0.1, 1.0, size=(n, k))
        world.append(
            RankInputs(
                activation=_encode(act, activation_format, activation_dtype),
                fc1_weight=_encode(w1, fc1_format, weight_dtype),
                fc2_weight=_encode(w2, fc2_format, weight_dtype),
                topk_idx=idx.astype(index_dtype),
                topk_weights=weights.astype(topk_weight_dtype),
            )
        )
    return world


def grid_world(
    config: MoeEpConfig,
    seed: int,
    tokens_per_rank: Sequence[int],
    *,
    clamp_columns: bool = False,
    unused_prob: float = 0.25,
) -> List[RankInputs]:
    """float32 inputs whose FC1 output ``c`` is exactly representable in bf16.

    Activations are in {-1, -0.5, 0, 0.5, 1}, fc1 weights are multiples of 1/16
    in [-1/2, 1/2], so ``c`` is a multiple of 1/32 with ``|c| <= H / 2`` (exact
    in bf16 while ``32 |c| <= 256``: ``H <= 16``, or ``H <= 10`` with
    ``clamp_columns``, where ``|c| <= 3 + (H - 1) / 2``). Then
    the stash ``fc1_c == c`` and the straight-through backward is the exact
    derivative. ``clamp_columns``: activation column 0 is 1 and fc1 row 0 holds
    +3 in gate column 0 and -3 in up column 1, so those two entries of ``c``
    are beyond any clamp limit below 1 for every route.
    """
    rng = np.random.default_rng(seed)
    h, i, k, e_all, el = config.hidden, config.intermediate, config.num_topk, config.num_experts, config.num_local_experts
    world = []
    for r in range(config.num_ranks):
        n = int(tokens_per_rank[r])
        act = rng.integers(-2, 3, size=(n, h)) / 2.0
        w1 = rng.integers(-8, 9, size=(el, h, 2 * i)) / 16.0
        if clamp_columns:
            act[:, 0] = 1.0
            w1[:, 0, :] = 0.0
            w1[:, 0, 0] = 3.0
            w1[:, 0, i + 1] = -3.0
        w2 = rng.normal(0.0, 1.0 / math.sqrt(i), size=(el, i, h))
        idx = np.stack([rng.permutation(e_all)[:k] for _ in range(n)]) if n else np.zeros((0, k), np.int64)
        idx = np.where(rng.random((n, k)) < unused_prob, -1, idx)
        weights = rng.uniform(0.1, 1.0, size=(n, k))
        world.append(
            RankInputs(
                activation=act.astype(np.float32),
                fc1_weight=w1.astype(np.float32),
                fc2_weight=w2.astype(np.float32),
                topk_idx=idx.astype(np.int64),
                topk_weights=weights.astype(np.float32),
            )
        )
    return world
