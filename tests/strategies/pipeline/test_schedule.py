"""Schedules as printable data, checked in one process: order, memory bound, no deadlock, ideal time."""

from __future__ import annotations

import pytest

from mpitrain.strategies.pipeline.schedule import (
    SCHEDULES,
    SPLIT,
    bubble_efficiency,
    chunks_per_rank,
    gpipe,
    ideal_efficiency,
    interleaved_1f1b,
    one_f_one_b,
    peak_in_flight,
    placement,
    render,
    schedule,
    simulate,
    zb1p,
    zbv,
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


def test_zero_bubble_schedules_are_the_documented_tables():
    assert [render(zb1p(4, 6, s)) for s in (0, 1, 3)] == [
        "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 I3 W3 I4 W4 I5 W5",
        "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 I4 W3 I5 W4 W5",
        "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 W3 W4 W5",
    ]
    assert render(zbv(2, 4, 0)) == ("F0 F1 F2 F0.1 I0.1 W0.1 F1.1 I1.1 W1.1 F3 I0 W0 F2.1 I2.1 W2.1 I1 W1 "
                                    "F3.1 I3.1 W3.1 I2 W2 I3 W3")


def test_zbv_places_the_partitions_in_a_v_and_the_others_in_a_loop():
    assert placement("zbv", 3) == [[0, 5], [1, 4], [2, 3]]
    assert placement("interleaved-1f1b", 2, 3) == [[0, 2, 4], [1, 3, 5]]
    assert placement("zb1p", 3) == [[0], [1], [2]]
    for name, P, _, v in layouts():
        assert sorted(k for row in placement(name, P, v) for k in row) == list(range(P * chunks_per_rank(name, v)))


def test_every_chunk_runs_each_micro_batch_once_each_way_in_ascending_order():
    for name, P, M, v in layouts():
        for s in range(P):
            acts = schedule(name, P, M, s, v)
            back = "IW" if name in SPLIT else "B"
            for c in range(chunks_per_rank(name, v)):
                for kind in "F" + back:
                    assert [a.micro for a in acts if a.kind == kind and a.chunk == c] == list(range(M)), (name, P, M)
                for m in range(M):  # F before I (or B) before W
                    order = [acts.index((kind, m, c)) for kind in "F" + back]
                    assert order == sorted(order), (name, P, M, s, m, c)
            assert len(acts) == len("F" + back) * M * chunks_per_rank(name, v)


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


def until_input_half(actions) -> int:
    """Peak number of micro-batches between F and I."""
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == "I" else 0
        peak = max(peak, live)
    return peak


def test_zero_bubble_schedules_hold_at_most_P_micro_batches_until_W_and_zb1p_1f1b_s_until_I():
    for P in range(1, 6):
        for M in range(1, 9):
            assert peak_in_flight("1f1b", P, M) == min(P, M) and peak_in_flight("gpipe", P, M) == M
            assert peak_in_flight("zb1p", P, M) == min(P, M), (P, M)
            assert peak_in_flight("zbv", P, M) <= P, (P, M)
            for s in range(P):
                assert until_input_half(zb1p(P, M, s)) == min(P - s, M), (P, M, s)


def test_no_schedule_deadlocks_and_each_takes_its_ideal_slots():
    """gpipe and 1f1b: M + P - 1 slots; interleaved: M + (P - 1) / v (the bubble shrinks v times)."""
    for name, P, M, v in layouts():
        for weight in (0.5, 1.0, 1.5):  # W's share of the backward changes no order: never a deadlock
            makespan = simulate(P, M, name, backward_cost=2.0, virtual=v, weight_cost=weight)
        if name not in SPLIT:
            assert makespan == pytest.approx(3.0 * (M + (P - 1) / v)), (name, P, M, v)
        if v == 1 and name not in SPLIT:
            assert 3.0 * M / makespan == pytest.approx(ideal_efficiency(P, M))
            assert bubble_efficiency(name, P, M, virtual=v) == pytest.approx(ideal_efficiency(P, M))


def test_zero_bubble_schedules_shrink_the_bubble_as_the_paper_says():
    """F = I = W = 1 (the paper's handcrafted case): ZB-H1's bubble is (P-1)(F + I - W) = P - 1 slots,
    a third of 1F1B's 3(P-1), once M >= P; ZB-V's is P-1 chunk forwards (rank P-1's wait for the first
    activation, which no schedule avoids) once M >= 2P-1."""
    for P in range(1, 6):
        for M in range(P, 10):
            assert simulate(P, M, "zb1p", 2.0, weight_cost=1.0) == pytest.approx(3 * M + P - 1), (P, M)
            if M >= 2 * P - 1:
                assert simulate(P, M, "zbv", 2.0, weight_cost=1.0) == pytest.approx(3 * M + (P - 1) / 2), (P, M)
    assert bubble_efficiency("zb1p", 2, 4) == pytest.approx(12 / 13)
    assert bubble_efficiency("zbv", 2, 4) == pytest.approx(12 / 12.5)


def test_simulate_on_partition_times_reproduces_the_uniform_case_and_sees_an_unbalanced_rank():
    for name, P, M, v in layouts():
        chunks = chunks_per_rank(name, v)
        uniform = [3.0 / chunks] * (P * chunks)  # F + B of a chunk: (1 + backward_cost) / chunks
        assert simulate(P, M, name, 2.0, v, 1.0, uniform) == pytest.approx(simulate(P, M, name, 2.0, v, 1.0))
    # zbv's rank 0 runs partitions 0 and 3: a heavy last partition makes it the slow rank
    assert simulate(2, 4, "zbv", partition_costs=[1, 1, 1, 3]) > simulate(2, 4, "zbv", partition_costs=[2, 1, 1, 2])


def test_simulate_on_measured_action_times_charges_each_kind_its_own_time():
    """Per-kind times: the uniform case again, then the makespans of P = 2, M = 1 by hand (the
    dependency chain F0 -> F1 -> B1 -> B0, and I1 -> B0 with W1 beside B0)."""
    for name, P, M, v in layouts():
        chunks = chunks_per_rank(name, v)
        same = [{"F": 1.0 / chunks, "B": 2.0 / chunks, "I": 1.0 / chunks, "W": 1.0 / chunks}] * (P * chunks)
        assert simulate(P, M, name, 2.0, v, 1.0, action_costs=same) == pytest.approx(
            simulate(P, M, name, 2.0, v, 1.0))
    costs = [{"F": 1.0, "B": 3.0, "I": 0.0, "W": 3.0}, {"F": 2.0, "B": 5.0, "I": 4.0, "W": 2.0}]
    assert simulate(2, 1, "1f1b", action_costs=costs) == pytest.approx(1 + 2 + 5 + 3)
    assert simulate(2, 1, "zb1p", action_costs=costs) == pytest.approx(1 + 2 + 4 + max(0 + 3, 2))


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
    with pytest.raises(ValueError):
        zbv(2, 3, 2)
