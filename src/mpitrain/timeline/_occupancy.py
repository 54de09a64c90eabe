"""The pipeline bubble measured from a timeline JSON: how much of each step a rank's pipeline actions
(F, B, I, W spans on its compute row) keep it busy.

Per rank and per fit ``step`` span (the first `skip` left out: the first step captures and splits the
model): ``step`` its duration, ``window`` the time from the first pipeline action's start to the last
one's end, ``waits`` the time blocked on messages inside it (the waits row: an action's span includes
the receive it waits for), ``compute`` = the actions' summed durations (they run one after another on
the main thread) minus those waits. ``busy`` = compute / window is the schedule's own efficiency on
that rank (1 - busy: the bubble, whether spent waiting or not); compute / step also counts what the
step does around the schedule (gradient reductions, optimizer, loss allreduce). Medians over the steps.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ._plot import ACTION

__all__ = ["Occupancy", "occupancy", "format_occupancy"]


@dataclass(frozen=True)
class Occupancy:
    """One rank's medians over the steps (milliseconds) and the shares derived from them."""

    rank: int
    steps: int
    step_ms: float
    window_ms: float
    waits_ms: float
    compute_ms: float

    @property
    def busy(self) -> float:
        """compute / window: the share of the schedule's span this rank computes."""
        return self.compute_ms / self.window_ms if self.window_ms else 0.0

    @property
    def of_step(self) -> float:
        return self.compute_ms / self.step_ms if self.step_ms else 0.0


def occupancy(trace: str | os.PathLike[str] | dict[str, Any], skip: int = 1) -> list[Occupancy]:
    """Every rank's :class:`Occupancy` in `trace` (a path or the loaded JSON), skipping each rank's
    first `skip` steps. Ranks without a step span or without actions are left out."""
    if isinstance(trace, dict):
        doc = trace
    else:
        with open(trace) as f:
            doc = json.load(f)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans: dict[tuple[int, str], list[tuple[float, float]]] = defaultdict(list)  # (rank, what) -> spans
    for e in doc["traceEvents"]:
        row = rows.get((e["pid"], e["tid"])) if e.get("ph") == "X" else None
        what = ("step" if e["name"] == "step" else "action" if ACTION.fullmatch(e["name"]) else None) \
            if row == "compute" else "wait" if row == "waits" else None
        if what is not None:
            spans[(e["pid"], what)].append((e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3))
    out = []
    for rank in sorted({r for r, what in spans if what == "step"}):
        per_step = []
        for t0, t1 in sorted(spans[(rank, "step")])[skip:]:
            inside = [(a, b) for a, b in spans[(rank, "action")] if t0 <= a and b <= t1]
            if not inside:
                continue
            lo, hi = min(a for a, _ in inside), max(b for _, b in inside)
            waits = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in spans[(rank, "wait")])
            per_step.append((t1 - t0, hi - lo, waits, sum(b - a for a, b in inside) - waits))
        if per_step:
            out.append(Occupancy(rank, len(per_step), *(statistics.median(v) for v in zip(*per_step))))
    return out


def format_occupancy(rows: list[Occupancy]) -> str:
    """A text table of :func:`occupancy`, with the mean over ranks."""
    lines = ["rank  steps  step ms  window ms  waits ms  compute ms  busy (compute/window)  compute/step"]
    for r in rows:
        lines.append(f"{r.rank:>4}  {r.steps:>5}  {r.step_ms:>7.1f}  {r.window_ms:>9.1f}  {r.waits_ms:>8.1f}  "
                     f"{r.compute_ms:>10.1f}  {r.busy:>21.3f}  {r.of_step:>12.3f}")
    if rows:
        busy, of_step = statistics.mean(r.busy for r in rows), statistics.mean(r.of_step for r in rows)
        lines.append(f"mean  {'':>5}  {'':>7}  {'':>9}  {'':>8}  {'':>10}  {busy:>21.3f}  {of_step:>12.3f}")
    return "\n".join(lines)
