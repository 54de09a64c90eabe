"""CUDA helpers of the communicators and their callers: whether MPI reads device memory, and the
stream ordering rule for device tensors.

The rule (torch.distributed's): a collective on a CUDA tensor reads and writes it *in order on the
calling thread's current stream*. A caller on another thread (a kvstore's comm thread) captures that
point with :func:`ready_event` where the tensor was produced, and runs the collective inside
:func:`after`, on a side stream that waits for the event: the producer's stream is never synchronized
as a whole, so backward keeps running while a bucket is reduced. Nothing here runs for CPU tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ready_event", "after", "side_stream", "mpi_cuda_aware", "host_wait"]

_streams: dict[int, Any] = {}  # one side stream per device index, shared by the comm threads
_streams_lock = threading.Lock()


def ready_event(t: torch.Tensor) -> Any:
    """An event recorded on the current stream of `t`'s device (the point after which `t` is
    produced), or None for a tensor that is not on a CUDA device."""
    if not t.is_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


def side_stream(dev: torch.device) -> Any:
    """The communication stream of CUDA device `dev` (created once, reused)."""
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    with _streams_lock:
        s = _streams.get(index)
        if s is None:
            s = _streams[index] = torch.cuda.Stream(device=index)
        return s


_NOTHING = contextlib.nullcontext()  # stateless: shared by every CPU call of `after`


def after(t: torch.Tensor, *ready: Any) -> contextlib.AbstractContextManager[Any]:
    """Run the block on `t`'s device's side stream, ordered after the `ready` events (from
    :func:`ready_event`; None: nothing to wait for); on exit the host waits for the side stream, so
    what the block wrote is complete for every stream and thread. For a CPU tensor: nothing at all."""
    return _after(t, ready) if t.is_cuda else _NOTHING


@contextlib.contextmanager
def _after(t: torch.Tensor, ready: tuple[Any, ...]) -> Iterator[None]:
    s = side_stream(t.device)
    for ev in ready:
        if ev is not None:
            s.wait_event(ev)
    with torch.cuda.stream(s):
        yield
    s.synchronize()


def host_wait(t: torch.Tensor) -> None:
    """Block the host until `t`'s producers on the current stream have finished (before MPI reads
    device memory directly: MPI knows no streams). Only the current stream is waited for."""
    ev = ready_event(t)
    if ev is not None:
        ev.synchronize()


def mpi_cuda_aware() -> bool:
    """Whether the loaded MPI library reads and writes CUDA device memory: Open MPI's
    ``MPIX_Query_cuda_support()`` or MPICH's ``MPIX_GPU_query_support(CUDA)``, asked of the libmpi
    that mpi4py loaded (both report the runtime state: built with CUDA and a device usable). False
    when torch has no CUDA, or the library has neither query."""
    if not torch.cuda.is_available():
        return False
    lib = _libmpi()
    if lib is None:
        return False
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        return bool(query())
    gpu_query = getattr(lib, "MPIX_GPU_query_support", None)
    if gpu_query is not None:  # MPICH: MPIX_GPU_SUPPORT_CUDA is 0
        flag = ctypes.c_int(0)
        gpu_query.restype = ctypes.c_int
        return gpu_query(ctypes.c_int(0), ctypes.byref(flag)) == 0 and bool(flag.value)
    return False


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library this process loaded (mpi4py opens it privately, so look it up by path)."""
    from mpi4py import MPI  # noqa: F401 - loads libmpi

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi.so" in line or "/libmpich.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None
