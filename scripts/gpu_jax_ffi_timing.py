"""Time the jax layer's fused forward and forward+backward with the native
kernels (jax-ffi) against the same layer with the XLA-native kernels (jax), in
one run on the same inputs, and print the ratios.

    python3 scripts/gpu_jax_ffi_timing.py [EP] [TOKENS...]     e.g. 2 128 1024

Shape: E = 32 experts per rank, H = 2048, I = 1024, top-8; float32 activations
and weights (no decode), bf16 combine and output (the config defaults), no
intermediate rounding; random distinct experts per token, so C = EP * T * 8 rows. Each
number is the median of 20 timed calls after 3 warm-up calls, with
block_until_ready. The native CUDA GEMMs are plain float32 tiled kernels (no
tensor cores), so this is a baseline for later work, not a target.
"""

from __future__ import annotations

import statistics
import sys
import time
from functools import partial

import numpy as np

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_ep_jax import api as A
from moe_ep_jax.kernels import XlaKernels
from moe_ep_jax_ffi.kernels import FfiKernels
from moe_ep_spec import MoeEpConfig


def main() -> None:
    ep = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    token_list = [int(t) for t in sys.argv[2:]] or [128, 1024]
    el, h, i, k = 32, 2048, 1024, 8
    mesh = Mesh(np.array(jax.devices()[:ep]), ("ep",))
    shard = NamedSharding(mesh, P("ep"))
    print(f"devices {jax.devices()[:ep]}; E={el * ep} ({el}/rank) H={h} I={i} K={k}; median of 20 calls")
    print(f"{'tokens/rank':>11} {'op':>16} {'jax (XLA) ms':>13} {'jax-ffi ms':>11} {'jax-ffi / jax':>14}")
    for t in token_list:
        config = MoeEpConfig(num_experts=el * ep, hidden=h, intermediate=i, num_topk=k, num_ranks=ep,
                             max_tokens_per_rank=t)
        rng = np.random.default_rng(t)
        x = jax.device_put(rng.standard_normal((ep * t, h)).astype(np.float32), shard)
        w1 = jax.device_put((rng.standard_normal((ep * el, h, 2 * i)) / np.sqrt(h)).astype(np.float32), shard)
        w2 = jax.device_put((rng.standard_normal((ep * el, i, h)) / np.sqrt(i)).astype(np.float32), shard)
        idx = jax.device_put(np.stack([rng.permutation(config.num_experts)[:k] for _ in range(ep * t)]).astype(np.int32), shard)
        tw = jax.device_put(rng.uniform(0.1, 1, (ep * t, k)).astype(np.float32), shard)
        args = (x, w1, w2, idx, tw)
        for op in ("forward", "forward_backward"):
            times = {}
            for name, kern in (("jax", XlaKernels()), ("jax-ffi", FfiKernels())):
                layer = partial(A.moe_ep, config=config, kernels=kern)
                if op == "forward":
                    body = layer
                else:
                    def body(x, w1, w2, idx, tw, layer=layer):
                        out, pull = jax.vjp(lambda x, w1, w2, tw: layer(x, w1, w2, idx, tw), x, w1, w2, tw)
                        return pull(out)
                fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
                for _ in range(3):
                    jax.block_until_ready(fn(*args))
                samples = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    samples.append(time.perf_counter() - t0)
                times[name] = statistics.median(samples) * 1e3
            print(f"{t:>11} {op:>16} {times['jax']:>13.3f} {times['jax-ffi']:>11.3f} {times['jax-ffi'] / times['jax']:>14.2f}")


if __name__ == "__main__":
    main()
