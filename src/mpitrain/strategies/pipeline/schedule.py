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

interleaved-1f1b (Megatron-LM's interleaved schedule) cuts the model into P * v partitions; rank s
runs partitions s, s + P, ..., s + (v-1)P (its v *virtual stages*, "chunks"). Micro-batches go
through the chunks in groups of P, so M must be a multiple of P; the bubble shrinks to (P-1)/v
slots. For P=2, M=4, v=2 (`F2.1`: forward of micro-batch 2 on chunk 1)::

    rank 0: F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0
    rank 1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0

GPipe keeps all M micro-batches' activations alive; 1F1B keeps at most P - s on stage s. Both take
(M + P - 1) forward+backward slots on a balanced pipeline, hence the ideal efficiency M / (M + P - 1).

Why no schedule can deadlock: sends never block (isend), so a stage only ever waits for a receive.
F(k, m) waits only on F(k', m) for partitions k' < k and B(k, m) only on B(k', m) for k' > k (a
skip edge k -> k+2 adds a dependency already implied through k+1). :func:`simulate` runs every stage's list
against exactly these rules and raises if some stage could wait forever; the tests run it for all
small P and M.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

__all__ = ["Action", "gpipe", "one_f_one_b", "interleaved_1f1b", "SCHEDULES", "schedule", "render",
           "simulate", "ideal_efficiency"]


class Action(NamedTuple):
    """``kind`` is "F" (forward) or "B" (backward) of micro-batch ``micro`` on this rank's virtual
    stage ``chunk`` (partition ``chunk * P + stage``; always 0 without virtual stages)."""

    kind: str
    micro: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


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


def interleaved_1f1b(stages: int, micro_batches: int, stage: int, virtual: int = 2) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: `virtual` chunks per rank, micro-batches in groups of `stages`.

    The k-th forward of a rank runs micro-batch ``(k // (P v)) P + k % P`` on chunk ``(k // P) % v``;
    backwards visit the chunks in reverse. ``2 (P-1-s) + (v-1) P`` warm-up forwards (all of them when
    M == P), then one forward / one backward, then the remaining backwards."""
    _check(stages, micro_batches, stage)
    if virtual < 1 or micro_batches % stages:
        raise ValueError(f"interleaved-1f1b needs virtual >= 1 and micro_batches a multiple of the "
                         f"{stages} pipeline ranks; got virtual={virtual}, micro_batches={micro_batches}")
    total, group = micro_batches * virtual, stages * virtual

    def action(kind: str, k: int) -> Action:
        chunk = (k % group) // stages
        return Action(kind, (k // group) * stages + k % stages, chunk if kind == "F" else virtual - 1 - chunk)

    warm = total if micro_batches == stages else min(total, 2 * (stages - 1 - stage) + (virtual - 1) * stages)
    out = [action("F", k) for k in range(warm)]
    for k in range(total - warm):
        out += [action("F", warm + k), action("B", k)]
    return out + [action("B", k) for k in range(total - warm, total)]


SCHEDULES: dict[str, Callable[..., list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b,
                                                     "interleaved-1f1b": interleaved_1f1b}


def schedule(name: str, stages: int, micro_batches: int, stage: int, virtual: int = 1) -> list[Action]:
    """The action list of rank `stage` for schedule `name` (`virtual` chunks for interleaved-1f1b)."""
    if name == "interleaved-1f1b":
        return interleaved_1f1b(stages, micro_batches, stage, virtual)
    return SCHEDULES[name](stages, micro_batches, stage)


def _check(stages: int, micro_batches: int, stage: int) -> None:
    if stages < 1 or micro_batches < 1 or not 0 <= stage < stages:
        raise ValueError(f"need stages >= 1, micro_batches >= 1 and 0 <= stage < stages; got {stages}, "
                         f"{micro_batches}, {stage}")


def render(actions: list[Action]) -> str:
    return " ".join(map(str, actions))


def simulate(stages: int, micro_batches: int, name: str, backward_cost: float = 2.0, virtual: int = 1) -> float:
    """Run every rank's action list against the pipeline's data dependencies with unit-time forwards
    and `backward_cost`-time backwards (a virtual stage does 1/`virtual` of a rank's work); returns
    the makespan. Raises RuntimeError on a deadlock."""
    lists = [schedule(name, stages, micro_batches, s, virtual) for s in range(stages)]
    last = stages * virtual - 1
    done: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * stages, [0.0] * stages
    while any(p < len(a) for p, a in zip(pos, lists)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            kind, m, chunk = lists[s][pos[s]]
            k = chunk * stages + s  # the partition this action runs
            deps = [("F", k - 1, m)] if kind == "F" and k > 0 else []
            if kind == "B":
                deps = [("F", k, m)] + ([("B", k + 1, m)] if k < last else [])
            if all(d in done for d in deps):
                start = max([clock[s], *(done[d] for d in deps)])
                clock[s] = start + (1.0 if kind == "F" else backward_cost) / virtual
                done[(kind, k, m)] = clock[s]
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(lists[s][pos[s]]) for s in range(stages) if pos[s] < len(lists[s])}
            raise RuntimeError(f"schedule {name!r} deadlocks for P={stages}, M={micro_batches}, v={virtual}: "
                               f"stages wait forever at {stuck}")
    return max(clock)


def ideal_efficiency(stages: int, micro_batches: int) -> float:
    """Fraction of the pipeline's time slots that do work on a balanced pipeline: M / (M + P - 1)."""
    return micro_batches / (micro_batches + stages - 1)


if __name__ == "__main__":
    import sys

    P, M = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4, 8)
    V = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    for name in SCHEDULES:
        if name == "interleaved-1f1b" and M % P:
            continue
        for s in range(P):
            print(f"{name:16}  stage {s}: {render(schedule(name, P, M, s, V))}")
