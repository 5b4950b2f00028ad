"""``torch``: the MoeEp backend over ``torch.distributed``, one process per rank.

The world-level ``*_rank`` methods take the spec's numpy inputs, move them to
the rank's device as torch tensors, run :mod:`moe_ep_torch.core` over a process
group made from the :class:`~moe_ep_spec.RankContext` (gloo on CPU, NCCL on
CUDA; created on first use and kept for the process's later calls) and return
numpy results. Torch users call :mod:`moe_ep_torch.api` instead.
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

from moe_ep_spec import validation as v
from moe_ep_spec.api import (BackwardResult, DispatchGrads, DispatchHandle, DispatchInputs, DispatchResult,
                             ForwardResult, RankContext, RankInputs, Stash)
from moe_ep_spec.backend import Availability, Capabilities, Launch, MoeEpBackend, installed_availability
from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import ConfigError, MoeEpError, StashError
from moe_ep_spec.formats import BF16, BlockScaledTensor

__all__ = ["TorchBackend"]

__version__ = "0.1.0"

_GROUPS: Dict[str, Any] = {}


def process_group(ctx: RankContext, backend: Optional[str] = None) -> Any:
    """The process group of ``ctx`` (the default group, initialised on first use).

    ``backend``: the group's torch.distributed backend; None: NCCL for a CUDA
    device, gloo otherwise. (``"gloo"`` on a CUDA device suits a caller whose
    collectives take CPU tensors only, e.g. ranks sharing one GPU, which NCCL refuses.)"""
    import torch
    import torch.distributed as dist

    group = _GROUPS.get(ctx.rendezvous)
    if group is not None:
        return group
    cuda = ctx.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(torch.device(ctx.device))
    if dist.is_initialized():
        raise MoeEpError(
            f"rank {ctx.rank}: a different torch.distributed process group is already initialised in this process; "
            f"the torch backend's world-level API needs its own (rendezvous {ctx.rendezvous})"
        )
    backend = backend or ("nccl" if cuda else "gloo")
    dist.init_process_group(
        backend=backend,
        init_method=ctx.rendezvous,
        rank=ctx.rank,
        world_size=ctx.num_ranks,
        timeout=timedelta(seconds=ctx.timeout_s),
        **({"device_id": torch.device(ctx.device)} if cuda and backend == "nccl" else {}),
    )
    group = _GROUPS[ctx.rendezvous] = dist.group.WORLD
    return group


# ----------------------------------------------------------------------------- conversions


def to_torch(x: Any, device: Any, weight: bool = False) -> Any:
    """numpy (ml_dtypes) or BlockScaledTensor -> torch tensor / TorchBlockScaled.

    Weights blocked along axis 1 become a TorchBlockScaled of the transposed
    weight (``[E, N, K]`` blocked along its last axis K), which is what
    :func:`moe_ep_torch.core` decodes and transposes back."""
    import torch

    from .formats import from_raw

    if isinstance(x, BlockScaledTensor):
        data, scale = x.data_codes(), x.scale_codes()
        if weight:
            data, scale = np.moveaxis(data, 1, -1), np.moveaxis(scale, 1, -1)
        data_t = torch.from_numpy(np.ascontiguousarray(data)).to(device)
        scale_t = torch.from_numpy(np.ascontiguousarray(scale)).to(device)
        return from_raw(data_t, scale_t, x.format, x.shape[x.axis])
    a = np.asarray(x)
    if a.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def to_numpy(x: Any) -> Any:
    """torch tensor / TorchBlockScaled -> numpy (ml_dtypes) / BlockScaledTensor blocked along axis 1."""
    import torch

    from .formats import TorchBlockScaled, raw

    if isinstance(x, TorchBlockScaled):
        data_u8, scale_u8 = raw(x)
        data, scale = data_u8.cpu().numpy(), scale_u8.cpu().numpy()
        fmt = x.format
        return BlockScaledTensor(
            data=data.view(fmt.data_dtype),
            scale=scale.view(fmt.scale_dtype),
            format=fmt,
            shape=x.shape,
            axis=len(x.shape) - 1,
        )
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).cpu().numpy().view(BF16)
    return x.detach().cpu().numpy()


def _encoding(x: Any) -> str:
    if isinstance(x, BlockScaledTensor):
        return x.format.value
    return np.asarray(x).dtype.name


def _plan_state(plan: Any) -> Dict[str, Any]:
    return {
        "send_route": plan.send_route.cpu().numpy(),
        "send_counts": list(plan.send_counts),
        "recv_counts": list(plan.recv_counts),
        "recv_meta": plan.recv_meta.cpu().numpy(),
        "order": plan.order.cpu().numpy(),
        "rows": plan.rows.cpu().numpy(),
        "num_rows": plan.num_rows,
        "tokens_per_expert": list(plan.tokens_per_expert),
        "expert_offsets": list(plan.expert_offsets),
    }


def _plan_from_handle(handle: DispatchHandle, device: Any) -> Any:
    import torch

    from .core import Plan

    st = handle.backend_state
    if not isinstance(st, dict) or "send_route" not in st:
        raise MoeEpError("handle was not made by the torch backend's dispatch")
    return Plan(
        rank=handle.rank,
        num_ranks=handle.num_ranks,
        num_tokens=handle.num_tokens,
        num_topk=handle.num_topk,
        num_local_experts=len(st["tokens_per_expert"]),
        send_route=torch.from_numpy(st["send_route"]).to(device),
        send_counts=st["send_counts"],
        recv_counts=st["recv_counts"],
        recv_meta=torch.from_numpy(st["recv_meta"]).to(device),
        order=torch.from_numpy(st["order"]).to(device),
        rows=torch.from_numpy(st["rows"]).to(device),
        num_rows=st["num_rows"],
        tokens_per_expert=st["tokens_per_expert"],
        expert_offsets=st["expert_offsets"],
        route_metadata=torch.from_numpy(handle.route_metadata).to(device),
    )


class TorchBackend(MoeEpBackend):
    """MoeEp in PyTorch over ``torch.distributed``: gloo on CPU, NCCL on CUDA.

    Every format, both router-weight placements, the clamp, the stash, the
    backward, and dispatch/combine in both layouts, at any EP size. On CUDA the
    FC1 GEMM of bf16 activations and weights is one grouped GEMM
    (``torch._grouped_mm``) with float32 output; other GEMMs run in float32.
    """

    name = "torch"
    version = __version__
    capabilities = Capabilities(launch=Launch.PROCESS_PER_RANK, devices=("cpu", "cuda"))

    @property
    def prims(self) -> Any:
        """The :class:`~moe_ep_torch.core.Primitives` this backend runs on
        (a subclass that brings its own kernels overrides this)."""
        from .core import TORCH

        return TORCH

    def availability(self) -> Availability:
        if importlib.util.find_spec("torch") is None:
            return Availability(False, "torch is not installed (pip install torch)")
        try:
            import torch
            import torch.distributed as dist
        except Exception as exc:  # noqa: BLE001 - report, never raise
            return Availability(False, f"import torch failed: {type(exc).__name__}: {exc}")
        if not dist.is_available():
            return Availability(False, "this torch build has no torch.distributed")
        if not hasattr(torch, "float8_e4m3fn"):
            return Availability(False, f"torch {torch.__version__} has no float8_e4m3fn (need torch >= 2.1)")
        return Availability(True)

    def quick_availability(self) -> Availability:
        """From what is installed, without importing torch (``moe-ep backends``):
        torch found, version 2.1 or newer."""
        return installed_availability("torch", (2, 1), "has no float8_e4m3fn")

    def torch_layer(self, host_sync: bool = True) -> Callable[..., Any]:
        """The functional layer :class:`moe_ep_torch.module.MoeEpLayer` runs on
        this backend: ``f(activation, fc1_weight, fc2_weight, topk_idx,
        topk_weights, *, config, group)`` with the arguments and result of
        :func:`moe_ep_torch.api.moe_ep`. A torch-based backend of another
        package overrides this, so the layer reaches it through the registry.

        Args:
            host_sync: False asks for the static-shape mode, which the torch
                backend does not have (the layer checks that first).
        """
        if not host_sync:
            raise ConfigError(
                f"host_sync=False (the static-shape mode) needs backend 'cuda-nccl'; got backend {self.name!r}",
                field="host_sync",
                value=host_sync,
            )
        from .api import OPS

        return OPS.moe_ep

    def framework_versions(self) -> dict:
        import torch

        out = {"torch": torch.__version__, "numpy": np.__version__}
        if torch.cuda.is_available():
            out["cuda"] = str(torch.version.cuda)
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        return out

    # ----------------------------------------------------------------- helpers

    def _prepare(self, config: MoeEpConfig, ctx: RankContext) -> Tuple[Any, Any]:
        import torch

        group = process_group(ctx)
        return group, torch.device(ctx.device)

    # ------------------------------------------------------------------ fused

    def _planned(
        self,
        config: MoeEpConfig,
        ctx: RankContext,
        inputs: RankInputs,
        check: Any = None,
        extra_rows: Any = None,
    ) -> Tuple[Any, Any, list, Any, Any, Any]:
        """Validate one rank's inputs (and ``check()``), move them to the device,
        plan and move the routes' payload (collective). A validation error is
        shared with every rank, so that all of them raise it together.
        Returns ``(group, plan, received payload, activation, fc1, fc2)``; the
        payload carries ``extra_rows(device)`` per token after the weights."""
        from . import core

        group, device = self._prepare(config, ctx)
        error: Optional[BaseException] = None
        try:
            num_tokens = v.validate_rank_inputs(config, inputs, ctx.rank)
            if check is not None:
                check(num_tokens)
        except MoeEpError as exc:
            error, num_tokens = exc, 0
        act = fc1 = fc2 = idx = payload = None
        extra = ""
        if error is None:
            act = to_torch(inputs.activation, device)
            fc1 = self.prims.decode_weight(to_torch(inputs.fc1_weight, device, weight=True))
            fc2 = self.prims.decode_weight(to_torch(inputs.fc2_weight, device, weight=True))
            idx = to_torch(inputs.topk_idx, device)
            rows = [] if extra_rows is None else extra_rows(device)
            payload = core.route_payload(act, to_torch(inputs.topk_weights, device), config.num_topk, extra=rows)
            extra = "|".join(_encoding(x) for x in (inputs.activation, inputs.fc1_weight, inputs.fc2_weight))
        plan, recv = core.make_plan(config, idx, num_tokens, group, device, error, extra, payload, self.prims)
        return group, plan, recv, act, fc1, fc2

    def forward_rank(self, config: MoeEpConfig, ctx: RankContext, inputs: RankInputs) -> ForwardResult:
        from . import core

        self.require(config, "forward")
        group, plan, recv, act, fc1, fc2 = self._planned(config, ctx, inputs)
        out = core.forward(config, plan, recv, act, fc1, fc2, group, self.prims)
        if not config.generate_c:
            return ForwardResult(to_numpy(out["output"]))
        return ForwardResult(
            to_numpy(out["output"]), to_numpy(out["fc1_c"]), out["route_metadata"].cpu().numpy().astype(np.int32)
        )

    def backward_rank(
        self, config: MoeEpConfig, ctx: RankContext, inputs: RankInputs, grad_output: np.ndarray, stash: Stash
    ) -> BackwardResult:
        from . import core

        self.require(config, "backward")

        def check(num_tokens: int) -> None:
            v.validate_grad("grad_output", grad_output, (num_tokens, config.hidden), "(num_tokens, hidden)", ctx.rank)
            if not isinstance(stash, Stash):
                raise StashError(f"rank {ctx.rank}: stash must be a Stash; got {type(stash).__name__}")

        group, plan, recv, act, fc1, fc2 = self._planned(
            config, ctx, inputs, check, lambda device: [to_torch(grad_output, device).float()]
        )
        v.validate_stash(config, stash, plan.num_rows, ctx.rank)
        expected = plan.route_metadata.cpu().numpy()
        diff = np.nonzero((stash.route_metadata != expected).any(axis=1))[0]
        if diff.size:
            row = int(diff[0])
            raise StashError(
                f"rank {ctx.rank}: route_metadata must equal the forward's routing of topk_idx; row {row} is "
                f"{tuple(int(x) for x in stash.route_metadata[row])}, the routing gives {tuple(int(x) for x in expected[row])}"
            )
        fc1_c = to_torch(stash.fc1_c, act.device)
        grads = core.backward(config, plan, recv, act, fc1, fc2, fc1_c, group, self.prims)
        return BackwardResult(**{name: t.float().cpu().numpy() for name, t in grads.items()})

    # ---------------------------------------------------------------- layered

    def dispatch_rank(self, config: MoeEpConfig, ctx: RankContext, inputs: DispatchInputs) -> DispatchResult:
        from . import core

        self.require(config, "dispatch")
        group, device = self._prepare(config, ctx)
        error: Optional[BaseException] = None
        try:
            num_tokens = v.validate_dispatch_inputs(config, inputs, ctx.rank)
        except MoeEpError as exc:
            error, num_tokens = exc, 0
        if error is None:
            tokens = to_torch(inputs.tokens, device)
            weights = to_torch(inputs.topk_weights, device)
            idx = to_torch(inputs.topk_idx, device)
            payload = core.route_payload(tokens, weights, config.num_topk)
        else:
            tokens = idx = payload = None
        extra = _encoding(inputs.tokens) if error is None else ""
        plan, recv = core.make_plan(config, idx, num_tokens, group, device, error, extra, payload, self.prims)
        buf = core.buffer_tokens(plan, tokens, recv[:-1])
        w_buf = core.to_buffer(plan, recv[-1])
        handle = DispatchHandle(
            rank=ctx.rank,
            num_ranks=config.num_ranks,
            num_tokens=num_tokens,
            num_topk=config.num_topk,
            route_metadata=plan.route_metadata.cpu().numpy().astype(np.int32),
            tokens_per_expert=np.asarray(plan.tokens_per_expert, dtype=np.int64),
            expert_offsets=np.asarray(plan.expert_offsets, dtype=np.int64),
            backend_state=_plan_state(plan),
        )
        return DispatchResult(tokens=to_numpy(buf), topk_weights=w_buf.float().cpu().numpy(), handle=handle)

    def combine_rank(self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, expert_out: np.ndarray) -> Any:
        from . import core

        self.require(config, "combine")
        group, device = self._prepare(config, ctx)
        v.validate_expert_out(config, expert_out, handle)
        plan = _plan_from_handle(handle, device)
        y = to_torch(expert_out, device).float()
        rows = self.prims.round_trip(core.from_buffer(plan, y), config.combine_format)
        (back,) = core.exchange_back(plan, [rows], group, self.prims)
        return to_numpy(self.prims.encode_output(config, self.prims.sum_slots(plan, back)))

    def combine_backward_rank(
        self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, grad_output: np.ndarray
    ) -> np.ndarray:
        import torch

        from . import core

        self.require(config, "combine_backward")
        group, device = self._prepare(config, ctx)
        v.validate_grad("grad_output", grad_output, (handle.num_tokens, config.hidden), "(num_tokens, hidden)", ctx.rank)
        plan = _plan_from_handle(handle, device)
        g = to_torch(grad_output, device).float()
        token_index = torch.div(plan.send_route, plan.num_topk, rounding_mode="floor")
        (recv,) = core.exchange(plan, [g[token_index]], group, self.prims)
        return core.to_buffer(plan, recv).cpu().numpy()

    def dispatch_backward_rank(self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle,
                               grad_tokens: np.ndarray, grad_topk_weights: np.ndarray) -> DispatchGrads:
        from . import core

        self.require(config, "dispatch_backward")
        group, device = self._prepare(config, ctx)
        rows = handle.num_recv_rows
        v.validate_grad("grad_tokens", grad_tokens, (rows, config.hidden), "(received rows, hidden)", ctx.rank)
        v.validate_grad("grad_topk_weights", grad_topk_weights, (rows,), "(received rows,)", ctx.rank)
        plan = _plan_from_handle(handle, device)
        gt = core.from_buffer(plan, to_torch(grad_tokens, device).float())
        gw = core.from_buffer(plan, to_torch(grad_topk_weights, device).float())
        gt_back, gw_back = core.exchange_back(plan, [gt, gw], group, self.prims)
        return DispatchGrads(
            grad_tokens=self.prims.sum_slots(plan, gt_back).cpu().numpy(),
            grad_topk_weights=core.to_slots(plan, gw_back).cpu().numpy(),
        )
