"""The NCCL transport of the native core (``moe_ep_comm_*``), framework-neutral.

Pointers and streams are plain integers (a framework's ``data_ptr()`` and
``cuda_stream``), so any binding can drive it; the PyTorch front-end
(``moe_ep_cuda_nccl``) bootstraps it from a ``torch.distributed`` store.

Example (every rank; ``uid`` made by one rank and shared out of band)::

    uid = moe_ep_native.comm.unique_id()            # on one rank
    comm = Communicator(uid, num_ranks, rank, cuda_device=0, timeout_s=60)
    comm.exchange(stream, send_ptr, [3, 1], recv_ptr, [2, 2], row_bytes=256)
    comm.close()
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

from ._capi import call, load

__all__ = ["UNIQUE_ID_BYTES", "Communicator", "unique_id"]

#: MOE_EP_UNIQUE_ID_BYTES.
UNIQUE_ID_BYTES = 128


def unique_id() -> bytes:
    """A new NCCL unique id (``MOE_EP_UNIQUE_ID_BYTES`` bytes) for :class:`Communicator`.

    Raises:
        NativeError: ``MOE_EP_ERR_UNSUPPORTED`` in a build without the NCCL transport.
    """
    buf = (ctypes.c_uint8 * UNIQUE_ID_BYTES)()
    call("moe_ep_comm_unique_id", ctypes.cast(buf, ctypes.c_void_p), UNIQUE_ID_BYTES)
    return bytes(buf)


class Communicator:
    """One rank of an NCCL communicator (``moe_ep_comm``).

    Args:
        uid: the unique id (``UNIQUE_ID_BYTES`` bytes) every rank of the group got.
        num_ranks: ranks of the group (>= 1); rank: this one, in ``[0, num_ranks)``.
        cuda_device: the CUDA device ordinal the communicator works on.
        timeout_s: bound on every host-side wait (joining included).

    Collective methods enqueue on ``stream`` (an integer ``cudaStream_t``, 0 for
    the legacy default stream) and never synchronise. :meth:`close` (or the
    context manager) finalises the NCCL communicator; a failed call
    (:class:`~moe_ep_spec.TransportError`) leaves it unusable: close it.
    """

    def __init__(self, uid: bytes, num_ranks: int, rank: int, cuda_device: int, timeout_s: float = 300.0) -> None:
        if not isinstance(uid, (bytes, bytearray)) or len(uid) != UNIQUE_ID_BYTES:
            got = f"{len(uid)} bytes" if isinstance(uid, (bytes, bytearray)) else type(uid).__name__
            raise ValueError(f"uid must be {UNIQUE_ID_BYTES} bytes (from unique_id()); got {got}")
        load()
        buf = (ctypes.c_uint8 * UNIQUE_ID_BYTES).from_buffer_copy(bytes(uid))
        handle = ctypes.c_void_p()
        call(
            "moe_ep_comm_init", ctypes.cast(buf, ctypes.c_void_p), UNIQUE_ID_BYTES, int(num_ranks), int(rank),
            int(cuda_device), max(1, int(timeout_s * 1000)), ctypes.byref(handle),
        )
        self._handle: Optional[int] = handle.value
        self.num_ranks = int(num_ranks)
        self.rank = int(rank)
        self.cuda_device = int(cuda_device)

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _live(self) -> int:
        if self._handle is None:
            raise ValueError("the communicator is closed")
        return self._handle

    def all_gather(self, stream: int, send: int, recv: int, nbytes: int) -> None:
        """``recv[r] = send of rank r`` (``[num_ranks, nbytes]`` bytes); device pointers."""
        call("moe_ep_comm_all_gather", self._live(), stream or None, send or None, recv or None, int(nbytes))

    def exchange(
        self, stream: int, send: int, send_rows: Sequence[int], recv: int, recv_rows: Sequence[int], row_bytes: int
    ) -> None:
        """Grouped send/receive of rows: ``send_rows[p]`` rows to rank ``p`` (in rank
        order from ``send``), ``recv_rows[p]`` rows from rank ``p`` (in rank order into ``recv``)."""
        if len(send_rows) != self.num_ranks or len(recv_rows) != self.num_ranks:
            raise ValueError(
                f"send_rows and recv_rows must have num_ranks = {self.num_ranks} entries; got "
                f"{len(send_rows)} and {len(recv_rows)}"
            )
        rows = ctypes.c_int64 * self.num_ranks
        call(
            "moe_ep_comm_exchange", self._live(), stream or None, send or None, rows(*map(int, send_rows)),
            recv or None, rows(*map(int, recv_rows)), int(row_bytes),
        )

    def close(self) -> None:
        """Finalise and free the communicator (idempotent)."""
        handle, self._handle = self._handle, None
        if handle is not None:
            call("moe_ep_comm_destroy", handle)

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"Communicator(rank={self.rank}, num_ranks={self.num_ranks}, cuda_device={self.cuda_device}, {state})"
