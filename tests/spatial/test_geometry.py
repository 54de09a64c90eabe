"""Halo geometry checked in one process against brute force: plans, interiors, torch's output sizes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mpitrain.spatial import SpatialError, plan_grid, window_of
from mpitrain.spatial.conv import _aligned, _strips, interior
from mpitrain.spatial.distribution import ranges
from mpitrain.spatial.halo import Box

KERNELS, STRIDES, PADS, DILATIONS = (1, 2, 3, 5, 7), (1, 2, 3), (0, 1, 3, "same"), (1, 2)
GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 1), (4, 1), (3, 2)]


def configs():
    for k, s, p, d in itertools.product(KERNELS, STRIDES, PADS, DILATIONS):
        if p == "same" and s > 1:
            continue
        yield k, s, p, d


def cells(box):
    return {(i, j) for i in range(*box.rows) for j in range(*box.cols)}


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_every_needed_cell_comes_from_exactly_one_owner_or_is_padding(grid):
    checked = 0
    for (k, s, p, d), (h, w) in itertools.product(configs(), [(9, 13), (15, 10), (11, 11)]):
        wins = window_of(k, s, p, d)
        try:
            plans = plan_grid((h, w), grid, wins)
        except SpatialError:
            continue
        for me in plans:
            got = cells(me.local)
            for src, box in me.recvs:
                assert not (got & cells(box)), f"cell received twice: {me}"
                assert cells(box) <= cells(plans[src].owned)
                assert (me.rank, box) in plans[src].sends, "a receive without its matching send"
                got |= cells(box)
            assert got == cells(me.need & me.valid), f"wrong cover: {me}"
            checked += 1
    assert checked > 100


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_output_blocks_partition_torch_output_and_read_exactly_the_needed_rows(grid):
    for (k, s, p, d), (h, w) in itertools.product(configs(), [(9, 13), (14, 12)]):
        wins = window_of(k, s, p, d)
        pad = p if p == "same" else (p, p)
        try:
            y = F.conv2d(torch.zeros(1, 1, h, w), torch.zeros(1, 1, k, k), stride=s, padding=pad, dilation=d)
        except RuntimeError:  # torch refuses a kernel larger than the padded input; so does the plan
            assert wins[0].out_size(h) == 0 or wins[1].out_size(w) == 0
            with pytest.raises(SpatialError):
                plan_grid((h, w), grid, wins)
            continue
        assert (wins[0].out_size(h), wins[1].out_size(w)) == tuple(y.shape[2:])
        try:
            plans = plan_grid((h, w), grid, wins)
        except SpatialError:
            assert y.shape[2] < grid[0] or y.shape[3] < grid[1] or h < grid[0] or w < grid[1]
            continue
        assert set().union(*(cells(pl.out) for pl in plans)) == cells(Box((0, y.shape[2]), (0, y.shape[3])))
        for pl in plans:  # brute force: the rows every output of the block reads
            lo = min(o * s - wins[0].pad[0] for o in range(*pl.out.rows))
            hi = max(o * s - wins[0].pad[0] + d * (k - 1) for o in range(*pl.out.rows)) + 1
            assert pl.need.rows == (lo, hi)


def test_interior_outputs_read_no_halo_cell_and_strips_cover_the_rest():
    for (k, s, p, d), grid in itertools.product(configs(), [(2, 1), (2, 2), (3, 1)]):
        wins = window_of(k, s, p, d)
        try:
            plans = plan_grid((13, 11), grid, wins)
        except SpatialError:
            continue
        for pl in plans:
            (r0, r1), (c0, c1) = interior(pl, wins)
            halo = set().union(*(cells(b) for _, b in pl.recvs)) if pl.recvs else set()
            for i, j in itertools.product(range(r0, r1), range(c0, c1)):
                a, c = pl.need.rows[0] + i * s, pl.need.cols[0] + j * s
                reads = {(a + d * u, c + d * v) for u in range(k) for v in range(k)}
                assert not reads & halo, f"interior output {(i, j)} reads a halo cell: {pl}"
            strips = _strips(pl, wins) if _aligned(pl, wins) else []
            strip_cells = set().union(*(cells(Box((a, b), (e, f))) for (a, b, e, f), _ in strips))
            if strip_cells:
                inner = {(i, j) for i in range(r0, r1) for j in range(c0, c1)}
                everything = {(i, j) for i in range(pl.out.shape[0]) for j in range(pl.out.shape[1])}
                assert strip_cells | inner == everything


def test_halo_wider_than_the_neighbour_block_comes_from_several_ranks():
    pl = plan_grid((9, 4), (4, 1), window_of(7, 1, 3, 1))[1]  # owns rows 3:5, needs 0:8
    assert [src for src, _ in pl.recvs] == [0, 2, 3]
    assert "recv" in str(pl) and "[0:3, 0:4]<-0" in str(pl)


def test_layer_whose_output_is_smaller_than_the_grid_is_refused_with_the_sizes():
    with pytest.raises(SpatialError, match=r"9x9 -> output 2x2.*4x1 grid"):
        plan_grid((9, 9), (4, 1), window_of(7, 2, 0, 1))


def test_ranges_are_the_blocking_rule():
    assert ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
