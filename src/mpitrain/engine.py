"""The dependency engine (DAG paper §3.1-3.2): tasks tagged with the variables they read and mutate.

Each :class:`Var` keeps a FIFO queue of the tasks that touch it. A task becomes runnable once it
reaches the head of every queue it is in: consecutive reads of a variable run concurrently, a write
runs alone and in push order (write-after-write, write-after-read and read-after-write are all kept).
Runnable tasks go to a named thread pool ("compute", "comm", ...), so communication never waits
behind computation threads. An exception raised by a task is stored on every variable it mutates,
poisons the tasks that later read or mutate those variables (they are skipped and inherit it), and is
re-raised by :meth:`Engine.wait` / :meth:`Engine.wait_all` — never swallowed.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["Var", "Task", "Engine", "EngineError"]

log = logging.getLogger("mpitrain.engine")


class EngineError(RuntimeError):
    """Misuse of the engine (unknown pool, closed engine) or a wait that timed out."""


class Var:
    """A tag for a piece of state. Tasks that mutate a Var run one at a time in push order."""

    _ids = itertools.count()

    def __init__(self, name: str = "") -> None:
        self.name = name or f"var{next(Var._ids)}"
        self._queue: deque[tuple[Task, bool]] = deque()  # waiting (task, is_write), FIFO
        self._readers = 0  # granted reads still running
        self._writer = False  # a granted write still running
        self.error: BaseException | None = None  # from a failed task that mutated this var

    def __repr__(self) -> str:
        return f"Var({self.name!r})"


class Task:
    """A pushed function. ``done`` is set when it ran (or was skipped because an input had failed)."""

    def __init__(self, fn: Callable[[], Any], reads: list[Var], mutates: list[Var], pool: str | None,
                 name: str) -> None:
        self.fn, self.reads, self.mutates, self.pool, self.name = fn, reads, mutates, pool, name
        self.pending = len(reads) + len(mutates)  # grants still missing
        self.done = threading.Event()
        self.error: BaseException | None = None

    def __repr__(self) -> str:
        return f"Task({self.name!r}, pool={self.pool!r})"


class Engine:
    """Schedules pushed tasks on thread pools in dependency order.

    `pools` maps a pool name to its number of threads (default: 2 compute, 1 comm). Threads block
    on their queue when idle (no polling). `warn_after` seconds into any wait, a warning names the
    variable and the tasks still pending on it; `timeout` on a wait raises :class:`EngineError`.
    """

    def __init__(self, pools: Mapping[str, int] | None = None, warn_after: float = 60.0) -> None:
        self._lock = threading.Lock()
        self._warn_after = warn_after
        self._live: set[Task] = set()
        self._closed = False
        # runnable tasks per pool (None: a stop sentinel). One lock; a condition per pool wakes one of its
        # threads per queued task, and `_helped` wakes threads helping in wait (only while there are some)
        self._qlock = threading.Lock()
        self._runnable: dict[str, threading.Condition] = {}
        self._helped = threading.Condition(self._qlock)
        self._helpers = 0
        self._queues: dict[str, deque[Task | None]] = {}
        self._threads: list[threading.Thread] = []
        self._sizes = dict(pools or {"compute": 2, "comm": 1})
        for name, n in self._sizes.items():
            if n < 1:
                raise EngineError(f"pool {name!r} needs at least one thread, got {n}")
            self._queues[name] = deque()
            self._runnable[name] = threading.Condition(self._qlock)
            for i in range(n):
                t = threading.Thread(target=self._worker, args=(name,), name=f"engine-{name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    @property
    def pools(self) -> tuple[str, ...]:
        return tuple(self._queues)

    # -- pushing ---------------------------------------------------------------------------------
    def push(self, fn: Callable[[], Any], reads: Iterable[Var] = (), mutates: Iterable[Var] = (),
             pool: str | None = "compute", name: str = "") -> Task:
        """Queue `fn` behind every earlier task that conflicts on a variable; returns at once.

        A Var both read and mutated counts as mutated. Tasks pushed from one thread keep that
        thread's order on every shared variable they write. ``pool=None`` runs `fn` inline in the
        thread that releases it (only for trivial bookkeeping).
        """
        if pool is not None and pool not in self._queues:
            raise EngineError(f"unknown pool {pool!r}; this engine has {self.pools}")
        mut = list(dict.fromkeys(mutates))
        rd = [v for v in dict.fromkeys(reads) if v not in mut]
        task = Task(fn, rd, mut, pool, name or getattr(fn, "__name__", "task"))
        with self._lock:
            if self._closed:
                raise EngineError("engine is closed")
            self._live.add(task)
            task.pending += 1  # held until all queues are entered, so no grant races the enqueue
            for v in rd:
                v._queue.append((task, False))
                self._grant(v)
            for v in mut:
                v._queue.append((task, True))
                self._grant(v)
            task.pending -= 1
            ready = task.pending == 0
        if ready:
            self._dispatch([task])
        return task

    def _dispatch(self, tasks: list[Task]) -> None:
        queued = [(t, pool) for t in tasks if (pool := t.pool) is not None]
        if queued:
            with self._qlock:
                for t, pool in queued:
                    self._queues[pool].append(t)
                    self._runnable[pool].notify()
                if self._helpers:
                    self._helped.notify_all()
        for t in tasks:
            if t.pool is None:
                self._run(t)

    def _grant(self, v: Var) -> list[Task]:
        """Grant the head of `v`'s queue (caller holds the lock); returns tasks that became ready."""
        ready = []
        while v._queue:
            task, write = v._queue[0]
            if write:
                if v._writer or v._readers:
                    break
                v._writer = True
            elif v._writer:
                break
            else:
                v._readers += 1
            v._queue.popleft()
            task.pending -= 1
            if task.pending == 0:
                ready.append(task)
            if write:
                break
        return ready

    def _worker(self, pool: str) -> None:
        q, runnable = self._queues[pool], self._runnable[pool]
        while True:
            with self._qlock:
                while not q:
                    runnable.wait()
                task = q.popleft()
            if task is None:
                return
            self._run(task)

    def _run(self, task: Task) -> None:
        inherited = next((v.error for v in (*task.reads, *task.mutates) if v.error is not None), None)
        if inherited is not None:
            task.error = inherited
        else:
            try:
                task.fn()
            except BaseException as e:  # noqa: BLE001 - re-raised to the waiter, never swallowed
                task.error = e
        ready: list[Task] = []
        with self._lock:
            for v in task.mutates:
                if task.error is not None:
                    v.error = task.error
                v._writer = False
                ready += self._grant(v)
            for v in task.reads:
                v._readers -= 1
                ready += self._grant(v)
            self._live.discard(task)
        task.done.set()
        if self._helpers:  # read after done is set: a helper that registers later sees done (see wait)
            with self._qlock:
                self._helped.notify_all()
        self._dispatch(ready)

    # -- waiting ---------------------------------------------------------------------------------
    def wait(self, var: Var, timeout: float | None = None, help: str | None = None) -> None:
        """Block until every task pushed so far that reads or mutates `var` has finished; then raise
        (and clear) the error of a failed task that mutated `var`, if any.

        ``help=pool``: while waiting, the calling thread runs that pool's runnable tasks itself, in
        queue order, instead of sleeping while a pool thread wakes up for them (the hand-off costs two
        thread wake-ups per task, milliseconds on a loaded machine). Dependency order is unchanged,
        since only tasks whose variables were granted are queued; the pool may run one task more at a
        time than it has threads. Only for tasks that never wait for the waiting thread itself."""
        if help is not None and help not in self._queues:
            raise EngineError(f"unknown pool {help!r}; this engine has {self.pools}")
        marker = self.push(_noop, reads=[var], pool=None, name=f"wait({var.name})")
        self._block(marker, f"variable {var.name}", timeout, help)
        with self._lock:
            err, var.error = var.error, None
        if err is not None:
            raise err

    def wait_all(self, timeout: float | None = None) -> None:
        """Block until every task pushed so far has finished; raise the first stored error."""
        with self._lock:
            live = list(self._live)
        for t in live:
            self._block(t, "all tasks", timeout)
        with self._lock:
            errors = [t.error for t in live if t.error is not None]
            for t in live:
                for v in t.mutates:
                    v.error = None
        if errors:
            raise errors[0]

    def _block(self, task: Task, what: str, timeout: float | None, help: str | None = None) -> None:
        start = time.monotonic()
        step = self._warn_after if timeout is None else min(self._warn_after, timeout)
        while not self._wait_once(task, step, help):
            waited = time.monotonic() - start
            with self._lock:
                live = sorted(t.name for t in self._live)
            if timeout is not None and waited >= timeout:
                raise EngineError(f"waiting for {what}: timed out after {waited:.1f}s; pending tasks: {live}")
            log.warning("engine: waiting for %s for %.0fs; pending tasks: %s", what, waited, live)

    def _wait_once(self, task: Task, step: float, help: str | None) -> bool:
        """Wait up to `step` seconds for `task` (running `help`'s queued tasks meanwhile); True if done."""
        if help is None:
            return task.done.wait(step)
        q, deadline = self._queues[help], time.monotonic() + step
        while True:
            with self._qlock:
                self._helpers += 1
                try:
                    while not task.done.is_set() and not (q and q[0] is not None):
                        left = deadline - time.monotonic()
                        if left <= 0 or not self._helped.wait(left):
                            return task.done.is_set()
                    if task.done.is_set():
                        return True
                    job = q.popleft()
                finally:
                    self._helpers -= 1
            if job is not None:  # always: the loop above stops only at a task, never at a stop sentinel
                self._run(job)

    def close(self) -> None:
        """Finish queued tasks and stop the threads (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with self._qlock:
            for name, q in self._queues.items():
                q.extend([None] * self._sizes[name])
                self._runnable[name].notify_all()
        for t in self._threads:
            t.join()


def _noop() -> None:
    pass

