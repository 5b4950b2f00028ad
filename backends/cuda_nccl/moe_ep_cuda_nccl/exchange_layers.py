"""The process's device-exchange layers (:mod:`moe_ep_cuda_nccl.device_exchange`):
the table that holds them and :func:`close`, which drops them.

Its own module so that both the device exchange (which fills the table) and the
static mode's error check (:func:`moe_ep_cuda_nccl.static.check_errors`, which
drops a group's layers after a transport timeout) reach it without importing
each other.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Tuple

import torch

__all__ = ["close"]

#: (configuration, CUDA device, bf16 operands, token bytes, combine order, exchange mode, round-trip place,
#: group name, group id) -> (group, :class:`moe_ep_native.exchange.ExchangeLayer`).
_LAYERS: Dict[Tuple[Any, ...], Tuple[Any, Any]] = {}
#: group name -> how many layers were made for it (the prefix of each one's store keys).
_GENERATION: Dict[str, int] = {}
_LOCK = threading.Lock()


def close(group: Any = None, keep: Any = None) -> None:
    """Drop the exchange layers of ``group`` (all when None), but those of the
    configuration ``keep`` (None: none kept); local, not collective: call it when
    no peer can still be in a stage of these layers (e.g. after a host collective
    that every rank reaches after its last call)."""
    with _LOCK:
        keys = [k for k, (g, _) in _LAYERS.items()
                if (group is None or g is group) and (keep is None or k[0] != keep)]  # k[0]: the configuration
        layers = [_LAYERS.pop(k)[1] for k in keys]
    for layer in layers:
        if layer.cuda_device is not None:
            torch.cuda.synchronize(layer.cuda_device)
        layer.close()
