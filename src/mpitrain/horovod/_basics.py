"""Lifecycle, rank queries, reduction ops and errors of ``mpitrain.horovod`` (Horovod's ``basics``).

State lives in one module-level :class:`_State`, created by :func:`init` and dropped by
:func:`shutdown`. MPI itself stays initialized for the life of the process (Horovod on MPI cannot be
re-initialized; we can, because we never finalize MPI)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

from ..comm.base import Communicator
from ..runtime import init as _mpitrain_init
from ._engine import Engine, HorovodInternalError

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
           "cross_rank", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
           "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
           "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "state",
           "start_timeline", "stop_timeline"]

# Reduction ops: the integer values of Horovod's ``ReduceOp`` enum, so scripts that compare or store
# them keep working. Adasum is accepted as a name and refused when used.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class _State:
    """Everything :func:`init` sets up: the world, the per-host layout and the engine thread."""

    def __init__(self, world: Communicator, engine: Engine, layout: tuple[int, int, int, int, bool]) -> None:
        self.world, self.engine = world, engine
        self.local_rank, self.local_size, self.cross_rank, self.cross_size, self.homogeneous = layout


_state: _State | None = None
_lock = threading.Lock()

#: What the modules above this one do at :func:`init` (given its `process_sets`) and at :func:`shutdown`,
#: in registration order: they register when imported (``mpitrain.horovod`` imports them all), so this
#: module, which they all use, imports none of them (docs/ARCHITECTURE.md, Import rules).
ON_INIT: list[Callable[[Any], None]] = []
ON_SHUTDOWN: list[Callable[[], None]] = []


def _layout(world: Communicator) -> tuple[int, int, int, int, bool]:
    """(local_rank, local_size, cross_rank, cross_size, homogeneous) from one gathered hostname each.

    Local ranks are ordered by world rank within a host; cross rank is the rank among the ranks that
    share this local rank (Horovod's definition), ordered by world rank."""
    hosts = world.allgather_object(socket.gethostname())
    mine = hosts[world.rank]
    local = [r for r, h in enumerate(hosts) if h == mine]
    local_rank = local.index(world.rank)
    locals_of = [[r for r, h2 in enumerate(hosts) if h2 == h].index(r) for r, h in enumerate(hosts)]
    peers = [r for r, lr in enumerate(locals_of) if lr == local_rank]
    counts = {h: hosts.count(h) for h in hosts}
    return local_rank, len(local), peers.index(world.rank), len(peers), len(set(counts.values())) == 1


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Start ``mpitrain.horovod`` on every rank of the job (collective). Calling it again while
    initialized does nothing; after :func:`shutdown` it starts afresh.

    `comm` must be None (or ``MPI.COMM_WORLD``): running Horovod on a subset of ranks is refused.
    `process_sets` is a list of :class:`ProcessSet` (or ``"dynamic"``, accepted and ignored: sets can
    always be added later with :func:`add_process_set`)."""
    global _state
    if comm is not None:
        from mpi4py import MPI

        if comm is not MPI.COMM_WORLD and not (isinstance(comm, MPI.Comm) and comm == MPI.COMM_WORLD):
            raise ValueError("mpitrain.horovod.init(comm=...) supports only the whole job (comm=None or "
                             "MPI.COMM_WORLD); build a ProcessSet for a subset of ranks instead")
    with _lock:
        if _state is not None:
            return
        world = _mpitrain_init()
        if world.backend != "mpi":  # mpitrain runs on torch.distributed here; Horovod's engine needs MPI
            from mpi4py import MPI

            from ..comm.compose import mpi_communicator

            world = mpi_communicator(MPI.COMM_WORLD)
        layout = _layout(world)
        _state = _State(world, Engine(world), layout)
    for hook in ON_INIT:
        hook(process_sets)


def shutdown() -> None:
    """Stop the engine thread once its queued operations are done and forget all process sets.

    MPI stays initialized; :func:`init` may be called again. Local: every rank should call it, after its
    last collective."""
    global _state
    with _lock:
        st, _state = _state, None
    if st is not None:
        st.engine.stop()
        for hook in ON_SHUTDOWN:
            hook()


def is_initialized() -> bool:
    return _state is not None


def state() -> _State:
    """The running state; ValueError (Horovod's text) before :func:`init`."""
    if _state is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return _state


def size() -> int:
    return state().world.size


def rank() -> int:
    return state().world.rank


def local_size() -> int:
    return state().local_size


def local_rank() -> int:
    return state().local_rank


def cross_size() -> int:
    return state().cross_size


def cross_rank() -> int:
    return state().cross_rank


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return state().homogeneous


def mpi_threads_supported() -> bool:
    """True when MPI runs with MPI_THREAD_MULTIPLE (our engine thread needs it)."""
    state()
    from mpi4py import MPI

    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


def mpi_enabled() -> bool:
    return True


def mpi_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return False


def nccl_built() -> int:
    """0: no NCCL (Horovod returns the NCCL version when built with it)."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when torch was built with CUDA: the collectives then take CUDA tensors (through the MPI
    backend, staged through host memory unless MPI is CUDA-aware; never NCCL, see :func:`nccl_built`)."""
    import torch

    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Refused for now: mpitrain's own timeline (issue #17 part 2) will take this name."""
    raise NotImplementedError("start_timeline is not supported by mpitrain.horovod yet")


def stop_timeline() -> None:
    """Refused for now (see :func:`start_timeline`)."""
    raise NotImplementedError("stop_timeline is not supported by mpitrain.horovod yet")
