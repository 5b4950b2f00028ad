"""Device checks of the native layer's device exchange (scripts/gpu_exchange_check.sh runs them).

  --smoke N   N processes on ONE GPU (CUDA IPC loopback): dispatch and combine
              against the spec's routing order bit for bit (tests/test_native_exchange.py's
              reference), 3 eager steps then 3 replays of a CUDA graph of dispatch+combine
              on new inputs; prints one line per rank.
  --time      EP 1: dispatch and combine of 4096 tokens (hidden 7168, bf16 rows, top-8,
              256 experts) against a device copy of the per-route rows; median of 20.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def _make(n, rank, el, k, cap, tmax, rb, hidden, order, timeout_s=30.0, align=1, num_sms=0):
    from moe_ep_native.exchange import ExchangeLayer, with_exchange
    from moe_ep_native.layer import layer_config
    from moe_ep_spec import MoeEpConfig

    cfg = MoeEpConfig(num_experts=n * el, hidden=hidden, intermediate=128, num_topk=k, num_ranks=n)
    base = layer_config(cfg, max_rows=cap, cuda_device=0, bf16_operands=True, with_backward=False)
    return ExchangeLayer(with_exchange(base, num_ranks=n, rank=rank, num_topk=k, max_tokens=tmax, token_bytes=rb,
                                       expert_alignment=align, timeout_s=timeout_s, combine_order=order,
                                       num_sms=num_sms))


def _smoke_rank(rank, n, port, q):
    try:
        import torch
        import torch.distributed as dist

        from moe_ep_native.exchange import SLOT_ORDER, connect_loopback
        from test_native_exchange import _expected, _routing

        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
        el, k, hidden, rb, tmax, cap = 3, 4, 64, 48, 16, 64 * n
        layer = _make(n, rank, el, k, cap, tmax, rb, hidden, SLOT_ORDER)
        connect_loopback(layer, store, "smoke")
        dev = torch.device("cuda:0")
        bufs = dict(tok=torch.zeros((tmax, rb), dtype=torch.uint8, device=dev),
                    idx=torch.zeros((tmax, k), dtype=torch.int32, device=dev),
                    w=torch.zeros((tmax, k), dtype=torch.float32, device=dev),
                    xo=torch.empty((cap, rb), dtype=torch.uint8, device=dev),
                    wo=torch.empty(cap, dtype=torch.float32, device=dev),
                    mo=torch.empty((cap, 4), dtype=torch.int32, device=dev),
                    gs=torch.empty(el, dtype=torch.int32, device=dev), err=torch.empty(1, dtype=torch.int32, device=dev),
                    y=torch.empty((cap, hidden), dtype=torch.float32, device=dev),
                    out=torch.empty((tmax, hidden), dtype=torch.float32, device=dev),
                    v=torch.empty(cap, dtype=torch.float32, device=dev),
                    ov=torch.empty((tmax, k), dtype=torch.float32, device=dev),
                    cerr=torch.empty(1, dtype=torch.int32, device=dev))
        T = tmax  # every rank the full T (the graph fixes it)

        def step():
            s = torch.cuda.current_stream().cuda_stream
            b = bufs
            layer.dispatch(s, T, rb, b["tok"].data_ptr(), b["idx"].data_ptr(), b["w"].data_ptr(), b["xo"].data_ptr(),
                           b["wo"].data_ptr(), b["mo"].data_ptr(), b["gs"].data_ptr(), None, b["err"].data_ptr())
            # the "experts": y = the row's weight broadcast plus the row's first byte (a function of the row)
            b["y"].copy_(b["wo"].unsqueeze(1) + b["xo"][:, :1].float())
            b["v"].copy_(b["wo"] * 2)
            layer.combine(s, T, b["y"].data_ptr(), b["out"].data_ptr(), b["v"].data_ptr(), b["ov"].data_ptr(),
                          b["cerr"].data_ptr())

        lines, ok = [], True
        graph = None
        for it in range(6):
            rng = [np.random.default_rng(1000 * it + r) for r in range(n)]
            idx = [_routing(rng[r], n, el, k, T, repeat=True) for r in range(n)]
            tok = [rng[r].integers(0, 256, size=(T, rb)).astype(np.uint8) for r in range(n)]
            w = [rng[r].standard_normal((T, k)).astype(np.float32) for r in range(n)]
            bufs["tok"].copy_(torch.from_numpy(tok[rank]))
            bufs["idx"].copy_(torch.from_numpy(idx[rank]))
            bufs["w"].copy_(torch.from_numpy(w[rank]))
            if it < 3:
                step()
            else:
                if graph is None:
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    side = torch.cuda.Stream()
                    with torch.cuda.stream(side):
                        with torch.cuda.graph(graph, stream=side):
                            step()
                    # capturing does not run the kernels: run this step's replay below
                graph.replay()
            torch.cuda.synchronize()
            want = _expected(idx, tok, w, n, el, k, 1, cap)[rank]
            got_meta = bufs["mo"].cpu().numpy()
            same = (np.array_equal(got_meta, want["meta"]) and np.array_equal(bufs["xo"].cpu().numpy(), want["tokens"])
                    and np.array_equal(bufs["wo"].cpu().numpy(), want["w"]) and np.array_equal(bufs["gs"].cpu().numpy(), want["gs"]))
            # combine reference: slot-order sum of the y rows of this rank's routes, wherever they went
            ref = np.zeros((T, hidden), np.float32)
            refv = np.zeros((T, k), np.float32)
            for kk in range(k):
                g = idx[rank][:, kk]
                valid = g >= 0
                row_val = (w[rank][:, kk] + tok[rank][:, 0].astype(np.float32)).astype(np.float32)
                ref = np.where(valid[:, None], ref + row_val[:, None], ref).astype(np.float32)
                refv[:, kk] = np.where(valid, w[rank][:, kk] * 2, 0)
            same_c = np.array_equal(bufs["out"].cpu().numpy(), ref) and np.array_equal(bufs["ov"].cpu().numpy(), refv)
            errs = (int(bufs["err"].item()), int(bufs["cerr"].item()))
            ok = ok and same and same_c and errs == (0, 0)
            lines.append(f"step {it} ({'graph' if it >= 3 else 'eager'}): dispatch {'ok' if same else 'DIFFERS'}, "
                         f"combine {'ok' if same_c else 'DIFFERS'}, errors {errs}")
        store.set(f"done/{rank}", b"1")
        for r in range(n):
            store.get(f"done/{r}")
        layer.close()
        q.put((rank, ok, lines))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        import traceback

        q.put((rank, False, [traceback.format_exc()]))


def smoke(n: int) -> int:
    import multiprocessing as mp

    from moe_ep_spec.launch import free_loopback_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_loopback_port()
    procs = [ctx.Process(target=_smoke_rank, args=(r, n, port, q)) for r in range(n)]
    for p in procs:
        p.start()
    status = 0
    for _ in range(n):
        rank, ok, lines = q.get(timeout=240)
        print(f"rank {rank}: {'PASS' if ok else 'FAIL'}")
        for line in lines:
            print("   ", line)
        status |= 0 if ok else 1
    for p in procs:
        p.join(30)
    print(f"smoke EP {n} on one GPU: {'PASS' if status == 0 else 'FAIL'}")
    return status


def timing(num_sms: int = 0) -> int:
    import torch

    from moe_ep_native.exchange import RANK_SUMS

    torch.cuda.set_device(0)
    T, k, E, H = 4096, 8, 256, 7168
    rb = 2 * H
    cap = T * k
    layer = _make(1, 0, E, k, cap, T, rb, H, RANK_SUMS, num_sms=num_sms)
    size, own = layer.exchange_info()
    layer.set_peers([own])
    dev = torch.device("cuda:0")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn((T, H), device=dev, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    w = torch.rand((T, k), device=dev, generator=g)
    xo = torch.empty((cap, rb), dtype=torch.uint8, device=dev)
    wo = torch.empty(cap, dtype=torch.float32, device=dev)
    mo = torch.empty((cap, 4), dtype=torch.int32, device=dev)
    gs = torch.empty(E, dtype=torch.int32, device=dev)
    err = torch.empty(1, dtype=torch.int32, device=dev)
    y = torch.randn((cap, H), device=dev, generator=g)
    out = torch.empty((T, H), dtype=torch.float32, device=dev)
    s = torch.cuda.current_stream().cuda_stream

    def disp():
        layer.dispatch(s, T, rb, x.data_ptr(), idx.data_ptr(), w.data_ptr(), xo.data_ptr(), wo.data_ptr(),
                       mo.data_ptr(), gs.data_ptr(), None, err.data_ptr())

    def comb():
        layer.combine(s, T, y.data_ptr(), out.data_ptr(), None, None, None)

    order = torch.argsort(idx.reshape(-1).to(torch.int64), stable=True)
    tok_of_route = order // k
    xr = torch.empty((cap, H), dtype=torch.bfloat16, device=dev)
    yr = torch.empty((cap, H), dtype=torch.float32, device=dev)

    def copy_disp():
        torch.index_select(x, 0, tok_of_route, out=xr)

    def copy_comb():
        torch.index_select(y, 0, order, out=yr)

    def med(fn, reps=20):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return float(np.median(times))

    td, tc = med(disp), med(comb)
    bd, bc = med(copy_disp), med(copy_comb)
    error_bits, status = int(err.item()), layer.status()
    if error_bits != 0 or status != 0:
        raise SystemExit(
            f"timing run: the exchange reported error bits {error_bits:#x} and status {status} (both must be 0); "
            f"the timings of a failed exchange mean nothing"
        )
    gb_d, gb_c = cap * rb / 1e9, cap * H * 4 / 1e9
    print(f"EP 1, T={T}, H={H}, top-{k}, {E} experts, symmetric region {size / 2**20:.0f} MiB, "
          f"exchange blocks {num_sms or 'default'}")
    print(f"dispatch: {td * 1e3:8.1f} us   copy of the per-route rows: {bd * 1e3:8.1f} us   ratio {td / bd:5.2f} "
          f"(target <= 1.2; {gb_d / td * 1e3:.0f} GB/s of per-route bytes)")
    print(f"combine:  {tc * 1e3:8.1f} us   copy of the per-route rows: {bc * 1e3:8.1f} us   ratio {tc / bc:5.2f} "
          f"(target <= 1.2; {gb_c / tc * 1e3:.0f} GB/s of per-route bytes)")
    layer.close()
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", type=int, default=0)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--sms", type=int, action="append", default=None,
                    help="with --time: the exchange's thread blocks (repeatable: one timing per value; 0 = default)")
    a = ap.parse_args()
    rc = 0
    if a.smoke:
        rc |= smoke(a.smoke)
    if a.time:
        for sms in a.sms or [0]:
            rc |= timing(sms)
    sys.exit(rc)
