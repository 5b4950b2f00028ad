"""One MoeEp layer, forward and backward, on the cuda-nccl backend over NCCL
(run on a device machine; docs/cuda-nccl.md).

    python scripts/gpu_cuda_nccl_layer.py --ranks 1            # one fwd+bwd per mode (what compute-sanitizer runs)
    python scripts/gpu_cuda_nccl_layer.py --ranks 2 --time     # + timing against the torch backend, same run

Modes: ``synced`` (moe_ep_cuda_nccl.api.moe_ep, one host sync), ``static``
(host_sync=False), ``graph`` (the static layer captured in a CUDA graph and
replayed) and, with --time, ``torch`` (moe_ep_torch.api.moe_ep: the baseline
the ratios are taken against). Every rank checks its results are finite and
that the static and synced modes agree bit for bit; rank 0 prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist

    from moe_ep_cuda_nccl import api as cn
    from moe_ep_spec import MoeEpConfig
    from moe_ep_torch import api as tapi

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks,
        timeout=timedelta(seconds=120), device_id=dev,
    )
    n, t, h, i, k = args.ranks, args.tokens, args.hidden, args.intermediate, args.topk
    e = args.experts_per_rank * n
    align = 16
    cap = n * t * k + args.experts_per_rank * (align - 1)  # worst case: always fits
    config = MoeEpConfig(
        num_experts=e, hidden=h, intermediate=i, num_topk=k, num_ranks=n, max_tokens_per_rank=t,
        recv_capacity=cap, expert_alignment=align,
    )
    # Everything the captured graph reads is made on a side stream: autograd syncs a leaf's
    # gradient with the stream the leaf was made on, and the legacy default stream cannot
    # take part in a capture (cudaErrorStreamCaptureImplicit).
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        g = torch.Generator(device=dev).manual_seed(1234 + rank)
        x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
        w1 = (torch.randn(args.experts_per_rank, h, 2 * i, device=dev, generator=g) / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn(args.experts_per_rank, i, h, device=dev, generator=g) / i**0.5).to(torch.bfloat16)
        w1.requires_grad_()
        w2.requires_grad_()
        scores = torch.rand(t, e, device=dev, generator=g)
        idx = scores.topk(k, dim=1).indices
        tw = torch.softmax(torch.randn(t, k, device=dev, generator=g), dim=1).requires_grad_()
        dy = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
    torch.cuda.synchronize(dev)

    def phase(text: str) -> None:  # progress on stdout as it happens: a stall shows where it is
        print(f"rank {rank}: {text} ({time.strftime('%H:%M:%S')})", flush=True)

    def step(fn):
        for p in (x, w1, w2, tw):
            p.grad = None
        out = fn(x, w1, w2, idx, tw, config=config)
        out.backward(dy)
        return [out.detach()] + [p.grad for p in (x, w1, w2, tw)]

    modes = {
        "synced": lambda *a, **kw: cn.moe_ep(*a, **kw),
        "static": lambda *a, **kw: cn.moe_ep(*a, host_sync=False, **kw),
    }
    phase("eager synced and static forward+backward")
    results = {m: [r.clone() for r in step(fn)] for m, fn in modes.items()}
    cn.check_errors(config)
    same = all(torch.equal(a, b) for a, b in zip(results["synced"], results["static"]))
    finite = all(bool(torch.isfinite(r.float()).all()) for rs in results.values() for r in rs)
    report = {"static == synced (bitwise)": same, "all finite": finite}

    # The static layer captured in CUDA graphs: (a) forward + loss.backward() (autograd),
    # (b) the explicit ops (forward, then moe_ep_backward with the stash).
    cfg_json, name = tapi.config_to_json(config), dist.group.WORLD.group_name

    def explicit():
        y, fc1_c, _ = cn.STATIC_OPS.forward_op(x, w1, w2, idx, tw, cfg_json, name)
        return (y,) + tuple(cn.STATIC_OPS.backward_op(dy, x, w1, w2, idx, tw, fc1_c, cfg_json, name))

    times = {}
    if not args.no_graph:  # --no-graph: e.g. under compute-sanitizer, where a capture and replay take very long
        phase("warm-up on the side stream, then CUDA-graph captures")
        with torch.cuda.stream(side):
            for _ in range(2):
                step(modes["static"])
                explicit()
        torch.cuda.synchronize(dev)
        graph = None
        if args.autograd_graph:
            key = "autograd graph replay == eager static (bitwise)"
            try:
                graph = torch.cuda.CUDAGraph()
                for p in (x, w1, w2, tw):
                    p.grad = None
                with torch.cuda.graph(graph, stream=side):
                    g_out = modes["static"](x, w1, w2, idx, tw, config=config)
                    g_out.backward(dy)
                graph.replay()
                torch.cuda.synchronize(dev)
                report[key] = torch.equal(g_out, results["static"][0]) and all(
                    torch.equal(p.grad, r) for p, r in zip((x, w1, w2, tw), results["static"][1:])
                )
            except Exception as exc:  # noqa: BLE001 - reported (and fails the run), the other checks go on
                report[key] = False
                graph = None
                print(f"rank {rank}: {key}: capture failed: {type(exc).__name__}: {str(exc).splitlines()[0]}", flush=True)
        eager = explicit()
        graph2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph2, stream=side):
            g2 = explicit()
        graph2.replay()
        torch.cuda.synchronize(dev)
        report["explicit-op graph replay == eager (bitwise)"] = all(torch.equal(a, b) for a, b in zip(g2, eager))
        if args.time:
            phase("timing")
            modes["torch"] = lambda *a, **kw: tapi.moe_ep(*a, **kw)
            runners = {m: (lambda fn=fn: step(fn)) for m, fn in modes.items()}
            runners["graph"] = graph.replay if graph is not None else graph2.replay
            for m, run in runners.items():
                phase(f"timing {m}")
                for _ in range(3):
                    run()
                samples = []
                for _ in range(args.iters):
                    dist.barrier()
                    torch.cuda.synchronize(dev)
                    start = time.perf_counter()
                    run()
                    torch.cuda.synchronize(dev)
                    samples.append(time.perf_counter() - start)
                times[m] = statistics.median(samples) * 1e3
    cn.check_errors(config)
    cn.close_communicators()
    gathered = [None] * n
    dist.all_gather_object(gathered, {"report": report, "times": times})
    if rank == 0:
        print(f"cuda-nccl layer, {n} rank(s): tokens/rank {t}, hidden {h}, intermediate {i}, experts {e}, topk {k}, "
              f"bf16 in/out, static capacity {cap}; {torch.cuda.get_device_name(dev)}")
        for r, item in enumerate(gathered):
            print(f"rank {r}: " + ", ".join(f"{key}: {val}" for key, val in item["report"].items()))
        if times:
            base = statistics.median([item["times"]["torch"] for item in gathered])
            print("| mode | median ms (fwd+bwd, max over ranks) | time / torch backend |")
            print("|---|---|---|")
            for m in ("torch", "synced", "static", "graph"):
                worst = max(item["times"][m] for item in gathered)
                print(f"| {m} | {worst:.3f} | {worst / base:.2f} |")
    ok = all(all(item["report"].values()) for item in gathered)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(f"rank {rank}: a check failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--experts-per-rank", type=int, default=4)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph captures (and the timing)")
    parser.add_argument(
        "--autograd-graph", action="store_true",
        help="also capture forward + loss.backward() (autograd) in a CUDA graph (not verified yet: docs/cuda-nccl.md)",
    )
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    from moe_ep_spec.launch import free_loopback_port

    port = free_loopback_port()
    if args.ranks == 1:
        _rank_main(0, args, port)
        return
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(args, port), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    sys.exit(main())
