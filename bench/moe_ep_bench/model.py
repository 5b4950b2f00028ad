"""What a benchmark run measures, and the numbers counted for it (numpy only).

Everything here is framework-neutral: the run's settings, the routing of every
input set (drawn once, in the parent, and shared by every driver so that each
backend and baseline moves exactly the same rows), and the bytes and
floating-point operations each measurement is divided by. Nothing here imports
torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.inputs import random_topk

__all__ = [
    "OPS",
    "FORMATS",
    "DEFAULT_FORMATS",
    "BenchSettings",
    "Routing",
    "make_routing",
    "row_bytes",
    "weight_bytes",
    "auto_experts",
    "defaults",
    "SLOW_FLOPS",
    "SLOW_BYTES",
]

#: The operations timed on every backend, in report order.
OPS = ("dispatch", "combine", "forward", "forward_backward")
#: The formats a run can sweep (``--format``).
FORMATS = ("bf16", "mxfp8", "nvfp4")
#: The formats swept when ``--format`` is not given.
DEFAULT_FORMATS = ("bf16", "mxfp8")

#: World backends (numpy, one process simulating every rank) skip a case whose
#: fused forward needs more than this many floating-point operations over the
#: world, or whose dispatch moves more than SLOW_BYTES of token rows over the
#: world, unless ``--include-slow``: the numpy reference runs at a few GFLOP/s.
SLOW_FLOPS = 1e9
SLOW_BYTES = 256 * 2**20

#: Bytes a rank holds, per local expert, at the peak of the heaviest timed
#: operation, in units of hidden * intermediate (see :func:`auto_experts`):
#: bf16 weights (6), their float32 copies and float32 gradients in the torch
#: backend's backward (24), the bf16 gradients autograd keeps (6), and slack.
_BYTES_PER_EXPERT_HI = 40


def row_bytes(fmt: str, hidden: int) -> int:
    """Bytes of one token row of width ``hidden`` in ``fmt``: bf16 ``2 H``;
    mxfp8 ``H`` E4M3 codes and ``ceil(H / 32)`` E8M0 scales; nvfp4 ``ceil(H / 2)``
    packed E2M1 codes and ``ceil(H / 16)`` E4M3 scales."""
    if fmt == "bf16":
        return 2 * hidden
    if fmt == "mxfp8":
        return hidden + -(-hidden // 32)
    if fmt == "nvfp4":
        return -(-hidden // 2) + -(-hidden // 16)
    raise ValueError(f"unknown format {fmt!r}")


def weight_bytes(settings: "BenchSettings", fmt: str) -> int:
    """Bytes of one rank's local experts' weights in ``fmt``: fc1 ``[E_local, H, 2I]``
    blocked along H and fc2 ``[E_local, I, H]`` blocked along I (codes and
    scales for a block-scaled format): ``E_local (2I row(fmt, H) + H row(fmt, I))``.
    bf16: ``6 E_local H I``; 2.82 GB for 32 experts at H 7168, I 2048."""
    h, i = settings.hidden, settings.intermediate
    return settings.num_local_experts * (2 * i * row_bytes(fmt, h) + h * row_bytes(fmt, i))


def auto_experts(ep_size: int, hidden: int, intermediate: int, topk: int, memory_budget_gb: float, wanted: int = 256) -> int:
    """The expert count of a run when ``--experts`` is not given: ``wanted``
    (256, as DeepSeek-V3) when its ``wanted / ep_size`` local experts fit in the
    per-GPU memory budget, otherwise the largest power of two of local experts
    that fits, times ``ep_size`` (at least ``topk``, at least one per rank).

    A local expert costs about ``40 * hidden * intermediate`` bytes at the peak
    of the forward+backward (the weights and their float32 copies and
    gradients): 587 MB at hidden 7168, intermediate 2048.
    """
    per_expert = _BYTES_PER_EXPERT_HI * hidden * intermediate
    fit = max(1, int(memory_budget_gb * 1e9 // per_expert))
    local = max(1, wanted // ep_size) if wanted >= ep_size else 1
    if local > fit:
        local = 2 ** int(math.floor(math.log2(fit)))
    experts = local * ep_size
    while experts < topk:
        experts += ep_size
    return experts


def defaults(device: str, quick: bool) -> Dict[str, object]:
    """The shapes and repeat counts a run uses for options not given."""
    if quick:
        return dict(hidden=64, intermediate=32, experts=8, topk=2, tokens=(8, 32), repeats=3, warmup=1, input_sets=2)
    if device == "cuda":
        return dict(
            hidden=7168, intermediate=2048, experts=None, topk=8, tokens=(128, 4096), repeats=20, warmup=3, input_sets=4
        )
    return dict(hidden=512, intermediate=256, experts=16, topk=4, tokens=(32, 128, 512), repeats=5, warmup=1, input_sets=2)


@dataclass(frozen=True)
class BenchSettings:
    """One run's settings (picklable: sent to every rank's process).

    Attributes:
        device: ``cpu`` or ``cuda`` (rank r on ``cuda:r``).
        ep_size: the EP size (ranks).
        hidden, intermediate, experts, topk: the layer's shape.
        tokens: tokens per rank of every case.
        formats: the formats swept (``bf16``, ``mxfp8``, ``nvfp4``).
        ops: the operations timed (a subset of :data:`OPS`).
        repeats, warmup: timed and untimed calls per measurement.
        input_sets: distinct random input sets, used in turn.
        seed: the random seed of the routing and the inputs.
        timeout_s: seconds one measurement may take (a hung rank is stopped).
        baselines: whether to measure the baselines.
        include_slow: time world backends at any size.
    """

    device: str
    ep_size: int
    hidden: int
    intermediate: int
    experts: int
    topk: int
    tokens: Tuple[int, ...]
    formats: Tuple[str, ...]
    ops: Tuple[str, ...] = OPS
    repeats: int = 5
    warmup: int = 1
    input_sets: int = 2
    seed: int = 0
    timeout_s: float = 300.0
    baselines: bool = True
    include_slow: bool = False
    #: The spec's intermediate_format of every layer (None: the exact float32 FC2 operand).
    intermediate_format: Optional[str] = None
    #: How the cuda-nccl layer runs: ``synced`` (host_sync=True), ``static`` (host_sync=False
    #: over NCCL) or ``device`` (host_sync=False over the native layer's device exchange).
    cuda_nccl_mode: str = "synced"
    #: How the device exchange's stages run on CUDA (``cuda_nccl_mode`` device): ``throughput``
    #: (five kernels chained with programmatic dependent launch) or ``low_latency`` (one kernel).
    exchange_mode: str = "throughput"
    #: The spec's backward_operand_format of every layer (None: the exact backward; ``"bf16"``).
    backward_operand_format: Optional[str] = None

    @property
    def num_local_experts(self) -> int:
        return self.experts // self.ep_size

    def config(self, fmt: str, tokens: Optional[int] = None, generate_c: bool = False) -> MoeEpConfig:
        """The layer of format ``fmt``: activation, weights, combine and output all in ``fmt``."""
        return MoeEpConfig(
            num_experts=self.experts,
            hidden=self.hidden,
            intermediate=self.intermediate,
            num_topk=self.topk,
            num_ranks=self.ep_size,
            output_format=fmt,
            combine_format=fmt,
            intermediate_format=self.intermediate_format,
            backward_operand_format=self.backward_operand_format,
            generate_c=generate_c,
            max_tokens_per_rank=tokens,
        )

    def as_dict(self) -> dict:
        return {
            "device": self.device,
            "ep_size": self.ep_size,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "experts": self.experts,
            "num_local_experts": self.num_local_experts,
            "topk": self.topk,
            "tokens": list(self.tokens),
            "formats": list(self.formats),
            "intermediate_format": self.intermediate_format,
            "backward_operand_format": self.backward_operand_format,
            "cuda_nccl_mode": self.cuda_nccl_mode,
            "exchange_mode": self.exchange_mode,
            "ops": list(self.ops),
            "repeats": self.repeats,
            "warmup": self.warmup,
            "input_sets": self.input_sets,
            "seed": self.seed,
            "routing": "uniform",
            "timeout_s": self.timeout_s,
            "baselines": self.baselines,
            "include_slow": self.include_slow,
        }


@dataclass
class Routing:
    """The routing of every input set of one token count.

    Attributes:
        tokens: tokens per rank.
        topk_idx: ``topk_idx[s][r]``: ``[T, K] int64`` expert ids of rank r in set s.
        per: ``per[s]``: ``[ep, ep, E_local] int64``: routes from rank src to
            local expert e of rank dst, ``per[s][src, dst, e]``.
    """

    tokens: int
    topk_idx: List[List[np.ndarray]]
    per: List[np.ndarray] = field(default_factory=list)

    @property
    def num_sets(self) -> int:
        return len(self.topk_idx)

    def send_rows(self, s: int, rank: int) -> List[int]:
        """Routes rank ``rank`` sends to every rank in set ``s`` (dispatch)."""
        return [int(v) for v in self.per[s][rank].sum(axis=1)]

    def recv_rows(self, s: int, rank: int) -> List[int]:
        """Routes rank ``rank`` receives from every rank in set ``s`` (dispatch)."""
        return [int(v) for v in self.per[s][:, rank].sum(axis=1)]

    def expert_rows(self, s: int, rank: int) -> List[int]:
        """Rows of every local expert of ``rank`` in set ``s``."""
        return [int(v) for v in self.per[s][:, rank].sum(axis=0)]

    def mean_recv_rows(self) -> float:
        """Rows received per rank and set, on average: R."""
        n = self.per[0].shape[0]
        return float(np.mean([sum(self.recv_rows(s, r)) for s in range(self.num_sets) for r in range(n)]))

    def mean_remote_rows(self) -> float:
        """Rows received per rank from other ranks, on average."""
        n = self.per[0].shape[0]
        vals = [sum(self.recv_rows(s, r)) - self.recv_rows(s, r)[r] for s in range(self.num_sets) for r in range(n)]
        return float(np.mean(vals))

    def world_rows(self) -> int:
        """The most routes of any set over the whole world."""
        return int(max(p.sum() for p in self.per))


def make_routing(settings: BenchSettings, tokens: int) -> Routing:
    """Uniform top-k routing (K distinct experts per token) for every input
    set, reproducible from ``settings.seed`` and ``tokens``."""
    config = settings.config("bf16")
    n, el = settings.ep_size, settings.num_local_experts
    rng = np.random.default_rng([settings.seed, tokens, 0x6D6F65])
    sets, per = [], []
    for _ in range(settings.input_sets):
        ranks = [random_topk(config, tokens, "uniform", rng).astype(np.int64) for _ in range(n)]
        table = np.zeros((n, n, el), dtype=np.int64)
        for src, idx in enumerate(ranks):
            counts = np.bincount(idx.reshape(-1), minlength=settings.experts)
            table[src] = counts.reshape(n, el)
        sets.append(ranks)
        per.append(table)
    return Routing(tokens=tokens, topk_idx=sets, per=per)


# ----------------------------------------------------------------------------- counted quantities


def dispatch_bytes(settings: BenchSettings, routing: Routing, fmt: str) -> Tuple[float, float]:
    """``(bytes, remote_bytes)``: token-row bytes a rank receives in dispatch,
    on average over ranks and input sets (and those from other ranks)."""
    rb = row_bytes(fmt, settings.hidden)
    return routing.mean_recv_rows() * rb, routing.mean_remote_rows() * rb


def combine_bytes(settings: BenchSettings, routing: Routing, fmt: str) -> Tuple[float, float]:
    """``(bytes, remote_bytes)``: token-row bytes a rank sends in combine (its
    received routes go back, in ``combine_format``), on average."""
    return dispatch_bytes(settings, routing, fmt)


def gemm_flops(settings: BenchSettings, routing: Routing, backward: bool = False) -> float:
    """Floating-point operations of a rank's expert GEMMs, on average:
    forward ``2 R H 2I + 2 R I H = 6 R H I``; forward+backward three times that
    (the backward's four GEMMs do twice the forward's)."""
    f = 6.0 * routing.mean_recv_rows() * settings.hidden * settings.intermediate
    return 3.0 * f if backward else f


def world_forward_flops(settings: BenchSettings, tokens: int) -> float:
    """The fused forward's GEMM operations over the whole world."""
    return 6.0 * settings.ep_size * tokens * settings.topk * settings.hidden * settings.intermediate


def too_slow_for_world(settings: BenchSettings, tokens: int) -> Optional[str]:
    """Why a world backend skips ``tokens`` at this shape, or None."""
    flops = world_forward_flops(settings, tokens)
    moved = settings.ep_size * tokens * settings.topk * row_bytes("bf16", settings.hidden)
    if flops > SLOW_FLOPS or moved > SLOW_BYTES:
        return (
            f"skipped: too slow for this size (fused forward {flops:.2g} FLOP, dispatch {moved / 2**20:.0f} MiB over "
            f"the world; limits {SLOW_FLOPS:.2g} FLOP, {SLOW_BYTES / 2**20:.0f} MiB; --include-slow runs it)"
        )
    return None


def median(values: Sequence[float]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64)))
