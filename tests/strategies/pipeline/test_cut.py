"""The cut's pure steps, each on its own (serial: capture, profile, measure, bounds, a meta model's holding).

`agree`, the one collective step, is tested over real MPI in test_cut_mpi.py."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from mpitrain.strategies.base import FitError
from mpitrain.strategies.pipeline._cut import (
    CutSpec,
    LossSample,
    bounds,
    calibrated,
    capture_model,
    hold,
    measure_mine,
    profile_sample,
    with_loss,
)
from mpitrain.strategies.pipeline._graph import cut_points, measure_plain, model_args, split, work_clock
from mpitrain.strategies.pipeline._layout import Layout

from .models import MLP


def _brute_force(costs: list[float], cuts: list[int], parts: int) -> float:
    """The least largest partition cost over every choice of `parts - 1` cuts."""
    n, best = len(costs), float("inf")
    for chosen in itertools.combinations(sorted(set(cuts)), parts - 1):
        edges = [0, *chosen, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


def test_balanced_bounds_minimise_the_costliest_partition_like_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 10)
        costs = [rng.choice([0.0, 1.0, 2.5, 7.0]) for _ in range(n)]
        cuts = sorted(rng.sample(range(1, n), rng.randint(1, n - 1)))
        parts = rng.randint(1, len(cuts) + 1)
        got = bounds("time", parts, costs, cuts)
        assert got[0] == 0 and got[-1] == n and len(got) == parts + 1
        assert all(c in cuts for c in got[1:-1]) and got == sorted(got)
        assert max(sum(costs[a:b]) for a, b in zip(got, got[1:])) == _brute_force(costs, cuts, parts)


def test_balanced_bounds_for_given_costs_and_ties_go_to_the_earliest_cut():
    assert bounds("time", 2, [1.0, 1.0, 1.0, 1.0, 4.0], [1, 2, 3, 4]) == [0, 4, 5]
    assert bounds("params", 2, [1.0] * 4, [1, 2, 3]) == [0, 2, 4]
    assert bounds("time", 2, [1.0] * 4, [1, 3]) == [0, 1, 4]  # max 3 either way: the earliest
    assert bounds("time", 1, [5.0, 1.0], [1]) == [0, 2]


def test_explicit_node_counts_give_their_bounds_and_a_bad_list_or_too_few_cuts_is_a_fit_error():
    assert bounds([2, 3], 2, [0.0] * 5, [1, 2, 3, 4]) == [0, 2, 5]
    with pytest.raises(FitError, match="non-tensor value"):
        bounds([2, 3], 2, [0.0] * 5, [1, 3, 4])
    with pytest.raises(FitError, match="summing"):
        bounds([2, 2], 2, [0.0] * 5, [1, 2, 3, 4])
    with pytest.raises(FitError, match="too few"):
        bounds("time", 3, [1.0] * 5, [2])


def _mlp_shapes(micro: int = 3):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(12, 12)
    traced = capture_model(model, x, per_micro=4)
    flat = model_args(traced, x)
    return model, traced, profile_sample(traced, flat, micro, torch.device("cpu"), False, False)


def test_capture_and_profile_give_the_sample_micro_batch_shapes_of_every_value():
    _, traced, shapes = _mlp_shapes(micro=3)
    assert [tuple(a.shape) for a in shapes.sample] == [(3, 12)]
    meta = shapes.first()
    out = traced.outputs[0]
    assert meta[out.name] is not None and meta[out.name].shape == (3, 5)
    assert shapes.first() is meta  # profiled once
    assert cut_points(traced, meta)  # an MLP can be cut between its layers


def test_a_rank_times_only_the_nodes_of_its_own_partitions():
    _, traced, shapes = _mlp_shapes()
    meta = shapes.first()
    at = bounds("params", 2, [1.0] * len(traced.nodes), cut_points(traced, meta))
    for rank in range(2):
        timed = measure_mine(Layout.of(2, rank, 2, 1, "1f1b"), traced, at, shapes, passes=1)
        assert timed is not None and len(timed) == len(traced.nodes)
        got = [i for i, t in enumerate(timed) if t is not None]
        assert got and all(at[rank] <= i < at[rank + 1] for i in got)
        assert all(t >= 0 for t in timed if t is not None)


def test_a_heavy_loss_counted_on_the_last_node_moves_nodes_off_the_last_partition():
    costs, cuts = [1.0] * 10, list(range(1, 10))
    weighed = with_loss(costs, 4.0)
    assert weighed == [1.0] * 9 + [5.0]  # on the node that produces the output, nowhere else
    assert bounds("time", 2, costs, cuts) == [0, 5, 10]
    assert bounds("time", 2, weighed, cuts) == [0, 7, 10]  # 7 | 3 + the loss's 4
    assert bounds("time", 3, with_loss(costs, 2.0), cuts) == [0, 4, 8, 10]  # 4 | 4 | 2 + 2


def test_the_loss_is_timed_on_the_partition_that_holds_the_output_only():
    _, traced, shapes = _mlp_shapes()
    meta, n = shapes.first(), len(traced.nodes)
    at = bounds("params", 2, [1.0] * n, cut_points(traced, meta))
    targets = torch.zeros(3, dtype=torch.long)
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def slow_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append((tuple(out.shape), tuple(y.shape)))
        _busy(0.05)  # work, not a sleep: partitions are timed in CPU time on the CPU
        return nn.functional.cross_entropy(out, y)

    loss = LossSample(slow_loss, targets)
    for rank in range(2):
        layout = Layout.of(2, rank, 2, 1, "1f1b")
        plain = measure_mine(layout, traced, at, shapes, passes=2)
        weighed = measure_mine(layout, traced, at, shapes, passes=2, loss=loss)
        assert plain is not None and weighed is not None
        if rank == 0:  # does not hold the output: the loss is neither run nor counted
            assert not calls and weighed[n - 1] is None
            continue
        assert calls and all(c == ((3, 5), (3,)) for c in calls)  # the model's output, the sample's targets
        # the 50 ms of work dwarf the MLP's nodes (microseconds): unit-free, so a load change between
        # the calls cannot decide it
        assert weighed[n - 1] > 10 * plain[n - 1]
        ahead = [i for i in range(at[1], n - 1) if weighed[i] is not None]
        assert ahead and all(weighed[i] < weighed[n - 1] / 10 for i in ahead)  # on the last node only


def _busy(seconds: float) -> None:
    """Compute for `seconds` of this thread's CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as the launcher runs ranks (``--threads 1``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_work_clock_is_cpu_time_only_on_one_cpu_thread():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert work_clock(torch.device("cpu")) is time.thread_time
        assert work_clock(torch.device("cuda")) is time.perf_counter  # kernels' time is not the CPU's
        torch.set_num_threads(2)
        assert work_clock(torch.device("cpu")) is time.perf_counter  # one thread's CPU misses the others'
    finally:
        torch.set_num_threads(threads)


def test_on_one_cpu_thread_a_partition_is_timed_in_cpu_time_so_waiting_for_a_core_is_not_work(one_thread: None):
    _, traced, shapes = _mlp_shapes()
    meta, n = shapes.first(), len(traced.nodes)
    at = bounds("params", 2, [1.0] * n, cut_points(traced, meta))
    layout, targets = Layout.of(2, 1, 2, 1, "1f1b"), torch.zeros(3, dtype=torch.long)

    def waiting(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # a rank descheduled for 50 ms
        time.sleep(0.05)
        return nn.functional.cross_entropy(out, y)

    def working(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # a rank computing for 50 ms
        _busy(0.05)
        return nn.functional.cross_entropy(out, y)

    waited = measure_mine(layout, traced, at, shapes, passes=2, loss=LossSample(waiting, targets))
    worked = measure_mine(layout, traced, at, shapes, passes=2, loss=LossSample(working, targets))
    assert waited is not None and worked is not None
    assert waited[n - 1] is not None and worked[n - 1] is not None
    assert waited[n - 1] < worked[n - 1] / 10  # in wall time both would count the 50 ms


def test_a_loss_that_fails_on_the_sample_goes_unweighed_and_the_partition_is_still_timed():
    _, traced, shapes = _mlp_shapes()
    meta, n = shapes.first(), len(traced.nodes)
    at = bounds("params", 2, [1.0] * n, cut_points(traced, meta))

    def wrong_targets(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out, y)  # y has the wrong shape: ValueError

    loss = LossSample(wrong_targets, torch.zeros(7, dtype=torch.long))
    timed = measure_mine(Layout.of(2, 1, 2, 1, "1f1b"), traced, at, shapes, passes=1, loss=loss)
    assert timed is not None and timed[n - 1] is not None  # no error on this rank alone: timed, loss unweighed


def test_a_partitions_node_times_are_scaled_to_its_plain_time_keeping_their_proportions():
    assert calibrated({3: 1.0, 4: 3.0}, 2.0) == {3: 0.5, 4: 1.5}
    assert calibrated({3: 0.0, 4: 0.0}, 2.0) == {3: 0.0, 4: 0.0}  # nothing to scale
    assert calibrated({3: 1.0}, 0.0) == {3: 1.0}


@pytest.mark.parametrize("split_backward", [False, True])
def test_timing_a_partition_as_a_step_runs_it_leaves_the_module_as_it_was(split_backward):
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 4)))
    grads = [torch.full_like(q, 3.0) for q in gm.parameters()]
    for q, g in zip(gm.parameters(), grads):
        q.grad = g
    stats = [b.clone() for b in gm.buffers()]
    data, x = torch.randn(6, 8), torch.randn(6, 8, requires_grad=True).clone()  # x: a received activation
    rng = torch.get_rng_state()
    for args in ([data], [x]):
        assert measure_plain(gm, args, passes=2, split=split_backward) > 0
    assert all(q.grad is g and torch.equal(g, torch.full_like(g, 3.0)) for q, g in zip(gm.parameters(), grads))
    assert all(torch.equal(b, s) for b, s in zip(gm.buffers(), stats))
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_meta_model_holds_exactly_its_partitions_tensors_after_each_split():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    x = torch.randn(4, 4)
    traced = capture_model(model, x, per_micro=2)
    shapes = profile_sample(traced, model_args(traced, x), 2, torch.device("cpu"), True, False)
    meta, layout = shapes.first(), Layout.of(2, 1, 2, 1, "1f1b")
    cuts = cut_points(traced, meta)
    n = len(traced.nodes)  # one per layer: rank 1 holds 3 layers, then 1 (two go back to meta), then 2
    for sizes in ([1, n - 1], [n - 1, 1], [2, n - 2]):
        at = bounds(sizes, 2, [0.0] * n, cuts)
        assert hold(model, layout, traced, at, meta, CutSpec(seed=3)) is None
        own = {id(t) for t in split(traced, at, meta)[1].module.parameters()}
        assert len(own) == 2 * sizes[1] and all(t.is_meta == (id(t) not in own) for t in model.parameters())
