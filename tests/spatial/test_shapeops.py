"""The shape-op rules on a block, in one process: which ops keep dim 0 and the spatial dims whole and
where those dims go (channel shuffle, permutes, flatten of channels, indexing, squeeze decided on the
global shape); ops merging or splitting a spatial dim are not local."""

from __future__ import annotations

import torch

from mpitrain.spatial._shapeops import local_rule, map_view

X = torch.zeros(2, 8, 3, 5)  # a block: 2 samples, 8 channels, 3 x 5 of a 7 x 10 sample
GLOBAL = (4, 8, 7, 10)
HW = (2, 3)


def rule(name, *args, **kwargs):
    out = local_rule(name, X, GLOBAL, HW, (X, *args), kwargs)
    return None if out is None else out[0]


def test_channel_shuffle_flatten_and_unflatten_of_channels_keep_the_spatial_dims():
    assert rule("view", 2, 2, 4, 3, 5) == (3, 4)
    assert rule("view", 2, -1, 3, 5) == (2, 3)
    assert rule("reshape", (2, 4, 2, 3, 5)) == (3, 4)
    assert rule("unflatten", 1, (2, 4)) == (3, 4)
    assert rule("view", 2, 2, 4, 7, 10) == (3, 4)  # global spatial sizes: see below


def test_a_view_naming_the_global_spatial_sizes_runs_with_the_blocks_sizes():
    out = local_rule("view", X, GLOBAL, HW, (X, 2, 2, 4, 7, 10), {})
    assert out is not None and out[0] == (3, 4) and out[1][1] == (2, 2, 4, 3, 5)


def test_merging_or_splitting_a_spatial_dim_or_moving_the_samples_is_not_local():
    assert rule("flatten", 2) is None
    assert rule("view", 2, 8, 15) is None
    assert rule("view", 16, 3, 5) is None  # samples merged with channels
    assert rule("transpose", 0, 1) is None
    assert rule("permute", 1, 0, 2, 3) is None
    assert map_view([2, 8, 3, 5], [2, 8, 5, 3], (0, 2, 3)) is None


def test_permutes_track_where_the_spatial_dims_go():
    assert rule("permute", 0, 2, 3, 1) == (1, 2)
    assert rule("permute", (0, 3, 1, 2)) == (3, 1)  # N x W x C x H
    assert rule("transpose", 2, 3) == (3, 2)
    assert rule("movedim", 1, -1) == (1, 2)
    assert rule("flatten", 0, 1) is None  # samples merged away


def test_indexing_splitting_and_reductions_along_channels_are_local():
    assert rule("__getitem__", (slice(None), 0)) == (1, 2)
    assert rule("__getitem__", (slice(None), slice(0, 4), None)) == (3, 4)
    assert rule("__getitem__", (Ellipsis, slice(1, 2), slice(None))) is None  # a row range of the block
    assert rule("__getitem__", (slice(None), torch.tensor([0, 1]))) is None  # advanced indexing
    assert rule("chunk", 2, 1) == HW and rule("chunk", 2, 2) is None
    assert rule("select", 1, 3) == (1, 2) and rule("unbind", 1) == (1, 2)
    assert rule("sum", 1) == (1, 2) and rule("sum", 1, True) == HW and rule("sum", (2, 3)) is None
    assert rule("max", 1) == (1, 2) and rule("max") is None
    assert rule("softmax", 1) == HW and rule("softmax", -1) is None
    assert rule("layer_norm", (5,)) is None and rule("linear", torch.zeros(4, 5)) is None


def test_squeeze_is_decided_on_the_global_shape():
    x = torch.zeros(2, 1, 1, 5)  # a block one row high of a 1-channel 4-row tensor
    out = local_rule("squeeze", x, (2, 1, 4, 10), HW, (x,), {})
    assert out is not None and out[0] == (1, 2) and out[1][1] == (1,)
    assert local_rule("squeeze", x, (2, 1, 4, 10), HW, (x, 2), {}) is not None  # no-op: the dim is not 1


def test_size_one_spatial_dims_map_in_order():
    x = torch.zeros(2, 8, 1, 1)  # a 1 x 1 block (a 2x2 grid over a 2x2 map)
    out = local_rule("view", x, (2, 8, 2, 2), HW, (x, 2, 2, 4, 1, 1), {})
    assert out is not None and out[0] == (3, 4)
    assert map_view([2, 8, 1, 1], [2, 8, 1, 1, 1], (0, 2, 3)) == (0, 2, 3)
