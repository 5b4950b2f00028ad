"""The MoeEp layer as a ``torch.nn.Module``: the experts' weights as parameters
and the process group, as the MoE layers of Megatron, TransformerEngine or vLLM
hold them.

Example (every rank runs the same code; the router is the model's own)::

    import torch, torch.distributed as dist
    from moe_ep_spec import MoeEpConfig
    from moe_ep_torch.module import MoeEpLayer

    dist.init_process_group("gloo")           # "nccl" on GPUs
    config = MoeEpConfig(num_experts=8, hidden=64, intermediate=32, num_topk=2,
                         num_ranks=dist.get_world_size())
    layer = MoeEpLayer(config)                  # this rank's experts, bfloat16
    router = torch.nn.Linear(64, 8)
    x = torch.randn(16, 64)
    weights, idx = router(x).softmax(-1).topk(2, dim=-1)
    y = layer(x.bfloat16(), idx, weights)      # [16, 64] bfloat16
    y.float().square().mean().backward()        # grads for the experts, x and the router

Importing this module imports torch.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from moe_ep_spec.config import MoeEpConfig
from moe_ep_spec.errors import BackendUnavailableError, ConfigError, DTypeError, NativeError
from moe_ep_spec.formats import MoeFormat, parse_format
from moe_ep_spec.registry import get_backend

from .backend import TorchBackend
from .formats import TorchBlockScaled, quantize, round_trip

__all__ = ["MoeEpLayer", "TORCH_BACKENDS", "PARAMETER_DTYPES"]

#: The backends a :class:`MoeEpLayer` can run on: the torch-based ones.
TORCH_BACKENDS = ("torch", "cuda-nccl")

#: The dtypes the expert parameters may have.
PARAMETER_DTYPES = (torch.bfloat16, torch.float32)

# Elements per scale block of the block-scaled formats: the weights' reduction
# extents (hidden for FC1, intermediate for FC2) must be multiples of it.
_BLOCK = {MoeFormat.MXFP8: 32, MoeFormat.NVFP4: 16}


def _torch_layer(backend: str, host_sync: Optional[bool]) -> Any:
    """The functional layer of the torch-based backend ``backend``: this
    package's own for ``torch``, else what the backend registered under that
    name in :mod:`moe_ep_spec.registry` returns from its ``torch_layer``
    (``host_sync`` None: the backend's default path). Raises BackendUnavailableError
    when that layer cannot load here (a missing package, a native library that does not
    load), naming the backend and the cause."""
    if backend == "torch":
        return TorchBackend().torch_layer(True if host_sync is None else host_sync)
    impl = get_backend(backend, require_available=False)
    if not callable(getattr(impl, "torch_layer", None)):
        raise ConfigError(
            f"backend {backend!r} is registered by {type(impl).__module__}.{type(impl).__name__}, which has no "
            f"torch_layer (the torch-based backends {TORCH_BACKENDS} have one)",
            field="backend",
            value=backend,
        )
    try:
        return impl.torch_layer(host_sync)
    except (ImportError, OSError, NativeError) as exc:  # its framework side or native library did not load
        raise BackendUnavailableError(backend, f"its torch layer did not load: {type(exc).__name__}: {exc}") from exc


class MoeEpLayer(torch.nn.Module):
    """This rank's part of an expert-parallel MoE layer: route every token to its
    ``num_topk`` experts on whichever ranks hold them, run the SwiGLU experts
    there, and bring back and sum the router-weighted results (docs/spec.md).

    Collective: every rank of ``group`` calls :meth:`forward` (and the backward)
    together, each with its own tokens.

    Args:
        config: the layer; ``config.num_ranks`` must equal the size of ``group``.
            With ``config.output_format`` bf16 (the default) the output is
            differentiable; other output formats give a
            :class:`~moe_ep_torch.formats.TorchBlockScaled` without autograd.
        group: the ``torch.distributed`` process group the experts are spread
            over (default: the world group; it must be initialised).
        backend: which torch-based backend computes the layer: ``"torch"``
            (PyTorch over the group, gloo on CPU or NCCL on CUDA) or
            ``"cuda-nccl"`` (the native core's CUDA kernels and NCCL transport;
            needs the ``moe-ep-cuda-nccl`` distribution).
        dtype: the parameters' dtype: ``torch.bfloat16`` (default) or ``torch.float32``.
        device: where the parameters live (default: torch's default device).
        weight_format: None (default): the parameters are the weights as they
            are. ``"mxfp8"`` or ``"nvfp4"``: every forward quantizes them to
            that block-scaled format along their reduction axis (hidden for FC1,
            intermediate for FC2). With gradients enabled the quantized values
            are used with a straight-through gradient (the parameters stay in
            ``dtype`` and are trained); without (``torch.no_grad()``), the
            block-scaled weights themselves go to the backend.
        host_sync: None (default): the backend's fastest conforming path; on
            ``cuda-nccl`` the native layer's device exchange in the static layout
            (``recv_capacity`` sized from ``config.max_tokens_per_rank`` when not
            given: no host synchronisation; a bad expert id then makes the output
            NaN and ``moe_ep_cuda_nccl.api.check_errors`` raises it), or its
            host-synchronised mode without ``max_tokens_per_rank``. True: one host
            synchronisation per call, every input error raised at once. False
            (``cuda-nccl`` only): its static-shape mode (needs
            ``config.recv_capacity`` and ``config.max_tokens_per_rank``; CUDA-graph
            capturable).

    Training: ``config.backward_operand_format="bf16"`` rounds the backward's GEMM
    operands to bf16 as training stacks do (four bf16 GEMMs on tensor cores instead
    of ten); a parameter that carries a float32 ``main_grad`` tensor (Megatron's
    convention) gets its gradient added there on ``cuda-nccl``, ``.grad`` left alone
    (docs/torch.md, "Training"); not with ``weight_format`` set, whose quantized copies
    carry no ``main_grad`` (the gradient then goes to ``.grad``). Without ``main_grad``,
    bf16 parameters on ``cuda-nccl``'s static and device paths get their bf16 ``.grad``
    written by the native weight-gradient GEMMs (no float32 gradient, no cast pass).

    Attributes:
        fc1_weight: ``[num_local_experts, hidden, 2 * intermediate]`` ``dtype``
            parameter: this rank's experts' FC1 weights, gate columns
            ``[:intermediate]`` then up columns.
        fc2_weight: ``[num_local_experts, intermediate, hidden]`` ``dtype``
            parameter: this rank's experts' FC2 weights.
        config: the :class:`~moe_ep_spec.MoeEpConfig`.
        group: the process group.
        backend: the backend's name.
        weight_format: the :class:`~moe_ep_spec.MoeFormat` of the on-the-fly
            quantization, or None.

    Expert ``e`` of rank ``r`` is global expert ``r * num_local_experts + e``.
    """

    def __init__(
        self,
        config: MoeEpConfig,
        *,
        group: Optional[Any] = None,
        backend: str = "torch",
        dtype: torch.dtype = torch.bfloat16,
        device: Any = None,
        weight_format: Optional[str] = None,
        host_sync: Optional[bool] = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, MoeEpConfig):
            raise ConfigError(f"config must be a MoeEpConfig; got {type(config).__name__}", field="config", value=config)
        if backend not in TORCH_BACKENDS:
            raise ConfigError(
                f"backend must be one of the torch-based backends {TORCH_BACKENDS}; got {backend!r}",
                field="backend",
                value=backend,
            )
        if dtype not in PARAMETER_DTYPES:
            raise DTypeError(
                f"dtype of the expert parameters must be torch.bfloat16 or torch.float32; got {dtype}",
                name="dtype",
                expected="bfloat16, float32",
                got=dtype,
            )
        if host_sync is not None and not isinstance(host_sync, bool):
            raise ConfigError(f"host_sync must be None or a bool; got {type(host_sync).__name__}", field="host_sync",
                              value=host_sync)
        if host_sync is False and backend != "cuda-nccl":
            raise ConfigError(
                f"host_sync=False (the static-shape mode) needs backend 'cuda-nccl'; got backend {backend!r}",
                field="host_sync",
                value=host_sync,
            )
        fmt = None if weight_format is None else parse_format(weight_format)
        if fmt is MoeFormat.BF16:
            fmt = None  # bf16 weights are plain bfloat16 tensors: nothing to quantize
        if fmt is not None:
            block = _BLOCK[fmt]
            for name, extent in (("hidden", config.hidden), ("intermediate", config.intermediate)):
                if extent % block:
                    raise ConfigError(
                        f"weight_format {fmt.value} needs {name} to be a multiple of {block} (its scale block); "
                        f"got {name} = {extent}",
                        field=name,
                        value=extent,
                    )
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError(
                "MoeEpLayer needs an initialised torch.distributed process group (call dist.init_process_group "
                "first, or pass group=)",
                field="group",
            )
        group = dist.group.WORLD if group is None else group
        size = dist.get_world_size(group)
        if size != config.num_ranks:
            raise ConfigError(
                f"the process group's size must equal config.num_ranks = {config.num_ranks}; got {size}",
                field="num_ranks",
                value=size,
            )
        # The functional layer: the torch backend's own, or the one the backend
        # registered under that name provides (resolved now: fail here, not in forward).
        self._layer_op = _torch_layer(backend, host_sync)
        self.config = config
        self.group = group
        self.backend = backend
        self.weight_format = fmt
        self.host_sync = host_sync
        el, h, i = config.num_local_experts, config.hidden, config.intermediate
        self.fc1_weight = torch.nn.Parameter(torch.empty((el, h, 2 * i), dtype=dtype, device=device))
        self.fc2_weight = torch.nn.Parameter(torch.empty((el, i, h), dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Draw the weights as the spec's random layers do, keeping unit scale
        through every stage: FC1 ~ N(0, 1/hidden), FC2 ~ N(0, 1/intermediate)
        (float32 draws, then cast to the parameters' dtype)."""
        with torch.no_grad():
            for param, fan_in in ((self.fc1_weight, self.config.hidden), (self.fc2_weight, self.config.intermediate)):
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32, device=param.device)
                param.copy_(values / math.sqrt(fan_in))

    def _weights(self) -> tuple:
        """The weights handed to the functional op (see ``weight_format``)."""
        fc1, fc2 = self.fc1_weight, self.fc2_weight
        fmt = self.weight_format
        if fmt is None:
            return fc1, fc2
        if torch.is_grad_enabled() and (fc1.requires_grad or fc2.requires_grad):
            # Block-scaled along axis 1 (the reduction axis): quantize the transposed
            # weight along its last axis; straight-through gradient to the parameter.
            def fake_quant(w: Tensor) -> Tensor:
                w32 = w.float()
                q = round_trip(w32.transpose(1, 2), fmt).transpose(1, 2)
                return w32 + (q - w32).detach()

            return fake_quant(fc1), fake_quant(fc2)
        # The transposed weights ([E, 2I, H] and [E, H, I]) blocked along their last
        # axis, as moe_ep_torch.api.moe_ep takes block-scaled weights.
        return quantize(fc1.detach().float().transpose(1, 2), fmt), quantize(fc2.detach().float().transpose(1, 2), fmt)

    def forward(self, activation: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> "Tensor | TorchBlockScaled":
        """The layer on this rank's tokens (collective over :attr:`group`).

        Args:
            activation: ``[num_tokens, hidden]`` bfloat16/float16/float32: this
                rank's tokens (differentiable); on the parameters' device.
            topk_idx: ``[num_tokens, num_topk]`` int32/int64: the global expert
                ids each token goes to, in ``[-1, num_experts)``; -1 marks an
                unused slot, which contributes nothing.
            topk_weights: ``[num_tokens, num_topk]`` bfloat16/float16/float32:
                the router weight of each slot, read as float32 (differentiable:
                the router is trained through it).

        Returns:
            ``[num_tokens, hidden]`` bfloat16: every token's sum over its slots
            of router weight times expert output (differentiable), when
            ``config.output_format`` is bf16; otherwise a
            :class:`~moe_ep_torch.formats.TorchBlockScaled` of that shape (no
            autograd). Bad input raises the spec's errors
            (:mod:`moe_ep_spec.errors`) on every rank, except on ``cuda-nccl``'s
            default path (``host_sync=None`` with ``max_tokens_per_rank``: the
            device exchange, no host synchronisation), where a bad expert id makes
            the output NaN and ``moe_ep_cuda_nccl.api.check_errors`` raises it.
        """
        fc1, fc2 = self._weights()
        return self._layer_op(activation, fc1, fc2, topk_idx, topk_weights, config=self.config, group=self.group)

    def extra_repr(self) -> str:
        c = self.config
        fmt = "" if self.weight_format is None else f", weight_format={self.weight_format.value}"
        return (
            f"backend={self.backend!r}, num_experts={c.num_experts}, num_local_experts={c.num_local_experts}, "
            f"hidden={c.hidden}, intermediate={c.intermediate}, num_topk={c.num_topk}, num_ranks={c.num_ranks}, "
            f"output_format={c.output_format.value}{fmt}"
        )
