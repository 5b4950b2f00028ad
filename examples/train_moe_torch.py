"""Train a small MoE block with ``moe_ep_torch.module.MoeEpLayer`` for a few steps
on CPU, two ranks over gloo on loopback, and check that the loss goes down.

    python examples/train_moe_torch.py            # needs moe-ep-torch (pip install ./backends/torch)
    python examples/train_moe_torch.py --steps 40 --ranks 4
    python examples/train_moe_torch.py --backward-operand-format exact    # the exact float32-operand backward
    MOE_EP_CUDA_NCCL_ON_CPU=1 python examples/train_moe_torch.py --backend cuda-nccl   # the native core

The block is a router (``torch.nn.Linear``, softmax, top-k) in front of the
expert-parallel layer; each rank holds ``num_experts / ranks`` experts and its
own batch of tokens, and learns a fixed random target function. The router is
replicated, so its gradients are averaged over the ranks (data parallel); the
experts are not (expert parallel: each rank trains its own).

The layer trains in the fast mode by default: ``backward_operand_format="bf16"``
rounds the backward's GEMM operands (the output cotangent, ``dc`` and ``w*h``)
to bf16 as training stacks do (on GPUs: four bf16 tensor-core GEMMs instead of
ten); ``--backward-operand-format exact`` keeps them float32. With ``--backend
cuda-nccl`` the layer runs its default path (the device exchange in the static
layout sized from ``max_tokens_per_rank``) and the experts' weights carry
float32 ``main_grad`` tensors (Megatron's convention): the layer adds their
gradients there and the optimizer steps on them (docs/torch.md, "Training").

Every wait is bounded: the process group's collectives (``--timeout``) and the
parent waiting for the ranks (the same, plus start-up). Exit status 0 when the
loss averaged over the ranks decreased by at least ``--min-drop``, else 1.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

__all__ = ["TrainResult", "train_rank", "main"]

HIDDEN = 64
INTERMEDIATE = 32
NUM_EXPERTS = 8
TOPK = 2
TOKENS_PER_RANK = 64


@dataclass(frozen=True)
class TrainResult:
    """What one rank reports.

    Attributes:
        rank: the rank.
        losses: the loss averaged over the ranks, one per step.
        error: the error text when the rank failed (then ``losses`` is empty).
    """

    rank: int
    losses: List[float]
    error: Optional[str] = None


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train_rank(rank: int, ranks: int, port: int, steps: int, timeout_s: float, backend: str = "torch",
               backward_operand_format: Optional[str] = "bf16") -> List[float]:
    """One rank's training loop; returns the loss averaged over the ranks per step."""
    import torch
    import torch.distributed as dist

    from moe_ep_spec import MoeEpConfig
    from moe_ep_torch.module import MoeEpLayer

    torch.set_num_threads(1)  # ranks share the machine's cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=ranks,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        config = MoeEpConfig(
            num_experts=NUM_EXPERTS, hidden=HIDDEN, intermediate=INTERMEDIATE, num_topk=TOPK, num_ranks=ranks,
            max_tokens_per_rank=TOKENS_PER_RANK, backward_operand_format=backward_operand_format,
        )
        torch.manual_seed(1000 + rank)  # each rank: its own experts and its own tokens
        experts = MoeEpLayer(config, backend=backend, dtype=torch.float32)
        main_grad = backend == "cuda-nccl"
        if main_grad:  # Megatron's convention: float32 accumulators the layer adds the weight gradients into
            for p in experts.parameters():
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        torch.manual_seed(0)  # the router is replicated: the same start on every rank
        router = torch.nn.Linear(HIDDEN, NUM_EXPERTS)
        target_map = torch.randn(HIDDEN, HIDDEN) / HIDDEN**0.5  # the function to learn, the same everywhere

        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(TOKENS_PER_RANK, HIDDEN, generator=gen)
        target = torch.tanh(x @ target_map)

        params = list(experts.parameters()) + list(router.parameters())
        optimizer = torch.optim.Adam(params, lr=1e-2)
        losses: List[float] = []
        for _ in range(steps):
            optimizer.zero_grad()
            if main_grad:
                for p in experts.parameters():
                    p.main_grad.zero_()
            probs = router(x).softmax(dim=-1)
            topk_weights, topk_idx = probs.topk(TOPK, dim=-1)
            y = experts(x, topk_idx, topk_weights)  # [T, H] bfloat16
            loss = (y.float() - target).square().mean()
            loss.backward()
            if main_grad:  # .grad is left alone: the optimizer steps on the accumulated main_grad
                for p in experts.parameters():
                    p.grad = p.main_grad.to(p.dtype)
            for p in router.parameters():  # data-parallel router: average its gradients
                dist.all_reduce(p.grad)
                p.grad /= ranks
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / ranks)
        return losses
    finally:
        dist.destroy_process_group()


def _entry(rank: int, ranks: int, port: int, steps: int, timeout_s: float, backend: str,
           backward_operand_format: Optional[str], out: "mp.Queue[TrainResult]") -> None:
    try:
        out.put(TrainResult(rank, train_rank(rank, ranks, port, steps, timeout_s, backend, backward_operand_format)))
    except BaseException as exc:  # noqa: BLE001 - report to the parent, whatever it was
        out.put(TrainResult(rank, [], f"{type(exc).__name__}: {exc}"))


def run(ranks: int, steps: int, timeout_s: float, backend: str = "torch",
        backward_operand_format: Optional[str] = "bf16") -> List[TrainResult]:
    """Start ``ranks`` processes, train, and collect their results (bounded by
    ``timeout_s`` plus start-up; stragglers are terminated)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_loopback_port()
    procs = [ctx.Process(target=_entry, args=(r, ranks, port, steps, timeout_s, backend, backward_operand_format, out),
                         daemon=True) for r in range(ranks)]
    for p in procs:
        p.start()
    results: List[TrainResult] = []
    deadline = time.monotonic() + timeout_s + 60.0
    try:
        while len(results) < ranks:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the ranks did not finish within {timeout_s + 60.0:.0f} s")
            try:
                results.append(out.get(timeout=min(left, 1.0)))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and out.empty():
                    raise RuntimeError(f"rank process exited with code {dead[0].exitcode} before reporting") from None
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return sorted(results, key=lambda r: r.rank)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="expert-parallel ranks, dividing 8 (default: 2)")
    parser.add_argument("--steps", type=int, default=30, help="training steps (default: 30)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any collective may wait (default: 120)")
    parser.add_argument(
        "--min-drop", type=float, default=0.2, help="fraction the loss must fall by, first to last step (default: 0.2)"
    )
    parser.add_argument("--backend", choices=("torch", "cuda-nccl"), default="torch",
                        help="the torch-based backend (cuda-nccl on CPU needs MOE_EP_CUDA_NCCL_ON_CPU=1; default: torch)")
    parser.add_argument("--backward-operand-format", choices=("bf16", "exact"), default="bf16",
                        help="the backward's GEMM operands: bf16 (default, the fast mode) or exact float32")
    args = parser.parse_args(argv)
    if args.ranks < 1 or NUM_EXPERTS % args.ranks:
        parser.error(f"--ranks must divide {NUM_EXPERTS} (the experts are split evenly); got {args.ranks}")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 to see the loss change; got {args.steps}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds; got {args.timeout}")

    mode = None if args.backward_operand_format == "exact" else args.backward_operand_format
    results = run(args.ranks, args.steps, args.timeout, args.backend, mode)
    failed = [r for r in results if r.error]
    if failed:
        for r in failed:
            print(f"rank {r.rank} failed: {r.error}", file=sys.stderr)
        return 1
    losses = results[0].losses
    for step, loss in enumerate(losses):
        if step % 5 == 0 or step == len(losses) - 1:
            print(f"step {step:3d}  loss {loss:.4f}")
    first, last = losses[0], losses[-1]
    ok = last <= (1.0 - args.min_drop) * first
    print(f"loss {first:.4f} -> {last:.4f} over {len(losses)} steps on {args.ranks} ranks: "
          + ("decreased" if ok else f"did not fall by {args.min_drop:.0%}"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
