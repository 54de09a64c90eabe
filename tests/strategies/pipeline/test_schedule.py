"""Schedules as printable data, checked in one process: order, memory bound, no deadlock, ideal time."""

from __future__ import annotations

import pytest

from mpitrain.strategies.pipeline.schedule import (
    SCHEDULES,
    gpipe,
    ideal_efficiency,
    one_f_one_b,
    render,
    simulate,
)


def test_1f1b_for_4_stages_and_6_micro_batches_is_the_documented_table():
    assert [render(one_f_one_b(4, 6, s)) for s in range(4)] == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
    ]
    assert render(gpipe(2, 3, 1)) == "F0 F1 F2 B0 B1 B2"


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_stage_runs_each_micro_batch_once_each_way_in_ascending_order(name):
    for P in range(1, 6):
        for M in range(1, 9):
            for s in range(P):
                acts = SCHEDULES[name](P, M, s)
                for kind in "FB":
                    assert [a.micro for a in acts if a.kind == kind] == list(range(M))
                assert all(acts.index(("F", m)) < acts.index(("B", m)) for m in range(M))


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


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_no_schedule_deadlocks_and_both_take_the_ideal_M_plus_P_minus_1_slots(name):
    for P in range(1, 7):
        for M in range(1, 10):
            makespan = simulate(P, M, name, backward_cost=2.0)
            assert makespan == pytest.approx(3.0 * (M + P - 1))
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
