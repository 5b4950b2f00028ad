"""The world driver: backends of the world launch model (the numpy reference).

One process drives every rank, so a call's time is the whole world's, taken
with ``time.perf_counter`` around the world-level method: ``backend.dispatch(config,
inputs)``, ``backend.combine(config, handles, expert_out)``, ``backend.forward(config,
inputs)``, and for forward+backward ``forward`` with ``generate_c=True`` then
``backward(config, inputs, grads, stash)``. Inputs are numpy
arrays made here from the run's routing (random, never zeros). Large cases are
skipped unless ``--include-slow`` (see :func:`~moe_ep_bench.model.too_slow_for_world`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import numpy as np

from moe_ep_spec.api import DispatchInputs, RankInputs
from moe_ep_spec.backend import MoeEpBackend
from moe_ep_spec.formats import BF16, quantize

from ..model import BenchSettings, Routing, too_slow_for_world
from ..results import Row

__all__ = ["world_cases", "run_world"]


def _encode(x: np.ndarray, fmt: str, axis: int) -> Any:
    if fmt == "bf16":
        return x.astype(np.float32).astype(BF16)
    return quantize(x, fmt, axis=axis)


def world_cases(backend: MoeEpBackend, settings: BenchSettings) -> List[Row]:
    """Every case of ``backend``: rows to measure (status ``ok`` for now) and
    rows not measured (skipped, unsupported)."""
    rows = []
    for fmt in settings.formats:
        for t in settings.tokens:
            slow = None if settings.include_slow else too_slow_for_world(settings, t)
            for op in settings.ops:
                row = Row(backend=backend.name, kind="backend", op=op, tokens=t, format=fmt, ep_size=settings.ep_size,
                          device="cpu", label="world-level call, perf_counter (every rank in this process)")
                config = settings.config(fmt, generate_c=op == "forward_backward")
                spec_op = {"forward_backward": "backward"}.get(op, op)
                reason = backend.capabilities.unsupported(config, spec_op)
                if reason is None and op == "forward_backward":
                    reason = backend.capabilities.unsupported(config, "forward")
                if reason is not None:
                    row.status, row.reason = "unsupported", reason
                elif slow is not None:
                    row.status, row.reason = "skipped", slow
                rows.append(row)
    return rows


class _World:
    """Numpy input sets of one (format, tokens) case."""

    def __init__(self, settings: BenchSettings, routing: Routing, fmt: str) -> None:
        s = settings
        h, i, el, k = s.hidden, s.intermediate, s.num_local_experts, s.topk
        rng = np.random.default_rng([s.seed, routing.tokens, 0x776F726C64])
        self.weights = []
        for _ in range(s.ep_size):
            fc1 = _encode(rng.standard_normal((el, h, 2 * i)) / np.sqrt(h), fmt, axis=1)
            fc2 = _encode(rng.standard_normal((el, i, h)) / np.sqrt(i), fmt, axis=1)
            self.weights.append((fc1, fc2))
        self.sets = []
        for st in range(routing.num_sets):
            world = []
            for r in range(s.ep_size):
                act = _encode(rng.standard_normal((routing.tokens, h)), fmt, axis=1)
                tw = rng.uniform(0.05, 1.0, size=(routing.tokens, k)).astype(np.float32)
                world.append((act, routing.topk_idx[st][r], tw))
            self.sets.append(world)
        self.rng = rng

    def dispatch_inputs(self, st: int) -> List[DispatchInputs]:
        return [DispatchInputs(tokens=a, topk_idx=idx, topk_weights=w) for a, idx, w in self.sets[st]]

    def rank_inputs(self, st: int) -> List[RankInputs]:
        return [
            RankInputs(activation=a, fc1_weight=w1, fc2_weight=w2, topk_idx=idx, topk_weights=w)
            for (a, idx, w), (w1, w2) in zip(self.sets[st], self.weights)
        ]


def _time(fn: Callable[[int], Any], nsets: int, warmup: int, repeats: int) -> List[float]:
    for i in range(warmup):
        fn(i % nsets)
    out = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(i % nsets)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def run_world(
    backend: MoeEpBackend, settings: BenchSettings, routings: Dict[int, Routing], rows: List[Row], progress: Any
) -> None:
    """Measure the ``ok`` rows of :func:`world_cases` in place."""
    cache: Dict[tuple, _World] = {}
    for row in rows:
        if row.status != "ok":
            continue
        key = (row.format, row.tokens)
        if key not in cache:
            cache.clear()
            cache[key] = _World(settings, routings[row.tokens], row.format)
        w = cache[key]
        nsets = len(w.sets)
        try:
            fn = _op(backend, settings, w, row.op, row.format, nsets)
            row.set_times(_time(fn, nsets, settings.warmup, settings.repeats))
        except Exception as exc:  # noqa: BLE001 - a failing backend is a row, not a crash
            row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"[:600]
        progress.update(f"{backend.name} {row.op} {row.format} T={row.tokens}")


def _op(backend: MoeEpBackend, settings: BenchSettings, w: _World, op: str, fmt: str, nsets: int) -> Callable[[int], Any]:
    config = settings.config(fmt)
    if op == "dispatch":
        return lambda st: backend.dispatch(config, w.dispatch_inputs(st))
    if op == "combine":
        handles, outs = [], []
        for st in range(nsets):
            res = backend.dispatch(config, w.dispatch_inputs(st))
            handles.append([r.handle for r in res])
            outs.append([w.rng.standard_normal((r.handle.num_recv_rows, settings.hidden)).astype(np.float32) for r in res])
        return lambda st: backend.combine(config, handles[st], outs[st])
    if op == "forward":
        return lambda st: backend.forward(config, w.rank_inputs(st))
    if op == "forward_backward":
        cfg = settings.config(fmt, generate_c=True)
        grads = [
            [w.rng.standard_normal((int(idx.shape[0]), settings.hidden)).astype(np.float32) for _, idx, _ in w.sets[st]]
            for st in range(nsets)
        ]

        def fwd_bwd(st: int) -> Any:
            inputs = w.rank_inputs(st)
            res = backend.forward(cfg, inputs)
            return backend.backward(cfg, inputs, grads[st], [r.stash for r in res])

        return fwd_bwd
    raise ValueError(op)

