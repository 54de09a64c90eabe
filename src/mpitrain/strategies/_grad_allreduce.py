"""Averaging the gradients of a parameter list over a communicator with fused flat buffers."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .._utils.flat import copy_from_flat, flatten, joined
from ..comm.base import Communicator, Request
from ._buckets import MB, plan_buckets

__all__ = ["allreduce_gradients", "start_allreduce_gradients", "GradientAllreduce"]


class GradientAllreduce:
    """Gradient reductions in flight; :meth:`wait` completes them and writes the results to ``.grad``.

    The ``.grad`` tensors must not be touched between the start and ``wait()``.
    """

    def __init__(self, grads: list[torch.Tensor], flats: list[tuple[torch.Tensor, bool]], groups: list[list[int]],
                 requests: list[Request]) -> None:
        self._grads, self._flats, self._groups, self._requests = grads, flats, groups, requests
        self._done = False

    def wait(self) -> None:
        """Block until every bucket is reduced and copied back; idempotent."""
        if self._done:
            return
        for (flat, in_place), group, req in zip(self._flats, self._groups, self._requests):
            req.wait()
            if not in_place:
                copy_from_flat(flat, [self._grads[i] for i in group])
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


def _flat(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The buffer a bucket is reduced in: its gradients' own memory where they lie back to back (True),
    else a flat copy (False)."""
    span = joined(tensors)
    return (flatten(tensors), False) if span is None else (span, True)


def start_allreduce_gradients(params: Iterable[nn.Parameter], comm: Communicator, op: str = "avg",
                              bucket_mb: float = 25.0) -> GradientAllreduce:
    """Start reducing (``op`` "avg" or "sum") the ``.grad`` of `params` over `comm`; returns a handle.

    Every rank of `comm` must call it with the same parameters in the same order (same shapes and
    dtypes). Gradients are fused per dtype into flat buckets of about `bucket_mb` MiB (one copy in,
    one copy out) and reduced with nonblocking allreduces, so several buckets are in flight at once;
    each holds MPI's temporary buffers of its size meanwhile (:func:`allreduce_gradients` holds one
    piece's). A bucket whose gradients already lie back to back in one buffer (views of a gradient
    bucket, or one tensor alone) is reduced in place: no copy.
    Parameters with ``requires_grad=False`` are skipped; a parameter whose ``.grad`` is None gets a
    zero gradient first, so every rank sends the same layout (after the call it holds the average).
    """
    grads, groups = _buckets(params, op, bucket_mb)
    flats = [_flat([grads[i] for i in group]) for group in groups]
    requests = [comm.iallreduce(flat, op) for flat, _ in flats]
    return GradientAllreduce(grads, flats, groups, requests)


def allreduce_gradients(params: Iterable[nn.Parameter], comm: Communicator, op: str = "avg",
                        bucket_mb: float = 25.0) -> None:
    """Blocking form of :func:`start_allreduce_gradients`: on return every ``.grad`` holds the result.
    The buckets are reduced one after the other by the blocking collective, so besides the gradients
    (and one bucket's flat copy, where not in place) MPI holds temporary memory for one piece of one
    bucket at a time, not for every bucket at once."""
    grads, groups = _buckets(params, op, bucket_mb)
    for group in groups:
        tensors = [grads[i] for i in group]
        flat, in_place = _flat(tensors)
        comm.allreduce(flat, op)
        if not in_place:
            copy_from_flat(flat, tensors)
