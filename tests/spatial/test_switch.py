"""`fit(strategy="spatial", switch_at=...)`: spatial for the first layers, then an alltoall to whole samples
and sample parallelism for the rest (§V-C's per-layer distributions) equals one process in float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpitrain.fit import FitError, fit
from mpitrain.spatial import Distribution, SpatialError, parallelize
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi


def small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).double()


def layouts(size: int) -> list[tuple[tuple[int, int], int]]:
    """Spatial over every rank along H, and (where the size allows) a 2-D grid."""
    out = [((size, 1), 1)]
    if size % 2 == 0:
        out.append(((size // 2, 2), 1))
    return out


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.parametrize(("switch_at", "extra"), [("3", 0), ("6", 1)],
                         ids=["before-stride-conv-even-batch", "before-last-conv-uneven-batch"])
def test_spatial_then_sample_parallel_steps_equal_one_process(comm, switch_at, extra):
    g = torch.Generator().manual_seed(3)
    n = 2 * comm.size + extra
    data = [(torch.randn(n, 3, 12, 12, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g))
            for _ in range(2)]
    loss_fn = nn.CrossEntropyLoss()
    ref = small_cnn()
    opt = sgd(ref.parameters())
    for x, y in data:
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        opt.step()
    for grid, samples in layouts(comm.size):
        model = small_cnn()
        result = fit(model, data, loss_fn, sgd, strategy="spatial", grid=grid, samples=samples,
                     switch_at=switch_at, progress=False)
        for (name, a), b in zip(result.model.state_dict().items(), ref.state_dict().values()):
            assert_close_all_ranks(comm, a, b, 1e-10, 1e-10, f"{name} after 2 steps, grid {grid} x {samples}, "
                                                             f"switch at {switch_at}")


def test_switch_moves_blocks_by_alltoall_and_gradients_match(comm):
    torch.manual_seed(1)
    model = small_cnn()
    x = torch.randn(comm.size, 3, 12, 12, dtype=torch.float64, requires_grad=True)
    dist = Distribution(comm, (comm.size, 1), 1)
    par = parallelize(model, dist, switch_at="6")
    from mpitrain.spatial import gather

    out = gather(par(dist.scatter(x)))
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref = copy.deepcopy(model)
    ref.zero_grad()
    xr = x.detach().clone().requires_grad_(True)
    ref(xr).square().sum().backward()
    for n, p in ref.named_parameters():
        assert_close_all_ranks(comm, grads[n], p.grad, 1e-10, 1e-10, f"grad of {n}")
    assert_close_all_ranks(comm, x.grad, xr.grad, 1e-10, 1e-10, "input gradient")
    assert_all_ranks(comm, not dist.redistributions.get("flatten"),
                     f"flatten ran on whole samples without a visible redistribution: {dist.redistributions}")


@pytest.mark.parametrize("name", ["7.x", "nope", ""], ids=str)
def test_switch_at_a_missing_module_is_refused_on_every_rank_before_any_message(comm, name):
    try:
        parallelize(small_cnn(), Distribution(comm, (comm.size, 1), 1), switch_at=name)
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "switch_at" in msg, msg or f"switch_at={name!r} accepted")


@pytest.mark.mpi(sizes=(2, 4))
def test_switch_with_several_sample_groups_is_refused_on_every_rank_before_any_message(comm):
    data = [(torch.randn(4, 3, 12, 12, dtype=torch.float64), torch.zeros(4, dtype=torch.long))]
    try:
        fit(small_cnn(), data, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=(comm.size // 2, 1),
            samples=2, switch_at="3", progress=False)
        msg = ""
    except FitError as e:
        msg = str(e)
    assert_all_ranks(comm, "samples=1" in msg, msg or "switch_at with 2 sample groups accepted")


def test_switch_after_a_global_pool_is_refused_on_every_rank(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    par = parallelize(small_cnn(), dist, switch_at="10")
    try:
        par(dist.scatter(torch.randn(comm.size, 3, 12, 12, dtype=torch.float64)))
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "global pool" in msg, msg or "a replicated input was switched")


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(6, 6, 3, padding=1)

    def forward(self, x):
        return x + self.conv(x)


def test_switching_at_a_residual_block_moves_its_input_for_both_paths(comm):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), _Residual(), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(6, 5)).double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(comm.size, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (comm.size,))
    loss_fn = nn.CrossEntropyLoss()
    result = fit(model, [(x, y)], loss_fn, sgd, strategy="spatial", grid=(comm.size, 1), switch_at="1",
                 progress=False)
    opt = sgd(ref.parameters())
    opt.zero_grad()
    loss_fn(ref(x), y).backward()
    opt.step()
    for (name, a), b in zip(result.model.state_dict().items(), ref.state_dict().values()):
        assert_close_all_ranks(comm, a, b, 1e-10, 1e-10, f"{name} after a step switching at the residual block")
