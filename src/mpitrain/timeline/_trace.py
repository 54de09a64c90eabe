"""Chrome-trace / Perfetto JSON: one process row per rank, one thread row per activity.

Each rank turns its events into compact rows (:func:`local_rows`) on rank 0's clock; rank 0 merges
them into one ``{"traceEvents": [...], "otherData": {...}}`` document (:func:`merge`). Times are in
microseconds from the moment the timeline started on rank 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ._recorder import Event, Recorder

__all__ = ["local_rows", "merge", "ROW_ORDER"]

#: Thread rows of the main thread, in display order; other threads follow, each with its waits.
ROW_ORDER = {"compute": "compute", "comm": "comm", "wait": "waits"}

# (row label, name, ts_us, dur_us, args)
Compact = tuple[str, str, float, float, dict[str, Any] | None]


def _label(rec: Recorder, row: str | tuple[int, str]) -> str:
    if isinstance(row, str):
        return ROW_ORDER.get(row, row)
    ident, what = row
    name = rec.thread_names.get(ident, str(ident))
    return f"{name} waits" if what == "wait" else name


def local_rows(rec: Recorder, events: Iterable[Event], origin_ns: int, offset_ns: int) -> list[Compact]:
    """This rank's events with times in microseconds on rank 0's clock since `origin_ns` (rank 0's start).
    Sorted by start, then longest first, so a parent precedes the events it contains."""
    out = [(_label(rec, row), name, (t0 + offset_ns - origin_ns) / 1e3, (t1 - t0) / 1e3, args)
           for row, name, t0, t1, args in events]
    out.sort(key=lambda e: (e[2], -e[3]))
    return out


def _sort_key(label: str) -> tuple[int, str]:
    order = list(ROW_ORDER.values())
    return (order.index(label), "") if label in order else (len(order), label)


def merge(per_rank: Sequence[list[Compact]], other: dict[str, Any]) -> dict[str, Any]:
    """The trace document: metadata naming each rank's process and thread rows, then every rank's
    complete ("X") events; `other` goes to ``otherData``."""
    events: list[dict[str, Any]] = []
    for rank, rows in enumerate(per_rank):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        labels = sorted({label for label, *_ in rows} | {"compute", "comm", "waits"}, key=_sort_key)
        tids = {label: i + 1 for i, label in enumerate(labels)}
        for label, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
        for label, name, ts, dur, args in rows:
            ev: dict[str, Any] = {"ph": "X", "name": name, "cat": label, "ts": ts, "dur": dur, "pid": rank,
                                  "tid": tids[label]}
            if args:
                ev["args"] = args
            events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}
