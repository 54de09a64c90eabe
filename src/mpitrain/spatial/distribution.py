"""Distributions of NCHW tensors over ``samples x ph x pw`` ranks: blocks, scatter, gather and layouts."""

from __future__ import annotations

import math
from typing import Any

import torch

from .._utils.flat import spans
from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm.base import Communicator, split_sizes
from ..comm.place import Place, PlaceError
from ._exchange import SendQueue
from .tensor import Layout, SpatialError, layout_of, own_share, plain, tag, to_nchw

__all__ = ["Distribution", "Layout", "SpatialError", "layout_of", "gather", "gather_group", "ranges"]

NONSPATIAL = ("replicate", "error")

def ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Half-open ``[start, stop)`` index ranges of the `parts` blocks of `n` items (:func:`split_sizes`)."""
    return spans(split_sizes(n, parts))


class Distribution:
    """``samples`` groups of ``ph x pw`` ranks: the mini-batch is split over the groups, each sample's
    height over the grid rows and its width over the grid columns (blocked, uneven sizes allowed). A
    3-D grid ``(pd, ph, pw)`` splits volumes (N, C, D, H, W) the same way, depth first.

    World rank ``r`` is in group ``r // (ph*pw)`` at the row-major grid position of ``r % (ph*pw)``
    (:attr:`place`: the project's one placement rule, :class:`~mpitrain.comm.place.Place`, whose replicas
    are the sample groups). Constructing one sends nothing; the spatial and sample communicators (the
    place's spatial and replica groups) are split from `comm` once, collectively, by :meth:`connect`
    (which :func:`~mpitrain.spatial.parallelize` calls after it has checked the model, so a model it
    refuses is refused before any message) or at their first use.

    `nonspatial` says what a non-spatial op (flatten, linear, ...) does to a block split over the grid
    (see :mod:`mpitrain.spatial.tensor`): ``"replicate"`` redistributes it to whole samples first (one
    allgather over the spatial group, warned once per op and counted in :attr:`redistributions`),
    ``"error"`` raises :class:`SpatialError`. The distribution owns the queue of halo sends left in
    flight by the layers of the models parallelized over it (:attr:`sends`); a halo wait longer than
    ``stall.warn_after`` seconds warns, naming the ranks and boxes it waits for, and one longer than
    ``stall.abort_after`` seconds ends the job (``comm.abort``), saying so.
    """

    def __init__(self, comm: Communicator, grid: tuple[int, ...] = (1, 1), samples: int = 1,
                 nonspatial: str = "replicate", stall: StallPolicy = DEFAULT_POLICY) -> None:
        grid = tuple(grid)  # a list is accepted too
        if len(grid) not in (2, 3) or any(not isinstance(g, int) or g < 1 for g in grid):
            raise SpatialError(f"grid must be two or three positive ints ((pd,) ph, pw), got {grid!r}")
        if not isinstance(samples, int) or samples < 1:
            raise SpatialError(f"samples must be a positive int, got {samples!r}")
        try:
            #: this rank's place: `samples` replicas (sample groups) of one `grid`
            self.place = Place(comm.size, comm.rank, samples, 1, grid)
        except PlaceError as e:
            raise SpatialError(f"samples x grid = {samples} x {'x'.join(map(str, grid))} = {samples * math.prod(grid)} "
                               f"ranks, but the communicator has {comm.size} ({e})") from None
        if nonspatial not in NONSPATIAL:
            raise SpatialError(f"nonspatial must be one of {NONSPATIAL}, got {nonspatial!r}")
        self.comm, self.grid, self.samples, self.nonspatial = comm, grid, samples, nonspatial
        self.redistributions: dict[str, int] = {}
        #: set by fit while its loss runs on blocks: an op that would make a value of one sample group
        #: (a non-spatial op on a block, a replicated value leaving the layout) raises NonSpatialOpError
        self.loss_on_blocks = False
        self.sends = SendQueue(stall, comm.abort)
        self.per_sample = self.place.cells
        self.group, self.spatial_rank = self.place.replica, self.place.cell_index
        self.coords = self.place.cell
        self._comms: tuple[Communicator, Communicator] | None = None

    def connect(self) -> None:
        """Split the spatial and sample communicators (collective over `comm`; later calls do nothing)."""
        if self._comms is None:
            groups = self.place.split(self.comm, ("replica", "spatial"))
            self._comms = (groups.of("spatial"), groups.of("replica"))

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
        return self.place.rank_of(group, 0, self.place.cell_of(spatial_rank))

    def grid_coords(self, spatial_rank: int) -> tuple[int, ...]:
        """The row-major grid position of a spatial rank."""
        return self.place.cell_of(spatial_rank)

    def check_shape(self, shape: tuple[int, ...], what: str = "tensor", *, dense: bool = False) -> None:
        """Refuse a global shape that is not N x C x (grid's dimensions) — with `dense`, also N x (grid's
        dimensions), a dense target such as an N x H x W label map — or leaves some rank an empty block
        (local check, no message)."""
        dims = len(self.grid)
        if len(shape) != dims + 2 and not (dense and len(shape) == dims + 1):
            name = "NCHW" if dims == 2 else "NCDHW"
            raise SpatialError(f"{what} must be {name} ({dims + 2}-D){' or ' + name.replace('C', '') if dense else ''}"
                               f" for grid {self.grid}, got shape {tuple(shape)}")
        if shape[0] < self.samples or any(n < g for n, g in zip(shape[len(shape) - dims:], self.grid)):
            raise SpatialError(f"{what} of shape {tuple(shape)} cannot be split into {self.samples} sample "
                               f"groups x grid {self.grid}: every rank needs at least one sample, row and "
                               f"column")

    def box(self, shape: tuple[int, ...], rank: int | None = None) -> tuple[tuple[int, int], ...]:
        """``((n0, n1), (h0, h1), (w0, w1))`` — with a 3-D grid ``((n0, n1), (d0, d1), (h0, h1),
        (w0, w1))`` — of world rank `rank` (default: this rank) for global `shape`: samples are dim 0,
        the grid splits the last ``len(grid)`` dims (N x C x H x W activations, N x H x W dense targets)."""
        group, _, coords = self.place.coords_of(self.comm.rank if rank is None else rank)
        return (ranges(shape[0], self.samples)[group],
                *(ranges(n, g)[c] for n, g, c in zip(shape[len(shape) - len(self.grid):], self.grid, coords)))

    def index(self, shape: tuple[int, ...], rank: int | None = None) -> tuple[slice, ...]:
        """The slices of world rank `rank`'s block in a global tensor of `shape`."""
        n, *spatial = self.box(shape, rank)
        whole = (slice(None),) * (len(shape) - 1 - len(spatial))
        return (slice(*n), *whole, *(slice(*r) for r in spatial))

    def local_shape(self, shape: tuple[int, ...], rank: int | None = None) -> tuple[int, ...]:
        n, *spatial = self.box(shape, rank)
        return (n[1] - n[0], *shape[1:len(shape) - len(spatial)], *(b - a for a, b in spatial))

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
        """This rank's block of the full `x` (a view, no copy: leave `x` unchanged while the block is
        in use), which must be equal on every rank: an NCHW (NCDHW) input, or a dense target laid out like
        an output (N x H x W class indices, N x C x H x W values).

        Differentiable: the gradient of `x` is the assembled gradient of all blocks, on every rank.
        Returns a :class:`~mpitrain.spatial.tensor.SpatialTensor`."""
        self.check_shape(tuple(x.shape), "scatter input", dense=True)
        return tag(_Scatter.apply(plain(x), self), Layout(self, "block", tuple(x.shape)))

    def infer_layout(self, t: torch.Tensor) -> Layout:
        """The block layout of an untagged local block, from one allgather of the local sizes (collective
        over the world); refuses, on every rank, blocks that do not follow the blocking rule."""
        dims = len(self.grid)
        if t.dim() != dims + 2:
            raise SpatialError(f"a spatial block must have {dims + 2} dimensions for grid {self.grid}, got "
                               f"shape {tuple(t.shape)}")
        mine = [t.shape[0], *t.shape[2:]]
        gathered = self.comm.allgather(torch.tensor(mine, dtype=torch.int64))
        sizes: list[list[int]] = gathered.view(self.comm.size, dims + 1).tolist()
        n = int(sum(sizes[g * self.per_sample][0] for g in range(self.samples)))
        spatial = []
        for d in range(dims):  # walk the grid along dimension d from the origin
            stride = math.prod(self.grid[d + 1:])
            spatial.append(int(sum(sizes[i * stride][d + 1] for i in range(self.grid[d]))))
        shape = (n, t.shape[1], *spatial)
        expected = [[s[0], *s[2:]] for s in (self.local_shape(shape, r) for r in range(len(sizes)))]
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
    restore = None
    if like is None:
        t, restore = to_nchw(t)  # a block whose spatial dims a shape op moved: gathered as N x C x (spatial)
    layout = layout_of(like if like is not None else t)
    if layout is not None and layout.kind == "group":  # one sample group's value, as a plain tensor
        return plain(t)
    if layout is None:
        raise SpatialError("gather needs a block produced by Distribution.scatter or a parallelized module "
                           "(or pass like=<such a block> for a tensor shaped like one, e.g. its .grad)")
    if like is not None and like.shape != t.shape:
        raise SpatialError(f"gather: tensor shape {tuple(t.shape)} differs from like's {tuple(like.shape)}")
    out: torch.Tensor = _Gather.apply(plain(t), layout)
    return out if restore is None else restore(out)


def gather_group(t: torch.Tensor) -> torch.Tensor:
    """This rank's sample group's whole samples (its rows of the global batch, every cell), on every
    rank of the spatial group, from this rank's block `t` (a SpatialTensor). Collective over the
    spatial group only (one allgather for a block; nothing for a tensor already replicated there).

    Differentiable with :func:`gather`'s convention: every rank of the group is expected to hold the
    same output gradient (each computes the same loss on the group's samples); the backward keeps this
    rank's block of it (a replicated tensor: spatial rank 0 keeps it, the others zero), so the
    gradients summed over the world are those of the sum of the groups' losses."""
    t, restore = to_nchw(t)
    layout = layout_of(t)
    if layout is not None and layout.kind == "group":  # already this group's value
        return plain(t)
    if layout is None:
        raise SpatialError("gather_group needs a block produced by Distribution.scatter or a parallelized module")
    out: torch.Tensor = _GatherGroup.apply(plain(t), layout)
    return restore(out)


def _group_blocks(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The group's whole samples from every spatial rank's block (one allgather over the spatial group)."""
    dist, shape = layout.dist, layout.shape
    ranks = dist.place.members("spatial")
    shapes = [dist.local_shape(shape, r) for r in ranks]
    rows = _padded_allgather(dist.spatial_comm, t.contiguous(), max(math.prod(s) for s in shapes))
    out = t.new_empty((dist.local_samples(shape[0]), *shape[1:]))
    for s, (r, local) in enumerate(zip(ranks, shapes)):
        out[(slice(None), *dist.index(shape, r)[1:])] = rows[s, :math.prod(local)].view(local)
    return out


def _padded_allgather(comm: Communicator, t: torch.Tensor, numel: int) -> torch.Tensor:
    """(comm.size, numel) rows: every rank's flattened `t`, zero-padded to `numel` elements."""
    buf = t.new_zeros(numel)
    buf[:t.numel()] = t.reshape(-1)
    return comm.allgather(buf).view(comm.size, numel)


def _assemble_blocks(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    dist, shape = layout.dist, layout.shape
    shapes = [dist.local_shape(shape, r) for r in range(dist.comm.size)]
    rows = _padded_allgather(dist.comm, t.contiguous(), max(math.prod(s) for s in shapes))
    out = t.new_empty(shape)
    for r, s in enumerate(shapes):
        out[dist.index(shape, r)] = rows[r, :math.prod(s)].view(s)
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
        return x[dist.index(ctx.shape)]  # a view: no copy

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
        n0, n1 = ranges(layout.shape[0], layout.dist.samples)[layout.dist.group]
        return own_share(g[n0:n1], layout), None


class _GatherGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, layout: Layout) -> torch.Tensor:
        ctx.layout = layout
        return _group_blocks(t, layout) if layout.kind == "block" else t.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return own_share(g, ctx.layout), None


class _Replicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, layout: Layout) -> torch.Tensor:
        ctx.layout = layout
        return _group_blocks(t, layout)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        # the result is replicated: its gradient arrives as shares, summed here (the true gradient of the
        # group's samples), of which this rank's block is its own part
        total = ctx.layout.dist.spatial_comm.allreduce(g.contiguous().clone(), "sum")
        return own_share(total, ctx.layout), None
