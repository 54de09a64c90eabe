"""3-D volumes on a (pd, ph, pw) grid: Conv3d, MaxPool3d, AvgPool3d (modules and functional), BatchNorm3d
and a CosmoFlow-style net (conv3d/BN3d/pool stacks, then dense layers after an explicit redistribution)
equal one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpitrain.spatial import Distribution, SpatialError, plan_grid, window_of
from mpitrain.spatial.models import cosmoflow
from tests.helpers import assert_all_ranks
from tests.spatial.test_layers import compare

TOL = 1e-10


def grids3(size: int) -> list[tuple[tuple[int, int, int], int]]:
    """(grid, samples): every 1-D split, and at 4 ranks 2x2x1, 1x2x2 and a sample x spatial hybrid."""
    out = [((size, 1, 1), 1), ((1, 1, size), 1)]
    if size == 4:
        out += [((2, 2, 1), 1), ((1, 2, 2), 1), ((2, 1, 1), 2)]
    return out


def test_volume_halo_plans_cover_every_needed_cell_once():
    for grid in [(2, 1, 1), (2, 2, 2), (1, 3, 2)]:
        plans = plan_grid((7, 6, 5), grid, window_of(3, 1, 1, 1, dims=3))
        for p in plans:
            cells = p.local.shape[0] * p.local.shape[1] * p.local.shape[2] + sum(
                b.shape[0] * b.shape[1] * b.shape[2] for _, b in p.recvs)
            inside = p.need & p.valid
            assert cells == inside.shape[0] * inside.shape[1] * inside.shape[2], f"{grid}: {p}"


class FunctionalPools3d(nn.Module):
    """``F.max_pool3d`` and ``F.avg_pool3d`` called in a forward (they route to the spatial 3-D pools)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.max_pool3d(x, 3, 1, 1) + torch.nn.functional.avg_pool3d(x, 3, 1, 1)


@pytest.mark.mpi
@pytest.mark.parametrize("ceil", [False, True])
def test_conv3d_bn3d_and_pools_equal_single_process(comm, ceil):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(2, 3, 3, 1, 1), nn.BatchNorm3d(3), nn.ReLU(), FunctionalPools3d(),
                          nn.MaxPool3d(3, 2, 1, ceil_mode=ceil), nn.Conv3d(3, 3, (3, 1, 3), 1, (1, 0, 1), bias=False),
                          nn.AvgPool3d(2, 2, ceil_mode=ceil, count_include_pad=False), nn.Conv3d(3, 2, 1)).double()
    for grid, samples in grids3(comm.size):
        shape = (max(2, samples), 2, 4 * grid[0] + 3, 4 * grid[1] + 2, 4 * grid[2] + 3)
        x = torch.randn(shape, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        compare(comm, copy.deepcopy(model), x, dist, f"3-D stack grid {grid}x{samples}", rtol=TOL)
        assert_all_ranks(comm, dist.redistributions == {}, f"redistributed {dist.redistributions}")


@pytest.mark.mpi
def test_cosmoflow_style_net_equals_single_process_redistributing_only_before_the_dense_layers(comm):
    torch.manual_seed(0)
    side = 4 * comm.size  # the last pooled volume (side / 4) still covers a 1-D grid of every rank
    model = cosmoflow(side).double()
    for grid, samples in grids3(comm.size):
        x = torch.randn(max(2, samples), 4, side, side, side, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        with pytest.warns(RuntimeWarning, match="flatten is not a spatial op"):
            compare(comm, copy.deepcopy(model), x, dist, f"CosmoFlow grid {grid}x{samples}", rtol=1e-9)
        assert_all_ranks(comm, dist.redistributions == {"flatten": 1}, f"redistributed {dist.redistributions}")


@pytest.mark.mpi
def test_a_volume_on_a_2d_grid_is_refused_before_any_message(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    try:
        dist.scatter(torch.randn(1, 1, 4 * comm.size, 4, 4))
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "NCHW" in msg, msg)
