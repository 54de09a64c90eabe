"""Distributions of NCHW tensors over ``samples x ph x pw`` ranks: blocks, scatter, gather and layouts."""

from __future__ import annotations

from typing import Any

import torch

from .._utils.flat import spans
from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm.base import Communicator, split_sizes
from ._exchange import SendQueue
from .tensor import Layout, SpatialError, layout_of, plain, tag

__all__ = ["Distribution", "Layout", "SpatialError", "layout_of", "gather", "ranges"]

NONSPATIAL = ("replicate", "error")

def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Half-open ``[start, stop)`` index ranges of the `parts` blocks of `n` items (:func:`split_sizes`)."""
    return spans(split_sizes(n, parts))


class Distribution:
    """``samples`` groups of ``ph x pw`` ranks: the mini-batch is split over the groups, each sample's
    height over the grid rows and its width over the grid columns (blocked, uneven sizes allowed).

    World rank ``r`` is in group ``r // (ph*pw)`` at grid position ``divmod(r % (ph*pw), pw)``.
    Constructing one sends nothing; the spatial and sample communicators are split from `comm` once,
    collectively, by :meth:`connect` (which :func:`~mpitrain.spatial.parallelize` calls after it has
    checked the model, so a model it refuses is refused before any message) or at their first use.

    `nonspatial` says what a non-spatial op (flatten, linear, ...) does to a block split over the grid
    (see :mod:`mpitrain.spatial.tensor`): ``"replicate"`` redistributes it to whole samples first (one
    allgather over the spatial group, warned once per op and counted in :attr:`redistributions`),
    ``"error"`` raises :class:`SpatialError`. The distribution owns the queue of halo sends left in
    flight by the layers of the models parallelized over it (:attr:`sends`); a halo wait longer than
    ``stall.warn_after`` seconds warns, naming the ranks and boxes it waits for.
    """

    def __init__(self, comm: Communicator, grid: tuple[int, int] = (1, 1), samples: int = 1,
                 nonspatial: str = "replicate", stall: StallPolicy = DEFAULT_POLICY) -> None:
        grid = tuple(grid)  # type: ignore[assignment]  # a list is accepted too
        if len(grid) != 2 or any(not isinstance(g, int) or g < 1 for g in grid):
            raise SpatialError(f"grid must be two positive ints (ph, pw), got {grid!r}")
        if not isinstance(samples, int) or samples < 1:
            raise SpatialError(f"samples must be a positive int, got {samples!r}")
        if grid[0] * grid[1] * samples != comm.size:
            raise SpatialError(f"samples x ph x pw = {samples} x {grid[0]} x {grid[1]} = "
                               f"{samples * grid[0] * grid[1]} ranks, but the communicator has {comm.size}")
        if nonspatial not in NONSPATIAL:
            raise SpatialError(f"nonspatial must be one of {NONSPATIAL}, got {nonspatial!r}")
        self.comm, self.grid, self.samples, self.nonspatial = comm, grid, samples, nonspatial
        self.redistributions: dict[str, int] = {}
        self.sends = SendQueue(stall.warn_after)
        self.per_sample = grid[0] * grid[1]
        self.group, self.spatial_rank = divmod(comm.rank, self.per_sample)
        self.coords = divmod(self.spatial_rank, grid[1])
        self._comms: tuple[Communicator, Communicator] | None = None

    def connect(self) -> None:
        """Split the spatial and sample communicators (collective over `comm`; later calls do nothing)."""
        if self._comms is None:
            spatial = self.comm.split(self.group, self.spatial_rank)
            sample = self.comm.split(self.spatial_rank, self.group)
            assert spatial is not None and sample is not None  # every rank passes a colour
            self._comms = (spatial, sample)

    @property
    def spatial_comm(self) -> Communicator:
        """The ph x pw ranks of this rank's sample group (halo exchanges)."""
        self.connect()
        assert self._comms is not None
        return self._comms[0]

    @property
    def sample_comm(self) -> Communicator:
        """The ranks at this rank's grid position in every group (gathering whole samples)."""
        self.connect()
        assert self._comms is not None
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

    def local_samples(self, n: int) -> int:
        """How many of `n` samples this rank's group holds."""
        a, b = ranges(n, self.samples)[self.group]
        return b - a

    def replicate(self, t: torch.Tensor) -> torch.Tensor:
        """The whole samples of this group from this rank's block `t` (a SpatialTensor of kind "block"),
        replicated over the spatial group: one allgather over the spatial group (collective there).
        Differentiable: the gradient shares of the replicated result are summed over the group and each
        rank keeps its block's part."""
        layout = layout_of(t)
        if layout is None or layout.kind != "block":
            raise SpatialError("replicate needs a block (a SpatialTensor of kind 'block')")
        y = _Replicate.apply(plain(t), layout)
        return tag(y, Layout(self, "replicated", layout.shape))

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of the full NCHW `x` (a view, no copy: leave `x` unchanged while the block is
        in use), which must be equal on every rank.

        Differentiable: the gradient of `x` is the assembled gradient of all blocks, on every rank.
        Returns a :class:`~mpitrain.spatial.tensor.SpatialTensor`."""
        self.check_shape(tuple(x.shape), "scatter input")
        return tag(_Scatter.apply(plain(x), self), Layout(self, "block", tuple(x.shape)))

    def infer_layout(self, t: torch.Tensor) -> Layout:
        """The block layout of an untagged local block, from one allgather of the local sizes (collective
        over the world); refuses, on every rank, blocks that do not follow the blocking rule."""
        if t.dim() != 4:
            raise SpatialError(f"a spatial block must be NCHW, got shape {tuple(t.shape)}")
        gathered = self.comm.allgather(torch.tensor([t.shape[0], t.shape[2], t.shape[3]], dtype=torch.int64))
        sizes: list[list[int]] = gathered.view(self.comm.size, 3).tolist()
        per, pw = self.per_sample, self.grid[1]
        n = int(sum(sizes[g * per][0] for g in range(self.samples)))
        h = int(sum(sizes[i * pw][1] for i in range(self.grid[0])))
        w = int(sum(sizes[j][2] for j in range(pw)))
        shape = (n, t.shape[1], h, w)
        expected = [[s[0], s[2], s[3]] for s in (self.local_shape(shape, r) for r in range(len(sizes)))]
        if expected != sizes:
            raise SpatialError(f"local blocks {sizes} (n, h, w per rank) are not the blocks of a {shape} "
                               f"tensor "
                               f"under {self}; produce them with Distribution.scatter")
        return Layout(self, "block", shape)


def gather(t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """The full tensor on every rank, from this rank's block `t` (collective over the world).

    `t` must be a SpatialTensor (from ``Distribution.scatter`` or a parallelized module); with `like`, `t` is
    shaped like
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
    out: torch.Tensor = _Gather.apply(plain(t), layout)
    return out


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
    def forward(ctx: Any, x: torch.Tensor, dist: Distribution) -> torch.Tensor:
        ctx.dist, ctx.shape = dist, tuple(x.shape)
        (n0, n1), (h0, h1), (w0, w1) = dist.box(ctx.shape)
        return x[n0:n1, :, h0:h1, w0:w1]  # a view: no copy

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _assemble_blocks(g.contiguous(), Layout(ctx.dist, "block", ctx.shape)), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, layout: Layout) -> torch.Tensor:
        ctx.layout = layout
        if layout.kind == "block":
            return _assemble_blocks(t, layout)
        return _assemble_samples(t, layout)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        layout = ctx.layout
        dist = layout.dist
        if layout.kind == "block":
            (n0, n1), (h0, h1), (w0, w1) = dist.box(layout.shape)
            return g[n0:n1, :, h0:h1, w0:w1].contiguous(), None
        n0, n1 = ranges(layout.shape[0], dist.samples)[dist.group]
        share = g[n0:n1].contiguous()
        return (share if dist.spatial_rank == 0 else torch.zeros_like(share)), None


class _Replicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, layout: Layout) -> torch.Tensor:
        ctx.layout = layout
        dist, shape = layout.dist, layout.shape
        n = dist.local_samples(shape[0])
        boxes = [dist.box(shape, dist.world_rank(dist.group, s))[1:] for s in range(dist.per_sample)]
        numel = max(n * shape[1] * (h1 - h0) * (w1 - w0) for (h0, h1), (w0, w1) in boxes)
        rows = _padded_allgather(dist.spatial_comm, t.contiguous(), numel)
        out = t.new_empty((n, *shape[1:]))
        for s, ((h0, h1), (w0, w1)) in enumerate(boxes):
            size = n * shape[1] * (h1 - h0) * (w1 - w0)
            out[:, :, h0:h1, w0:w1] = rows[s, :size].view(n, shape[1], h1 - h0, w1 - w0)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        layout = ctx.layout
        dist = layout.dist
        total = dist.spatial_comm.allreduce(g.contiguous().clone(), "sum")
        _, (h0, h1), (w0, w1) = dist.box(layout.shape)
        return total[:, :, h0:h1, w0:w1].contiguous(), None
