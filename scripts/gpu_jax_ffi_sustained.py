"""Why one jax-ffi call's kernels take ~4.9 ms but calls back to back cost ~5.5 ms each:
the per-call time of n calls issued back to back (n = 1, 3, 8, 32) for the jitted layer
(as ``moe-ep bench`` builds it) and for the bench's grouped-GEMM roofline
(``torch._grouped_mm``, the same shapes, CUDA events around n calls), on one GPU; then
8 jax calls back to back traced, with every call's span and its largest kernel's time,
first call against last (a clock that drops under sustained load shows there).

    python scripts/gpu_jax_ffi_sustained.py --tokens 4096 --format bf16

Run ``nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv -lms 20`` beside it to
see the clocks.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--format", choices=("bf16", "mxfp8"), default="bf16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    from moe_ep_jax.devices import prepare_environment

    prepare_environment()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_ep_jax import formats as F
    from moe_ep_jax.api import shard_moe_ep
    from moe_ep_jax_ffi.kernels import FfiKernels
    from moe_ep_spec import MoeEpConfig

    t, h, i, e, k, fmt = args.tokens, args.hidden, args.intermediate, args.experts, args.topk, args.format
    devs = jax.devices("gpu")[:1]
    mesh = Mesh(np.array(devs), ("ep",))
    shard = NamedSharding(mesh, P("ep"))
    config = MoeEpConfig(num_experts=e, hidden=h, intermediate=i, num_topk=k, num_ranks=1, output_format=fmt,
                         combine_format=fmt, intermediate_format="bf16", max_tokens_per_rank=t)
    layer = jax.jit(shard_moe_ep(config, mesh, kernels=FfiKernels()))

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
    idx_np = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)
    idx = jax.device_put(idx_np, shard)
    operands = (x, w1, w2, idx, tw)
    for _ in range(3):
        jax.block_until_ready(layer(*operands))

    # The roofline's GEMMs on the same routing, in torch.
    dev = torch.device("cuda:0")
    counts = np.bincount(idx_np.reshape(-1), minlength=e)
    rows = int(counts.sum())
    g = torch.Generator(device=dev)
    g.manual_seed(0)
    tx = torch.randn((rows, h), generator=g, device=dev).to(torch.bfloat16)
    th = torch.randn((rows, i), generator=g, device=dev).to(torch.bfloat16)
    fc1 = (torch.randn((e, h, 2 * i), generator=g, device=dev) / math.sqrt(h)).to(torch.bfloat16)
    fc2 = (torch.randn((e, i, h), generator=g, device=dev) / math.sqrt(i)).to(torch.bfloat16)
    offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=dev)

    def gemms():
        return torch._grouped_mm(tx, fc1, offs=offs), torch._grouped_mm(th, fc2, offs=offs)

    for _ in range(3):
        gemms()
    torch.cuda.synchronize()

    print(f"jax-ffi forward {fmt} T={t} H={h} I={i} E={e} K={k}; per-call ms, median of {args.rounds} rounds")
    print(f"{'n back to back':>15} {'jax-ffi wall':>13} {'grouped_mm events':>18} {'grouped_mm wall':>16} {'ratio':>7}")
    for n in (1, 3, 8, 32):
        jw, ge, gw = [], [], []
        for _ in range(args.rounds):
            time.sleep(0.05)
            t0 = time.perf_counter()
            jax.block_until_ready([layer(*operands) for _ in range(n)])
            jw.append((time.perf_counter() - t0) * 1e3 / n)
            time.sleep(0.05)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            outs = [gemms() for _ in range(n)]
            b.record()
            torch.cuda.synchronize()
            gw.append((time.perf_counter() - t0) * 1e3 / n)
            ge.append(a.elapsed_time(b) / n)
            del outs
        mj, mg = statistics.median(jw), statistics.median(ge)
        print(f"{n:>15} {mj:>13.3f} {mg:>18.3f} {statistics.median(gw):>16.3f} {mg / mj:>7.3f}")

    tmp = tempfile.mkdtemp(prefix="jaxprof8-")
    with jax.profiler.trace(tmp):
        jax.block_until_ready([layer(*operands) for _ in range(8)])
    data = jax.profiler.ProfileData.from_file(glob.glob(os.path.join(tmp, "**", "*.xplane.pb"), recursive=True)[0])
    evs = []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "stream" in line.name.lower():
                    evs += [(ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for ev in line.events]
    evs.sort()
    per_call = len(evs) // 8
    print(f"8 calls traced: {len(evs)} GPU events, span {(evs[-1][1] - evs[0][0]) / 1e6:.3f} ms "
          f"({(evs[-1][1] - evs[0][0]) / 8e6:.3f} ms a call)")
    for c in range(8):
        chunk = evs[c * per_call:(c + 1) * per_call]
        big = max(chunk, key=lambda ev: ev[1] - ev[0])
        print(f"  call {c}: span {(chunk[-1][1] - chunk[0][0]) / 1e6:.3f} ms, largest kernel "
              f"{(big[1] - big[0]) / 1e6:.3f} ms ({big[2][:40]})")


if __name__ == "__main__":
    main()
