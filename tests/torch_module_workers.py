"""Rank functions for tests/test_torch_module.py (run in spawned processes by
torch_workers.run_ranks)."""

from __future__ import annotations

import numpy as np

__all__ = ["layer_forward", "layer_errors", "layer_checks"]


def _np(t):
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        from moe_ep_spec.formats import BF16

        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def layer_forward(rank: int, config, weight_format) -> dict:
    """The layer's forward on random tokens, with and without gradients, and
    everything the reference needs to recompute it."""
    import torch

    from moe_ep_torch.module import MoeEpLayer

    torch.manual_seed(10 + rank)
    layer = MoeEpLayer(config, weight_format=weight_format)
    x = torch.randn(6 + rank, config.hidden).bfloat16().requires_grad_()
    idx = torch.stack([torch.randperm(config.num_experts)[: config.num_topk] for _ in range(x.shape[0])])
    idx[0, 0] = -1
    w = torch.rand(x.shape[0], config.num_topk).requires_grad_()
    y = layer(x, idx, w)
    y.float().sum().backward()
    with torch.no_grad():
        y_nograd = layer(x, idx, w)
    return {
        "activation": _np(x),
        "topk_idx": idx.numpy().astype(np.int32),
        "topk_weights": _np(w),
        "fc1": _np(layer.fc1_weight),
        "fc2": _np(layer.fc2_weight),
        "output": _np(y),
        "output_nograd": _np(y_nograd),
        "grads": [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in (layer.fc1_weight, layer.fc2_weight, w, x)],
        "param_shapes": [tuple(p.shape) for p in layer.parameters()],
        "repr": repr(layer),
    }


def layer_errors(rank: int, config) -> list:
    """The constructor's errors, as (class name, message)."""
    import torch

    from moe_ep_spec.errors import MoeEpError
    from moe_ep_torch.module import MoeEpLayer

    out = []
    for kwargs in (
        {"backend": "jax"},
        {"dtype": torch.float16},
        {"config": config.replace(num_ranks=config.num_ranks + 1, num_experts=config.num_ranks + 1)},
        {"weight_format": "mxfp8", "config": config.replace(hidden=48)},
        {"host_sync": False},
    ):
        kwargs = dict(kwargs)
        cfg = kwargs.pop("config", config)
        try:
            MoeEpLayer(cfg, **kwargs)
        except MoeEpError as exc:
            out.append((type(exc).__name__, str(exc)))
        else:
            out.append(("no error", repr(kwargs)))
    return out


def layer_checks(rank: int, config, weight_formats, error_config) -> dict:
    """:func:`layer_forward` for every weight format, and on rank 0 the
    constructor's errors for ``error_config`` (one process group for all)."""
    out = {"forward": {fmt: layer_forward(rank, config, fmt) for fmt in weight_formats}}
    out["errors"] = layer_errors(rank, error_config)
    return out
