"""Redistribution (§III-C): one all-to-all moves a tensor between any two distributions; its backward
is the reverse shuffle (a permutation's adjoint is its inverse)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from .distribution import Distribution
from .tensor import DistributionLike, Layout, SpatialError, layout_of, plain, tag

__all__ = ["Redistribute", "redistribute", "SampleSwitch", "sample_distribution"]

#: ``((n0, n1), (h0, h1), (w0, w1))`` (or with a depth range): a block of a global tensor, channels whole.
Ranges = tuple[tuple[int, int], ...]


def _meet(a: Ranges, b: Ranges) -> Ranges | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return None if any(hi <= lo for lo, hi in out) else out


def _index(box: Ranges, origin: Ranges) -> tuple[slice, ...]:
    parts = [slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin)]
    return (parts[0], slice(None), *parts[1:])


def _numel(box: Ranges | None, channels: int) -> int:
    return 0 if box is None else channels * math.prod(b - a for a, b in box)


def shuffle(x: torch.Tensor, shape: tuple[int, ...], src: Distribution, dst: Distribution) -> torch.Tensor:
    """This rank's `dst` block of the global `shape` tensor whose `src` blocks the ranks hold (collective:
    one alltoallv over ``src.comm``; every rank sends each other rank the intersection of the blocks)."""
    comm, me, c = src.comm, src.comm.rank, shape[1]
    mine, want = (src.box(shape, me)), (dst.box(shape, me))
    outgoing = [_meet(mine, (dst.box(shape, q))) for q in range(comm.size)]
    incoming = [_meet((src.box(shape, q)), want) for q in range(comm.size)]
    pieces = [x[_index(b, mine)].reshape(-1) for b in outgoing if b is not None]
    send = torch.cat(pieces) if pieces else x.new_empty(0)
    recv = comm.alltoallv(send, [_numel(b, c) for b in outgoing], [_numel(b, c) for b in incoming])
    y = x.new_empty(dst.local_shape(shape, me))
    offset = 0
    for b in incoming:
        if b is not None:
            count = _numel(b, c)
            region = y[_index(b, want)]
            region.copy_(recv[offset:offset + count].view(region.shape))
            offset += count
    return y


class _Shuffle(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shape: tuple[int, ...], src: Distribution, dst: Distribution
                ) -> torch.Tensor:
        ctx.shape, ctx.src, ctx.dst = shape, src, dst
        return shuffle(x.contiguous(), shape, src, dst)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return shuffle(g.contiguous(), ctx.shape, ctx.dst, ctx.src), None, None, None


def redistribute(x: torch.Tensor, src: DistributionLike, dst: Distribution) -> torch.Tensor:
    """`x` (a `src` block) as this rank's `dst` block, differentiably. Both distributions must be over the
    same ranks in the same order (checked locally: same communicator size and rank)."""
    if src.comm.size != dst.comm.size or src.comm.rank != dst.comm.rank:
        raise SpatialError(f"cannot redistribute between {src} and {dst}: they are over different ranks")
    layout = layout_of(x)
    if layout is None:
        layout = src.infer_layout(x)  # a bare local block: its sizes tell the global shape
    if layout.kind != "block":
        raise SpatialError("redistribute needs a spatial block (not a tensor replicated over the group)")
    dst.check_shape(layout.shape, "redistributed tensor")
    return tag(_Shuffle.apply(plain(x), layout.shape, src, dst), Layout(dst, "block", layout.shape))


class Redistribute(nn.Module):
    """A layer that moves its input from `src` to `dst` (e.g. spatial blocks to whole samples before a
    fully connected head); put it in the model before :func:`parallelize`."""

    def __init__(self, src: Distribution, dst: Distribution) -> None:
        super().__init__()
        self.src, self.dst = src, dst

    def extra_repr(self) -> str:
        return f"{self.src} -> {self.dst}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return redistribute(x, self.src, self.dst)


def sample_distribution(dist: Distribution) -> Distribution:
    """Sample parallelism over the ranks of `dist`: a 1 x 1 (x 1) grid and one sample group per rank of
    ``dist.comm`` (rank r holds samples ``ranges(N, W)[r]``; with N divisible by W these are its share
    of its own spatial group's samples). It shares `dist`'s queue of halo sends (it has none of its
    own: a 1 x 1 grid exchanges no halos). Sends nothing; its communicators are split by
    ``connect()`` (collective over ``dist.comm``)."""
    out = Distribution(dist.comm, (1,) * len(dist.grid), dist.comm.size, nonspatial=dist.nonspatial)
    out.sends = dist.sends
    return out


class SampleSwitch(nn.Module):
    """`inner` run sample-parallel (§V-C's per-layer distributions: spatial for the early layers, then
    whole samples): every spatially split block among its inputs is first moved by one alltoall (over
    ``src.comm``) from `src` to the sample distribution `dst` (:func:`sample_distribution`), so each
    rank holds whole samples, and `inner` and every layer after it (spatial layers follow their
    input's distribution) run on them. Backward is the reverse alltoall. Parameter gradients stay
    partial sums over each rank's data, summed over the world like the spatial layers' (exact: the
    loss sees the gathered outputs). Inputs replicated over a spatial group (after a global pool) are
    refused: switch before the pool."""

    def __init__(self, inner: nn.Module, src: Distribution, dst: Distribution) -> None:
        super().__init__()
        self.inner, self.src, self.dst = inner, src, dst

    def extra_repr(self) -> str:
        return f"{self.src} -> samples over {self.dst.comm.size} ranks"

    def _move(self, t: object) -> object:
        layout = layout_of(t)
        if layout is None or layout.dist is self.dst:
            return t
        if layout.kind != "block":
            raise SpatialError(f"switch to sample parallelism at {type(self.inner).__name__}: its input is "
                               f"already whole samples replicated over the spatial group (after a global "
                               f"pool); switch at a module before the pool")
        assert isinstance(t, torch.Tensor)
        return redistribute(t, layout.dist, self.dst)

    def forward(self, *args: object, **kwargs: object) -> object:
        args, kwargs = pytree.tree_map(self._move, (args, kwargs))
        return self.inner(*args, **kwargs)
