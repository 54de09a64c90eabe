"""Running one partition (HyPar-Flow §5.2-5.3): receive activations, compute, send; the reverse for errors.

Message protocol, the same for every model, P, R and schedule:

* Every graph value that crosses a boundary is an :class:`Edge` (producer partition -> consumer
  partition, one edge per consumer, a skip i -> i+2 is a direct edge). Edges are numbered in one
  global order that every rank computes from the same graph, and a message's tag is
  ``(edge * 2 + direction) * window + micro % window``: activations and partial errors of different
  edges, directions and micro-batches never match each other's receives.
* Sends are nonblocking (``isend`` of the tensor's own buffer, no copy unless it is not contiguous)
  and are completed at the end of the step; receives are posted one action ahead and waited in
  schedule order. A stage therefore only ever waits for a receive, and the schedules' dependency
  rules (see :mod:`.schedule`) guarantee its sender gets there.
* Receive buffers are allocated from shapes every rank computed locally from the same sample batch:
  no shape messages. Activations that carry no gradient (integers, values computed without
  parameters) get no backward message; every edge that does gets exactly one, zeros if the consumer
  did not use it differentiably, and the producer **sums** the errors of all consumers of a value.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...comm._wait import StallPolicy, wait_request
from ...comm.base import Communicator, Request
from ...timeline import span
from .graph import Partition, ValueMeta, mutated_placeholders
from .schedule import Action

__all__ = ["Edge", "make_edges", "Stage"]

_MAX_TAG = 32767  # the MPI standard's guaranteed minimum for MPI_TAG_UB


@dataclass(frozen=True)
class Edge:
    """Value `value` produced by partition `src` and read by partition `dst`; `grad`: errors flow back."""

    index: int
    value: str
    src: int
    dst: int
    grad: bool


def make_edges(parts: list[Partition], meta: dict[str, ValueMeta | None]) -> list[Edge]:
    """All boundary edges in one global order: by consumer, then the consumer's argument order."""
    producer = {v: p.index for p in parts for v in p.outputs}
    out = []
    for p in parts:
        for v in p.recv_inputs:
            m = meta[v]
            grad = bool(m is not None and m.requires_grad and m.dtype.is_floating_point)
            out.append(Edge(len(out), v, producer[v], p.index, grad))
    return out


class Stage:
    """One partition on one rank of a pipeline communicator (`ranks[k]`: the rank running partition k).

    ``run`` executes a schedule's actions for one mini-batch; every stage of the pipeline must call it
    with the same actions kind (train or eval) and micro-batch count."""

    def __init__(self, part: Partition, edges: list[Edge], comm: Communicator, ranks: list[int],
                 micro_window: int, stall_timeout: float, stall_abort: float | None = None) -> None:
        self.part, self.comm, self.ranks = part, comm, ranks
        self.last = part.index == len(ranks) - 1
        self.in_edges = [e for e in edges if e.dst == part.index]
        self.out_edges = [e for e in edges if e.src == part.index]
        self.grad_out = [e for e in self.out_edges if e.grad]
        self.window = max(1, min(micro_window, _MAX_TAG // max(2 * len(edges), 1)))
        # A micro-batch stage step is ~1 ms: poll at most every 0.2 ms so the watchdog costs little latency.
        self.policy = StallPolicy(warn_after=stall_timeout, abort_after=stall_abort, max_nap=2e-4)
        self._posted: dict[Action, list[tuple[Request, torch.Tensor]]] = {}
        self._sends: list[tuple[Request, str]] = []
        self._saved: dict[int, tuple[list[torch.Tensor], Any]] = {}
        mutated = mutated_placeholders(part.module)
        self._clone = [v in mutated for v in part.recv_inputs]

    def tag(self, edge: Edge, micro: int, backward: bool) -> int:
        return (edge.index * 2 + int(backward)) * self.window + micro % self.window

    # -- receives -----------------------------------------------------------------------------
    def _post(self, a: Action, metas: list[dict[str, ValueMeta | None]]) -> None:
        if a in self._posted:
            return
        edges = self.in_edges if a.kind == "F" else self.grad_out
        peer = (lambda e: e.src) if a.kind == "F" else (lambda e: e.dst)
        reqs = []
        for e in edges:
            m = metas[a.micro][e.value]
            buf = torch.empty(m.shape, dtype=m.dtype)
            reqs.append((self.comm.irecv(buf, self.ranks[peer(e)], self.tag(e, a.micro, a.kind == "B")), buf))
        self._posted[a] = reqs

    def _take(self, a: Action) -> list[torch.Tensor]:
        edges = self.in_edges if a.kind == "F" else self.grad_out
        out = []
        for e, (req, buf) in zip(edges, self._posted.pop(a)):
            what = "activation" if a.kind == "F" else "partial error"
            src = e.src if a.kind == "F" else e.dst
            self._wait(req, f"{what} {e.value!r} of micro-batch {a.micro} from partition {src} "
                            f"(rank {self.ranks[src]})")
            out.append(buf)
        return out

    def _wait(self, req: Request, what: str) -> None:
        """Wait with a way out (the project's stall watchdog): a sleeping poll, a warning naming what is
        missing after `stall_timeout` s, the end of the job after `stall_abort` s (None: never)."""
        wait_request(req, f"{what}, in partition {self.part.index}", self.policy, f"rank {self.comm.rank}",
                     self.comm.abort)

    def _send(self, t: torch.Tensor, e: Edge, micro: int, backward: bool) -> None:
        t = t.detach()
        t = t if t.is_contiguous() else t.contiguous()  # a copy only when the layout forces one
        dest = e.src if backward else e.dst
        req = self.comm.isend(t, self.ranks[dest], self.tag(e, micro, backward))
        self._sends.append((req, f"{'partial error' if backward else 'activation'} {e.value!r} of "
                                 f"micro-batch {micro} to partition {dest} (rank {self.ranks[dest]})"))

    # -- compute ------------------------------------------------------------------------------
    def forward(self, micro: int, inputs: list[Any], train: bool) -> Any:
        received = self._take(Action("F", micro))
        leaves = [t.requires_grad_() if (train and e.grad) else t for e, t in zip(self.in_edges, received)]
        args = [t.clone() if c and t.requires_grad else t for t, c in zip(leaves, self._clone)]
        out = self.part.module(*[inputs[i] for i in self.part.data_inputs], *args)
        if not self.last:
            index = {v: i for i, v in enumerate(self.part.outputs)}
            for e in self.out_edges:
                self._send(out[index[e.value]], e, micro, backward=False)
        if train:
            self._saved[micro] = (leaves, out)
        return out

    def backward(self, micro: int, loss: torch.Tensor | None) -> None:
        """Backward of micro-batch `micro`: from `loss` (last partition) or the summed received errors."""
        leaves, out = self._saved.pop(micro)
        if self.last:
            tensors, grads = [loss], None
        else:
            summed: dict[str, torch.Tensor] = {}
            for e, g in zip(self.grad_out, self._take(Action("B", micro))):
                summed[e.value] = summed[e.value].add_(g) if e.value in summed else g
            index = {v: i for i, v in enumerate(self.part.outputs)}
            pairs = [(out[index[v]], g) for v, g in summed.items() if out[index[v]].requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if tensors:
            torch.autograd.backward(tensors, grads)
        for e, leaf in zip(self.in_edges, leaves):
            if e.grad:
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._send(g, e, micro, backward=True)

    def run(self, actions: list[Action], inputs: list[list[Any]], metas: list[dict[str, ValueMeta | None]],
            last_fn: Callable[[int, Any], torch.Tensor | None], train: bool) -> None:
        """Run `actions` in order. On the last partition ``last_fn(micro, output)`` is called after each
        forward and, when training, returns the (scaled) loss to back-propagate."""
        losses: dict[int, torch.Tensor] = {}
        for i, a in enumerate(actions):
            self._post(a, metas)
            if i + 1 < len(actions):
                self._post(actions[i + 1], metas)
            with span(str(a), stage=self.part.index, micro=a.micro):  # timeline: F3 / B3 of this stage
                if a.kind == "F":
                    with torch.set_grad_enabled(train):
                        out = self.forward(a.micro, inputs[a.micro], train)
                    if self.last:
                        loss = last_fn(a.micro, out)
                        if train:
                            losses[a.micro] = loss
                else:
                    self.backward(a.micro, losses.pop(a.micro, None))

    def finish_sends(self) -> None:
        """Complete every send of the step (their buffers may be freed or reused afterwards)."""
        for req, what in self._sends:
            self._wait(req, what)
        self._sends.clear()
