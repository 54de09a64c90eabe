"""Process-wide start-up: the world communicator, rank queries and abort-on-uncaught-exception."""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType

import torch

from .comm.base import CommError, Communicator
from .comm.compose import mpi_communicator, torch_world

__all__ = ["init", "rank", "size", "local_rank", "world", "device", "device_for", "on_init", "BACKENDS"]

BACKENDS = ("mpi", "torch")
_world: Communicator | None = None
_device: torch.device | None = None  # this rank's device, chosen by the first init
_lock = threading.Lock()
_on_init: list[Callable[[Communicator], object]] = []


def on_init(fn: Callable[[Communicator], object]) -> None:
    """Call ``fn(world)`` when :func:`init` has built the world (at once if it has): how a layer above
    this one joins the start-up without this module importing it (the timeline's ``MPITRAIN_TIMELINE``)."""
    with _lock:
        made = _world
        if made is None:
            _on_init.append(fn)
    if made is not None:
        fn(made)


def device_for(local_rank: int, device_count: int, bind: bool = True) -> torch.device:
    """The device a rank uses: ``cuda:(local_rank % device_count)`` when `bind` and the host has CUDA
    devices (ranks beyond the device count share them round-robin), else the CPU. A pure function."""
    if local_rank < 0 or device_count < 0:
        raise ValueError(f"local_rank and device_count must be >= 0, got {local_rank} and {device_count}")
    if bind and device_count > 0:
        return torch.device("cuda", local_rank % device_count)
    return torch.device("cpu")


def device() -> torch.device:
    """This rank's device: the one :func:`init` bound (``cuda:k``), or the CPU when CUDA is absent, the
    job opted out (``init(bind_device=False)``) or ``init`` has not run. Move models there:
    ``model.to(mpitrain.device())``."""
    return _device if _device is not None else torch.device("cpu")


def init(backend: str | None = None, *, bind_device: bool = True) -> Communicator:
    """Start (once) and return the world communicator.

    With CUDA present and `bind_device` True (the default), the first call binds this rank to
    ``cuda:(local_rank % device_count)`` (``torch.cuda.set_device``; :func:`device` returns it) before
    any communicator starts, so NCCL and CUDA-aware MPI see one device per rank. ``bind_device=False``
    leaves the current CUDA device alone and makes :func:`device` the CPU (a CPU job on a GPU host).

    `backend` is "mpi" (default) or "torch" (torch.distributed: gloo on CPU, NCCL on GPUs); when None
    the ``MPITRAIN_BACKEND`` environment variable decides. Every later call returns the same object;
    asking for a different backend then is an error. Installs a ``sys.excepthook`` that prints the
    traceback with the rank and aborts the whole job, so no rank is left waiting in a collective.
    The world is composed by :mod:`mpitrain.comm.compose`: the backend, host staging where a GPU may
    need it, and the tracing layer on top (idle until a timeline records). When ``MPITRAIN_TIMELINE``
    names a file, the first call starts a timeline of the job, written there at exit
    (:mod:`mpitrain.timeline`, through :func:`on_init`; every rank must call ``init``).
    """
    global _world, _device
    wanted = backend or os.environ.get("MPITRAIN_BACKEND") or "mpi"
    if wanted not in BACKENDS:
        raise CommError(f"unknown backend {wanted!r}; choose one of {BACKENDS}")
    with _lock:
        if _world is not None:
            if backend is not None and backend != _world.backend:
                raise CommError(f"already initialized with backend {_world.backend!r}, asked for {backend!r}")
            return _world
        _device = _bind(bind_device)
        from mpi4py import MPI

        if wanted == "mpi":
            _world = mpi_communicator(MPI.COMM_WORLD)
        else:
            _world = torch_world(mpi_communicator(MPI.COMM_WORLD, trace=False))
        _install_abort_hook(_world)
        made, hooks = _world, list(_on_init)
        _on_init.clear()
    for fn in hooks:  # outside the lock: a hook may call world() (MPITRAIN_TIMELINE=trace.json: docs/timeline.md)
        fn(made)
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


def _bind(bind: bool) -> torch.device:
    """Choose this rank's device (see :func:`device_for`) and make it torch's current CUDA device."""
    count = torch.cuda.device_count() if bind and torch.cuda.is_available() else 0
    dev = device_for(local_rank() if count else 0, count, bind)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


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
