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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.base import Communicator
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


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def window_of(kernel: int | Sequence[int], stride: int | Sequence[int], padding: int | str | Sequence[int],
              dilation: int | Sequence[int], ceil: bool = False) -> tuple[Window, Window]:
    """(height, width) windows of a torch conv/pool configuration; ``padding="same"`` splits the total
    padding ``dilation*(kernel-1)`` as torch does (the extra one on the high side)."""
    k, s, d = _pair(kernel), _pair(stride), _pair(dilation)
    if padding == "valid":
        padding = 0
    if padding == "same":
        pads = [(d[i] * (k[i] - 1) // 2, d[i] * (k[i] - 1) - d[i] * (k[i] - 1) // 2) for i in range(2)]
    else:
        p = _pair(padding)  # type: ignore[arg-type]
        pads = [(p[0], p[0]), (p[1], p[1])]
    return Window(k[0], s[0], pads[0], d[0], ceil), Window(k[1], s[1], pads[1], d[1], ceil)


@dataclass(frozen=True)
class Box:
    """A half-open rectangle of global (row, column) indices."""

    rows: tuple[int, int]
    cols: tuple[int, int]

    @property
    def empty(self) -> bool:
        return self.rows[1] <= self.rows[0] or self.cols[1] <= self.cols[0]

    @property
    def shape(self) -> tuple[int, int]:
        return max(0, self.rows[1] - self.rows[0]), max(0, self.cols[1] - self.cols[0])

    def __and__(self, other: Box) -> Box:
        return Box((max(self.rows[0], other.rows[0]), min(self.rows[1], other.rows[1])),
                   (max(self.cols[0], other.cols[0]), min(self.cols[1], other.cols[1])))

    def within(self, origin: Box) -> tuple[slice, slice]:
        """Index (rows, cols) of this box inside a tensor whose [0, 0] is ``origin``'s corner."""
        r0, c0 = origin.rows[0], origin.cols[0]
        return slice(self.rows[0] - r0, self.rows[1] - r0), slice(self.cols[0] - c0, self.cols[1] - c0)

    def __str__(self) -> str:
        return f"[{self.rows[0]}:{self.rows[1]}, {self.cols[0]}:{self.cols[1]}]"


@dataclass(frozen=True)
class HaloPlan:
    """What one rank of the spatial group owns, needs and exchanges for one layer (global indices).

    ``need`` is the (unclipped) input rectangle its output block ``out`` reads; ``local`` the part it
    owns; ``recvs``/``sends`` list ``(spatial rank, box)`` in rank order. Parts of ``need`` outside
    ``valid`` (the global tensor) are padding."""

    rank: int
    owned: Box
    out: Box
    need: Box
    valid: Box
    local: Box
    recvs: tuple[tuple[int, Box], ...]
    sends: tuple[tuple[int, Box], ...]

    @property
    def ext_shape(self) -> tuple[int, int]:
        return self.need.shape

    @property
    def exchanges(self) -> bool:
        return bool(self.recvs or self.sends)

    def __str__(self) -> str:
        recv = ", ".join(f"{b}<-{r}" for r, b in self.recvs) or "-"
        send = ", ".join(f"{b}->{r}" for r, b in self.sends) or "-"
        return (f"rank {self.rank}: owns {self.owned} out {self.out} needs {self.need} "
                f"local {self.local} recv {recv} send {send}")


def plan_grid(size: tuple[int, int], grid: tuple[int, int], windows: tuple[Window, Window]) -> list[HaloPlan]:
    """The plans of every rank of a ph x pw grid for an input of global `size` (H, W), in rank order.

    Refuses (SpatialError) a layer whose input or output has fewer rows/columns than the grid."""
    (h, w), (ph, pw) = size, grid
    out_h, out_w = windows[0].out_size(h), windows[1].out_size(w)
    if h < ph or w < pw or out_h < ph or out_w < pw:
        raise SpatialError(f"input {h}x{w} -> output {out_h}x{out_w} of a window layer {windows} cannot be "
                           f"split over a {ph}x{pw} grid: every rank needs at least one input and output "
                           f"row and column; use a smaller grid or redistribute before this layer")
    rows, cols = ranges(h, ph), ranges(w, pw)
    orows, ocols = ranges(out_h, ph), ranges(out_w, pw)
    owned = [Box(rows[i], cols[j]) for i in range(ph) for j in range(pw)]
    outs = [Box(orows[i], ocols[j]) for i in range(ph) for j in range(pw)]
    needs = [Box(windows[0].needed(*o.rows), windows[1].needed(*o.cols)) for o in outs]
    valid = Box((0, h), (0, w))
    plans = []
    for me in range(ph * pw):
        recvs = tuple((q, owned[q] & needs[me]) for q in range(ph * pw)
                      if q != me and not (owned[q] & needs[me]).empty)
        sends = tuple((q, owned[me] & needs[q]) for q in range(ph * pw)
                      if q != me and not (owned[me] & needs[q]).empty)
        plans.append(HaloPlan(me, owned[me], outs[me], needs[me], valid, owned[me] & needs[me], recvs, sends))
    return plans


def plan_halo(size: tuple[int, int], grid: tuple[int, int], windows: tuple[Window, Window],
              rank: int) -> HaloPlan:
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
