"""MoeEp for torch users: differentiable, over a ``torch.distributed`` process group.

Example (every rank runs the same code)::

    import torch, torch.distributed as dist
    from moe_ep_spec import MoeEpConfig
    from moe_ep_torch.api import moe_ep

    dist.init_process_group("nccl")          # or "gloo" on CPU
    config = MoeEpConfig(num_experts=64, hidden=4096, intermediate=1024, num_topk=8,
                         num_ranks=dist.get_world_size())
    out = moe_ep(x, w1, w2, topk_idx, topk_weights, config=config)   # [T, H] bf16
    out.float().square().mean().backward()    # grads for x, w1, w2, topk_weights

``moe_ep`` is the custom op ``moe_ep::forward`` (``torch.library.custom_op``)
with a registered autograd formula (the spec's backward, itself the custom op
``moe_ep::backward``) and fake kernels, so it works under ``torch.compile``
tracing and passes ``torch.library.opcheck``.

Host synchronisation: one per call (see :mod:`moe_ep_torch.core`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from moe_ep_spec import errors as E
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.formats import MoeFormat
from moe_ep_spec.validation import check_shape

from . import core
from .formats import TorchBlockScaled

__all__ = [
    "moe_ep", "moe_ep_backward", "moe_ep_forward_with_stash", "ForwardWithStash", "LayerOps", "OPS", "run_forward",
    "run_backward", "config_to_json", "config_from_json",
]

_PLAIN = (torch.float32, torch.float16, torch.bfloat16)


def config_to_json(config: MoeEpConfig) -> str:
    """The configuration as the string the custom ops take."""
    return json.dumps({k: (v.value if isinstance(v, MoeFormat) else v) for k, v in vars(config).items()}, sort_keys=True)


def config_from_json(text: str) -> MoeEpConfig:
    return MoeEpConfig(**json.loads(text))


def _group(group: Optional[Any]) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise E.ConfigError("moe_ep needs an initialised torch.distributed process group (dist.init_process_group)")
    return group if group is not None else dist.group.WORLD


def _group_name(group: Any) -> str:
    return group.group_name


def _resolve(name: str) -> Any:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _check(
    config: MoeEpConfig, group: Any, activation: Tensor, fc1: Any, fc2: Any, idx: Tensor, weights: Tensor,
    *, group_moves_rows: bool = True,
) -> None:
    """The spec's input rules for torch tensors (messages as moe_ep_spec.validation).
    ``group_moves_rows`` False: the group's collectives never see the tensors (a
    device exchange moves them), so any backend of the group takes any device."""
    rank = dist.get_rank(group)
    p = f"rank {rank}: "
    h, i, el, k = config.hidden, config.intermediate, config.num_local_experts, config.num_topk

    def shape(name: str, t: Any, want: Tuple[Any, ...], what: str) -> None:
        check_shape(name, tuple(t.shape), want, what, rank)

    for name, t in (("activation", activation), ("fc1_weight", fc1), ("fc2_weight", fc2)):
        if isinstance(t, TorchBlockScaled):
            t.validate()
        elif not isinstance(t, Tensor) or t.dtype not in _PLAIN:
            got = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise E.DTypeError(f"{p}{name} must have dtype in (float32, float16, bfloat16); got {got}", name=name, got=got)
    shape("activation", activation, (None, h), "(num_tokens, hidden)")
    num_tokens = activation.shape[0]
    fc1_shape = (el, 2 * i, h) if isinstance(fc1, TorchBlockScaled) else (el, h, 2 * i)
    fc2_shape = (el, h, i) if isinstance(fc2, TorchBlockScaled) else (el, i, h)
    shape("fc1_weight", fc1, fc1_shape, "(num_local_experts, hidden, 2 * intermediate)")
    shape("fc2_weight", fc2, fc2_shape, "(num_local_experts, intermediate, hidden)")
    if idx.dtype not in (torch.int32, torch.int64):
        raise E.DTypeError(f"{p}topk_idx must have dtype in (int32, int64); got {idx.dtype}", name="topk_idx", got=idx.dtype)
    shape("topk_idx", idx, (num_tokens, k), "(num_tokens, num_topk)")
    if weights.dtype not in _PLAIN:
        raise E.DTypeError(f"{p}topk_weights must have dtype in (float32, float16, bfloat16); got {weights.dtype}")
    shape("topk_weights", weights, (num_tokens, k), "(num_tokens, num_topk)")
    if config.max_tokens_per_rank is not None and num_tokens > config.max_tokens_per_rank:
        raise E.CapacityError(
            f"{p}num_tokens must be <= max_tokens_per_rank = {config.max_tokens_per_rank}; got {num_tokens}",
            limit=config.max_tokens_per_rank,
            got=num_tokens,
        )
    device = activation.device
    for name, t in (("fc1_weight", fc1), ("fc2_weight", fc2), ("topk_idx", idx), ("topk_weights", weights)):
        if t.device != device:
            raise E.DeviceError(f"{p}{name} must be on the activation's device {device}; got {t.device}")
    if not group_moves_rows:
        return
    backend = dist.get_backend(group)
    if backend == "nccl" and device.type != "cuda":
        raise E.DeviceError(f"{p}an NCCL process group needs CUDA tensors; got tensors on {device}")
    if backend == "gloo" and device.type != "cpu":
        raise E.DeviceError(f"{p}a gloo process group here needs CPU tensors; got tensors on {device}")


def _comm_device(group: Any) -> torch.device:
    """Where this group's collectives take tensors: the current CUDA device for
    NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encoding(t: Any) -> str:
    return t.format.value if isinstance(t, TorchBlockScaled) else str(t.dtype)


def _check_group(config: MoeEpConfig, group: Any) -> None:
    """Same answer on every rank, so raising here leaves no rank in a collective."""
    size = dist.get_world_size(group)
    if size != config.num_ranks:
        raise E.ConfigError(
            f"rank {dist.get_rank(group)}: the process group's size must equal num_ranks = {config.num_ranks}; got {size}",
            field="num_ranks",
            value=size,
        )


def run_forward(
    prims: Any, config: MoeEpConfig, group: Any, activation: Any, fc1: Any, fc2: Any, idx: Tensor, weights: Tensor,
    stash: bool = True,
) -> dict:
    """The fused forward of this rank over ``group`` with ``prims`` (a
    :class:`~moe_ep_torch.core.Primitives`): ``{"output", "fc1_c", "route_metadata"}``.
    Every rank raises the same error class when any rank's input breaks a rule.
    ``stash`` (False: no backward follows) is a hint a front-end may use to skip writing
    ``fc1_c``; this one keeps it either way (its FC1 output is that stash)."""
    _check_group(config, group)
    error: Optional[BaseException] = None
    try:
        _check(config, group, activation, fc1, fc2, idx, weights)
    except E.MoeEpError as exc:
        error = exc
    device = _comm_device(group)  # the plan's collectives run where the group can reach, whatever the inputs
    extra = "|".join(_encoding(t) for t in (activation, fc1, fc2)) if error is None else ""
    payload = core.route_payload(activation, weights, config.num_topk) if error is None else None
    num_tokens = int(activation.shape[0]) if error is None else 0
    plan, recv = core.make_plan(
        config, idx if error is None else None, num_tokens, group, device, error, extra, payload, prims
    )
    return core.forward(config, plan, recv, activation, prims.decode_weight(fc1), prims.decode_weight(fc2), group, prims)


def run_backward(
    prims: Any,
    config: MoeEpConfig,
    group: Any,
    grad_output: Tensor,
    activation: Any,
    fc1: Any,
    fc2: Any,
    idx: Tensor,
    weights: Tensor,
    fc1_c: Tensor,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The spec backward of this rank over ``group`` with ``prims``: float32
    ``(grad_activation, grad_fc1_weight, grad_fc2_weight, grad_topk_weights)``."""
    _check_group(config, group)
    _check(config, group, activation, fc1, fc2, idx, weights)
    payload = core.route_payload(activation, weights, config.num_topk, extra=[core.cotangent(grad_output)])
    plan, recv = core.make_plan(
        config, idx, int(activation.shape[0]), group, activation.device, None,
        "|".join(_encoding(t) for t in (activation, fc1, fc2)), payload, prims,
    )
    if fc1_c.shape[0] != plan.num_rows:
        raise E.StashError(f"fc1_c must have {plan.num_rows} rows (the routes of topk_idx); got {fc1_c.shape[0]}")
    g = core.backward(
        config, plan, recv, activation, prims.decode_weight(fc1), prims.decode_weight(fc2), fc1_c, group, prims
    )
    return g["grad_activation"], g["grad_fc1_weight"], g["grad_fc2_weight"], g["grad_topk_weights"]


@dataclass(frozen=True)
class ForwardWithStash:
    """A forward's output and what the spec's explicit backward needs of it
    (:meth:`LayerOps.moe_ep_forward_with_stash`).

    Attributes:
        output: ``[T, H]`` bfloat16, or a
            :class:`~moe_ep_torch.formats.TorchBlockScaled` for a block-scaled
            ``output_format``: the layer's output (no autograd).
        fc1_c: ``[R, 2I]`` bfloat16: the stash, the bf16 rounding of each processed
            route's FC1 accumulator (pre-clamp, unweighted); R is the routes this rank
            processed (``config.recv_capacity`` in the static-shape modes, padding rows zero).
        route_metadata: ``[R, 4]`` int32: ``(local_expert, src_rank, src_token, src_slot)``
            of each stash row (-1 on padding rows).
    """

    output: Any
    fc1_c: Tensor
    route_metadata: Tensor


# ----------------------------------------------------------------------------- custom ops

ForwardFn = Callable[..., dict]
BackwardFn = Callable[..., Tuple[Tensor, Tensor, Tensor, Tensor]]


class LayerOps:
    """``moe_ep`` and ``moe_ep_backward`` as two ``torch.library`` custom ops,
    ``{namespace}::forward`` and ``{namespace}::backward``, with the spec's
    backward registered as the forward's autograd formula and fake kernels
    (``torch.compile`` tracing, ``torch.library.opcheck``).

    Every torch front-end shares this layer and brings its own computation:
    ``run_forward(config, group, activation, fc1, fc2, topk_idx, topk_weights,
    stash=True)`` returns ``{"output", "fc1_c", "route_metadata"}`` (with
    ``stash=False``, when no backward follows, ``fc1_c`` may be None: a front-end
    need not write the stash) and ``run_backward(config,
    group, grad_output, activation, fc1, fc2, topk_idx, topk_weights, fc1_c)``
    the four float32 gradients (:func:`run_forward` / :func:`run_backward` with
    a :class:`~moe_ep_torch.core.Primitives` are the usual pair).

    Args:
        namespace: the custom ops' namespace (unique per process).
        fixed_rows: where the stash has ``config.recv_capacity`` rows whatever
            the routing (a static-shape mode), so the fake kernels say so.
    """

    def __init__(self, namespace: str, run_forward: ForwardFn, run_backward: BackwardFn, fixed_rows: bool = False) -> None:
        self.namespace = namespace

        @torch.library.custom_op(f"{namespace}::forward", mutates_args=())
        def forward_op(
            activation: Tensor,
            fc1_weight: Tensor,
            fc2_weight: Tensor,
            topk_idx: Tensor,
            topk_weights: Tensor,
            config_json: str,
            group_name: str,
        ) -> Tuple[Tensor, Tensor, Tensor]:
            """``(output [T, H] bf16, fc1_c [R, 2I] bf16, route_metadata [R, 4] int32)``."""
            config = config_from_json(config_json)
            out = run_forward(config, _resolve(group_name), activation, fc1_weight, fc2_weight, topk_idx, topk_weights)
            return out["output"], out["fc1_c"], out["route_metadata"].clone()

        @forward_op.register_fake
        def _forward_fake(activation, fc1_weight, fc2_weight, topk_idx, topk_weights, config_json, group_name):
            config = config_from_json(config_json)
            rows = config.recv_capacity if fixed_rows else torch.library.get_ctx().new_dynamic_size()
            out = activation.new_empty((activation.shape[0], config.hidden), dtype=torch.bfloat16)
            fc1_c = activation.new_empty((rows, 2 * config.intermediate), dtype=torch.bfloat16)
            meta = activation.new_empty((rows, 4), dtype=torch.int32)
            return out, fc1_c, meta

        @torch.library.custom_op(f"{namespace}::forward_inference", mutates_args=())
        def forward_inference_op(
            activation: Tensor,
            fc1_weight: Tensor,
            fc2_weight: Tensor,
            topk_idx: Tensor,
            topk_weights: Tensor,
            config_json: str,
            group_name: str,
        ) -> Tensor:
            """``output [T, H] bf16``: the forward when no backward follows (no autograd
            formula), which need not write the stash."""
            config = config_from_json(config_json)
            out = run_forward(config, _resolve(group_name), activation, fc1_weight, fc2_weight, topk_idx, topk_weights,
                              stash=False)
            return out["output"]

        @forward_inference_op.register_fake
        def _forward_inference_fake(activation, fc1_weight, fc2_weight, topk_idx, topk_weights, config_json,
                                    group_name):
            config = config_from_json(config_json)
            return activation.new_empty((activation.shape[0], config.hidden), dtype=torch.bfloat16)

        @torch.library.custom_op(f"{namespace}::backward", mutates_args=())
        def backward_op(
            grad_output: Tensor,
            activation: Tensor,
            fc1_weight: Tensor,
            fc2_weight: Tensor,
            topk_idx: Tensor,
            topk_weights: Tensor,
            fc1_c: Tensor,
            config_json: str,
            group_name: str,
        ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
            """The spec backward: float32 ``(grad_activation, grad_fc1_weight,
            grad_fc2_weight, grad_topk_weights)``."""
            config = config_from_json(config_json)
            return run_backward(
                config, _resolve(group_name), grad_output, activation, fc1_weight, fc2_weight, topk_idx, topk_weights,
                fc1_c,
            )

        @backward_op.register_fake
        def _backward_fake(grad_output, activation, fc1_weight, fc2_weight, topk_idx, topk_weights, fc1_c, config_json, group_name):
            f32 = torch.float32
            return (
                activation.new_empty(activation.shape, dtype=f32),
                fc1_weight.new_empty(fc1_weight.shape, dtype=f32),
                fc2_weight.new_empty(fc2_weight.shape, dtype=f32),
                topk_weights.new_empty(topk_weights.shape, dtype=f32),
            )

        def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor, Tensor]) -> None:
            activation, fc1, fc2, idx, weights, config_json, group_name = inputs
            _, fc1_c, _ = output
            ctx.save_for_backward(activation, fc1, fc2, idx, weights, fc1_c)
            ctx.config_json = config_json
            ctx.group_name = group_name

        def autograd_backward(ctx: Any, grad_out: Tensor, _grad_c: Any, _grad_meta: Any) -> Tuple[Any, ...]:
            activation, fc1, fc2, idx, weights, fc1_c = ctx.saved_tensors
            gx, g1, g2, gw = backward_op(grad_out, activation, fc1, fc2, idx, weights, fc1_c, ctx.config_json, ctx.group_name)
            return gx, g1, g2, None, gw, None, None

        forward_op.register_autograd(autograd_backward, setup_context=setup_context)
        self.forward_op = forward_op
        self.forward_inference_op = forward_inference_op
        self.backward_op = backward_op
        self._run_forward = run_forward
        self._run_backward = run_backward

    def moe_ep(self, activation: Any, fc1_weight: Any, fc2_weight: Any, topk_idx: Tensor, topk_weights: Tensor, *,
               config: MoeEpConfig, group: Optional[Any] = None) -> Any:
        """The MoeEp layer on this rank (collective over ``group``).

        Args:
            activation: ``[T, H]`` float32/float16/bfloat16 (differentiable): this
                rank's tokens (T may differ per rank and may be 0), or a
                :class:`~moe_ep_torch.formats.TorchBlockScaled` blocked along H.
            fc1_weight: ``[E_local, H, 2I]`` float (differentiable): FC1 of this
                rank's experts, gate columns first, or a
                TorchBlockScaled of the transposed weight ``[E_local, 2I, H]``
                blocked along H.
            fc2_weight: ``[E_local, I, H]`` float (differentiable), or a
                TorchBlockScaled of ``[E_local, H, I]`` blocked along I.
            topk_idx: ``[T, K]`` int32/int64 in ``[-1, E)``: global expert ids; -1 marks an unused slot.
            topk_weights: ``[T, K]`` float (differentiable): router weights, read as float32.
            config: the layer; ``config.num_ranks`` must equal the group's size.
            group: the process group (default: the world).

        Returns:
            ``[T, H]`` bfloat16 when ``config.output_format`` is bf16
            (differentiable: gradients follow the spec's backward, with every
            rounding straight-through); otherwise a TorchBlockScaled (no autograd).
            Every rank raises the same error class when any rank's input breaks a rule.
        """
        group = _group(group)
        plain = all(isinstance(t, Tensor) for t in (activation, fc1_weight, fc2_weight))
        wants_grad = torch.is_grad_enabled() and any(
            isinstance(t, Tensor) and t.requires_grad for t in (activation, fc1_weight, fc2_weight, topk_weights)
        )
        if config.output_format is MoeFormat.BF16 and plain:
            args = (activation, fc1_weight, fc2_weight, topk_idx, topk_weights, config_to_json(config),
                    _group_name(group))
            if wants_grad:
                out, _, _ = self.forward_op(*args)
                return out
            return self.forward_inference_op(*args)  # no backward to come: the stash need not be written
        if wants_grad:
            raise E.CapabilityError(
                "moe_ep is differentiable with plain float inputs and output_format bf16; got "
                f"output_format {config.output_format.value} / block-scaled inputs with requires_grad "
                "(train with moe_ep_forward_with_stash, then moe_ep_backward)",
                feature="autograd",
            )
        with torch.no_grad():
            return self._run_forward(config, group, activation, fc1_weight, fc2_weight, topk_idx, topk_weights,
                                     stash=False)["output"]

    def moe_ep_forward_with_stash(self, activation: Any, fc1_weight: Any, fc2_weight: Any, topk_idx: Tensor,
                                  topk_weights: Tensor, *, config: MoeEpConfig,
                                  group: Optional[Any] = None) -> ForwardWithStash:
        """The forward of a training step whose backward is the explicit
        :meth:`moe_ep_backward` (spec section 3, ``generate_c``): for any input
        format, block-scaled ones included, which autograd does not take.
        Arguments as :meth:`moe_ep`; nothing is recorded for autograd.

        Returns:
            :class:`ForwardWithStash`: the output, ``fc1_c`` and ``route_metadata``.
        """
        group = _group(group)
        with torch.no_grad():
            out = self._run_forward(config, group, activation, fc1_weight, fc2_weight, topk_idx, topk_weights)
        return ForwardWithStash(output=out["output"], fc1_c=out["fc1_c"], route_metadata=out["route_metadata"])

    def moe_ep_backward(self, grad_output: Tensor, activation: Any, fc1_weight: Any, fc2_weight: Any, topk_idx: Tensor,
                        topk_weights: Tensor, fc1_c: Tensor, *, config: MoeEpConfig,
                        group: Optional[Any] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The spec's explicit backward (collective): float32 ``(grad_activation
        [T, H], grad_fc1_weight [E_local, H, 2I], grad_fc2_weight [E_local, I, H],
        grad_topk_weights [T, K])`` from the forward's inputs (plain or
        block-scaled, as :meth:`moe_ep` takes them; every rounding is
        straight-through, so a block-scaled input's gradient is that of its decoded
        values) and its ``fc1_c`` stash (:meth:`moe_ep_forward_with_stash`, or the
        custom op's second output). With plain inputs it is the custom op
        ``{namespace}::backward``; with block-scaled ones the same computation
        called directly (a custom op takes tensors only)."""
        group = _group(group)
        if not all(isinstance(t, Tensor) for t in (activation, fc1_weight, fc2_weight)):
            with torch.no_grad():
                return self._run_backward(
                    config, group, grad_output, activation, fc1_weight, fc2_weight, topk_idx, topk_weights, fc1_c
                )
        return self.backward_op(
            grad_output, activation, fc1_weight, fc2_weight, topk_idx, topk_weights, fc1_c,
            config_to_json(config), _group_name(group),
        )


#: The torch backend's ops: ``moe_ep::forward`` and ``moe_ep::backward``.
OPS = LayerOps("moe_ep", partial(run_forward, core.TORCH), partial(run_backward, core.TORCH))
_forward_op, _backward_op = OPS.forward_op, OPS.backward_op


# ----------------------------------------------------------------------------- public

#: The MoeEp layer on this rank: :meth:`LayerOps.moe_ep` of :data:`OPS`.
moe_ep = OPS.moe_ep
#: The spec's explicit backward: :meth:`LayerOps.moe_ep_backward` of :data:`OPS`.
moe_ep_backward = OPS.moe_ep_backward
#: The forward with the stash its explicit backward takes: :meth:`LayerOps.moe_ep_forward_with_stash` of :data:`OPS`.
moe_ep_forward_with_stash = OPS.moe_ep_forward_with_stash
