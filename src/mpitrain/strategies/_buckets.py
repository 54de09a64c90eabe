"""Gradient buckets: parameters fused into flat buffers (DDP order) whose slices are the gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._utils.flat import views

__all__ = ["plan_buckets", "Bucket", "MB", "gradient_buckets", "adopt"]

#: Bucket capacities are given in MiB, as DDP's ``bucket_cap_mb``.
MB = 1 << 20


def plan_buckets(sizes: Sequence[tuple[int, str]], cap_bytes: int,
                 first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group items ``(nbytes, kind)`` given in ready order into buckets of indices (printable data).

    DDP's heuristic, with Horovod's cap rule: items arrive in the order autograd is expected to
    produce their gradients (the reverse of registration order); one bucket is open per `kind`
    (dtype/device: a flat buffer has one dtype); an item that would push the open bucket past the cap
    closes it first, so no bucket exceeds the cap unless a single item does (then it goes alone). The
    first bucket of each kind is capped at `first_cap_bytes` (default: the cap), so the last layers'
    gradients leave early in backward instead of waiting for a large neighbour. Buckets are returned
    in the order their first item is ready, which is the order every rank pushes them.
    """
    if cap_bytes <= 0 or (first_cap_bytes is not None and first_cap_bytes <= 0):
        raise ValueError(f"bucket capacities must be positive, got {cap_bytes} and {first_cap_bytes}")
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    closed: list[list[int]] = []
    open_: dict[str, tuple[list[int], int]] = {}
    later: set[str] = set()  # kinds whose first bucket is closed
    for i, (nbytes, kind) in enumerate(sizes):
        items, filled = open_.get(kind, ([], 0))
        if items and filled + nbytes > (cap_bytes if kind in later else first):
            closed.append(items)
            later.add(kind)
            items, filled = [], 0
        open_[kind] = (items + [i], filled + nbytes)
    closed.extend(items for items, _ in open_.values())
    return sorted(closed, key=lambda b: b[0])


class Bucket:
    """One flat buffer holding the gradients of `params` back to back, plus one "used" slot each.

    ``views[i]`` is ``params[i]``'s gradient as a view of the buffer, so autograd accumulates
    straight into it. The tail (``used``, one element per parameter) travels in the same reduction:
    after a sum over ranks, ``used[i] > 0`` says some rank produced a gradient for ``params[i]``,
    which lets parameters unused everywhere keep ``grad=None`` as in one process, at no extra message.
    """

    def __init__(self, index: int, key: str, params: Sequence[nn.Parameter], allocate: bool = True) -> None:
        self.index, self.key, self.params = index, key, list(params)
        total = sum(p.numel() for p in self.params) if allocate else 0
        p0 = self.params[0]
        # allocate=False: the plan only (ZeRO >= 2 reduces the gradients through its own transient buffers)
        self.buffer = torch.zeros(total + len(self.params) if allocate else 0, dtype=p0.dtype, device=p0.device)
        self.used = self.buffer[total:]
        self.views = views(self.buffer, [p.shape for p in self.params]) if allocate else []

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def __repr__(self) -> str:
        return f"Bucket({self.index}, key={self.key!r}, params={len(self.params)}, {self.nbytes} bytes)"


def gradient_buckets(params: Sequence[nn.Parameter], name: str, bucket_mb: float = 25.0,
                     first_bucket_mb: float | None = None, allocate: bool = True) -> list[Bucket]:
    """`params` in :class:`Bucket` s planned by :func:`plan_buckets` in DDP's order (the reverse of
    `params`: autograd produces the last layers' gradients first), keys ``f"{name}.b{i}"``; `allocate`
    False: the plan only (no buffer, no views)."""
    order = list(params)[::-1]
    plan = plan_buckets([(p.numel() * p.element_size(), f"{p.dtype}/{p.device}") for p in order],
                        int(bucket_mb * MB), None if first_bucket_mb is None else int(first_bucket_mb * MB))
    return [Bucket(i, f"{name}.b{i}", [order[j] for j in idx], allocate) for i, idx in enumerate(plan)]


def adopt(p: nn.Parameter, view: torch.Tensor, scale: float | None) -> bool:
    """Make ``p.grad`` its bucket view, multiplied by `scale` if given; False if `p` has no gradient.

    Called from a post-accumulate-grad hook. After ``zero_grad(set_to_none=True)`` autograd hands the
    parameter a fresh tensor; one pass writes it, scaled, into the bucket (cheaper than zeroing the
    bucket ahead and accumulating into it, and the pre-scaling rides along), and from then on
    accumulation (more micro-batches, ``no_sync``, several backward passes) writes in place."""
    g = p.grad
    if g is None:
        return False
    if g.data_ptr() != view.data_ptr():
        if scale is None:
            view.copy_(g)
        else:
            torch.mul(g, scale, out=view)
        p.grad = view
    elif scale is not None:
        view.mul_(scale)
    return True
