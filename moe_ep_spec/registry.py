"""The backend registry: owns the list of backends and the plugin manager.

Backends arrive through the entry-point group ``moe_ep_spec.backends`` (the
project's own ones included) or, in-process, through :func:`register_backend`.

Environment:
    ``MOE_EP_BACKEND``: the backend :func:`get_backend` returns when no name is
        given (default ``reference``).
    ``MOE_EP_LOAD_PLUGINS``: a comma-separated allow-list of entry-point names or
        distribution names to load. Unset: load every installed plugin. Empty:
        load none (in-process registrations still work). An entry that names no
        installed plugin is reported: a :class:`~moe_ep_spec.errors.MoeEpWarning`
        when the plugins load, :meth:`Registry.unmatched_plugins`, and an error
        (exit status 2) from ``moe-ep backends``.

A plugin that fails to import or to register is recorded as a
:class:`PluginFailure` (entry-point name, distribution, exception) and the others
load normally; ``moe-ep backends`` prints the failures.
"""

from __future__ import annotations

import difflib
import os
import re
import threading
import traceback
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Dict, List, Mapping, Optional, Tuple

import pluggy

from . import hookspecs
from .backend import MoeEpBackend
from .errors import BackendNotFoundError, BackendUnavailableError, MoeEpWarning

__all__ = [
    "DEFAULT_BACKEND",
    "InstalledPlugin",
    "ENV_BACKEND",
    "ENV_LOAD_PLUGINS",
    "PluginFailure",
    "Registry",
    "get_registry",
    "get_backend",
    "list_backends",
    "plugin_failures",
    "register_backend",
]

DEFAULT_BACKEND = "reference"
ENV_BACKEND = "MOE_EP_BACKEND"
ENV_LOAD_PLUGINS = "MOE_EP_LOAD_PLUGINS"
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")


def _normalize(name: str) -> str:
    """Distribution names compare as PEP 503 normalises them (``moe_ep.spec`` == ``moe-ep-spec``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded or registered.

    Attributes:
        name: the entry-point name (or the plugin's name for in-process plugins).
        distribution: the distribution that declared it, if known.
        stage: ``"import"`` (loading the entry point failed) or ``"register"``
            (its hook raised, or it registered an invalid or duplicate backend).
        exception: the exception raised.
        traceback: the formatted traceback.
    """

    name: str
    distribution: Optional[str]
    stage: str
    exception: BaseException
    traceback: str = ""

    def __str__(self) -> str:
        dist = f" (distribution {self.distribution})" if self.distribution else ""
        return f"plugin {self.name!r}{dist} failed at {self.stage}: {type(self.exception).__name__}: {self.exception}"


@dataclass(frozen=True)
class InstalledPlugin:
    """An installed entry point of the group ``moe_ep_spec.backends``.

    Attributes:
        name: the entry-point name.
        distribution: the distribution that declares it, if known.
    """

    name: str
    distribution: Optional[str]

    def __str__(self) -> str:
        return f"{self.name} ({self.distribution})" if self.distribution else self.name


class Registry:
    """Owns the plugin manager and the registered backends.

    Args:
        load_entry_points: load the installed entry points on first use.
        environ: the environment to read ``MOE_EP_*`` from (default ``os.environ``).
    """

    def __init__(self, *, load_entry_points: bool = True, environ: Optional[Mapping[str, str]] = None) -> None:
        self._environ = os.environ if environ is None else environ
        self._load_entry_points = load_entry_points
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._backends: Dict[str, MoeEpBackend] = {}
        self._sources: Dict[str, str] = {}
        self._failures: List[PluginFailure] = []
        self._installed: List[InstalledPlugin] = []
        self._unmatched: Tuple[str, ...] = ()
        self._loaded = False
        self._lock = threading.RLock()

    # ----------------------------------------------------------------- loading

    def _ensure_loaded(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if self._load_entry_points:
                self._load_installed()

    def _allowed(self) -> Optional[Dict[str, str]]:
        """The allow-list of ``MOE_EP_LOAD_PLUGINS``, normalised name -> as written; None when unset."""
        raw = self._environ.get(ENV_LOAD_PLUGINS)
        if raw is None:
            return None
        return {_normalize(part.strip()): part.strip() for part in raw.split(",") if part.strip()}

    def _load_installed(self) -> None:
        allowed = self._allowed()
        matched = set()
        for ep in sorted(metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(getattr(ep, "dist", None), "name", None)
            self._installed.append(InstalledPlugin(ep.name, dist))
            keys = {_normalize(ep.name)} | ({_normalize(dist)} if dist is not None else set())
            if allowed is not None:
                matched |= keys & set(allowed)
                if not keys & set(allowed):
                    continue
            try:
                plugin = ep.load()
            except BaseException as exc:  # noqa: BLE001 - a broken plugin must not break the others
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                self._failures.append(PluginFailure(ep.name, dist, "import", exc, traceback.format_exc()))
                continue
            self._register_plugin(plugin, ep.name, dist)
        if allowed is not None:
            self._unmatched = tuple(written for key, written in allowed.items() if key not in matched)
            if self._unmatched:
                warnings.warn(self._unmatched_message(), MoeEpWarning, stacklevel=4)

    def _unmatched_message(self) -> str:
        entries = ", ".join(repr(u) for u in self._unmatched)
        installed = ", ".join(str(p) for p in self._installed) or "(none)"
        return (
            f"{ENV_LOAD_PLUGINS} names {entries}, which matches no installed plugin (entries are entry-point or "
            f"distribution names); installed plugins: {installed}"
        )

    def _register_plugin(self, plugin: Any, name: str, dist: Optional[str]) -> None:
        try:
            self._pm.register(plugin, name=name)
        except BaseException as exc:  # noqa: BLE001
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self._failures.append(PluginFailure(name, dist, "register", exc, traceback.format_exc()))
            return
        for impl in self._pm.hook.register_backends.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                impl.function(register=lambda backend, _n=name, _d=dist: self._add(backend, _n, _d))
            except BaseException as exc:  # noqa: BLE001
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                self._failures.append(PluginFailure(name, dist, "register", exc, traceback.format_exc()))

    def _add(self, backend: Any, source: str, dist: Optional[str]) -> None:
        if not isinstance(backend, MoeEpBackend):
            raise TypeError(f"register() takes a moe_ep_spec.MoeEpBackend instance; got {type(backend).__name__}")
        name = backend.name
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"backend name must match {_NAME_RE.pattern} (lowercase); got {name!r}")
        if name in self._backends:
            raise ValueError(f"backend name {name!r} is already registered by {self._sources[name]!r}")
        if dist is not None and backend.distribution is None:
            backend.distribution = dist
        self._backends[name] = backend
        self._sources[name] = source

    # ------------------------------------------------------------------ public

    def register_plugin(self, plugin: Any, name: Optional[str] = None) -> None:
        """Register an in-process pluggy plugin (a module or object with a
        ``register_backends`` hookimpl). Failures are raised, not recorded."""
        with self._lock:
            self._ensure_loaded()
            before = len(self._failures)
            self._register_plugin(plugin, name or getattr(plugin, "__name__", repr(plugin)), None)
            if len(self._failures) > before:
                raise self._failures.pop().exception

    def register(self, backend: MoeEpBackend, *, source: str = "in-process") -> MoeEpBackend:
        """Register one backend object in-process; raises on an invalid or
        duplicate name. Returns the backend."""
        with self._lock:
            self._ensure_loaded()
            self._add(backend, source, None)
            return backend

    def unregister(self, name: str) -> None:
        """Remove a backend registered under ``name`` (no error if absent)."""
        with self._lock:
            self._backends.pop(name, None)
            self._sources.pop(name, None)

    def names(self) -> List[str]:
        self._ensure_loaded()
        return sorted(self._backends)

    def list_backends(self) -> List[MoeEpBackend]:
        """Every registered backend, available or not, sorted by name."""
        self._ensure_loaded()
        return [self._backends[n] for n in sorted(self._backends)]

    def failures(self) -> Tuple[PluginFailure, ...]:
        """Plugins that failed to load or register."""
        self._ensure_loaded()
        return tuple(self._failures)

    def installed_plugins(self) -> Tuple[InstalledPlugin, ...]:
        """Every installed entry point of the group, loaded or not (empty when
        the registry does not load entry points)."""
        self._ensure_loaded()
        return tuple(self._installed)

    def unmatched_plugins(self) -> Tuple[str, ...]:
        """The ``MOE_EP_LOAD_PLUGINS`` entries, as written, that name no installed
        plugin (empty when the variable is unset or every entry matched)."""
        self._ensure_loaded()
        return self._unmatched

    def unmatched_plugins_message(self) -> str:
        """A sentence naming :meth:`unmatched_plugins` and the installed plugins
        (empty when there are none)."""
        self._ensure_loaded()
        return self._unmatched_message() if self._unmatched else ""

    def source(self, name: str) -> str:
        """The entry point (or ``in-process``) that registered ``name``."""
        self._ensure_loaded()
        return self._sources[name]

    def default_name(self) -> str:
        """``$MOE_EP_BACKEND`` or ``reference``."""
        return self._environ.get(ENV_BACKEND) or DEFAULT_BACKEND

    def get_backend(self, name: Optional[str] = None, *, require_available: bool = True) -> MoeEpBackend:
        """The backend registered as ``name`` (default: :meth:`default_name`).

        Raises:
            BackendNotFoundError: no such name; the error lists the registered
                names and suggests the closest one.
            BackendUnavailableError: ``require_available`` and the backend says it
                cannot run here; the error carries its reason.
        """
        self._ensure_loaded()
        origin = None
        if name is None:
            name = self.default_name()
            if self._environ.get(ENV_BACKEND):
                origin = f"the environment variable {ENV_BACKEND}"
        backend = self._backends.get(name)
        if backend is None:
            names = sorted(self._backends)
            close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.6)
            note = None
            raw = self._environ.get(ENV_LOAD_PLUGINS)
            if raw is not None and self._load_entry_points:
                parts = []
                if any(p.name == name for p in self._installed):
                    parts.append(
                        f"{ENV_LOAD_PLUGINS}={raw!r} loads only the installed plugins it names, and the installed "
                        f"plugin {name!r} is not among them"
                    )
                if self._unmatched:
                    parts.append(self._unmatched_message())
                note = "; ".join(parts) or None
            raise BackendNotFoundError(name, names, close[0] if close else None, origin=origin, note=note)
        if require_available:
            availability = backend.availability()
            if not availability:
                raise BackendUnavailableError(name, availability.reason)
        return backend


_registry: Optional[Registry] = None
_registry_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry (created, and its plugins loaded, on first use)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = Registry()
        return _registry


def get_backend(name: Optional[str] = None, *, require_available: bool = True) -> MoeEpBackend:
    """Look a backend up by name in the process-wide registry; see :meth:`Registry.get_backend`."""
    return get_registry().get_backend(name, require_available=require_available)


def list_backends() -> List[MoeEpBackend]:
    """Every backend in the process-wide registry, sorted by name."""
    return get_registry().list_backends()


def plugin_failures() -> Tuple[PluginFailure, ...]:
    """Plugins of the process-wide registry that failed to load."""
    return get_registry().failures()


def register_backend(backend: MoeEpBackend) -> MoeEpBackend:
    """Register ``backend`` in the process-wide registry, in-process."""
    return get_registry().register(backend)
