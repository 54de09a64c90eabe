"""The tracing layer: every call on a communicator recorded, with the time blocked on it, while a tracer is set.

:class:`Traced` wraps a communicator (:mod:`mpitrain.comm.compose` puts it outermost on the world, and
``split`` carries it to every sub-communicator); :func:`set_tracer` turns recording on for every
traced communicator of the process and off again (``None``): the timeline (``mpitrain.timeline``) sets
its event buffer here for as long as it records. With no tracer set, a traced call costs one global
check and one call more than the wrapped one. What is recorded:

* a blocking call (``allreduce``, ``send``, ``recv``, ``barrier``, ...): one "comm" event with its
  name, ``bytes`` (of the tensor argument), ``peer`` (root, destination or source) and ``ranks`` (the
  communicator's size); its duration is the time blocked in it;
* a nonblocking call (``iallreduce``, ``isend``, ...): a "comm" event for issuing it, and its request
  is wrapped so that the time blocked completing it is a "wait" event: from the ``wait()`` call, or
  from the first ``test()`` that found it incomplete when the caller polls, to completion.

Calls the layers below make (a staged send's host copy, the hierarchy's leaders' ring) are not
recorded: only what the caller asked of the traced communicator. Times are ``time.perf_counter_ns``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ._layer import Layer
from .base import Communicator, Request

__all__ = ["Traced", "Tracer", "set_tracer", "tracer", "METHODS"]

#: The recorded calls: method -> (position of its tensor argument or None, position of its peer or None).
METHODS: dict[str, tuple[int | None, int | None]] = {
    "allreduce": (0, None), "broadcast": (0, 1), "allgather": (0, None), "reduce_scatter": (0, None),
    "alltoallv": (0, None), "barrier": (None, None), "send": (0, 1), "recv": (0, 1), "sendrecv": (0, 1),
    "iallreduce": (0, None), "ibroadcast": (0, 1), "isend": (0, 1), "irecv": (0, 1),
    "allgather_object": (None, None), "broadcast_object": (None, 1), "send_object": (None, 1),
    "recv_object": (None, 0),
}

now = time.perf_counter_ns


class Tracer(Protocol):
    """Where traced calls go (the timeline's event buffer is one): times in ``time.perf_counter_ns``."""

    def add(self, kind: str, name: str, t0: int, t1: int, args: dict[str, Any] | None = None) -> None:
        """A "comm" event: the call `name` ran from `t0` to `t1`."""

    def add_wait(self, name: str, t0: int, t1: int, args: dict[str, Any] | None = None, clip: bool = True) -> None:
        """The time from `t0` to `t1` blocked completing a nonblocking call's request."""


#: The process's tracer, or None (the one check an untraced call makes).
_tracer: Tracer | None = None


def set_tracer(t: Tracer | None) -> Tracer | None:
    """Record every traced communicator's calls into `t` from now on (None: stop); returns the previous one."""
    global _tracer
    previous, _tracer = _tracer, t
    return previous


def tracer() -> Tracer | None:
    """The tracer set now, or None."""
    return _tracer


class Traced(Layer):
    """Records the calls on `inner` while a tracer is set (see the module doc)."""

    def rewrap(self, inner: Communicator) -> Traced:
        return Traced(inner)

    def _call(self, tr: Tracer, name: str, fn: Any, *a: Any) -> Any:
        """Run ``fn(*a)`` (the inner communicator's `name`), recording it into `tr`."""
        t0 = now()
        out = fn(*a)
        tpos, ppos = METHODS[name]
        args: dict[str, Any] = {"ranks": self._size}
        if tpos is not None and isinstance(a[tpos], torch.Tensor):
            args["bytes"] = a[tpos].numel() * a[tpos].element_size()
        if ppos is not None:
            args["peer"] = a[ppos]
        tr.add("comm", name, t0, now(), args)
        return _TracedRequest(out, name, args) if isinstance(out, Request) else out

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        tr = _tracer
        return self.inner.allreduce(t, op) if tr is None else self._call(tr, "allreduce", self.inner.allreduce, t, op)

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        tr = _tracer
        return self.inner.broadcast(t, root) if tr is None else \
            self._call(tr, "broadcast", self.inner.broadcast, t, root)

    def allgather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        tr = _tracer
        return self.inner.allgather(t, out) if tr is None else \
            self._call(tr, "allgather", self.inner.allgather, t, out)

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        tr = _tracer
        return self.inner.reduce_scatter(t, op) if tr is None else \
            self._call(tr, "reduce_scatter", self.inner.reduce_scatter, t, op)

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        tr = _tracer
        return self.inner.alltoallv(send, send_counts, recv_counts) if tr is None else \
            self._call(tr, "alltoallv", self.inner.alltoallv, send, send_counts, recv_counts)

    def barrier(self) -> None:
        tr = _tracer
        self.inner.barrier() if tr is None else self._call(tr, "barrier", self.inner.barrier)

    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        tr = _tracer
        self.inner.send(t, dest, tag) if tr is None else self._call(tr, "send", self.inner.send, t, dest, tag)

    def recv(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        tr = _tracer
        return self.inner.recv(t, source, tag) if tr is None else \
            self._call(tr, "recv", self.inner.recv, t, source, tag)

    def sendrecv(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                 sendtag: int = 0, recvtag: int = 0) -> torch.Tensor:
        tr = _tracer
        return self.inner.sendrecv(send, dest, recv, source, sendtag, recvtag) if tr is None else \
            self._call(tr, "sendrecv", self.inner.sendrecv, send, dest, recv, source, sendtag, recvtag)

    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request:
        tr = _tracer
        return self.inner.iallreduce(t, op) if tr is None else \
            self._call(tr, "iallreduce", self.inner.iallreduce, t, op)

    def ibroadcast(self, t: torch.Tensor, root: int = 0) -> Request:
        tr = _tracer
        return self.inner.ibroadcast(t, root) if tr is None else \
            self._call(tr, "ibroadcast", self.inner.ibroadcast, t, root)

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Request:
        tr = _tracer
        return self.inner.isend(t, dest, tag) if tr is None else self._call(tr, "isend", self.inner.isend, t, dest, tag)

    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Request:
        tr = _tracer
        return self.inner.irecv(t, source, tag) if tr is None else \
            self._call(tr, "irecv", self.inner.irecv, t, source, tag)

    def allgather_object(self, obj: Any) -> list[Any]:
        tr = _tracer
        return self.inner.allgather_object(obj) if tr is None else \
            self._call(tr, "allgather_object", self.inner.allgather_object, obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        tr = _tracer
        return self.inner.broadcast_object(obj, root) if tr is None else \
            self._call(tr, "broadcast_object", self.inner.broadcast_object, obj, root)

    def send_object(self, obj: Any, dest: int, tag: int = 0) -> None:
        tr = _tracer
        self.inner.send_object(obj, dest, tag) if tr is None else \
            self._call(tr, "send_object", self.inner.send_object, obj, dest, tag)

    def recv_object(self, source: int, tag: int = 0) -> Any:
        tr = _tracer
        return self.inner.recv_object(source, tag) if tr is None else \
            self._call(tr, "recv_object", self.inner.recv_object, source, tag)


class _TracedRequest(Request):
    """A request whose completion records the time blocked on it as a "wait" event (see module doc)."""

    __slots__ = ("_inner", "_name", "_args", "_since", "_done")

    def __init__(self, inner: Request, name: str, args: dict[str, Any]) -> None:
        self._inner, self._name, self._args = inner, name, args
        self._since: int | None = None  # the first failed test() of a polling caller
        self._done = False

    def _finished(self) -> None:
        self._done = True
        tr = _tracer
        if tr is not None and self._since is not None:
            tr.add_wait(f"wait {self._name}", self._since, now(), self._args)

    def test(self) -> bool:
        if self._done:
            return True
        if self._inner.test():
            self._finished()
            return True
        if self._since is None:
            self._since = now()
        return False

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            if self._since is None and not self._inner.test():
                self._since = now()
            out = self._inner.wait()
            self._finished()
            return out
        return self._inner.wait()

    def cancel(self) -> bool:
        return self._inner.cancel()
