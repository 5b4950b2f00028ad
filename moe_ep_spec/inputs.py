"""Random MoeEp inputs for a whole world: for the CLI, the conformance suite,
benchmarks and users' own tests. Never zeros, always reproducible from a seed.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Union

import numpy as np

from .api import DispatchInputs, RankInputs, Tensor
from .config import MoeEpConfig
from .errors import ConfigError
from .formats import BF16, quantize

__all__ = ["ROUTINGS", "INPUT_FORMATS", "random_topk", "random_world", "random_dispatch_world"]

#: Routing patterns :func:`random_topk` can make.
ROUTINGS = ("uniform", "skewed", "one_rank", "unused_mixed", "all_unused")
#: Encodings of activation and weights: plain float32 or bfloat16, or block-scaled.
INPUT_FORMATS = ("fp32", "bf16", "mxfp8", "nvfp4")


def _token_count(value: Any, where: str) -> int:
    """One rank's token count: an integer >= 0 (ConfigError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(
            f"num_tokens{where} must be an integer >= 0; got {type(value).__name__} {value!r}",
            field="num_tokens",
            value=value,
        )
    if value < 0:
        raise ConfigError(f"num_tokens{where} must be an integer >= 0; got {int(value)}", field="num_tokens", value=value)
    return int(value)


def _tokens_per_rank(config: MoeEpConfig, num_tokens: Union[int, Sequence[int]]) -> List[int]:
    if isinstance(num_tokens, (int, np.integer)) and not isinstance(num_tokens, bool):
        return [_token_count(num_tokens, "")] * config.num_ranks
    if isinstance(num_tokens, (str, bytes)) or not isinstance(num_tokens, Sequence) and not isinstance(num_tokens, np.ndarray):
        raise ConfigError(
            f"num_tokens must be an integer >= 0 or one such count per rank (num_ranks = {config.num_ranks}); "
            f"got {type(num_tokens).__name__} {num_tokens!r}",
            field="num_tokens",
            value=num_tokens,
        )
    if len(num_tokens) != config.num_ranks:
        raise ConfigError(
            f"num_tokens must be an int or one count per rank (num_ranks = {config.num_ranks}); got {len(num_tokens)}",
            field="num_tokens",
            value=num_tokens,
        )
    return [_token_count(t, f"[{rank}]") for rank, t in enumerate(num_tokens)]


def random_topk(
    config: MoeEpConfig, num_tokens: int, routing: str, rng: np.random.Generator
) -> np.ndarray:
    """``[num_tokens, num_topk] int32`` expert ids for one rank.

    ``uniform``: K distinct experts per token, uniformly. ``skewed``: slot 0 of
    every token goes to expert 0, the rest uniform and distinct. ``one_rank``:
    every route goes to an expert of rank 0 (ids may repeat when K exceeds
    num_local_experts). ``unused_mixed``: uniform, then about a third of the
    slots set to -1. ``all_unused``: every slot -1.
    """
    k, e, el = config.num_topk, config.num_experts, config.num_local_experts
    if routing not in ROUTINGS:
        raise ConfigError(f"routing must be one of {ROUTINGS}; got {routing!r}", field="routing", value=routing)
    if routing == "all_unused":
        return np.full((num_tokens, k), -1, dtype=np.int32)
    if routing == "one_rank":
        return rng.integers(0, el, size=(num_tokens, k)).astype(np.int32)
    idx = np.argsort(rng.random((num_tokens, e)), axis=1)[:, :k].astype(np.int32)
    if routing == "skewed" and num_tokens:
        # Put expert 0 first: swap it into slot 0 where it was elsewhere.
        for t in range(num_tokens):
            row = list(idx[t])
            if 0 in row:
                row.remove(0)
            else:
                row.pop()
            idx[t] = [0] + row
    if routing == "unused_mixed":
        idx[rng.random((num_tokens, k)) < 1 / 3] = -1
    return idx


def _encode(values: np.ndarray, input_format: str, axis: int) -> Tensor:
    if input_format == "fp32":
        return values.astype(np.float32)
    if input_format == "bf16":
        return values.astype(np.float32).astype(BF16)
    return quantize(values, input_format, axis=axis)


def random_world(
    config: MoeEpConfig,
    *,
    num_tokens: Union[int, Sequence[int]],
    routing: str = "uniform",
    input_format: str = "bf16",
    weight_format: Union[str, None] = None,
    seed: int = 0,
    topk_weights_format: str = "fp32",
) -> List[RankInputs]:
    """One :class:`RankInputs` per rank with reproducible random values.

    Args:
        config: the layer.
        num_tokens: tokens per rank: one int for all ranks, or one per rank.
        routing: one of :data:`ROUTINGS`.
        input_format: encoding of the activation (one of :data:`INPUT_FORMATS`).
        weight_format: encoding of both weights; default: ``input_format``.
        seed: the random seed.
        topk_weights_format: ``fp32`` or ``bf16``: the router weights' dtype.

    Values: activation ~ N(0, 1); fc1_weight ~ N(0, 1/H); fc2_weight ~ N(0, 1/I),
    so every stage keeps unit scale; topk_weights in (0.05, 1), float32.
    """
    if input_format not in INPUT_FORMATS:
        raise ConfigError(f"input_format must be one of {INPUT_FORMATS}; got {input_format!r}", field="input_format")
    weight_format = input_format if weight_format is None else weight_format
    if weight_format not in INPUT_FORMATS:
        raise ConfigError(f"weight_format must be one of {INPUT_FORMATS}; got {weight_format!r}", field="weight_format")
    if topk_weights_format not in ("fp32", "bf16"):
        raise ConfigError(
            f"topk_weights_format must be 'fp32' or 'bf16'; got {topk_weights_format!r}", field="topk_weights_format"
        )
    rng = np.random.default_rng(seed)
    h, i, el = config.hidden, config.intermediate, config.num_local_experts
    world = []
    for t in _tokens_per_rank(config, num_tokens):
        act = rng.standard_normal((t, h))
        fc1 = rng.standard_normal((el, h, 2 * i)) / np.sqrt(h)
        fc2 = rng.standard_normal((el, i, h)) / np.sqrt(i)
        world.append(
            RankInputs(
                activation=_encode(act, input_format, axis=1),
                fc1_weight=_encode(fc1, weight_format, axis=1),
                fc2_weight=_encode(fc2, weight_format, axis=1),
                topk_idx=random_topk(config, t, routing, rng),
                topk_weights=_encode(rng.uniform(0.05, 1.0, size=(t, config.num_topk)), topk_weights_format, axis=1),
            )
        )
    return world


def random_dispatch_world(
    config: MoeEpConfig,
    *,
    num_tokens: Union[int, Sequence[int]],
    routing: str = "uniform",
    input_format: str = "bf16",
    seed: int = 0,
) -> List[DispatchInputs]:
    """One :class:`DispatchInputs` per rank (tokens, topk_idx, topk_weights)."""
    return [
        DispatchInputs(tokens=r.activation, topk_idx=r.topk_idx, topk_weights=r.topk_weights)
        for r in random_world(config, num_tokens=num_tokens, routing=routing, input_format=input_format, seed=seed)
    ]
