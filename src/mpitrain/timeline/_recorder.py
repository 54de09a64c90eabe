"""The per-process event buffer: what :func:`span` and the traced communicators append to.

Nothing here imports from mpitrain, so any layer may record. When no timeline runs, :data:`current`
is None and every entry point returns after that one check (``span`` hands back a shared no-op
context manager); no tracer is set on the communicators (:mod:`mpitrain.comm.tracing`) and the
optimizer hooks are not installed then.

An event is ``(row, name, t0_ns, t1_ns, args)`` on this process's ``time.perf_counter_ns`` clock.
`row` says which thread row of the trace it belongs to: on the main thread its kind ("compute",
"comm" or "wait"), on any other thread ``(thread id, "run" | "wait")`` -- one row per thread, plus
one for its waits, so the events of one row never overlap partially (they nest, or follow each other).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

__all__ = ["Recorder", "current", "span", "record", "now", "KINDS"]

#: The kinds of event (rows of the main thread): computation, a communication call, time blocked.
KINDS = ("compute", "comm", "wait")

Row = str | tuple[int, str]
Event = tuple[Row, str, int, int, dict[str, Any] | None]

now = time.perf_counter_ns


class Recorder:
    """Events of one process, at most `max_events` (the most recent ones are kept: a deque with
    ``maxlen``; :attr:`offered` counts every event offered, so ``offered - len(events)`` were dropped;
    the count takes no lock, so with several recording threads it may miss a few). Appending is
    thread-safe (one ``deque.append`` under the GIL)."""

    def __init__(self, max_events: int) -> None:
        self.events: deque[Event] = deque(maxlen=max_events)
        self.thread_names: dict[int, str] = {}
        self.main = threading.main_thread().ident
        self.offered = 0
        self._waits = threading.local()  # per thread: the end of its last recorded wait

    def row(self, kind: str) -> Row:
        ident = threading.get_ident()
        if ident == self.main:
            return kind
        if ident not in self.thread_names:
            self.thread_names[ident] = self._unique(threading.current_thread().name)
        return (ident, "wait" if kind == "wait" else "run")

    def _unique(self, name: str) -> str:
        # Rows are labelled by thread name: two live threads of one name (two kvstores' coordinators)
        # would otherwise share a row, and their independent waits would overlap on it.
        taken, label, k = set(self.thread_names.values()), name, 2
        while label in taken:
            label, k = f"{name} #{k}", k + 1
        return label

    def add(self, kind: str, name: str, t0: int, t1: int, args: dict[str, Any] | None = None) -> None:
        self.offered += 1
        self.events.append((self.row(kind), name, t0, t1, args))

    def add_wait(self, name: str, t0: int, t1: int, args: dict[str, Any] | None = None, clip: bool = True) -> None:
        """A wait from `t0` to `t1`. With `clip` (a request's wait) it starts no earlier than this
        thread's previous wait ended: waits measured by polling several requests in turn would
        otherwise overlap on the waits row (their union, the time blocked, is kept). A wait span
        opened with :func:`span` is not clipped: the request waits inside it nest in it."""
        if clip:
            t0 = max(t0, getattr(self._waits, "end", 0))
        if t1 > t0:
            self._waits.end = max(t1, getattr(self._waits, "end", 0))
            self.add("wait", name, t0, t1, args)


#: The running recorder, or None: the one check every instrumentation point makes.
current: Recorder | None = None


class _Span:
    __slots__ = ("rec", "kind", "name", "args", "t0")

    def __init__(self, rec: Recorder, kind: str, name: str, args: dict[str, Any] | None) -> None:
        self.rec, self.kind, self.name, self.args = rec, kind, name, args
        self.t0 = 0

    def __enter__(self) -> None:
        self.t0 = now()

    def __exit__(self, *exc: object) -> None:
        if self.kind == "wait":
            self.rec.add_wait(self.name, self.t0, now(), self.args, clip=False)
        else:
            self.rec.add(self.kind, self.name, self.t0, now(), self.args)


_NULL: AbstractContextManager[None] = nullcontext()


def span(name: str, kind: str = "compute", **args: Any) -> AbstractContextManager[None]:
    """``with span("forward", micro=3):`` records the block as one event of `kind` ("compute",
    "comm" or "wait") with `args` shown in the trace viewer. Off (no timeline running): returns a
    shared no-op context manager after one None check. Spans on one thread must nest (a ``with``
    block guarantees it)."""
    rec = current
    if rec is None:
        return _NULL
    return _Span(rec, kind, name, args or None)


def record(name: str, t0_ns: int, t1_ns: int, kind: str = "compute", **args: Any) -> None:
    """Record an event timed by the caller with :func:`now` (``time.perf_counter_ns``); no-op when off."""
    rec = current
    if rec is not None:
        rec.add(kind, name, t0_ns, t1_ns, args or None)


def events_of(rec: Recorder) -> Iterator[Event]:
    """A snapshot of `rec`'s events (copied, so threads may keep appending)."""
    return iter(list(rec.events))
