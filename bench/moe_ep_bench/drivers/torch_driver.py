"""The torch driver, parent side: spawns one process per rank, sends them the
jobs, collects their timings and turns them into rows. Imports no torch:
:mod:`.torch_rank` does, inside the rank processes.

Jobs (:class:`Job`) have one of these targets (the baselines' are their names
in :data:`~moe_ep_bench.results.BASELINES`):

``torch``, ``cuda-nccl``
    a backend with PyTorch tensors in and out, timed in its ranks' processes:
    ``torch``'s own functions (dispatch, combine, the fused forward,
    forward+backward); ``cuda-nccl``'s layer (:mod:`moe_ep_cuda_nccl.api`,
    the same call as :mod:`moe_ep_torch.api`: forward and forward+backward);
    and, for both, forward+backward of bf16 layers through the module a user
    calls, ``moe_ep_torch.module.MoeEpLayer(config, backend=NAME)`` with its
    defaults (rows of variant :data:`MODULE_VARIANT`);
``all_to_all``
    ``torch.distributed.all_to_all_single`` of the same bytes per peer as the
    dispatch (or combine) moves (variant ``nccl`` on CUDA, ``gloo`` on CPU);
``copy``
    one copy of a rank's dispatch bytes: GPU0 to GPU1 (EP >= 2, variant
    ``peer``), device to device on GPU0 (EP 1, ``device``), memcpy on CPU
    (``host``); rank 0 alone;
``grouped_gemm``
    the expert GEMMs on the same per-expert row counts: ``torch._grouped_mm``
    in bf16 on CUDA, per-expert float32 matmuls on CPU;
``weight_read``
    one copy of rank 0's local bf16 expert weights on its device: the
    bandwidth (read plus write bytes over the time) that the ``weight_read``
    rows of every format and token count read the weights at
    (:func:`weight_read_rows`).

What each op of a backend job times (``torch``; ``cuda-nccl`` the same calls
through :mod:`moe_ep_cuda_nccl.api` unless said):

``dispatch``
    ``torch``: ``moe_ep_torch.core.make_plan(..., payload=core.route_payload(tokens,
    topk_weights, K))``, then the received rows into the expert-major buffer
    (``core.buffer_tokens``, ``core.to_buffer``): the spec's ``dispatch`` without
    the numpy conversion. ``cuda-nccl``, ``--cuda-nccl-mode device`` only (the
    default on CUDA; other modes and formats skipped): the native layer's
    ``moe_ep_layer_dispatch`` (device exchange, bf16 rows into the expert-major
    buffer, buffers made once);
``combine``
    ``torch``: the ``combine_format`` round trip of the expert output,
    ``core.exchange_back``, the slot sum (``core.to_slots``, ``core.sum_slots``)
    and the output encode (``core.encode_output``), on a plan made beforehand
    (untimed). ``cuda-nccl``, device mode only: ``moe_ep_layer_combine`` of bf16
    expert rows with the bf16 output encoded in it, after an untimed dispatch of
    the same set;
``forward``
    ``moe_ep(...)`` under ``torch.no_grad()``; ``cuda-nccl`` in the mode of
    ``--cuda-nccl-mode``: ``device`` (``host_sync=False, exchange="device"``,
    static layout with ``recv_capacity = config.worst_case_recv_rows()`` for the
    case's tokens), ``static`` (``host_sync=False`` over NCCL) or ``synced``
    (``host_sync=True``, the default on CPU);
``forward_backward``
    bf16: ``moe_ep(...)`` then ``out.backward(grad)`` on bf16 leaves with
    ``requires_grad``; mxfp8 and nvfp4 (block-scaled inputs are no autograd
    leaves): the explicit API, ``moe_ep_forward_with_stash(...)`` then
    ``moe_ep_backward(grad, ..., fc1_c)``.

Every rank runs the jobs in the same order. A job's time per repeat is the
slowest rank's; the parent stops every rank when one job exceeds the timeout
or a rank dies, and reports the jobs not run as errors.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from moe_ep_spec.launch import free_loopback_port

from ..model import OPS, BenchSettings, Routing, weight_bytes
from ..results import Row, sig
from .jobs import BACKENDS, MODULE_VARIANT, TARGETS, Job

__all__ = ["Job", "make_jobs", "run_jobs", "variant", "TARGETS", "BACKENDS", "MODULE_VARIANT", "weight_read_rows",
           "unsupported"]

def variant(target: str, settings: BenchSettings) -> str:
    """How a baseline is measured on this device and EP size (the rows' ``variant``)."""
    cuda = settings.device == "cuda"
    if target == "all_to_all":
        return "nccl" if cuda else "gloo"
    if target == "copy":
        return ("peer" if settings.ep_size >= 2 else "device") if cuda else "host"
    if target == "grouped_gemm":
        return "torch._grouped_mm" if cuda else "per-expert matmul"
    if target == "weight_read":
        return "device copy" if cuda else "host copy"
    return ""


def unsupported(backend: str, op: str, fmt: str, settings: Optional[BenchSettings] = None) -> Optional[str]:
    """Why the torch driver does not time ``op`` in ``fmt`` on ``backend``, or None.
    ``cuda-nccl`` in the ``device`` mode also times the native layer's device
    exchange stages (dispatch and combine) on bf16 rows."""
    exchange_stage = (
        backend == "cuda-nccl" and op in ("dispatch", "combine") and settings is not None
        and settings.cuda_nccl_mode == "device"
    )
    if exchange_stage and fmt != "bf16":
        return f"skipped: the bench times the device exchange's stages on bf16 rows only (format {fmt})"
    if op not in BACKENDS[backend] and not exchange_stage:
        return (
            f"skipped: the bench times {backend}'s layer only (moe_ep_cuda_nccl.api.moe_ep: forward, "
            "forward_backward) outside --cuda-nccl-mode device, where the device exchange's dispatch and combine "
            "are stages of their own"
        )
    return None


def torch_unsupported(op: str, fmt: str) -> Optional[str]:
    """Why the torch driver cannot time ``op`` in ``fmt`` on the torch backend, or None."""
    return unsupported("torch", op, fmt)


def make_jobs(settings: BenchSettings, backends: Sequence[str], baselines: bool) -> List[Job]:
    """The jobs of a run, in the order the ranks run them: weights phase (bf16
    first), then tokens, then target, then op. ``backends``: those of
    :data:`BACKENDS` to time."""
    specs: List[Tuple[str, str, int, str, bool]] = []
    for fmt in settings.formats:
        for t in settings.tokens:
            for op in settings.ops:
                for b in backends:
                    if unsupported(b, op, fmt, settings) is None:
                        specs.append((b, op, t, fmt, False))
                        if op == "forward_backward" and fmt == "bf16":
                            specs.append((b, op, t, fmt, True))
                if baselines and op in ("dispatch", "combine"):
                    specs.append(("all_to_all", op, t, fmt, False))
                    specs.append(("copy", op, t, fmt, False))
    if baselines:
        fused = [op for op in settings.ops if op in ("forward", "forward_backward")]
        for t in settings.tokens:
            for op in fused:
                specs.append(("grouped_gemm", op, t, "bf16", False))
        if "forward" in settings.ops:
            specs.append(("weight_read", "forward", 0, "bf16", False))
    phases = ["bf16"] + [f for f in settings.formats if f != "bf16"]

    def key(s: Tuple[str, str, int, str, bool]) -> tuple:
        phase = "bf16" if s[0] in ("grouped_gemm", "weight_read") else s[3]
        return (phases.index(phase), s[2], TARGETS.index(s[0]), OPS.index(s[1]), s[3], s[4])

    specs.sort(key=key)
    return [Job(i, *s) for i, s in enumerate(specs)]


def _rank_entry(*args: Any) -> None:
    """The rank processes' target (imports torch there, not here)."""
    from . import torch_rank

    torch_rank.rank_main(*args)


@dataclass
class JobResult:
    status: str
    times_ms: Optional[List[float]]
    reason: str = ""
    label: str = ""
    derived: bool = False
    bytes: Optional[float] = None


def run_jobs(
    settings: BenchSettings,
    routings: Dict[int, Routing],
    jobs: Sequence[Job],
    progress: Any,
) -> Tuple[Dict[int, Tuple[JobResult, ...]], Dict[str, Any]]:
    """Run ``jobs`` in ``settings.ep_size`` spawned rank processes.

    Returns ``(results, environment)``: per job id, every rank's
    :class:`JobResult` (jobs not run get an ``error`` result), and what rank 0
    reported about torch and the devices.
    """
    n = settings.ep_size
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_loopback_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(r, settings, routings, list(jobs), port, out), daemon=True)
        for r in range(n)
    ]
    for p in procs:
        p.start()
    results: Dict[int, Dict[int, JobResult]] = {j.id: {} for j in jobs}
    env: Dict[str, Any] = {}
    done_ranks: set = set()
    failure: Optional[str] = None
    by_id = {j.id: j for j in jobs}
    finished = 0
    last = time.monotonic()
    try:
        while len(done_ranks) < n:
            if time.monotonic() - last > settings.timeout_s:
                pending = [j for j in jobs if len(results[j.id]) < n]
                what = pending[0].describe() if pending else "the end of the run"
                failure = f"timeout: no progress within --timeout {settings.timeout_s:g} s (at {what}); ranks stopped"
                break
            try:
                msg = out.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in done_ranks]
                if dead:
                    # give the queue a moment: a rank may have sent its last words before dying
                    try:
                        msg = out.get(timeout=1.0)
                    except queue_mod.Empty:
                        r = dead[0]
                        failure = f"rank {r} died (exit code {procs[r].exitcode})"
                        break
                else:
                    continue
            kind = msg[0]
            last = time.monotonic()
            if kind == "env":
                env.update(msg[1])
            elif kind == "job":
                _, rank, job_id, res = msg
                results[job_id][rank] = JobResult(**res)
                if len(results[job_id]) == n:
                    finished += 1
                    progress.update(by_id[job_id].describe())
            elif kind == "done":
                done_ranks.add(msg[1])
            elif kind == "fatal":
                _, rank, text = msg
                failure = f"rank {rank} failed: {text}"
                break
    finally:
        for p in procs:
            p.join(timeout=5 if failure is None else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        out.close()
    final: Dict[int, Tuple[JobResult, ...]] = {}
    for j in jobs:
        got = results[j.id]
        if len(got) == n:
            final[j.id] = tuple(got[r] for r in range(n))
        else:
            reason = failure or "the rank processes ended early"
            final[j.id] = (JobResult("error", None, f"not run: {reason}"),)
            progress.update(j.describe() + " (not run)")
    return final, env


def rows_from_results(
    settings: BenchSettings, jobs: Sequence[Job], results: Dict[int, Tuple[JobResult, ...]], labels: Dict[str, str]
) -> List[Row]:
    """One row per job: the slowest rank's time of every repeat, then the median.
    ``labels``: the label of each backend's rows. The ``weight_read`` job gives
    one row per format and token count (:func:`weight_read_rows`)."""
    rows: List[Row] = []
    for j in jobs:
        per_rank = results[j.id]
        if j.target in BACKENDS:
            row = Row(backend=j.target, kind="backend", op=j.op, tokens=j.tokens, format=j.format,
                      ep_size=settings.ep_size, device=settings.device, label=labels.get(j.target, ""),
                      variant=MODULE_VARIANT if j.module else "")
        else:
            row = Row(backend=j.target, kind="baseline", op=j.op, tokens=j.tokens, format=j.format,
                      ep_size=settings.ep_size, device=settings.device, variant=variant(j.target, settings))
        bad = [(r, x) for r, x in enumerate(per_rank) if x.status != "ok"]
        labels_ = [x.label for x in per_rank if x.label]
        if labels_:
            row.label = labels_[0]
        row.derived = any(x.derived for x in per_rank)
        copied = next((x.bytes for x in per_rank if x.bytes), None)
        if bad:
            r, x = bad[0]
            row.status = x.status
            row.reason = x.reason if len(per_rank) == 1 else f"rank {r}: {x.reason}"
        else:
            series = [x.times_ms for x in per_rank if x.times_ms]
            if not series:
                row.status, row.reason = "error", "no timings came back"
            else:
                count = min(len(s) for s in series)
                row.set_times([max(s[i] for s in series) for i in range(count)])
        if j.target == "weight_read":
            rows += weight_read_rows(settings, row, copied)
        else:
            rows.append(row)
    return rows


def weight_read_rows(settings: BenchSettings, copy: Row, copied_bytes: Optional[float]) -> List[Row]:
    """The ``weight_read`` rows of every format and token count from one device
    copy of ``copied_bytes`` (its per-repeat times in ``copy``): reading a
    format's local weights once, ``weight_bytes(fmt)``, at the copy's bandwidth
    ``2 * copied_bytes / time`` (read plus write). The time does not depend on
    the token count (forward only)."""
    rows = []
    for fmt in settings.formats:
        for t in settings.tokens:
            row = Row(**{**copy.as_dict(), "format": fmt, "tokens": t, "samples_ms": [], "ratios": {}})
            if copy.ok and copied_bytes:
                wb = weight_bytes(settings, fmt)
                row.bytes = float(wb)
                row.set_times([ms * wb / (2.0 * copied_bytes) for ms in copy.samples_ms])
                row.derived = True
                bw = 2.0 * copied_bytes / (copy.median_ms / 1e3) / 1e9  # type: ignore[operator]
                row.label = (
                    f"local experts' {fmt} weights ({sig(wb / 1e6)} MB) / device copy bandwidth {sig(bw)} GB/s "
                    f"(read + write bytes / time of: {copy.label})"
                )
            elif copy.status == "ok":
                row.status, row.reason = "error", "the weight copy reported no byte count"
            rows.append(row)
    return rows
