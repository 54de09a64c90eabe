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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .._utils.stall import watched
from ..comm.base import Communicator, Request
from .distribution import SpatialError, ranges
from .memory import dense, empty_as

__all__ = ["Window", "Box", "HaloPlan", "HaloStats", "Exchange", "plan_halo", "plan_grid", "window_of",
           "start_exchange", "finish_exchange", "assemble", "assemble_box", "place_halos", "start_adjoint",
           "finish_adjoint", "adjoint_exchange", "halo_exchange", "wait_all", "settle", "complete_sends",
           "isend_all", "FORWARD_TAG", "BACKWARD_TAG", "STALL_WARNING_S"]

FORWARD_TAG, BACKWARD_TAG = 7301, 7302


@dataclass(frozen=True)
class Window:
    """One spatial dimension of a sliding-window op: output ``o`` reads inputs
    ``o*stride - pad[0] + dilation*t`` for ``t in range(kernel)``; inputs outside ``[0, n)`` are padding."""

    kernel: int = 1
    stride: int = 1
    pad: tuple[int, int] = (0, 0)
    dilation: int = 1

    @property
    def span(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        room = n + self.pad[0] + self.pad[1] - self.span
        return room // self.stride + 1 if room >= 0 else 0

    def needed(self, o0: int, o1: int) -> tuple[int, int]:
        """Half-open global input range read by outputs ``[o0, o1)`` (may extend below 0 or past n)."""
        return o0 * self.stride - self.pad[0], (o1 - 1) * self.stride - self.pad[0] + self.span


def _pair(v: int | Sequence[int]) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def window_of(kernel, stride, padding, dilation) -> tuple[Window, Window]:
    """(height, width) windows of a torch conv/pool configuration; ``padding="same"`` splits the total
    padding ``dilation*(kernel-1)`` as torch does (the extra one on the high side)."""
    k, s, d = _pair(kernel), _pair(stride), _pair(dilation)
    if padding == "valid":
        padding = 0
    if padding == "same":
        pads = [(d[i] * (k[i] - 1) // 2, d[i] * (k[i] - 1) - d[i] * (k[i] - 1) // 2) for i in range(2)]
    else:
        p = _pair(padding)
        pads = [(p[0], p[0]), (p[1], p[1])]
    return Window(k[0], s[0], pads[0], d[0]), Window(k[1], s[1], pads[1], d[1])


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


def _fill_padding(ext: torch.Tensor, plan: HaloPlan, fill: float) -> None:
    """Write `fill` where the needed rectangle lies outside the global tensor (four strips)."""
    inside = plan.need & plan.valid
    if inside.empty:
        ext.fill_(fill)
        return
    rs, cs = inside.within(plan.need)
    r0, r1, c0, c1 = rs.start, rs.stop, cs.start, cs.stop
    ext[:, :, :r0, :].fill_(fill)
    ext[:, :, r1:, :].fill_(fill)
    ext[:, :, r0:r1, :c0].fill_(fill)
    ext[:, :, r0:r1, c1:].fill_(fill)


def assemble(x: torch.Tensor, plan: HaloPlan, halos: Sequence[torch.Tensor], fill: float) -> torch.Tensor:
    """The needed rectangle as one tensor from the local block `x` and the received `halos`."""
    ext = empty_as(x, (x.shape[0], x.shape[1], *plan.ext_shape))
    _fill_padding(ext, plan, fill)
    if not plan.local.empty:
        ext[(..., *plan.local.within(plan.need))] = x[(..., *plan.local.within(plan.owned))]
    place_halos(ext, plan, halos)
    return ext


def assemble_box(x: torch.Tensor, plan: HaloPlan, halos: Sequence[torch.Tensor], box: Box, fill: float,
                 local: bool = True) -> torch.Tensor:
    """The part `box` (global indices, inside ``plan.need``) of the needed rectangle: padding `fill`,
    the local cells (or zeros when ``local=False``) and the received `halos`. Meant for thin strips."""
    out = empty_as(x, (x.shape[0], x.shape[1], *box.shape)).fill_(fill)  # x's memory order: the strip
    # convolutions run on oneDNN's channels-last path when the model does
    inside = box & plan.valid
    if not inside.empty and fill != 0.0:
        out[(..., *inside.within(box))] = 0.0
    mine = plan.owned & box
    if local and not mine.empty:
        out[(..., *mine.within(box))] = x[(..., *mine.within(plan.owned))]
    for (_, rbox), buf in zip(plan.recvs, halos):
        part = rbox & box
        if not part.empty:
            out[(..., *part.within(box))] = buf[(..., *part.within(rbox))]
    return out


def place_halos(ext: torch.Tensor, plan: HaloPlan, halos: Sequence[torch.Tensor]) -> None:
    """Copy the received `halos` into the needed rectangle `ext` (in place)."""
    for (_, box), buf in zip(plan.recvs, halos):
        ext[(..., *box.within(plan.need))] = buf


@dataclass
class HaloStats:
    """Seconds a layer spent blocked on halo messages (after any overlapped compute), and exchanges."""

    wait_s: float = 0.0
    exchanges: int = 0

    def reset(self) -> None:
        self.wait_s, self.exchanges = 0.0, 0


@dataclass
class Exchange:
    """Halo messages in flight: receive buffers (in ``plan.recvs`` order), their requests, and the sends
    with the buffers they read (kept alive until the send completes)."""

    halos: list[torch.Tensor]
    requests: list[Request]
    sends: list[tuple[Request, torch.Tensor]] = field(default_factory=list)


def isend_all(comm: Communicator, parts: Sequence[tuple[torch.Tensor, int]], tag: int
              ) -> list[tuple[Request, torch.Tensor]]:
    """Post a nonblocking send of each (tensor, destination); returns (request, the buffer it reads)."""
    out = []
    for t, dst in parts:
        buf = t.contiguous()
        out.append((comm.isend(buf, dst, tag), buf))
    return out


def start_exchange(x: torch.Tensor, plan: HaloPlan, comm: Communicator, tag: int = FORWARD_TAG) -> Exchange:
    """Post every receive and send of the forward halo exchange of block `x` (nonblocking)."""
    n, c = x.shape[0], x.shape[1]
    halos = [x.new_empty((n, c, *box.shape)) for _, box in plan.recvs]
    reqs = [comm.irecv(buf, src, tag) for (src, _), buf in zip(plan.recvs, halos)]
    sends = isend_all(comm, [(x[(..., *box.within(plan.owned))], dst) for dst, box in plan.sends], tag)
    return Exchange(halos, reqs, sends)


#: Seconds a halo wait may take before it warns (naming the plan: ranks and boxes still expected).
STALL_WARNING_S = 60.0

# Sends of earlier exchanges not yet waited for. A rank waits only for its *receives* (its neighbours'
# data) when it needs them; waiting for its own sends there would also wait for each neighbour to reach
# that layer (the receiver completes a large send), which measured 3-5 ms of a 2-rank mesh-model step.
# They are completed after the next exchange's receives and at the end of every forward and backward.
_pending: list[tuple[Request, torch.Tensor]] = []


def wait_all(requests: Sequence[Request], plan: HaloPlan, warn_after: float = STALL_WARNING_S) -> None:
    """Complete every request (blocking); if that takes more than `warn_after` seconds a watchdog warns
    once, naming this rank's plan (the ranks and boxes it waits for). A dead rank ends the job through
    the launcher; a layer that differs on another rank shows up in the warnings of both."""
    _wait_watched(requests, "halo exchange", plan.__str__, warn_after)


def complete_sends(warn_after: float = STALL_WARNING_S) -> None:
    """Wait for every deferred halo send (see :func:`settle`); afterwards nothing is in flight. Called at
    the end of each forward and backward of a parallelized model; collective-free and idempotent."""
    if _pending:
        _wait_watched([r for r, _ in _pending], "halo sends",
                      lambda: f"{sum(not r.test() for r, _ in _pending)} halo sends still in flight", warn_after)
        _pending.clear()


def _wait_watched(requests: Sequence[Request], label: str, detail: Callable[[], str], warn_after: float) -> None:
    """Complete `requests`; only those not done yet register with the stall watchdog."""
    late = [r for r in requests if not r.test()]
    if late:
        with watched(label, detail, warn_after):
            for r in late:
                r.wait()


def settle(ex: Exchange, plan: HaloPlan, backward: bool = False) -> None:
    """Wait for the receives of `ex`, complete the sends of earlier exchanges, and defer those of `ex`
    (their buffers stay referenced until they complete). With `backward` (called from an autograd
    backward) the deferred sends are also completed when that backward pass ends."""
    wait_all(ex.requests, plan)
    complete_sends()
    _pending.extend(ex.sends)
    if backward and ex.sends:  # one callback per exchange: cheap, and none is lost to an exception
        torch.autograd.Variable._execution_engine.queue_callback(complete_sends)


def finish_exchange(ex: Exchange, plan: HaloPlan) -> list[torch.Tensor]:
    """Wait for the halos of `ex` (see :func:`settle`); returns them."""
    settle(ex, plan)
    return ex.halos


def start_adjoint(dext: torch.Tensor, plan: HaloPlan, comm: Communicator,
                  tag: int = BACKWARD_TAG) -> Exchange:
    """Post the adjoint of the halo exchange of the gradient `dext` of the needed rectangle: each halo
    goes back to its owner, each rank receives the gradients of its cells that others read."""
    n, c = dext.shape[0], dext.shape[1]
    parts = [dext.new_empty((n, c, *box.shape)) for _, box in plan.sends]
    reqs = [comm.irecv(buf, dst, tag) for (dst, _), buf in zip(plan.sends, parts)]
    sends = isend_all(comm, [(dext[(..., *box.within(plan.need))], src) for src, box in plan.recvs], tag)
    return Exchange(parts, reqs, sends)


def finish_adjoint(dext: torch.Tensor, plan: HaloPlan, ex: Exchange) -> torch.Tensor:
    """The gradient of the local block: its own cells of `dext` plus, in rank order, what others sent."""
    n, c = dext.shape[0], dext.shape[1]
    dx = empty_as(dext, (n, c, *plan.owned.shape)).zero_()
    if not plan.local.empty:
        dx[(..., *plan.local.within(plan.owned))] = dext[(..., *plan.local.within(plan.need))]
    settle(ex, plan, backward=True)
    for (_, box), part in zip(plan.sends, ex.halos):
        dx[(..., *box.within(plan.owned))] += part
    return dx


def adjoint_exchange(dext: torch.Tensor, plan: HaloPlan, comm: Communicator) -> torch.Tensor:
    """Blocking adjoint of the halo exchange (see :func:`start_adjoint`)."""
    return finish_adjoint(dext, plan, start_adjoint(dense(dext), plan, comm))


class _HaloExchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: HaloPlan, comm: Communicator, fill: float) -> torch.Tensor:
        ctx.plan, ctx.comm = plan, comm
        x = dense(x)
        return assemble(x, plan, finish_exchange(start_exchange(x, plan, comm), plan), fill)

    @staticmethod
    def backward(ctx, dext: torch.Tensor):
        return adjoint_exchange(dext, ctx.plan, ctx.comm), None, None, None


def halo_exchange(x: torch.Tensor, plan: HaloPlan, comm: Communicator, fill: float = 0.0) -> torch.Tensor:
    """The needed rectangle of `plan` (halos from the other ranks of `comm`, `fill` as padding) for
    the local block `x`. Every rank of the spatial group `comm` must call it for the same layer.
    Differentiable: the backward is the exact adjoint (halo gradients are added to their owners)."""
    if tuple(x.shape[2:]) != plan.owned.shape:
        raise SpatialError(f"block of shape {tuple(x.shape)} does not match the plan's {plan.owned.shape}")
    return _HaloExchange.apply(x, plan, comm, fill)
