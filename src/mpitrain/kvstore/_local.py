"""The `local` KVStore: one process, no communication (MXNet's "local")."""

from __future__ import annotations

from ..comm.base import Communicator
from ._allreduce import AllreduceStore, Entry
from ._interface import KVStoreError

__all__ = ["LocalStore"]


class LocalStore(AllreduceStore):
    """Single-process store over a size-1 communicator. Operations complete before they return
    (there is nothing to overlap with), which also satisfies the asynchronous contract."""

    type = "local"

    def __init__(self, comm: Communicator | None = None, warn_after: float = 60.0,
                 abort_after: float | None = 600.0) -> None:
        if comm is None:
            from mpi4py import MPI

            from ..comm.compose import mpi_communicator

            comm = mpi_communicator(MPI.COMM_SELF)
        if comm.size != 1:
            raise KVStoreError(f"the local kvstore runs in one process; got a communicator of size "
                               f"{comm.size} (use funnel, concurrent, depchain or dist_sync_mpi)")
        super().__init__(comm, warn_after, abort_after)

    def _enqueue(self, entry: Entry) -> None:
        if entry.finish is not None:
            entry.finish()

    def set_gradient_compression(self, compression_params: dict) -> None:
        raise KVStoreError("the local kvstore does not communicate; gradient compression is unsupported")
