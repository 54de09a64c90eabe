"""Where communicators are composed: a backend at the bottom, the layers above it, outermost first:

1. :class:`~mpitrain.comm.tracing.Traced` -- records every call while a tracer is set (the timeline);
2. :class:`~mpitrain.comm._staged.Staged` (MPI only) -- tensors MPI cannot read go through pinned host
   mirrors (and a CUDA tensor whose allreduce goes hierarchical, even where MPI is CUDA-aware);
   composed where torch sees a CUDA device or CPU staging is forced, absent otherwise (a CPU job pays
   nothing for it);
3. the backend: :class:`~mpitrain.comm._mpi.MPICommunicator` (whose allreduce calls the host hierarchy,
   :mod:`mpitrain.comm._hierarchical`, when its ranks span hosts) or the torch.distributed one.

``mpitrain.init()`` builds the world here; ``split`` re-wraps each sub-communicator in its parent's
layers, so every communicator derived from the world is traced (and staged) alike.
"""

from __future__ import annotations

from typing import Any

import torch

from ._layer import Layer, backend_of, layer_of
from .base import Communicator
from .tracing import Traced

__all__ = ["mpi_communicator", "torch_world", "traced", "direct_devices", "backend_of", "layer_of", "Layer"]


def mpi_communicator(mpi_comm: Any, *, direct: frozenset[str] | None = None, trace: bool = True) -> Communicator:
    """A composed communicator over the mpi4py communicator `mpi_comm`: the MPI backend, staged for the
    device types not in `direct` (default: CPU, plus CUDA when MPI is CUDA-aware; a set without "cpu"
    stages CPU tensors too, for tests of the staging path), traced when `trace`."""
    from ._mpi import MPICommunicator, default_direct
    from ._staged import Staged

    direct = default_direct() if direct is None else frozenset(direct)
    comm: Communicator = MPICommunicator(mpi_comm)
    if "cpu" not in direct or torch.cuda.is_available():
        comm = Staged(comm, direct)  # type: ignore[arg-type]  # the MPI backend just built
    return traced(comm) if trace else comm


def torch_world(bootstrap: Communicator, *, trace: bool = True) -> Communicator:
    """The torch.distributed world (its default group started once: ``init_torch_world``, bootstrapped over
    the MPI communicator `bootstrap`, collective over it), traced when `trace`."""
    from ._torchdist import init_torch_world

    comm: Communicator = init_torch_world(bootstrap.rank, bootstrap.size, bootstrap)
    return traced(comm) if trace else comm


def traced(comm: Communicator) -> Communicator:
    """`comm` with the tracing layer on top (itself when it has one already)."""
    return comm if isinstance(comm, Traced) else Traced(comm)


def direct_devices(comm: Communicator) -> frozenset[str]:
    """The device types a composed MPI communicator hands to MPI as they are (the rest is staged): its
    staging layer's `direct`, or without one (no CUDA device here) what MPI reads by default."""
    from ._mpi import default_direct
    from ._staged import Staged

    staged = layer_of(comm, Staged)
    return staged.direct if staged is not None else default_direct()
