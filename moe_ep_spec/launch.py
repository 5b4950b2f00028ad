"""Run a backend's operation over a whole world, whatever its launch model.

World backends are called directly. Process-per-rank backends get one local
process per rank (``multiprocessing`` with the ``spawn`` start method), a
rendezvous address on loopback (``tcp://127.0.0.1:PORT``) and a deadline; each
process calls the backend's ``<operation>_rank`` method with its rank's
arguments, and the results come back in rank order.

A rank that raises makes :func:`call_world` stop every rank and raise the same
exception (or, when the exception cannot be pickled, a :class:`RankFailure`
that carries its type, message and traceback). A rank that hangs or dies is stopped at the
deadline and reported as :class:`RankTimeoutError` / :class:`RankCrashError`.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, List, Optional, Sequence

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
    "call_world",
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


def _rank_main(
    backend: MoeEpBackend, operation: str, config: MoeEpConfig, ctx: RankContext, args: tuple, results: Any
) -> None:
    try:
        value = getattr(backend, operation + "_rank")(config, ctx, *args)
        results.put((ctx.rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
            results.put((ctx.rank, "error", (payload, tb)))
        except Exception:  # noqa: BLE001 - unpicklable exception: send its text
            results.put((ctx.rank, "failure", (type(exc).__name__, str(exc), tb)))


def call_world(
    backend: MoeEpBackend,
    operation: str,
    config: MoeEpConfig,
    *per_rank: Sequence[Any],
    timeout_s: float = 120.0,
    devices: Optional[Sequence[str]] = None,
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
    devices = list(devices) if devices is not None else ["cpu"] * n
    rendezvous = f"tcp://127.0.0.1:{free_loopback_port()}"
    mpctx = mp.get_context("spawn")
    results = mpctx.Queue()
    procs = []
    for r in range(n):
        ctx = RankContext(rank=r, num_ranks=n, rendezvous=rendezvous, timeout_s=timeout_s, device=devices[r])
        args = tuple(a[r] for a in per_rank)
        p = mpctx.Process(target=_rank_main, args=(backend, operation, config, ctx, args, results), daemon=True)
        p.start()
        procs.append(p)
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    crashed: Optional[int] = None
    try:
        while len(got) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, kind, payload = results.get(timeout=min(remaining, 0.2))
                got[rank] = (kind, payload)
                if kind != "ok":
                    break  # the other ranks may wait on this one forever
                continue
            except queue_module.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in got and not p.is_alive():
                    # Give a result already in the pipe a moment to arrive.
                    try:
                        rank, kind, payload = results.get(timeout=1.0)
                        got[rank] = (kind, payload)
                    except queue_module.Empty:
                        crashed = r
                    break
            if crashed is not None:
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r in range(n):
        if r in got and got[r][0] != "ok":
            kind, payload = got[r]
            if kind == "error":
                exc_bytes, _tb = payload
                raise pickle.loads(exc_bytes)
            type_name, message, tb = payload
            raise RankFailure(r, type_name, message, tb)
    if crashed is not None:
        raise RankCrashError(operation, crashed, procs[crashed].exitcode)
    if len(got) < n:
        raise RankTimeoutError(operation, [r for r in range(n) if r not in got], timeout_s)
    return [pickle.loads(got[r][1]) for r in range(n)]
