"""Functions that run in spawned rank processes for tests/test_cuda_nccl.py.

Each takes ``device`` ("cpu": native CPU kernels, gloo; "cuda": rank r on
cuda:r, the native CUDA kernels and NCCL transport) and returns plain numpy /
Python values for the test to assert on.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

NAMES = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")


def _dev(rank: int, device: str) -> Any:
    import torch

    return torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")


def _inputs(world_inputs, rank: int, device: str, grad: bool = False):
    import torch

    w = world_inputs[rank]
    dev = _dev(rank, device)

    def f(a):
        return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(dev).requires_grad_(grad)

    idx = torch.from_numpy(w.topk_idx.astype(np.int64)).to(dev)
    return f(w.activation), f(w.fc1_weight), f(w.fc2_weight), idx, f(w.topk_weights)


def _bits(t) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def static_matches_synced(rank: int, config, world_inputs, grad_outputs, device: str) -> Dict[str, Any]:
    """The static mode against the host-synchronised one on the same inputs:
    forward results and explicit backward, then a loss.backward() through the
    static op; everything as numpy for a bitwise comparison."""
    import torch

    from moe_ep_cuda_nccl import api
    from moe_ep_torch.api import config_to_json

    group = torch.distributed.group.WORLD
    act, fc1, fc2, idx, tw = _inputs(world_inputs, rank, device)
    # bf16-exact: loss.backward() below hands the op a bfloat16 cotangent (the output's dtype)
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32)).to(act.device).to(torch.bfloat16).float()
    out: Dict[str, Any] = {}
    args = (act, fc1, fc2, idx, tw, config_to_json(config), group.group_name)
    for mode, ops in (("synced", api.OPS), ("static", api.STATIC_OPS)):
        y, fc1_c, meta = ops.forward_op(*args)
        grads = ops.backward_op(g, act, fc1, fc2, idx, tw, fc1_c, config_to_json(config), group.group_name)
        out[mode] = {"output": _bits(y), "fc1_c": _bits(fc1_c), "route_metadata": _bits(meta)}
        out[mode].update({n: _bits(t) for n, t in zip(NAMES, grads)})
    act, fc1, fc2, idx, tw = _inputs(world_inputs, rank, device, grad=True)
    y = api.moe_ep(act, fc1, fc2, idx, tw, config=config, host_sync=False)
    (y.float() * g).sum().backward()
    out["autograd"] = {n: _bits(t.grad) for n, t in zip(NAMES, (act, fc1, fc2, tw))}
    api.check_errors(config)
    return out


def static_errors(rank: int, config, world_inputs, mutate: str, device: str) -> Dict[str, Any]:
    """A defect on rank 1 only ("expert_id": an id out of range; "overflow":
    every route of rank 1 to expert 0): every rank's output must be NaN, and
    check_errors must raise on every rank, then pass once the record is read."""
    import torch

    from moe_ep_cuda_nccl import api

    act, fc1, fc2, idx, tw = _inputs(world_inputs, rank, device)
    bad = idx.clone()
    if rank == 1:
        if mutate == "expert_id":
            bad[0, 0] = config.num_experts + 3
        else:
            bad[:] = 0
    y = api.moe_ep(act, fc1, fc2, bad, tw, config=config, host_sync=False)
    result: Dict[str, Any] = {"all_nan": bool(torch.isnan(y.float()).all())}
    try:
        api.check_errors(config)
        result["error"] = "no error"
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
    y = api.moe_ep(act, fc1, fc2, idx, tw, config=config, host_sync=False)
    result["good_is_finite"] = bool(torch.isfinite(y.float()).all())
    api.check_errors(config)  # must not raise: the record was cleared
    return result


def graph_replay(rank: int, config, worlds: List[Any], device: str) -> Dict[str, Any]:
    """Capture one static forward + explicit backward in a CUDA graph on the
    first inputs, replay it on each later input set copied into the captured
    tensors, and compare every replay with an eager static call on the same
    inputs (bitwise); the replays' outputs must differ between input sets."""
    import torch

    from moe_ep_cuda_nccl import api

    def run(a, w1, w2, i, w, g):
        y, fc1_c, _ = api.STATIC_OPS.forward_op(a, w1, w2, i, w, cfg, name)
        grads = api.STATIC_OPS.backward_op(g, a, w1, w2, i, w, fc1_c, cfg, name)
        return (y,) + tuple(grads)

    from moe_ep_torch.api import config_to_json

    cfg, name = config_to_json(config), torch.distributed.group.WORLD.group_name
    dev = _dev(rank, device)
    sets = []
    for world, grads in worlds:
        a, w1, w2, i, w = _inputs(world, rank, device)
        sets.append((a, w1, w2, i, w, torch.from_numpy(grads[rank].astype(np.float32)).to(dev)))
    static_in = tuple(t.clone() for t in sets[0])
    stream = torch.cuda.Stream(dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: communicator, error flags, allocator pools
            run(*static_in)
    torch.cuda.current_stream(dev).wait_stream(stream)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run(*static_in)
    replays, outputs = [], []
    for inputs in sets[1:] + sets[:1]:
        for dst, src in zip(static_in, inputs):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize(dev)
        outputs.append(_cmp(static_out[0]).clone())
        eager = run(*inputs)
        replays.append([bool(torch.equal(_cmp(x), _cmp(y))) for x, y in zip(static_out, eager)])
        replays[-1].append(bool(torch.isfinite(static_out[0].float()).all()))
    api.check_errors(config)
    return {"replays": replays, "distinct": not torch.equal(outputs[0], outputs[1])}


def _cmp(t):
    import torch

    t = t.detach()
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def comm_exchange(rank: int, device: str) -> Dict[str, Any]:
    """The native transport alone: an all-gather and a variable-size exchange
    (rank r sends r + p + 1 rows of bytes (r, p, row) to rank p)."""
    import torch

    from moe_ep_cuda_nccl.prims import NATIVE

    group = torch.distributed.group.WORLD
    n = torch.distributed.get_world_size()
    dev = _dev(rank, device)
    row = torch.tensor([rank * 10 + j for j in range(5)], dtype=torch.int64, device=dev)
    gathered = NATIVE.all_gather(row, group).cpu().numpy()
    send_counts = [rank + p + 1 for p in range(n)]
    recv_counts = [p + rank + 1 for p in range(n)]
    send = torch.cat([
        torch.tensor([[rank, p, i] for i in range(send_counts[p])], dtype=torch.int32) for p in range(n)
    ]).to(dev)
    recv = NATIVE.all_to_all(send, send_counts, recv_counts, group).cpu().numpy()
    want = np.concatenate([np.array([[p, rank, i] for i in range(recv_counts[p])], dtype=np.int32) for p in range(n)])
    NATIVE.close(group)
    return {"gathered": gathered.tolist(), "recv_ok": bool(np.array_equal(recv, want))}


def static_block_scaled(rank: int, config, world_inputs, device: str) -> Dict[str, Any]:
    """A block-scaled output (no autograd): the static and synced modes' codes."""
    import torch

    from moe_ep_cuda_nccl import api
    from moe_ep_torch import formats as TF

    act, fc1, fc2, idx, tw = _inputs(world_inputs, rank, device)
    with torch.no_grad():
        a = api.moe_ep(act, fc1, fc2, idx, tw, config=config)
        b = api.moe_ep(act, fc1, fc2, idx, tw, config=config, host_sync=False)
    (da, sa), (db, sb) = TF.raw(a), TF.raw(b)
    return {"data_equal": bool(torch.equal(da, db)), "scale_equal": bool(torch.equal(sa, sb))}


def module_paths(rank: int, config, world_inputs, grad_outputs, device: str, dtype: str) -> Dict[str, Any]:
    """``MoeEpLayer(backend="cuda-nccl")`` with its default path, with ``host_sync=True`` and
    with ``host_sync=False``, on the same weights and tokens: forward output and gradients
    (``.grad``) of each; then the default path again with float32 ``main_grad`` tensors on the
    weights: their values after the backward, and whether ``.grad`` was left alone."""
    import torch

    from moe_ep_cuda_nccl import exchange_layers
    from moe_ep_cuda_nccl.api import check_errors, default_static_config
    from moe_ep_torch.module import MoeEpLayer

    dev = _dev(rank, device)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    w = world_inputs[rank]
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32)).to(dev)
    out: Dict[str, Any] = {}

    def step(host_sync, main_grads=None):
        # The static mode needs recv_capacity: the one the default path sizes.
        cfg = default_static_config(config) if host_sync is False else config
        layer = MoeEpLayer(cfg, backend="cuda-nccl", dtype=dt, device=dev, host_sync=host_sync)
        with torch.no_grad():
            layer.fc1_weight.copy_(torch.from_numpy(np.asarray(w.fc1_weight, np.float32)))
            layer.fc2_weight.copy_(torch.from_numpy(np.asarray(w.fc2_weight, np.float32)))
        if main_grads is not None:
            layer.fc1_weight.main_grad = main_grads[0].clone()
            layer.fc2_weight.main_grad = main_grads[1].clone()
        x = torch.from_numpy(np.asarray(w.activation, np.float32)).to(dev).to(dt).requires_grad_(True)
        tw = torch.from_numpy(np.asarray(w.topk_weights, np.float32)).to(dev).requires_grad_(True)
        idx = torch.from_numpy(w.topk_idx.astype(np.int64)).to(dev)
        y = layer(x, idx, tw)
        (y.float() * g).sum().backward()
        res = {"output": _bits(y), "grad_activation": _bits(x.grad), "grad_topk_weights": _bits(tw.grad)}
        if main_grads is None:
            res["grad_fc1_weight"], res["grad_fc2_weight"] = _bits(layer.fc1_weight.grad), _bits(layer.fc2_weight.grad)
        else:
            res["main_fc1"], res["main_fc2"] = _bits(layer.fc1_weight.main_grad), _bits(layer.fc2_weight.main_grad)
            res["grad_left_alone"] = layer.fc1_weight.grad is None and layer.fc2_weight.grad is None
        return res

    before = len(exchange_layers._LAYERS)
    out["default"] = step(None)
    out["default_took_the_device_exchange"] = len(exchange_layers._LAYERS) > before
    out["synced"] = step(True)
    out["static"] = step(False)
    rng = np.random.default_rng(100 + rank)
    init = [torch.from_numpy(rng.standard_normal(tuple(t.shape)).astype(np.float32)).to(dev)
            for t in (torch.empty(np.asarray(w.fc1_weight).shape), torch.empty(np.asarray(w.fc2_weight).shape))]
    out["init"] = [t.cpu().numpy() for t in init]
    out["default_main_grad"] = step(None, init)
    out["synced_main_grad"] = step(True, init)
    out["static_main_grad"] = step(False, init)
    check_errors(default_static_config(config))
    check_errors(config)
    return out


def module_bf16_weight_grads(rank: int, config, world_inputs, grad_outputs, device: str) -> Dict[str, Any]:
    """``MoeEpLayer(backend="cuda-nccl", dtype=torch.bfloat16)`` on each path (default, host-
    synchronised, static): the weights' ``.grad`` (bits and dtype), and the
    ``weight_grads_bf16`` keyword of every native experts backward the path made."""
    import torch

    from moe_ep_cuda_nccl.api import default_static_config
    from moe_ep_native.layer import Layer
    from moe_ep_torch.module import MoeEpLayer

    dev = _dev(rank, device)
    w = world_inputs[rank]
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32)).to(dev)
    seen: list = []
    original = Layer.experts_backward

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(bool(kwargs.get("weight_grads_bf16", False)))
        return original(self, *args, **kwargs)

    Layer.experts_backward = spy
    out: Dict[str, Any] = {}
    try:
        for name, host_sync in (("default", None), ("synced", True), ("static", False)):
            cfg = default_static_config(config) if host_sync is False else config
            layer = MoeEpLayer(cfg, backend="cuda-nccl", dtype=torch.bfloat16, device=dev, host_sync=host_sync)
            with torch.no_grad():
                layer.fc1_weight.copy_(torch.from_numpy(np.asarray(w.fc1_weight, np.float32)))
                layer.fc2_weight.copy_(torch.from_numpy(np.asarray(w.fc2_weight, np.float32)))
            x = torch.from_numpy(np.asarray(w.activation, np.float32)).to(dev).to(torch.bfloat16).requires_grad_(True)
            tw = torch.from_numpy(np.asarray(w.topk_weights, np.float32)).to(dev).requires_grad_(True)
            idx = torch.from_numpy(w.topk_idx.astype(np.int64)).to(dev)
            seen.clear()
            (layer(x, idx, tw).float() * g).sum().backward()
            out[name] = {
                "grad_fc1_weight": _bits(layer.fc1_weight.grad), "grad_fc2_weight": _bits(layer.fc2_weight.grad),
                "dtypes": [str(layer.fc1_weight.grad.dtype), str(layer.fc2_weight.grad.dtype)],
                "grad_activation": _bits(x.grad), "bf16_flags": list(seen),
            }
    finally:
        Layer.experts_backward = original
    return out
