"""A timeline of every rank: one Chrome-trace / Perfetto JSON for the whole job (docs/timeline.md).

Three ways to record one:

* ``fit(..., timeline="trace.json")``;
* ``MPITRAIN_TIMELINE=trace.json`` in the environment of any program (read once by
  ``mpitrain.init()``; the file is written when the program exits);
* ``mpitrain.timeline.start("trace.json")`` ... ``mpitrain.timeline.stop()`` (both collective).

Rank 0 writes one process row per rank and one thread row per activity: compute (spans opened with
:func:`span`: forward/backward per pipeline stage and micro-batch, optimizer steps), comm (every
call on the world communicator and its splits, with bytes and peer: the tracing layer the world
is composed with, :mod:`mpitrain.comm.tracing`), waits (time blocked on a message or collective),
and one row per other thread (Pipe-SGD's communication thread, the kvstore's) with its waits. Clocks
are aligned to rank 0's at start. When no timeline runs, no tracer is set (a traced call costs one
check more) and :func:`span` returns after one None check. :func:`plot` (``mpitrain timeline plot
trace.json -o out.png``) draws a trace as a Gantt chart;
:func:`occupancy` (``mpitrain timeline bubble trace.json``) measures the pipeline bubble in it.
"""

from __future__ import annotations

from ._occupancy import Occupancy, format_occupancy, occupancy
from ._plot import plot
from ._recorder import KINDS, now, record, span
from ._session import DEFAULT_MAX_EVENTS, ENV, active, discard, recording, start, start_from_env, stop

__all__ = ["start", "stop", "discard", "recording", "active", "span", "record", "now", "KINDS",
           "DEFAULT_MAX_EVENTS", "ENV", "plot", "occupancy", "format_occupancy", "Occupancy", "start_from_env"]
