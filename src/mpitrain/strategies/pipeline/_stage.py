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
* When only the first pipeline rank has the batch's inputs (``make_edges(..., data=...)``: fit's
  per-rank reads), a model input that a later partition reads is an edge too, from partition 0
  (which sends its own rows of that input, no gradient), so middle stages read no data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from ..._utils.stall import StallPolicy
from ...comm import wait_request
from ...comm.base import Communicator, Request
from ...timeline import span
from .._device import autocast as device_autocast
from .._device import model_device, to_device
from ._backward import WeightWork, input_gradients
from ._graph import Partition, ValueMeta, mutated_placeholders
from .schedule import Action

__all__ = ["Edge", "make_edges", "Stage", "run", "autocast"]

_MAX_TAG = 32767  # the MPI standard's guaranteed minimum for MPI_TAG_UB


@dataclass(frozen=True)
class Edge:
    """Value `value` produced by partition `src` and read by partition `dst`; `grad`: errors flow back.
    `data`: the index of the model input this edge carries (sent by partition 0), None for a value
    computed by `src`."""

    index: int
    value: str
    src: int
    dst: int
    grad: bool
    data: int | None = None


def make_edges(parts: list[Partition], meta: dict[str, ValueMeta | None],
               data: list[str] | None = None) -> list[Edge]:
    """All boundary edges in one global order: by consumer, then the consumer's argument order.

    `data`: the names of the model's inputs (placeholders) when only partition 0's rank has them; each
    tensor input that a later partition reads then becomes an edge from partition 0."""
    producer = {v: p.index for p in parts for v in p.outputs}
    out: list[Edge] = []
    for p in parts:
        for i in (p.data_inputs if data is not None and p.index > 0 else []):
            assert data is not None
            if meta.get(data[i]) is not None:  # a non-tensor input is a constant every rank holds
                out.append(Edge(len(out), data[i], 0, p.index, False, i))
        for v in p.recv_inputs:
            m = meta[v]
            grad = bool(m is not None and m.requires_grad and m.dtype.is_floating_point)
            out.append(Edge(len(out), v, producer[v], p.index, grad))
    return out


class Stage:
    """One partition on one rank of a pipeline communicator (`ranks[k]`: the rank running partition k;
    with virtual stages a rank runs several partitions, each its own Stage).

    :func:`run` executes a schedule's actions for one mini-batch; every stage of the pipeline must call
    it with the same actions kind (train or eval) and micro-batch count. `recompute(micro)` says
    whether the forward of a training micro-batch keeps only its inputs and recomputes its
    activations during backward (``torch.utils.checkpoint``, non-reentrant: RNG state replayed)."""

    def __init__(self, part: Partition, edges: list[Edge], comm: Communicator, ranks: list[int],
                 micro_window: int, policy: StallPolicy, recompute: Callable[[int], bool] = lambda m: False,
                 autocast: str | None = None) -> None:
        self.part, self.comm, self.ranks, self.recompute, self.autocast = part, comm, ranks, recompute, autocast
        self.last = part.index == len(ranks) - 1
        self.device = model_device(part.module)  # receive buffers and data inputs go to the partition's device
        self.in_edges = [e for e in edges if e.dst == part.index]
        self.recv_edges = [e for e in self.in_edges if e.data is None]  # the partition's recv_inputs, in order
        self.out_edges = [e for e in edges if e.src == part.index]
        self.grad_out = [e for e in self.out_edges if e.grad]
        self.window = max(1, min(micro_window, _MAX_TAG // max(2 * len(edges), 1)))
        # A micro-batch stage step can be ~1 ms: poll at most every 0.2 ms so waiting adds little latency.
        self.policy = replace(policy, max_nap=min(policy.max_nap, 2e-4), first_nap=min(policy.first_nap, 2e-5))
        self._posted: dict[tuple[str, int], list[tuple[Request, torch.Tensor]]] = {}
        self._sends: list[tuple[Request, str]] = []
        self._saved: dict[int, tuple[list[torch.Tensor], Any]] = {}
        self._weights: dict[int, WeightWork] = {}  # micro-batch -> its weight half, after its input half
        self._params = [q for q in part.module.parameters() if q.requires_grad]
        mutated = mutated_placeholders(part.module)
        self._clone = [v in mutated for v in part.recv_inputs]

    def tag(self, edge: Edge, micro: int, backward: bool) -> int:
        return (edge.index * 2 + int(backward)) * self.window + micro % self.window

    # -- receives -----------------------------------------------------------------------------
    def _post(self, a: Action, metas: list[dict[str, ValueMeta | None]]) -> None:
        """Post the receives of `a` (activations for F, partial errors for B or I; W receives nothing)."""
        if a.kind == "W" or (_direction(a), a.micro) in self._posted:
            return
        edges = self.in_edges if a.kind == "F" else self.grad_out
        peer = (lambda e: e.src) if a.kind == "F" else (lambda e: e.dst)
        reqs = []
        for e in edges:
            m = metas[a.micro][e.value]
            assert m is not None  # edges carry tensors only (cut_points)
            buf = torch.empty(m.shape, dtype=m.dtype, device=self.device)
            reqs.append((self.comm.irecv(buf, self.ranks[peer(e)], self.tag(e, a.micro, a.kind != "F")), buf))
        self._posted[(_direction(a), a.micro)] = reqs

    def _take(self, a: Action) -> list[torch.Tensor]:
        edges = self.in_edges if a.kind == "F" else self.grad_out
        out = []
        for e, (req, buf) in zip(edges, self._posted.pop((_direction(a), a.micro))):
            what = "activation" if a.kind == "F" else "partial error"
            src = e.src if a.kind == "F" else e.dst
            self._wait(req, f"{what} {e.value!r} of micro-batch {a.micro} from partition {src} "
                            f"(rank {self.ranks[src]})")
            out.append(buf)
        return out

    def _wait(self, req: Request, what: str) -> None:
        """Wait with a way out: a sleeping poll, a line naming what is missing every
        `policy.warn_after` s, the end of the job after `policy.abort_after` s (None: never)."""
        wait_request(req, lambda: f"{what}, in partition {self.part.index}", self.policy,
                     f"rank {self.comm.rank}", self.comm.abort)

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
        data = {e.data: t for e, t in zip(self.in_edges, received) if e.data is not None}
        recv = [(e, t) for e, t in zip(self.in_edges, received) if e.data is None]
        leaves = [t.requires_grad_() if (train and e.grad) else t for e, t in recv]
        args = [t.clone() if c and t.requires_grad else t for t, c in zip(leaves, self._clone)]
        call = [to_device(data[i] if i in data else inputs[i], self.device) for i in self.part.data_inputs] + args
        with autocast(self.autocast, self.device):
            if train and self.recompute(micro):
                out = checkpoint(self.part.module, *call, use_reentrant=False)
            else:
                out = self.part.module(*call)
        if not self.last:
            index = {v: i for i, v in enumerate(self.part.outputs)}
            for e in self.out_edges:
                value = to_device(inputs[e.data], self.device) if e.data is not None else out[index[e.value]]
                self._send(value, e, micro, backward=False)
        if train:
            self._saved[micro] = (leaves, out)
        return out

    def backward(self, micro: int, loss: torch.Tensor | None, split: bool = False) -> None:
        """Backward of micro-batch `micro` from `loss` (last partition) or the summed received errors,
        ending with the partial errors sent back. `split`: only the input half (the zero-bubble
        schedules' I: :mod:`._backward`); :meth:`backward_weight` runs the weight half later."""
        leaves, out = self._saved.pop(micro)
        tensors: list[torch.Tensor]
        grads: list[torch.Tensor | None]
        if self.last:
            assert loss is not None, "the last partition back-propagates the loss"
            tensors, grads = [loss], [None]
        else:
            summed: dict[str, torch.Tensor] = {}
            for e, g in zip(self.grad_out, self._take(Action("B", micro))):
                summed[e.value] = summed[e.value].add_(g) if e.value in summed else g
            index = {v: i for i, v in enumerate(self.part.outputs)}
            pairs = [(out[index[v]], g) for v, g in summed.items() if out[index[v]].requires_grad]
            tensors, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if split:
            inputs = [leaf for e, leaf in zip(self.recv_edges, leaves) if e.grad]
            self._weights[micro] = input_gradients(tensors, grads, inputs, self._params)
        elif tensors:
            torch.autograd.backward(tensors, grads)
        for e, leaf in zip(self.recv_edges, leaves):
            if e.grad:
                g = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                self._send(g, e, micro, backward=True)

    def backward_weight(self, micro: int) -> None:
        """The weight half of micro-batch `micro`'s backward (after :meth:`backward` with `split`)."""
        self._weights.pop(micro).run()

    def abandon(self) -> list[Request]:
        """After a failed step: this stage's requests still in flight (posted receives, sends), which it
        forgets with the step's saved activations, so the next step starts clean (for
        :func:`~mpitrain.comm._inflight.abandon`, which settles them before their buffers can go)."""
        reqs = [r for posted in self._posted.values() for r, _ in posted] + [r for r, _ in self._sends]
        self._posted.clear()
        self._sends.clear()
        self._saved.clear()
        self._weights.clear()  # weight halves owed by the failed step
        return reqs

    def finish_sends(self) -> None:
        """Complete every send of the step (their buffers may be freed or reused afterwards)."""
        for req, what in self._sends:
            self._wait(req, what)
        self._sends.clear()


def autocast(precision: str | None, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast on `device`'s type to `precision` ("bf16", "fp16": fit's ``precision=``), else nothing
    (the strategies' one rule, :func:`~mpitrain.strategies._device.autocast`)."""
    return device_autocast(precision, device)


def run(stages: list[Stage], actions: list[Action], inputs: list[list[Any]],
        metas: list[dict[str, ValueMeta | None]], last_fn: Callable[[int, Any], torch.Tensor | None],
        train: bool) -> None:
    """Run `actions` in order, each on ``stages[action.chunk]`` (this rank's partitions). Receives are
    posted one action ahead. On the model's last partition ``last_fn(micro, flat_outputs)`` is called
    after each forward and, when training, returns the (scaled) loss to back-propagate."""
    losses: dict[int, torch.Tensor] = {}
    for i, a in enumerate(actions):
        stages[a.chunk]._post(a, metas)
        if i + 1 < len(actions):
            nxt = actions[i + 1]
            stages[nxt.chunk]._post(nxt, metas)
        stage = stages[a.chunk]
        with span(str(a), stage=stage.part.index, micro=a.micro):  # the timeline's F3 / B3 of this stage
            if a.kind == "F":
                with torch.set_grad_enabled(train):
                    out = stage.forward(a.micro, inputs[a.micro], train)
                if stage.last:
                    with autocast(stage.autocast, stage.device):  # the loss too, as in one process's autocast region
                        loss = last_fn(a.micro, out)
                    if train and loss is not None:
                        losses[a.micro] = loss
            elif a.kind == "W":
                stage.backward_weight(a.micro)
            else:  # B, or I (the input half)
                stage.backward(a.micro, losses.pop(a.micro, None) if stage.last else None, split=a.kind == "I")


def _direction(a: Action) -> str:
    """The messages an action receives: "F" activations, "B" partial errors (for B and I alike)."""
    return "F" if a.kind == "F" else "B"
