"""One gradient rule with the low-level API: a loss every rank computes alike — on blocks, on gathered
values or on values redistributed to whole samples — gives exactly the one-process input and weight
gradients (a value several ranks hold counts once), on spatial-only and sample x spatial grids."""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.spatial import Distribution, gather, parallelize
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi
RTOL = 1e-10


def layouts(size: int) -> list[tuple[tuple[int, int], int]]:
    """(grid, samples): spatial-only grids, and sample x spatial where the world allows it."""
    hybrid = {2: [((1, 1), 2)], 3: [((1, 1), 3)], 4: [((2, 1), 2), ((1, 2), 2)]}[size]
    return [((size, 1), 1), ((1, size), 1), *hybrid]


_DISTS: dict[tuple, Distribution] = {}


def distribution(comm, grid: tuple[int, int], samples: int) -> Distribution:
    """One Distribution per layout for the module (its communicators are split once)."""
    key = (id(comm), grid, samples)
    if key not in _DISTS:
        _DISTS[key] = Distribution(comm, grid, samples)
    return _DISTS[key]


class _Net(nn.Module):
    """conv-BN-ReLU; an ASPP-like pooled branch (global pool, 1x1 conv, BatchNorm of the replicated pooled
    vectors, resized back with ``F.interpolate(size=y.shape[-2:])``: the block's whole extent) concatenated
    along channels; a strided conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(4, 2, 1, bias=False), nn.BatchNorm2d(2), nn.ReLU())
        self.out = nn.Conv2d(6, 3, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(self.conv(x)))
        p = F.interpolate(self.pool(y), size=y.shape[-2:], mode="bilinear", align_corners=False)
        return self.out(torch.cat([y, p], 1))


def _net() -> nn.Module:
    return _Net().double()


#: name -> (loss on the parallel output ys, the same loss on the one-process output y)
LOSSES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    # on blocks: element-wise ops keep the block, the whole reduction sums every rank's cells once
    "blocks sum": (lambda ys: torch.tanh(ys).sum(), lambda y: torch.tanh(y).sum()),
    "blocks mean": (lambda ys: (ys * ys).mean(), lambda y: (y * y).mean()),
    # on gathered values: every rank holds the whole output
    "gathered": (lambda ys: gather(ys).pow(3).mean(), lambda y: y.pow(3).mean()),
    # implicitly redistributed (flatten is not spatial): replicated whole samples of each group, then a
    # whole reduction over the groups
    "redistributed": (lambda ys: torch.logsumexp(ys.flatten(1), 1).mean(),
                      lambda y: torch.logsumexp(y.flatten(1), 1).mean()),
    # a plain value leaving the layout (all of a group's samples flattened together): each group's value
    # counts once, so the groups' values add up to the whole batch's
    "redistributed, leaving the layout": (lambda ys: ys.flatten().pow(2).sum(), lambda y: y.flatten().pow(2).sum()),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_loss_every_rank_computes_gives_the_one_process_input_and_weight_gradients(comm, name):
    torch.manual_seed(0)
    net = _net()
    x = torch.randn(4, 3, 2 * comm.size + 3, 2 * comm.size + 1, dtype=torch.float64)
    on_blocks, on_whole = LOSSES[name]
    xr = x.clone().requires_grad_()
    ref = copy.deepcopy(net)
    on_whole(ref(xr)).backward()
    for grid, samples in layouts(comm.size):
        dist = distribution(comm, grid, samples)
        model = copy.deepcopy(net)
        xs = x.clone().requires_grad_()
        warned = "redistributed" in name and dist.per_sample > 1 and "flatten" not in dist.redistributions
        with pytest.warns(RuntimeWarning) if warned else nullcontext():
            loss = on_blocks(parallelize(model, dist)(dist.scatter(xs)))
        loss.backward()
        what = f"{name}, grid {grid} x{samples}"
        assert_close_all_ranks(comm, xs.grad, xr.grad, rtol=RTOL, atol=1e-14, what=f"{what}: dL/dx")
        for (pname, p), pr in zip(model.named_parameters(), ref.parameters()):
            assert_close_all_ranks(comm, p.grad, pr.grad, rtol=RTOL, atol=1e-14, what=f"{what}: dL/d{pname}")


def test_whole_reductions_of_blocks_and_replicated_tensors_equal_the_whole_tensors_on_every_rank(comm):
    for grid, samples in layouts(comm.size):
        dist = Distribution(comm, grid, samples)  # its own: the counter of redistributions starts empty
        full = torch.randn(5, 3, comm.size + 2, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        block = dist.scatter(full)
        pooled = block.mean((2, 3))  # replicated over the spatial group
        got = torch.stack([block.sum(), block.mean(), pooled.sum(), pooled.mean(),
                           torch.sum(block, dtype=torch.float32).double()])
        want = torch.stack([full.sum(), full.mean(), full.mean((2, 3)).sum(), full.mean((2, 3)).mean(),
                            full.float().sum().double()])
        assert_close_all_ranks(comm, got, want, rtol=1e-6, what=f"grid {grid} x{samples}")
        assert_all_ranks(comm, dist.redistributions == {}, f"redistributed {dist.redistributions}")
