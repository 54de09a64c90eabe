"""Alpha-beta extrapolation to another rank count (plan(world_size=W)): the per-link constants stay,
the step and byte counts of each pattern follow the rank count."""

from __future__ import annotations

import pytest

from mpitrain.perf.calibrate import Calibration, LinkCost, Network, extrapolate_calibration, extrapolate_network


def test_extrapolated_ring_allreduce_and_alltoall_follow_their_step_counts():
    net = Network("world", 2, LinkCost(1e-5, 1e-9), LinkCost(2e-5, 1e-9), LinkCost(1e-5, 0.5e-9))
    four = extrapolate_network(net, 4)
    assert four.ranks == 4 and four.p2p == net.p2p
    assert four.allreduce.alpha == pytest.approx(2e-5 * 6 / 2)  # 2(W-1) steps
    assert four.allreduce.beta == pytest.approx(1e-9 * (6 / 4) / (2 / 2))  # 2(W-1)/W of the bytes
    assert four.alltoall.alpha == pytest.approx(1e-5 * 3)
    assert four.alltoall.beta == pytest.approx(0.5e-9 * (3 / 4) / (1 / 2))
    assert extrapolate_network(four, 2) == net.__class__("world", 2, net.p2p, *(
        LinkCost(pytest.approx(c.alpha), pytest.approx(c.beta)) for c in (net.allreduce, net.alltoall)))
    assert extrapolate_network(net, 2) is net


def test_a_one_rank_measurement_cannot_be_extrapolated():
    zero = LinkCost(0.0, 0.0)
    with pytest.raises(ValueError):
        extrapolate_network(Network("world", 1, zero, zero, zero), 4)


def test_the_barrier_grows_with_the_log_of_the_ranks():
    cal = Calibration(1e-5, 1e-9, 1e-10, 1e-4, {}, {})
    assert extrapolate_calibration(cal, 2, 8).S == pytest.approx(3e-4)
    assert extrapolate_calibration(cal, 2, 8).alpha == cal.alpha
