"""The pipeline's Layout: pure, known at construction (serial: no communicator, no model)."""

from __future__ import annotations

import pytest

from mpitrain.comm.place import PlaceError
from mpitrain.strategies.pipeline._layout import Layout


@pytest.mark.parametrize("world, P, R", [(1, 1, 1), (4, 4, 1), (4, 2, 2), (6, 3, 2), (8, 2, 4)])
def test_world_rank_r_times_p_plus_p_runs_pipeline_rank_p_of_replica_r(world, P, R):
    for rank in range(world):
        layout = Layout.of(world, rank, P, None, "1f1b")
        assert (layout.P, layout.R, layout.replica, layout.p) == (P, R, rank // P, rank % P)
        assert layout.world_rank(layout.replica, layout.p) == rank


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_one_partition_per_rank_in_order_for_gpipe_1f1b_zb1p(P):
    for schedule in ("gpipe", "1f1b", "zb1p"):
        layout = Layout.of(P, 0, P, 1, schedule)
        assert layout.V == 1 and layout.parts == P
        assert layout.ranks == list(range(P))
        assert layout.last_rank == P - 1 and layout.placement_name == "loop"


@pytest.mark.parametrize("P, V", [(2, 2), (3, 2), (2, 3), (4, 4)])
def test_interleaved_rank_p_runs_p_then_p_plus_P_and_the_last_partition_is_on_the_last_rank(P, V):
    for p in range(P):
        layout = Layout.of(P, p, P, 1, "interleaved-1f1b", virtual_stages=V)
        assert layout.mine == tuple(c * P + p for c in range(V))
        assert layout.parts == P * V and layout.last_rank == P - 1
        assert all(layout.rank_of(k) == k % P for k in range(P * V))


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_zbv_rank_p_runs_p_and_2P_minus_1_minus_p_and_rank_0_computes_the_loss(P):
    for p in range(P):
        layout = Layout.of(P, p, P, 1, "zbv", virtual_stages=2)
        assert layout.mine == (p, 2 * P - 1 - p)
        assert layout.last_rank == 0 and layout.placement_name == "v"
    # every partition runs exactly once
    assert sorted(k for p in range(P) for k in Layout.of(P, p, P, 1, "zbv").mine) == list(range(2 * P))


def test_virtual_stages_count_only_for_interleaved_1f1b():
    assert Layout.of(2, 0, 2, 1, "1f1b", virtual_stages=3).V == 1
    assert Layout.of(2, 0, 2, 1, "zbv", virtual_stages=2).V == 2


def test_an_unknown_schedule_a_V_the_schedule_cannot_run_and_a_world_that_does_not_fit_are_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        Layout.of(2, 0, 2, 1, "zigzag")
    place = Layout.of(2, 0, 2, 1, "1f1b").place
    with pytest.raises(ValueError, match="partitions per rank"):
        Layout(place, "1f1b", 2)
    with pytest.raises(PlaceError):
        Layout.of(4, 0, 3, None, "1f1b")
