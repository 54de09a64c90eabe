"""Slicing global mini-batches into equal per-replica and per-micro-batch pieces."""

from __future__ import annotations

from typing import Any

from .base import FitError

__all__ = ["batch_size", "shard", "chunks", "check_divisible"]


def batch_size(x: Any) -> int:
    """Dim-0 length of a tensor, or of the first tensor of a tuple/list."""
    return len(x[0]) if isinstance(x, (tuple, list)) else len(x)


def check_divisible(n: int, parts: int, what: str) -> None:
    """Refuse (FitError naming what to change) a batch of `n` that `parts` don't divide equally.

    Equal slices keep every strategy's mean loss equal to the one-process mean loss."""
    if parts < 1 or n % parts:
        raise FitError(f"a batch of {n} samples cannot be split equally into {parts} {what}; "
                         f"use a batch size divisible by {parts}")


def shard(x: Any, parts: int, index: int) -> Any:
    """Slice `index` of `parts` equal slices along dim 0 (views, no copy); tuples are sliced item-wise."""
    if isinstance(x, (tuple, list)):
        return type(x)(shard(v, parts, index) for v in x)
    n = len(x)
    check_divisible(n, parts, "slices")
    step = n // parts
    return x[index * step:(index + 1) * step]


def chunks(x: Any, parts: int) -> list[Any]:
    """All `parts` equal slices of `x` along dim 0."""
    return [shard(x, parts, i) for i in range(parts)]
