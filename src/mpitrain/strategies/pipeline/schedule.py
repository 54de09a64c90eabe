"""Pipeline schedules as data: the order in which each stage runs forwards (F) and backwards (B).

A schedule is a pure function ``(stages, micro_batches, stage) -> list[Action]``. Both schedules run
every stage's micro-batches in ascending order in each direction, so the messages of one graph edge
arrive in the order they are received (MPI's non-overtaking rule; tags also carry the micro-batch).
For 4 stages and 6 micro-batches (`python -m mpitrain.strategies.pipeline.schedule 4 6`)::

    gpipe   stage 0: F0 F1 F2 F3 F4 F5 B0 B1 B2 B3 B4 B5
            stage 3: F0 F1 F2 F3 F4 F5 B0 B1 B2 B3 B4 B5
    1f1b    stage 0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5      (P-1-s warm-up forwards, then
            stage 1: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5       one forward / one backward,
            stage 2: F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5       then the remaining backwards)
            stage 3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5

GPipe keeps all M micro-batches' activations alive; 1F1B keeps at most P - s on stage s. Both take
(M + P - 1) forward+backward slots on a balanced pipeline, hence the ideal efficiency M / (M + P - 1).

Why no schedule can deadlock: sends never block (isend), so a stage only ever waits for a receive.
F(s, m) waits only on F(s', m) for s' < s and B(s, m) only on B(s', m) for s' > s (a skip edge
s -> s+2 adds a dependency already implied through s+1). :func:`simulate` runs every stage's list
against exactly these rules and raises if some stage could wait forever; the tests run it for all
small P and M.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Action", "gpipe", "one_f_one_b", "SCHEDULES", "render", "simulate", "ideal_efficiency"]


class Action(NamedTuple):
    """``kind`` is "F" (forward) or "B" (backward) of micro-batch ``micro``."""

    kind: str
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}"


def gpipe(stages: int, micro_batches: int, stage: int) -> list[Action]:
    """Fill-drain: all forwards, then all backwards."""
    _check(stages, micro_batches, stage)
    return [Action("F", m) for m in range(micro_batches)] + [Action("B", m) for m in range(micro_batches)]


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[Action]:
    """PipeDream-flush: ``P-1-s`` warm-up forwards, then alternate F/B, then drain the backwards."""
    _check(stages, micro_batches, stage)
    warm = min(stages - 1 - stage, micro_batches)
    out = [Action("F", m) for m in range(warm)]
    for i in range(micro_batches - warm):
        out += [Action("F", warm + i), Action("B", i)]
    return out + [Action("B", m) for m in range(micro_batches - warm, micro_batches)]


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _check(stages: int, micro_batches: int, stage: int) -> None:
    if stages < 1 or micro_batches < 1 or not 0 <= stage < stages:
        raise ValueError(f"need stages >= 1, micro_batches >= 1 and 0 <= stage < stages; got {stages}, "
                         f"{micro_batches}, {stage}")


def render(actions: list[Action]) -> str:
    return " ".join(map(str, actions))


def simulate(stages: int, micro_batches: int, schedule: str, backward_cost: float = 2.0) -> float:
    """Run every stage's action list against the pipeline's data dependencies with unit-time forwards
    and `backward_cost`-time backwards; returns the makespan. Raises RuntimeError on a deadlock."""
    lists = [SCHEDULES[schedule](stages, micro_batches, s) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * stages, [0.0] * stages
    while any(p < len(a) for p, a in zip(pos, lists)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            kind, m = lists[s][pos[s]]
            deps = [("F", s - 1, m)] if kind == "F" and s > 0 else []
            if kind == "B":
                deps = [("F", s, m)] + ([("B", s + 1, m)] if s < stages - 1 else [])
            if all(d in done for d in deps):
                start = max([clock[s], *(done[d] for d in deps)])
                clock[s] = start + (1.0 if kind == "F" else backward_cost)
                done[(kind, s, m)] = clock[s]
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(lists[s][pos[s]]) for s in range(stages) if pos[s] < len(lists[s])}
            raise RuntimeError(f"schedule {schedule!r} deadlocks for P={stages}, M={micro_batches}: "
                               f"stages wait forever at {stuck}")
    return max(clock)


def ideal_efficiency(stages: int, micro_batches: int) -> float:
    """Fraction of the pipeline's time slots that do work on a balanced pipeline: M / (M + P - 1)."""
    return micro_batches / (micro_batches + stages - 1)


if __name__ == "__main__":
    import sys

    P, M = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4, 6)
    for name, fn in SCHEDULES.items():
        for s in range(P):
            print(f"{name:6}  stage {s}: {render(fn(P, M, s))}")
