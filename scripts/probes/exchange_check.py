"""Device checks of the native layer's device exchange: a probe, run by hand on a GPU machine
(scripts/gpu.py runs the exchange's tests).

  --smoke N   N processes on ONE GPU (CUDA IPC loopback): dispatch and combine
              against the spec's routing order bit for bit (tests/test_native_exchange.py's
              reference), 3 eager steps then 3 replays of a CUDA graph of dispatch+combine
              on new inputs, with float32 and with bf16 expert-output rows y; prints one
              line per rank.
  --time      EP 1: dispatch and combine of 4096 tokens (hidden 7168, bf16 rows, top-8,
              256 experts) against a device copy of the per-route rows; median of 20.
              The combine twice: float32 rows y, and bf16 rows y (a layer made with
              bf16 expert-output rows; its copy baseline copies bf16 rows). Checks first
              (bit for bit): the placed rows, the combine against the slot-order sum, and
              the bf16-rows combine against the float32-rows one of the same values.

    python scripts/probes/exchange_check.py --smoke 2
    python scripts/probes/exchange_check.py --time --tokens 128 --mode throughput --mode low_latency
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

#: The exchange mode of every layer made here (--mode sets it; spawned ranks inherit it).
MODE_ENV = "MOE_EP_CUDA_NCCL_EXCHANGE_MODE"


def _make(n, rank, el, k, cap, tmax, rb, hidden, order, timeout_s=30.0, align=1, num_sms=0, bf16_out=False):
    from moe_ep_native.exchange import MODES, ExchangeLayer, with_exchange
    from moe_ep_native.layer import layer_config
    from moe_ep_spec import MoeEpConfig

    cfg = MoeEpConfig(num_experts=n * el, hidden=hidden, intermediate=128, num_topk=k, num_ranks=n)
    base = layer_config(cfg, max_rows=cap, cuda_device=0, bf16_operands=True, with_backward=False,
                        bf16_expert_out=bf16_out)
    return ExchangeLayer(with_exchange(base, num_ranks=n, rank=rank, num_topk=k, max_tokens=tmax, token_bytes=rb,
                                       expert_alignment=align, timeout_s=timeout_s, combine_order=order,
                                       num_sms=num_sms, mode=_mode(MODES)))


def _mode(modes):
    value = os.environ.get(MODE_ENV, "throughput")
    if value not in modes:
        raise SystemExit(f"{MODE_ENV} must be one of {', '.join(map(repr, modes))}; got {value!r}")
    return modes[value]


def _smoke_rank(rank, n, port, q):
    try:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=__import__("datetime").timedelta(seconds=60))
        el, k, hidden, rb, tmax, cap = 3, 4, 64, 48, 16, 64 * n
        lines, ok = [], True
        for bf16_out in (False, True):
            ok_dt, dt_lines = _smoke_layer(rank, n, store, el, k, hidden, rb, tmax, cap, bf16_out)
            ok = ok and ok_dt
            lines += [f"y {'bf16' if bf16_out else 'float32'}: {line}" for line in dt_lines]
        store.set(f"done/{rank}", b"1")
        for r in range(n):
            store.get(f"done/{r}")
        q.put((rank, ok, lines))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        import traceback

        q.put((rank, False, [traceback.format_exc()]))


def _smoke_layer(rank, n, store, el, k, hidden, rb, tmax, cap, bf16_out):
    """One layer (y float32 or bf16) through 3 eager steps and 3 graph replays: (ok, lines)."""
    import torch

    from moe_ep_native.exchange import SLOT_ORDER, connect_loopback
    from test_native_exchange import _expected, _routing

    layer = _make(n, rank, el, k, cap, tmax, rb, hidden, SLOT_ORDER, bf16_out=bf16_out)
    connect_loopback(layer, store, f"smoke-{'bf16' if bf16_out else 'f32'}")
    ydt = torch.bfloat16 if bf16_out else torch.float32
    dev = torch.device("cuda:0")
    bufs = dict(tok=torch.zeros((tmax, rb), dtype=torch.uint8, device=dev),
                idx=torch.zeros((tmax, k), dtype=torch.int32, device=dev),
                w=torch.zeros((tmax, k), dtype=torch.float32, device=dev),
                xo=torch.empty((cap, rb), dtype=torch.uint8, device=dev),
                wo=torch.empty(cap, dtype=torch.float32, device=dev),
                mo=torch.empty((cap, 4), dtype=torch.int32, device=dev),
                gs=torch.empty(el, dtype=torch.int32, device=dev), err=torch.empty(1, dtype=torch.int32, device=dev),
                y=torch.empty((cap, hidden), dtype=ydt, device=dev),
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
        # the "experts": y = the row's weight broadcast plus the row's first byte (a function of the
        # row), rounded to y's dtype
        b["y"].copy_(b["wo"].unsqueeze(1) + b["xo"][:, :1].float())
        b["v"].copy_(b["wo"] * 2)
        layer.combine(s, T, b["y"].data_ptr(), b["out"].data_ptr(), b["v"].data_ptr(), b["ov"].data_ptr(),
                      b["cerr"].data_ptr(), y_bf16=b["y"].dtype == torch.bfloat16)

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
                and np.array_equal(bufs["wo"].cpu().numpy(), want["w"])
                and np.array_equal(bufs["gs"].cpu().numpy(), want["gs"]))
        # combine reference: slot-order sum of the y rows of this rank's routes, wherever they went
        ref = np.zeros((T, hidden), np.float32)
        refv = np.zeros((T, k), np.float32)
        for kk in range(k):
            g = idx[rank][:, kk]
            valid = g >= 0
            row_val = (w[rank][:, kk] + tok[rank][:, 0].astype(np.float32)).astype(np.float32)
            row_val = torch.from_numpy(row_val).to(ydt).float().numpy()  # as the combine reads it
            ref = np.where(valid[:, None], ref + row_val[:, None], ref).astype(np.float32)
            refv[:, kk] = np.where(valid, w[rank][:, kk] * 2, 0)
        same_c = np.array_equal(bufs["out"].cpu().numpy(), ref) and np.array_equal(bufs["ov"].cpu().numpy(), refv)
        errs = (int(bufs["err"].item()), int(bufs["cerr"].item()))
        ok = ok and same and same_c and errs == (0, 0)
        lines.append(f"step {it} ({'graph' if it >= 3 else 'eager'}): dispatch {'ok' if same else 'DIFFERS'}, "
                     f"combine {'ok' if same_c else 'DIFFERS'}, errors {errs}")
    torch.cuda.synchronize()
    store.set(f"closing-{int(bf16_out)}/{rank}", b"1")
    for r in range(n):  # no rank frees its region while a peer may still write into it
        store.get(f"closing-{int(bf16_out)}/{r}")
    layer.close()
    return ok, lines


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


def timing(num_sms: int = 0, tokens: int = 4096, profile_kernels: bool = True) -> int:
    import torch

    from moe_ep_native.exchange import RANK_SUMS

    torch.cuda.set_device(0)
    T, k, E, H = tokens, 8, 256, 7168
    rb = 2 * H
    cap = T * k
    layers = {}  # y's dtype -> a one-rank layer (float32 rows y, or bf16 rows y)
    for name, bf16_out in (("float32", False), ("bf16", True)):
        layer = _make(1, 0, E, k, cap, T, rb, H, RANK_SUMS, num_sms=num_sms, bf16_out=bf16_out)
        size, own = layer.exchange_info()
        layer.set_peers([own])
        layers[name] = layer
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
    ys = {"bf16": torch.randn((cap, H), device=dev, generator=g).to(torch.bfloat16)}
    ys["float32"] = ys["bf16"].float()  # the same values
    outs = {name: torch.empty((T, H), dtype=torch.float32, device=dev) for name in ys}
    def disp(name="float32"):
        s = torch.cuda.current_stream().cuda_stream  # read per call: a graph capture runs on its own stream
        layers[name].dispatch(s, T, rb, x.data_ptr(), idx.data_ptr(), w.data_ptr(), xo.data_ptr(), wo.data_ptr(),
                              mo.data_ptr(), gs.data_ptr(), None, err.data_ptr())

    def comb(name):
        s = torch.cuda.current_stream().cuda_stream
        layers[name].combine(s, T, ys[name].data_ptr(), outs[name].data_ptr(), None, None, None,
                             y_bf16=name == "bf16")

    # Checks, bit for bit: the placed rows, the combine against the slot-order sum from +0, and the
    # bf16-rows combine against the float32-rows one.
    disp("bf16")
    comb("bf16")
    disp()
    comb("float32")
    torch.cuda.synchronize()
    meta = mo.long()
    placed = meta[:, 0] >= 0
    rows_of = torch.full((T, k), -1, dtype=torch.int64, device=dev)
    rows_of[meta[placed, 2], meta[placed, 3]] = torch.nonzero(placed).flatten()
    ref = torch.zeros((T, H), dtype=torch.float32, device=dev)
    for kk in range(k):
        ok = (rows_of[:, kk] >= 0).unsqueeze(1)
        ref = torch.where(ok, ref + ys["float32"][rows_of[:, kk].clamp(min=0)], ref)
    problems = []
    if int(placed.sum()) != T * k or int(err.item()) != 0:
        problems.append(f"dispatch placed {int(placed.sum())} rows of {T * k} with error bits {int(err.item()):#x}")
    elif not torch.equal(xo.view(torch.bfloat16), x[meta[:, 2]]):
        problems.append("dispatch: a placed row differs from its token's row")
    if not torch.equal(outs["float32"].view(torch.int32), ref.view(torch.int32)):
        bad = int((outs["float32"].view(torch.int32) != ref.view(torch.int32)).sum())
        problems.append(f"combine (float32 rows): {bad} of {T * H} sums differ from the slot-order sum")
    if not torch.equal(outs["bf16"].view(torch.int32), outs["float32"].view(torch.int32)):
        bad = int((outs["bf16"].view(torch.int32) != outs["float32"].view(torch.int32)).sum())
        problems.append(f"combine (bf16 rows): {bad} of {T * H} sums differ from float32 rows' of the same values")
    if problems:
        raise SystemExit("timing run: the checks failed (the timings would mean nothing): " + "; ".join(problems))

    order = torch.argsort(idx.reshape(-1).to(torch.int64), stable=True)
    tok_of_route = order // k
    xr = torch.empty((cap, H), dtype=torch.bfloat16, device=dev)
    yr = {name: torch.empty((cap, H), dtype=y.dtype, device=dev) for name, y in ys.items()}

    def copy_disp():
        torch.index_select(x, 0, tok_of_route, out=xr)

    def copy_comb(name):
        torch.index_select(ys[name], 0, order, out=yr[name])

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

    td, bd = med(disp), med(copy_disp)
    tc = {name: med(lambda name=name: comb(name)) for name in ys}
    bc = {name: med(lambda name=name: copy_comb(name)) for name in ys}
    error_bits, status = int(err.item()), [layer.status() for layer in layers.values()]
    if error_bits != 0 or any(status):
        raise SystemExit(
            f"timing run: the exchange reported error bits {error_bits:#x} and status {status} (all must be 0); "
            f"the timings of a failed exchange mean nothing"
        )
    size = layers["float32"].exchange_info()[0]
    print(f"EP 1, T={T}, H={H}, top-{k}, {E} experts, symmetric region {size / 2**20:.0f} MiB, "
          f"exchange blocks {num_sms or 'default'}, mode {os.environ.get(MODE_ENV, 'throughput')}; "
          f"checks passed (bit for bit)")
    gb_d = cap * rb / 1e9
    print(f"dispatch:             {td * 1e3:8.1f} us   copy of the per-route rows: {bd * 1e3:8.1f} us   "
          f"ratio {td / bd:5.2f} (target <= 1.2; {gb_d / td * 1e3:.0f} GB/s of per-route bytes)")
    for name, y in ys.items():
        gb_c = cap * H * y.element_size() / 1e9
        print(f"combine ({name + ' y)':9s}  {tc[name] * 1e3:8.1f} us   copy of the per-route rows: "
              f"{bc[name] * 1e3:8.1f} us   ratio {tc[name] / bc[name]:5.2f} "
              f"(target <= 1.2; {gb_c / tc[name] * 1e3:.0f} GB/s of per-route bytes)")
    # The same stages replayed from CUDA graphs (no launch gaps), and where a dispatch's time goes.
    graphs = {}
    for what, fn in (("dispatch", disp), ("combine (bf16 y)", lambda: comb("bf16"))):
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up on the side stream, as torch's graph capture recommends
            with torch.cuda.graph(graph, stream=side):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graphs[what] = graph
    gd, gc = med(graphs["dispatch"].replay), med(graphs["combine (bf16 y)"].replay)
    print(f"graph replay: dispatch {gd * 1e3:8.1f} us (ratio {gd / bd:5.2f}), combine (bf16 y) {gc * 1e3:8.1f} us "
          f"(ratio {gc / bc['bf16']:5.2f})")
    from torch.profiler import ProfilerActivity, profile

    if not profile_kernels:
        for layer in layers.values():
            layer.close()
        return 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            disp()
            comb("bf16")
        torch.cuda.synchronize()
    print("kernels of 5 dispatches and 5 combines (bf16 y):")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    if int(err.item()) != 0 or any(layer.status() for layer in layers.values()):
        raise SystemExit(f"timing run: error bits {int(err.item()):#x} after the graph replays")
    for layer in layers.values():
        layer.close()
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", type=int, default=0)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--tokens", type=int, action="append", default=None,
                    help="with --time: tokens per rank (repeatable; default 4096; kernels listed for the first)")
    ap.add_argument("--sms", type=int, action="append", default=None,
                    help="with --time: the exchange's thread blocks (repeatable: one timing per value; 0 = default)")
    ap.add_argument("--mode", action="append", choices=("throughput", "low_latency"), default=None,
                    help="the exchange's mode (repeatable: --smoke and --time once per mode; default throughput)")
    a = ap.parse_args()
    rc = 0
    for mode in a.mode or ["throughput"]:
        os.environ[MODE_ENV] = mode
        print(f"== mode {mode}")
        if a.smoke:
            rc |= smoke(a.smoke)
        if a.time:
            for sms in a.sms or [0]:
                for n, tokens in enumerate(a.tokens or [4096]):
                    rc |= timing(sms, tokens, profile_kernels=n == 0)
    sys.exit(rc)
