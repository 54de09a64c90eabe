"""Stall watchdog for blocking waits: warn naming the rank and what it waits for, then end the job."""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .base import Request

__all__ = ["StallPolicy", "wait_watched", "watched", "DEFAULT_POLICY"]


@dataclass(frozen=True)
class StallPolicy:
    """`warn_after` seconds: print one warning; `abort_after` (None = never): print and abort the job.
    `max_nap`: the longest sleep between polls, i.e. the most latency the watchdog adds to a wait.

    The defaults suit training steps; tests and interactive runs pass smaller numbers."""

    warn_after: float = 60.0
    abort_after: float | None = 600.0
    max_nap: float = 1e-3


DEFAULT_POLICY = StallPolicy()


def wait_watched(req: Request, what: str, rank: int, abort: Callable[[int], None],
                 policy: StallPolicy = DEFAULT_POLICY) -> torch.Tensor | None:
    """``req.wait()`` with a way out: after `policy.warn_after` s one line on stderr names this `rank`
    and `what` it waits for (e.g. "recv of activation 3 of micro-batch 2 from rank 1"); after
    `policy.abort_after` s it prints again and calls `abort(1)`, which ends every rank.

    Polls ``req.test()`` with a sleep that backs off to `policy.max_nap`, so a stalled rank does not
    spin a core.
    """
    if req.test():
        return req.wait()
    start = time.monotonic()
    nap, warned = min(2e-5, policy.max_nap), False
    while not req.test():
        time.sleep(nap)
        nap = min(nap * 2, policy.max_nap)
        waited = time.monotonic() - start
        if not warned and waited >= policy.warn_after:
            warned = True
            _say(f"[mpitrain] rank {rank}: still waiting after {waited:.0f}s for {what}")
        if policy.abort_after is not None and waited >= policy.abort_after:
            _say(f"[mpitrain] rank {rank}: gave up after {waited:.0f}s waiting for {what}; aborting the job")
            abort(1)
    return req.wait()


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Monitor:
    """One daemon thread per process, waking once a second, that warns about blocking waits that
    registered with :func:`watched` and outlived their limit (once per wait)."""

    def __init__(self) -> None:
        # thread id -> (label, detail, since, warn_after); the message is formatted only if it is late
        self._waits: dict[int, tuple[str, str | Callable[[], str], float, float]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def enter(self, label: str, detail: str | Callable[[], str], warn_after: float) -> int:
        key = threading.get_ident()
        with self._lock:
            self._waits[key] = (label, detail, time.monotonic(), warn_after)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpitrain-stall-monitor", daemon=True)
                self._thread.start()
        return key

    def leave(self, key: int) -> None:
        with self._lock:
            self._waits.pop(key, None)

    def _run(self) -> None:
        warned: set[tuple[int, float]] = set()
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            with self._lock:
                late = [(k, w) for k, w in self._waits.items() if now - w[2] > w[3] and (k, w[2]) not in warned]
            for key, (label, detail, since, warn_after) in late:
                warned.add((key, since))
                text = detail() if callable(detail) else detail
                warnings.warn(f"{label} stalled for {warn_after:g} s; {text}", RuntimeWarning, stacklevel=1)


_monitor = _Monitor()


@contextmanager
def watched(label: str, detail: str | Callable[[], str], warn_after: float) -> Iterator[None]:
    """Mark the calling thread as blocked in `label` for the duration of the ``with`` block; if the block
    lasts longer than `warn_after` seconds a shared monitor thread issues one RuntimeWarning
    "<label> stalled for <warn_after> s; <detail>" (`detail` may be a callable, called only then).

    For waits that must block inside MPI rather than poll: a blocked MPI call releases the GIL, while a
    Python polling loop fights the compute thread for it (measured 10-40x slower compute steps on a busy
    machine). Entering and leaving costs a lock and a dict update; the monitor wakes once a second."""
    key = _monitor.enter(label, detail, warn_after)
    try:
        yield
    finally:
        _monitor.leave(key)
