"""``example-loopback``: the shared reference, one process per rank.

A harness (``moe_ep_spec.launch.call_world``, hence ``moe-ep run`` and
``moe-ep conformance``) starts one process per rank and calls the ``*_rank``
method of the operation in each of them with a :class:`~moe_ep_spec.RankContext`.
The ranks then meet on loopback and rank 0 computes the whole world with the
reference (see :mod:`moe_ep_example.exchange`), so the results are bit for bit
the reference's and every error is the reference's error, raised on every rank.

Shapes use the project vocabulary: ``T`` = num_tokens of the rank, ``H`` =
hidden, ``I`` = intermediate, ``K`` = num_topk, ``E_local`` = num_local_experts,
``R`` = rows received by the rank.

This module imports ``moe_ep_spec`` and the standard library only; the exchange
(and with it ``multiprocessing.connection``) is imported when a rank runs.
"""

from __future__ import annotations

import os
import platform
import socket
from typing import Any, Dict, Optional

import numpy as np

import moe_ep_spec
from moe_ep_spec import (
    Availability,
    BackwardResult,
    Capabilities,
    DispatchGrads,
    DispatchHandle,
    DispatchInputs,
    DispatchResult,
    ForwardResult,
    Launch,
    MoeEpBackend,
    MoeEpConfig,
    RankContext,
    RankInputs,
    Stash,
    Tensor,
)

from moe_ep_spec.registry import ENV_LOAD_PLUGINS

from . import __version__

__all__ = ["ExampleLoopbackBackend"]


class ExampleLoopbackBackend(MoeEpBackend):
    """The reference behind a real process-per-rank exchange on loopback.

    Supports what the reference supports (every format, the stash, the backward,
    the layered primitives in both layouts, any EP size) on the CPU, with launch
    model :attr:`~moe_ep_spec.Launch.PROCESS_PER_RANK`: it implements the
    ``*_rank`` methods only, and the world-level methods raise
    :class:`~moe_ep_spec.CapabilityError` (run it through
    :func:`moe_ep_spec.launch.call_world`).

    Args:
        authkey: the key the ranks authenticate each other with. Default: 32
            random bytes, which travel with the backend object when the harness
            pickles it into the rank processes. ``$MOE_EP_EXAMPLE_AUTHKEY``
            overrides it (for harnesses whose rank processes build their own
            backend objects).

    Attributes:
        name: ``"example-loopback"``.
        version: the distribution's version (``moe_ep_example.__version__``).
        capabilities: everything, ``launch=process-per-rank``, ``devices=("cpu",)``.
    """

    name = "example-loopback"
    version = __version__
    capabilities = Capabilities(launch=Launch.PROCESS_PER_RANK, devices=("cpu",))

    def __init__(self, authkey: Optional[bytes] = None) -> None:
        if authkey is not None and not isinstance(authkey, bytes):
            raise TypeError(f"authkey must be bytes or None; got {type(authkey).__name__}")
        self._authkey = authkey if authkey else os.urandom(32)

    # ------------------------------------------------------------------ checks

    def availability(self) -> Availability:
        """Available when the ``reference`` backend is registered and available in
        this process (rank 0 runs it) and a loopback TCP socket can be opened.
        Never raises."""
        try:
            registry = moe_ep_spec.get_registry()
            if "reference" not in registry.names():
                return Availability(
                    False,
                    "needs the 'reference' backend of moe-ep-spec, which is not registered "
                    f"(does ${ENV_LOAD_PLUGINS} leave it out?)",
                )
            reference = registry.get_backend("reference", require_available=False)
            ref_availability = reference.availability()
            if not ref_availability:
                return Availability(False, f"the 'reference' backend is unavailable: {ref_availability.reason}")
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
        except OSError as exc:
            return Availability(False, f"cannot open a TCP socket on 127.0.0.1: {exc}")
        except Exception as exc:  # noqa: BLE001 - availability() must never raise
            return Availability(False, f"availability check failed: {type(exc).__name__}: {exc}")
        return Availability(True)

    def framework_versions(self) -> Dict[str, str]:
        """The versions this backend runs on: numpy, ml_dtypes, moe-ep-spec (whose
        reference does the numerics) and Python."""
        versions = {
            "numpy": np.__version__,
            "moe-ep-spec": moe_ep_spec.__version__,
            "python": platform.python_version(),
        }
        try:
            import ml_dtypes

            versions["ml_dtypes"] = ml_dtypes.__version__
        except Exception as exc:  # noqa: BLE001 - a report header must not fail
            versions["ml_dtypes"] = f"unavailable ({type(exc).__name__})"
        return versions

    def _run(self, operation: str, config: MoeEpConfig, ctx: RankContext, *args: Any) -> Any:
        """Check ``ctx`` against ``config`` and the capabilities, then exchange."""
        self.require(config, operation)
        if not isinstance(ctx, RankContext):
            raise TypeError(f"ctx must be a moe_ep_spec.RankContext; got {type(ctx).__name__}")
        if ctx.num_ranks != config.num_ranks:
            raise moe_ep_spec.ConfigError(
                f"ctx.num_ranks must equal config.num_ranks = {config.num_ranks}; got {ctx.num_ranks}",
                field="num_ranks",
                value=ctx.num_ranks,
            )
        if not 0 <= ctx.rank < ctx.num_ranks:
            raise moe_ep_spec.ConfigError(
                f"ctx.rank must be in [0, num_ranks) = [0, {ctx.num_ranks}); got {ctx.rank}", field="rank", value=ctx.rank
            )
        if ctx.device != "cpu" and not ctx.device.startswith("cpu:"):
            raise moe_ep_spec.DeviceError(
                f"backend {self.name!r} runs on devices {list(self.capabilities.devices)}; rank {ctx.rank} got "
                f"device {ctx.device!r}"
            )
        from .exchange import exchange, resolve_key

        return exchange(ctx, resolve_key(self._authkey), operation, config, tuple(args))

    # ------------------------------------------------------ process-per-rank model

    def forward_rank(self, config: MoeEpConfig, ctx: RankContext, inputs: RankInputs) -> ForwardResult:
        """The fused forward for rank ``ctx.rank``; collective over the world of ``ctx``.

        Args:
            config: the layer configuration (the same on every rank).
            ctx: this rank's :class:`~moe_ep_spec.RankContext`; ``ctx.num_ranks``
                must equal ``config.num_ranks``.
            inputs: this rank's :class:`~moe_ep_spec.RankInputs`:
                ``[T, H] float32/float16/bfloat16 or block-scaled``: activation,
                ``[E_local, H, 2I]``: fc1_weight, ``[E_local, I, H]``: fc2_weight,
                ``[T, K] int32/int64``: topk_idx, ``[T, K] float``: topk_weights.

        Returns:
            this rank's :class:`~moe_ep_spec.ForwardResult`: ``[T, H]`` output in
            ``config.output_format``; with ``config.generate_c`` also
            ``[R, 2I] bfloat16``: fc1_c and ``[R, 4] int32``: route_metadata.

        Raises:
            MoeEpError: what the reference raises for the world's inputs (on
                every rank, with the same type), or
                :class:`~moe_ep_example.exchange.ExchangeError` when the ranks
                cannot meet.
        """
        return self._run("forward", config, ctx, inputs)

    def backward_rank(
        self, config: MoeEpConfig, ctx: RankContext, inputs: RankInputs, grad_output: np.ndarray, stash: Stash
    ) -> BackwardResult:
        """The spec backward for rank ``ctx.rank``; collective.

        Args:
            config: the configuration of the forward.
            ctx: this rank's context.
            inputs: this rank's forward inputs (see :meth:`forward_rank`).
            grad_output: ``[T, H] float32/float16/bfloat16``: the cotangent of the
                rank's output.
            stash: this rank's :class:`~moe_ep_spec.Stash` from the forward:
                ``[R, 2I] bfloat16``: fc1_c, ``[R, 4] int32``: route_metadata.

        Returns:
            this rank's :class:`~moe_ep_spec.BackwardResult`, all float32:
            ``[T, H]``: grad_activation, ``[E_local, H, 2I]``: grad_fc1_weight,
            ``[E_local, I, H]``: grad_fc2_weight, ``[T, K]``: grad_topk_weights.
        """
        return self._run("backward", config, ctx, inputs, grad_output, stash)

    def dispatch_rank(self, config: MoeEpConfig, ctx: RankContext, inputs: DispatchInputs) -> DispatchResult:
        """Layered dispatch for rank ``ctx.rank``; collective.

        Args:
            config: the layer configuration.
            ctx: this rank's context.
            inputs: this rank's :class:`~moe_ep_spec.DispatchInputs`:
                ``[T, H] float or block-scaled``: tokens, ``[T, K] int32/int64``:
                topk_idx, ``[T, K] float``: topk_weights.

        Returns:
            this rank's :class:`~moe_ep_spec.DispatchResult`: ``[R, H]`` tokens
            (the input encoding), ``[R] float32``: topk_weights, and the
            :class:`~moe_ep_spec.DispatchHandle` for the other layered calls.
        """
        return self._run("dispatch", config, ctx, inputs)

    def combine_rank(
        self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, expert_out: np.ndarray
    ) -> Tensor:
        """Layered combine for rank ``ctx.rank``; collective.

        Args:
            config: the layer configuration.
            ctx: this rank's context.
            handle: this rank's :class:`~moe_ep_spec.DispatchHandle` from
                :meth:`dispatch_rank`.
            expert_out: ``[R, H] float``: the expert output of every received row
                (padding rows are never read).

        Returns:
            ``[T, H]`` in ``config.output_format``: the unweighted sum of every
            token's routes.
        """
        return self._run("combine", config, ctx, handle, expert_out)

    def dispatch_backward_rank(self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle,
                               grad_tokens: np.ndarray, grad_topk_weights: np.ndarray) -> DispatchGrads:
        """Backward of dispatch for rank ``ctx.rank``; collective.

        Args:
            config: the layer configuration.
            ctx: this rank's context.
            handle: this rank's handle from :meth:`dispatch_rank`.
            grad_tokens: ``[R, H] float``: the cotangent of the received rows.
            grad_topk_weights: ``[R] float``: the cotangent of the received weights.

        Returns:
            this rank's :class:`~moe_ep_spec.DispatchGrads`: ``[T, H] float32``:
            grad_tokens, ``[T, K] float32``: grad_topk_weights.
        """
        return self._run("dispatch_backward", config, ctx, handle, grad_tokens, grad_topk_weights)

    def combine_backward_rank(
        self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, grad_output: np.ndarray
    ) -> np.ndarray:
        """Backward of combine for rank ``ctx.rank``; collective.

        Args:
            config: the layer configuration.
            ctx: this rank's context.
            handle: this rank's handle from :meth:`dispatch_rank`.
            grad_output: ``[T, H] float``: the cotangent of the combined output.

        Returns:
            ``[R, H] float32``: the cotangent of every received row (padding rows zero).
        """
        return self._run("combine_backward", config, ctx, handle, grad_output)

    def __repr__(self) -> str:  # never show the key
        return f"<{type(self).__name__} name={self.name!r} version={self.version!r}>"
