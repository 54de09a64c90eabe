"""Waiting with a way out: one stall policy, one backoff, one polling wait and one watched blocking wait.

Every wait in mpitrain that could last forever goes through this module, with the same two limits
(:class:`StallPolicy`): after ``warn_after`` seconds a line names who waits for what, after
``abort_after`` seconds the job ends. Two shapes of waiting:

* :func:`wait_until` polls a ``done()`` test with sleeps that back off (:class:`Backoff`), so a stalled
  rank does not spin a core. For the main thread's waits (pipeline stages, kvstore negotiation).
* :func:`watched` marks a wait that must stay *blocking inside MPI* (communication threads): a Python
  polling loop fights the compute thread for the GIL, while a blocked MPI call releases it. One
  monitor thread per process warns when such a wait outlives its limit, and ends the job when it
  outlives ``abort_after`` where the waiter gave a way to (``abort``).
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["StallPolicy", "DEFAULT_POLICY", "StallError", "Backoff", "poll", "wait_until", "watched", "say"]


class StallError(TimeoutError):
    """A wait outlived ``abort_after`` where no abort function was given to end the job."""


@dataclass(frozen=True)
class StallPolicy:
    """How long a wait may take. `warn_after` seconds: one line naming who waits for what (repeated
    every `warn_after` seconds); `abort_after` (None = never): the job ends. The sleep between polls
    starts at `first_nap` and doubles up to `max_nap`, the most latency polling adds to a wait; `spin`
    seconds of back-to-back tests come first, for waits whose peers are usually already there."""

    warn_after: float = 60.0
    abort_after: float | None = 600.0
    max_nap: float = 1e-3
    first_nap: float = 2e-5
    spin: float = 0.0

    def __post_init__(self) -> None:
        if not self.warn_after > 0:
            raise ValueError(f"warn_after must be > 0 seconds, got {self.warn_after!r}")
        if self.abort_after is not None and not self.abort_after >= self.warn_after:
            raise ValueError(f"abort_after must be None or >= warn_after ({self.warn_after}), "
                             f"got {self.abort_after!r}")
        if not 0 < self.first_nap <= self.max_nap or self.spin < 0:
            raise ValueError(f"need 0 < first_nap <= max_nap and spin >= 0, got {self.first_nap}, "
                             f"{self.max_nap}, {self.spin}")


#: The limits of a training step: a warning after a minute, the end of the job after ten.
DEFAULT_POLICY = StallPolicy()


def say(line: str) -> None:
    """One line on stderr, flushed (visible even if the job is about to be aborted)."""
    print(line, file=sys.stderr, flush=True)


class Backoff:
    """The sleep between polls that find nothing: `first` seconds, doubling to `most`; ``reset()``
    after progress. With a condition variable, a sleep ends early when ``woken()`` becomes true."""

    def __init__(self, first: float = 2e-5, most: float = 1e-3) -> None:
        self.first, self.most = first, most
        self.pause = first

    def reset(self) -> None:
        self.pause = self.first

    def sleep(self, cv: threading.Condition | None = None, woken: Callable[[], bool] | None = None) -> None:
        if cv is None:
            time.sleep(self.pause)
        else:
            with cv:
                cv.wait_for(woken or (lambda: False), self.pause)
        self.pause = min(self.pause * 2, self.most)


def poll(done: Callable[[], bool], policy: StallPolicy = DEFAULT_POLICY, deadline: float | None = None,
         cv: threading.Condition | None = None) -> bool:
    """Call ``done()`` until it is true: `policy.spin` seconds back to back, then with backoff sleeps
    (an MPI test progresses the request, so sleeping between tests leaves the core to computation).
    With `cv`, each sleep is a wait on it that ends as soon as a notify finds ``done()`` true (for
    waits on other threads' progress). Returns False once ``time.monotonic()`` passes `deadline` with
    ``done()`` still false."""
    if policy.spin > 0:
        until = time.monotonic() + policy.spin
        while time.monotonic() < until:
            if done():
                return True
    nap = Backoff(policy.first_nap, policy.max_nap)
    while not done():
        if deadline is not None and time.monotonic() > deadline:
            return False
        nap.sleep(cv, done)
    return True


def wait_until(done: Callable[[], bool], what: str | Callable[[], str], policy: StallPolicy = DEFAULT_POLICY,
               *, who: str = "", abort: Callable[[int], None] | None = None,
               cv: threading.Condition | None = None) -> None:
    """Poll ``done()`` (see :func:`poll`) with a way out: every `policy.warn_after` seconds one line on
    stderr "[mpitrain] <who>: still waiting after <N>s for <what>"; after `policy.abort_after` seconds
    "gave up after ..." and ``abort(1)``, which ends every rank (without `abort`: :class:`StallError`).

    `what` may be a callable, formatted only for a late wait; `cv`: as in :func:`poll`."""
    if done():
        return
    start = time.monotonic()
    prefix = f"[mpitrain] {who}: " if who else "[mpitrain] "
    next_warning = start + policy.warn_after
    while not poll(done, policy, deadline=next_warning, cv=cv):
        waited = time.monotonic() - start
        text = what() if callable(what) else what
        if policy.abort_after is not None and waited >= policy.abort_after:
            say(f"{prefix}gave up after {waited:.0f}s waiting for {text}; aborting the job")
            if abort is None:
                raise StallError(f"{who or 'this rank'} gave up after {waited:.0f}s waiting for {text}")
            abort(1)
            return
        say(f"{prefix}still waiting after {waited:.0f}s for {text}")
        next_warning = time.monotonic() + policy.warn_after
        if policy.abort_after is not None:
            next_warning = min(next_warning, start + policy.abort_after)


@dataclass(frozen=True)
class _Watch:
    label: str
    detail: str | Callable[[], str]
    since: float
    warn_after: float
    abort_after: float | None
    abort: Callable[[int], None] | None


class _Monitor:
    """One daemon thread per process, waking once a second, that warns about blocking waits that
    registered with :func:`watched` and outlived their limit (once per wait), and ends the job for
    those that outlived their `abort_after` and gave an `abort`."""

    def __init__(self) -> None:
        # thread id -> the wait it is blocked in; the message is formatted only if it is late
        self._waits: dict[int, _Watch] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def enter(self, watch: _Watch) -> int:
        key = threading.get_ident()
        with self._lock:
            self._waits[key] = watch
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpitrain-stall-monitor", daemon=True)
                self._thread.start()
        return key

    def leave(self, key: int) -> None:
        with self._lock:
            self._waits.pop(key, None)

    def _run(self) -> None:
        warned: set[tuple[int, float]] = set()
        gave_up: set[tuple[int, float]] = set()
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            with self._lock:
                waits = list(self._waits.items())
            for key, w in waits:
                late = now - w.since
                if w.abort is not None and w.abort_after is not None and late >= w.abort_after:
                    if (key, w.since) in gave_up:
                        continue  # abort returned (it should not): once is enough
                    gave_up.add((key, w.since))
                    text = w.detail() if callable(w.detail) else w.detail
                    say(f"[mpitrain] {w.label} gave up after {late:.0f}s; {text}; aborting the job")
                    w.abort(1)
                elif late > w.warn_after and (key, w.since) not in warned:
                    warned.add((key, w.since))
                    text = w.detail() if callable(w.detail) else w.detail
                    warnings.warn(f"{w.label} stalled for {w.warn_after:g} s; {text}", RuntimeWarning, stacklevel=1)


_monitor = _Monitor()


@contextmanager
def watched(label: str, detail: str | Callable[[], str], warn_after: float, abort_after: float | None = None,
            abort: Callable[[int], None] | None = None) -> Iterator[None]:
    """Mark the calling thread as blocked in `label` for the duration of the ``with`` block; if the block
    lasts longer than `warn_after` seconds a shared monitor thread issues one RuntimeWarning
    "<label> stalled for <warn_after> s; <detail>" (`detail` may be a callable, called only then). With
    `abort_after` and `abort`, a block still running after `abort_after` seconds makes the monitor say
    "[mpitrain] <label> gave up after <N>s; <detail>; aborting the job" on stderr and call ``abort(1)``,
    which ends every rank (a thread blocked inside MPI cannot be interrupted otherwise); the monitor
    wakes once a second, so that comes within a second of the limit.

    For waits that must block inside MPI rather than poll (see the module docstring). Entering and
    leaving costs a lock and a dict update; the monitor wakes once a second."""
    key = _monitor.enter(_Watch(label, detail, time.monotonic(), warn_after, abort_after, abort))
    try:
        yield
    finally:
        _monitor.leave(key)
