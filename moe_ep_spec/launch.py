"""Run a backend's operation over a whole world, whatever its launch model.

World backends are called directly. Process-per-rank backends run in a
:class:`RankPool`: one local process per rank (``multiprocessing``, ``spawn``
start method), started once and reused for later calls with the same backend,
EP size and devices, all sharing one rendezvous address on loopback
(``tcp://127.0.0.1:PORT``) and so one :class:`~moe_ep_spec.api.RankContext` per
rank. A backend may therefore set up its communicator on the first call and
keep it (keyed by ``ctx.rendezvous``). Each call sends every rank its
arguments; each rank calls the backend's ``<operation>_rank`` method; the
results come back in rank order.

A rank that raises makes :func:`call_world` raise the same exception (or, when
the exception cannot be pickled, a :class:`RankFailure` with its type, message
and traceback). Backends that share an input error with every rank (so that
all raise together instead of leaving the others in a collective) mark the
copies raised on the other ranks with ``exc.moe_ep_peer_error = True``; the
originating rank's exception is the one raised. When every rank answered, the
pool stays up; when some did not (a hang, a crash, a rank left waiting in a
collective), it is stopped and the next call starts a fresh one. A rank that
hangs or dies is reported as :class:`RankTimeoutError` / :class:`RankCrashError`.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import pickle
import socket
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .api import RankContext
from .backend import Launch, MoeEpBackend
from .config import MoeEpConfig
from .errors import BackendError
from .validation import validate_world

__all__ = [
    "OPERATIONS",
    "RankFailure",
    "RankTimeoutError",
    "RankCrashError",
    "RankPool",
    "call_world",
    "close_pools",
    "free_loopback_port",
]

#: The world-level operations and the number of per-rank arguments each takes.
OPERATIONS = {
    "forward": 1,  # inputs
    "backward": 3,  # inputs, grad_output, stash
    "dispatch": 1,  # inputs
    "combine": 2,  # handles, expert_out
    "dispatch_backward": 3,  # handles, grad_tokens, grad_topk_weights
    "combine_backward": 2,  # handles, grad_output
}


class RankFailure(BackendError):
    """A rank raised an exception that could not be sent back as it was.
    Attributes: ``rank``, ``type_name``, ``traceback_text``."""

    def __init__(self, rank: int, type_name: str, message: str, traceback_text: str) -> None:
        super().__init__(f"rank {rank} raised {type_name}: {message}\n{traceback_text}")
        self.rank = rank
        self.type_name = type_name
        self.traceback_text = traceback_text


class RankTimeoutError(BackendError, TimeoutError):
    """Some ranks had not finished at the deadline; all were stopped.
    Attributes: ``pending`` (the ranks without a result) and ``timeout_s``."""

    def __init__(self, operation: str, pending: Sequence[int], timeout_s: float) -> None:
        super().__init__(
            f"{operation}: ranks {list(pending)} gave no result within timeout_s = {timeout_s:g}; all ranks were stopped"
        )
        self.pending = tuple(pending)
        self.timeout_s = timeout_s


class RankCrashError(BackendError):
    """A rank's process ended without a result (crash, os._exit, signal).
    Attributes: ``rank`` and ``exitcode``."""

    def __init__(self, operation: str, rank: int, exitcode: Optional[int]) -> None:
        super().__init__(f"{operation}: rank {rank} ended with exit code {exitcode} and no result")
        self.rank = rank
        self.exitcode = exitcode


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_loop(backend: MoeEpBackend, ctx: RankContext, conn: Any) -> None:
    """A rank's process: run requests until told to stop or the pipe closes."""
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        operation, config, args = request
        try:
            value = getattr(backend, operation + "_rank")(config, ctx, *args)
            conn.send(("ok", pickle.dumps(value)))
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            tb = traceback.format_exc()
            try:
                payload = pickle.dumps(exc)
                pickle.loads(payload)
                conn.send(("error", (payload, tb)))
            except Exception:  # noqa: BLE001 - unpicklable exception: send its text
                conn.send(("failure", (type(exc).__name__, str(exc), tb)))


#: Seconds the other ranks get to answer once one rank has reported an error.
_ERROR_GRACE_S = 5.0


def _originating_error(errors: List[Tuple[int, Tuple[str, Any]]]) -> BaseException:
    """The exception to raise for the ranks that failed: the first whose error is
    its own (not marked ``moe_ep_peer_error``: a report of another rank's error)."""
    decoded = []
    for r, (kind, payload) in errors:
        if kind == "error":
            exc = pickle.loads(payload[0])
        else:
            type_name, message, tb = payload
            exc = RankFailure(r, type_name, message, tb)
        decoded.append(exc)
    own = [e for e in decoded if not getattr(e, "moe_ep_peer_error", False)]
    return (own or decoded)[0]


class RankPool:
    """``num_ranks`` processes of one process-per-rank backend, kept for reuse.

    Args:
        backend: the backend (pickled into every rank's process).
        num_ranks: the EP size.
        devices: the device of every rank (default ``cpu``).
        timeout_s: the ``RankContext.timeout_s`` the ranks see.
    """

    def __init__(
        self, backend: MoeEpBackend, num_ranks: int, devices: Optional[Sequence[str]] = None, timeout_s: float = 120.0
    ) -> None:
        self.backend = backend
        self.num_ranks = num_ranks
        self.devices = list(devices) if devices is not None else ["cpu"] * num_ranks
        self.rendezvous = f"tcp://127.0.0.1:{free_loopback_port()}"
        ctx = mp.get_context("spawn")
        self._conns: List[Any] = []
        self._procs: List[Any] = []
        self._closed = False
        for r in range(num_ranks):
            parent, child = ctx.Pipe()
            rank_ctx = RankContext(
                rank=r, num_ranks=num_ranks, rendezvous=self.rendezvous, timeout_s=timeout_s, device=self.devices[r]
            )
            p = ctx.Process(target=_rank_loop, args=(backend, rank_ctx, child), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)

    @property
    def alive(self) -> bool:
        """True while the pool is open and every rank's process runs."""
        return not self._closed and all(p.is_alive() for p in self._procs)

    def call(self, operation: str, config: MoeEpConfig, per_rank: Sequence[Sequence[Any]], timeout_s: float) -> List[Any]:
        """Run ``operation`` on every rank; see :func:`call_world`. Stops the pool
        on any failure."""
        n = self.num_ranks
        for r in range(n):
            self._conns[r].send((operation, config, tuple(a[r] for a in per_rank)))
        got: Dict[int, Tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        failed: Optional[BaseException] = None
        try:
            while len(got) < n:
                if time.monotonic() >= deadline:
                    failed = RankTimeoutError(operation, [r for r in range(n) if r not in got], timeout_s)
                    break
                for r in range(n):
                    if r in got:
                        continue
                    if self._conns[r].poll(0.01):
                        try:
                            got[r] = self._conns[r].recv()
                        except (EOFError, OSError):
                            self._procs[r].join(timeout=1)
                            failed = RankCrashError(operation, r, self._procs[r].exitcode)
                            break
                        if got[r][0] != "ok":
                            # The others may be stuck in a collective: give them a short grace.
                            deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
                    elif not self._procs[r].is_alive():
                        failed = RankCrashError(operation, r, self._procs[r].exitcode)
                        break
                if failed is not None:
                    break
        except BaseException:
            self.close()
            raise
        errors = [(r, got[r]) for r in sorted(got) if got[r][0] != "ok"]
        if failed is not None and errors:
            failed = None  # a rank's own error explains the others' silence
        if failed is not None or len(got) < n:
            self.close()  # some rank did not answer: the pool cannot be trusted
        if errors:
            raise _originating_error(errors)
        if failed is not None:
            raise failed
        return [pickle.loads(got[r][1]) for r in range(n)]

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        if self._closed:
            return
        self._closed = True
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self._conns:
            c.close()


_pools: Dict[Tuple[int, int, Tuple[str, ...]], RankPool] = {}
_pools_lock = threading.Lock()


def close_pools() -> None:
    """Stop every cached :class:`RankPool` (also done at interpreter exit)."""
    with _pools_lock:
        for pool in _pools.values():
            pool.close()
        _pools.clear()


atexit.register(close_pools)


def call_world(
    backend: MoeEpBackend,
    operation: str,
    config: MoeEpConfig,
    *per_rank: Sequence[Any],
    timeout_s: float = 120.0,
    devices: Optional[Sequence[str]] = None,
    reuse: bool = True,
) -> List[Any]:
    """Run ``operation`` of ``backend`` over the world of ``config.num_ranks`` ranks.

    Args:
        backend: any registered backend.
        operation: one of :data:`OPERATIONS`.
        config: the layer configuration.
        per_rank: the operation's world-level arguments, each one entry per rank
            (e.g. for ``backward``: inputs, grad_output, stash).
        timeout_s: process-per-rank only: the deadline for all ranks together.
        devices: process-per-rank only: the device of every rank (default cpu).
        reuse: process-per-rank only: run in the cached :class:`RankPool` for this
            backend, EP size and devices (started on first use); False starts a
            pool for this call alone.

    Returns:
        one result per rank, in rank order.
    """
    if operation not in OPERATIONS:
        raise ValueError(f"operation must be one of {sorted(OPERATIONS)}; got {operation!r}")
    if len(per_rank) != OPERATIONS[operation]:
        raise TypeError(f"{operation} takes {OPERATIONS[operation]} per-rank arguments; got {len(per_rank)}")
    if backend.capabilities.launch is Launch.WORLD:
        return list(getattr(backend, operation)(config, *per_rank))
    n = config.num_ranks
    for i, arg in enumerate(per_rank):
        validate_world(config, arg, f"{operation} argument {i}")
    devs = tuple(devices) if devices is not None else ("cpu",) * n
    if not reuse:
        pool = RankPool(backend, n, devs, timeout_s)
        try:
            return pool.call(operation, config, per_rank, timeout_s)
        finally:
            pool.close()
    key = (id(backend), n, devs)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or not pool.alive or pool.backend is not backend:
            if pool is not None:
                pool.close()
            pool = _pools[key] = RankPool(backend, n, devs, timeout_s)
    try:
        return pool.call(operation, config, per_rank, timeout_s)
    finally:
        if not pool.alive:
            with _pools_lock:
                if _pools.get(key) is pool:
                    del _pools[key]
