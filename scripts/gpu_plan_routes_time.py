"""Time moe_ep_plan_routes on CUDA: the one-block kernel against the multi-block
kernels (MOE_EP_PLAN_ROUTES=single|multi forces one; auto is the library's
choice), for a sweep of (T, K, E). Checks every way against the CPU plan bit
for bit first. Two times per case, median of --reps, in microseconds:
  eager: one call on the stream (launch gaps included), CUDA events around it;
  graph: a CUDA graph of --per-graph calls replayed, divided by --per-graph
         (what a captured layer pays).
Run on a device machine with moe-ep-native built with CUDA, e.g.
  python scripts/gpu_plan_routes_time.py
  python scripts/gpu_plan_routes_time.py --cases 4096,8,256 1024,8,256
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np
import torch

from moe_ep_native import host
from moe_ep_native._capi import call

CUDA = 1
MODES = ("single", "multi", "auto")
DEFAULT_CASES = ["4096,8,256", "16384,8,256", "2048,8,256", "1024,8,256", "512,8,256", "256,8,256", "128,8,256",
                 "32,8,256", "4096,8,8", "4096,8,1024", "4096,8,4096", "4096,8,1"]


def _set_mode(mode: str) -> None:
    if mode == "auto":
        os.environ.pop("MOE_EP_PLAN_ROUTES", None)
    else:
        os.environ["MOE_EP_PLAN_ROUTES"] = mode


def _case(t: int, k: int, e: int, reps: int, per_graph: int) -> list[str]:
    rng = np.random.default_rng(t + k + e)
    ids = rng.integers(0, e, size=(t, k)).astype(np.int32)
    if ids.size > 4:
        ids.reshape(-1)[: ids.size // 64] = -1  # a few unused slots and bad ids
        ids.reshape(-1)[1] = e + 5
    want = host.plan_routes(ids, e)
    n = t * k
    idx = torch.from_numpy(ids.reshape(-1).copy()).cuda()
    outs = [torch.empty(max(1, n), dtype=torch.int32, device="cuda") for _ in range(3)]
    outs.append(torch.empty(e + 1, dtype=torch.int32, device="cuda"))
    s = torch.cuda.Stream()

    def plan():
        call("moe_ep_plan_routes", CUDA, torch.cuda.current_stream().cuda_stream, idx.data_ptr(), t, k, e,
             *[o.data_ptr() for o in outs])

    cells = []
    for mode in MODES:
        _set_mode(mode)
        for o in outs:
            o.fill_(-7)
        with torch.cuda.stream(s):
            plan()
        torch.cuda.synchronize()
        ok = (np.array_equal(outs[0].cpu().numpy()[:n], want.send_route)
              and np.array_equal(outs[1].cpu().numpy()[:n], want.route_pos)
              and np.array_equal(outs[2].cpu().numpy()[:n], want.route_expert)
              and np.array_equal(outs[3].cpu().numpy()[:e], want.counts) and int(outs[3][e]) == want.num_bad)
        eager = []
        with torch.cuda.stream(s):
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                plan()
                b.record()
                b.synchronize()
                eager.append(a.elapsed_time(b) * 1e3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(per_graph):
                plan()
        graph.replay()
        torch.cuda.synchronize()
        replays = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            replays.append(a.elapsed_time(b) * 1e3 / per_graph)
        cells.append(f"{mode}: {statistics.median(eager):8.1f} {statistics.median(replays):8.1f}"
                     f"{'' if ok else ' MISMATCH'}")
    _set_mode("auto")
    return cells


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=DEFAULT_CASES, help="T,K,E triples")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--per-graph", type=int, default=20)
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}; times in us (eager, graph per call), median of {args.reps}")
    for c in args.cases:
        t, k, e = (int(x) for x in c.split(","))
        print(f"T={t:6d} K={k} E={e:5d} N={t * k:7d} | " + " | ".join(_case(t, k, e, args.reps, args.per_graph)),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
