"""Process-per-rank backends for tests: the reference behind a real exchange.

``LoopbackReference`` runs every rank in its own process. The ranks meet at the
rendezvous address (rank 0 listens on loopback, the others connect), rank 0
gathers every rank's arguments, runs the reference over the world and sends each
rank its result. It exercises the launch model end to end without a framework.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Client, Listener
from typing import Any, List

import moe_ep_spec
from moe_ep_spec import Capabilities, Launch, MoeEpBackend, MoeEpConfig, RankContext

_AUTH = b"moe-ep-test"


def _address(ctx: RankContext) -> tuple:
    host, port = ctx.rendezvous.removeprefix("tcp://").rsplit(":", 1)
    if host != "127.0.0.1":
        raise ValueError(f"rendezvous must be on loopback 127.0.0.1; got {host}")
    return host, int(port)


def _exchange(ctx: RankContext, operation: str, config: MoeEpConfig, args: tuple) -> Any:
    """Rank 0 gathers every rank's arguments, runs the reference, scatters results.

    Ranks live on across calls (moe_ep_spec.launch.RankPool), so rank 0 closes
    its listener as soon as every rank has connected: a rank that races ahead
    to the next call can then only reach the next call's listener.
    """
    address = _address(ctx)
    deadline = time.monotonic() + ctx.timeout_s
    if ctx.rank == 0:
        conns = {}
        per_rank: List[tuple] = [args] + [()] * (ctx.num_ranks - 1)
        with Listener(address, authkey=_AUTH) as listener:
            while len(conns) < ctx.num_ranks - 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank 0: only {len(conns)} of {ctx.num_ranks - 1} ranks connected in time")
                conn = listener.accept()
                rank, rank_args = conn.recv()
                conns[rank] = conn
                per_rank[rank] = rank_args
        world_args = list(zip(*per_rank))
        reference = moe_ep_spec.get_backend("reference")
        try:
            results = getattr(reference, operation)(config, *world_args)
            error = None
        except moe_ep_spec.MoeEpError as exc:
            results, error = None, exc
        for rank, conn in conns.items():
            conn.send(("error", error) if error is not None else ("ok", results[rank]))
            conn.close()
        if error is not None:
            raise error
        return results[0]
    while True:
        try:
            conn = Client(address, authkey=_AUTH)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    with conn:
        conn.send((ctx.rank, args))
        kind, value = conn.recv()
    if kind == "error":
        raise value
    return value


class LoopbackReference(MoeEpBackend):
    """The reference, one process per rank."""

    name = "loopback-reference"
    capabilities = Capabilities(launch=Launch.PROCESS_PER_RANK)

    def forward_rank(self, config, ctx, inputs):
        return _exchange(ctx, "forward", config, (inputs,))

    def backward_rank(self, config, ctx, inputs, grad_output, stash):
        return _exchange(ctx, "backward", config, (inputs, grad_output, stash))

    def dispatch_rank(self, config, ctx, inputs):
        return _exchange(ctx, "dispatch", config, (inputs,))

    def combine_rank(self, config, ctx, handle, expert_out):
        return _exchange(ctx, "combine", config, (handle, expert_out))

    def dispatch_backward_rank(self, config, ctx, handle, grad_tokens, grad_topk_weights):
        return _exchange(ctx, "dispatch_backward", config, (handle, grad_tokens, grad_topk_weights))

    def combine_backward_rank(self, config, ctx, handle, grad_output):
        return _exchange(ctx, "combine_backward", config, (handle, grad_output))


class HangingRank(LoopbackReference):
    """Rank 1 never answers."""

    name = "hanging-rank"

    def forward_rank(self, config, ctx, inputs):
        if ctx.rank == 1:
            time.sleep(3600)
        return super().forward_rank(config, ctx, inputs)


class CrashingRank(LoopbackReference):
    """Rank 1 dies without a result."""

    name = "crashing-rank"

    def forward_rank(self, config, ctx, inputs):
        if ctx.rank == 1:
            os._exit(17)
        return super().forward_rank(config, ctx, inputs)
