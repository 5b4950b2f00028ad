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

from functools import partial
from typing import Any, Optional, Tuple

from torch import Tensor

from moe_ep_spec.config import MoeEpConfig
from moe_ep_torch.api import ForwardWithStash, LayerOps, _group, run_backward, run_forward

from . import device_exchange, static
from .prims import NATIVE
from .prims import close_communicators as _close_nccl

__all__ = ["moe_ep", "moe_ep_backward", "moe_ep_forward_with_stash", "check_errors", "close_communicators", "OPS", "STATIC_OPS", "DEVICE_OPS"]

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
