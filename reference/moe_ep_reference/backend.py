"""``reference``: the shared numpy reference, registered like any other backend."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from moe_ep_spec import validation as v
from moe_ep_spec.api import (BackwardResult, DispatchGrads, DispatchHandle, DispatchInputs, DispatchResult,
                             ForwardResult, RankInputs, Stash, Tensor)
from moe_ep_spec.backend import Capabilities, Launch, MoeEpBackend
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import DTypeError, StashError
from moe_ep_spec.formats import round_to_bf16, round_trip
from moe_ep_spec.tolerance import (
    ForwardBudget,
    allowed_scale_codes,
    exact_reduction,
    quantum,
    reduction_bound,
    rounding_error_bound,
)

from . import world as W

__all__ = ["ReferenceBackend"]

__version__ = "0.1.0"


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


class ReferenceBackend(MoeEpBackend):
    """The spec, executed: a whole EP world in one process, float64 throughout.

    Supports everything: every format combination, block-scaled inputs, both
    router-weight placements, the clamp, ``generate_c``, the backward, and the
    layered primitives in the dynamic and the static layout, at any EP size.
    """

    name = "reference"
    version = __version__
    capabilities = Capabilities(launch=Launch.WORLD, devices=("cpu",))

    def framework_versions(self) -> dict:
        import ml_dtypes

        return {"numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__}

    # ---------------------------------------------------------------- checks

    def _check_world_inputs(self, config: MoeEpConfig, inputs: Sequence[RankInputs]) -> None:
        v.validate_world(config, inputs, "inputs")
        for r, inp in enumerate(inputs):
            v.validate_rank_inputs(config, inp, r)

    def _check_layered(self, config: MoeEpConfig, op: str, handles: Sequence[DispatchHandle],
                       **per_rank: Sequence[Any]) -> None:
        """What a layered call after the dispatch checks first: ``op`` supported,
        ``handles`` (:meth:`_check_handles`), then each world-level argument
        (``name=value``, in order) one entry a rank."""
        self.require(config, op)
        self._check_handles(config, handles)
        for name, value in per_rank.items():
            v.validate_world(config, value, name)

    def _check_handles(self, config: MoeEpConfig, handles: Sequence[DispatchHandle]) -> None:
        v.validate_world(config, handles, "handles")
        for r, h in enumerate(handles):
            v.check_handle(config, h, r)

    # ----------------------------------------------------------------- fused

    def forward(self, config: MoeEpConfig, inputs: Sequence[RankInputs]) -> List[ForwardResult]:
        return self._forward(config, inputs, with_bound=False)[0]

    def forward_and_budget(
        self, config: MoeEpConfig, inputs: Sequence[RankInputs]
    ) -> Tuple[List[ForwardResult], List[ForwardBudget]]:
        """:meth:`forward` and :meth:`forward_budget` from one computation."""
        return self._forward(config, inputs, with_bound=True)

    def forward_budget(self, config: MoeEpConfig, inputs: Sequence[RankInputs]) -> List[ForwardBudget]:
        """Per rank, the budgets of a conforming backend's forward results: the
        decoded ``output``, the allowed output scale codes (block formats) and,
        with ``generate_c``, ``fc1_c`` (see :mod:`moe_ep_spec.tolerance`)."""
        return self._forward(config, inputs, with_bound=True)[1]

    def _forward(
        self, config: MoeEpConfig, inputs: Sequence[RankInputs], with_bound: bool
    ) -> Tuple[List[ForwardResult], List[ForwardBudget]]:
        self.require(config, "forward")
        self._check_world_inputs(config, inputs)
        handles = W.plan(config, [inp.topk_idx for inp in inputs])
        x = W.gather(handles, [W.decode(inp.activation) for inp in inputs])
        w = W.gather(handles, [_read_weights(inp.topk_weights) for inp in inputs], by_slot=True)
        ys, cs, bs = [], [], []
        for d, h in enumerate(handles):
            fc1, fc2 = W.decode(inputs[d].fc1_weight), W.decode(inputs[d].fc2_weight)
            with np.errstate(invalid="ignore", over="ignore"):  # a NaN/inf token poisons its own rows only
                y, c, b = W.expert_forward(config, h, x[d], w[d], fc1, fc2, with_bound=with_bound)
            ys.append(y)
            cs.append(c)
            bs.append(b)
        per_slot = W.scatter_slots(config, handles, ys)
        bound_slots = W.scatter_slots(config, handles, [b[0] for b in bs]) if with_bound else None
        results, budgets = [], []
        for r, h in enumerate(handles):
            summed = W.sum_slots(per_slot[r])
            out = W.encode_output(config, summed)
            if config.generate_c:
                results.append(ForwardResult(out, round_to_bf16(cs[r]), h.route_metadata.copy()))
            else:
                results.append(ForwardResult(out))
            if bound_slots is not None:
                budgets.append(
                    _output_budget(
                        config, summed, W.sum_slots(bound_slots[r]), per_slot[r], bs[r][1] if config.generate_c else None
                    )
                )
        return results, budgets

    def backward(self, config: MoeEpConfig, inputs: Sequence[RankInputs], grad_output: Sequence[np.ndarray],
                 stash: Sequence[Stash]) -> List[BackwardResult]:
        return self._backward(config, inputs, grad_output, stash, with_bound=False)[0]

    def backward_and_budget(self, config: MoeEpConfig, inputs: Sequence[RankInputs], grad_output: Sequence[np.ndarray],
                            stash: Sequence[Stash]) -> Tuple[List[BackwardResult], List[BackwardResult]]:
        """:meth:`backward` and :meth:`backward_budget` from one computation."""
        return self._backward(config, inputs, grad_output, stash, with_bound=True)

    def backward_budget(self, config: MoeEpConfig, inputs: Sequence[RankInputs], grad_output: Sequence[np.ndarray],
                        stash: Sequence[Stash]) -> List[BackwardResult]:
        """Per rank, float64 budgets shaped like the four gradients of :meth:`backward`."""
        return self._backward(config, inputs, grad_output, stash, with_bound=True)[1]

    def _backward(self, config: MoeEpConfig, inputs: Sequence[RankInputs], grad_output: Sequence[np.ndarray],
                  stash: Sequence[Stash], with_bound: bool) -> Tuple[List[BackwardResult], List[BackwardResult]]:
        self.require(config, "backward")
        self._check_world_inputs(config, inputs)
        v.validate_world(config, grad_output, "grad_output")
        v.validate_world(config, stash, "stash")
        handles = W.plan(config, [inp.topk_idx for inp in inputs])
        for r, h in enumerate(handles):
            v.validate_grad("grad_output", grad_output[r], (h.num_tokens, config.hidden), "(num_tokens, hidden)", r)
            v.validate_stash(config, stash[r], h.num_recv_rows, r)
            _check_metadata(r, stash[r].route_metadata, h.route_metadata)
        x = W.gather(handles, [W.decode(inp.activation) for inp in inputs])
        w = W.gather(handles, [_read_weights(inp.topk_weights) for inp in inputs], by_slot=True)
        dy = W.gather(handles, [np.asarray(g, dtype=np.float64) for g in grad_output])
        grads, bounds = [], []
        for d, h in enumerate(handles):
            fc1, fc2 = W.decode(inputs[d].fc1_weight), W.decode(inputs[d].fc2_weight)
            c = stash[d].fc1_c.astype(np.float64)
            with np.errstate(invalid="ignore", over="ignore"):
                g, b = W.expert_backward(config, h, x[d], w[d], fc1, fc2, c, dy[d], with_bound=with_bound)
            grads.append(g)
            bounds.append(b)
        results = _assemble_backward(config, handles, grads)
        budgets: List[BackwardResult] = []
        if with_bound:
            budgets = _assemble_backward(config, handles, bounds, as_float32=False)
            abs_slots = W.scatter_slots(config, handles, [np.abs(gr[0]) for gr in grads])
            for r, bud in enumerate(budgets):
                budgets[r] = BackwardResult(
                    grad_activation=bud.grad_activation + reduction_bound(W.sum_slots(abs_slots[r]), config.num_topk),
                    grad_fc1_weight=bud.grad_fc1_weight,
                    grad_fc2_weight=bud.grad_fc2_weight,
                    grad_topk_weights=bud.grad_topk_weights,
                )
        return results, budgets

    # --------------------------------------------------------------- layered

    def dispatch(self, config: MoeEpConfig, inputs: Sequence[DispatchInputs]) -> List[DispatchResult]:
        self.require(config, "dispatch")
        v.validate_world(config, inputs, "inputs")
        for r, inp in enumerate(inputs):
            v.validate_dispatch_inputs(config, inp, r)
        mismatch = W.stack_tokens([inp.tokens for inp in inputs])
        if mismatch is not None:
            raise DTypeError(f"tokens must have the same encoding on every rank: {mismatch}", name="tokens")
        handles = W.plan(config, [inp.topk_idx for inp in inputs])
        tokens = W.gather_tokens(handles, [inp.tokens for inp in inputs])
        weights = W.gather(handles, [_read_weights(inp.topk_weights) for inp in inputs], by_slot=True)
        return [DispatchResult(tokens[r], _f32(weights[r]), handles[r]) for r in range(config.num_ranks)]

    def combine(
        self, config: MoeEpConfig, handles: Sequence[DispatchHandle], expert_out: Sequence[np.ndarray]
    ) -> List[Tensor]:
        return [W.encode_output(config, W.sum_slots(p)) for p in self._combine_slots(config, handles, expert_out)]

    def combine_budget(
        self, config: MoeEpConfig, handles: Sequence[DispatchHandle], expert_out: Sequence[np.ndarray]
    ) -> List[ForwardBudget]:
        """Per rank, the budgets of a conforming combine's ``[T, H]`` output and its
        scale codes: the float32 slot sum, then the output encode (the combine
        round trip of a given row is exact and must match)."""
        return [
            _output_budget(config, W.sum_slots(p), 0.0, p)
            for p in self._combine_slots(config, handles, expert_out)
        ]

    def _combine_slots(
        self, config: MoeEpConfig, handles: Sequence[DispatchHandle], expert_out: Sequence[np.ndarray]
    ) -> List[np.ndarray]:
        self._check_layered(config, "combine", handles, expert_out=expert_out)
        rows = []
        for h, y in zip(handles, expert_out):
            v.validate_expert_out(config, y, h)
            yy = np.where(h.valid_rows[:, None], np.asarray(y, dtype=np.float64), 0.0)  # padding never read
            rows.append(round_trip(yy, config.combine_format, axis=-1))
        return W.scatter_slots(config, handles, rows)

    def combine_backward(
        self, config: MoeEpConfig, handles: Sequence[DispatchHandle], grad_output: Sequence[np.ndarray]
    ) -> List[np.ndarray]:
        self._check_layered(config, "combine_backward", handles, grad_output=grad_output)
        for r, (h, g) in enumerate(zip(handles, grad_output)):
            v.validate_grad("grad_output", g, (h.num_tokens, config.hidden), "(num_tokens, hidden)", r)
        return [_f32(g) for g in W.gather(handles, [np.asarray(g, dtype=np.float64) for g in grad_output])]

    def dispatch_backward(self, config: MoeEpConfig, handles: Sequence[DispatchHandle],
                          grad_tokens: Sequence[np.ndarray],
                          grad_topk_weights: Sequence[np.ndarray]) -> List[DispatchGrads]:
        tok_slots, w_slots = self._dispatch_backward_slots(config, handles, grad_tokens, grad_topk_weights)
        return [
            DispatchGrads(grad_tokens=_f32(W.sum_slots(tok_slots[r])), grad_topk_weights=_f32(w_slots[r]))
            for r in range(config.num_ranks)
        ]

    def dispatch_backward_budget(self, config: MoeEpConfig, handles: Sequence[DispatchHandle],
                                 grad_tokens: Sequence[np.ndarray],
                                 grad_topk_weights: Sequence[np.ndarray]) -> List[DispatchGrads]:
        """Per rank, float64 budgets shaped like :meth:`dispatch_backward`'s results:
        the float32 slot sum for ``grad_tokens`` (0 where that sum is exact in
        float32); ``grad_topk_weights`` is exact (0)."""
        tok_slots, w_slots = self._dispatch_backward_slots(config, handles, grad_tokens, grad_topk_weights)
        return [
            DispatchGrads(
                grad_tokens=_slot_sum_bound(tok_slots[r], config.num_topk),
                grad_topk_weights=np.zeros_like(w_slots[r]),
            )
            for r in range(config.num_ranks)
        ]

    def _dispatch_backward_slots(self, config: MoeEpConfig, handles: Sequence[DispatchHandle],
                                 grad_tokens: Sequence[np.ndarray],
                                 grad_topk_weights: Sequence[np.ndarray]) -> Tuple[List[np.ndarray], List[np.ndarray]]:
        self._check_layered(config, "dispatch_backward", handles, grad_tokens=grad_tokens,
                            grad_topk_weights=grad_topk_weights)
        gts, gws = [], []
        for r, (h, gt, gw) in enumerate(zip(handles, grad_tokens, grad_topk_weights)):
            v.validate_grad("grad_tokens", gt, (h.num_recv_rows, config.hidden), "(received rows, hidden)", r)
            v.validate_grad("grad_topk_weights", gw, (h.num_recv_rows,), "(received rows,)", r)
            valid = h.valid_rows  # padding rows are never read
            gts.append(np.where(valid[:, None], np.asarray(gt, dtype=np.float64), 0.0))
            gws.append(np.where(valid, np.asarray(gw, dtype=np.float64), 0.0))
        return W.scatter_slots(config, handles, gts), W.scatter_slots(config, handles, gws)


def _slot_sum_bound(per_slot: np.ndarray, num_topk: int, route_error: Any = 0.0) -> np.ndarray:
    """The error bound of a float32 slot sum of ``per_slot`` (``[T, K, H]`` float64,
    the terms) whose terms may each be off by their share of ``route_error``
    (``[T, H]``, summed over slots): 0 where the sum is exact in float32 in every
    order (the terms are the reference's and fit 24 bits together, e.g. K = 1 or
    two bf16 values of nearby magnitude), else ``gamma(K) * sum_k |term_k|`` plus
    the underflow term."""
    abs_sum = W.sum_slots(np.abs(per_slot))
    common = np.min(quantum(per_slot), axis=1) if per_slot.shape[1] else np.full(abs_sum.shape, np.inf)
    exact = exact_reduction(abs_sum, common) & (np.asarray(route_error) == 0)
    return reduction_bound(abs_sum, num_topk, exact)


def _output_budget(
    config: MoeEpConfig,
    summed: np.ndarray,
    route_error: Any,
    per_slot: np.ndarray,
    fc1_c: Optional[np.ndarray] = None,
) -> ForwardBudget:
    """The budget of a ``[T, H]`` output: the routes' errors (``route_error``,
    summed over slots) plus the float32 slot sum (nothing where that sum is
    exact), pushed through the output encode."""
    fmt = config.output_format
    before_encode = route_error + _slot_sum_bound(per_slot, config.num_topk, route_error)
    return ForwardBudget(
        output=rounding_error_bound(summed, before_encode, fmt, axis=1),
        scale_codes=allowed_scale_codes(summed, before_encode, fmt, axis=1) if fmt.is_block_scaled else None,
        fc1_c=fc1_c,
    )


def _assemble_backward(
    config: MoeEpConfig,
    handles: Sequence[DispatchHandle],
    per_dest: Sequence[Tuple[np.ndarray, ...]],
    as_float32: bool = True,
) -> List[BackwardResult]:
    """Route-level (dx, dw) back to their tokens; weight gradients stay put."""
    dx_slots = W.scatter_slots(config, handles, [p[0] for p in per_dest])
    dw_slots = W.scatter_slots(config, handles, [p[1] for p in per_dest])
    cast = _f32 if as_float32 else (lambda a: a)
    return [
        BackwardResult(
            grad_activation=cast(W.sum_slots(dx_slots[r])),
            grad_fc1_weight=cast(per_dest[r][2]),
            grad_fc2_weight=cast(per_dest[r][3]),
            grad_topk_weights=cast(dw_slots[r]),
        )
        for r in range(config.num_ranks)
    ]


def _read_weights(topk_weights: np.ndarray) -> np.ndarray:
    """Router weights are read as float32 (exact for float32/float16/bfloat16)."""
    return np.asarray(topk_weights).astype(np.float32).astype(np.float64)


def _check_metadata(rank: int, got: np.ndarray, expected: np.ndarray) -> None:
    diff = np.nonzero((got != expected).any(axis=1))[0]
    if diff.size:
        row = int(diff[0])
        raise StashError(
            f"rank {rank}: route_metadata must equal the forward's routing of topk_idx; row {row} is "
            f"{tuple(int(x) for x in got[row])}, the routing gives {tuple(int(x) for x in expected[row])}"
        )
