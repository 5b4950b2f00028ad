"""The torch driver, parent side: spawns one process per rank, sends them the
jobs, collects their timings and turns them into rows. Imports no torch:
:mod:`.torch_rank` does, inside the rank processes.

Jobs (:class:`Job`) are of four targets:

``torch``
    the torch backend's own functions on the device (dispatch, combine, the
    fused forward, forward+backward);
``a2a``
    ``torch.distributed.all_to_all_single`` of the same bytes per peer as the
    dispatch (or combine) moves (NCCL on CUDA, gloo on CPU);
``copy``
    one copy of a rank's dispatch bytes: GPU0 to GPU1 (EP >= 2), device to
    device on GPU0 (EP 1), memcpy on CPU; rank 0 alone;
``gemm``
    the expert GEMMs on the same per-expert row counts: ``torch._grouped_mm``
    in bf16 on CUDA, per-expert float32 matmuls on CPU.

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

from ..model import OPS, BenchSettings, Routing
from ..results import Row

__all__ = ["Job", "make_jobs", "run_jobs", "baseline_name", "TARGETS"]

TARGETS = ("torch", "a2a", "copy", "gemm")


@dataclass(frozen=True)
class Job:
    """One measurement in the rank processes."""

    id: int
    target: str
    op: str
    tokens: int
    format: str

    @property
    def phase(self) -> str:
        """The weights the job needs in memory: GEMM baselines run on bf16 weights."""
        return "bf16" if self.target == "gemm" else self.format

    def describe(self) -> str:
        what = "torch" if self.target == "torch" else self.target
        return f"{what} {self.op} {self.format} T={self.tokens}"


def baseline_name(target: str, settings: BenchSettings) -> str:
    """The ``backend`` name of a baseline row."""
    cuda = settings.device == "cuda"
    if target == "a2a":
        return "nccl" if cuda else "gloo"
    if target == "copy":
        if not cuda:
            return "memcpy"
        return "peer-copy" if settings.ep_size >= 2 else "d2d-copy"
    if target == "gemm":
        return "grouped-gemm" if cuda else "matmul"
    return target


def torch_unsupported(op: str, fmt: str) -> Optional[str]:
    """Why the torch driver cannot time ``op`` in ``fmt``, or None."""
    if op == "forward_backward" and fmt != "bf16":
        return (
            "unsupported: moe_ep_torch.api.moe_ep is differentiable with plain float inputs and bf16 output only "
            f"(format {fmt})"
        )
    return None


def make_jobs(settings: BenchSettings, torch_backend: bool, baselines: bool) -> List[Job]:
    """The jobs of a run, in the order the ranks run them: weights phase (bf16
    first), then tokens, then target, then op."""
    specs: List[Tuple[str, str, int, str]] = []
    for fmt in settings.formats:
        for t in settings.tokens:
            for op in settings.ops:
                if torch_backend and torch_unsupported(op, fmt) is None:
                    specs.append(("torch", op, t, fmt))
                if baselines and op in ("dispatch", "combine"):
                    specs.append(("a2a", op, t, fmt))
                    specs.append(("copy", op, t, fmt))
    if baselines:
        fused = [op for op in settings.ops if op in ("forward", "forward_backward")]
        for t in settings.tokens:
            for op in fused:
                specs.append(("gemm", op, t, "bf16"))
    phases = ["bf16"] + [f for f in settings.formats if f != "bf16"]
    specs.sort(key=lambda s: (phases.index("bf16" if s[0] == "gemm" else s[3]), s[2], TARGETS.index(s[0]), OPS.index(s[1]), s[3]))
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
    settings: BenchSettings, jobs: Sequence[Job], results: Dict[int, Tuple[JobResult, ...]], backend_label: str
) -> List[Row]:
    """One row per job: the slowest rank's time of every repeat, then the median."""
    rows: List[Row] = []
    for j in jobs:
        per_rank = results[j.id]
        if j.target == "torch":
            row = Row(backend="torch", kind="backend", op=j.op, tokens=j.tokens, format=j.format,
                      ep_size=settings.ep_size, device=settings.device, label=backend_label)
        else:
            row = Row(backend=baseline_name(j.target, settings), kind="baseline", op=j.op, tokens=j.tokens,
                      format=j.format, ep_size=settings.ep_size, device=settings.device)
        bad = [(r, x) for r, x in enumerate(per_rank) if x.status != "ok"]
        labels = [x.label for x in per_rank if x.label]
        if labels:
            row.label = labels[0]
        row.derived = any(x.derived for x in per_rank)
        if bad:
            r, x = bad[0]
            row.status = x.status
            row.reason = x.reason if len(per_rank) == 1 else f"rank {r}: {x.reason}"
            rows.append(row)
            continue
        series = [x.times_ms for x in per_rank if x.times_ms]
        if not series:
            row.status, row.reason = "error", "no timings came back"
            rows.append(row)
            continue
        count = min(len(s) for s in series)
        slowest = [max(s[i] for s in series) for i in range(count)]
        rows.append(row.set_times(slowest))
    return rows
