"""MoeEp for PyTorch users on the native CUDA kernels and NCCL transport.

The same layer as :mod:`moe_ep_torch.api` (custom ops with the spec's backward
as their autograd formula, the same validation and error sharing), run on the
native core: ``moe_ep_cuda_nccl::forward`` / ``::backward``, and for the
static-shape mode ``moe_ep_cuda_nccl_static::forward`` / ``::backward``.

Example (every rank; ``dist.init_process_group("nccl")`` first)::

    from moe_ep_cuda_nccl.api import moe_ep, check_errors, close_communicators

    out = moe_ep(x, w1, w2, topk_idx, topk_weights, config=config)   # one host sync
    out.float().square().mean().backward()

    # static shapes, no host synchronisation, CUDA-graph capturable:
    config = MoeEpConfig(..., max_tokens_per_rank=4096, recv_capacity=C, expert_alignment=16)
    out = moe_ep(x, w1, w2, topk_idx, topk_weights, config=config, host_sync=False)
    check_errors(config)            # when convenient (one sync): bad ids, overflow
    close_communicators()           # before dist.destroy_process_group()
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any, Callable, Optional, Tuple

import torch
from torch import Tensor

from moe_ep_spec.config import MoeEpConfig
from moe_ep_torch.api import (ForwardWithStash, LayerOps, _group, _resolve, config_from_json, run_backward,
                              run_forward)

from . import device_exchange, static
from .prims import NATIVE, MainGrads, main_grad_of
from .prims import close_communicators as _close_nccl

__all__ = ["moe_ep", "moe_ep_default", "default_static_config", "moe_ep_backward", "moe_ep_forward_with_stash",
           "check_errors", "close_communicators", "OPS", "STATIC_OPS", "DEVICE_OPS"]

#: Host-synchronised ops (one host synchronisation per call, any layout).
OPS = LayerOps("moe_ep_cuda_nccl", partial(run_forward, NATIVE), partial(run_backward, NATIVE))
#: Static-shape ops (no host synchronisation; static layout and max_tokens_per_rank required).
STATIC_OPS = LayerOps(
    "moe_ep_cuda_nccl_static", partial(static.forward, NATIVE), partial(static.backward, NATIVE), fixed_rows=True
)
#: Static-shape ops over the native layer's device exchange (:mod:`moe_ep_cuda_nccl.device_exchange`).
DEVICE_OPS = LayerOps(
    "moe_ep_cuda_nccl_device",
    partial(device_exchange.forward, NATIVE),
    partial(device_exchange.backward, NATIVE),
    fixed_rows=True,
)


def _synced_backward_into(config: MoeEpConfig, group: Any, grad_output: Tensor, activation: Any, fc1: Any, fc2: Any,
                          idx: Tensor, weights: Tensor, fc1_c: Tensor,
                          main_grads: MainGrads) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The host-synchronised backward with main_grad accumulators: its float32 weight
    gradients added to them (one float32 addition; the experts run in the shared torch
    front-end, :func:`moe_ep_torch.api.run_backward`, which writes fresh gradients)."""
    gx, g1, g2, gw = run_backward(NATIVE, config, group, grad_output, activation, fc1, fc2, idx, weights, fc1_c)
    if main_grads.fc1 is not None:
        main_grads.fc1.add_(g1)
        g1 = main_grads.fc1
    if main_grads.fc2 is not None:
        main_grads.fc2.add_(g2)
        g2 = main_grads.fc2
    return gx, g1, g2, gw


def _accumulate_into_main_grad(ops: LayerOps, backward_into: Callable[..., Tuple[Tensor, ...]],
                               bf16_weight_grads: bool = False) -> None:
    """Give ``ops``' autograd formula Megatron's ``main_grad`` convention: when an expert
    weight carries a float32 ``main_grad`` (:func:`moe_ep_cuda_nccl.prims.main_grad_of`),
    its gradient is added there by ``backward_into`` (a mutating custom op,
    ``{namespace}::backward_main_grad``) and autograd gets None for it, so ``.grad`` is
    left alone and nothing is cast. With ``bf16_weight_grads`` (``backward_into`` writes
    the experts itself), when neither weight has a ``main_grad`` and the activation and
    both weights are bf16 tensors, the weight gradients come out of the native GEMMs as
    bf16 (``MOE_EP_BACKWARD_WEIGHT_GRADS_BF16``): autograd gets the leaves' dtype, no
    cast pass. Otherwise the weights get their float32 gradient (cast by autograd to the
    leaf's dtype), as before."""
    ns = ops.namespace

    @torch.library.custom_op(f"{ns}::backward_main_grad", mutates_args=("fc1_main_grad", "fc2_main_grad"))
    def backward_main_grad(
        grad_output: Tensor,
        activation: Tensor,
        fc1_weight: Tensor,
        fc2_weight: Tensor,
        topk_idx: Tensor,
        topk_weights: Tensor,
        fc1_c: Tensor,
        fc1_main_grad: Optional[Tensor],
        fc2_main_grad: Optional[Tensor],
        config_json: str,
        group_name: str,
        weight_grads_bf16: bool = False,
    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """The spec backward, the weight gradients added to the given main grads: float32
        ``(grad_activation, grad_fc1_weight, grad_fc2_weight, grad_topk_weights)``, a weight
        result empty ``[0]`` where its gradient went into its main grad. ``weight_grads_bf16``
        (no main grads, bf16 activation and weights): the two weight results are bfloat16."""
        config = config_from_json(config_json)
        main = MainGrads(fc1_main_grad, fc2_main_grad, bf16=weight_grads_bf16)
        gx, g1, g2, gw = backward_into(config, _resolve(group_name), grad_output, activation, fc1_weight, fc2_weight,
                                       topk_idx, topk_weights, fc1_c, main)
        return (gx, gx.new_empty((0,)) if fc1_main_grad is not None else g1,
                gx.new_empty((0,)) if fc2_main_grad is not None else g2, gw)

    @backward_main_grad.register_fake
    def _fake(grad_output, activation, fc1_weight, fc2_weight, topk_idx, topk_weights, fc1_c, fc1_main_grad,
              fc2_main_grad, config_json, group_name, weight_grads_bf16=False):
        f32 = torch.float32
        wdt = torch.bfloat16 if weight_grads_bf16 else f32
        return (
            activation.new_empty(activation.shape, dtype=f32),
            fc1_weight.new_empty((0,) if fc1_main_grad is not None else fc1_weight.shape, dtype=wdt),
            fc2_weight.new_empty((0,) if fc2_main_grad is not None else fc2_weight.shape, dtype=wdt),
            topk_weights.new_empty(topk_weights.shape, dtype=f32),
        )

    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor, Tensor]) -> None:
        activation, fc1, fc2, idx, weights, config_json, group_name = inputs
        ctx.save_for_backward(activation, fc1, fc2, idx, weights, output[1])
        ctx.config_json = config_json
        ctx.group_name = group_name
        # The stash and the metadata have no cotangent: not materialised as zeros (a [C, 2I] fill).
        ctx.set_materialize_grads(False)
        ctx.out_like = (tuple(output[0].shape), output[0].dtype)

    def autograd_backward(ctx: Any, grad_out: Optional[Tensor], _grad_c: Any, _grad_meta: Any) -> Tuple[Any, ...]:
        activation, fc1, fc2, idx, weights, fc1_c = ctx.saved_tensors
        if grad_out is None:  # the output unused: its cotangent is zero
            shape, dtype = ctx.out_like
            grad_out = torch.zeros(shape, dtype=dtype, device=idx.device)
        m1, m2 = main_grad_of(fc1), main_grad_of(fc2)
        bf16 = torch.bfloat16
        if (m1 is None and m2 is None and bf16_weight_grads and activation.dtype == bf16 and fc1.dtype == bf16
                and fc2.dtype == bf16):
            # bf16 leaves without main_grad: their bf16 gradients written by the native GEMMs.
            gx, g1, g2, gw = backward_main_grad(grad_out, activation, fc1, fc2, idx, weights, fc1_c, None, None,
                                                ctx.config_json, ctx.group_name, True)
            return gx, g1, g2, None, gw, None, None
        if m1 is None and m2 is None:
            gx, g1, g2, gw = ops.backward_op(grad_out, activation, fc1, fc2, idx, weights, fc1_c, ctx.config_json,
                                             ctx.group_name)
            return gx, g1, g2, None, gw, None, None
        gx, g1, g2, gw = backward_main_grad(grad_out, activation, fc1, fc2, idx, weights, fc1_c, m1, m2,
                                            ctx.config_json, ctx.group_name)
        return gx, None if m1 is not None else g1, None if m2 is not None else g2, None, gw, None, None

    ops.forward_op.register_autograd(autograd_backward, setup_context=setup_context)
    ops.backward_main_grad_op = backward_main_grad


_accumulate_into_main_grad(OPS, _synced_backward_into)
_accumulate_into_main_grad(STATIC_OPS, partial(static.backward, NATIVE), bf16_weight_grads=True)
_accumulate_into_main_grad(DEVICE_OPS, partial(device_exchange.backward, NATIVE), bf16_weight_grads=True)


@functools.lru_cache(maxsize=64)
def default_static_config(config: MoeEpConfig) -> Optional[MoeEpConfig]:
    """The configuration :func:`moe_ep_default` runs in the static layout: ``config``
    itself when it has ``recv_capacity``; with ``max_tokens_per_rank`` and no
    ``recv_capacity``, ``config`` with ``recv_capacity = config.worst_case_recv_rows()``
    (every routing fits: no overflow is possible); None without ``max_tokens_per_rank``
    (no static size: the host-synchronised mode runs)."""
    if config.recv_capacity is not None:
        return config
    if config.max_tokens_per_rank is None:
        return None
    return config.replace(recv_capacity=config.worst_case_recv_rows())


def moe_ep_default(
    activation: Any,
    fc1_weight: Any,
    fc2_weight: Any,
    topk_idx: Tensor,
    topk_weights: Tensor,
    *,
    config: MoeEpConfig,
    group: Optional[Any] = None,
) -> Any:
    """The layer on its fastest conforming path, what :class:`moe_ep_torch.module.MoeEpLayer`
    runs on ``cuda-nccl`` by default: the native layer's device exchange in the static
    layout of :func:`default_static_config` (no host synchronisation, the same results as
    :func:`moe_ep` within the combine budget: the device exchange sums a token's rows per
    rank first), or, without ``config.max_tokens_per_rank``, the host-synchronised mode.
    In the static layout a bad expert id makes every rank's output NaN instead of raising:
    :func:`check_errors` (with the configuration :func:`default_static_config` gives) raises
    it."""
    static_config = default_static_config(config)
    if static_config is None:
        return OPS.moe_ep(activation, fc1_weight, fc2_weight, topk_idx, topk_weights, config=config, group=group)
    return DEVICE_OPS.moe_ep(activation, fc1_weight, fc2_weight, topk_idx, topk_weights, config=static_config,
                             group=group)


def _ops(host_sync: bool, exchange: Optional[str]) -> LayerOps:
    if exchange not in (None, "nccl", "device"):
        raise ValueError(f"exchange must be None, 'nccl' or 'device'; got {exchange!r}")
    if host_sync:
        if exchange == "device":
            raise ValueError("exchange='device' needs host_sync=False (the device exchange is static-layout only)")
        return OPS
    device = exchange == "device" or (exchange is None and device_exchange.enabled())
    return DEVICE_OPS if device else STATIC_OPS


def moe_ep(activation: Any, fc1_weight: Any, fc2_weight: Any, topk_idx: Tensor, topk_weights: Tensor, *,
           config: MoeEpConfig, group: Optional[Any] = None, host_sync: bool = True,
           exchange: Optional[str] = None) -> Any:
    """The MoeEp layer on this rank (collective over ``group``); arguments and
    result as :func:`moe_ep_torch.api.moe_ep`.

    Args:
        host_sync: True: one host synchronisation per call (the count table),
            any layout, every input error raised on every rank. False: the
            static-shape mode (:mod:`moe_ep_cuda_nccl.static`): needs
            ``config.recv_capacity`` and ``config.max_tokens_per_rank``; no
            host synchronisation, capturable in a CUDA graph; a bad expert id
            or a capacity overflow on any rank makes every rank's output NaN
            and is raised by :func:`check_errors`.
        exchange: with ``host_sync=False``: ``"nccl"`` (the static mode's NCCL
            exchange), ``"device"`` (the native layer's device exchange,
            :mod:`moe_ep_cuda_nccl.device_exchange`), None: ``"device"`` when
            ``MOE_EP_CUDA_NCCL_EXCHANGE=device``, else ``"nccl"``.
    """
    ops = _ops(host_sync, exchange)
    return ops.moe_ep(activation, fc1_weight, fc2_weight, topk_idx, topk_weights, config=config, group=group)


def moe_ep_forward_with_stash(activation: Any, fc1_weight: Any, fc2_weight: Any, topk_idx: Tensor, topk_weights: Tensor,
                              *, config: MoeEpConfig, group: Optional[Any] = None, host_sync: bool = True,
                              exchange: Optional[str] = None) -> ForwardWithStash:
    """The forward of a training step whose backward is :func:`moe_ep_backward`, for any
    input format (block-scaled ones included): a
    :class:`~moe_ep_torch.api.ForwardWithStash` (output, ``fc1_c``, ``route_metadata``);
    arguments as :func:`moe_ep`."""
    ops = _ops(host_sync, exchange)
    return ops.moe_ep_forward_with_stash(activation, fc1_weight, fc2_weight, topk_idx, topk_weights, config=config,
                                         group=group)


def moe_ep_backward(grad_output: Tensor, activation: Any, fc1_weight: Any, fc2_weight: Any, topk_idx: Tensor,
                    topk_weights: Tensor, fc1_c: Tensor, *, config: MoeEpConfig, group: Optional[Any] = None,
                    host_sync: bool = True, exchange: Optional[str] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The spec's explicit backward (collective): float32 ``(grad_activation,
    grad_fc1_weight, grad_fc2_weight, grad_topk_weights)`` for plain or block-scaled
    forward inputs (:meth:`moe_ep_torch.api.LayerOps.moe_ep_backward`); ``host_sync`` as
    :func:`moe_ep` (False: ``fc1_c`` has ``recv_capacity`` rows), ``exchange`` as :func:`moe_ep`."""
    ops = _ops(host_sync, exchange)
    return ops.moe_ep_backward(
        grad_output, activation, fc1_weight, fc2_weight, topk_idx, topk_weights, fc1_c, config=config, group=group
    )


def close_communicators(group: Optional[Any] = None) -> None:
    """Destroy this process's NCCL communicators and device exchanges of ``group``
    (all when None; see :func:`moe_ep_cuda_nccl.prims.close_communicators`)."""
    device_exchange.close(group)
    _close_nccl(group)


def check_errors(config: MoeEpConfig, group: Optional[Any] = None) -> None:
    """Raise :class:`~moe_ep_spec.RoutingIndexError` or
    :class:`~moe_ep_spec.CapacityError` when a static-mode call on ``group``
    since the last check met a bad expert id or overflowed ``recv_capacity``
    on any rank (its outputs were NaN); clears the record. One host
    synchronisation: call it outside CUDA-graph capture."""
    static.check_errors(config, _group(group))
