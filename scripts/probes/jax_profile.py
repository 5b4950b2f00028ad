"""Where the time of one jax-ffi (or jax) layer goes, on one device (EP 1): the jitted
forward and forward+backward timed (median of --iters calls, perf_counter around each call
and its block_until_ready: no CUDA events), then one call of each profiled under
torch.profiler, whose CUPTI collection records every kernel of the process, XLA's and the
FFI handlers' included: the top kernels by GPU time and, with --timeline, each kernel in
order with its duration and the idle gap before it (as layer_profile.py's print_timeline;
no GPU sleep is queued before the call, since XLA's stream is not torch's, so a gap may be
the host launching the next kernel).

The inputs are layer_profile.py's (the DeepSeek-V3 per-rank shape by default): x, w1, w2
and the cotangent dY normal in bf16 (weights scaled by 1/sqrt of their fan-in), top-k of
uniform scores for the routing, softmax router weights (float32), from torch's generator
seeded 0 on the profiled device. The layer is moe_ep_jax.api.shard_moe_ep over a mesh of
one device, as the bench's jax driver runs it; forward+backward is jax.vjp with respect to
x, w1, w2 and topk_weights applied to the bf16 dY, returning the output and the four
gradients (--grads-only: the gradients only, as the bench times it, so XLA drops the
forward's combine).

    # on the device machine, from the repository root: `gpu.py build` (not --quick) installs
    # jax-ffi with its CUDA handlers (docs/gpu.md: a carried .devbuild makes it quick)
    python scripts/gpu.py build --out $OUT/gpu && python scripts/probes/jax_profile.py --timeline
    python scripts/probes/jax_profile.py --backend jax --backward-operand-format none
    # here, on jax's CPU devices, tiny sizes (no CUDA kernels to list)
    python scripts/probes/jax_profile.py --device cpu --tokens 64 --hidden 256 --intermediate 128 --experts 8 --topk 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, Callable, Dict, List, Sequence, Tuple


def parse_args(argv: Sequence[str] = None) -> argparse.Namespace:  # type: ignore[assignment]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("jax-ffi", "jax"), default="jax-ffi",
                        help="jax-ffi: FfiKernels (the native core through XLA FFI); jax: XLA's kernels")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: jax's CPU devices (then there are no CUDA kernels to profile)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5, help="timed calls per function (the median is printed)")
    parser.add_argument("--top", type=int, default=20, help="kernels listed per profile")
    parser.add_argument("--intermediate-format", choices=("none", "bf16", "mxfp8", "nvfp4"), default="bf16")
    parser.add_argument("--backward-operand-format", choices=("none", "bf16"), default="bf16",
                        help="bf16: the training stacks' rounding (four bf16 grouped GEMMs, bf16 weight gradients)")
    parser.add_argument("--layout", choices=("dynamic", "static"), default="dynamic",
                        help="dynamic: C = T*K rows (the bench's); static: recv_capacity T*K + E*15, "
                             "expert_alignment 16 (layer_profile.py's --mode static)")
    parser.add_argument("--grads-only", action="store_true",
                        help="forward+backward returns the gradients only (the bench's jax driver)")
    parser.add_argument("--timeline", action="store_true", help="also each call's kernels in order")
    parser.add_argument("--dump-hlo", metavar="DIR", default=None,
                        help="write each jitted function's optimized HLO (compiled.as_text()) into DIR")
    return parser.parse_args(argv)


def make_inputs(args: argparse.Namespace) -> Dict[str, Any]:
    """layer_profile.py's tensors, made by torch (its generator on the device, seed 0), as
    numpy arrays (bf16 as ml_dtypes.bfloat16), or made by numpy where torch is missing."""
    import ml_dtypes
    import numpy as np

    t, h, i, e, k = args.tokens, args.hidden, args.intermediate, args.experts, args.topk
    bf16 = ml_dtypes.bfloat16
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        dev = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
        g = torch.Generator(device=dev).manual_seed(0)

        def host(a: Any) -> Any:
            if a.dtype == torch.bfloat16:
                return a.view(torch.int16).cpu().numpy().view(bf16)
            return a.cpu().numpy()

        x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        w1 = (torch.randn(e, h, 2 * i, device=dev, generator=g) / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, i, h, device=dev, generator=g) / i**0.5).to(torch.bfloat16)
        idx = torch.rand(t, e, device=dev, generator=g).topk(k, dim=1).indices.to(torch.int32)
        tw = torch.softmax(torch.randn(t, k, device=dev, generator=g), dim=1)
        dy = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
        out = {name: host(a) for name, a in dict(x=x, w1=w1, w2=w2, idx=idx, tw=tw, dy=dy).items()}
        del x, w1, w2, idx, tw, dy
        if args.device == "cuda":
            torch.cuda.empty_cache()
        return out
    rng = np.random.default_rng(0)
    scores = rng.random((t, e))
    logits = rng.standard_normal((t, k))
    tw = np.exp(logits - logits.max(axis=1, keepdims=True))
    return dict(
        x=rng.standard_normal((t, h), np.float32).astype(bf16),
        w1=(rng.standard_normal((e, h, 2 * i), np.float32) / h**0.5).astype(bf16),
        w2=(rng.standard_normal((e, i, h), np.float32) / i**0.5).astype(bf16),
        idx=np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int32),
        tw=(tw / tw.sum(axis=1, keepdims=True)).astype(np.float32),
        dy=rng.standard_normal((t, h), np.float32).astype(bf16),
    )


def build(args: argparse.Namespace, jax: Any, inputs: Dict[str, Any]) -> Tuple[List[Tuple[str, Callable, tuple]], str]:
    """The jitted functions ``[(name, compiled, arguments)]`` and a line saying what runs."""
    import numpy as np
    from jax.sharding import Mesh

    from moe_ep_jax.api import shard_moe_ep
    from moe_ep_spec import MoeEpConfig

    t, h, i, e, k = args.tokens, args.hidden, args.intermediate, args.experts, args.topk
    devs = jax.devices("cpu" if args.device == "cpu" else "gpu")
    mesh = Mesh(np.array(devs[:1]), ("ep",))
    extra: Dict[str, Any] = {}
    if args.layout == "static":
        extra = dict(recv_capacity=t * k + e * 15, expert_alignment=16)
    config = MoeEpConfig(
        num_experts=e, hidden=h, intermediate=i, num_topk=k, num_ranks=1, max_tokens_per_rank=t,
        output_format="bf16", combine_format="bf16",
        intermediate_format=None if args.intermediate_format == "none" else args.intermediate_format,
        backward_operand_format=None if args.backward_operand_format == "none" else "bf16", **extra)
    kernels = None
    if args.backend == "jax-ffi":
        from moe_ep_jax_ffi.kernels import FfiKernels

        kernels = FfiKernels()
    layer = shard_moe_ep(config, mesh, kernels=kernels)
    dev = devs[0]
    a = {name: jax.device_put(v, dev) for name, v in inputs.items()}

    def forward(x: Any, w1: Any, w2: Any, idx: Any, tw: Any) -> Any:
        return layer(x, w1, w2, idx, tw)

    def forward_backward(x: Any, w1: Any, w2: Any, idx: Any, tw: Any, dy: Any) -> Any:
        out, pull = jax.vjp(lambda x, w1, w2, tw: layer(x, w1, w2, idx, tw), x, w1, w2, tw)
        grads = pull(dy)
        return grads if args.grads_only else (out, grads)

    fwd_args = (a["x"], a["w1"], a["w2"], a["idx"], a["tw"])
    runs = []
    for name, fn, fargs in (("forward", forward, fwd_args), ("forward+backward", forward_backward, fwd_args + (a["dy"],))):
        compiled = jax.jit(fn).lower(*fargs).compile()
        if args.dump_hlo:
            os.makedirs(args.dump_hlo, exist_ok=True)
            path = os.path.join(args.dump_hlo, f"{args.backend}-{name.replace('+', '_')}.hlo.txt")
            with open(path, "w") as f:
                f.write(compiled.as_text())
            print(f"   HLO of {name}: {path}", flush=True)
        runs.append((name, compiled, fargs))
    what = (f"{args.backend} ({type(kernels).__name__ if kernels is not None else 'XlaKernels'}) on {dev.platform} "
            f"({dev.device_kind}): T={t} H={h} I={i} E={e} K={k}, {args.layout} layout, intermediate_format "
            f"{config.intermediate_format}, backward_operand_format {config.backward_operand_format}, "
            f"forward+backward returns {'the gradients only' if args.grads_only else 'the output and the gradients'}")
    return runs, what


def timed(jax: Any, fn: Callable, fargs: tuple, iters: int) -> Tuple[float, float]:
    """``(median ms of one call and its block_until_ready, ms per call of iters calls back to back)``."""
    for _ in range(2):
        jax.block_until_ready(fn(*fargs))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*fargs))
        samples.append((time.perf_counter() - t0) * 1e3)
    t0 = time.perf_counter()
    outs = [fn(*fargs) for _ in range(iters)]
    jax.block_until_ready(outs)
    piped = (time.perf_counter() - t0) * 1e3 / iters
    del outs
    return statistics.median(samples), piped


def gpu_events(jax: Any, fn: Callable, fargs: tuple) -> List[Dict[str, Any]]:
    """The GPU kernels, copies and memsets of one call of ``fn`` under torch.profiler (CUPTI
    records the whole process's), in start order; empty without torch's CUDA profiling."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    jax.block_until_ready(fn(*fargs))
    with profile(activities=activities) as prof:
        jax.block_until_ready(fn(*fargs))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    gpu = [ev for ev in trace.get("traceEvents", [])
           if ev.get("ph") == "X" and ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu.sort(key=lambda ev: float(ev["ts"]))
    return gpu


def print_top(name: str, gpu: List[Dict[str, Any]], top: int) -> None:
    """Kernels by total GPU time: total, count, mean, share of the call's kernel time."""
    totals: Dict[str, List[float]] = defaultdict(list)
    for ev in gpu:
        totals[ev["name"]].append(float(ev["dur"]))
    busy = sum(sum(v) for v in totals.values())
    span = max(float(ev["ts"]) + float(ev["dur"]) for ev in gpu) - float(gpu[0]["ts"])
    print(f"-- {name}: top kernels by GPU time (one call: {len(gpu)} events, kernel time {busy / 1e3:.3f} ms, "
          f"span {span / 1e3:.3f} ms)", flush=True)
    print(f"{'total us':>10} {'count':>5} {'mean us':>9} {'share':>6}  kernel", flush=True)
    ranked = sorted(totals.items(), key=lambda kv: -sum(kv[1]))
    for kname, durs in ranked[:top]:
        s = sum(durs)
        print(f"{s:10.1f} {len(durs):5d} {s / len(durs):9.1f} {100 * s / busy:5.1f}%  {kname[:120]}", flush=True)
    if len(ranked) > top:
        rest = sum(sum(d) for _, d in ranked[top:])
        print(f"{rest:10.1f} {sum(len(d) for _, d in ranked[top:]):5d} {'':>9} {100 * rest / busy:5.1f}%  "
              f"({len(ranked) - top} other kernels)", flush=True)
    gemm = sum(sum(d) for kname, d in totals.items() if _is_gemm(kname))
    print(f"-- {name}: GEMM kernels {gemm / 1e3:.3f} ms, everything else {(busy - gemm) / 1e3:.3f} ms", flush=True)


def _is_gemm(kernel: str) -> bool:
    """Whether a kernel name is a matrix multiply's (CUTLASS, cuBLAS, XLA's Triton GEMMs)."""
    k = kernel.lower()
    return any(word in k for word in ("gemm", "cutlass", "cublas", "sm90_xmma", "matmul", "wgmma"))


def print_timeline(name: str, gpu: List[Dict[str, Any]]) -> None:
    """Each GPU event of the call in order: start after the first, duration, idle gap before it (us)."""
    t0, end, busy, gaps = float(gpu[0]["ts"]), float(gpu[0]["ts"]), 0.0, 0.0
    print(f"-- timeline of one {name} (us): start, duration, idle gap before, kernel", flush=True)
    for ev in gpu:
        ts, dur = float(ev["ts"]), float(ev["dur"])
        gap = max(0.0, ts - end)
        gaps += gap
        busy += max(0.0, ts + dur - max(ts, end))
        end = max(end, ts + dur)
        print(f"{ts - t0:9.1f} {dur:8.1f} {gap:7.1f}  {ev['name'][:110]}", flush=True)
    print(f"-- span {end - t0:.1f} us: busy {busy:.1f}, idle gaps {gaps:.1f}, {len(gpu)} events", flush=True)


def main(argv: Sequence[str] = None) -> int:  # type: ignore[assignment]
    args = parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    if args.device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    inputs = make_inputs(args)
    from moe_ep_jax.devices import prepare_environment

    prepare_environment()
    import jax

    runs, what = build(args, jax, inputs)
    del inputs
    print(what, flush=True)
    for name, fn, fargs in runs:
        single, piped = timed(jax, fn, fargs, args.iters)
        print(f"== {name}: {single:.3f} ms a call (median of {args.iters}, perf_counter + block_until_ready), "
              f"{piped:.3f} ms a call with {args.iters} calls back to back", flush=True)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("-- no torch here: no profile", flush=True)
        return 0
    for name, fn, fargs in runs:
        gpu = gpu_events(jax, fn, fargs)
        if not gpu:
            print(f"-- {name}: the profile holds no CUDA kernels (device {args.device})", flush=True)
            continue
        print_top(name, gpu, args.top)
        if args.timeline:
            print_timeline(name, gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
