"""Schedules as printable data, checked in one process: order, memory bound, no deadlock, ideal time."""

from __future__ import annotations

import pytest

from mpitrain.strategies.pipeline.schedule import (
    SCHEDULES,
    gpipe,
    ideal_efficiency,
    interleaved_1f1b,
    one_f_one_b,
    render,
    schedule,
    simulate,
)


def layouts():
    """(P, M, v) for every schedule: interleaved needs M a multiple of P; v only means something there."""
    for name in sorted(SCHEDULES):
        for P in range(1, 6):
            for M in range(1, 9):
                for v in ((1, 2, 3) if name == "interleaved-1f1b" else (1,)):
                    if name != "interleaved-1f1b" or M % P == 0:
                        yield name, P, M, v


def test_1f1b_for_4_stages_and_6_micro_batches_is_the_documented_table():
    assert [render(one_f_one_b(4, 6, s)) for s in range(4)] == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    assert render(gpipe(2, 3, 1)) == "F0 F1 F2 B0 B1 B2"


def test_interleaved_for_2_ranks_4_micro_batches_2_chunks_is_the_documented_table():
    assert [render(interleaved_1f1b(2, 4, s, 2)) for s in range(2)] == [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
    ]


def test_every_chunk_runs_each_micro_batch_once_each_way_in_ascending_order():
    for name, P, M, v in layouts():
        for s in range(P):
            acts = schedule(name, P, M, s, v)
            for c in range(v):
                for kind in "FB":
                    assert [a.micro for a in acts if a.kind == kind and a.chunk == c] == list(range(M))
                assert all(acts.index(("F", m, c)) < acts.index(("B", m, c)) for m in range(M))
            assert len(acts) == 2 * M * v


def test_1f1b_keeps_at_most_P_minus_s_micro_batches_in_flight_gpipe_keeps_all():
    for P in range(1, 6):
        for M in range(1, 9):
            for s in range(P):
                for name, bound in (("1f1b", min(P - s, M)), ("gpipe", M)):
                    live = peak = 0
                    for a in SCHEDULES[name](P, M, s):
                        live += 1 if a.kind == "F" else -1
                        peak = max(peak, live)
                    assert peak == bound, (name, P, M, s)


def test_no_schedule_deadlocks_and_each_takes_its_ideal_slots():
    """gpipe and 1f1b: M + P - 1 slots; interleaved: M + (P - 1) / v (the bubble shrinks v times)."""
    for name, P, M, v in layouts():
        makespan = simulate(P, M, name, backward_cost=2.0, virtual=v)
        assert makespan == pytest.approx(3.0 * (M + (P - 1) / v)), (name, P, M, v)
        if v == 1:
            assert 3.0 * M / makespan == pytest.approx(ideal_efficiency(P, M))


def test_simulate_detects_a_deadlocking_order():
    bad = {"bad": lambda P, M, s: [a for a in reversed(one_f_one_b(P, M, s))]}
    SCHEDULES.update(bad)
    try:
        with pytest.raises(RuntimeError, match="deadlocks"):
            simulate(2, 2, "bad")
    finally:
        del SCHEDULES["bad"]


def test_bad_schedule_arguments_are_refused():
    with pytest.raises(ValueError):
        gpipe(2, 0, 0)
    with pytest.raises(ValueError):
        one_f_one_b(2, 2, 2)
    with pytest.raises(ValueError, match="multiple"):
        interleaved_1f1b(2, 3, 0, 2)
