"""Where the time of one jax-ffi forward goes, on one GPU (EP 1): the jitted
layer (``shard_moe_ep`` with the native kernels, as ``moe-ep bench`` builds it)
timed, then traced once with ``jax.profiler`` and the GPU events of the trace
summed by name (the XLA fusions, the FFI handlers' kernels, the copies).

    python scripts/gpu_jax_ffi_profile.py --tokens 4096 --format bf16     # issue 14's per-rank shape by default

Prints the median time of --iters calls, the time the trace's GPU events cover,
and the --top event names by total time with their share of that time; then where
the host spends a call: how long issuing one call and 8 calls back to back takes
against the time they finish (a host slower than the GPU starves it), and the
trace's host events by total time (the XLA runtime's and the FFI handlers').
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import statistics
import sys
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--format", choices=("bf16", "mxfp8", "nvfp4"), default="bf16")
    parser.add_argument("--intermediate-format", default="bf16")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--top", type=int, default=24)
    parser.add_argument("--xla", action="store_true", help="XLA's kernels (the jax backend) instead of jax-ffi's")
    args = parser.parse_args()

    from moe_ep_jax.devices import prepare_environment

    prepare_environment()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_ep_jax import formats as F
    from moe_ep_jax.api import shard_moe_ep
    from moe_ep_spec import MoeEpConfig

    t, h, i, e, k, fmt = args.tokens, args.hidden, args.intermediate, args.experts, args.topk, args.format
    devs = jax.devices(os.environ.get("PROFILE_PLATFORM", "gpu"))[:1]
    mesh = Mesh(np.array(devs), ("ep",))
    shard = NamedSharding(mesh, P("ep"))
    kernels = None
    if not args.xla:
        from moe_ep_jax_ffi.kernels import FfiKernels

        kernels = FfiKernels()
    config = MoeEpConfig(num_experts=e, hidden=h, intermediate=i, num_topk=k, num_ranks=1, output_format=fmt,
                         combine_format=fmt, intermediate_format=args.intermediate_format, max_tokens_per_rank=t)
    layer = jax.jit(shard_moe_ep(config, mesh, kernels=kernels))

    def encode(x, f):
        return x.astype(jnp.bfloat16) if f == "bf16" else F.quantize(x, f, axis=1)

    def make():
        key = jax.random.key(0)
        w1 = jax.random.normal(jax.random.fold_in(key, 1), (e, h, 2 * i), jnp.float32) / math.sqrt(h)
        w2 = jax.random.normal(jax.random.fold_in(key, 2), (e, i, h), jnp.float32) / math.sqrt(i)
        x = jax.random.normal(jax.random.fold_in(key, 3), (t, h), jnp.float32)
        tw = jax.random.uniform(jax.random.fold_in(key, 4), (t, k), jnp.float32, 0.05, 1.0)
        return encode(x, fmt), encode(w1, fmt), encode(w2, fmt), tw

    x, w1, w2, tw = jax.jit(make, out_shardings=shard)()
    rng = np.random.default_rng(0)
    idx = jax.device_put(np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32), shard)
    operands = (x, w1, w2, idx, tw)
    for _ in range(2):
        jax.block_until_ready(layer(*operands))
    samples = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        jax.block_until_ready(layer(*operands))
        samples.append((time.perf_counter() - t0) * 1e3)
    median = statistics.median(samples)
    flops = 2 * t * k * h * 3 * i
    print(f"{'jax' if args.xla else 'jax-ffi'} forward {fmt} T={t} H={h} I={i} E={e} K={k}: median {median:.3f} ms "
          f"of {args.iters} ({flops / median / 1e9:.1f} TFLOP/s)")

    tmp = tempfile.mkdtemp(prefix="jaxprof-")
    with jax.profiler.trace(tmp):
        jax.block_until_ready(layer(*operands))
    paths = glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        sys.exit(f"no xplane.pb under {tmp}")
    data = jax.profiler.ProfileData.from_file(paths[0])
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    lo, hi = math.inf, -math.inf
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "Stream" not in line.name and "stream" not in line.name:
                continue
            for ev in line.events:
                totals[ev.name] += ev.duration_ns
                counts[ev.name] += 1
                lo, hi = min(lo, ev.start_ns), max(hi, ev.start_ns + ev.duration_ns)
    busy = sum(totals.values())
    if busy == 0:
        for plane in data.planes:
            print(f"plane {plane.name}: lines {[line.name for line in plane.lines][:12]}")
        sys.exit("the trace has no GPU stream events")
    print(f"trace: GPU events sum {busy / 1e6:.3f} ms over a span of {(hi - lo) / 1e6:.3f} ms")
    for name, ns in totals.most_common(args.top):
        print(f"  {ns / 1e6:8.3f} ms {ns / busy:6.1%} x{counts[name]:<3d} {name[:110]}")

    for n in (1, 8):
        issued, done = [], []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            outs = [layer(*operands) for _ in range(n)]
            t1 = time.perf_counter()
            jax.block_until_ready(outs)
            t2 = time.perf_counter()
            issued.append((t1 - t0) * 1e3 / n)
            done.append((t2 - t0) * 1e3 / n)
        print(f"host: {n} call(s) back to back: issued in {statistics.median(issued):.3f} ms a call, "
              f"done in {statistics.median(done):.3f} ms a call (medians of {args.iters})")
    host: collections.Counter = collections.Counter()
    hcount: collections.Counter = collections.Counter()
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                host[f"{line.name[:24]}: {ev.name}"] += ev.duration_ns
                hcount[f"{line.name[:24]}: {ev.name}"] += 1
    print("host events of the traced call, by total time (nested events overlap):")
    for name, ns in host.most_common(args.top):
        print(f"  {ns / 1e6:8.3f} ms x{hcount[name]:<4d} {name[:120]}")

    # Three calls back to back, traced: every GPU line's busy time and the largest idle
    # gaps of the GPU timeline (what a call costs beyond its kernels).
    tmp3 = tempfile.mkdtemp(prefix="jaxprof3-")
    with jax.profiler.trace(tmp3):
        jax.block_until_ready([layer(*operands) for _ in range(3)])
    data3 = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(tmp3, "**", "*.xplane.pb"), recursive=True)[0])
    evs = []
    for plane in data3.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            busy_line = sum(ev.duration_ns for ev in line.events)
            print(f"3 calls: GPU line {line.name!r}: {len(list(line.events))} events, {busy_line / 1e6:.3f} ms")
            if "Stream" in line.name or "stream" in line.name:
                evs += [(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for ev in line.events]
    evs.sort()
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(evs, evs[1:]) if b[0] > a[1]]
    span = (max(e[1] for e in evs) - evs[0][0]) / 1e6
    print(f"3 calls: span {span:.3f} ms, kernels {sum(e[1] - e[0] for e in evs) / 1e6:.3f} ms, "
          f"idle {sum(g[0] for g in gaps) / 1e6:.3f} ms; largest gaps:")
    for g, before, after in sorted(gaps, reverse=True)[:8]:
        print(f"  {g / 1e3:8.1f} us after {before[:50]} before {after[:50]}")


if __name__ == "__main__":
    main()
