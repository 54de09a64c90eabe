"""Requests a failed step leaves in flight, settled before their buffers can be freed.

When an exception leaves a step, the nonblocking requests it posted are still live inside MPI: a posted
receive keeps its buffer's address, and a message a peer sends later (the peers are still running the
step) is written there when this rank next enters MPI; a send's buffer may still be read. If Python frees
those tensors first (the step's objects dropped, or interpreter exit: mpi4py runs MPI_Finalize after
Python has freed its objects), MPI writes into freed memory — the heap corruption ("corrupted
double-linked list", SIGABRT at exit) of issue 25.

:func:`abandon` settles such requests, the one mechanism every strategy uses (:func:`settle_on_error`
around the part of a step that posts them):

* a receive is cancelled (``MPI_Cancel``, then completed: both local, per the MPI standard), so no later
  message lands in its buffer; a message it had already matched is complete when ``cancel`` returns;
* every other request — sends (MPI deprecates cancelling them), collectives, receives a backend cannot
  cancel (torch.distributed's) — is kept, with the buffers it holds, in this process's list of orphans until
  it completes; at interpreter exit the ones still pending are pinned (their memory is never freed), so
  MPI_Finalize never touches freed memory. A peer that waits for this rank's part of the step is not
  released by any of this: it ends through its own stall policy, or the job through this rank's exit.

Communication threads (the kvstore engine, pipe-sgd's ring, the staged-send worker) need none of this:
their buffers are referenced by the frames of the calls that use them, which outlive any exception of
the compute thread and are never torn down at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import threading
from collections.abc import Callable, Iterable, Iterator

from .base import Request

__all__ = ["abandon", "settle_on_error", "orphans"]

_orphans: list[Request] = []
_lock = threading.Lock()
_hooked = False


def _done(req: Request) -> bool:
    """Whether `req` has completed (a request whose completion raised counts as pending: keep it)."""
    try:
        return req.test()
    except Exception:  # noqa: BLE001 - an error completing it is the step's, already raised
        return False


def abandon(requests: Iterable[Request]) -> None:
    """Settle `requests`, which nobody will wait for (see the module doc): cancel the receives, keep the
    rest alive until they complete. Local, never blocks; safe to call with completed requests."""
    global _hooked
    kept = []
    for req in requests:
        if _done(req):
            continue
        try:
            if req.cancel():
                continue
        except Exception:  # noqa: BLE001 - not cancellable after all: keep it
            pass
        kept.append(req)
    with _lock:
        _orphans[:] = [r for r in _orphans if not _done(r)] + kept
        if kept and not _hooked:
            atexit.register(_pin_pending)
            _hooked = True


def orphans() -> list[Request]:
    """The abandoned requests still kept alive (completed ones are dropped at the next :func:`abandon`)."""
    with _lock:
        return list(_orphans)


def _pin_pending() -> None:
    """At exit, before Python frees its objects: every orphan still pending gets a reference that is never
    released, so neither it nor the buffers it holds are freed before (or during) MPI_Finalize."""
    with _lock:
        for req in _orphans:
            if not _done(req):
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(req))


@contextlib.contextmanager
def settle_on_error(outstanding: Callable[[], Iterable[Request]]) -> Iterator[None]:
    """Run the block; if an exception leaves it, :func:`abandon` the requests ``outstanding()`` returns (the
    block's requests not completed yet; the owner forgets them), then let the exception go on."""
    try:
        yield
    except BaseException:
        abandon(outstanding())
        raise
