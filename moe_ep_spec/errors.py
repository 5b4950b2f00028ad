"""The one error hierarchy of moe-ep-spec.

Every error a conforming backend raises for bad input is a subclass of
:class:`MoeEpError`. The subclasses also derive from the matching builtin
(``ValueError``, ``TypeError``, ``LookupError`` ...) so callers that already
catch those keep working.

Messages follow one rule: name the rule, the value seen and what is allowed,
e.g. ``topk_idx must have shape (num_tokens, num_topk) = (64, 2); got (64, 3)``.
The offending values are also kept as attributes.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["MoeEpError", "ConfigError", "ShapeError", "DTypeError", "FormatError", "RoutingIndexError", "CapacityError",
           "StashError", "DeviceError", "CapabilityError", "BackendError", "BackendNotFoundError",
           "BackendUnavailableError", "NativeError", "NativeArgumentError", "TransportError", "MoeEpWarning"]


class MoeEpError(Exception):
    """Root of every error raised by moe-ep-spec and its backends."""


class ConfigError(MoeEpError, ValueError):
    """A :class:`~moe_ep_spec.MoeEpConfig` field breaks a rule of the spec.

    Attributes: ``field`` (the field name) and ``value`` (what was given).
    """

    def __init__(self, message: str, *, field: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value


class _NotAsExpected(MoeEpError):
    """An argument that is not what the spec expects (the base of ShapeError and
    DTypeError): ``name`` (the argument), ``expected`` and ``got``."""

    def __init__(self, message: str, *, name: str | None = None, expected: Any = None, got: Any = None) -> None:
        super().__init__(message)
        self.name = name
        self.expected = expected
        self.got = got


class ShapeError(_NotAsExpected, ValueError):
    """An array has the wrong number of dimensions or the wrong extent.

    Attributes: ``name`` (the argument), ``expected`` and ``got`` (shapes).
    """


class DTypeError(_NotAsExpected, TypeError):
    """An array has a dtype the spec does not allow for that argument.

    Attributes: ``name``, ``expected`` (the allowed dtypes, as text) and ``got``.
    """


class FormatError(MoeEpError, ValueError):
    """A block-scaled tensor is inconsistent (data and scale disagree, bad axis,
    unknown format name)."""


class RoutingIndexError(MoeEpError, ValueError):
    """``topk_idx`` holds an expert id outside ``[-1, num_experts)``.

    Attributes: ``rank`` (which rank's input, or None), ``position`` (the first
    offending ``(token, slot)``), ``value`` (the id found) and ``num_experts``.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        position: tuple[int, int] | None = None,
        value: int | None = None,
        num_experts: int | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.position = position
        self.value = value
        self.num_experts = num_experts


class CapacityError(MoeEpError, ValueError):
    """A static bound was exceeded: more tokens than ``max_tokens_per_rank``, or
    more received rows than ``recv_capacity``.

    Attributes: ``limit`` (the bound) and ``got`` (the count seen).
    """

    def __init__(self, message: str, *, limit: int | None = None, got: int | None = None) -> None:
        super().__init__(message)
        self.limit = limit
        self.got = got


class StashError(MoeEpError, ValueError):
    """The training stash handed to the backward does not match the forward's
    routing (``route_metadata`` rows differ from the plan of ``topk_idx``)."""


class DeviceError(MoeEpError, ValueError):
    """Inputs live on different devices, or on a device the backend cannot use."""


class CapabilityError(MoeEpError, NotImplementedError):
    """The backend does not support this feature; it declared so in its
    :class:`~moe_ep_spec.Capabilities`. Attribute ``feature`` names it."""

    def __init__(self, message: str, *, feature: str | None = None) -> None:
        super().__init__(message)
        self.feature = feature


class BackendError(MoeEpError):
    """Problems finding or loading a backend."""


class BackendNotFoundError(BackendError, LookupError):
    """No backend is registered under ``name``.

    Attributes: ``name``, ``registered`` (the names that are) and ``suggestion``
    (the closest registered name, or None).

    Optional ``origin`` says where the name came from when the caller did not
    pass it (``"the environment variable MOE_EP_BACKEND"``), and ``note`` adds a
    sentence (e.g. that ``MOE_EP_LOAD_PLUGINS`` restricts what was loaded).
    """

    def __init__(
        self,
        name: str,
        registered: Sequence[str],
        suggestion: str | None,
        *,
        origin: str | None = None,
        note: str | None = None,
    ) -> None:
        listing = ", ".join(sorted(registered)) or "(none)"
        source = f" (the name came from {origin})" if origin else ""
        message = f"no MoeEp backend named {name!r}{source}; registered backends: {listing}"
        if suggestion is not None:
            message += f". Did you mean {suggestion!r}?"
        if note:
            message += f". {note}"
        super().__init__(message)
        self.name = name
        self.registered = tuple(sorted(registered))
        self.suggestion = suggestion
        self.origin = origin
        self.note = note

    def __str__(self) -> str:  # LookupError would quote the message otherwise
        return str(self.args[0])

    def __reduce__(self) -> tuple:  # survive pickling between rank processes
        return (_rebuild_not_found, (type(self), self.name, self.registered, self.suggestion, self.origin, self.note))


class BackendUnavailableError(BackendError, RuntimeError):
    """The backend is registered but cannot run here. Attributes: ``name`` and
    ``reason`` (the backend's own explanation)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"MoeEp backend {name!r} is not available: {reason}")
        self.name = name
        self.reason = reason

    def __reduce__(self) -> tuple:  # survive pickling between rank processes
        return (type(self), (self.name, self.reason))


class NativeError(MoeEpError, RuntimeError):
    """A native kernel library (the C ABI of ``backends/native``) returned a
    failure status. Attributes: ``op`` (the entry point), ``status`` (the
    integer ``moe_ep_status``) and ``status_name`` (e.g. ``MOE_EP_ERR_CUDA``);
    the message is the library's own (rule, value seen, what is allowed)."""

    def __init__(self, message: str, *, op: str = "", status: int = 0, status_name: str = "") -> None:
        super().__init__(message)
        self.op = op
        self.status = status
        self.status_name = status_name

    def __reduce__(self) -> tuple:  # survive pickling between rank processes
        return (_rebuild_native_error, (type(self), self.args[0], self.op, self.status, self.status_name))


class NativeArgumentError(NativeError, ValueError):
    """The native library rejected an argument (``MOE_EP_ERR_INVALID_ARGUMENT``):
    a size, pointer, enum or index broke the rule its message states. Nothing
    was written."""


class TransportError(NativeError):
    """The native transport (NCCL) failed or timed out (``MOE_EP_ERR_COMM``):
    a peer that never joined or left, or an NCCL error. The communicator is
    unusable afterwards and is destroyed."""


class MoeEpWarning(UserWarning):
    """A setting that moe-ep-spec ignores but that is probably a mistake, such as a
    ``MOE_EP_LOAD_PLUGINS`` entry that names no installed plugin."""


def _rebuild_not_found(
    cls: type, name: str, registered: Sequence[str], suggestion: str | None, origin: str | None, note: str | None
) -> BackendNotFoundError:
    return cls(name, registered, suggestion, origin=origin, note=note)


def _rebuild_native_error(cls: type, message: str, op: str, status: int, status_name: str) -> NativeError:
    return cls(message, op=op, status=status, status_name=status_name)
