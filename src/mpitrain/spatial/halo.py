"""Halo geometry (pure, printable, checked in one process) and the halo exchange with its adjoint.

A sliding-window layer (conv, pool) on a ph x pw grid gives each rank the block of *output* rows and
columns that :func:`~mpitrain.comm.split_sizes` assigns it. The input that block needs is a rectangle
of global indices (:meth:`Window.needed`), which may stick out of the global tensor (that part is the
layer's padding, filled locally) and may reach into any number of other ranks' blocks, so a halo wider
than a neighbour's block simply comes from several ranks. Every rank receives, from every other rank of
its spatial group, the intersection of that rank's block with its needed rectangle (corners included):
one message per pair and direction, all in flight at once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.base import Communicator
from ._box import Box, HaloPlan
from ._exchange import SendQueue, adjoint_exchange, assemble, finish_exchange, start_exchange
from ._memory import dense
from .distribution import SpatialError, ranges

__all__ = ["Window", "Box", "HaloPlan", "plan_grid", "plan_halo", "window_of", "halo_exchange"]


@dataclass(frozen=True)
class Window:
    """One spatial dimension of a sliding-window op: output ``o`` reads inputs
    ``o*stride - pad[0] + dilation*t`` for ``t in range(kernel)``; inputs outside ``[0, n)`` are padding.
    ``ceil``: pooling's ``ceil_mode`` (one more output when a last, partial window starts inside the
    input or its left padding)."""

    kernel: int = 1
    stride: int = 1
    pad: tuple[int, int] = (0, 0)
    dilation: int = 1
    ceil: bool = False

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        room = n + self.pad[0] + self.pad[1] - self.span
        if room < 0:
            return 0
        if not self.ceil:
            return room // self.stride + 1
        out = -(-room // self.stride) + 1
        return out - 1 if (out - 1) * self.stride >= n + self.pad[0] else out

    def needed(self, o0: int, o1: int) -> tuple[int, int]:
        """Half-open global input range read by outputs ``[o0, o1)`` (may extend below 0 or past n)."""
        return o0 * self.stride - self.pad[0], (o1 - 1) * self.stride - self.pad[0] + self.span


def _tuple(v: int | Sequence[int], dims: int) -> tuple[int, ...]:
    return (v,) * dims if isinstance(v, int) else tuple(int(x) for x in v)


def window_of(kernel: int | Sequence[int], stride: int | Sequence[int], padding: int | str | Sequence[int],
              dilation: int | Sequence[int], ceil: bool = False, dims: int = 2) -> tuple[Window, ...]:
    """(height, width) — or (depth, height, width) with ``dims=3`` — windows of a torch conv/pool
    configuration; ``padding="same"`` splits the total padding ``dilation*(kernel-1)`` as torch does
    (the extra one on the high side)."""
    k, s, d = _tuple(kernel, dims), _tuple(stride, dims), _tuple(dilation, dims)
    if padding == "valid":
        padding = 0
    if padding == "same":
        pads = [(d[i] * (k[i] - 1) // 2, d[i] * (k[i] - 1) - d[i] * (k[i] - 1) // 2) for i in range(dims)]
    else:
        p = _tuple(padding, dims)  # type: ignore[arg-type]
        pads = [(p[i], p[i]) for i in range(dims)]
    return tuple(Window(k[i], s[i], pads[i], d[i], ceil) for i in range(dims))


def plan_grid(size: Sequence[int], grid: Sequence[int], windows: Sequence[Any]) -> list[HaloPlan]:
    """The plans of every rank of a grid (``(ph, pw)`` or ``(pd, ph, pw)``, ranks in row-major order)
    for an input of global spatial `size`, one window per dimension (anything with ``out_size(n)`` and
    ``needed(o0, o1)``, e.g. :class:`Window`).

    Refuses (SpatialError) a layer whose input or output has fewer cells than the grid along a dimension."""
    outs_n = [w.out_size(n) for w, n in zip(windows, size)]
    if any(n < p or o < p for n, o, p in zip(size, outs_n, grid)):
        sizes = "x".join(map(str, size))
        raise SpatialError(f"input {sizes} -> output {'x'.join(map(str, outs_n))} of a window layer {tuple(windows)} "
                           f"cannot be split over a {'x'.join(map(str, grid))} grid: every rank needs at least "
                           f"one input and output row and column; use a smaller grid or larger inputs, or run "
                           f"the model sample-parallel from the submodule holding this layer on (see the traceback; "
                           f"a ResNet's 'layer4'): fit(strategy='spatial', switch_at=NAME), parallelize(..., "
                           f"switch_at=NAME), or redistribute before this layer")
    coords = list(itertools.product(*(range(p) for p in grid)))
    blocks = [ranges(n, p) for n, p in zip(size, grid)]
    oblocks = [ranges(o, p) for o, p in zip(outs_n, grid)]
    owned = [Box(*(blocks[d][c[d]] for d in range(len(grid)))) for c in coords]
    outs = [Box(*(oblocks[d][c[d]] for d in range(len(grid)))) for c in coords]
    needs = [Box(*(w.needed(*r) for w, r in zip(windows, o.dims))) for o in outs]
    valid = Box(*((0, n) for n in size))
    plans = []
    for me in range(len(coords)):
        recvs = tuple((q, owned[q] & needs[me]) for q in range(len(coords))
                      if q != me and not (owned[q] & needs[me]).empty)
        sends = tuple((q, owned[me] & needs[q]) for q in range(len(coords))
                      if q != me and not (owned[me] & needs[q]).empty)
        plans.append(HaloPlan(me, owned[me], outs[me], needs[me], valid, owned[me] & needs[me], recvs, sends))
    return plans


def plan_halo(size: Sequence[int], grid: Sequence[int], windows: Sequence[Any], rank: int) -> HaloPlan:
    """The plan of spatial rank `rank` (see :func:`plan_grid`)."""
    return plan_grid(size, grid, windows)[rank]


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, plan: HaloPlan, comm: Communicator, fill: float,
                queue: SendQueue | None) -> torch.Tensor:
        ctx.plan, ctx.comm, ctx.queue = plan, comm, queue
        x = dense(x)
        return assemble(x, plan, finish_exchange(start_exchange(x, plan, comm), plan, queue), fill)

    @staticmethod
    def backward(ctx: Any, dext: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        return adjoint_exchange(dext, ctx.plan, ctx.comm, ctx.queue), None, None, None, None


def halo_exchange(x: torch.Tensor, plan: HaloPlan, comm: Communicator, fill: float = 0.0,
                  queue: SendQueue | None = None) -> torch.Tensor:
    """The needed rectangle of `plan` (halos from the other ranks of `comm`, `fill` as padding) for
    the local block `x`. Every rank of the spatial group `comm` must call it for the same layer.
    Differentiable: the backward is the exact adjoint (halo gradients are added to their owners).
    With a `queue` (a distribution's :class:`SendQueue`) this rank's sends are left in flight there
    until the next exchange or the end of the pass; without one they are completed before returning."""
    if tuple(x.shape[2:]) != plan.owned.shape:
        raise SpatialError(f"block of shape {tuple(x.shape)} does not match the plan's {plan.owned.shape}")
    out: torch.Tensor = _HaloExchange.apply(x, plan, comm, fill, queue)
    return out
