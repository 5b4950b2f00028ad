"""Where the time of one cuda-nccl layer goes, on one GPU (EP 1): CUDA-event
times of forward and forward+backward, and the top kernels of each under
torch.profiler, for the exact (float32) FC2 operand and for a bf16
intermediate_format, in either backward operand mode.

    python scripts/probes/layer_profile.py --tokens 4096      # the DeepSeek-V3 per-rank shape by default
    python scripts/probes/layer_profile.py --mode device --intermediate-format bf16 --backward-operand-format bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import timedelta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--top", type=int, default=14, help="kernels listed per profile")
    parser.add_argument("--mode", choices=("synced", "static", "device"), default="synced",
                        help="synced: host_sync=True; static: host_sync=False over NCCL; device: host_sync=False over "
                             "the native layer's device exchange")
    parser.add_argument("--format", choices=("bf16", "mxfp8", "nvfp4"), default="bf16",
                        help="the activation's, the weights', the combine's and the output's format (block-scaled: "
                             "forward only, as the spec differentiates plain inputs only)")
    parser.add_argument("--detail", action="store_true",
                        help="also the ops by input shape and by the Python lines that issued them (5 frames)")
    parser.add_argument("--timeline", action="store_true",
                        help="also one call's kernels in launch order (forward, and forward+backward in bf16): start after the call's first kernel, "
                             "duration and the idle gap before each (the call queued behind a GPU sleep, as the "
                             "bench times it)")
    parser.add_argument("--backward-operand-format", choices=("none", "bf16"), default="none",
                        help="the layers' backward_operand_format (bf16: the training stacks' rounding, four bf16 "
                             "grouped GEMMs and bf16 weight gradients)")
    parser.add_argument("--intermediate-format", action="append", default=None,
                        help="repeatable; 'none' for the exact float32 FC2 operand (default: none and bf16)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from moe_ep_cuda_nccl import api as cn
    from moe_ep_spec import MoeEpConfig
    from moe_ep_spec.launch import free_loopback_port

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_loopback_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120), device_id=dev)
    t, h, i, e, k = args.tokens, args.hidden, args.intermediate, args.experts, args.topk
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    w1 = (torch.randn(e, h, 2 * i, device=dev, generator=g) / h**0.5).to(torch.bfloat16).requires_grad_()
    w2 = (torch.randn(e, i, h, device=dev, generator=g) / i**0.5).to(torch.bfloat16).requires_grad_()
    idx = torch.rand(t, e, device=dev, generator=g).topk(k, dim=1).indices
    tw = torch.softmax(torch.randn(t, k, device=dev, generator=g), dim=1).requires_grad_()
    dy = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
    flops = 2 * t * k * h * 3 * i  # forward: FC1 (2I) + FC2 (I)

    def timed(fn, iters: int) -> float:
        for _ in range(2):
            fn()
        samples = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            samples.append(a.elapsed_time(b))
        return statistics.median(samples)

    fmt = args.format
    if fmt != "bf16":
        from moe_ep_spec.formats import MoeFormat
        from moe_ep_torch import formats as TF

        f = MoeFormat(fmt)
        with torch.no_grad():  # block-scaled weights as moe_ep_torch takes them: fc1 [E, 2I, H], fc2 [E, H, I]
            x = TF.quantize(x.detach().float(), f)
            w1 = TF.quantize(w1.detach().float().transpose(1, 2).contiguous(), f)
            w2 = TF.quantize(w2.detach().float().transpose(1, 2).contiguous(), f)
    static = args.mode != "synced"
    align = 16
    extra = dict(max_tokens_per_rank=t, recv_capacity=t * k + e * (align - 1), expert_alignment=align) if static else {}
    call = dict(host_sync=not static, exchange={"synced": None, "static": "nccl", "device": "device"}[args.mode])
    print(f"mode {args.mode}: moe_ep(..., {', '.join(f'{a}={b!r}' for a, b in call.items())})", flush=True)
    for inter_name in args.intermediate_format or ["none", "bf16"]:
        inter = None if inter_name == "none" else inter_name
        config = MoeEpConfig(num_experts=e, hidden=h, intermediate=i, num_topk=k, num_ranks=1,
                             intermediate_format=inter, generate_c=True, output_format=fmt, combine_format=fmt,
                             backward_operand_format=None if args.backward_operand_format == "none" else "bf16",
                             **extra)

        def fwd():
            with torch.no_grad():
                return cn.moe_ep(x, w1, w2, idx, tw, config=config, **call)

        def fwd_bwd():
            for p in (x, w1, w2, tw):
                p.grad = None
            cn.moe_ep(x, w1, w2, idx, tw, config=config, **call).backward(dy)

        runs = [("forward", fwd)] + ([("forward+backward", fwd_bwd)] if fmt == "bf16" else [])
        times = {name: timed(fn, args.iters) for name, fn in runs}
        print(f"== format {fmt}, intermediate_format {inter}: forward {times['forward']:.3f} ms "
              f"({flops / times['forward'] / 1e9:.0f} TFLOP/s)"
              + (f", forward+backward {times['forward+backward']:.3f} ms" if len(runs) > 1 else ""), flush=True)
        if args.timeline:
            for name, fn in runs:
                print_timeline(name, fn, profile, ProfilerActivity, torch)
        for name, fn in runs:
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=args.detail,
                         with_stack=args.detail) as prof:
                fn()
                torch.cuda.synchronize()
            print(f"-- {name}: top kernels by CUDA time", flush=True)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70),
                  flush=True)
            if args.detail:
                print(f"-- {name}: by input shape", flush=True)
                print(prof.key_averages(group_by_input_shape=True).table(
                    sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=40, max_shapes_column_width=90),
                    flush=True)
                print(f"-- {name}: by the Python lines that issued them", flush=True)
                print(prof.key_averages(group_by_stack_n=5).table(
                    sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=40), flush=True)
    cn.close_communicators()
    dist.destroy_process_group()


def print_timeline(name, fn, profile, activity, torch) -> None:
    """One call of ``fn`` queued behind a ~1 ms GPU sleep (so the host's launches do not
    pace the GPU, as in the bench): each GPU kernel and copy in order with its start, duration and the
    idle gap before it (microseconds), then the totals."""
    import json
    import tempfile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[activity.CUDA, activity.CPU]) as prof:
        torch.cuda._sleep(2_000_000)
        fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace_file:
            trace = json.load(trace_file)
    gpu = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu.sort(key=lambda e: float(e["ts"]))
    gpu = [e for e in gpu if "sleep" not in e["name"]]
    if not gpu:
        print("-- timeline: no GPU events", flush=True)
        return
    from jax_profile import print_timeline as print_events  # its neighbour in scripts/probes (no jax imported)

    print_events(name, gpu)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    sys.exit(main())
