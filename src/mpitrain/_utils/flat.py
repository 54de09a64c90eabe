"""Flat buffers: offsets of packed blocks, tensors packed into one buffer and views back into it.

The one place where the project computes prefix sums of sizes or packs tensors back to back (gradient
buckets, fused broadcasts, alltoallv displacements, ring chunks, server shards)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

import torch

__all__ = ["offsets", "spans", "flatten", "joined", "views", "copy_from_flat", "group_by"]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def offsets(sizes: Iterable[int]) -> list[int]:
    """Exclusive prefix sums, one longer than `sizes`: ``[0, s0, s0 + s1, ..., total]``.

    Block i of a packed buffer is ``[offsets[i], offsets[i + 1])``; ``offsets[:-1]`` are MPI's
    displacements."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + int(s))
    return out


def spans(sizes: Iterable[int], start: int = 0) -> list[tuple[int, int]]:
    """Half-open ``(start, stop)`` ranges of consecutive blocks of `sizes`, the first starting at `start`."""
    offs = offsets(sizes)
    return [(start + a, start + b) for a, b in zip(offs, offs[1:])]


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' elements back to back in one new 1-D tensor (one copy), or written into `out`
    (1-D, at least as long; returns the used prefix). All tensors must share a dtype and device."""
    parts = [t.reshape(-1) for t in tensors]
    if out is None:
        return torch.cat(parts) if parts else torch.empty(0)
    used = out[:sum(p.numel() for p in parts)]
    return torch.cat(parts, out=used) if parts else used


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D view of the memory `tensors` cover when they already lie back to back, in order, in one
    storage (each contiguous, one dtype and device: consecutive :func:`views` of one buffer), else None.
    Reducing that view in place reduces every tensor with no :func:`flatten` copy."""
    if not tensors:
        return None
    first = tensors[0]
    storage, at = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.untyped_storage().data_ptr() != storage or t.data_ptr() != at):
            return None
        at += t.numel() * t.element_size()
    return first.as_strided((sum(t.numel() for t in tensors),), (1,))


def views(flat: torch.Tensor, shapes: Sequence[torch.Size | tuple[int, ...]]) -> list[torch.Tensor]:
    """Consecutive views of the 1-D `flat` with the given shapes (no copy); `flat` may be longer."""
    numels = [int(torch.Size(s).numel()) for s in shapes]
    return [flat[a:b].view(s) for (a, b), s in zip(spans(numels), shapes)]


def copy_from_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Write consecutive pieces of the 1-D `flat` back into `tensors`, in place (undoes :func:`flatten`)."""
    for t, v in zip(tensors, views(flat, [t.shape for t in tensors])):
        t.copy_(v)


def group_by(items: Iterable[T], key: Callable[[T], K]) -> dict[K, list[T]]:
    """Items (tensors, or tuples holding them) grouped by ``key(t)`` (e.g. dtype and device: a flat
    buffer has one of each), in order of first appearance."""
    out: dict[K, list[T]] = {}
    for t in items:
        out.setdefault(key(t), []).append(t)
    return out
