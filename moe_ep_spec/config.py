"""``MoeEpConfig``: the frozen, validated static configuration of one MoeEp layer."""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from .errors import ConfigError, FormatError
from .formats import MoeFormat
from .formats import parse_format as _parse_format


def parse_format(value: Any, name: str) -> MoeFormat:
    try:
        return _parse_format(value, name=name)
    except FormatError as exc:
        raise ConfigError(str(exc), field=name, value=value) from None

__all__ = ["MoeEpConfig"]


def _int_field(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an integer >= {minimum}; got bool {value!r}", field=name, value=value)
    try:
        ivalue = operator.index(value)
    except TypeError:
        raise ConfigError(
            f"{name} must be an integer >= {minimum}; got {type(value).__name__} {value!r}", field=name, value=value
        ) from None
    if ivalue < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}; got {ivalue}", field=name, value=value)
    return ivalue


def _bool_field(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be a bool; got {type(value).__name__} {value!r}", field=name, value=value)
    return bool(value)


@dataclass(frozen=True)
class MoeEpConfig:
    """Static configuration of a MoeEp layer; frozen, hashable, validated on construction.

    Vocabulary (used everywhere in the project): ``num_tokens`` T (per rank, may
    differ between ranks and may be 0), ``hidden`` H, ``intermediate`` I,
    ``num_topk`` K, ``num_experts`` E, ``num_ranks`` (the EP size),
    ``num_local_experts`` = E / num_ranks.

    Args:
        num_experts: E, the global expert count. ``>= 1``, divisible by ``num_ranks``.
        hidden: H, the token width. ``>= 1``; a multiple of 32 if ``output_format``
            or ``combine_format`` is mxfp8, of 16 if either is nvfp4.
        intermediate: I, the expert width; FC1 has ``2 * I`` columns (gate, then up).
            ``>= 1``; a multiple of the block size if ``intermediate_format`` is
            block-scaled.
        num_topk: K, routes per token. ``1 <= K <= E``.
        num_ranks: the EP size. ``>= 1``.
        max_tokens_per_rank: upper bound on any rank's ``num_tokens``, or None
            (no bound). Static-shape backends (XLA, CUDA graphs) need it. ``>= 1``.
        output_format: encoding of the ``[num_tokens, hidden]`` result.
        combine_format: rounding of every route's expert output on its way back.
        intermediate_format: rounding of the FC2 operand (blocked along I), or
            None for the exact value.
        apply_topk_in_fc1: True: the router weight multiplies the SwiGLU output
            before FC2; False: it multiplies the FC2 output.
        gate_up_clamp: the SwiGLU limit L (stored as ``abs(L)``; finite, non-zero),
            or None for no clamp.
        generate_c: the fused forward also returns the training stash
            (``fc1_c``, ``route_metadata``).
        recv_capacity: None for the dynamic layout (exactly as many received rows
            as routes). An int selects the static layout: every rank's received
            buffer has exactly ``recv_capacity`` rows. ``>= 1``.
        expert_alignment: static layout only: every local expert's slab starts at
            a multiple of this many rows and is padded with zero rows (metadata
            -1) up to it. ``>= 1``; values above 1 need ``recv_capacity``.
        backward_operand_format: the backward's GEMM operands. None (the
            default): exact, the float32 ``dc`` and ``w*h`` enter their GEMMs
            with their exact values. ``"bf16"``: the cotangent, ``dc`` and
            ``w*h`` are rounded to bf16 (round to nearest even) before their
            GEMMs, as training stacks do (spec section 9.2).

    Expert placement is contiguous: global expert ``e`` lives on rank
    ``e // num_local_experts`` as local expert ``e % num_local_experts``.
    """

    num_experts: int
    hidden: int
    intermediate: int
    num_topk: int
    num_ranks: int = 1
    max_tokens_per_rank: Optional[int] = None
    output_format: Union[MoeFormat, str] = MoeFormat.BF16
    combine_format: Union[MoeFormat, str] = MoeFormat.BF16
    intermediate_format: Optional[Union[MoeFormat, str]] = None
    apply_topk_in_fc1: bool = True
    gate_up_clamp: Optional[float] = None
    generate_c: bool = False
    recv_capacity: Optional[int] = None
    expert_alignment: int = 1
    backward_operand_format: Optional[Union[MoeFormat, str]] = None

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "num_ranks", _int_field("num_ranks", self.num_ranks, 1))
        s(self, "num_experts", _int_field("num_experts", self.num_experts, 1))
        s(self, "hidden", _int_field("hidden", self.hidden, 1))
        s(self, "intermediate", _int_field("intermediate", self.intermediate, 1))
        s(self, "num_topk", _int_field("num_topk", self.num_topk, 1))
        if self.num_experts % self.num_ranks:
            raise ConfigError(
                f"num_experts must be divisible by num_ranks = {self.num_ranks}; got num_experts = {self.num_experts}",
                field="num_experts",
                value=self.num_experts,
            )
        if self.num_topk > self.num_experts:
            raise ConfigError(
                f"num_topk must be in [1, num_experts] = [1, {self.num_experts}]; got {self.num_topk}",
                field="num_topk",
                value=self.num_topk,
            )
        if self.max_tokens_per_rank is not None:
            s(self, "max_tokens_per_rank", _int_field("max_tokens_per_rank", self.max_tokens_per_rank, 1))
        for name in ("output_format", "combine_format"):
            fmt = parse_format(getattr(self, name), name=name)
            s(self, name, fmt)
            if fmt.block_size and self.hidden % fmt.block_size:
                raise ConfigError(
                    f"hidden must be a multiple of {fmt.block_size} when {name} is {fmt.value}; got hidden = {self.hidden}",
                    field="hidden",
                    value=self.hidden,
                )
        if self.intermediate_format is not None:
            fmt = parse_format(self.intermediate_format, name="intermediate_format")
            s(self, "intermediate_format", fmt)
            if fmt.block_size and self.intermediate % fmt.block_size:
                raise ConfigError(
                    f"intermediate must be a multiple of {fmt.block_size} when intermediate_format is {fmt.value}; "
                    f"got intermediate = {self.intermediate}",
                    field="intermediate",
                    value=self.intermediate,
                )
        s(self, "apply_topk_in_fc1", _bool_field("apply_topk_in_fc1", self.apply_topk_in_fc1))
        s(self, "generate_c", _bool_field("generate_c", self.generate_c))
        if self.gate_up_clamp is not None:
            clamp = self.gate_up_clamp
            if isinstance(clamp, bool) or not isinstance(clamp, (int, float, np.integer, np.floating)):
                raise ConfigError(
                    f"gate_up_clamp must be a finite non-zero number or None; got {type(clamp).__name__} {clamp!r}",
                    field="gate_up_clamp",
                    value=clamp,
                )
            try:
                value = abs(float(clamp))
            except OverflowError:
                value = math.inf
            if not math.isfinite(value) or value == 0.0:
                raise ConfigError(
                    f"gate_up_clamp must be a finite non-zero number or None; got {clamp!r}",
                    field="gate_up_clamp",
                    value=clamp,
                )
            s(self, "gate_up_clamp", value)
        s(self, "expert_alignment", _int_field("expert_alignment", self.expert_alignment, 1))
        if self.recv_capacity is not None:
            s(self, "recv_capacity", _int_field("recv_capacity", self.recv_capacity, 1))
        elif self.expert_alignment != 1:
            raise ConfigError(
                f"expert_alignment applies to the static layout only: set recv_capacity, or leave expert_alignment "
                f"at 1; got expert_alignment = {self.expert_alignment} with recv_capacity = None",
                field="expert_alignment",
                value=self.expert_alignment,
            )

        if self.backward_operand_format is not None:
            value = self.backward_operand_format
            try:
                fmt = _parse_format(value, name="backward_operand_format")
            except FormatError:
                fmt = None
            if fmt is not MoeFormat.BF16:
                raise ConfigError(
                    f"backward_operand_format must be None (exact float32 operands) or 'bf16'; got {value!r}",
                    field="backward_operand_format",
                    value=value,
                )
            s(self, "backward_operand_format", fmt)

    # ------------------------------------------------------------------ derived

    @property
    def num_local_experts(self) -> int:
        """E / num_ranks: experts held by each rank."""
        return self.num_experts // self.num_ranks

    @property
    def static_layout(self) -> bool:
        """True when ``recv_capacity`` is set (fixed-size received buffers)."""
        return self.recv_capacity is not None

    def expert_rank(self, expert: int) -> int:
        """The rank that holds global expert ``expert``."""
        return self._check_expert(expert) // self.num_local_experts

    def local_expert(self, expert: int) -> int:
        """The local index of global expert ``expert`` on its rank."""
        return self._check_expert(expert) % self.num_local_experts

    def global_expert(self, rank: int, local_expert: int) -> int:
        """The global id of ``local_expert`` on ``rank``."""
        if not 0 <= rank < self.num_ranks:
            raise ConfigError(f"rank must be in [0, {self.num_ranks}); got {rank}", field="rank", value=rank)
        if not 0 <= local_expert < self.num_local_experts:
            raise ConfigError(
                f"local_expert must be in [0, {self.num_local_experts}); got {local_expert}",
                field="local_expert",
                value=local_expert,
            )
        return rank * self.num_local_experts + local_expert

    def expert_placement(self) -> np.ndarray:
        """``[num_experts] int64``: the rank of every global expert (contiguous)."""
        return np.arange(self.num_experts, dtype=np.int64) // self.num_local_experts

    def worst_case_recv_rows(self) -> int:
        """The most rows any rank can receive, aligned as the static layout aligns
        them: a safe ``recv_capacity``. Needs ``max_tokens_per_rank``.

        Every token sends at most ``min(num_topk, num_local_experts)`` routes to one
        rank when its top-k ids are distinct, but ids may repeat, so the bound is
        ``num_ranks * max_tokens_per_rank * num_topk`` routes plus
        ``expert_alignment - 1`` padding rows per local expert.
        """
        if self.max_tokens_per_rank is None:
            raise ConfigError(
                "worst_case_recv_rows needs max_tokens_per_rank; got None", field="max_tokens_per_rank", value=None
            )
        routes = self.num_ranks * self.max_tokens_per_rank * self.num_topk
        return routes + self.num_local_experts * (self.expert_alignment - 1)

    def replace(self, **changes: Any) -> "MoeEpConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def _check_expert(self, expert: int) -> int:
        if not 0 <= expert < self.num_experts:
            raise ConfigError(
                f"expert must be in [0, num_experts) = [0, {self.num_experts}); got {expert}",
                field="expert",
                value=expert,
            )
        return int(expert)
