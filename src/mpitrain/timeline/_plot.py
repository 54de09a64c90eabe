"""A matplotlib Gantt chart of a timeline JSON: one row per rank and thread, events as bars."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from typing import Any

__all__ = ["plot", "color_of"]

_COLORS = {"F": "#4C72B0", "B": "#DD8452", "I": "#E5AE38", "W": "#2CA9B8", "optimizer step": "#8172B3",
           "wait": "#C44E52", "comm": "#55A868", "step": "#E8E8E8", "other": "#937860"}
#: a pipeline action's span: F3, B3, I3, W3 (micro-batch 3), F3.1 (on the rank's chunk 1)
ACTION = re.compile(r"([FBIW])\d+(?:\.\d+)?")


def color_of(name: str, row: str) -> str:
    """Forward blue, backward orange (its input half I yellow, its weight half W teal), optimizer
    purple, waits red, messages green, fit's step light grey."""
    action = ACTION.fullmatch(name)
    if action:
        return _COLORS[action.group(1)]
    if name in ("optimizer step", "step"):
        return _COLORS[name]
    if "wait" in row or name.startswith("wait"):
        return _COLORS["wait"]
    if row == "comm" or row not in ("compute",):
        return _COLORS["comm"]
    return _COLORS["other"]


def _depths(spans: list[tuple[float, float, int]]) -> dict[int, int]:
    """Nesting depth of each span (index -> depth) on one row, spans sorted by (start, -duration)."""
    out: dict[int, int] = {}
    stack: list[float] = []
    for start, end, i in spans:
        while stack and stack[-1] <= start:
            stack.pop()
        out[i] = len(stack)
        stack.append(end)
    return out


def plot(trace: str | os.PathLike[str], out: str | os.PathLike[str], title: str | None = None,
         start_ms: float | None = None, end_ms: float | None = None, width: float = 14.0) -> str:
    """Draw `trace` (a timeline JSON) into the image `out` (format from its suffix); returns `out`.
    `start_ms`/`end_ms` cut a window of the run. Nested events are drawn thinner on top of their parent;
    a pipeline action wide enough is labelled with its name ("F3", "B0", "I2", "W2.1")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(trace) as f:
        doc: dict[str, Any] = json.load(f)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    rows: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    lo, hi = start_ms, end_ms
    for e in doc["traceEvents"]:
        if e.get("ph") != "X":
            continue
        t0, t1 = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        if (lo is not None and t1 < lo) or (hi is not None and t0 > hi):
            continue
        rows[(e["pid"], e["tid"])].append(e)
    keys = sorted(k for k in names if rows.get(k))
    shown = [(e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3) for k in keys for e in rows[k]]
    left = lo if lo is not None else min((a for a, _ in shown), default=0.0)
    right = hi if hi is not None else max((b for _, b in shown), default=1.0)
    min_label = (right - left) / 60  # a label needs about 1/60 of the width
    fig, ax = plt.subplots(figsize=(width, 0.45 * len(keys) + 1.6))
    for y, key in enumerate(keys):
        label = names[key]
        events = sorted(rows[key], key=lambda e: (e["ts"], -e["dur"]))
        depth = _depths([(e["ts"], e["ts"] + e["dur"], i) for i, e in enumerate(events)])
        for i, e in sorted(enumerate(events), key=lambda ie: depth[ie[0]]):
            d = depth[i]
            h = 0.8 * (0.75 ** d)
            x0, w = e["ts"] / 1e3, e["dur"] / 1e3
            ax.broken_barh([(x0, w)], (y - h / 2, h), facecolors=color_of(e["name"], label),
                           edgecolor="black" if e["name"] == "step" else "none", linewidth=0.4)
            if w >= min_label and ACTION.fullmatch(e["name"]):
                ax.text(x0 + w / 2, y, e["name"], ha="center", va="center", fontsize=6, color="white", clip_on=True)
    ax.set_yticks(range(len(keys)), [f"rank {pid}: {names[(pid, tid)]}" for pid, tid in keys], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the timeline started (rank 0's clock)")
    if lo is not None or hi is not None:
        ax.set_xlim(left=lo, right=hi)
    legend = [Patch(color=_COLORS[k], label=k) for k in ("F", "B", "I", "W", "optimizer step", "comm", "wait", "step")]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.6 / max(len(keys), 1)),
              ncol=8, fontsize=8, frameon=False)
    other = doc.get("otherData", {})
    ax.set_title(title or f"mpitrain timeline, {other.get('ranks', '?')} ranks, started {other.get('started', '?')}",
                 fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return os.fspath(out)
