"""What a MoeEp backend is: a name, a version, declared capabilities, an
availability check, and the six operations of the spec.

A backend runs in one of two launch models (:class:`Launch`):

``world``
    One process simulates (or drives) every rank. The backend implements the
    world-level methods, which take one entry per rank and return one result per
    rank: :meth:`MoeEpBackend.forward`, :meth:`~MoeEpBackend.backward`,
    :meth:`~MoeEpBackend.dispatch`, :meth:`~MoeEpBackend.combine`,
    :meth:`~MoeEpBackend.dispatch_backward`, :meth:`~MoeEpBackend.combine_backward`.
``process-per-rank``
    Each rank is its own process (torch.distributed, NCCL, ...). The backend
    implements the ``*_rank`` methods, which a harness calls in every rank's
    process with a :class:`~moe_ep_spec.api.RankContext` and that rank's inputs.

The world-level methods are the interface the conformance suite calls; for a
process-per-rank backend the suite's harness starts the processes and calls the
``*_rank`` methods. A method of the other model raises :class:`CapabilityError`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from importlib import metadata
from typing import FrozenSet, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .api import (BackwardResult, DispatchGrads, DispatchHandle, DispatchInputs, DispatchResult, ForwardResult,
                  RankContext, RankInputs, Stash, Tensor)
from .config import MoeEpConfig
from .errors import CapabilityError
from .formats import MoeFormat

__all__ = ["Launch", "Capabilities", "Availability", "MoeEpBackend", "installed_version", "release",
           "installed_availability"]


def installed_version(distribution: str) -> Optional[str]:
    """The installed version of ``distribution`` (e.g. ``2.5.1+cpu``), read from
    its metadata without importing it; None when not installed (for a backend's
    quick availability check)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> Tuple[int, ...]:
    """The leading numbers of a version string: ``"2.5.1+cpu"`` -> ``(2, 5, 1)``."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(x) for x in m.group(0).split(".")) if m else ()


def installed_availability(module: str, minimum: Tuple[int, ...], lacks: str) -> "Availability":
    """A backend's quick check of its framework from what is installed, importing
    nothing: ``module`` found and, when its distribution's version is known, at
    least ``minimum``; else why not (``lacks``: what an older version misses)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        return Availability(False, f"{module} is not installed (pip install {module})")
    version = installed_version(module)
    if version is not None and release(version) < minimum:
        need = ".".join(str(x) for x in minimum)
        return Availability(False, f"{module} {version} {lacks} (need {module} >= {need})")
    return Availability(True)


class Launch(str, enum.Enum):
    """How a backend's ranks run."""

    WORLD = "world"
    PROCESS_PER_RANK = "process-per-rank"

    def __str__(self) -> str:
        return self.value


_ALL_FORMATS: FrozenSet[MoeFormat] = frozenset(MoeFormat)


@dataclass(frozen=True)
class Capabilities:
    """What a backend supports. Anything not declared here must work.

    Attributes:
        formats: formats supported for ``output_format``, ``combine_format`` and
            ``intermediate_format``.
        input_formats: encodings accepted for activation and weights (bf16 stands
            for every plain float dtype; mxfp8/nvfp4 for block-scaled inputs).
        backward: the spec backward is implemented.
        generate_c: the forward can return the training stash.
        layered: ``dispatch``/``combine`` (and their backward) are implemented.
        static_layout: ``recv_capacity``/``expert_alignment`` are honoured.
        dynamic_layout: ``recv_capacity=None`` works (a static-shape backend may
            need ``recv_capacity`` or ``max_tokens_per_rank``).
        intermediate_format: ``intermediate_format`` other than None works.
        devices: device kinds the backend runs on (``"cpu"``, ``"cuda"``).
        launch: the :class:`Launch` model.
        num_ranks: the EP sizes supported, or None for any.
    """

    formats: FrozenSet[MoeFormat] = _ALL_FORMATS
    input_formats: FrozenSet[MoeFormat] = _ALL_FORMATS
    backward: bool = True
    generate_c: bool = True
    layered: bool = True
    static_layout: bool = True
    dynamic_layout: bool = True
    intermediate_format: bool = True
    devices: Tuple[str, ...] = ("cpu",)
    launch: Launch = Launch.WORLD
    num_ranks: Optional[Tuple[int, ...]] = None

    def unsupported(
        self, config: MoeEpConfig, operation: str = "forward", input_formats: Iterable[MoeFormat] = ()
    ) -> Optional[str]:
        """Why ``config`` cannot run ``operation`` here, as ``"capability: ..."``
        text, or None when it can. ``operation`` is one of ``forward``,
        ``backward``, ``dispatch``, ``combine``, ``dispatch_backward``,
        ``combine_backward``; ``input_formats`` are the encodings of the inputs
        (bf16 standing for any plain float array)."""
        for fmt in input_formats:
            if fmt not in self.input_formats:
                return f"capability: {fmt.value} inputs not supported"
        if self.num_ranks is not None and config.num_ranks not in self.num_ranks:
            return f"capability: num_ranks {config.num_ranks} not in {sorted(self.num_ranks)}"
        for name in ("output_format", "combine_format", "intermediate_format"):
            fmt = getattr(config, name)
            if fmt is not None and fmt not in self.formats:
                return f"capability: {name} {fmt.value} not supported"
        if config.intermediate_format is not None and not self.intermediate_format:
            return "capability: intermediate_format not supported"
        if operation == "backward" and not self.backward:
            return "capability: backward not supported"
        if operation in ("forward", "backward") and config.generate_c and not self.generate_c:
            return "capability: generate_c (training stash) not supported"
        if operation in ("dispatch", "combine", "dispatch_backward", "combine_backward") and not self.layered:
            return "capability: layered dispatch/combine not supported"
        if config.static_layout and not self.static_layout:
            return "capability: static layout (recv_capacity) not supported"
        if not config.static_layout and not self.dynamic_layout:
            return "capability: dynamic layout (recv_capacity=None) not supported"
        return None

    def as_dict(self) -> dict:
        """A JSON-friendly view (for reports and ``moe-ep backends``)."""
        return {
            "formats": sorted(f.value for f in self.formats),
            "input_formats": sorted(f.value for f in self.input_formats),
            "backward": self.backward,
            "generate_c": self.generate_c,
            "layered": self.layered,
            "static_layout": self.static_layout,
            "dynamic_layout": self.dynamic_layout,
            "intermediate_format": self.intermediate_format,
            "devices": list(self.devices),
            "launch": self.launch.value,
            "num_ranks": None if self.num_ranks is None else list(self.num_ranks),
        }


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here; ``reason`` says why not. Truthy when available."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available


class MoeEpBackend:
    """Base class of every backend. Subclasses set ``name``, ``version`` and
    ``capabilities``, override :meth:`availability` when they can be unavailable,
    and implement the methods of their launch model.

    Every method validates its inputs with the spec's rules before computing
    (see :mod:`moe_ep_spec.validation`) and never modifies them.

    Attributes:
        name: the registry name (lowercase, ``[a-z0-9_-]``).
        version: the backend's version string.
        capabilities: the :class:`Capabilities`.
        distribution: the installed distribution that provided it (set by the
            registry for entry-point plugins).
    """

    name: str = ""
    version: str = "0"
    capabilities: Capabilities = Capabilities()
    distribution: Optional[str] = None

    def availability(self) -> Availability:
        """Whether this backend can run on this machine, with the reason if not.
        Must be cheap and must not raise."""
        return Availability(True)

    def quick_availability(self) -> Availability:
        """What ``moe-ep backends`` shows: whether this backend can run here,
        judged without importing a framework (torch, jax) or starting a device
        runtime, so that listing backends stays fast. The default is
        :meth:`availability`; a backend whose full check imports its framework
        overrides this with a check of what is installed (``find_spec``,
        distribution versions, a native library's build flags). Must not raise."""
        return self.availability()

    def is_available(self) -> bool:
        return bool(self.availability())

    def framework_versions(self) -> dict:
        """Versions of the frameworks the backend runs on, for reports."""
        return {"numpy": np.__version__}

    # ------------------------------------------------------------- world model

    def forward(self, config: MoeEpConfig, inputs: Sequence[RankInputs]) -> List[ForwardResult]:
        """The fused forward over a whole world.

        Args:
            config: the layer configuration.
            inputs: one :class:`RankInputs` per rank (length ``num_ranks``).

        Returns:
            one :class:`ForwardResult` per rank; ``fc1_c`` and ``route_metadata``
            are set exactly when ``config.generate_c``.
        """
        raise self._wrong_launch("forward")

    def backward(self, config: MoeEpConfig, inputs: Sequence[RankInputs], grad_output: Sequence[np.ndarray],
                 stash: Sequence[Stash]) -> List[BackwardResult]:
        """The spec backward over a whole world.

        Args:
            config: the configuration of the forward.
            inputs: the forward's inputs, one per rank.
            grad_output: one ``[T, H]`` float32/float16/bfloat16 cotangent per rank.
            stash: one :class:`Stash` per rank, as the forward returned it.
        """
        raise self._wrong_launch("backward")

    def dispatch(self, config: MoeEpConfig, inputs: Sequence[DispatchInputs]) -> List[DispatchResult]:
        """Layered dispatch over a whole world: one :class:`DispatchInputs` per
        rank in, one :class:`DispatchResult` per rank out."""
        raise self._wrong_launch("dispatch")

    def combine(
        self, config: MoeEpConfig, handles: Sequence[DispatchHandle], expert_out: Sequence[np.ndarray]
    ) -> List[Tensor]:
        """Layered combine over a whole world.

        Args:
            handles: the handles ``dispatch`` returned, one per rank.
            expert_out: one ``[R, H]`` float array per rank (rows as dispatched;
                padding rows are never read).

        Returns:
            one ``[T, H]`` output per rank in ``config.output_format``: the
            unweighted Form-A sum of every token's routes.
        """
        raise self._wrong_launch("combine")

    def dispatch_backward(self, config: MoeEpConfig, handles: Sequence[DispatchHandle],
                          grad_tokens: Sequence[np.ndarray],
                          grad_topk_weights: Sequence[np.ndarray]) -> List[DispatchGrads]:
        """Backward of dispatch (a combine of the cotangents): ``[R, H]`` and
        ``[R]`` float cotangents per rank in, :class:`DispatchGrads` per rank out."""
        raise self._wrong_launch("dispatch_backward")

    def combine_backward(
        self, config: MoeEpConfig, handles: Sequence[DispatchHandle], grad_output: Sequence[np.ndarray]
    ) -> List[np.ndarray]:
        """Backward of combine (a dispatch of the cotangent): ``[T, H]`` float per
        rank in, ``[R, H]`` float32 per rank out (padding rows zero)."""
        raise self._wrong_launch("combine_backward")

    # ------------------------------------------------------ process-per-rank model

    def forward_rank(self, config: MoeEpConfig, ctx: RankContext, inputs: RankInputs) -> ForwardResult:
        """The fused forward for the rank ``ctx.rank``; collective over ``ctx``."""
        raise self._wrong_launch("forward_rank")

    def backward_rank(
        self, config: MoeEpConfig, ctx: RankContext, inputs: RankInputs, grad_output: np.ndarray, stash: Stash
    ) -> BackwardResult:
        """The spec backward for one rank; collective."""
        raise self._wrong_launch("backward_rank")

    def dispatch_rank(self, config: MoeEpConfig, ctx: RankContext, inputs: DispatchInputs) -> DispatchResult:
        """Layered dispatch for one rank; collective."""
        raise self._wrong_launch("dispatch_rank")

    def combine_rank(
        self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, expert_out: np.ndarray
    ) -> Tensor:
        """Layered combine for one rank; collective."""
        raise self._wrong_launch("combine_rank")

    def dispatch_backward_rank(self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle,
                               grad_tokens: np.ndarray, grad_topk_weights: np.ndarray) -> DispatchGrads:
        """Backward of dispatch for one rank; collective."""
        raise self._wrong_launch("dispatch_backward_rank")

    def combine_backward_rank(
        self, config: MoeEpConfig, ctx: RankContext, handle: DispatchHandle, grad_output: np.ndarray
    ) -> np.ndarray:
        """Backward of combine for one rank; collective."""
        raise self._wrong_launch("combine_backward_rank")

    # ----------------------------------------------------------------- helpers

    def require(self, config: MoeEpConfig, operation: str) -> None:
        """Raise :class:`CapabilityError` if ``config`` cannot run ``operation``."""
        reason = self.capabilities.unsupported(config, operation)
        if reason is not None:
            raise CapabilityError(f"backend {self.name!r}: {reason}", feature=operation)

    def _wrong_launch(self, method: str) -> CapabilityError:
        return CapabilityError(
            f"backend {self.name!r} runs with launch model {self.capabilities.launch.value!r} and does not "
            f"implement {method}()",
            feature=method,
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} version={self.version!r}>"

