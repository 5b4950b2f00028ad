"""Rank-process functions of tests/test_native_exchange.py (spawned by torch_workers.run_ranks)."""

from __future__ import annotations

import os
import time
from typing import Any, Dict

import numpy as np

NAMES = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")


def _bits(t) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.float().numpy()


def _inputs(world_inputs, rank: int, dev, bf16: bool):
    import torch

    w = world_inputs[rank]
    dt = torch.bfloat16 if bf16 else torch.float32

    def f(a, dtype=dt):
        return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(dev).to(dtype)

    idx = torch.from_numpy(w.topk_idx.astype(np.int64)).to(dev)
    return f(w.activation), f(w.fc1_weight), f(w.fc2_weight), idx, f(w.topk_weights, torch.float32)


def _run(ops, config, group, args, g):
    from moe_ep_torch.api import config_to_json

    act, fc1, fc2, idx, tw = args
    y, fc1_c, meta = ops.forward_op(act, fc1, fc2, idx, tw, config_to_json(config), group.group_name)
    grads = ops.backward_op(g, act, fc1, fc2, idx, tw, fc1_c, config_to_json(config), group.group_name)
    out = {"output": _bits(y), "fc1_c": _bits(fc1_c), "route_metadata": _bits(meta)}
    out.update({n: _bits(t) for n, t in zip(NAMES, grads)})
    return out


def inference_skips_the_stash(rank: int, config, world_inputs, device: str) -> Dict[str, Any]:
    """The static mode and the device exchange without a backward to come: moe_ep on inputs
    that need no gradient (the ops' forward_inference op) and the forwards with stash=False
    give the training forward's output bit for bit, and write no stash (fc1_c None)."""
    import torch

    from moe_ep_cuda_nccl import api, device_exchange, static
    from moe_ep_cuda_nccl.prims import NATIVE
    from moe_ep_torch.api import config_to_json

    group = torch.distributed.group.WORLD
    dev = torch.device("cuda:0") if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    res: Dict[str, Any] = {}
    for name, ops, forward in (("static", api.STATIC_OPS, static.forward),
                               ("device", api.DEVICE_OPS, device_exchange.forward)):
        args = _inputs(world_inputs, rank, torch.device("cpu") if name == "static" else dev, True)
        trained, _, _ = ops.forward_op(*args, config_to_json(config), group.group_name)
        plain = ops.moe_ep(*args, config=config, group=group)
        no_stash = forward(NATIVE, config, group, *args, stash=False)
        res[name] = {"forward_op": _bits(trained), "moe_ep": _bits(plain), "stash_false": _bits(no_stash["output"]),
                     "fc1_c_none": no_stash["fc1_c"] is None}
    api.check_errors(config)
    api.close_communicators()
    return res


def fc1_epilogue_fused_matches_pass(rank: int, config, world_inputs, grad_outputs) -> Dict[str, Any]:
    """The device exchange's training forward and backward on cuda:0 with FC1's SwiGLU in the
    GEMM's epilogue (MOE_EP_FC1_EPILOGUE=fused, the default) and with the pass after FC1's
    float32 GEMM ("pass"): the outputs, stashes and gradients of each, and the names of the
    kernels the forward ran (to see which FC1 ran); then an unknown value's error."""
    import torch

    from moe_ep_cuda_nccl import api
    from moe_ep_torch.api import config_to_json

    group = torch.distributed.group.WORLD
    dev = torch.device("cuda:0")
    torch.cuda.set_device(0)
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32)).to(dev)
    args = _inputs(world_inputs, rank, dev, True)
    res: Dict[str, Any] = {}
    try:
        for mode in ("fused", "pass"):
            os.environ["MOE_EP_FC1_EPILOGUE"] = mode
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                y, fc1_c, _ = api.DEVICE_OPS.forward_op(*args, config_to_json(config), group.group_name)
                torch.cuda.synchronize()
            grads = api.DEVICE_OPS.backward_op(g, *args, fc1_c, config_to_json(config), group.group_name)
            res[mode] = {"output": _bits(y), "fc1_c": _bits(fc1_c), "kernels": sorted({e.name for e in prof.events()})}
            res[mode].update({n: _bits(t) for n, t in zip(NAMES, grads)})
        api.check_errors(config)
        os.environ["MOE_EP_FC1_EPILOGUE"] = "fast"
        try:
            api.DEVICE_OPS.forward_op(*args, config_to_json(config), group.group_name)
            res["bad_value_error"] = ""
        except Exception as exc:  # noqa: BLE001
            res["bad_value_error"] = f"{type(exc).__name__}: {exc}"
    finally:
        os.environ.pop("MOE_EP_FC1_EPILOGUE", None)
    api.close_communicators()
    return res


def device_matches_static(rank: int, config, world_inputs, grad_outputs, combine: str, bf16: bool,
                          device: str, mode: str = "throughput") -> Dict[str, Any]:
    """The static mode (NCCL exchange; on CPU tensors: gloo) and the device
    exchange on the same inputs, twice each (buffers reused). device "cpu": both
    on CPU tensors; "cuda": the static mode on CPU tensors, the device exchange
    on cuda:0 (every rank on one GPU, CUDA IPC loopback)."""
    import torch

    os.environ["MOE_EP_CUDA_NCCL_COMBINE"] = combine
    os.environ["MOE_EP_CUDA_NCCL_EXCHANGE_MODE"] = mode
    from moe_ep_cuda_nccl import api

    group = torch.distributed.group.WORLD
    cpu = torch.device("cpu")
    dev = torch.device("cuda:0") if device == "cuda" else cpu
    if device == "cuda":
        torch.cuda.set_device(0)
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32))
    res: Dict[str, Any] = {"static": [], "device": []}
    for _ in range(2):
        res["static"].append(_run(api.STATIC_OPS, config, group, _inputs(world_inputs, rank, cpu, bf16), g))
        res["device"].append(_run(api.DEVICE_OPS, config, group, _inputs(world_inputs, rank, dev, bf16), g.to(dev)))
    from moe_ep_cuda_nccl import device_exchange as D

    res["modes"] = sorted({key[5] for key in D._LAYERS})  # the ex_mode of every exchange layer this ran on
    api.check_errors(config)
    api.close_communicators()
    return res


def round_trip_places_agree(rank: int, config, world_inputs, grad_outputs, combine: str, device: str,
                            mode: str = "throughput") -> Dict[str, Any]:
    """The device exchange's forward and backward with a block-scaled combine_format's round
    trip done by the experts stage (MOE_EP_CUDA_NCCL_ROUND_TRIP=experts) and by the combine as
    it reads the rows (=combine, where the front-end takes it): the outputs of both, and
    whether the combine rounded the rows, for every exchange layer this ran on."""
    import torch

    os.environ["MOE_EP_CUDA_NCCL_COMBINE"] = combine
    os.environ["MOE_EP_CUDA_NCCL_EXCHANGE_MODE"] = mode
    from moe_ep_cuda_nccl import api
    from moe_ep_cuda_nccl import device_exchange as D

    group = torch.distributed.group.WORLD
    dev = torch.device("cuda:0") if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32)).to(dev)
    res: Dict[str, Any] = {}
    for where in ("experts", "combine"):
        os.environ[D.ROUND_TRIP_ENV] = where
        res[where] = _run(api.DEVICE_OPS, config, group, _inputs(world_inputs, rank, dev, False), g)
    res["round_trip_in_combine"] = sorted({layer.combine_round_trip is not None for _, layer in D._LAYERS.values()})
    api.check_errors(config)
    api.close_communicators()
    return res


def device_errors(rank: int, config, world_inputs, mutate: str, device: str, mode: str = "throughput") -> Dict[str, Any]:
    """A bad id / overflow on the last rank through the device exchange: NaN everywhere, check_errors raises."""
    import torch

    os.environ["MOE_EP_CUDA_NCCL_EXCHANGE_MODE"] = mode

    from moe_ep_cuda_nccl import api

    dev = torch.device("cuda:0") if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    act, fc1, fc2, idx, tw = _inputs(world_inputs, rank, dev, False)
    bad = idx.clone()
    if rank == config.num_ranks - 1:
        if mutate == "expert_id":
            bad[0, 0] = config.num_experts + 3
        else:
            bad[:] = 0
    out = api.moe_ep(act, fc1, fc2, bad, tw, config=config, host_sync=False, exchange="device")
    res = {"all_nan": bool(torch.isnan(out.float()).all())}
    try:
        api.check_errors(config)
        res["error"] = ""
    except Exception as exc:  # noqa: BLE001
        res["error"] = f"{type(exc).__name__}: {exc}"
    good = api.moe_ep(act, fc1, fc2, idx, tw, config=config, host_sync=False, exchange="device")
    res["good_is_finite"] = bool(torch.isfinite(good.float()).all())
    api.check_errors(config)
    api.close_communicators()
    return res


def device_timeout(rank: int, config, world_inputs, device: str, mode: str = "throughput") -> Dict[str, Any]:
    """Rank 1 connects, then never calls the layer: rank 0 must get TransportError within the timeout."""
    import torch

    os.environ["MOE_EP_CUDA_NCCL_EXCHANGE_MODE"] = mode
    import torch.distributed as dist

    os.environ["MOE_EP_CUDA_NCCL_TIMEOUT_S"] = "2"
    from moe_ep_cuda_nccl import api

    dev = torch.device("cuda:0") if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    act, fc1, fc2, idx, tw = _inputs(world_inputs, rank, dev, False)
    api.moe_ep(act, fc1, fc2, idx, tw, config=config, host_sync=False, exchange="device")  # both: connected, one step
    api.check_errors(config)
    dist.barrier()
    res: Dict[str, Any] = {}
    if rank == 0:
        start = time.monotonic()
        out = api.moe_ep(act, fc1, fc2, idx, tw, config=config, host_sync=False, exchange="device")
        try:
            api.check_errors(config)
            res["error"] = ""
        except Exception as exc:  # noqa: BLE001
            res["error"] = f"{type(exc).__name__}: {exc}"
        res["seconds"] = time.monotonic() - start
        res["all_nan"] = bool(torch.isnan(out.float()).all())
    dist.barrier()
    api.close_communicators()
    return res
