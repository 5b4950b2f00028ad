"""The torch driver, rank side: runs in each spawned rank process.

Builds the inputs on the rank's device (random, never zeros; the routing comes
from the parent so every backend and baseline moves the same rows), then times
every job: warm-up calls, then ``repeats`` calls, each one after a host barrier
of all ranks and a device synchronisation, timed with CUDA events on the
default stream (CUDA) or ``time.perf_counter`` (CPU, where torch ops and gloo
collectives return when done). Input sets are used in turn. With several GPU
ranks a one-element NCCL all-reduce starts them together, and a ~1 ms GPU spin
lets the host queue the call's first kernels before the start event: the host's
launch latency is excluded, any wait of the call on the host included.
"""

from __future__ import annotations

import gc
import math
import os
import platform
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from moe_ep_spec.formats import MoeFormat

from ..model import BenchSettings, Routing, row_bytes
from .jobs import BACKENDS, Job

_MAX_REASON = 600
#: A GPU spin (cycles) before each timed call; about 1 ms at H200 clocks.
_SLEEP = getattr(torch.cuda, "_sleep", None)
_SLEEP_CYCLES = 2_000_000


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


class Runner:
    """State of one rank: the device, the groups, the current weights and inputs."""

    def __init__(self, rank: int, settings: BenchSettings, routings: Dict[int, Routing]) -> None:
        self.rank = rank
        self.s = settings
        self.routings = routings
        self.cuda = settings.device == "cuda"
        self.dev = torch.device(f"cuda:{rank}") if self.cuda else torch.device("cpu")
        self.group = dist.group.WORLD
        # Host-side barriers go over gloo, so that no rank spins a kernel while
        # another rank measures (e.g. the peer copy).
        self.host = dist.new_group(backend="gloo") if self.cuda else self.group
        self._weights_key: Optional[str] = None
        self._weights: Any = None
        self._inputs_key: Optional[tuple] = None
        self._inputs: Any = None
        self._gemm_dense: Any = None
        self._align = torch.ones(1, device=self.dev)

    # ------------------------------------------------------------------ plumbing

    def seed(self, *parts: Any) -> int:
        h = 1469598103934665603
        for p in (self.s.seed, self.rank) + parts:
            for ch in str(p).encode():
                h = ((h ^ ch) * 1099511628211) % (1 << 61)
        return h

    def gen(self, *parts: Any) -> torch.Generator:
        g = torch.Generator(device=self.dev)
        g.manual_seed(self.seed(*parts))
        return g

    def grad_outputs(self, tokens: int, nsets: int) -> List[torch.Tensor]:
        """``[tokens, hidden]`` bf16 output cotangents, one per input set (the same for every format)."""
        return [torch.randn((tokens, self.s.hidden), generator=self.gen("grad_output", tokens, i), device=self.dev)
                .to(torch.bfloat16) for i in range(nsets)]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def barrier(self) -> None:
        self.sync()
        if self.s.ep_size > 1:
            dist.barrier(group=self.host)

    def measure(
        self,
        fn: Callable[[int], Any],
        nsets: int,
        pre: Optional[Callable[[int], None]] = None,
        collective: bool = True,
    ) -> List[float]:
        """Warm up, then time ``repeats`` calls of ``fn(set)``; milliseconds per call."""
        s = self.s
        for i in range(s.warmup):
            if pre is not None:
                pre(i % nsets)
            fn(i % nsets)
        samples: List[float] = []
        events = []
        for i in range(s.repeats):
            k = i % nsets
            if pre is not None:
                pre(k)
            if collective:
                self.barrier()
            else:
                self.sync()
            if self.cuda:
                if collective and self.s.ep_size > 1:
                    # Line the GPUs up: what follows starts when this all-reduce ends, at
                    # the same moment on every GPU (the host barrier leaves a skew of
                    # tens of microseconds between the ranks' launches).
                    dist.all_reduce(self._align, op=dist.ReduceOp.MAX, group=self.group)
                if _SLEEP is not None:
                    # Keep the GPU busy for ~1 ms while the host queues the call, so that
                    # the timed region starts with the call's work queued, not with the
                    # host's launch latency.
                    _SLEEP(_SLEEP_CYCLES)
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                result = fn(k)
                b.record()
                events.append((a, b))
            else:
                t0 = time.perf_counter()
                result = fn(k)
                samples.append((time.perf_counter() - t0) * 1e3)
            del result
        self.sync()
        if self.cuda:
            samples = [float(a.elapsed_time(b)) for a, b in events]
        return samples

    # ------------------------------------------------------------------ data

    def weights(self, fmt: str) -> Dict[str, Any]:
        """This rank's expert weights in ``fmt``, random N(0, 1/H) and N(0, 1/I),
        built one expert at a time (no full float32 copy)."""
        if self._weights_key == fmt:
            return self._weights
        self._weights = None
        self._gemm_dense = None
        self.free()
        from moe_ep_torch import formats as TF

        el, h, i = self.s.num_local_experts, self.s.hidden, self.s.intermediate
        g = self.gen("weights", fmt)
        if fmt == "bf16":
            fc1 = torch.empty((el, h, 2 * i), dtype=torch.bfloat16, device=self.dev)
            fc2 = torch.empty((el, i, h), dtype=torch.bfloat16, device=self.dev)
            for e in range(el):
                fc1[e] = (torch.randn((h, 2 * i), generator=g, device=self.dev) / math.sqrt(h)).to(torch.bfloat16)
                fc2[e] = (torch.randn((i, h), generator=g, device=self.dev) / math.sqrt(i)).to(torch.bfloat16)
            w = {"fc1": fc1, "fc2": fc2}
        else:
            fmt_e = MoeFormat(fmt)
            # moe_ep_torch takes block-scaled weights transposed: fc1 [E, 2I, H]
            # blocked along H, fc2 [E, H, I] blocked along I.
            parts1, parts2 = [], []
            for e in range(el):
                parts1.append(TF.quantize(torch.randn((2 * i, h), generator=g, device=self.dev) / math.sqrt(h), fmt_e))
                parts2.append(TF.quantize(torch.randn((h, i), generator=g, device=self.dev) / math.sqrt(i), fmt_e))
            fc1 = TF.TorchBlockScaled(
                torch.stack([p.data for p in parts1]), torch.stack([p.scale for p in parts1]), fmt_e, h
            )
            fc2 = TF.TorchBlockScaled(
                torch.stack([p.data for p in parts2]), torch.stack([p.scale for p in parts2]), fmt_e, i
            )
            del parts1, parts2
            w = {"fc1": fc1, "fc2": fc2}
        self._weights_key, self._weights = fmt, w
        return w

    def inputs(self, fmt: str, tokens: int) -> Dict[str, List[Any]]:
        """Every input set of this rank: tokens (encoded in ``fmt``), topk_idx
        from the parent's routing, router weights in (0.05, 1)."""
        key = (fmt, tokens)
        if self._inputs_key == key:
            return self._inputs
        self._inputs = None
        from moe_ep_torch import formats as TF

        routing = self.routings[tokens]
        h, k = self.s.hidden, self.s.topk
        out: Dict[str, List[Any]] = {"tokens": [], "idx": [], "weights": []}
        for s in range(routing.num_sets):
            g = self.gen("inputs", tokens, s)
            x = torch.randn((tokens, h), generator=g, device=self.dev)
            out["tokens"].append(x.to(torch.bfloat16) if fmt == "bf16" else TF.quantize(x, MoeFormat(fmt)))
            out["idx"].append(torch.from_numpy(routing.topk_idx[s][self.rank]).to(self.dev))
            out["weights"].append(0.05 + 0.95 * torch.rand((tokens, k), generator=g, device=self.dev))
        self._inputs_key, self._inputs = key, out
        return out

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ jobs

    def run(self, job: Job) -> Dict[str, Any]:
        if job.module:
            return self.job_module(job)
        if job.target in BACKENDS:
            return self.job_backend(job)
        fn = getattr(self, f"job_{job.target}")
        return fn(job)

    def job_backend(self, job: Job) -> Dict[str, Any]:
        """A backend's own functions: ``torch`` (moe_ep_torch), or ``cuda-nccl``
        (moe_ep_cuda_nccl.api, the same layer call on the native core)."""
        from moe_ep_torch import core
        from moe_ep_torch import formats as TF

        s, fmt, t = self.s, job.format, job.tokens
        config = s.config(fmt)
        call: Dict[str, Any] = {}
        if job.target == "cuda-nccl":
            from moe_ep_cuda_nccl import api

            name = "moe_ep_cuda_nccl.api.moe_ep"
            if s.cuda_nccl_mode != "synced":
                # The static layout: capacity for the worst case of these tokens, no host synchronisation.
                config = s.config(fmt, t)
                config = config.replace(recv_capacity=config.worst_case_recv_rows())
                call = {"host_sync": False, "exchange": "device" if s.cuda_nccl_mode == "device" else "nccl"}
                name += f"(host_sync=False, exchange={call['exchange']!r})"
                if s.cuda_nccl_mode == "device":
                    from moe_ep_cuda_nccl.device_exchange import MODE_ENV

                    os.environ[MODE_ENV] = s.exchange_mode  # this rank process's exchange layers
                    name += f" in the {s.exchange_mode} mode"
        else:
            from moe_ep_torch import api

            name = "moe_ep_torch.api.moe_ep"
        inp = self.inputs(fmt, t)
        nsets = len(inp["idx"])
        group, dev, k = self.group, self.dev, s.topk
        extra = f"moe-ep-bench|{fmt}"
        timer = "CUDA events" if self.cuda else "perf_counter"
        if job.target == "cuda-nccl" and job.op in ("dispatch", "combine"):
            return self.job_device_exchange(job, config, inp, timer)
        if job.op == "dispatch":

            def dispatch(i: int) -> Any:
                tok = inp["tokens"][i]
                plan, recv = core.make_plan(
                    config, inp["idx"][i], t, group, dev, None, extra, core.route_payload(tok, inp["weights"][i], k)
                )
                return core.buffer_tokens(plan, tok, recv[:-1]), core.to_buffer(plan, recv[-1])

            times = self.measure(dispatch, nsets)
            label = f"core.make_plan(payload=core.route_payload) + expert-major buffer; {timer}"
        elif job.op == "combine":
            plans, ys = [], []
            for i in range(nsets):
                plan, _ = core.make_plan(config, inp["idx"][i], t, group, dev, None, extra, None)
                g = self.gen("expert_out", fmt, t, i)
                plans.append(plan)
                ys.append(torch.randn((plan.num_rows, s.hidden), generator=g, device=dev).to(torch.bfloat16))

            def combine(i: int) -> Any:
                plan = plans[i]
                rows = TF.round_trip(core.from_buffer(plan, ys[i].float()), config.combine_format)
                (back,) = core.exchange_back(plan, [rows], group)
                return core.encode_output(config, core.sum_slots(core.to_slots(plan, back)))

            times = self.measure(combine, nsets)
            label = f"combine_format round trip + core.exchange_back + slot sum + encode; {timer}"
        elif job.op == "forward":
            w = self.weights(fmt)

            def forward(i: int) -> Any:
                with torch.no_grad():
                    return api.moe_ep(inp["tokens"][i], w["fc1"], w["fc2"], inp["idx"][i], inp["weights"][i], config=config,
                                      **call)

            times = self.measure(forward, nsets)
            label = f"{name}, no grad; {timer}"
        elif job.op == "forward_backward" and fmt != "bf16":
            # Block-scaled inputs are no autograd leaves: a training step is the explicit API,
            # the forward with its stash and then the spec's backward (straight-through).
            w = self.weights(fmt)
            gys = self.grad_outputs(t, nsets)

            def fwd_bwd_explicit(i: int) -> Any:
                x, idx, tw = inp["tokens"][i], inp["idx"][i], inp["weights"][i]
                fwd = api.moe_ep_forward_with_stash(x, w["fc1"], w["fc2"], idx, tw, config=config, **call)
                return api.moe_ep_backward(gys[i], x, w["fc1"], w["fc2"], idx, tw, fwd.fc1_c, config=config, **call)

            times = self.measure(fwd_bwd_explicit, nsets)
            label = (f"{name.replace('api.moe_ep', 'api.moe_ep_forward_with_stash', 1)} then moe_ep_backward "
                     f"({fmt} inputs: the explicit API); {timer}")
        elif job.op == "forward_backward":
            w = self.weights(fmt)
            fc1 = w["fc1"].detach().requires_grad_(True)
            fc2 = w["fc2"].detach().requires_grad_(True)
            acts = [a.detach().clone().requires_grad_(True) for a in inp["tokens"]]
            tws = [x.detach().clone().requires_grad_(True) for x in inp["weights"]]
            gys = self.grad_outputs(t, nsets)
            leaves = [fc1, fc2] + acts + tws

            def clear(_: int) -> None:
                for leaf in leaves:
                    leaf.grad = None

            def fwd_bwd(i: int) -> Any:
                out = api.moe_ep(acts[i], fc1, fc2, inp["idx"][i], tws[i], config=config, **call)
                out.backward(gys[i])
                return None

            try:
                times = self.measure(fwd_bwd, nsets, pre=clear)
            finally:
                clear(0)
                del fc1, fc2, acts, tws, leaves
            label = f"{name} then .backward() (bf16 leaves, requires_grad); {timer}"
        else:
            raise ValueError(job.op)
        return {"status": "ok", "times_ms": times, "label": label}

    def job_module(self, job: Job) -> Dict[str, Any]:
        """Forward+backward through ``MoeEpLayer(config, backend=NAME)`` as a user
        calls it: the module's defaults with ``config.max_tokens_per_rank`` the case's
        tokens (on cuda-nccl its static layout over the device exchange), its bf16 parameters (the run's weights
        copied in), the activations and router weights as autograd leaves, then
        ``.backward()``; the gradients cleared before each call, untimed."""
        from moe_ep_torch.module import MoeEpLayer

        s, fmt, t = self.s, job.format, job.tokens
        # max_tokens_per_rank set, as a training loop sets it: the module's default path is
        # then the static layout over the device exchange (without it, the synced mode)
        config = s.config(fmt, t)
        layer = MoeEpLayer(config, group=self.group, backend=job.target, device=self.dev)
        w = self.weights(fmt)
        with torch.no_grad():
            layer.fc1_weight.copy_(w["fc1"])
            layer.fc2_weight.copy_(w["fc2"])
        inp = self.inputs(fmt, t)
        nsets = len(inp["idx"])
        acts = [a.detach().clone().requires_grad_(True) for a in inp["tokens"]]
        tws = [x.detach().clone().requires_grad_(True) for x in inp["weights"]]
        gys = self.grad_outputs(t, nsets)
        leaves = list(layer.parameters()) + acts + tws
        timer = "CUDA events" if self.cuda else "perf_counter"

        def clear(_: int) -> None:
            for leaf in leaves:
                leaf.grad = None

        def fwd_bwd(i: int) -> Any:
            layer(acts[i], inp["idx"][i], tws[i]).backward(gys[i])
            return None

        try:
            times = self.measure(fwd_bwd, nsets, pre=clear)
        finally:
            clear(0)
            del layer, acts, tws, leaves
        label = (f"moe_ep_torch.module.MoeEpLayer(config, backend={job.target!r}) with its defaults "
                 f"(max_tokens_per_rank={t}), forward then "
                 f".backward() (bf16 parameters, activations and router weights requiring grad); {timer}")
        return {"status": "ok", "times_ms": times, "label": label}

    def job_device_exchange(self, job: Job, config: Any, inp: Dict[str, Any], timer: str) -> Dict[str, Any]:
        """``cuda-nccl --cuda-nccl-mode device``: the native layer's device exchange
        stages alone (``moe_ep_layer_dispatch`` / ``moe_ep_layer_combine``,
        :mod:`moe_ep_native.exchange`, peers through the loopback provider), on bf16
        rows, into buffers made once: dispatch moves the token rows into the
        expert-major buffer; combine (after an untimed dispatch of the same set)
        sums bf16 expert rows per token and writes the bf16 output."""
        import torch
        from torch.distributed.distributed_c10d import _get_default_store

        from moe_ep_cuda_nccl.prims import ptr as p
        from moe_ep_native import exchange as X
        from moe_ep_native.layer import layer_config

        s, t, dev, k = self.s, job.tokens, self.dev, self.s.topk
        cap = int(config.recv_capacity)  # the static layout job_backend set (the worst case)
        rb = 2 * s.hidden
        base = layer_config(config, max_rows=cap, cuda_device=dev.index if self.cuda else None, bf16_operands=True,
                            with_backward=False)
        layer = X.ExchangeLayer(X.with_exchange(base, num_ranks=s.ep_size, rank=self.rank, num_topk=k, max_tokens=t,
                                                token_bytes=rb, expert_alignment=1, timeout_s=s.timeout_s,
                                                mode=X.MODES[s.exchange_mode]))
        store = dist.PrefixStore(f"moe_ep_bench_exchange/{job.id}/", _get_default_store())
        try:
            X.connect_loopback(layer, store, "peers")
            nsets = len(inp["idx"])
            toks = [x.to(torch.bfloat16).contiguous() for x in inp["tokens"]]
            idxs = [x.to(torch.int32).contiguous() for x in inp["idx"]]
            ws = [x.float().contiguous() for x in inp["weights"]]
            x_rows = torch.empty((cap, s.hidden), dtype=torch.bfloat16, device=dev)
            w_buf = torch.empty(cap, dtype=torch.float32, device=dev)
            meta = torch.empty((cap, 4), dtype=torch.int32, device=dev)
            gs = torch.empty(config.num_local_experts, dtype=torch.int32, device=dev)
            err = torch.empty(1, dtype=torch.int32, device=dev)
            y = torch.randn((cap, s.hidden), generator=self.gen("expert_out", job.format, t, 0), device=dev).to(
                torch.bfloat16)
            out = torch.empty((t, s.hidden), dtype=torch.bfloat16, device=dev)
            stream = torch.cuda.current_stream(dev).cuda_stream if self.cuda else None

            def dispatch(i: int) -> Any:
                layer.dispatch(stream, t, rb, p(toks[i]), p(idxs[i]), p(ws[i]), p(x_rows), p(w_buf), p(meta), p(gs),
                               None, p(err))

            def combine(i: int) -> Any:
                layer.combine(stream, t, p(y), p(out), None, None, p(err), y_bf16=True, out_bf16=True)

            if job.op == "dispatch":
                times = self.measure(dispatch, nsets)
                label = (f"moe_ep_layer_dispatch (device exchange, {s.exchange_mode} mode, bf16 rows into the "
                         f"expert-major buffer); {timer}")
            else:
                times = self.measure(combine, nsets, pre=dispatch)
                label = f"moe_ep_layer_combine (device exchange, {s.exchange_mode} mode, bf16 rows, bf16 output); {timer}"
            if int(err.item()) != 0:  # waits for the stream
                raise RuntimeError(f"the device exchange reported error bits {int(err.item()):#x} while timed")
        finally:
            self.sync()
            layer.close()
        return {"status": "ok", "times_ms": times, "label": label}

    def _splits(self, job: Job, i: int) -> tuple:
        routing = self.routings[job.tokens]
        rb = row_bytes(job.format, self.s.hidden)
        send = [c * rb for c in routing.send_rows(i, self.rank)]
        recv = [c * rb for c in routing.recv_rows(i, self.rank)]
        return (send, recv) if job.op == "dispatch" else (recv, send)

    def job_all_to_all(self, job: Job) -> Dict[str, Any]:
        nsets = self.routings[job.tokens].num_sets
        bufs = []
        for i in range(nsets):
            send, recv = self._splits(job, i)
            g = self.gen("a2a", job.op, job.format, job.tokens, i)
            src = torch.randint(0, 256, (sum(send),), generator=g, device=self.dev, dtype=torch.uint8)
            dst = torch.empty((sum(recv),), dtype=torch.uint8, device=self.dev)
            bufs.append((src, dst, send, recv))

        def a2a(i: int) -> Any:
            src, dst, send, recv = bufs[i]
            dist.all_to_all_single(dst, src, recv, send, group=self.group)
            return None

        times = self.measure(a2a, nsets)
        backend = "NCCL" if self.cuda else "gloo"
        return {"status": "ok", "times_ms": times,
                "label": f"all_to_all_single over {backend}, uint8, the dispatch's bytes per peer"}

    def job_copy(self, job: Job) -> Dict[str, Any]:
        # Rank 0 alone copies; the others wait at the host barriers.
        self.barrier()
        result: Dict[str, Any] = {"status": "ok", "times_ms": None, "label": ""}
        if self.rank == 0:
            routing = self.routings[job.tokens]
            rb = row_bytes(job.format, self.s.hidden)
            remote_only = self.cuda and self.s.ep_size >= 2
            if remote_only:
                dst_dev = torch.device("cuda:1")
                peer = torch.cuda.can_device_access_peer(0, 1)
                label = (
                    f"copy cuda:0 -> cuda:1 (peer access: {'yes' if peer else 'no'}) of the rows rank 0 receives "
                    "from other ranks (bytes_remote; its own rows counted free)"
                )
            elif self.cuda:
                dst_dev = self.dev
                label = "device-to-device copy on cuda:0 of rank 0's received rows (one GPU: no link crossed)"
            else:
                dst_dev = self.dev
                label = "memcpy (torch copy_ on CPU) of rank 0's received rows"
            bufs = []
            for i in range(routing.num_sets):
                rows = routing.recv_rows(i, 0)
                nbytes = max(1, (sum(rows) - rows[0] if remote_only else sum(rows)) * rb)
                g = self.gen("copy", job.format, job.tokens, i)
                src = torch.randint(0, 256, (nbytes,), generator=g, device=self.dev, dtype=torch.uint8)
                bufs.append((src, torch.empty((nbytes,), dtype=torch.uint8, device=dst_dev)))

            def copy(i: int) -> Any:
                src, dst = bufs[i]
                dst.copy_(src, non_blocking=True)
                return None

            try:
                times = self.measure(copy, len(bufs), collective=False)
                if self.cuda and dst_dev != self.dev:
                    torch.cuda.synchronize(dst_dev)
                result = {"status": "ok", "times_ms": times, "label": label}
            finally:
                del bufs
        self.barrier()
        return result

    def job_weight_read(self, job: Job) -> Dict[str, Any]:
        """Rank 0 copies its local bf16 expert weights (fc1 and fc2) into fresh
        buffers on its device; the others wait at the host barriers. The
        bytes copied travel with the result: the weight_read rows read the
        weights at ``2 * bytes / time`` (read plus write)."""
        self.barrier()
        result: Dict[str, Any] = {"status": "ok", "times_ms": None, "label": ""}
        if self.rank == 0:
            w = self.weights("bf16")
            src = (w["fc1"], w["fc2"])
            dst = tuple(torch.empty_like(x) for x in src)
            nbytes = sum(x.numel() * x.element_size() for x in src)

            def copy(_: int) -> Any:
                for d, x in zip(dst, src):
                    d.copy_(x, non_blocking=True)
                return None

            try:
                times = self.measure(copy, 1, collective=False)
            finally:
                del dst
            where = f"on {self.dev}" if self.cuda else "in host memory"
            timer = "CUDA events" if self.cuda else "perf_counter"
            result = {"status": "ok", "times_ms": times, "bytes": float(nbytes),
                      "label": f"fc1.copy_ + fc2.copy_ of rank 0's local bf16 weights {where} ({nbytes / 1e6:.1f} MB); {timer}"}
        self.barrier()
        return result

    def job_grouped_gemm(self, job: Job) -> Dict[str, Any]:
        routing = self.routings[job.tokens]
        s = self.s
        h, i_ = s.hidden, s.intermediate
        w = self.weights("bf16")
        fc1, fc2 = w["fc1"], w["fc2"]
        backward = job.op == "forward_backward"
        sets = []
        for k in range(routing.num_sets):
            counts = routing.expert_rows(k, self.rank)
            rows = sum(counts)
            g = self.gen("gemm", job.tokens, k)

            def rnd(*shape: int) -> torch.Tensor:
                return torch.randn(shape, generator=g, device=self.dev).to(torch.bfloat16)

            x, hh = rnd(rows, h), rnd(rows, i_)
            extra = (rnd(rows, 2 * i_), rnd(rows, h)) if backward else (None, None)
            offs = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=self.dev)
            sets.append((counts, x, hh, extra[0], extra[1], offs))
        nsets = len(sets)
        grouped_failed = ""
        if self.cuda and hasattr(torch, "_grouped_mm"):
            gm = torch._grouped_mm

            def fwd(k: int) -> Any:
                _, x, hh, _, _, offs = sets[k]
                return gm(x, fc1, offs=offs), gm(hh, fc2, offs=offs)

            def bwd(k: int) -> Any:
                _, x, hh, dc, dy, offs = sets[k]
                return (
                    gm(dc, fc1.transpose(-2, -1), offs=offs),  # dx = dc W1^T
                    gm(x.t(), dc, offs=offs),  # dW1 = x^T dc, per expert
                    gm(dy, fc2.transpose(-2, -1), offs=offs),  # dh = dy W2^T
                    gm(hh.t(), dy, offs=offs),  # dW2 = h^T dy, per expert
                )

            label = "torch._grouped_mm, bf16 operands and output, fp32 accumulate; CUDA events"
            try:
                fwd(0)
                self.sync()
            except Exception as exc:  # noqa: BLE001 - shape/arch limits: fall back to a loop below
                grouped_failed = _short(exc)[:200]
            if not grouped_failed and not backward:
                return {"status": "ok", "times_ms": self.measure(fwd, nsets), "label": label + "; forward 2 GEMMs"}
            if not grouped_failed:
                try:
                    bwd(0)
                    self.sync()
                except Exception as exc:  # noqa: BLE001 - derive the backward from the forward's rate
                    times = self.measure(fwd, nsets)
                    return {
                        "status": "ok",
                        "times_ms": [3.0 * t for t in times],
                        "derived": True,
                        "label": f"3 x the forward grouped GEMMs (the backward's grouped GEMMs failed: {_short(exc)[:200]})",
                    }
                times = self.measure(lambda k: (fwd(k), bwd(k)), nsets)
                return {"status": "ok", "times_ms": times, "label": label + "; forward 2 + backward 4 GEMMs"}
        # CPU (or no grouped GEMM): one matmul per expert, float32 on CPU, bf16 on CUDA.
        dtype = torch.float32 if not self.cuda else torch.bfloat16
        if self._gemm_dense is None:
            self._gemm_dense = (fc1.to(dtype), fc2.to(dtype))
        w1, w2 = self._gemm_dense
        sets = [(c, x.to(dtype), hh.to(dtype), None if dc is None else dc.to(dtype), None if dy is None else dy.to(dtype), o)
                for c, x, hh, dc, dy, o in sets]

        def loop(k: int) -> Any:
            counts, x, hh, dc, dy, _ = sets[k]
            o = 0
            outs = []
            for e, c in enumerate(counts):
                if c:
                    sl = slice(o, o + c)
                    outs.append(x[sl] @ w1[e])
                    outs.append(hh[sl] @ w2[e])
                    if backward:
                        outs.append(dc[sl] @ w1[e].T)
                        outs.append(x[sl].T @ dc[sl])
                        outs.append(dy[sl] @ w2[e].T)
                        outs.append(hh[sl].T @ dy[sl])
                o += c
            return outs

        times = self.measure(loop, nsets)
        what = "forward 2" + (" + backward 4" if backward else "") + " GEMMs"
        kind = "float32" if dtype == torch.float32 else "bf16"
        timer = "CUDA events" if self.cuda else "perf_counter"
        label = f"one torch matmul per expert ({kind}), {what}; {timer}"
        if grouped_failed:
            label += f" (torch._grouped_mm failed: {grouped_failed})"
        return {"status": "ok", "times_ms": times, "label": label}


def environment(settings: BenchSettings) -> Dict[str, Any]:
    env: Dict[str, Any] = {"torch": str(torch.__version__), "torch_grouped_mm": hasattr(torch, "_grouped_mm")}
    if settings.device == "cuda":
        env["cuda"] = str(torch.version.cuda)
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            env["nccl"] = "unknown"
        env["gpus"] = [
            {
                "index": d,
                "name": torch.cuda.get_device_name(d),
                "memory_gib": round(torch.cuda.get_device_properties(d).total_memory / 2**30, 1),
            }
            for d in range(torch.cuda.device_count())
        ]
        if torch.cuda.device_count() >= 2:
            env["peer_access_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["torch_threads"] = torch.get_num_threads()
    return env


def rank_main(rank: int, settings: BenchSettings, routings: Dict[int, Routing], jobs: Sequence[Job], port: int, out: Any) -> None:
    """A rank process: join the group, report the environment (rank 0), run
    every job in order, sending each result as it is done."""
    try:
        for name in sorted({j.target for j in jobs if j.target in BACKENDS}):
            from moe_ep_spec.registry import get_backend

            availability = get_backend(name, require_available=False).availability()
            if not availability:
                raise RuntimeError(f"backend {name!r} is not available: {availability.reason}")
        cuda = settings.device == "cuda"
        if cuda:
            if not torch.cuda.is_available():
                raise RuntimeError(f"--device cuda: torch {torch.__version__} sees no CUDA device")
            if torch.cuda.device_count() < settings.ep_size:
                raise RuntimeError(
                    f"--ep-size {settings.ep_size} needs {settings.ep_size} GPUs (rank r on cuda:r); "
                    f"this machine has {torch.cuda.device_count()}"
                )
            torch.cuda.set_device(rank)
        else:
            # share the cores between the ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.ep_size))
        kwargs: Dict[str, Any] = {"device_id": torch.device(f"cuda:{rank}")} if cuda else {}
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=settings.ep_size,
            timeout=timedelta(seconds=settings.timeout_s),
            **kwargs,
        )
        runner = Runner(rank, settings, routings)
        if rank == 0:
            out.put(("env", environment(settings)))
    except BaseException as exc:  # noqa: BLE001
        out.put(("fatal", rank, _short(exc) + "\n" + traceback.format_exc(limit=4)))
        return
    try:
        for job in jobs:
            try:
                runner.barrier()
                res = runner.run(job)
            except BaseException as exc:  # noqa: BLE001 - report and go on with the next job
                if isinstance(exc, KeyboardInterrupt):
                    raise
                oom = "out of memory" in str(exc).lower()
                res = {"status": "error", "times_ms": None, "reason": ("out of memory: " if oom else "") + _short(exc)}
                runner.free()
            out.put(("job", rank, job.id, res))
        out.put(("done", rank))
    finally:
        if any(j.target == "cuda-nccl" for j in jobs):
            try:
                from moe_ep_cuda_nccl.api import close_communicators

                close_communicators()
            except Exception:  # noqa: BLE001
                pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
