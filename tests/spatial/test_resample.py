"""Upsampling layers (ConvTranspose2d, Upsample / F.interpolate), ceil_mode pooling and a U-Net with skip
concatenations equal the single-process layers: output, dL/dx and every dL/dw."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.spatial import Distribution
from mpitrain.spatial.models import UNet
from tests.helpers import assert_all_ranks
from tests.spatial.test_layers import compare, layouts

pytestmark = pytest.mark.mpi
TOL = 1e-10

TRANSPOSED = [dict(k=2, s=2, p=0, op=0, d=1), dict(k=3, s=2, p=1, op=1, d=1), dict(k=4, s=2, p=1, op=0, d=1),
              dict(k=3, s=1, p=1, op=0, d=2), dict(k=3, s=3, p=0, op=2, d=1)]


@pytest.mark.parametrize("index", range(len(TRANSPOSED)))
def test_conv_transpose_equals_single_process(comm, index):
    c = TRANSPOSED[index]
    torch.manual_seed(index)
    model = nn.Sequential(nn.ConvTranspose2d(4, 3, c["k"], c["s"], c["p"], c["op"], groups=1, dilation=c["d"]),
                          nn.ReLU(), nn.ConvTranspose2d(3, 2, 3, 1, 1, groups=1, bias=False)).double()
    for grid, samples in layouts(comm.size):
        x = torch.randn(max(2, samples), 4, 3 * comm.size + 1, 2 * comm.size + 1, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        compare(comm, copy.deepcopy(model), x, dist, f"transposed {c} grid {grid}x{samples}", rtol=TOL)


INTERP = [dict(scale_factor=2, mode="nearest"), dict(scale_factor=3, mode="nearest"),
          dict(scale_factor=2, mode="bilinear", align_corners=False),
          dict(scale_factor=2, mode="bilinear", align_corners=True),
          dict(size=(23, 17), mode="bilinear", align_corners=False)]


class Interp(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.conv, self.kw = nn.Conv2d(3, 3, 3, 1, 1), kw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(self.conv(x), **self.kw))  # functional: routed by the SpatialTensor


@pytest.mark.parametrize("index", range(len(INTERP)))
def test_interpolate_and_upsample_equal_single_process(comm, index):
    kw = INTERP[index]
    torch.manual_seed(index)
    for grid, samples in layouts(comm.size):
        x = torch.randn(max(2, samples), 3, 3 * comm.size + 2, 2 * comm.size + 3, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        compare(comm, Interp(**kw).double(), x, dist, f"F.interpolate {kw} grid {grid}x{samples}", rtol=TOL)
        module = nn.Sequential(nn.Conv2d(3, 3, 3, 1, 1), nn.Upsample(**kw), nn.Conv2d(3, 2, 3, 1, 1)).double()
        compare(comm, module, x, dist, f"nn.Upsample {kw} grid {grid}x{samples}", rtol=TOL)
        assert_all_ranks(comm, dist.redistributions == {}, f"redistributed {dist.redistributions}")


@pytest.mark.parametrize("include_pad", [True, False])
def test_ceil_mode_pools_equal_single_process(comm, include_pad):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, 1, 1), nn.MaxPool2d(3, 2, 1, ceil_mode=True),
                          nn.Conv2d(3, 3, 3, 1, 1),
                          nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=include_pad),
                          nn.Conv2d(3, 2, 1)).double()
    for grid, samples in layouts(comm.size):
        x = torch.randn(max(2, samples), 2, 8 * comm.size + 2, 6 * comm.size + 2, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        compare(comm, copy.deepcopy(model), x, dist, f"ceil_mode pools grid {grid}x{samples}", rtol=TOL)


def test_unet_with_skip_concatenations_and_transposed_convs_equals_single_process(comm):
    torch.manual_seed(0)
    model = UNet(in_channels=3, width=4, depth=2).double()  # one transposed-conv and one bilinear up step
    for grid, samples in layouts(comm.size):
        x = torch.randn(max(2, samples), 3, 8 * comm.size, 8 * comm.size, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        compare(comm, copy.deepcopy(model), x, dist, f"U-Net grid {grid}x{samples}", rtol=1e-9)
        assert_all_ranks(comm, dist.redistributions == {}, f"redistributed {dist.redistributions}")


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_padding_modes_equal_single_process(comm, mode):
    # circular wraps to the far edge: only along the dimension the grid leaves whole (the columns here)
    pads = ((0, 1), (0, 2)) if mode == "circular" else (1, 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, 1, pads[0], padding_mode=mode), nn.ReLU(),
                          nn.Conv2d(3, 2, 5, 2, pads[1], padding_mode=mode)).double()
    chosen = [((comm.size, 1), 1)] if mode == "circular" else layouts(comm.size)
    for grid, samples in chosen:
        x = torch.randn(max(2, samples), 2, 4 * comm.size + 3, 4 * comm.size + 2, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        compare(comm, copy.deepcopy(model), x, dist, f"padding_mode={mode} grid {grid}x{samples}", rtol=TOL)


@pytest.mark.mpi
def test_circular_padding_along_a_split_dimension_is_refused(comm):
    from mpitrain.spatial import SpatialError, parallelize

    dist = Distribution(comm, (comm.size, 1), 1)
    model = parallelize(nn.Conv2d(1, 1, 3, 1, 1, padding_mode="circular"), dist)
    try:
        model(dist.scatter(torch.randn(1, 1, 4 * comm.size, 4)))
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "circular" in msg, msg)
