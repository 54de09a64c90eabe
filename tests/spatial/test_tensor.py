"""SpatialTensor layout rules: element-wise ops and channel concatenation keep the block, a spatial
mean pools with only pooled vectors moving, a replicated 1x1 scale broadcasts onto a block (squeeze-and-
excitation), a non-spatial op is redistributed visibly or refused, and an unknown in-place op is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.spatial import Distribution, SpatialError, SpatialTensor, layout_of, parallelize
from mpitrain.spatial.tensor import plain
from tests.helpers import assert_all_ranks
from tests.spatial.test_layers import compare, layouts

pytestmark = pytest.mark.mpi


def test_spatial_and_sample_groups_hold_the_world_ranks_of_the_documented_layout(comm):
    """Rank r is cell r % (ph*pw) of sample group r // (ph*pw): the spatial communicator holds its group's
    ranks, the sample communicator the ranks at its cell in every group, in that order (an allgather of
    world ranks over each), for every sample count the world allows and a 2-D and a 3-D grid."""
    for samples in [d for d in range(1, comm.size + 1) if comm.size % d == 0]:
        per = comm.size // samples
        for grid in ((1, per), (per, 1, 1)):
            dist = Distribution(comm, grid, samples)
            me = torch.tensor([comm.rank], dtype=torch.int64)
            got = (dist.spatial_comm.allgather(me).tolist(), dist.sample_comm.allgather(me).tolist(),
                   dist.group, dist.spatial_rank)
            g, s = divmod(comm.rank, per)
            want = (list(range(g * per, (g + 1) * per)), list(range(s, comm.size, per)), g, s)
            assert_all_ranks(comm, got == want, f"samples={samples}, grid={grid}: {got} != {want}")


class SqueezeExcite(nn.Module):
    """conv, then x * sigmoid(fc(mean over H, W)) (the scale is replicated, 1x1), a residual add, a cat
    along channels, then mean over H, W and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc, self.head = nn.Conv2d(3, 4, 3, 1, 1), nn.Linear(4, 4), nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(x))
        scale = torch.sigmoid(self.fc(y.mean((2, 3))))[:, :, None, None]
        z = y * scale + y
        z = torch.cat([z, -z], dim=1)
        return self.head(z.mean(dim=(-2, -1)))


def test_elementwise_and_squeeze_excitation_keep_the_layout_and_move_only_pooled_vectors(comm):
    torch.manual_seed(0)
    model = SqueezeExcite().double()
    for grid, samples in layouts(comm.size):
        x = torch.randn(max(2, samples), 3, 3 * comm.size + 1, 2 * comm.size + 2, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        compare(comm, copy.deepcopy(model), x, dist, f"squeeze-excite grid {grid}x{samples}", rtol=1e-10)
        assert_all_ranks(comm, dist.redistributions == {}, f"redistributed {dist.redistributions}")


def test_block_layout_survives_elementwise_ops_and_drops_on_scalar_reductions(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    x = dist.scatter(torch.randn(2, 3, 2 * comm.size, 4))
    y = torch.nn.functional.gelu(x * 2 + 1).clone()
    y.relu_()
    same = isinstance(y, SpatialTensor) and layout_of(y) == layout_of(x)
    cat = layout_of(torch.cat([x, y], dim=1))
    assert_all_ranks(comm, same and cat is not None and cat.shape == (2, 6, 2 * comm.size, 4),
                     f"layouts {layout_of(y)}, cat {cat}")


def test_non_spatial_op_is_refused_with_nonspatial_error_and_redistributed_with_a_warning_otherwise(comm):
    model = nn.Sequential(nn.Conv2d(1, 2, 3, 1, 1), nn.Flatten(), nn.Linear(2 * 2 * comm.size * 3, 2)).double()
    x = torch.randn(2, 1, 2 * comm.size, 3, dtype=torch.float64)
    strict = Distribution(comm, (comm.size, 1), 1, nonspatial="error")
    try:
        parallelize(copy.deepcopy(model), strict)(strict.scatter(x))
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "flatten is not a spatial op" in msg, msg)
    dist = Distribution(comm, (comm.size, 1), 1)
    with pytest.warns(RuntimeWarning, match="flatten is not a spatial op"):
        compare(comm, model, x, dist, "flatten after a redistribution", rtol=1e-10)
    assert_all_ranks(comm, dist.redistributions == {"flatten": 1}, f"{dist.redistributions}")


def test_unknown_in_place_op_on_a_block_is_refused(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    x = dist.scatter(torch.randn(1, 1, 2 * comm.size, 3)).clone()
    try:
        x[..., 0] = 1.0
        msg = ""
    except SpatialError as e:
        msg = str(e)
    assert_all_ranks(comm, "in-place" in msg, msg)


class ShapeOps(nn.Module):
    """Shape and per-cell ops that keep the split dims whole: a channel shuffle (view, transpose, view
    back), chunk and cat on channels, a permute to channels-last with layer_norm and linear there, basic
    indexing of channels, stack / unbind / softmax / a channel reduction, squeeze and unsqueeze, a view
    naming the global spatial sizes, functional max and average pools, then a global pool and a head."""

    def __init__(self, h: int, w: int) -> None:
        super().__init__()
        self.h, self.w = h, w
        self.conv, self.norm, self.fc = nn.Conv2d(3, 8, 3, 1, 1), nn.LayerNorm(8), nn.Linear(8, 8)
        self.head = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c, h, w = y.size()
        y = y.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, -1, h, w)  # channel shuffle
        a, b = y.chunk(2, dim=1)
        y = torch.cat([torch.sin(b), a], dim=1)
        z = self.fc(self.norm(y.permute(0, 2, 3, 1)))  # ConvNeXt's channels-last block
        y = y + z.permute(0, 3, 1, 2)
        first = y[:, :1] * y[:, 1].unsqueeze(1)
        pair = torch.stack([y[:, 2:5], y[:, 5:]], dim=2)  # N x 3 x 2 x H x W
        y = torch.cat([first, pair.sum(2), pair.unbind(2)[1], torch.softmax(y[:, :2], dim=1)], dim=1)
        y = y * y.amax(1, keepdim=True)
        y = y.reshape(n, 9, 1, self.h, self.w).squeeze(2)  # the global sizes, as a model may name them
        y = F.max_pool2d(y, 3, 1, 1) + F.avg_pool2d(y, 3, 2, 1, ceil_mode=True).mean((2, 3), keepdim=True)
        return self.head(y.mean((2, 3)))


def test_shape_ops_keeping_the_split_dims_whole_run_on_the_block_and_equal_one_process(comm):
    torch.manual_seed(0)
    for grid, samples in layouts(comm.size):
        h, w = 3 * grid[0] + 1, 2 * grid[1] + 3
        model = ShapeOps(h, w).double()
        x = torch.randn(max(2, samples), 3, h, w, dtype=torch.float64)
        dist = Distribution(comm, grid, samples)
        compare(comm, model, x, dist, f"shape ops grid {grid}x{samples}", rtol=1e-10)
        assert_all_ranks(comm, dist.redistributions == {}, f"redistributed {dist.redistributions}")


def test_shape_ops_that_mix_a_split_dim_redistribute_visibly_and_stay_exact(comm):
    dist = Distribution(comm, (comm.size, 1), 1)
    x = torch.randn(2, 3, 2 * comm.size + 1, 4, dtype=torch.float64)
    whole = torch.cat([x.flatten(2), x.transpose(2, 3).reshape(2, 3, -1), x[:, :, ::2].reshape(2, 3, -1)], dim=2)
    with pytest.warns(RuntimeWarning, match="not a spatial op"):
        b = dist.scatter(x)
        got = torch.cat([b.flatten(2), b.transpose(2, 3).reshape(2, 3, -1), b[:, :, ::2].reshape(2, 3, -1)], dim=2)
    moved = dict(dist.redistributions)
    assert_all_ranks(comm, torch.equal(plain(got), whole) and moved == {"flatten": 1, "reshape": 1, "__getitem__": 1},
                     f"redistributed {moved}")


def test_sizes_read_from_a_block_mean_the_whole_extent_after_a_redistribution(comm):
    """Swin's window attention reads ``B, H, W, C = x.shape`` on a channels-last block, pads (a
    redistribution to whole samples) and crops back with ``x[:, :H, :W]``: the crop keeps the whole map."""
    dist = Distribution(comm, (comm.size, 1), 1)
    x = torch.randn(2, 3, 2 * comm.size + 1, 4, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="not a spatial op"):
        b = dist.scatter(x).permute(0, 2, 3, 1)
        _, h, w, _ = b.shape
        got = F.pad(b, (0, 0, 0, 1, 0, 1))[:, :h, :w, :] + b
    assert_all_ranks(comm, torch.equal(plain(got), 2 * x.permute(0, 2, 3, 1)), "the crop lost rows")
