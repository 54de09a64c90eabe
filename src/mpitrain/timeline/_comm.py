"""Recording every Communicator call and the time blocked on it, installed only while a timeline runs.

:func:`install` replaces the collective and point-to-point methods of every concrete Communicator
class (both backends, every communicator they create: the world, its splits, duplicates) with a
recording wrapper, and :func:`uninstall` puts the originals back, so an idle timeline costs nothing.
What is recorded:

* a blocking call (``allreduce``, ``send``, ``recv``, ``barrier``, ...): one "comm" event with its
  name, ``bytes`` (of the tensor argument), ``peer`` (root, destination or source) and ``ranks`` (the
  communicator's size); its duration is the time blocked in it;
* a nonblocking call (``iallreduce``, ``isend``, ...): a "comm" event for issuing it, and its request
  is wrapped so that the time blocked completing it is a "wait" event: from the ``wait()`` call, or
  from the first ``test()`` that found it incomplete when the caller polls, to completion;
* a call made inside another recorded call of the same thread (a backend's ``send`` that is
  ``isend().wait()``) is not recorded again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..comm.base import Communicator, Request
from . import _recorder
from ._recorder import now

__all__ = ["install", "uninstall", "METHODS"]

# method -> (position of the tensor argument or None, its keyword, position of the peer or None, its keyword)
METHODS: dict[str, tuple[int | None, str, int | None, str]] = {
    "allreduce": (0, "t", None, ""),
    "broadcast": (0, "t", 1, "root"),
    "allgather": (0, "t", None, ""),
    "reduce_scatter": (0, "t", None, ""),
    "alltoallv": (0, "send", None, ""),
    "barrier": (None, "", None, ""),
    "send": (0, "t", 1, "dest"),
    "recv": (0, "t", 1, "source"),
    "sendrecv": (0, "send", 1, "dest"),
    "iallreduce": (0, "t", None, ""),
    "ibroadcast": (0, "t", 1, "root"),
    "isend": (0, "t", 1, "dest"),
    "irecv": (0, "t", 1, "source"),
    "allgather_object": (None, "", None, ""),
    "broadcast_object": (None, "", 1, "root"),
    "send_object": (None, "", 1, "dest"),
    "recv_object": (None, "", 0, "source"),
}
_NONBLOCKING = {"iallreduce", "ibroadcast", "isend", "irecv"}
_ROOTED = {"broadcast", "ibroadcast", "broadcast_object"}  # peer defaults to root 0


class _Busy(threading.local):
    inside = False


_busy = _Busy()
_saved: list[tuple[type, str, Any]] = []


def _args(comm: Communicator, spec: tuple[int | None, str, int | None, str], name: str, a: tuple[Any, ...],
          kw: dict[str, Any]) -> dict[str, Any]:
    tpos, tkw, ppos, pkw = spec
    out: dict[str, Any] = {"ranks": comm.size}
    if tpos is not None:
        t = a[tpos] if len(a) > tpos else kw.get(tkw)
        if isinstance(t, torch.Tensor):
            out["bytes"] = t.numel() * t.element_size()
    if ppos is not None:
        peer = a[ppos] if len(a) > ppos else kw.get(pkw, 0 if name in _ROOTED else None)
        if peer is not None:
            out["peer"] = peer
    return out


def _wrap(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    spec = METHODS[name]
    nonblocking = name in _NONBLOCKING

    def recorded(self: Communicator, *a: Any, **kw: Any) -> Any:
        rec = _recorder.current
        if rec is None or _busy.inside:
            return fn(self, *a, **kw)
        _busy.inside = True
        t0 = now()
        try:
            out = fn(self, *a, **kw)
        finally:
            _busy.inside = False
        args = _args(self, spec, name, a, kw)
        rec.add("comm", name, t0, now(), args)
        return _TracedRequest(out, name, args) if nonblocking else out

    recorded.__wrapped__ = fn  # type: ignore[attr-defined]
    recorded.__doc__, recorded.__name__, recorded.__qualname__ = fn.__doc__, fn.__name__, fn.__qualname__
    return recorded


class _TracedRequest(Request):
    """A request whose completion records the time blocked on it as a "wait" event (see module doc)."""

    __slots__ = ("_inner", "_name", "_args", "_since", "_done")

    def __init__(self, inner: Request, name: str, args: dict[str, Any]) -> None:
        self._inner, self._name, self._args = inner, name, args
        self._since: int | None = None  # the first failed test() of a polling caller
        self._done = False

    def _finished(self) -> None:
        self._done = True
        rec = _recorder.current
        if rec is not None and self._since is not None:
            rec.add_wait(f"wait {self._name}", self._since, now(), self._args)

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


def _classes(root: type) -> list[type]:
    out, todo = [], [root]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def install() -> None:
    """Wrap the methods of every Communicator class imported so far (idempotent)."""
    if _saved:
        return
    for cls in _classes(Communicator):
        for name in METHODS:
            fn = cls.__dict__.get(name)
            if fn is not None and callable(fn) and not getattr(fn, "__isabstractmethod__", False):
                _saved.append((cls, name, fn))
                setattr(cls, name, _wrap(fn, name))


def uninstall() -> None:
    """Put every wrapped method back."""
    while _saved:
        cls, name, fn = _saved.pop()
        setattr(cls, name, fn)
