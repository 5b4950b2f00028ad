"""Functions that run in spawned rank processes for tests/test_torch_backend.py."""

from __future__ import annotations

import traceback
from datetime import timedelta
from typing import Any, Callable, List

import numpy as np


def _init(rank: int, world: int, port: int, backend: str) -> None:
    import torch
    import torch.distributed as dist

    extra = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device(f"cuda:{rank}")
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60),
        **extra,
    )


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, backend: str, args: tuple, out: Any) -> None:
    import torch.distributed as dist

    try:
        _init(rank, world, port, backend)
        out.put((rank, "ok", fn(rank, *args)))
    except BaseException as exc:  # noqa: BLE001
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0, backend: str = "gloo") -> List[Any]:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes with a process group
    (gloo, or nccl with rank r on cuda:r) on loopback; return the per-rank results
    (or ``("error", text)``)."""
    import multiprocessing as mp

    from moe_ep_spec.launch import free_loopback_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_loopback_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, backend, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    try:
        for _ in range(world):
            rank, kind, value = out.get(timeout=timeout)
            results[rank] = value if kind == "ok" else ("error", value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


def _torch_inputs(world_inputs, rank: int):
    import torch

    w = world_inputs[rank]
    act = torch.from_numpy(np.asarray(w.activation, dtype=np.float32)).requires_grad_()
    fc1 = torch.from_numpy(np.asarray(w.fc1_weight, dtype=np.float32)).requires_grad_()
    fc2 = torch.from_numpy(np.asarray(w.fc2_weight, dtype=np.float32)).requires_grad_()
    idx = torch.from_numpy(w.topk_idx.astype(np.int64))
    tw = torch.from_numpy(w.topk_weights.astype(np.float32)).requires_grad_()
    return act, fc1, fc2, idx, tw


def training_step(rank: int, config, world_inputs, grad_outputs) -> dict:
    """One forward + loss.backward() through the differentiable op; returns the
    output, the op's own stash (what its backward used) and the grads."""
    import torch

    from moe_ep_torch import api

    act, fc1, fc2, idx, tw = _torch_inputs(world_inputs, rank)
    out, fc1_c, meta = torch.ops.moe_ep.forward(
        act, fc1, fc2, idx, tw, api.config_to_json(config), torch.distributed.group.WORLD.group_name
    )
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32))
    loss = (out.float() * g).sum()
    loss.backward()
    return {
        "output": out.detach().view(torch.int16).numpy(),
        "fc1_c": fc1_c.view(torch.int16).numpy(),
        "route_metadata": meta.numpy(),
        "grad_activation": act.grad.numpy(),
        "grad_fc1_weight": fc1.grad.numpy(),
        "grad_fc2_weight": fc2.grad.numpy(),
        "grad_topk_weights": tw.grad.numpy(),
    }


def autograd_grad(rank: int, config, world_inputs, grad_outputs) -> dict:
    """torch.autograd.grad of the same loss."""
    import torch

    from moe_ep_torch.api import moe_ep

    act, fc1, fc2, idx, tw = _torch_inputs(world_inputs, rank)
    out = moe_ep(act, fc1, fc2, idx, tw, config=config)
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32))
    grads = torch.autograd.grad((out.float() * g).sum(), [act, fc1, fc2, tw])
    return {k: v.numpy() for k, v in zip(("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"), grads)}


def opcheck(rank: int, config, world_inputs) -> str:
    import torch

    from moe_ep_torch import api

    act, fc1, fc2, idx, tw = _torch_inputs(world_inputs, rank)
    args = (act, fc1, fc2, idx, tw, api.config_to_json(config), torch.distributed.group.WORLD.group_name)
    torch.library.opcheck(torch.ops.moe_ep.forward.default, args)
    # The inference op runs only where no gradient is wanted: inputs that need none.
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    torch.library.opcheck(torch.ops.moe_ep.forward_inference.default, plain)
    return "ok"


def expect_error(rank: int, config, world_inputs, bad_rank: int, mutate: str) -> str:
    """Call moe_ep with a defect on ``bad_rank``; return the error class name and message."""
    import torch

    from moe_ep_torch.api import moe_ep

    act, fc1, fc2, idx, tw = _torch_inputs(world_inputs, rank)
    if rank == bad_rank:
        if mutate == "expert_id":
            idx = idx.clone()
            idx[0, 0] = config.num_experts
        elif mutate == "shape":
            act = torch.zeros(act.shape[0], config.hidden + 1, requires_grad=True)
        elif mutate == "config":
            config = config.replace(gate_up_clamp=3.0)
    try:
        with torch.no_grad():
            moe_ep(act.detach(), fc1.detach(), fc2.detach(), idx, tw.detach(), config=config)
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def cuda_device_errors(rank: int, config, world_inputs) -> List[str]:
    """Under NCCL: CPU tensors, and a weight on another device, are rejected."""
    import torch

    from moe_ep_torch.api import moe_ep

    act, fc1, fc2, idx, tw = (t.detach() for t in _torch_inputs(world_inputs, rank))
    dev = torch.device(f"cuda:{rank}")
    out = []
    for case in ("cpu tensors", "weight on cpu"):
        args = [act, fc1, fc2, idx, tw] if case == "cpu tensors" else [act.to(dev), fc1, fc2.to(dev), idx.to(dev), tw.to(dev)]
        try:
            moe_ep(*args, config=config)
            out.append(f"{case}: no error")
        except Exception as exc:  # noqa: BLE001
            out.append(f"{case}: {type(exc).__name__}: {exc}")
    return out


def cuda_grouped_gemm_used(rank: int, config, world_inputs) -> dict:
    """A bf16 forward on CUDA: which GEMM path FC1 took (moe_ep_torch.core.GEMM_PATH),
    and its output."""
    import torch

    from moe_ep_torch import core
    from moe_ep_torch.api import moe_ep

    w = world_inputs[rank]
    dev = torch.device(f"cuda:{rank}")

    def t(a):
        return torch.from_numpy(np.asarray(a).view(np.int16)).view(torch.bfloat16).to(dev)

    idx = torch.from_numpy(w.topk_idx.astype(np.int64)).to(dev)
    tw = torch.from_numpy(w.topk_weights.astype(np.float32)).to(dev)
    y = moe_ep(t(w.activation), t(w.fc1_weight), t(w.fc2_weight), idx, tw, config=config)
    return {"path": core.GEMM_PATH["path"], "reason": core.GEMM_PATH["reason"], "output": y.view(torch.int16).cpu().numpy()}


def block_scaled_explicit_step(rank: int, config, world_inputs, grad_outputs, fmt: str) -> dict:
    """A training step with block-scaled inputs through the explicit API
    (moe_ep_forward_with_stash, then moe_ep_backward), and the same step on their
    decoded values through the differentiable op's custom ops."""
    import torch

    from moe_ep_spec.formats import MoeFormat
    from moe_ep_torch import api
    from moe_ep_torch import formats as TF

    w = world_inputs[rank]
    f = MoeFormat(fmt)
    act = TF.quantize(torch.from_numpy(np.asarray(w.activation, dtype=np.float32)), f)  # [T, H] along H
    # The weights as the layer takes them block-scaled: transposed, blocked along the reduction axis.
    fc1 = TF.quantize(torch.from_numpy(np.asarray(w.fc1_weight, dtype=np.float32)).transpose(1, 2).contiguous(), f)
    fc2 = TF.quantize(torch.from_numpy(np.asarray(w.fc2_weight, dtype=np.float32)).transpose(1, 2).contiguous(), f)
    idx = torch.from_numpy(w.topk_idx.astype(np.int64))
    tw = torch.from_numpy(w.topk_weights.astype(np.float32))
    g = torch.from_numpy(grad_outputs[rank].astype(np.float32))
    fwd = api.moe_ep_forward_with_stash(act, fc1, fc2, idx, tw, config=config)
    grads = api.moe_ep_backward(g, act, fc1, fc2, idx, tw, fwd.fc1_c, config=config)
    dact, dfc1, dfc2 = TF.decode(act), TF.decode_weight(fc1), TF.decode_weight(fc2)
    out, fc1_c, meta = torch.ops.moe_ep.forward(
        dact, dfc1, dfc2, idx, tw, api.config_to_json(config), torch.distributed.group.WORLD.group_name
    )
    ref = api.moe_ep_backward(g, dact, dfc1, dfc2, idx, tw, fc1_c, config=config)
    from moe_ep_spec import errors as E

    errors = []
    try:  # a stash of the wrong row count is refused before any exchange, as for plain inputs
        api.moe_ep_backward(g, act, fc1, fc2, idx, tw, fwd.fc1_c[1:], config=config)
    except E.StashError as exc:
        errors.append(f"StashError: {exc}")
    try:  # autograd does not take block-scaled inputs, and says what does
        api.moe_ep(act, fc1, fc2, idx, tw.clone().requires_grad_(), config=config)
    except E.CapabilityError as exc:
        errors.append(f"CapabilityError: {exc}")
    names = ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights")
    res = {"output": fwd.output.view(torch.int16).numpy(), "fc1_c": fwd.fc1_c.view(torch.int16).numpy(),
           "route_metadata": fwd.route_metadata.numpy(), "ref_output": out.view(torch.int16).numpy(),
           "ref_fc1_c": fc1_c.view(torch.int16).numpy(), "ref_route_metadata": meta.numpy()}
    res.update({n: v.numpy() for n, v in zip(names, grads)})
    res.update({"ref_" + n: v.numpy() for n, v in zip(names, ref)})
    res["errors"] = errors
    return res
