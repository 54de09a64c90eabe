"""Memory formats: spatial layers keep a block in the order it came in, NCHW or channels-last (NHWC)."""

from __future__ import annotations

import torch

__all__ = ["memory_format", "dense", "empty_as"]


def memory_format(t: torch.Tensor) -> torch.memory_format:
    """channels_last when `t` (4-D) has its channels innermost, else the default NCHW order.

    oneDNN convolutions on CPU run several times faster channels-last (docs/spatial.md has the
    measurement), so a model converted with ``model.to(memory_format=torch.channels_last)`` must not be
    converted back by our layers."""
    if t.dim() == 4 and t.shape[1] > 1 and t.stride(1) == 1:
        return torch.channels_last
    return torch.contiguous_format


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if its memory is dense in its own order, else a dense copy in that order."""
    fmt = memory_format(t)
    return t if t.is_contiguous(memory_format=fmt) else t.contiguous(memory_format=fmt)


def empty_as(t: torch.Tensor, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """An uninitialised tensor of `shape` with `t`'s dtype, device and memory order."""
    fmt = memory_format(t) if len(shape) == 4 else torch.contiguous_format
    return torch.empty(tuple(shape), dtype=t.dtype, device=t.device, memory_format=fmt)
