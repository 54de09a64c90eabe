"""Distributions of NCHW tensors over ``samples x ph x pw`` ranks: blocks, scatter, gather and layouts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.base import Communicator, split_sizes

__all__ = ["Distribution", "Layout", "layout_of", "tag", "gather", "ranges", "SpatialError"]

#: Attribute under which a block carries its :class:`Layout` (set by scatter and the spatial layers).
LAYOUT_ATTR = "_mpitrain_layout"


class SpatialError(ValueError):
    """A spatial layer, distribution or shape cannot work; raised on every rank before any message."""


def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Half-open ``[start, stop)`` index ranges of the `parts` blocks of `n` items (:func:`split_sizes`)."""
    out, start = [], 0
    for size in split_sizes(n, parts):
        out.append((start, start + size))
        start += size
    return out


class Distribution:
    """``samples`` groups of ``ph x pw`` ranks: the mini-batch is split over the groups, each sample's
    height over the grid rows and its width over the grid columns (blocked, uneven sizes allowed).

    World rank ``r`` is in group ``r // (ph*pw)`` at grid position ``divmod(r % (ph*pw), pw)``.
    Constructing one sends nothing; the spatial and sample communicators are split from `comm` once,
    collectively, by :meth:`connect` (which :func:`~mpitrain.spatial.parallelize` calls after it has
    checked the model, so a model it refuses is refused before any message) or at their first use.
    """

    def __init__(self, comm: Communicator, grid: tuple[int, int] = (1, 1), samples: int = 1) -> None:
        grid = tuple(grid)
        if len(grid) != 2 or any(not isinstance(g, int) or g < 1 for g in grid):
            raise SpatialError(f"grid must be two positive ints (ph, pw), got {grid!r}")
        if not isinstance(samples, int) or samples < 1:
            raise SpatialError(f"samples must be a positive int, got {samples!r}")
        if grid[0] * grid[1] * samples != comm.size:
            raise SpatialError(f"samples x ph x pw = {samples} x {grid[0]} x {grid[1]} = "
                               f"{samples * grid[0] * grid[1]} ranks, but the communicator has {comm.size}")
        self.comm, self.grid, self.samples = comm, grid, samples
        self.per_sample = grid[0] * grid[1]
        self.group, self.spatial_rank = divmod(comm.rank, self.per_sample)
        self.coords = divmod(self.spatial_rank, grid[1])
        self._comms: tuple[Communicator, Communicator] | None = None

    def connect(self) -> None:
        """Split the spatial and sample communicators (collective over `comm`; later calls do nothing)."""
        if self._comms is None:
            self._comms = (self.comm.split(self.group, self.spatial_rank),
                           self.comm.split(self.spatial_rank, self.group))

    @property
    def spatial_comm(self) -> Communicator:
        """The ph x pw ranks of this rank's sample group (halo exchanges)."""
        self.connect()
        return self._comms[0]

    @property
    def sample_comm(self) -> Communicator:
        """The ranks at this rank's grid position in every group (gathering whole samples)."""
        self.connect()
        return self._comms[1]

    def __repr__(self) -> str:
        return f"Distribution(samples={self.samples}, grid={self.grid}, rank={self.comm.rank})"

    def __deepcopy__(self, memo: dict) -> Distribution:
        return self  # a handle on communicators: copies of a model share it

    def world_rank(self, group: int, spatial_rank: int) -> int:
        return group * self.per_sample + spatial_rank

    def check_shape(self, shape: tuple[int, ...], what: str = "tensor") -> None:
        """Refuse a global NCHW shape that leaves some rank an empty block (local check, no message)."""
        if len(shape) != 4:
            raise SpatialError(f"{what} must be NCHW (4-D), got shape {tuple(shape)}")
        n, _, h, w = shape
        if n < self.samples or h < self.grid[0] or w < self.grid[1]:
            raise SpatialError(f"{what} of shape {tuple(shape)} cannot be split into {self.samples} sample "
                               f"groups x grid {self.grid}: every rank needs at least one sample, row and "
                               f"column")

    def box(self, shape: tuple[int, ...], rank: int | None = None) -> tuple[tuple[int, int], ...]:
        """``((n0, n1), (h0, h1), (w0, w1))`` of world rank `rank` (default: this rank) for global `shape`."""
        rank = self.comm.rank if rank is None else rank
        group, s = divmod(rank, self.per_sample)
        i, j = divmod(s, self.grid[1])
        n, _, h, w = shape
        return ranges(n, self.samples)[group], ranges(h, self.grid[0])[i], ranges(w, self.grid[1])[j]

    def local_shape(self, shape: tuple[int, ...], rank: int | None = None) -> tuple[int, int, int, int]:
        (n0, n1), (h0, h1), (w0, w1) = self.box(shape, rank)
        return (n1 - n0, shape[1], h1 - h0, w1 - w0)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of the full NCHW `x` (a view, no copy: leave `x` unchanged while the block is
        in use), which must be equal on every rank.

        Differentiable: the gradient of `x` is the assembled gradient of all blocks, on every rank."""
        self.check_shape(tuple(x.shape), "scatter input")
        return tag(_Scatter.apply(x, self), Layout(self, "block", tuple(x.shape)))

    def infer_layout(self, t: torch.Tensor) -> Layout:
        """The block layout of an untagged local block, from one allgather of the local sizes (collective
        over the world); refuses, on every rank, blocks that do not follow the blocking rule."""
        if t.dim() != 4:
            raise SpatialError(f"a spatial block must be NCHW, got shape {tuple(t.shape)}")
        sizes = self.comm.allgather(torch.tensor([t.shape[0], t.shape[2], t.shape[3]], dtype=torch.int64))
        sizes = sizes.view(self.comm.size, 3).tolist()
        per, pw = self.per_sample, self.grid[1]
        n = sum(sizes[g * per][0] for g in range(self.samples))
        h = sum(sizes[i * pw][1] for i in range(self.grid[0]))
        w = sum(sizes[j][2] for j in range(pw))
        shape = (n, t.shape[1], h, w)
        expected = [[s[0], s[2], s[3]] for s in (self.local_shape(shape, r) for r in range(len(sizes)))]
        if expected != sizes:
            raise SpatialError(f"local blocks {sizes} (n, h, w per rank) are not the blocks of a {shape} "
                               f"tensor "
                               f"under {self}; produce them with Distribution.scatter")
        return Layout(self, "block", shape)


@dataclass(frozen=True)
class Layout:
    """How a local tensor sits in the global one. ``kind="block"``: the NCHW block of `dist`;
    ``kind="replicated"``: samples split over the groups, the rest replicated in each spatial group
    (e.g. after a global AdaptiveAvgPool2d). `shape` is the global shape."""

    dist: Distribution
    kind: str
    shape: tuple[int, ...]


def layout_of(t: torch.Tensor) -> Layout | None:
    return getattr(t, LAYOUT_ATTR, None)


def tag(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Attach `layout` to `t` (in place, returns `t`)."""
    setattr(t, LAYOUT_ATTR, layout)
    return t


def gather(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor on every rank, from this rank's block `t` (collective over the world).

    `t` must come from ``Distribution.scatter`` or a parallelized module; with `like`, `t` is shaped like
    such a block (e.g. its ``.grad``) and is laid out the same way. Differentiable: the backward takes
    this rank's block of the (replicated) output gradient; for a tensor replicated inside the spatial
    group only spatial rank 0 keeps it (gradients of replicated tensors are shares summed by the group).
    """
    layout = layout_of(like if like is not None else t)
    if layout is None:
        raise SpatialError("gather needs a block produced by Distribution.scatter or a parallelized module "
                           "(or pass like=<such a block> for a tensor shaped like one, e.g. its .grad)")
    if like is not None and like.shape != t.shape:
        raise SpatialError(f"gather: tensor shape {tuple(t.shape)} differs from like's {tuple(like.shape)}")
    return _Gather.apply(t, layout)


def _padded_allgather(comm: Communicator, t: torch.Tensor, numel: int) -> torch.Tensor:
    """(comm.size, numel) rows: every rank's flattened `t`, zero-padded to `numel` elements."""
    buf = t.new_zeros(numel)
    buf[:t.numel()] = t.reshape(-1)
    return comm.allgather(buf).view(comm.size, numel)


def _assemble_blocks(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    dist, shape = layout.dist, layout.shape
    boxes = [dist.box(shape, r) for r in range(dist.comm.size)]
    numel = max((n1 - n0) * shape[1] * (h1 - h0) * (w1 - w0) for (n0, n1), (h0, h1), (w0, w1) in boxes)
    rows = _padded_allgather(dist.comm, t.contiguous(), numel)
    out = t.new_empty(shape)
    for r, ((n0, n1), (h0, h1), (w0, w1)) in enumerate(boxes):
        size = (n1 - n0) * shape[1] * (h1 - h0) * (w1 - w0)
        out[n0:n1, :, h0:h1, w0:w1] = rows[r, :size].view(n1 - n0, shape[1], h1 - h0, w1 - w0)
    return out


def _assemble_samples(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    dist, shape = layout.dist, layout.shape
    spans = ranges(shape[0], dist.samples)
    row = int(torch.Size(shape[1:]).numel())
    rows = _padded_allgather(dist.sample_comm, t.contiguous(), max(b - a for a, b in spans) * row)
    return torch.cat([rows[g, :(b - a) * row].view(b - a, *shape[1:]) for g, (a, b) in enumerate(spans)])


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dist: Distribution) -> torch.Tensor:
        ctx.dist, ctx.shape = dist, tuple(x.shape)
        (n0, n1), (h0, h1), (w0, w1) = dist.box(ctx.shape)
        return x[n0:n1, :, h0:h1, w0:w1]  # a view: no copy

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _assemble_blocks(g.contiguous(), Layout(ctx.dist, "block", ctx.shape)), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, layout: Layout) -> torch.Tensor:
        ctx.layout = layout
        if layout.kind == "block":
            return _assemble_blocks(t, layout)
        return _assemble_samples(t, layout)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        layout = ctx.layout
        dist = layout.dist
        if layout.kind == "block":
            (n0, n1), (h0, h1), (w0, w1) = dist.box(layout.shape)
            return g[n0:n1, :, h0:h1, w0:w1].contiguous(), None
        n0, n1 = ranges(layout.shape[0], dist.samples)[dist.group]
        share = g[n0:n1].contiguous()
        return (share if dist.spatial_rank == 0 else torch.zeros_like(share)), None
