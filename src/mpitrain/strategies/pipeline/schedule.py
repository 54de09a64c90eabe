"""Pipeline schedules as data: the order in which each stage runs forwards (F) and backwards.

A schedule is a pure function ``(stages, micro_batches, stage) -> list[Action]``. Every schedule runs
each of a stage's partitions' micro-batches in ascending order in each direction, so the messages of
one graph edge arrive in the order they are received (MPI's non-overtaking rule; tags also carry the
micro-batch). A backward is either whole (B) or split, as in the zero-bubble paper (Qi et al., 2023),
into its input-gradient half I (the partial errors the previous partition waits for: the paper's "B")
and its weight-gradient half W (parameter gradients, which nobody waits for within the step).
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

zb1p (the paper's ZB-H1) is 1F1B with the backward split: P-1-s warm-up forwards, then F / I pairs;
stage s starts emitting W (oldest first) after its first s pairs, one W after each I, and the W it
still owes fill the cool-down, where 1F1B waits for the errors of later stages. Every stage keeps at
most P micro-batches between F and W (1F1B: P - s between F and B; what W needs is less than what
I needs). For 4 stages and 6 micro-batches::

    stage 0: F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5
    stage 1: F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 I4 W3 I5 W4 W5
    stage 3: F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5

(stage 0 shown first: it emits W from its first pair on; stage s delays W by s pairs.)

zbv (the paper's ZB-V) cuts the model into 2P partitions placed in a V: rank s runs partition s
(chunk 0) and partition 2P-1-s (chunk 1), so rank 0 holds the first and the last partition and rank
P-1 the two middle ones (their edge is a message to itself). Warm-up 2(P-s)-1 chunk-0 forwards, s
chunk-1 / chunk-0 forward pairs, P-s chunk-1 F I W triples; then F I W on chunk 0 and on chunk 1
alternately; the cool-down runs the remaining input gradients first and the owed W last. M below
2P-1 leaves out the actions of the missing micro-batches of the 2P-1 schedule. For P=2, M=4::

    rank 0: F0 F1 F2 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F3 I0 W0 F2.1 I2.1 W2.1 I1 W1 F3.1 I3.1 W3.1 I2 W2 I3 W3

GPipe keeps all M micro-batches' activations alive; 1F1B keeps at most P - s on stage s. GPipe and 1F1B
take (M + P - 1) forward+backward slots on a balanced pipeline, hence the ideal efficiency
M / (M + P - 1); :func:`bubble_efficiency` simulates any schedule with given F / I / W costs.

Why no schedule can deadlock: sends never block (isend), so a stage only ever waits for a receive.
F(k, m) waits only on F(k', m) for partitions k' < k; B(k, m) and I(k, m) only on B or I of (k', m)
for k' > k (a skip edge k -> k+2 adds a dependency already implied through k+1); W waits for nothing
(it follows its own I on the same rank). :func:`simulate` runs every stage's list against exactly
these rules and raises if some stage could wait forever; the tests run it for all small P and M.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

__all__ = ["Action", "gpipe", "one_f_one_b", "interleaved_1f1b", "zb1p", "zbv", "SCHEDULES", "SPLIT", "schedule",
           "chunks_per_rank", "placement", "render", "simulate", "peak_in_flight", "ideal_efficiency",
           "bubble_efficiency"]


class Action(NamedTuple):
    """``kind`` is "F" (forward), "B" (whole backward), "I" (its input-gradient half: the errors sent
    back) or "W" (its weight-gradient half) of micro-batch ``micro`` on this rank's virtual stage
    ``chunk`` (always 0 without virtual stages; :func:`placement` says which partition it is)."""

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


class _Emitter:
    """Appends actions per chunk, each kind's micro-batches counted up from 0 (ascending by design)."""

    def __init__(self) -> None:
        self.out: list[Action] = []
        self.count: dict[tuple[str, int], int] = {}

    def __call__(self, kind: str, chunk: int = 0) -> None:
        m = self.count.get((kind, chunk), 0)
        self.count[(kind, chunk)] = m + 1
        self.out.append(Action(kind, m, chunk))

    def done(self, kind: str, chunk: int = 0) -> int:
        return self.count.get((kind, chunk), 0)


def zb1p(stages: int, micro_batches: int, stage: int) -> list[Action]:
    """ZB-H1: 1F1B's order with I for B; W of the oldest micro-batch after each I once stage s has
    run s pairs; the owed W last."""
    _check(stages, micro_batches, stage)
    warm = min(stages - 1 - stage, micro_batches)
    emit = _Emitter()
    for _ in range(warm):
        emit("F")
    for i in range(micro_batches):
        if warm + i < micro_batches:
            emit("F")
        emit("I")
        if i >= stage:
            emit("W")
    while emit.done("W") < micro_batches:
        emit("W")
    return emit.out


def zbv(stages: int, micro_batches: int, stage: int) -> list[Action]:
    """ZB-V: two chunks per rank in a V (:func:`placement`); see the module docstring for the phases.
    Built for ``max(M, 2P-1)`` micro-batches, keeping those below M."""
    _check(stages, micro_batches, stage)
    n, P, s = max(micro_batches, 2 * stages - 1), stages, stage
    emit = _Emitter()
    for _ in range(2 * (P - s) - 1):
        emit("F", 0)
    for _ in range(s):
        emit("F", 1)
        emit("F", 0)
    for _ in range(P - s):
        for kind in "FIW":
            emit(kind, 1)
    while emit.done("F", 0) < n or emit.done("F", 1) < emit.done("F", 0):
        if emit.done("F", 0) < n:
            emit("F", 0)
        for chunk, kinds in ((0, "IW"), (1, "FIW")):
            for kind in kinds:
                emit(kind, chunk)
    for _ in range(s):
        emit("I", 0)
        emit("I", 1)
    for _ in range(P - s):
        emit("I", 0)
        emit("W", 0)
    for chunk in (1, 0):
        while emit.done("W", chunk) < n:
            emit("W", chunk)
    return [a for a in emit.out if a.micro < micro_batches]


SCHEDULES: dict[str, Callable[..., list[Action]]] = {"gpipe": gpipe, "1f1b": one_f_one_b,
                                                     "interleaved-1f1b": interleaved_1f1b, "zb1p": zb1p, "zbv": zbv}
#: The schedules that split each backward into I and W.
SPLIT = frozenset({"zb1p", "zbv"})


def chunks_per_rank(name: str, virtual: int = 2) -> int:
    """Partitions per pipeline rank: `virtual` for interleaved-1f1b, 2 for zbv, else 1."""
    return virtual if name == "interleaved-1f1b" else 2 if name == "zbv" else 1


def placement(name: str, stages: int, virtual: int = 2) -> list[list[int]]:
    """``out[s][c]``: the partition that rank `s` runs as its chunk `c` (chunks in ascending partition
    order). Loop placement ``c P + s`` (interleaved-1f1b, and one chunk for the others); zbv's V:
    s and 2P-1-s."""
    v = chunks_per_rank(name, virtual)
    if name == "zbv":
        return [[s, 2 * stages - 1 - s] for s in range(stages)]
    return [[c * stages + s for c in range(v)] for s in range(stages)]


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


def simulate(stages: int, micro_batches: int, name: str, backward_cost: float = 2.0, virtual: int = 1,
             weight_cost: float | None = None, partition_costs: Sequence[float] | None = None,
             action_costs: Sequence[Mapping[str, float]] | None = None) -> float:
    """Run every rank's action list against the pipeline's data dependencies with unit-time forwards,
    `backward_cost`-time whole backwards, of which W takes `weight_cost` (default half) and I the
    rest (a chunk does 1/chunks of a rank's work); returns the makespan. `partition_costs`: each
    partition's forward + backward per micro-batch instead (seconds, say), split in the same
    proportions: the makespan of an unbalanced pipeline. `action_costs`: each partition's measured
    time per action kind (``{"F": .., "B": .., "I": .., "W": ..}``; the kinds the schedule runs),
    overriding both: a split backward may cost more than a whole one, and the first partition's I
    nothing. Raises RuntimeError on a deadlock."""
    v = chunks_per_rank(name, virtual)
    w = backward_cost / 2 if weight_cost is None else weight_cost
    share = {"F": 1.0, "B": backward_cost, "I": backward_cost - w, "W": w}
    scale = [c / (1.0 + backward_cost) for c in partition_costs] if partition_costs is not None \
        else [1.0 / v] * (stages * v)
    cost = list(action_costs) if action_costs is not None else [{k: c * x for k, c in share.items()} for x in scale]
    lists = [schedule(name, stages, micro_batches, s, virtual) for s in range(stages)]
    where = placement(name, stages, virtual)
    last = stages * v - 1
    done: dict[tuple[str, int, int], float] = {}  # ("F" | "G": errors sent | "W", partition, micro)
    pos, clock = [0] * stages, [0.0] * stages
    while any(p < len(a) for p, a in zip(pos, lists)):
        progressed = False
        for s in range(stages):
            if pos[s] == len(lists[s]):
                continue
            kind, m, chunk = lists[s][pos[s]]
            k = where[s][chunk]  # the partition this action runs
            deps = [("F", k - 1, m)] if kind == "F" and k > 0 else []
            if kind in "BI":
                deps = [("F", k, m)] + ([("G", k + 1, m)] if k < last else [])
            if kind == "W":
                deps = [("G", k, m)]
            if all(d in done for d in deps):
                start = max([clock[s], *(done[d] for d in deps)])
                clock[s] = start + cost[k][kind]
                done[("G" if kind in "BI" else kind, k, m)] = clock[s]
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: str(lists[s][pos[s]]) for s in range(stages) if pos[s] < len(lists[s])}
            raise RuntimeError(f"schedule {name!r} deadlocks for P={stages}, M={micro_batches}, v={virtual}: "
                               f"stages wait forever at {stuck}")
    return max(clock)


def peak_in_flight(name: str, stages: int, micro_batches: int, virtual: int = 2) -> float:
    """The most micro-batches any rank holds between a forward and the end of its backward (B, or W
    for the split schedules), a chunk counting 1/chunks: the activation memory in units of one
    micro-batch through a rank's layers. 1f1b: P; gpipe: M; zb1p: P; zbv: at most P."""
    v = chunks_per_rank(name, virtual)
    peak = 0.0
    for s in range(stages):
        live = 0.0
        for a in schedule(name, stages, micro_batches, s, virtual):
            live += 1 / v if a.kind == "F" else -1 / v if a.kind in "BW" else 0.0
            peak = max(peak, live)
    return peak


def ideal_efficiency(stages: int, micro_batches: int) -> float:
    """Fraction of the pipeline's time slots that do work on a balanced pipeline: M / (M + P - 1)."""
    return micro_batches / (micro_batches + stages - 1)


def bubble_efficiency(name: str, stages: int, micro_batches: int, virtual: int = 2, backward_cost: float = 2.0,
                      weight_cost: float | None = None) -> float:
    """The share of a balanced pipeline's time its ranks compute under schedule `name` (F = 1, whole
    backward `backward_cost`, W `weight_cost` of it): ``M (1 + backward_cost) / makespan``;
    M / (M + P - 1) for gpipe and 1f1b, M / (M + (P - 1) / v) for interleaved-1f1b."""
    v = chunks_per_rank(name, virtual)
    makespan = simulate(stages, micro_batches, name, backward_cost, v, weight_cost)
    return micro_batches * (1.0 + backward_cost) / makespan


if __name__ == "__main__":
    import sys

    P, M = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4, 8)
    V = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    for name in SCHEDULES:
        if name == "interleaved-1f1b" and M % P:
            continue
        for s in range(P):
            print(f"{name:16}  stage {s}: {render(schedule(name, P, M, s, V))}")
