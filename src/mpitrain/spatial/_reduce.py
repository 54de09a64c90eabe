"""Differentiable sums over a group: the allreduce whose adjoint is an allreduce, and gradient sync."""

from __future__ import annotations

from typing import Any

import torch

from ..comm.base import Communicator
from ..comm.reducer import ReducePolicy, Reducer

__all__ = ["allreduce_sum", "allreduce_once", "GradBucket"]


class _AllreduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return comm.allreduce(t.contiguous().clone(), "sum")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.allreduce(g.contiguous().clone(), "sum"), None


def allreduce_sum(t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Sum of every rank's `t` (a new tensor, equal on every rank of `comm`; all must call it).

    Its output is replicated, so its gradient arrives as shares (one per rank) whose sum is the true
    gradient; the backward sums them, giving every rank the true gradient of its own `t`."""
    out: torch.Tensor = _AllreduceSum.apply(t, comm)
    return out


class _AllreduceOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, comm: Communicator, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return comm.allreduce(t.contiguous().clone(), "sum")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return (g if ctx.keep else torch.zeros_like(g)), None, None


def allreduce_once(t: torch.Tensor, comm: Communicator, keep: bool = True) -> torch.Tensor:
    """Sum of every rank's `t` as a value that *counts once* (docs/spatial.md, "One gradient rule"): every
    rank of `comm` holds it and computes the same loss from it, so its gradient is the same on every rank
    and the backward hands each rank that gradient for its own `t` without summing (`keep`), or zero
    when `t` is a share held by another rank too (a replicated value: its spatial rank 0 keeps it)."""
    out: torch.Tensor = _AllreduceOnce.apply(t, comm, keep)
    return out


class GradBucket:
    """Sums the gradients of `params` over `comm` with ONE allreduce at the end of each backward pass.

    :meth:`views` gives the parameters for one forward as views whose gradients arrive at one autograd
    node (not one per parameter: 56 custom nodes cost the mesh model ~0.5 ms per step). That node
    stores the local gradients instead of accumulating them and queues :meth:`flush` to run when
    autograd finishes. Every rank runs the same graph, so every rank flushes the same parameters in the
    same (index) order."""

    def __init__(self, comm: Communicator, params: list[torch.Tensor]) -> None:
        self.comm, self.params = comm, params
        self.pending: dict[int, torch.Tensor] = {}
        self._reducer = Reducer(comm, ReducePolicy("flat", op="sum"), name="spatial gradient allreduce")

    def views(self) -> tuple[torch.Tensor, ...]:
        """`params` as views for one forward (in order); backward sends their gradients here."""
        return _SyncGrads.apply(self, *self.params) if self.params else ()

    def add(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Store one backward pass's local gradients (None: a parameter this pass did not reach)."""
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        for i, g in enumerate(grads):
            if g is not None:
                self.pending[i] = self.pending[i] + g if i in self.pending else g

    def flush(self) -> None:
        """Allreduce the stored local gradients as one flat buffer (the gradient reducer's blocking form,
        :class:`~mpitrain.comm.reducer.Reducer`); add the sums to ``.grad`` (a ``.grad``
        set here is a view of that buffer)."""
        order = sorted(self.pending)
        grads, self.pending = [self.pending[i] for i in order], {}
        perms = [_memory_order(g) for g in grads]
        flat = torch.cat([g.permute(o).reshape(-1) for g, o in zip(grads, perms)])
        self._reducer.reduce([flat])  # one tensor: reduced in place, blocking on this (autograd's) thread
        offset = 0
        for i, g, o in zip(order, grads, perms):
            total = flat[offset:offset + g.numel()].view([g.shape[d] for d in o]).permute(_inverse(o))
            offset += g.numel()
            p = self.params[i]
            if p.grad is None:
                p.grad = total  # a view of `flat` in g's memory order (channels-last stays so): no copy
            else:
                p.grad.add_(total)


def _memory_order(t: torch.Tensor) -> list[int]:
    """Dimensions from outermost to innermost in memory: ``t.permute(order)`` is contiguous when `t` is
    dense in any memory format (e.g. channels-last), so flattening it needs no copy."""
    return sorted(range(t.dim()), key=lambda d: (-t.stride()[d], d))


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, d in enumerate(order):
        inv[d] = i
    return inv


class _SyncGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bucket: GradBucket, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.bucket = bucket
        ctx.set_materialize_grads(False)  # an unreached parameter stays None, not a zero tensor
        return tuple(p.view_as(p) for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        ctx.bucket.add(grads)
        return (None,) * (len(grads) + 1)
