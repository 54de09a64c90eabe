"""Averaging the gradients of a parameter list over a communicator with fused flat buffers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm.base import Communicator
from ..comm.reducer import ReducePolicy, Reducer
from ._buckets import MB, plan_buckets

__all__ = ["allreduce_gradients", "start_allreduce_gradients", "GradientAllreduce"]


class GradientAllreduce:
    """Gradient reductions in flight (a :class:`~mpitrain.comm.reducer.Reducer`'s buckets); :meth:`wait`
    completes them and writes the results to ``.grad``.

    The ``.grad`` tensors must not be touched between the start and ``wait()``.
    """

    def __init__(self, reducer: Reducer) -> None:
        self._reducer = reducer
        self._done = False

    def wait(self) -> None:
        """Block until every bucket is reduced and copied back, in bucket order; idempotent. A stalled
        reduction warns and ends the job as the reducer's stall policy says."""
        if self._done:
            return
        self._reducer.wait_all()
        self._done = True


def _buckets(params: Iterable[nn.Parameter], op: str, bucket_mb: float
             ) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The gradients to reduce (zeros where None) and their buckets, after checking the arguments."""
    if op not in ("avg", "sum"):
        raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    grads: list[torch.Tensor] = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    kinds = [(g.numel() * g.element_size(), f"{g.dtype}/{g.device}") for g in grads]
    return grads, plan_buckets(kinds, int(bucket_mb * MB))


def start_allreduce_gradients(params: Iterable[nn.Parameter], comm: Communicator, op: str = "avg",
                              bucket_mb: float = 25.0, *, stall: StallPolicy = DEFAULT_POLICY) -> GradientAllreduce:
    """Start reducing (``op`` "avg" or "sum") the ``.grad`` of `params` over `comm`; returns a handle.

    Every rank of `comm` must call it with the same parameters in the same order (same shapes and
    dtypes). Gradients are fused per dtype into flat buckets of about `bucket_mb` MiB (one copy in,
    one copy out) and reduced with nonblocking allreduces, so several buckets are in flight at once;
    each holds MPI's temporary buffers of its size meanwhile (:func:`allreduce_gradients` holds one
    piece's). A bucket whose gradients already lie back to back in one buffer (views of a gradient
    bucket, or one tensor alone) is reduced in place: no copy.
    Parameters with ``requires_grad=False`` are skipped; a parameter whose ``.grad`` is None gets a
    zero gradient first, so every rank sends the same layout (after the call it holds the average).
    The buckets go to a :class:`~mpitrain.comm.reducer.Reducer` (flat policy, posted by the caller);
    `stall` bounds the wait.
    """
    grads, groups = _buckets(params, op, bucket_mb)
    reducer = Reducer(comm, ReducePolicy("flat", op=op), stall, name="gradient allreduce")
    for group in groups:
        reducer.submit(reducer.register([grads[i] for i in group]))
    return GradientAllreduce(reducer)


def allreduce_gradients(params: Iterable[nn.Parameter], comm: Communicator, op: str = "avg",
                        bucket_mb: float = 25.0) -> None:
    """Blocking form of :func:`start_allreduce_gradients`: on return every ``.grad`` holds the result.
    The buckets are reduced one after the other by the blocking collective, so besides the gradients
    (and one bucket's flat copy, where not in place) MPI holds temporary memory for one piece of one
    bucket at a time, not for every bucket at once (the reducer's blocking form)."""
    grads, groups = _buckets(params, op, bucket_mb)
    reducer = Reducer(comm, ReducePolicy("flat", op=op), name="gradient allreduce")
    for group in groups:
        reducer.reduce([grads[i] for i in group])
