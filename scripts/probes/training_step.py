"""One training step through ``moe_ep_torch.api.moe_ep`` over NCCL on CUDA,
gradients from ``loss.backward()`` checked against the reference backward.

    python scripts/probes/training_step.py NUM_RANKS      # on a machine with NUM_RANKS GPUs
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from datetime import timedelta

import numpy as np


def rank_main(rank: int, n: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    from moe_ep_spec import MoeEpConfig
    from moe_ep_spec.formats import BF16
    from moe_ep_spec.inputs import random_world
    from moe_ep_torch import api

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=120), device_id=torch.device(f"cuda:{rank}"))
    config = MoeEpConfig(num_experts=8 * n, hidden=256, intermediate=128, num_topk=4, num_ranks=n, gate_up_clamp=1.0)
    world = random_world(config, num_tokens=[64 + 16 * r for r in range(n)], input_format="fp32", seed=11, routing="unused_mixed")
    rng = np.random.default_rng(12)
    gy = [rng.standard_normal((w.activation.shape[0], config.hidden)).astype(np.float32).astype(BF16).astype(np.float32) for w in world]
    w = world[rank]
    dev = torch.device(f"cuda:{rank}")
    act = torch.tensor(np.asarray(w.activation, np.float32), device=dev, requires_grad=True)
    fc1 = torch.tensor(np.asarray(w.fc1_weight, np.float32), device=dev, requires_grad=True)
    fc2 = torch.tensor(np.asarray(w.fc2_weight, np.float32), device=dev, requires_grad=True)
    idx = torch.tensor(w.topk_idx.astype(np.int64), device=dev)
    tw = torch.tensor(w.topk_weights, device=dev, requires_grad=True)
    # The differentiable op itself, so that the stash its backward used is visible.
    y, fc1_c, meta = torch.ops.moe_ep.forward(act, fc1, fc2, idx, tw, api.config_to_json(config),
                                              dist.group.WORLD.group_name)
    (y.float() * torch.tensor(gy[rank], device=dev)).sum().backward()
    torch.cuda.synchronize()
    out.put((rank, {
        "output": y.detach().view(torch.int16).cpu().numpy(),
        "fc1_c": fc1_c.view(torch.int16).cpu().numpy(), "route_metadata": meta.cpu().numpy(),
        "grad_activation": act.grad.cpu().numpy(), "grad_fc1_weight": fc1.grad.cpu().numpy(),
        "grad_fc2_weight": fc2.grad.cpu().numpy(), "grad_topk_weights": tw.grad.cpu().numpy(),
    }, config, world, gy))
    dist.destroy_process_group()


def main() -> int:
    import moe_ep_spec
    from moe_ep_spec import Stash
    from moe_ep_spec.launch import free_loopback_port
    from moe_ep_spec.tolerance import compare

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_loopback_port()
    procs = [ctx.Process(target=rank_main, args=(r, n, port, q)) for r in range(n)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(n):
        rank, res, config, world, gy = q.get(timeout=600)
        got[rank] = res
    for p in procs:
        p.join(timeout=60)
    ref_b = moe_ep_spec.get_backend("reference")
    cfg = config.replace(generate_c=True)
    fwd = ref_b.forward(cfg, world)
    # Judge the backward from the stash the op made and used (its own fc1_c may sit
    # one bf16 step from the reference's where c is near a tie); judge that stash
    # against the forward's budget.
    stash = [Stash(got[r]["fc1_c"].view(np.uint16).view(fwd[r].fc1_c.dtype), got[r]["route_metadata"]) for r in range(n)]
    ref = ref_b.backward(cfg, world, gy, stash)
    bud = ref_b.backward_budget(cfg, world, gy, stash)
    fbud = ref_b.forward_budget(cfg, world)
    ok = True
    for r in range(n):
        c = compare(f"rank {r} output", got[r]["output"].view(np.uint16).view(fwd[r].output.dtype), fwd[r].output, fbud[r].output)
        print(f"{c.name:32s} error/budget {c.ratio:.3g}  {'ok' if c.ok else 'FAIL'}")
        ok &= c.ok
        c = compare(f"rank {r} fc1_c", stash[r].fc1_c, fwd[r].fc1_c, fbud[r].fc1_c)
        print(f"{c.name:32s} error/budget {c.ratio:.3g}  {'ok' if c.ok else 'FAIL ' + c.describe()}")
        ok &= c.ok and bool(np.array_equal(stash[r].route_metadata, fwd[r].route_metadata))
        for name in ("grad_activation", "grad_fc1_weight", "grad_fc2_weight", "grad_topk_weights"):
            c = compare(f"rank {r} {name}", got[r][name], getattr(ref[r], name), getattr(bud[r], name))
            print(f"{c.name:32s} error/budget {c.ratio:.3g}  {'ok' if c.ok else 'FAIL ' + c.describe()}")
            ok &= c.ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
