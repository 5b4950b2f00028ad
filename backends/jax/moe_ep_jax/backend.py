"""``jax``: the MoeEp backend over a JAX device mesh, world launch.

One process drives the whole EP world: the world-level methods take one entry
per rank (numpy, the spec's objects), validate every rank on the host with
:mod:`moe_ep_spec.validation` before anything runs, pad every rank's tokens to
``T = max_tokens_per_rank`` (the largest T of the call when that is None) with
``topk_idx`` -1 rows, place the ranks' arrays on a mesh of ``num_ranks`` devices
(axis ``"ep"``), run the :mod:`moe_ep_jax.api` function inside
``jax.shard_map`` under ``jax.jit``, and return per-rank numpy results trimmed
to each rank's token count, and, in the dynamic layout, to its received rows.

Executables are cached per operation and static shape, keyed only by what the
operation depends on (a dispatch does not depend on the formats, for example).
On CPU they are compiled with XLA options that cut compile time about 4x
(``XLA_CPU_FAST_COMPILE``; they change no arithmetic).

Devices: the default JAX backend's (CPU, or the GPUs). On CPU the backend makes
XLA expose ``MOE_EP_JAX_CPU_DEVICES`` (default 8) devices by setting
``XLA_FLAGS`` before jax is first imported (see :mod:`moe_ep_jax.devices`).
"""

from __future__ import annotations

import importlib.util
import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from moe_ep_spec import validation as v
from moe_ep_spec.api import (BackwardResult, DispatchGrads, DispatchHandle, DispatchInputs, DispatchResult,
                             ForwardResult, RankInputs, Stash, Tensor)
from moe_ep_spec.backend import Availability, Capabilities, Launch, MoeEpBackend, installed_availability
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import DTypeError, ShapeError, StashError
from moe_ep_spec.formats import BlockScaledTensor, MoeFormat, dequantize

from . import __version__
from . import devices as D

__all__ = ["JaxBackend", "XLA_CPU_FAST_COMPILE"]

#: Compiler options for the backend's own executables on CPU: the legacy loop
#: emitters and no LLVM optimisation. Same arithmetic, a quarter of the compile time.
XLA_CPU_FAST_COMPILE = {
    "xla_cpu_use_fusion_emitters": False,
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}

_AXIS = "ep"


# ----------------------------------------------------------------------------- host side


def _encoding(x: Any) -> str:
    return x.format.value if isinstance(x, BlockScaledTensor) else np.asarray(x).dtype.name


def _unify(tensors: Sequence[Any]) -> List[Any]:
    """The ranks' tensors in one encoding, so that they stack into one global
    array: as they are when they agree; else decoded (exactly) to float32."""
    if len({_encoding(t) for t in tensors}) == 1:
        return list(tensors)
    return [dequantize(t, np.float32) if isinstance(t, BlockScaledTensor) else np.asarray(t, np.float32) for t in tensors]


def _pad_rows(a: np.ndarray, rows: int, fill: Any = 0) -> np.ndarray:
    if a.shape[0] == rows:
        return a
    out = np.full((rows,) + a.shape[1:], fill, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


def _stack_rows(per_rank: Sequence[np.ndarray], rows: int, fill: Any = 0) -> np.ndarray:
    """Pad every rank's ``[rows_r, ...]`` to ``rows`` and concatenate along axis 0."""
    return np.concatenate([_pad_rows(np.asarray(a), rows, fill) for a in per_rank], axis=0)


def _stack_tensor(per_rank: Sequence[Any], rows: int) -> Any:
    """Per-rank token tensors (same encoding) -> one global array or BlockScaled (numpy leaves)."""
    from . import formats as F

    first = per_rank[0]
    if isinstance(first, BlockScaledTensor):
        data = _stack_rows([t.data for t in per_rank], rows)
        scale = _stack_rows([t.scale for t in per_rank], rows)  # zero codes: zero rows
        return F.BlockScaled(data, scale, first.format, first.shape[1], 1)
    return _stack_rows(per_rank, rows)


def _stack_weights(per_rank: Sequence[Any]) -> Any:
    from . import formats as F

    first = per_rank[0]
    if isinstance(first, BlockScaledTensor):
        return F.BlockScaled(
            np.concatenate([t.data for t in per_rank]), np.concatenate([t.scale for t in per_rank]), first.format,
            first.shape[first.axis], first.axis,
        )
    return np.concatenate(per_rank, axis=0)


def _split_tensor(x: Any, n: int, rows: int, keep: Sequence[int]) -> List[Any]:
    """A global output (array or BlockScaled of numpy) -> per-rank tensors of ``keep[r]`` rows."""
    from . import formats as F

    if isinstance(x, F.BlockScaled):
        fmt = x.format
        data, scale = np.asarray(x.data), np.asarray(x.scale)
        out = []
        for r in range(n):
            d = data[r * rows : r * rows + keep[r]]
            s = scale[r * rows : r * rows + keep[r]]
            out.append(
                BlockScaledTensor(
                    data=np.ascontiguousarray(d).view(fmt.data_dtype),
                    scale=np.ascontiguousarray(s).view(fmt.scale_dtype),
                    format=fmt,
                    shape=(keep[r], x.n),
                    axis=1,
                )
            )
        return out
    a = np.asarray(x)
    return [np.ascontiguousarray(a[r * rows : r * rows + keep[r]]) for r in range(n)]


def host_plan(config: MoeEpConfig, topk_idx: Sequence[np.ndarray]) -> List[np.ndarray]:
    """``route_metadata`` ``[R, 4] int32`` of every rank as the spec plans it
    (section 4; static layout: aligned slabs, -1 padding rows). Used to check a
    stash before anything runs."""
    n, el = config.num_ranks, config.num_local_experts
    rows: List[List[np.ndarray]] = [[] for _ in range(n)]
    for src, idx in enumerate(topk_idx):
        a = np.asarray(idx, dtype=np.int64)
        t, k = np.nonzero(a >= 0)
        g = a[t, k]
        meta = np.stack([g % el, np.full_like(t, src), t, k], axis=1)
        for d in range(n):
            rows[d].append(meta[g // el == d])
    out = []
    for d in range(n):
        m = np.concatenate(rows[d]) if rows[d] else np.zeros((0, 4), np.int64)
        m = m[np.argsort(m[:, 0], kind="stable")]
        if config.static_layout:
            counts = np.bincount(m[:, 0], minlength=el)
            align = config.expert_alignment
            starts = np.concatenate([[0], np.cumsum(-(-counts // align) * align)])
            full = np.full((config.recv_capacity, 4), -1, dtype=np.int64)  # type: ignore[arg-type]
            for e in range(el):
                full[starts[e] : starts[e] + counts[e]] = m[m[:, 0] == e]
            m = full
        out.append(m.astype(np.int32))
    return out


@dataclass(frozen=True, eq=False)
class JaxHandleState:
    """``DispatchHandle.backend_state`` of the jax backend: this rank's
    :class:`~moe_ep_jax.api.EpHandle` leaves as numpy arrays, and the static
    shape they were made with. Opaque to callers."""

    num_tokens: int  # T: padded token rows of every rank
    capacity: int  # C: rows of every rank's buffer
    leaves: Tuple[np.ndarray, ...]


# ----------------------------------------------------------------------------- the backend


class JaxBackend(MoeEpBackend):
    """MoeEp in JAX over a device mesh (``jax.shard_map`` + ``jax.jit``), world launch.

    Everything the spec defines: every format, block-scaled inputs, both
    router-weight placements, the clamp, the stash, the backward, and
    dispatch/combine in both layouts, at any EP size up to the device count.

    Args:
        exchange: ``ragged`` (``jax.lax.ragged_all_to_all``; GPU/TPU),
            ``capacity`` (fixed per-peer capacity ``all_to_all``; every platform)
            or None: ``MOE_EP_JAX_EXCHANGE``, else ragged on GPU/TPU, capacity on CPU.
        kernels: the :class:`~moe_ep_jax.kernels.ExpertKernels` provider
            (default: XLA-native).
        fast_compile: compile with :data:`XLA_CPU_FAST_COMPILE` (default: on CPU).
        cache_size: executables kept (least recently used dropped).
    """

    name = "jax"
    version = __version__

    def __init__(
        self, exchange: Optional[str] = None, kernels: Any = None, fast_compile: Optional[bool] = None, cache_size: int = 64
    ) -> None:
        self.exchange = exchange
        self.kernels = kernels
        self.fast_compile = fast_compile
        self._cache: "OrderedDict[Any, Any]" = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:
        """Picklable (``moe-ep conformance --isolate`` sends backends to fresh
        processes): compiled executables and the lock stay behind."""
        state = dict(self.__dict__)
        state["_cache"] = OrderedDict()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # ------------------------------------------------------------- description

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """Everything, on CPU and CUDA; EP sizes up to the device count once jax
        runs in this process (before that, any: the device count is set at import)."""
        limit: Optional[Tuple[int, ...]] = None
        if D.jax_imported():
            try:
                import jax

                limit = tuple(range(1, len(jax.devices()) + 1))
            except Exception:  # noqa: BLE001 - describing must not raise
                limit = None
        return Capabilities(launch=Launch.WORLD, devices=("cpu", "cuda"), num_ranks=limit)

    def availability(self) -> Availability:
        if importlib.util.find_spec("jax") is None:
            return Availability(False, "jax is not installed (pip install jax)")
        try:
            platform, count, problem = D.device_report()
            import jax
        except Exception as exc:  # noqa: BLE001 - report, never raise
            return Availability(False, f"import jax failed: {type(exc).__name__}: {exc}")
        missing = [
            name
            for name, ok in (
                ("jax.shard_map", hasattr(jax, "shard_map")),
                ("jax.lax.ragged_dot", hasattr(jax.lax, "ragged_dot")),
                ("jax.lax.ragged_all_to_all", hasattr(jax.lax, "ragged_all_to_all")),
            )
            if not ok
        ]
        if missing:
            return Availability(False, f"jax {jax.__version__} lacks {', '.join(missing)} (need jax >= 0.7)")
        if problem:
            return Availability(False, problem)
        return Availability(True)

    def quick_availability(self) -> Availability:
        """From what is installed, without importing jax (``moe-ep backends``):
        jax found, version 0.7 or newer."""
        return installed_availability("jax", (0, 7), "lacks jax.shard_map, jax.lax.ragged_dot or jax.lax.ragged_all_to_all")

    def framework_versions(self) -> dict:
        import jax
        import jaxlib

        devs = jax.devices()
        return {
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "numpy": np.__version__,
            "platform": devs[0].platform,
            "devices": str(len(devs)),
            "exchange": self._exchange(),
        }

    # ------------------------------------------------------------------ running

    def _exchange(self) -> str:
        D.prepare_environment()  # before anything imports jax
        from .api import default_exchange

        return self.exchange or default_exchange()

    def _mesh(self, n: int) -> Any:
        D.prepare_environment()
        import jax
        from jax.sharding import Mesh

        devs = jax.devices()
        if n > len(devs):
            from moe_ep_spec.errors import CapabilityError

            raise CapabilityError(
                f"backend {self.name!r}: capability: num_ranks {n} needs {n} devices; this process has {len(devs)} "
                f"{devs[0].platform} device(s) (on CPU set MOE_EP_JAX_CPU_DEVICES or XLA_FLAGS before jax is imported)",
                feature="num_ranks",
            )
        return Mesh(np.array(devs[:n]), (_AXIS,))

    def _compiler_options(self) -> Optional[dict]:
        import jax

        fast = self.fast_compile
        if fast is None:
            fast = jax.default_backend() == "cpu"
        return dict(XLA_CPU_FAST_COMPILE) if fast else None

    def _run(self, key: Any, n: int, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        """``fn`` (one rank's view) under ``jax.shard_map`` over ``n`` devices,
        every argument and result sharded along its leading axis; returns the
        results as numpy (pytrees kept)."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = self._mesh(n)
        sharding = NamedSharding(mesh, P(_AXIS))
        placed = jax.tree_util.tree_map(lambda a: jax.device_put(a, sharding), tuple(args))
        leaves, tree = jax.tree_util.tree_flatten(placed)
        full_key = (key, n, self._exchange(), tree, tuple((a.shape, str(a.dtype)) for a in leaves))
        with self._lock:
            compiled = self._cache.get(full_key)
            if compiled is not None:
                self._cache.move_to_end(full_key)
        if compiled is None:
            jitted = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS)))
            options = self._compiler_options()
            lowered = jitted.lower(*placed)
            compiled = lowered.compile(options) if options else lowered.compile()
            with self._lock:
                self._cache[full_key] = compiled
                evicted = False
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                    evicted = True
            if evicted:
                # jax's own caches (lowerings, compilations) still hold what was dropped here;
                # without this an XLA:CPU process keeps every executable's code mapped and,
                # after a few thousand programs, runs out of memory maps (vm.max_map_count)
                # and crashes inside the compiler.
                jax.clear_caches()
        out = compiled(*placed)
        return jax.tree_util.tree_map(np.asarray, out)

    def _kw(self) -> Dict[str, Any]:
        return {"axis_name": _AXIS, "exchange": self._exchange(), "kernels": self.kernels}

    @staticmethod
    def _num_tokens(config: MoeEpConfig, counts: Sequence[int]) -> int:
        return int(config.max_tokens_per_rank) if config.max_tokens_per_rank is not None else max(1, *counts)

    def _check_world_inputs(self, config: MoeEpConfig, inputs: Sequence[RankInputs]) -> List[int]:
        v.validate_world(config, inputs, "inputs")
        return [v.validate_rank_inputs(config, inp, r) for r, inp in enumerate(inputs)]

    @staticmethod
    def _check_capacity(config: MoeEpConfig, topk_idx: Sequence[np.ndarray]) -> None:
        from .api import check_routing

        check_routing(config, topk_idx)

    def _fused_args(self, config: MoeEpConfig, inputs: Sequence[RankInputs], rows: int) -> List[Any]:
        x = _stack_tensor(_unify([i.activation for i in inputs]), rows)
        w1 = _stack_weights(_unify([i.fc1_weight for i in inputs]))
        w2 = _stack_weights(_unify([i.fc2_weight for i in inputs]))
        idx = _stack_rows([np.asarray(i.topk_idx, np.int32) for i in inputs], rows, -1)
        tw = _stack_rows(_unify([i.topk_weights for i in inputs]), rows)
        return [x, w1, w2, idx, tw]

    # -------------------------------------------------------------------- fused

    def forward(self, config: MoeEpConfig, inputs: Sequence[RankInputs]) -> List[ForwardResult]:
        from .api import moe_ep

        self.require(config, "forward")
        counts = self._check_world_inputs(config, inputs)
        self._check_capacity(config, [i.topk_idx for i in inputs])
        n, rows = config.num_ranks, self._num_tokens(config, counts)
        cfg = config.replace(generate_c=True)  # one executable for both; the stash is dropped when not asked for
        out, fc1_c, meta = self._run(("forward", cfg), n, partial(moe_ep, config=cfg, **self._kw()), self._fused_args(config, inputs, rows))
        cap = fc1_c.shape[0] // n
        outputs = _split_tensor(out, n, rows, counts)
        results = []
        for r in range(n):
            if not config.generate_c:
                results.append(ForwardResult(outputs[r]))
                continue
            m = meta[r * cap : (r + 1) * cap]
            keep = cap if config.static_layout else int((m[:, 0] >= 0).sum())
            c = fc1_c[r * cap : r * cap + keep]
            results.append(ForwardResult(outputs[r], np.ascontiguousarray(c), np.ascontiguousarray(m[:keep], dtype=np.int32)))
        return results

    def backward(self, config: MoeEpConfig, inputs: Sequence[RankInputs], grad_output: Sequence[np.ndarray],
                 stash: Sequence[Stash]) -> List[BackwardResult]:
        from .core import buffer_rows

        self.require(config, "backward")
        counts = self._check_world_inputs(config, inputs)
        v.validate_world(config, grad_output, "grad_output")
        v.validate_world(config, stash, "stash")
        self._check_capacity(config, [i.topk_idx for i in inputs])
        plans = host_plan(config, [i.topk_idx for i in inputs])
        for r in range(config.num_ranks):
            v.validate_grad("grad_output", grad_output[r], (counts[r], config.hidden), "(num_tokens, hidden)", r)
            v.validate_stash(config, stash[r], plans[r].shape[0], r)
            diff = np.nonzero((stash[r].route_metadata != plans[r]).any(axis=1))[0]
            if diff.size:
                row = int(diff[0])
                raise StashError(
                    f"rank {r}: route_metadata must equal the forward's routing of topk_idx; row {row} is "
                    f"{tuple(int(x) for x in stash[r].route_metadata[row])}, the routing gives "
                    f"{tuple(int(x) for x in plans[r][row])}"
                )
        n, rows = config.num_ranks, self._num_tokens(config, counts)
        cap = buffer_rows(config, rows)
        args = self._fused_args(config, inputs, rows)
        dy = _stack_rows(_unify(list(grad_output)), rows)
        c = _stack_rows([s.fc1_c for s in stash], cap)
        cfg = config.replace(generate_c=True)
        fn = partial(_backward_call, config=cfg, kw=self._kw())
        gx, g1, g2, gw = self._run(("backward", cfg), n, fn, [dy] + args + [c])
        el = config.num_local_experts
        return [
            BackwardResult(
                grad_activation=np.ascontiguousarray(gx[r * rows : r * rows + counts[r]]),
                grad_fc1_weight=np.ascontiguousarray(g1[r * el : (r + 1) * el]),
                grad_fc2_weight=np.ascontiguousarray(g2[r * el : (r + 1) * el]),
                grad_topk_weights=np.ascontiguousarray(gw[r * rows : r * rows + counts[r]]),
            )
            for r in range(n)
        ]

    # ------------------------------------------------------------------ layered

    def dispatch(self, config: MoeEpConfig, inputs: Sequence[DispatchInputs]) -> List[DispatchResult]:
        from .api import ep_dispatch

        self.require(config, "dispatch")
        v.validate_world(config, inputs, "inputs")
        counts = [v.validate_dispatch_inputs(config, inp, r) for r, inp in enumerate(inputs)]
        encodings = [_encoding(i.tokens) for i in inputs]
        for r, enc in enumerate(encodings):
            if enc != encodings[0]:
                raise DTypeError(
                    f"tokens must have the same encoding on every rank: rank {r} passes {enc} while rank 0 passes "
                    f"{encodings[0]}",
                    name="tokens",
                    expected=encodings[0],
                    got=enc,
                )
        self._check_capacity(config, [i.topk_idx for i in inputs])
        n, rows = config.num_ranks, self._num_tokens(config, counts)
        tokens = _stack_tensor([i.tokens for i in inputs], rows)
        idx = _stack_rows([np.asarray(i.topk_idx, np.int32) for i in inputs], rows, -1)
        tw = _stack_rows(_unify([i.topk_weights for i in inputs]), rows)
        cfg = _layout_config(config)
        recv, weights, handle = self._run(("dispatch", cfg), n, partial(ep_dispatch, config=cfg, **self._kw()), [tokens, idx, tw])
        cap = weights.shape[0] // n
        leaves = _handle_leaves(handle)
        meta_all = handle.route_metadata
        keeps = []
        for r in range(n):
            m = meta_all[r * cap : (r + 1) * cap]
            keeps.append(cap if config.static_layout else int((m[:, 0] >= 0).sum()))
        tok = _split_tensor(recv, n, cap, keeps)
        el = config.num_local_experts
        results = []
        for r in range(n):
            h = DispatchHandle(
                rank=r,
                num_ranks=n,
                num_tokens=counts[r],
                num_topk=config.num_topk,
                route_metadata=np.ascontiguousarray(meta_all[r * cap : r * cap + keeps[r]], dtype=np.int32),
                tokens_per_expert=handle.tokens_per_expert[r * el : (r + 1) * el].astype(np.int64),
                expert_offsets=handle.expert_offsets[r * (el + 1) : (r + 1) * (el + 1)].astype(np.int64),
                backend_state=JaxHandleState(rows, cap, tuple(_rank_slice(a, n, r) for a in leaves)),
            )
            results.append(DispatchResult(tokens=tok[r], topk_weights=np.ascontiguousarray(weights[r * cap : r * cap + keeps[r]]), handle=h))
        return results

    def _check_handles(self, config: MoeEpConfig, handles: Sequence[DispatchHandle]) -> Tuple[int, int]:
        v.validate_world(config, handles, "handles")
        states = []
        for r, h in enumerate(handles):
            v.check_handle(config, h, r)
            if not isinstance(h.backend_state, JaxHandleState):
                raise ShapeError(
                    f"handles[{r}] must come from the jax backend's dispatch; got a handle with backend_state "
                    f"{type(h.backend_state).__name__}",
                    name="handles",
                )
            states.append(h.backend_state)
        shapes = {(s.num_tokens, s.capacity) for s in states}
        if len(shapes) != 1:
            raise ShapeError(f"handles must come from one dispatch; got (num_tokens, capacity) {sorted(shapes)}", name="handles")
        return states[0].num_tokens, states[0].capacity

    def _handle(self, config: MoeEpConfig, handles: Sequence[DispatchHandle]) -> Any:
        """The handles as one global EpHandle of numpy leaves (stacked per rank)."""
        import jax

        from .api import EpHandle
        from .core import Plan

        rows, cap = handles[0].backend_state.num_tokens, handles[0].backend_state.capacity
        stacked = [np.concatenate([h.backend_state.leaves[i] for h in handles]) for i in range(len(handles[0].backend_state.leaves))]
        spec = _placeholder_spec(config, rows, cap)
        template = EpHandle(
            plan=Plan(*[0] * 4), route_metadata=0, tokens_per_expert=0, expert_offsets=0, valid=0, error=0, spec=spec
        )
        tree = jax.tree_util.tree_structure(template)
        return jax.tree_util.tree_unflatten(tree, stacked)

    def combine(
        self, config: MoeEpConfig, handles: Sequence[DispatchHandle], expert_out: Sequence[np.ndarray]
    ) -> List[Tensor]:
        self.require(config, "combine")
        rows, cap = self._check_handles(config, handles)
        v.validate_world(config, expert_out, "expert_out")
        for h, y in zip(handles, expert_out):
            v.validate_expert_out(config, y, h)
        y = _stack_rows(_unify(list(expert_out)), cap)
        cfg = _combine_config(config)
        fn = partial(_combine_call, config=cfg, kw=self._kw())
        out = self._run(("combine", cfg), config.num_ranks, fn, [y, self._handle(cfg, handles)])
        return _split_tensor(out, config.num_ranks, rows, [h.num_tokens for h in handles])

    def dispatch_backward(self, config: MoeEpConfig, handles: Sequence[DispatchHandle],
                          grad_tokens: Sequence[np.ndarray],
                          grad_topk_weights: Sequence[np.ndarray]) -> List[DispatchGrads]:
        self.require(config, "dispatch_backward")
        rows, cap = self._check_handles(config, handles)
        v.validate_world(config, grad_tokens, "grad_tokens")
        v.validate_world(config, grad_topk_weights, "grad_topk_weights")
        for r, (h, gt, gw) in enumerate(zip(handles, grad_tokens, grad_topk_weights)):
            v.validate_grad("grad_tokens", gt, (h.num_recv_rows, config.hidden), "(received rows, hidden)", r)
            v.validate_grad("grad_topk_weights", gw, (h.num_recv_rows,), "(received rows,)", r)
        gt = _stack_rows(_unify(list(grad_tokens)), cap)
        gw = _stack_rows(_unify(list(grad_topk_weights)), cap)
        cfg = _layout_config(config)
        fn = partial(_dispatch_backward_call, config=cfg, kw=self._kw())
        g_tok, g_w = self._run(("dispatch_backward", cfg), config.num_ranks, fn, [gt, gw, self._handle(cfg, handles)])
        return [
            DispatchGrads(
                grad_tokens=np.ascontiguousarray(g_tok[r * rows : r * rows + h.num_tokens]),
                grad_topk_weights=np.ascontiguousarray(g_w[r * rows : r * rows + h.num_tokens]),
            )
            for r, h in enumerate(handles)
        ]

    def combine_backward(
        self, config: MoeEpConfig, handles: Sequence[DispatchHandle], grad_output: Sequence[np.ndarray]
    ) -> List[np.ndarray]:
        self.require(config, "combine_backward")
        rows, cap = self._check_handles(config, handles)
        v.validate_world(config, grad_output, "grad_output")
        for r, (h, g) in enumerate(zip(handles, grad_output)):
            v.validate_grad("grad_output", g, (h.num_tokens, config.hidden), "(num_tokens, hidden)", r)
        g = _stack_rows(_unify(list(grad_output)), rows)
        cfg = _layout_config(config)
        fn = partial(_combine_backward_call, config=cfg, kw=self._kw())
        out = self._run(("combine_backward", cfg), config.num_ranks, fn, [g, self._handle(cfg, handles)])
        return [np.ascontiguousarray(out[r * cap : r * cap + h.num_recv_rows]) for r, h in enumerate(handles)]


# ----------------------------------------------------------------------------- per-rank bodies


def _layout_config(config: MoeEpConfig) -> MoeEpConfig:
    """The configuration with everything a dispatch (and its handle) does not
    depend on reset, so that executables are shared between cases."""
    return config.replace(
        output_format=MoeFormat.BF16,
        combine_format=MoeFormat.BF16,
        intermediate_format=None,
        apply_topk_in_fc1=True,
        gate_up_clamp=None,
        generate_c=False,
    )


def _combine_config(config: MoeEpConfig) -> MoeEpConfig:
    return _layout_config(config).replace(output_format=config.output_format, combine_format=config.combine_format)


def _placeholder_spec(config: MoeEpConfig, rows: int, cap: int) -> Any:
    """The LayerSpec of a handle rebuilt from a JaxHandleState (its exchange and
    kernels are filled in by the per-rank body)."""
    from .core import LayerSpec

    return LayerSpec(config=config, axis_name=_AXIS, num_tokens=rows, capacity=cap, exchange="capacity", kernels=None)


def _respec(handle: Any, config: MoeEpConfig, kw: Dict[str, Any]) -> Any:
    from .api import EpHandle
    from .core import replace_spec
    from .kernels import DEFAULT_KERNELS

    spec = replace_spec(
        handle.spec, config=config, exchange=kw["exchange"], kernels=kw["kernels"] if kw["kernels"] is not None else DEFAULT_KERNELS
    )
    return EpHandle(handle.plan, handle.route_metadata, handle.tokens_per_expert, handle.expert_offsets, handle.valid, handle.error, spec)


def _backward_call(dy, x, w1, w2, idx, tw, c, *, config, kw):  # type: ignore[no-untyped-def]
    from .api import moe_ep_backward

    return moe_ep_backward(dy, x, w1, w2, idx, tw, c, config=config, **kw)


def _combine_call(y, handle, *, config, kw):  # type: ignore[no-untyped-def]
    from .api import ep_combine

    return ep_combine(y, _respec(handle, config, kw), config=config)


def _dispatch_backward_call(gt, gw, handle, *, config, kw):  # type: ignore[no-untyped-def]
    from .api import dispatch_backward

    return dispatch_backward(gt, gw, _respec(handle, config, kw))


def _combine_backward_call(g, handle, *, config, kw):  # type: ignore[no-untyped-def]
    from .api import combine_backward

    return combine_backward(g, _respec(handle, config, kw))


def _handle_leaves(handle: Any) -> List[np.ndarray]:
    import jax

    return [np.asarray(a) for a in jax.tree_util.tree_leaves(handle)]


def _rank_slice(a: np.ndarray, n: int, r: int) -> np.ndarray:
    per = a.shape[0] // n
    return np.ascontiguousarray(a[r * per : (r + 1) * per])
