"""Process-wide start-up: the world communicator, rank queries and abort-on-uncaught-exception."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from types import TracebackType

from .comm.base import CommError, Communicator

__all__ = ["init", "rank", "size", "local_rank", "world", "BACKENDS"]

BACKENDS = ("mpi", "torch")
_world: Communicator | None = None
_lock = threading.Lock()


def init(backend: str | None = None) -> Communicator:
    """Start (once) and return the world communicator.

    `backend` is "mpi" (default) or "torch" (torch.distributed: gloo on CPU, NCCL on GPUs); when None
    the ``MPITRAIN_BACKEND`` environment variable decides. Every later call returns the same object;
    asking for a different backend then is an error. Installs a ``sys.excepthook`` that prints the
    traceback with the rank and aborts the whole job, so no rank is left waiting in a collective.
    When ``MPITRAIN_TIMELINE`` names a file, the first call starts a timeline of the job, written
    there at exit (:mod:`mpitrain.timeline`; every rank must call ``init``).
    """
    global _world
    wanted = backend or os.environ.get("MPITRAIN_BACKEND") or "mpi"
    if wanted not in BACKENDS:
        raise CommError(f"unknown backend {wanted!r}; choose one of {BACKENDS}")
    with _lock:
        if _world is not None:
            if backend is not None and backend != _world.backend:
                raise CommError(f"already initialized with backend {_world.backend!r}, asked for {backend!r}")
            return _world
        from mpi4py import MPI

        from .comm._mpi import MPICommunicator

        mpi_world = MPICommunicator(MPI.COMM_WORLD)
        if wanted == "mpi":
            _world = mpi_world
        else:
            from .comm._torchdist import init_torch_world

            _world = init_torch_world(mpi_world.rank, mpi_world.size, mpi_world)
        _install_abort_hook(_world)
        made = _world
    from .timeline._session import start_from_env  # MPITRAIN_TIMELINE=trace.json (docs/timeline.md)

    start_from_env(made)
    return made


def world() -> Communicator:
    """The world communicator (initializing with the default backend if needed)."""
    return _world if _world is not None else init()


def rank() -> int:
    return world().rank


def size() -> int:
    return world().size


def local_rank() -> int:
    """This rank's index among the ranks on its host (from the launcher's environment)."""
    for var in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    from mpi4py import MPI

    return MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def _install_abort_hook(comm: Communicator) -> None:
    # Every uncaught exception, KeyboardInterrupt included, ends the job: a rank that exits alone
    # leaves the others waiting in their next collective.
    def hook(etype: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        text = "".join(traceback.format_exception(etype, value, tb))
        sys.stderr.write(f"[mpitrain] rank {comm.rank}: uncaught exception, aborting the job\n{text}")
        sys.stderr.flush()
        sys.stdout.flush()
        comm.abort(1)

    sys.excepthook = hook
