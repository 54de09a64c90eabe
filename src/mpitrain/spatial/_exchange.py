"""Halo messages (private): assembling needed rectangles, posting and settling exchanges and their
adjoints, and the per-distribution queue of deferred sends."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .._utils.stall import DEFAULT_POLICY, StallPolicy, watched
from ..comm.base import Communicator, Request
from ..timeline import span
from ._box import Box, HaloPlan
from ._memory import dense, empty_as

__all__ = ["Exchange", "SendQueue", "outstanding", "assemble", "assemble_box", "place_halos", "start_exchange",
           "finish_exchange", "start_adjoint", "finish_adjoint", "adjoint_exchange", "wait_all", "settle",
           "isend_all", "FORWARD_TAG", "BACKWARD_TAG"]

FORWARD_TAG, BACKWARD_TAG = 7301, 7302


def _fill_padding(ext: torch.Tensor, plan: HaloPlan, fill: float) -> None:
    """Write `fill` where the needed box lies outside the global tensor (two slabs per dimension)."""
    inside = plan.need & plan.valid
    if inside.empty:
        ext.fill_(fill)
        return
    # slabs below and above the inside range of each dimension, restricted to the inside range of the
    # dimensions before it (so no cell is written twice)
    spans = inside.within(plan.need)
    for d, s in enumerate(spans):
        lead = (slice(None), slice(None), *spans[:d])
        ext[(*lead, slice(None, s.start))].fill_(fill)
        ext[(*lead, slice(s.stop, None))].fill_(fill)


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

    def outstanding(self) -> list[Request]:
        """Every request of this exchange (for :func:`~mpitrain.comm._inflight.settle_on_error`)."""
        return [*self.requests, *(r for r, _ in self.sends)]


def outstanding(ex: Exchange | None) -> list[Request]:
    """The requests of `ex`, if any: what a failed layer abandons (``settle_on_error(lambda: outstanding(ex))``)."""
    return ex.outstanding() if ex is not None else []


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
    with span("halo exchange start", kind="comm", recvs=len(halos), sends=len(plan.sends)):  # timeline
        reqs = [comm.irecv(buf, src, tag) for (src, _), buf in zip(plan.recvs, halos)]
        sends = isend_all(comm, [(x[(..., *box.within(plan.owned))], dst) for dst, box in plan.sends], tag)
    return Exchange(halos, reqs, sends)


Abort = Callable[[int], None]


def wait_all(requests: Sequence[Request], plan: HaloPlan, stall: StallPolicy = DEFAULT_POLICY,
             abort: Abort | None = None) -> None:
    """Complete every request (blocking); if that takes more than ``stall.warn_after`` seconds a
    watchdog warns once, naming this rank's plan (the ranks and boxes it waits for), and with `abort`
    (the communicator's) it ends the job after ``stall.abort_after`` seconds, saying so. A dead rank
    ends the job through the launcher; a layer that differs on another rank shows up in the warnings
    of both."""
    _wait_watched(requests, "halo exchange", plan.__str__, stall, abort)


class SendQueue:
    """Sends of earlier exchanges not yet waited for, owned by one :class:`Distribution` (so by the models
    parallelized over it; never shared between distributions).

    A rank waits only for its *receives* (its neighbours' data) when it needs them; waiting for its own
    sends there would also wait for each neighbour to reach that layer (the receiver completes a large
    send). Deferred sends are completed after the next exchange's receives and at the end of every
    forward and backward (docs/spatial.md has the measured cost of not deferring)."""

    def __init__(self, stall: StallPolicy = DEFAULT_POLICY, abort: Abort | None = None) -> None:
        self.stall, self.abort = stall, abort  # every halo wait of the distribution: see wait_all
        self._pending: list[tuple[Request, torch.Tensor]] = []

    @property
    def warn_after(self) -> float:
        return self.stall.warn_after

    def __len__(self) -> int:
        return len(self._pending)

    def abandon(self) -> list[Request]:
        """After a failed step: the deferred sends, which the queue forgets (for
        :func:`~mpitrain.comm._inflight.abandon`, which keeps them alive until they complete)."""
        pending, self._pending = self._pending, []
        return [r for r, _ in pending]

    def defer(self, sends: Sequence[tuple[Request, torch.Tensor]]) -> None:
        """Keep `sends` (request, the buffer it reads) until :meth:`complete`."""
        self._pending.extend(sends)

    def complete(self) -> None:
        """Wait for every deferred send; afterwards nothing is in flight. Collective-free, idempotent."""
        if self._pending:
            pending = self._pending
            _wait_watched([r for r, _ in pending], "halo sends",
                          lambda: f"{sum(not r.test() for r, _ in pending)} halo sends still in flight",
                          self.stall, self.abort)
            self._pending = []


def _wait_watched(requests: Sequence[Request], label: str, detail: Callable[[], str], stall: StallPolicy,
                  abort: Abort | None) -> None:
    """Complete `requests`; only those not done yet register with the stall watchdog."""
    late = [r for r in requests if not r.test()]
    if late:
        with watched(label, detail, stall.warn_after, stall.abort_after, abort):
            for r in late:
                r.wait()


def settle(ex: Exchange, plan: HaloPlan, queue: SendQueue | None, backward: bool = False) -> None:
    """Wait for the receives of `ex`, complete the sends of earlier exchanges, and defer those of `ex` on
    `queue` (their buffers stay referenced until they complete; with no queue they are completed now).
    With `backward` (called from an autograd backward) the deferred sends are also completed when that
    backward pass ends."""
    stall, abort = (queue.stall, queue.abort) if queue is not None else (DEFAULT_POLICY, None)
    with span("halo exchange finish", kind="comm", backward=backward):  # timeline: the receives' waits nest
        wait_all(ex.requests, plan, stall, abort)
    if queue is None:
        _wait_watched([r for r, _ in ex.sends], "halo sends", plan.__str__, stall, abort)
        return
    queue.complete()
    queue.defer(ex.sends)
    if backward and ex.sends:  # one callback per exchange: cheap, and none is lost to an exception
        torch.autograd.Variable._execution_engine.queue_callback(queue.complete)


def finish_exchange(ex: Exchange, plan: HaloPlan, queue: SendQueue | None) -> list[torch.Tensor]:
    """Wait for the halos of `ex` (see :func:`settle`); returns them."""
    settle(ex, plan, queue)
    return ex.halos


def start_adjoint(dext: torch.Tensor, plan: HaloPlan, comm: Communicator,
                  tag: int = BACKWARD_TAG) -> Exchange:
    """Post the adjoint of the halo exchange of the gradient `dext` of the needed rectangle: each halo
    goes back to its owner, each rank receives the gradients of its cells that others read."""
    n, c = dext.shape[0], dext.shape[1]
    parts = [dext.new_empty((n, c, *box.shape)) for _, box in plan.sends]
    with span("halo adjoint start", kind="comm", recvs=len(parts), sends=len(plan.recvs)):  # timeline
        reqs = [comm.irecv(buf, dst, tag) for (dst, _), buf in zip(plan.sends, parts)]
        sends = isend_all(comm, [(dext[(..., *box.within(plan.need))], src) for src, box in plan.recvs], tag)
    return Exchange(parts, reqs, sends)


def finish_adjoint(dext: torch.Tensor, plan: HaloPlan, ex: Exchange, queue: SendQueue | None) -> torch.Tensor:
    """The gradient of the local block: its own cells of `dext` plus, in rank order, what others sent."""
    n, c = dext.shape[0], dext.shape[1]
    dx = empty_as(dext, (n, c, *plan.owned.shape)).zero_()
    if not plan.local.empty:
        dx[(..., *plan.local.within(plan.owned))] = dext[(..., *plan.local.within(plan.need))]
    settle(ex, plan, queue, backward=True)
    for (_, box), part in zip(plan.sends, ex.halos):
        dx[(..., *box.within(plan.owned))] += part
    return dx


def adjoint_exchange(dext: torch.Tensor, plan: HaloPlan, comm: Communicator, queue: SendQueue | None
                     ) -> torch.Tensor:
    """Blocking adjoint of the halo exchange (see :func:`start_adjoint`)."""
    return finish_adjoint(dext, plan, start_adjoint(dense(dext), plan, comm), queue)
