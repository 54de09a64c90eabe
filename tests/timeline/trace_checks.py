"""Checks of a Chrome-trace document shared by the timeline tests: structure, nesting, schedule order."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

__all__ = ["problems", "x_events", "stage_orders", "row_names"]

_TOL_US = 1e-3  # times are ns / 1000 in floats: allow the last digit


def x_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e.get("ph") == "X"]


def row_names(doc: dict[str, Any]) -> dict[tuple[int, int], str]:
    """(pid, tid) -> the thread row's name."""
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
            if e.get("ph") == "M" and e["name"] == "thread_name"}


def problems(doc: dict[str, Any]) -> list[str]:
    """Everything wrong with `doc` as a trace: missing fields, rows without a name, events of one
    thread row that overlap without nesting. Empty when valid."""
    out = []
    if not isinstance(doc.get("traceEvents"), list):
        return ["no traceEvents list"]
    names = row_names(doc)
    rows: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for e in x_events(doc):
        missing = [k for k in ("ts", "dur", "pid", "tid", "name") if k not in e]
        if missing:
            out.append(f"event {e} lacks {missing}")
            continue
        if e["dur"] < 0:
            out.append(f"event {e} has a negative duration")
        if (e["pid"], e["tid"]) not in names:
            out.append(f"event {e['name']} on an unnamed row {(e['pid'], e['tid'])}")
        rows[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    for key, spans in rows.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        for s in spans:
            while stack and stack[-1][1] <= s[0] + _TOL_US:
                stack.pop()
            if stack and s[1] > stack[-1][1] + _TOL_US:
                out.append(f"row {key} ({names.get(key)}): {s} overlaps {stack[-1]} without nesting")
            stack.append(s)
    return out


def stage_orders(doc: dict[str, Any]) -> dict[int, list[str]]:
    """Per process (rank), the names of its pipeline actions ("F0", "B3", "I2", "W2.1", ...) in time order."""
    out: dict[int, list[tuple[float, str]]] = defaultdict(list)
    for e in x_events(doc):
        if re.fullmatch(r"[FBIW]\d+(\.\d+)?", e["name"]):
            out[e["pid"]].append((e["ts"], e["name"]))
    return {pid: [n for _, n in sorted(v)] for pid, v in out.items()}
