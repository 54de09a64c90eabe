"""Starting and stopping the job's timeline: clock alignment, hooks, the merge on rank 0."""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from ..comm.base import CommError, Communicator
from ..comm.tracing import set_tracer
from ..runtime import world
from . import _recorder
from ._clock import ClockSync, measure
from ._recorder import Recorder, now
from ._trace import local_rows, merge

__all__ = ["start", "stop", "discard", "recording", "active", "start_from_env", "DEFAULT_MAX_EVENTS", "ENV"]

#: Events kept per rank (the most recent ones); older ones are dropped and counted in the trace's
#: ``otherData.dropped``. At ~120 bytes of JSON per event, the default bounds a rank's share of the
#: file to about 12 MB.
DEFAULT_MAX_EVENTS = 100_000

_GATHER_TAG = 32124  # the events' messages to rank 0 at stop (the clock's ping-pongs use 32123)

#: The environment variable that starts a timeline in ``mpitrain.init()`` for any program.
ENV = "MPITRAIN_TIMELINE"


@dataclass
class _Session:
    path: str
    comm: Communicator
    rec: Recorder
    sync: ClockSync
    origin_ns: int  # rank 0's clock when the timeline started
    started: float
    hooks: list[RemovableHandle] = field(default_factory=list)


_session: _Session | None = None


def active() -> bool:
    """Whether a timeline is recording in this process."""
    return _session is not None


def start(path: str | os.PathLike[str], comm: Communicator | None = None,
          max_events: int = DEFAULT_MAX_EVENTS) -> None:
    """Start recording the job's timeline, to be written to `path` by rank 0 at :func:`stop`.

    Collective over `comm` (default: the world): every rank calls it with the same arguments; the
    ranks' clocks are aligned to rank 0's here (a few ping-pongs each). Records, until ``stop()``:
    every call on a traced Communicator -- the world and every communicator split from it, composed
    with the tracing layer by ``mpitrain.init()`` (:mod:`mpitrain.comm.tracing`): collectives and
    messages with their bytes and peer, nonblocking ones with the time blocked completing them --,
    every optimizer step, and the spans the strategies
    and the user open with :func:`span`. Keeps the most recent `max_events` events per rank.
    A bad argument raises ValueError on every rank before any message; starting twice raises
    RuntimeError."""
    global _session
    if _session is not None:
        raise RuntimeError(f"a timeline is already recording (to {_session.path!r}); stop() it first")
    if not isinstance(max_events, int) or max_events < 1:
        raise ValueError(f"max_events must be a positive int, got {max_events!r}")
    path = os.fspath(path)
    if not path:
        raise ValueError("the timeline needs a file path")
    if comm is None:
        comm = world()
    sync = measure(comm)
    # rank 0's start, on every rank's own clock: its events are then placed relative to it
    origin = int(comm.broadcast_object(now() if comm.rank == 0 else None, root=0))
    rec = Recorder(max_events)
    _session = _Session(path, comm, rec, sync, origin, time.time())
    _session.hooks = _optimizer_hooks()
    set_tracer(rec)  # the traced communicators' layer records from now on
    _recorder.current = rec


def _optimizer_hooks() -> list[RemovableHandle]:
    """Every optimizer's ``step()`` becomes a "compute" event named after its class."""
    began: dict[int, int] = {}

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        began[id(opt)] = now()

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        t0 = began.pop(id(opt), None)
        rec = _recorder.current
        if t0 is not None and rec is not None:
            rec.add("compute", "optimizer step", t0, now(), {"optimizer": type(opt).__name__})

    return [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]


def discard() -> None:
    """Stop recording in this process without writing anything (no message: for error paths, where
    the other ranks may not reach :func:`stop`)."""
    _detach()


def _detach() -> _Session | None:
    """Stop recording in this process (no message); returns the session that ran."""
    global _session
    session, _session = _session, None
    _recorder.current = None
    set_tracer(None)
    if session is not None:
        for h in session.hooks:
            h.remove()
    return session


def stop() -> str | None:
    """Stop recording and write the job's trace. Collective over the timeline's communicator: every
    rank sends its events to rank 0, which writes one Chrome-trace JSON (open it in Perfetto or
    ``chrome://tracing``, or draw it with ``mpitrain timeline plot``). Returns the path on rank 0 and
    None elsewhere; a no-op returning None when no timeline runs."""
    session = _detach()
    if session is None:
        return None
    comm, rec = session.comm, session.rec
    rows = local_rows(rec, list(rec.events), session.origin_ns, session.sync.offset_ns)
    mine = {"rows": rows, "offset_us": session.sync.offset_ns / 1e3, "rtt_us": session.sync.rtt_ns / 1e3,
            "dropped": max(0, rec.offered - len(rows))}
    if comm.rank != 0:  # rank 0 alone holds the whole trace (each rank's share bounded by max_events)
        comm.send_object(mine, 0, _GATHER_TAG)
        return None
    every = [mine] + [comm.recv_object(r, _GATHER_TAG) for r in range(1, comm.size)]
    other = {"generator": "mpitrain.timeline", "ranks": comm.size,
             "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(session.started)),
             "max_events_per_rank": rec.events.maxlen,
             "clock_offset_us": [m["offset_us"] for m in every], "clock_rtt_us": [m["rtt_us"] for m in every],
             "dropped": [m["dropped"] for m in every]}
    doc = merge([m["rows"] for m in every], other)
    directory = os.path.dirname(os.path.abspath(session.path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{session.path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"), default=str)
    os.replace(tmp, session.path)
    return session.path


@contextmanager
def recording(path: str | os.PathLike[str] | None, comm: Communicator | None = None) -> Iterator[None]:
    """``with recording(path, comm):`` -- a timeline of the block written to `path` when it ends
    normally (collective, as :func:`start`/:func:`stop`); on an exception it is discarded locally (the
    other ranks may not reach the end). Does nothing when `path` is None or a timeline already runs
    (the block's events then go to that one). What ``fit(timeline=...)`` uses."""
    if path is None or _session is not None:
        yield
        return
    start(path, comm)
    try:
        yield
    except BaseException:
        discard()
        raise
    stop()


def start_from_env(comm: Communicator) -> None:
    """Called by ``mpitrain.init()`` once it has built the world (``runtime.on_init``, wired by the
    ``mpitrain`` package): when :data:`ENV` names a file, start a timeline over `comm` and
    write it when the program exits normally (every rank reaches exit: the merge is collective)."""
    path = os.environ.get(ENV)
    if not path or _session is not None:
        return
    start(path, comm)
    atexit.register(_stop_at_exit)


def _stop_at_exit() -> None:
    try:
        written = stop()
    except CommError:  # the communicator was finalized before us: nothing can be merged any more
        _detach()
        return
    if written:
        print(f"[mpitrain] timeline written to {written}", flush=True)
