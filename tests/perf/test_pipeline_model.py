"""The pipeline step model (HyPar-Flow) and §V-C's shortest path over (layer, distribution)."""

from __future__ import annotations

import math

import pytest

from mpitrain.perf.pipeline import micro_batch_candidates, pipeline_step
from mpitrain.perf.spatial import layer_path, ring_allreduce
from mpitrain.perf.timing import ring_allreduce_time


def test_balanced_pipeline_step_is_m_plus_p_minus_1_slots_plus_allreduce():
    c = pipeline_step([0.01, 0.01], M=4, p2p_s=0.001, allreduce_s=0.005, update_s=0.002)
    assert c.compute == pytest.approx(0.04)
    assert c.bubble == pytest.approx(0.01)
    assert c.communication == pytest.approx(2 * 5 * 0.001 + 0.005)
    assert c.total == pytest.approx(0.04 + 0.01 + 0.015 + 0.002)
    one = pipeline_step([0.01], M=3, p2p_s=1.0, allreduce_s=0.0)  # one partition sends nothing
    assert one.bubble == 0.0 and one.communication == 0.0
    with pytest.raises(ValueError):
        pipeline_step([0.01, 0.01], M=0, p2p_s=0.0, allreduce_s=0.0)


def test_unbalanced_pipeline_is_the_first_micro_batch_through_all_then_the_slowest():
    c = pipeline_step([0.01, 0.03], M=3, p2p_s=0.0, allreduce_s=0.0)
    assert c.total == pytest.approx(0.04 + 2 * 0.03)  # sum of stages, then M - 1 at the slowest rate


def test_micro_batches_start_at_the_largest_divisor_and_halve():
    assert micro_batch_candidates(32) == [32, 16, 8, 4, 2, 1]
    assert micro_batch_candidates(12) == [12, 6, 3, 1]
    assert micro_batch_candidates(100, limit=8) == [5, 2, 1]


def test_spatial_allreduce_is_the_one_ring_formula():
    assert ring_allreduce(4, 1000, 1e-5, 1e-9) == pytest.approx(ring_allreduce_time(1000, 4, 1e-5, 1e-9, 0.0))


def test_layer_path_takes_the_cheapest_line_through_layers_and_shuffles():
    # two distributions; switching costs 2; the third layer is much cheaper under distribution 1
    costs = [[1, 5], [1, 5], [10, 1]]
    total, path = layer_path(costs, lambda i, d, e: 0.0 if d == e else 2.0)
    assert (total, path) == (5, [0, 0, 1])
    # an expensive shuffle keeps one distribution throughout
    total, path = layer_path(costs, lambda i, d, e: 0.0 if d == e else 100.0)
    assert (total, path) == (11, [1, 1, 1])
    # a forbidden edge (inf) is never taken, an impossible layer cost (inf) never chosen
    total, path = layer_path([[1, 1], [math.inf, 1]], lambda i, d, e: 0.0 if d == e else math.inf)
    assert path == [1, 1] and total == 2
    assert layer_path([], lambda i, d, e: 0.0) == (0.0, [])
