"""The loopback exchange behind ``example-loopback``: gather, compute on rank 0, scatter.

Every rank calls :func:`exchange` with the same operation and configuration and
its own arguments. The ranks meet at ``ctx.rendezvous`` (``tcp://127.0.0.1:PORT``;
any address that is not IPv4 loopback is refused):

1. rank 0 listens there; every other rank connects (retrying while rank 0 is not
   listening yet) and both sides authenticate with the shared key
   (``multiprocessing.connection``'s HMAC challenge, in both directions);
2. every other rank sends rank 0 its arguments (pickled, over a
   :class:`multiprocessing.connection.Connection`);
3. rank 0 checks that all ranks asked for the same operation and configuration,
   runs the world-level reference (``moe_ep_spec.get_backend("reference")``) over
   the gathered world and sends each rank its own result, or the exception the
   reference raised, which every rank re-raises with its original type.

Every wait is bounded by ``ctx.timeout_s`` (one deadline per call): rank 0's
``accept`` runs on a listening socket with a timeout, the other ranks' connect
retries stop at the deadline, and every receive polls first. A connection that
fails authentication (a stray client on the port) is dropped and does not
disturb the exchange.

The key is the backend's (random per backend object, and travelling with it when
the harness pickles the backend into the rank processes), or the environment
variable :data:`ENV_AUTHKEY` when the rank processes build their own backend
objects.
"""

from __future__ import annotations

import ipaddress
import os
import pickle
import queue
import socket
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import moe_ep_spec
from moe_ep_spec import MoeEpConfig, RankContext

__all__ = [
    "ENV_AUTHKEY",
    "ExchangeError",
    "ExchangeTimeoutError",
    "RendezvousError",
    "parse_rendezvous",
    "exchange",
    "resolve_key",
]

#: Environment variable that, when set, overrides the backend's authentication key.
ENV_AUTHKEY = "MOE_EP_EXAMPLE_AUTHKEY"

#: Tag of the messages; ranks of a different protocol version are rejected.
PROTOCOL = "moe-ep-example/1"

_RETRY_S = 0.05  # pause between connection attempts while rank 0 is not listening
_POLL_S = 0.05  # rank 0 checks for authenticated peers this often while accepting


class ExchangeError(moe_ep_spec.BackendError):
    """The ranks could not complete the exchange (a rank asked for another
    operation or configuration, authentication failed, rank 0 went away)."""


class ExchangeTimeoutError(ExchangeError, TimeoutError):
    """A wait of the exchange reached the deadline ``ctx.timeout_s``."""


class RendezvousError(ExchangeError, ValueError):
    """``ctx.rendezvous`` is not a ``tcp://`` address on IPv4 loopback."""


def parse_rendezvous(rendezvous: str) -> Tuple[str, int]:
    """The ``(host, port)`` of a rendezvous address.

    Args:
        rendezvous: ``"tcp://HOST:PORT"`` where HOST is an IPv4 loopback literal
            (``127.0.0.1``, or any ``127.x.y.z``) and PORT is in ``[1, 65535]``.

    Returns:
        ``(host, port)`` for :mod:`socket`.

    Raises:
        RendezvousError: another scheme, a host name, a non-loopback host (this
            backend never listens on or connects to another machine) or a bad port.
    """
    prefix = "tcp://"
    if not isinstance(rendezvous, str) or not rendezvous.startswith(prefix):
        raise RendezvousError(f"rendezvous must be 'tcp://127.0.0.1:PORT'; got {rendezvous!r}")
    host, sep, port_text = rendezvous[len(prefix):].rpartition(":")
    try:
        ip = ipaddress.ip_address(host) if sep else None
    except ValueError:
        ip = None
    if ip is None or ip.version != 4 or not ip.is_loopback:
        raise RendezvousError(
            f"rendezvous host must be an IPv4 loopback address such as 127.0.0.1; got {host!r} in {rendezvous!r} "
            f"(this backend only exchanges data between processes of one machine)"
        )
    try:
        port = int(port_text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise RendezvousError(f"rendezvous port must be an integer in [1, 65535]; got {port_text!r} in {rendezvous!r}")
    return str(ip), port


# ---------------------------------------------------------------------------- plumbing


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


class _Bounded:
    """The ``send_bytes``/``recv_bytes`` of a connection, every receive bounded by a
    deadline: what ``multiprocessing.connection``'s challenge functions need."""

    def __init__(self, conn: Any, deadline: float, what: str) -> None:
        self._conn = conn
        self._deadline = deadline
        self._what = what

    def send_bytes(self, data: bytes) -> None:
        self._conn.send_bytes(data)

    def recv_bytes(self, maxlength: Optional[int] = None) -> bytes:
        if not self._conn.poll(_remaining(self._deadline)):
            raise ExchangeTimeoutError(f"{self._what}: no answer before the deadline")
        return self._conn.recv_bytes(maxlength)


def _recv(conn: Any, deadline: float, what: str, timeout_s: float) -> Any:
    """One pickled message, or :class:`ExchangeTimeoutError` at the deadline."""
    if not conn.poll(_remaining(deadline)):
        raise ExchangeTimeoutError(f"{what}: nothing received within timeout_s = {timeout_s:g}")
    return conn.recv()


def _wrap(sock: socket.socket) -> Any:
    """A blocking :class:`multiprocessing.connection.Connection` over ``sock``."""
    from multiprocessing.connection import Connection

    sock.setblocking(True)
    return Connection(sock.detach())


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling as itself, else an :class:`ExchangeError`
    with its type and message (what travels to the other ranks)."""
    if isinstance(exc, Exception):
        try:
            back = pickle.loads(pickle.dumps(exc))
            if type(back) is type(exc):
                return exc
        except Exception:  # noqa: BLE001 - not picklable as itself: send its text
            pass
    return ExchangeError(f"rank 0 raised {type(exc).__module__}.{type(exc).__name__}: {exc}")


def _send_quietly(conn: Any, message: Any) -> None:
    """Send ``message`` and close; a rank that already gave up must not stop rank 0
    from answering the others."""
    try:
        conn.send(message)
    except (OSError, EOFError):
        pass
    finally:
        conn.close()


# ---------------------------------------------------------------------------- rank 0


def _greet(conn: Any, key: bytes, deadline: float, ctx: RankContext, arrivals: "queue.Queue[tuple]") -> None:
    """Rank 0, one thread per accepted connection: authenticate the peer and read
    its arguments. Puts ``(conn, message, None)`` on ``arrivals``;
    ``(conn, None, problem)`` when an authenticated peer's message could not be
    read; ``(None, None, None)`` when the peer is not one of our ranks (a stray
    client, a wrong key) or went away during authentication (its connection is
    closed)."""
    from multiprocessing.connection import AuthenticationError, answer_challenge, deliver_challenge

    try:
        bounded = _Bounded(conn, deadline, f"rank 0 authenticating a peer at {ctx.rendezvous}")
        deliver_challenge(bounded, key)  # type: ignore[arg-type]
        answer_challenge(bounded, key)  # type: ignore[arg-type]
    except (AuthenticationError, EOFError, OSError, AssertionError):
        conn.close()
        arrivals.put((None, None, None))
        return
    try:
        hello = _recv(conn, deadline, "rank 0 waiting for a peer's arguments", ctx.timeout_s)
    except Exception as exc:  # noqa: BLE001 - one of our ranks: its failure is the exchange's
        arrivals.put((conn, None, f"rank 0 could not read a rank's arguments: {type(exc).__name__}: {exc}"))
        return
    arrivals.put((conn, hello, None))


def _serve(ctx: RankContext, address: Tuple[str, int], key: bytes, operation: str, config: MoeEpConfig, args: tuple,
           deadline: float) -> Any:
    """Rank 0: gather every rank's arguments, run the reference, answer every rank.

    Connections are authenticated in their own threads, so a peer that connects
    and stays silent (not one of our ranks) cannot hold up the others; every
    thread ends by the deadline."""
    n = ctx.num_ranks
    per_rank: Dict[int, tuple] = {0: args}
    peers: List[Tuple[Optional[int], Any]] = []  # (rank, or None when its message was rejected; connection)
    error: Optional[BaseException] = None
    arrivals: "queue.Queue[tuple]" = queue.Queue()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(address)
            server.listen(max(n, 8))
            while len(peers) < n - 1:
                remaining = _remaining(deadline)
                if remaining <= 0:
                    break
                server.settimeout(min(remaining, _POLL_S))  # the listening socket's timeout bounds accept()
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    pass
                else:
                    threading.Thread(
                        target=_greet, args=(_wrap(sock), key, deadline, ctx, arrivals), daemon=True
                    ).start()
                found = _admit(arrivals, ctx, operation, config, per_rank, peers)
                error = error or found
            found = _admit(arrivals, ctx, operation, config, per_rank, peers)  # late arrivals learn the outcome too
            error = error or found
    except BaseException:
        for _, conn in peers:
            conn.close()
        raise
    if error is None and len(per_rank) < n:
        missing = [r for r in range(n) if r not in per_rank]
        error = ExchangeTimeoutError(
            f"{operation}: rank 0 heard nothing from ranks {missing} at {ctx.rendezvous} within "
            f"timeout_s = {ctx.timeout_s:g}"
        )
    results: List[Any] = []
    if error is None:
        try:
            world_args = [[per_rank[r][i] for r in range(n)] for i in range(len(args))]
            reference = moe_ep_spec.get_backend("reference")
            results = list(getattr(reference, operation)(config, *world_args))
            if len(results) != n:
                raise ExchangeError(f"{operation}: the reference returned {len(results)} results for {n} ranks")
        except BaseException as exc:  # noqa: BLE001 - every rank must learn about it
            error = exc
    if error is not None:
        portable = _portable(error)
        for _, conn in peers:
            _send_quietly(conn, ("error", portable))
        raise error
    for rank, conn in peers:
        _send_quietly(conn, ("ok", results[rank]))
    return results[0]


def _admit(
    arrivals: "queue.Queue[tuple]",
    ctx: RankContext,
    operation: str,
    config: MoeEpConfig,
    per_rank: Dict[int, tuple],
    peers: List[Tuple[Optional[int], Any]],
) -> Optional[ExchangeError]:
    """Rank 0: take the authenticated peers that arrived so far into ``per_rank``
    and ``peers``; the first problem found, as an :class:`ExchangeError`, or None."""
    error: Optional[ExchangeError] = None
    while True:
        try:
            conn, hello, problem = arrivals.get_nowait()
        except queue.Empty:
            return error
        if conn is None:
            continue
        problem = problem or _check_hello(hello, ctx, operation, config, per_rank)
        if problem is None:
            per_rank[hello["rank"]] = hello["args"]
            peers.append((hello["rank"], conn))
        else:
            error = error or ExchangeError(problem)
            peers.append((None, conn))


def _check_hello(
    hello: Any, ctx: RankContext, operation: str, config: MoeEpConfig, per_rank: Dict[int, tuple]
) -> Optional[str]:
    """Why an authenticated peer's message cannot join this exchange, or None."""
    if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL:
        return f"a rank spoke another protocol than {PROTOCOL!r} at {ctx.rendezvous}"
    rank = hello.get("rank")
    if not isinstance(rank, int) or not 1 <= rank < ctx.num_ranks:
        return f"a peer claimed rank {rank!r}; expected 1 <= rank < num_ranks = {ctx.num_ranks}"
    if rank in per_rank:
        return f"two processes claimed rank {rank} at {ctx.rendezvous}"
    if hello.get("operation") != operation:
        return f"rank {rank} called {hello.get('operation')}_rank while rank 0 called {operation}_rank"
    if hello.get("config") != config:
        return f"rank {rank} was called with another MoeEpConfig than rank 0: {hello.get('config')} != {config}"
    if not isinstance(hello.get("args"), tuple) or len(hello["args"]) != len(per_rank[0]):
        return f"rank {rank} sent {hello.get('args')!r:.80} instead of {len(per_rank[0])} arguments"
    return None


# ---------------------------------------------------------------------------- ranks 1..n-1


def _connect(ctx: RankContext, address: Tuple[str, int], key: bytes, deadline: float) -> Any:
    """Ranks other than 0: an authenticated connection to rank 0, retried until the deadline."""
    from multiprocessing.connection import AuthenticationError, answer_challenge, deliver_challenge

    while True:
        remaining = _remaining(deadline)
        if remaining <= 0:
            raise ExchangeTimeoutError(
                f"rank {ctx.rank}: rank 0 was not listening at {ctx.rendezvous} within timeout_s = {ctx.timeout_s:g}"
            )
        try:
            sock = socket.create_connection(address, timeout=remaining)
        except (ConnectionRefusedError, ConnectionResetError, socket.timeout):
            time.sleep(min(_RETRY_S, _remaining(deadline)))
            continue
        conn = _wrap(sock)
        try:
            bounded = _Bounded(conn, deadline, f"rank {ctx.rank} authenticating with rank 0 at {ctx.rendezvous}")
            answer_challenge(bounded, key)  # type: ignore[arg-type]
            deliver_challenge(bounded, key)  # type: ignore[arg-type]
        except (AuthenticationError, AssertionError) as exc:
            conn.close()
            raise ExchangeError(
                f"rank {ctx.rank}: authentication with the process at {ctx.rendezvous} failed ({exc}); every rank "
                f"must use the same backend object (as the harness pickles it) or the same ${ENV_AUTHKEY}"
            ) from None
        except (EOFError, OSError) as exc:
            conn.close()
            if isinstance(exc, ExchangeTimeoutError):
                raise
            raise ExchangeError(
                f"rank {ctx.rank}: the process at {ctx.rendezvous} closed the connection during authentication"
            ) from None
        return conn


def _join(ctx: RankContext, address: Tuple[str, int], key: bytes, operation: str, config: MoeEpConfig, args: tuple,
          deadline: float) -> Any:
    """Ranks other than 0: send the arguments, wait for this rank's result."""
    conn = _connect(ctx, address, key, deadline)
    with conn:
        hello = {
            "protocol": PROTOCOL,
            "rank": ctx.rank,
            "operation": operation,
            "config": config,
            "args": args,
        }
        try:
            conn.send(hello)
            kind, value = _recv(conn, deadline, f"rank {ctx.rank} waiting for its result from rank 0", ctx.timeout_s)
        except (EOFError, ConnectionError) as exc:
            raise ExchangeError(
                f"rank {ctx.rank}: rank 0 closed the connection without a result ({type(exc).__name__})"
            ) from None
    if kind == "error":
        raise value  # the reference's exception, with its original type
    return value


# ---------------------------------------------------------------------------- entry


def exchange(ctx: RankContext, key: bytes, operation: str, config: MoeEpConfig, args: tuple) -> Any:
    """Run the world-level reference ``operation`` across the ranks of ``ctx``;
    collective: every rank of the world calls it with the same ``operation`` and
    ``config``.

    Args:
        ctx: this rank's context (rank, num_ranks, loopback rendezvous, timeout).
        key: the authentication key shared by the ranks (bytes).
        operation: a world-level operation of the reference (``forward``,
            ``backward``, ``dispatch``, ``combine``, ``dispatch_backward``,
            ``combine_backward``).
        config: the layer configuration (equal on every rank).
        args: this rank's arguments of ``operation``, in the order of the
            world-level method (e.g. ``(inputs, grad_output, stash)`` for
            ``backward``).

    Returns:
        this rank's entry of the reference's result list.

    Raises:
        RendezvousError: ``ctx.rendezvous`` is not on IPv4 loopback.
        ExchangeTimeoutError: a wait reached ``ctx.timeout_s``.
        ExchangeError: the ranks disagree on the operation or configuration,
            authentication failed, or rank 0 went away.
        MoeEpError: whatever the reference raised for the world's inputs (the
            same exception type on every rank).
    """
    address = parse_rendezvous(ctx.rendezvous)
    deadline = time.monotonic() + float(ctx.timeout_s)
    if ctx.num_ranks == 1:  # nobody to meet
        return getattr(moe_ep_spec.get_backend("reference"), operation)(config, *[[a] for a in args])[0]
    if ctx.rank == 0:
        return _serve(ctx, address, key, operation, config, args, deadline)
    return _join(ctx, address, key, operation, config, args, deadline)


def resolve_key(own: bytes) -> bytes:
    """The authentication key: ``$MOE_EP_EXAMPLE_AUTHKEY`` (UTF-8) when set and
    non-empty, else ``own`` (the backend object's random key)."""
    env = os.environ.get(ENV_AUTHKEY)
    return env.encode("utf-8") if env else own
