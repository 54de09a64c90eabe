"""Timing model (eqs. 2-7) on hand-computed cases, and calibration of alpha/beta/gamma."""

from __future__ import annotations

import pytest

from mpitrain.perf.calibrate import calibrate, fit_alpha_beta
from mpitrain.perf.timing import TimingInputs, predict, ring_allreduce_time, scaling_efficiency
from tests.helpers import assert_all_ranks

X = TimingInputs(l_up=0.001, l_for=0.002, l_back=0.004, alpha=1e-4, beta=1e-9, gamma=1e-10, n_bytes=4e6, p=4,
                 S=1e-5, L=4, K=2)


def test_ring_time_is_thakurs_formula_and_zero_on_one_rank():
    expected = 2 * 3 * 1e-4 + 2 * 0.75 * 4e6 * 1e-9 + 0.75 * 4e6 * 1e-10 + 1e-5
    assert ring_allreduce_time(4e6, 4, 1e-4, 1e-9, 1e-10, 1e-5) == pytest.approx(expected)
    assert ring_allreduce_time(4e6, 1, 1e-4, 1e-9, 1e-10, 1e-5) == 0.0
    # compression shrinks only the bytes on the wire, not the bytes summed
    half = ring_allreduce_time(4e6, 4, 0, 1e-9, 1e-10, wire_ratio=0.5)
    assert half == pytest.approx(0.75 * 4e6 * 1e-9 + 0.75 * 4e6 * 1e-10)


def test_predictions_follow_equations_2_to_6():
    r = predict(X)
    comp, comm1 = 0.007, ring_allreduce_time(4e6, 4, 1e-4, 1e-9, 1e-10, 1e-5)
    comm4 = ring_allreduce_time(4e6, 4, 1e-4, 1e-9, 1e-10, 1e-5, L=4)
    assert r["sync"] == pytest.approx(comp + comm1)  # eq. 2
    assert r["pipe_ideal"] == pytest.approx((comp + comm1) / 2)  # eq. 3
    assert r["pipe"] == pytest.approx(max(comp, comm1))  # eqs. 4-5
    assert r["pipe_seg"] == pytest.approx(max(0.001 + 0.002 + 0.001, comm4))  # eq. 6, l_b = l_back / L
    assert r["sync_seg"] == pytest.approx(0.003 + max(0.004, 0.001 + comm4))


def test_sequential_communication_wins_when_communication_bound():
    slow = TimingInputs(l_up=0, l_for=1e-3, l_back=1e-3, alpha=1e-3, beta=1e-8, gamma=0, n_bytes=4e6, p=4, L=8)
    r = predict(slow)
    assert r["l_comm"] > r["l_comp"] and r["pipe"] < r["pipe_seg"]
    assert predict(slow.with_codec(0.25, 0.0))["pipe"] < r["pipe"]


def test_staleness_one_is_the_synchronous_time():
    one = TimingInputs(**{**X.__dict__, "K": 1})
    assert predict(one)["pipe"] == pytest.approx(predict(one)["sync"])


def test_scaling_efficiency_is_one_when_compute_bound():
    assert scaling_efficiency(0.001, 0.01, 0.005) == 1.0
    assert scaling_efficiency(0.001, 0.009, 0.02) == pytest.approx(0.5)


def test_alpha_beta_fit_recovers_a_linear_cost():
    sizes = [8, 1024, 65536, 1 << 20]
    alpha, beta = fit_alpha_beta(sizes, [3e-6 + 2e-10 * m for m in sizes])
    assert alpha == pytest.approx(3e-6 + 8 * 2e-10) and beta == pytest.approx(2e-10, rel=1e-3)


@pytest.mark.mpi
def test_calibration_is_identical_on_every_rank_and_physical(comm):
    cal = calibrate(comm, repeats=3, codecs=(None, "int8"), max_bytes=1 << 18)
    everyone = comm.allgather_object(cal)
    ok = all(c == everyone[0] for c in everyone) and cal.beta > 0 and cal.gamma > 0 and cal.alpha >= 0
    assert_all_ranks(comm, ok and cal.wire_ratio["int8"] < 0.26 and cal.codec_per_byte["None"] == 0.0, repr(cal))
