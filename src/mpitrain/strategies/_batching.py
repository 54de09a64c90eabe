"""Slicing global mini-batches into per-replica and per-micro-batch pieces: equal ones (`shard`,
`chunks`) and, for uneven batches, blocks as even as possible by the project's one blocking rule
(:func:`~mpitrain.comm.base.split_sizes`)."""

from __future__ import annotations

from typing import Any

import torch

from .._utils.flat import spans
from ..comm.base import Communicator, split_sizes
from .base import Batch, BatchShare, FitError, Share

__all__ = ["batch_size", "shard", "chunks", "check_divisible", "rows", "split_rows", "even_share", "slice_share",
           "gather_rows"]


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


def rows(x: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` along dim 0 (views); tuples/lists item-wise, non-tensors passed as is."""
    if isinstance(x, (tuple, list)):
        return type(x)(rows(v, start, stop) for v in x)
    return x[start:stop] if isinstance(x, torch.Tensor) else x


def split_rows(x: Any, parts: int) -> list[Any]:
    """`x` cut along dim 0 into `parts` blocks as even as possible (:func:`split_sizes`), empty ones dropped."""
    return [rows(x, a, b) for a, b in spans(split_sizes(batch_size(x), parts)) if b > a]


def even_share(n: int, parts: int, index: int) -> Share:
    """Block `index` of `parts` blocks of `n` rows as even as possible (the first ``n % parts`` one longer)."""
    a, b = spans(split_sizes(n, parts))[index]
    return Share(a, b)


def slice_share(inputs: Batch, targets: torch.Tensor, share: Share) -> BatchShare:
    """The :class:`BatchShare` of a global batch held in full (an iterable of global batches)."""
    n = batch_size(targets)
    if share.rows == 0:
        return BatchShare(None, None, n, share)
    return BatchShare(rows(inputs, share.start, share.stop) if share.inputs else None,
                      targets[share.start:share.stop] if share.targets else None, n, share)


def gather_rows(comm: Communicator, out: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Collective: every rank's `out` (``sizes[rank]`` rows, the same trailing shape) concatenated in
    rank order, on every rank. Pads to the largest block for one allgather."""
    if len(set(sizes)) == 1:
        return comm.allgather(out.contiguous())
    top = max(sizes)
    padded = out.new_zeros((top, *out.shape[1:]))
    padded[:len(out)] = out
    blocks = comm.allgather(padded).reshape(len(sizes), top, *out.shape[1:])
    return torch.cat([blocks[r, :s] for r, s in enumerate(sizes)])
