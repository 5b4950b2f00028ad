"""The framework-neutral inputs and results of the MoeEp operations.

Arrays here are numpy arrays (with ml_dtypes' ``bfloat16`` and float8 types) or
:class:`~moe_ep_spec.formats.BlockScaledTensor`. Framework backends accept the
same objects at the world level (the conformance suite's interface) and their
own tensors in their framework front-ends.

Shapes use the project vocabulary: ``T`` = num_tokens of the rank, ``H`` =
hidden, ``I`` = intermediate, ``K`` = num_topk, ``E_local`` = num_local_experts,
``R`` = rows received by the rank (the number of routes it processes in the
dynamic layout, ``recv_capacity`` in the static layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from .formats import BlockScaledTensor

__all__ = ["Tensor", "RankInputs", "ForwardResult", "Stash", "BackwardResult", "DispatchInputs", "DispatchHandle",
           "DispatchResult", "DispatchGrads", "RankContext", "ROUTE_METADATA_COLUMNS"]

#: A plain float array or a block-scaled tensor.
Tensor = Union[np.ndarray, BlockScaledTensor]

#: Column names of ``route_metadata``, in order.
ROUTE_METADATA_COLUMNS = ("local_expert", "src_rank", "src_token", "src_slot")


@dataclass(frozen=True, eq=False)
class RankInputs:
    """One rank's inputs to the fused forward (and, re-supplied, to the backward).

    Attributes:
        activation: ``[T, H]`` float32/float16/bfloat16, or a BlockScaledTensor
            (mxfp8/nvfp4) of logical shape ``(T, H)`` blocked along axis 1 (H):
            the rank's tokens. T may be 0.
        fc1_weight: ``[E_local, H, 2I]`` float32/float16/bfloat16 or block-scaled
            along axis 1 (H, the reduction axis): columns ``[0, I)`` are gate,
            ``[I, 2I)`` are up.
        fc2_weight: ``[E_local, I, H]`` float32/float16/bfloat16 or block-scaled
            along axis 1 (I, the reduction axis).
        topk_idx: ``[T, K]`` int32/int64: the global expert of every (token, slot);
            ``-1`` marks an unused slot. Values must be in ``[-1, E)``.
        topk_weights: ``[T, K]`` float32/float16/bfloat16: the router weight of
            every (token, slot), read as float32. Ignored for ``-1`` slots.
    """

    activation: Tensor
    fc1_weight: Tensor
    fc2_weight: Tensor
    topk_idx: np.ndarray
    topk_weights: np.ndarray


@dataclass(frozen=True, eq=False)
class Stash:
    """The training stash of one rank (``generate_c=True``).

    Attributes:
        fc1_c: ``[R, 2I]`` bfloat16: the FC1 output ``c`` of every route this rank
            processed, rounded to bf16, before the clamp and unweighted; rows in
            expert-major order. Static layout: padding rows are zero.
        route_metadata: ``[R, 4]`` int32, rows aligned with ``fc1_c``:
            ``(local_expert, src_rank, src_token, src_slot)``. Static layout:
            padding rows are ``-1`` in every column.
    """

    fc1_c: np.ndarray
    route_metadata: np.ndarray


@dataclass(frozen=True, eq=False)
class ForwardResult:
    """One rank's result of the fused forward.

    Attributes:
        output: ``[T, H]`` in ``config.output_format``: a bfloat16 array, or a
            BlockScaledTensor blocked along axis 1.
        fc1_c: see :class:`Stash`; None unless ``config.generate_c``.
        route_metadata: see :class:`Stash`; None unless ``config.generate_c``.
    """

    output: Tensor
    fc1_c: Optional[np.ndarray] = None
    route_metadata: Optional[np.ndarray] = None

    @property
    def stash(self) -> Optional[Stash]:
        """The stash as one object, or None when the forward made none."""
        if self.fc1_c is None or self.route_metadata is None:
            return None
        return Stash(fc1_c=self.fc1_c, route_metadata=self.route_metadata)


@dataclass(frozen=True, eq=False)
class BackwardResult:
    """One rank's gradients from the backward (all float32).

    Attributes:
        grad_activation: ``[T, H]`` float32.
        grad_fc1_weight: ``[E_local, H, 2I]`` float32.
        grad_fc2_weight: ``[E_local, I, H]`` float32.
        grad_topk_weights: ``[T, K]`` float32; exactly 0 for ``-1`` slots.
    """

    grad_activation: np.ndarray
    grad_fc1_weight: np.ndarray
    grad_fc2_weight: np.ndarray
    grad_topk_weights: np.ndarray


@dataclass(frozen=True, eq=False)
class DispatchInputs:
    """One rank's inputs to the layered ``dispatch``.

    Attributes:
        tokens: ``[T, H]`` float32/float16/bfloat16 or block-scaled along axis 1:
            moved unchanged (codes and scales travel as they are).
        topk_idx: ``[T, K]`` int32/int64 in ``[-1, E)``; ``-1`` slots are not sent.
        topk_weights: ``[T, K]`` float32/float16/bfloat16, read as float32.
    """

    tokens: Tensor
    topk_idx: np.ndarray
    topk_weights: np.ndarray


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """The routing plan of one rank, made by ``dispatch`` and used by ``combine``
    and the backward passes. Treat it as read-only.

    Attributes:
        rank: this rank.
        num_ranks: the EP size.
        num_tokens: T of this rank (the rows ``combine`` returns).
        num_topk: K.
        route_metadata: ``[R, 4]`` int32: ``(local_expert, src_rank, src_token,
            src_slot)`` of every received row, in expert-major order; ``-1`` rows
            are padding (static layout).
        tokens_per_expert: ``[E_local]`` int64: valid rows per local expert.
        expert_offsets: ``[E_local + 1]`` int64: local expert ``e``'s slab is rows
            ``[expert_offsets[e], expert_offsets[e] + tokens_per_expert[e])``; in
            the static layout every offset is a multiple of ``expert_alignment``,
            and ``expert_offsets[-1]`` is the end of the last aligned slab.
        backend_state: anything else the backend needs (opaque to callers).
    """

    rank: int
    num_ranks: int
    num_tokens: int
    num_topk: int
    route_metadata: np.ndarray
    tokens_per_expert: np.ndarray
    expert_offsets: np.ndarray
    backend_state: Any = None

    @property
    def num_recv_rows(self) -> int:
        """R: rows of the received buffer (padding included)."""
        return int(self.route_metadata.shape[0])

    @property
    def valid_rows(self) -> np.ndarray:
        """``[R] bool``: True for rows that carry a route, False for padding."""
        return self.route_metadata[:, 0] >= 0


@dataclass(frozen=True, eq=False)
class DispatchResult:
    """One rank's result of ``dispatch``.

    Attributes:
        tokens: ``[R, H]``, the same encoding as the input tokens: received rows in
            expert-major order (local expert, then source rank, then source token,
            then source slot). Padding rows are zero (block-scaled: zero codes and
            zero scale codes).
        topk_weights: ``[R]`` float32: the router weight of every received row;
            0 for padding rows.
        handle: the :class:`DispatchHandle` for ``combine`` and the backward.
    """

    tokens: Tensor
    topk_weights: np.ndarray
    handle: DispatchHandle

    @property
    def route_metadata(self) -> np.ndarray:
        return self.handle.route_metadata

    @property
    def tokens_per_expert(self) -> np.ndarray:
        return self.handle.tokens_per_expert

    @property
    def expert_offsets(self) -> np.ndarray:
        return self.handle.expert_offsets


@dataclass(frozen=True, eq=False)
class DispatchGrads:
    """One rank's result of ``dispatch_backward`` (a combine of the cotangents).

    Attributes:
        grad_tokens: ``[T, H]`` float32: the sum over a token's routes of the
            received rows' cotangents (unweighted, unrounded).
        grad_topk_weights: ``[T, K]`` float32: the cotangent of each route's
            received weight; exactly 0 for ``-1`` slots.
    """

    grad_tokens: np.ndarray
    grad_topk_weights: np.ndarray


@dataclass(frozen=True)
class RankContext:
    """Where one rank of a process-per-rank backend runs.

    Attributes:
        rank: this process's rank, ``0 <= rank < num_ranks``.
        num_ranks: the EP size.
        rendezvous: ``"tcp://127.0.0.1:PORT"``: where the ranks meet (loopback).
        timeout_s: how long any collective may wait before it fails.
        device: the device this rank uses (``"cpu"``, ``"cuda:0"`` ...).
    """

    rank: int
    num_ranks: int
    rendezvous: str
    timeout_s: float = 60.0
    device: str = "cpu"
