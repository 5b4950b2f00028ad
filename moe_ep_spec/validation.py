"""Input checks every backend runs before it computes anything.

Each check raises the spec's error type with a message that names the rule, the
value seen and what is allowed, prefixed with ``rank N:`` when the input belongs
to one rank of a world. Nothing here modifies its inputs. Backends call these
(or equivalent checks of their own) so that bad input is rejected the same way
everywhere: the conformance suite tests that they do.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import numpy as np

from .api import DispatchHandle, DispatchInputs, RankInputs, Stash
from .config import MoeEpConfig
from .errors import CapacityError, DTypeError, FormatError, RoutingIndexError, ShapeError
from .formats import BF16, BlockScaledTensor

__all__ = [
    "PLAIN_FLOAT_DTYPES",
    "INDEX_DTYPES",
    "check_tensor",
    "check_shape",
    "check_float_array",
    "check_topk",
    "check_num_tokens",
    "validate_rank_inputs",
    "validate_world",
    "check_handle",
    "validate_dispatch_inputs",
    "validate_grad",
    "validate_stash",
    "validate_expert_out",
]

#: dtypes allowed for plain (not block-scaled) float inputs.
PLAIN_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), BF16)
#: dtypes allowed for ``topk_idx``.
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def _prefix(rank: Optional[int]) -> str:
    return "" if rank is None else f"rank {rank}: "


def _dtype_names(dtypes: Sequence[np.dtype]) -> str:
    return ", ".join(d.name for d in dtypes)


def _dtype_text(dtype: np.dtype) -> str:
    """The dtype's name, saying so when its byte order is not the machine's."""
    if dtype.byteorder not in ("=", "|") and dtype != dtype.newbyteorder("="):
        return f"{dtype.name} in non-native byte order ({dtype.str}); pass a native-order array"
    return dtype.name


def check_float_array(name: str, arr: Any, shape: Tuple[Any, ...], what: str, rank: Optional[int] = None) -> np.ndarray:
    """``arr`` must be a plain float array (float32/float16/bfloat16) of ``shape``.

    ``shape`` holds ints, or None for an extent that is not checked; ``what``
    spells the expected shape in the vocabulary, e.g. ``"(num_tokens, hidden)"``.
    """
    p = _prefix(rank)
    if not isinstance(arr, np.ndarray):
        raise DTypeError(
            f"{p}{name} must be a numpy array with dtype in ({_dtype_names(PLAIN_FLOAT_DTYPES)}); "
            f"got {type(arr).__name__}",
            name=name,
            got=type(arr),
        )
    if arr.dtype not in PLAIN_FLOAT_DTYPES:
        raise DTypeError(
            f"{p}{name} must have dtype in ({_dtype_names(PLAIN_FLOAT_DTYPES)}); got {_dtype_text(arr.dtype)}",
            name=name,
            expected=_dtype_names(PLAIN_FLOAT_DTYPES),
            got=arr.dtype.name,
        )
    check_shape(name, tuple(arr.shape), shape, what, rank)
    return arr


def check_shape(name: str, got: Tuple[int, ...], shape: Tuple[Any, ...], what: str, rank: Optional[int] = None) -> None:
    """``got`` must equal ``shape`` (None entries match anything); raises
    :class:`ShapeError` with the spec's message, e.g. ``topk_idx must have shape
    (num_tokens, num_topk) = (64, 2); got (64, 3)``. Framework backends call it
    with their tensors' shapes so their messages are the same."""
    ok = len(got) == len(shape) and all(e is None or e == g for e, g in zip(shape, got))
    if not ok:
        shown = tuple("?" if e is None else e for e in shape)
        shown_text = "(" + ", ".join(str(e) for e in shown) + ("," if len(shown) == 1 else "") + ")"
        raise ShapeError(
            f"{_prefix(rank)}{name} must have shape {what} = {shown_text}; got {got}",
            name=name,
            expected=shape,
            got=got,
        )


def check_tensor(
    name: str, t: Any, shape: Tuple[Any, ...], what: str, blocked_axis: int, rank: Optional[int] = None
) -> Tuple[int, ...]:
    """``t`` must be a plain float array of ``shape`` or a BlockScaledTensor of that
    logical shape blocked along ``blocked_axis``. Returns the logical shape."""
    if isinstance(t, BlockScaledTensor):
        try:
            t.validate()
        except (FormatError, ShapeError, DTypeError) as exc:
            renamed = type(exc)(f"{_prefix(rank)}{name}: {exc}")
            renamed.__dict__.update(exc.__dict__)  # keep name / expected / got
            raise renamed from None
        check_shape(name, t.shape, shape, what, rank)
        if t.axis != blocked_axis % len(t.shape):
            raise FormatError(
                f"{_prefix(rank)}{name} must be blocked along axis {blocked_axis} (its reduction axis); "
                f"got a {t.format.value} tensor blocked along axis {t.axis}"
            )
        return t.shape
    return tuple(check_float_array(name, t, shape, what, rank).shape)


def check_topk(
    config: MoeEpConfig, topk_idx: Any, topk_weights: Any, num_tokens: int, rank: Optional[int] = None
) -> None:
    """``topk_idx`` ``[T, K]`` int32/int64 in ``[-1, E)``; ``topk_weights`` ``[T, K]`` float."""
    p = _prefix(rank)
    if not isinstance(topk_idx, np.ndarray) or topk_idx.dtype not in INDEX_DTYPES:
        got = _dtype_text(topk_idx.dtype) if isinstance(topk_idx, np.ndarray) else type(topk_idx).__name__
        raise DTypeError(
            f"{p}topk_idx must have dtype in ({_dtype_names(INDEX_DTYPES)}); got {got}",
            name="topk_idx",
            expected=_dtype_names(INDEX_DTYPES),
            got=got,
        )
    shape = (num_tokens, config.num_topk)
    check_shape("topk_idx", tuple(topk_idx.shape), shape, "(num_tokens, num_topk)", rank)
    check_float_array("topk_weights", topk_weights, shape, "(num_tokens, num_topk)", rank)
    bad = (topk_idx < -1) | (topk_idx >= config.num_experts)
    if bad.any():
        t, k = (int(i) for i in np.argwhere(bad)[0])
        value = int(topk_idx[t, k])
        raise RoutingIndexError(
            f"{p}topk_idx values must be in [-1, num_experts) = [-1, {config.num_experts}); "
            f"got {value} at (token {t}, slot {k})",
            rank=rank,
            position=(t, k),
            value=value,
            num_experts=config.num_experts,
        )


def check_num_tokens(config: MoeEpConfig, num_tokens: int, rank: Optional[int] = None,
                     what: str = "num_tokens") -> None:
    """``num_tokens`` must not exceed ``config.max_tokens_per_rank`` (when set);
    ``what`` names it in the message."""
    limit = config.max_tokens_per_rank
    if limit is not None and num_tokens > limit:
        raise CapacityError(
            f"{_prefix(rank)}{what} must be <= max_tokens_per_rank = {limit}; got {num_tokens}",
            limit=limit,
            got=num_tokens,
        )


def validate_rank_inputs(config: MoeEpConfig, inputs: RankInputs, rank: Optional[int] = None) -> int:
    """Check one rank's fused-forward inputs; returns its ``num_tokens``."""
    if not isinstance(inputs, RankInputs):
        raise DTypeError(
            f"{_prefix(rank)}inputs must be a RankInputs; got {type(inputs).__name__}", name="inputs", got=type(inputs)
        )
    h, i, el = config.hidden, config.intermediate, config.num_local_experts
    shape = check_tensor("activation", inputs.activation, (None, h), "(num_tokens, hidden)", 1, rank)
    num_tokens = shape[0]
    check_num_tokens(config, num_tokens, rank)
    check_tensor(
        "fc1_weight", inputs.fc1_weight, (el, h, 2 * i), "(num_local_experts, hidden, 2 * intermediate)", 1, rank
    )
    check_tensor("fc2_weight", inputs.fc2_weight, (el, i, h), "(num_local_experts, intermediate, hidden)", 1, rank)
    check_topk(config, inputs.topk_idx, inputs.topk_weights, num_tokens, rank)
    return num_tokens


def validate_dispatch_inputs(config: MoeEpConfig, inputs: DispatchInputs, rank: Optional[int] = None) -> int:
    """Check one rank's dispatch inputs; returns its ``num_tokens``."""
    if not isinstance(inputs, DispatchInputs):
        raise DTypeError(
            f"{_prefix(rank)}inputs must be a DispatchInputs; got {type(inputs).__name__}",
            name="inputs",
            got=type(inputs),
        )
    shape = check_tensor("tokens", inputs.tokens, (None, config.hidden), "(num_tokens, hidden)", 1, rank)
    check_num_tokens(config, shape[0], rank)
    check_topk(config, inputs.topk_idx, inputs.topk_weights, shape[0], rank)
    return shape[0]


def validate_world(config: MoeEpConfig, per_rank: Sequence[Any], name: str) -> None:
    """A world-level argument must hold exactly one entry per rank."""
    if isinstance(per_rank, (str, bytes)) or not isinstance(per_rank, Sequence):
        raise ShapeError(
            f"{name} must be a sequence with one entry per rank (num_ranks = {config.num_ranks}); "
            f"got {type(per_rank).__name__}",
            name=name,
            expected=config.num_ranks,
            got=type(per_rank),
        )
    if len(per_rank) != config.num_ranks:
        raise ShapeError(
            f"{name} must have one entry per rank: length num_ranks = {config.num_ranks}; got {len(per_rank)}",
            name=name,
            expected=config.num_ranks,
            got=len(per_rank),
        )


def check_handle(config: MoeEpConfig, handle: Any, rank: int) -> DispatchHandle:
    """Entry ``rank`` of a world-level ``handles`` argument must be rank ``rank``'s
    :class:`~moe_ep_spec.DispatchHandle` of a dispatch with ``config``'s
    ``num_ranks`` and ``num_topk``."""
    if not isinstance(handle, DispatchHandle):
        raise DTypeError(f"handles[{rank}] must be a DispatchHandle; got {type(handle).__name__}", name="handles")
    h = handle
    if h.rank != rank or h.num_ranks != config.num_ranks or h.num_topk != config.num_topk:
        raise ShapeError(
            f"handles[{rank}] must be rank {rank}'s handle of a dispatch with num_ranks = {config.num_ranks} and "
            f"num_topk = {config.num_topk}; got rank {h.rank}, num_ranks {h.num_ranks}, num_topk {h.num_topk}",
            name="handles",
        )
    return handle


def validate_grad(
    name: str, grad: Any, shape: Tuple[int, ...], what: str, rank: Optional[int] = None
) -> np.ndarray:
    """A cotangent must be a plain float array of exactly ``shape``."""
    return check_float_array(name, grad, shape, what, rank)


def validate_stash(config: MoeEpConfig, stash: Stash, expected_rows: int, rank: Optional[int] = None) -> None:
    """``fc1_c`` ``[R, 2I]`` bfloat16 and ``route_metadata`` ``[R, 4]`` int32, with
    R the number of rows the forward produced on this rank."""
    p = _prefix(rank)
    if not isinstance(stash, Stash):
        raise DTypeError(f"{p}stash must be a Stash; got {type(stash).__name__}", name="stash", got=type(stash))
    fc1_c, meta = stash.fc1_c, stash.route_metadata
    if not isinstance(fc1_c, np.ndarray) or fc1_c.dtype != BF16:
        got = fc1_c.dtype.name if isinstance(fc1_c, np.ndarray) else type(fc1_c).__name__
        raise DTypeError(f"{p}fc1_c must have dtype bfloat16; got {got}", name="fc1_c", expected="bfloat16", got=got)
    if not isinstance(meta, np.ndarray) or meta.dtype != np.int32:
        got = meta.dtype.name if isinstance(meta, np.ndarray) else type(meta).__name__
        raise DTypeError(
            f"{p}route_metadata must have dtype int32; got {got}", name="route_metadata", expected="int32", got=got
        )
    check_shape("fc1_c", tuple(fc1_c.shape), (expected_rows, 2 * config.intermediate), "(rows, 2 * intermediate)", rank)
    check_shape("route_metadata", tuple(meta.shape), (expected_rows, 4), "(rows, 4)", rank)


def validate_expert_out(config: MoeEpConfig, expert_out: Any, handle: DispatchHandle) -> np.ndarray:
    """``combine``'s input: ``[R, H]`` plain float, R the rows the handle's dispatch made."""
    if not isinstance(handle, DispatchHandle):
        raise DTypeError(f"handle must be a DispatchHandle; got {type(handle).__name__}", name="handle", got=type(handle))
    return check_float_array(
        "expert_out", expert_out, (handle.num_recv_rows, config.hidden), "(received rows, hidden)", handle.rank
    )
