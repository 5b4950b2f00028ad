"""The jax driver: backends ``jax`` and ``jax-ffi`` (world launch, one process
drives a mesh of EP devices).

The fused layer as a JAX user runs it: :func:`moe_ep_jax.api.shard_moe_ep`
(``moe_ep`` inside ``jax.shard_map`` over a mesh of ``--ep-size`` devices,
axis ``"ep"``) under ``jax.jit``, with XLA's kernels (``jax``) or the native
core's through XLA FFI (``jax-ffi``, :class:`moe_ep_jax_ffi.kernels.FfiKernels`).
``forward`` times the jitted layer; ``forward_backward`` the jitted
``jax.vjp`` of the layer with respect to the activation, both weights and the
router weights, applied to a bf16 output cotangent (bf16), or, for block-scaled
inputs (constants to ``jax.vjp``), the explicit API: ``moe_ep`` with
``generate_c`` then ``moe_ep_backward`` in one ``jax.shard_map``, as for torch.
Each executable is compiled before it is timed (on CPU with the jax
backend's own ``XLA_CPU_FAST_COMPILE`` options, as the backend compiles); a call's time is
``time.perf_counter`` around the call and ``jax.block_until_ready`` of its
result (the whole world's time, as every rank runs in the call). Each such row has a
twin with the note "8 calls back to back, one wait": the per-call time of calls
issued as a training loop issues them, the host running ahead (the single call's
time also holds its dispatch and its wait, while the device idles; the baselines'
CUDA-event times hold neither). On GPU each row has a second twin with the note
:data:`DEVICE_TIME`: each call alone under ``jax.profiler.trace``, its time the span
of its GPU stream events (first kernel start to last kernel end), which is what the
baselines' CUDA events around a call measure: the row to compare with them (calls
back to back also run at lower clocks).

Devices: ``--device cpu`` uses jax's CPU devices (the jax backend asks XLA for
``MOE_EP_JAX_CPU_DEVICES``, default 8, before jax is first imported; or set
``XLA_FLAGS=--xla_force_host_platform_device_count=N``), ``--device cuda``
its GPUs. Imports jax only in :func:`run_jax`.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Dict, List, Sequence

import numpy as np

from moe_ep_spec.backend import MoeEpBackend

from ..model import BenchSettings, Routing
from ..results import Row

__all__ = ["DEVICE_TIME", "device_times", "jax_cases", "run_jax"]


def _unsupported(backend: str, op: str) -> str:
    if op in ("dispatch", "combine"):
        return f"skipped: the bench times {backend}'s fused layer only (forward, forward_backward)"
    return ""


def jax_cases(backend: MoeEpBackend, settings: BenchSettings) -> List[Row]:
    """Every case of ``backend``: rows to measure (status ``ok`` for now) and rows not measured."""
    rows = []
    for fmt in settings.formats:
        for t in settings.tokens:
            for op in settings.ops:
                row = Row(backend=backend.name, kind="backend", op=op, tokens=t, format=fmt,
                          ep_size=settings.ep_size, device=settings.device)
                why = _unsupported(backend.name, op)
                if why:
                    row.status, row.reason = why.split(":")[0], why
                rows.append(row)
    return rows


def _time(fn: Callable[..., Any], sets: Sequence[tuple], warmup: int, repeats: int) -> List[float]:
    import jax

    for i in range(warmup):
        jax.block_until_ready(fn(*sets[i % len(sets)]))
    out = []
    for i in range(repeats):
        args = sets[i % len(sets)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


#: Calls issued back to back before one wait, for the pipelined rows.
PIPELINE = 8

#: Host pause between the calls of the device-time rows (seconds): the device idles
#: between two calls for at least this long, which is how the trace's kernels are told
#: apart into calls (a call's own kernels follow each other within microseconds).
TRACE_PAUSE_S = 0.01

#: Variant note of the device-time rows.
DEVICE_TIME = "device time: jax.profiler trace, first kernel start to last kernel end"


def device_times(events: Sequence[tuple], calls: int, pause_ns: float) -> List[float]:
    """Milliseconds from the first kernel's start to the last kernel's end of each of
    ``calls`` calls.

    events: ``(start_ns, end_ns)`` of every GPU stream event of a trace in which the
    calls ran one at a time, the host pausing ``pause_ns`` or more between them.
    Events are grouped into calls at idle gaps longer than half the pause. Raises
    :class:`RuntimeError` when the groups are not exactly ``calls`` (a call that
    itself idles the device that long, or a trace that lost events), rather than
    return times of something else.
    """
    if not events:
        raise RuntimeError("the trace holds no GPU stream events")
    evs = sorted(events)
    spans: List[List[float]] = [[evs[0][0], evs[0][1]]]
    for start, end in evs[1:]:
        if start - spans[-1][1] > pause_ns / 2:
            spans.append([start, end])
        else:
            spans[-1][1] = max(spans[-1][1], end)
    if len(spans) != calls:
        raise RuntimeError(
            f"the trace's GPU events form {len(spans)} groups separated by idle gaps over {pause_ns / 2e6:g} ms; "
            f"expected one group per call, {calls}"
        )
    return [(end - start) / 1e6 for start, end in spans]


def _gpu_stream_events(trace_dir: str) -> List[tuple]:
    """``(start_ns, end_ns)`` of the GPU stream events (kernels, copies) of the
    ``jax.profiler`` trace written under ``trace_dir``."""
    import glob
    import os

    import jax

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if len(paths) != 1:
        raise RuntimeError(f"expected one *.xplane.pb under {trace_dir}, found {len(paths)}")
    data = jax.profiler.ProfileData.from_file(paths[0])
    out = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" in line.name.lower():  # not the planes' derived lines (XLA Ops, XLA Modules, ...)
                out += [(ev.start_ns, ev.start_ns + ev.duration_ns) for ev in line.events]
    return out


def _time_device(fn: Callable[..., Any], sets: Sequence[tuple], repeats: int) -> List[float]:
    """Device time of each of ``repeats`` calls, one at a time, traced with
    ``jax.profiler``: as a CUDA event pair around a call measures the baselines (the
    host's dispatch and wait are not in it, every kernel of the call and any idle gap
    between them are). With several devices the span covers all of them (the whole
    world's time, as the torch driver reports the slowest rank's), on the trace's one clock."""
    import shutil
    import tempfile

    import jax

    tmp = tempfile.mkdtemp(prefix="moe-ep-bench-trace-")
    try:
        with jax.profiler.trace(tmp):
            for i in range(repeats):
                jax.block_until_ready(fn(*sets[i % len(sets)]))
                time.sleep(TRACE_PAUSE_S)
        events = _gpu_stream_events(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return device_times(events, repeats, TRACE_PAUSE_S * 1e9)


def _time_pipelined(fn: Callable[..., Any], sets: Sequence[tuple], repeats: int) -> List[float]:
    """Per-call times of :data:`PIPELINE` calls issued back to back and one
    ``block_until_ready`` of all their results (as a training loop dispatches: the host
    runs ahead of the device), one sample per round."""
    import jax

    out = []
    for r in range(repeats):
        t0 = time.perf_counter()
        results = [fn(*sets[(r * PIPELINE + i) % len(sets)]) for i in range(PIPELINE)]
        jax.block_until_ready(results)
        out.append((time.perf_counter() - t0) * 1e3 / PIPELINE)
        del results
    return out


def run_jax(
    backend: MoeEpBackend, settings: BenchSettings, routings: Dict[int, Routing], rows: List[Row], progress: Any
) -> Dict[str, Any]:
    """Measure the ``ok`` rows of :func:`jax_cases` in place; returns what to
    add to the report's environment."""
    from moe_ep_jax.devices import prepare_environment

    prepare_environment()
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_ep_jax import formats as F
    from moe_ep_jax.api import shard_moe_ep

    s = settings
    todo = [r for r in rows if r.status == "ok"]
    try:
        devs = jax.devices("cpu" if s.device == "cpu" else "gpu")
    except RuntimeError as exc:
        devs, problem = [], f"jax has no {s.device} devices here: {exc}"
    else:
        problem = ""
        if len(devs) < s.ep_size:
            problem = (
                f"--ep-size {s.ep_size} needs {s.ep_size} jax {s.device} devices; jax has {len(devs)}"
                + (" (set MOE_EP_JAX_CPU_DEVICES or XLA_FLAGS=--xla_force_host_platform_device_count=N before jax "
                   "is imported)" if s.device == "cpu" else "")
            )
    if problem:
        for r in todo:
            r.status, r.reason = "error", problem
            progress.update(f"{backend.name} {r.op} {r.format} T={r.tokens} (not run)")
        return {}
    mesh = Mesh(np.array(devs[: s.ep_size]), ("ep",))
    shard = NamedSharding(mesh, P("ep"))
    kernels = None
    if backend.name == "jax-ffi":
        from moe_ep_jax_ffi.kernels import FfiKernels

        kernels = FfiKernels()
    exchange = getattr(backend, "exchange", None) or ("capacity" if s.device == "cpu" else None)
    kernels_name = type(kernels).__name__ if kernels is not None else "XlaKernels"
    # Compile as the backend compiles its own executables: on CPU with its fast-compile options (same
    # arithmetic, a quarter of the compile time, slower code), unless the backend was made with fast_compile=False.
    fast = getattr(backend, "fast_compile", None)
    options = None
    if fast or (fast is None and s.device == "cpu"):
        from moe_ep_jax.backend import XLA_CPU_FAST_COMPILE

        options = dict(XLA_CPU_FAST_COMPILE)
    base_key = jax.random.key(s.seed)

    def key(*parts: int) -> Any:
        k = base_key
        for p in parts:
            k = jax.random.fold_in(k, p)
        return k

    def encode(x: Any, fmt: str) -> Any:
        return x.astype(jnp.bfloat16) if fmt == "bf16" else F.quantize(x, fmt, axis=1)

    weights: Dict[str, Any] = {}

    def get_weights(fmt: str) -> Any:
        if fmt not in weights:
            weights.clear()
            e, h, i = s.experts, s.hidden, s.intermediate  # global: sharded over the mesh, E_local per device

            def make() -> Any:
                w1 = jax.random.normal(key(1, 1), (e, h, 2 * i), jnp.float32) / math.sqrt(h)
                w2 = jax.random.normal(key(1, 2), (e, i, h), jnp.float32) / math.sqrt(i)
                return encode(w1, fmt), encode(w2, fmt)

            weights[fmt] = jax.jit(make, out_shardings=shard)()
        return weights[fmt]

    pipelined: List[Row] = []
    for row in todo:
        fmt, t = row.format, row.tokens
        routing = routings[t]
        try:
            config = s.config(fmt, t)
            w1, w2 = get_weights(fmt)
            layer = shard_moe_ep(config, mesh, exchange=exchange, kernels=kernels)
            sets = []
            for st in range(routing.num_sets):
                idx = jax.device_put(np.concatenate(routing.topk_idx[st]).astype(np.int32), shard)

                def make_inputs(st: int = st) -> Any:
                    x = jax.random.normal(key(2, t, st), (s.ep_size * t, s.hidden), jnp.float32)
                    tw = jax.random.uniform(key(3, t, st), (s.ep_size * t, s.topk), jnp.float32, 0.05, 1.0)
                    gy = jax.random.normal(key(4, t, st), (s.ep_size * t, s.hidden), jnp.bfloat16)
                    return encode(x, fmt), tw, gy

                x, tw, gy = jax.jit(make_inputs, out_shardings=shard)()
                sets.append((x, w1, w2, idx, tw, gy) if row.op == "forward_backward" else (x, w1, w2, idx, tw))
            if row.op == "forward":
                fn = layer
                what = "shard_moe_ep(...)(x, w1, w2, idx, tw)"
            elif fmt != "bf16":
                # Block-scaled inputs are constants to jax.vjp: a training step is the explicit
                # API, the forward with its stash (generate_c) and then the spec's backward.
                from moe_ep_jax import api as A

                cfg_c = config.replace(generate_c=True)

                def step(x: Any, w1: Any, w2: Any, idx: Any, tw: Any, gy: Any) -> Any:
                    _, fc1_c, _ = A.moe_ep(x, w1, w2, idx, tw, config=cfg_c, exchange=exchange, kernels=kernels)
                    return A.moe_ep_backward(gy, x, w1, w2, idx, tw, fc1_c, config=cfg_c, exchange=exchange,
                                             kernels=kernels)

                fn = jax.shard_map(step, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
                what = (f"moe_ep(generate_c=True) then moe_ep_backward in jax.shard_map ({fmt} inputs: the explicit "
                        "API)")
            else:

                def fn(x: Any, w1: Any, w2: Any, idx: Any, tw: Any, gy: Any) -> Any:
                    _, vjp = jax.vjp(lambda x, w1, w2, tw: layer(x, w1, w2, idx, tw), x, w1, w2, tw)
                    return vjp(gy)

                what = "jax.vjp of shard_moe_ep(...) w.r.t. x, w1, w2, tw, applied to a bf16 cotangent"
            lowered = jax.jit(fn).lower(*sets[0])
            compiled = lowered.compile(options) if options else lowered.compile()
            row.set_times(_time(compiled, sets, s.warmup, s.repeats))
            row.label = (
                f"jax.jit({what}) on {s.ep_size} {devs[0].platform} device(s), exchange {exchange or 'default'}, "
                f"{kernels_name}; compiled first{' (XLA_CPU_FAST_COMPILE, as the backend)' if options else ''}, "
                "then perf_counter around the call + block_until_ready"
            )
            # The same executable pipelined: the row above includes each call's dispatch and
            # wait (the device idles meanwhile), which the baselines' CUDA-event times do not.
            piped = Row(backend=row.backend, kind="backend", op=row.op, tokens=t, format=fmt, ep_size=row.ep_size,
                        device=row.device, variant=f"{PIPELINE} calls back to back, one wait")
            piped.set_times(_time_pipelined(compiled, sets, s.repeats))
            piped.label = row.label.replace("perf_counter around the call + block_until_ready",
                                            f"perf_counter around {PIPELINE} calls + one block_until_ready, per call")
            pipelined.append(piped)
            if devs[0].platform == "gpu":
                traced = Row(backend=row.backend, kind="backend", op=row.op, tokens=t, format=fmt,
                             ep_size=row.ep_size, device=row.device, variant=DEVICE_TIME)
                try:
                    traced.set_times(_time_device(compiled, sets, s.repeats))
                except Exception as exc:  # noqa: BLE001 - the other rows stand without it
                    traced.status, traced.reason = "error", f"{type(exc).__name__}: {exc}"[:600]
                traced.label = (
                    f"jax.jit({what}) on {s.ep_size} {devs[0].platform} device(s), exchange {exchange or 'default'}, "
                    f"{kernels_name}; compiled first, then each call alone under jax.profiler.trace "
                    f"({TRACE_PAUSE_S * 1e3:g} ms host pause between calls): the span of its GPU stream events "
                    "(on every device: the whole world's)")
                pipelined.append(traced)
        except Exception as exc:  # noqa: BLE001 - a failing backend is a row, not a crash
            row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"[:600]
        progress.update(f"{backend.name} {row.op} {row.format} T={row.tokens}")
    weights.clear()
    rows.extend(pipelined)
    return {"jax": jax.__version__, "jax_platform": devs[0].platform, "jax_devices": len(devs)}
