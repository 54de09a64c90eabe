"""What every spatially parallel window layer shares: the input's layout, the cached halo plan, tagging."""

from __future__ import annotations

import torch
from torch import nn

from .distribution import Distribution, Layout, SpatialError, layout_of, tag
from .halo import HaloPlan, HaloStats, Window, plan_halo

__all__ = ["WindowLayer", "input_layout"]


def input_layout(dist: Distribution, x: torch.Tensor) -> Layout:
    """`x`'s layout: its tag, or (untagged block) inferred with one allgather of the local sizes."""
    layout = layout_of(x)
    return layout if layout is not None else dist.infer_layout(x)


class WindowLayer(nn.Module):
    """Base of the sliding-window layers (conv, pools): one plan per input distribution and global
    size, cached. The input's distribution (after a :class:`Redistribute`, not necessarily `dist`)
    decides the grid; `dist` is used to read an untagged block.

    The global size comes from the input's :class:`Layout` (set by ``scatter`` and every spatial layer)
    or, for an untagged block, from one allgather of the local sizes. A block replicated inside the
    spatial group (after a global pool) is processed locally with no halo."""

    def __init__(self, dist: Distribution, windows: tuple[Window, Window]) -> None:
        super().__init__()
        self.dist, self.windows = dist, windows
        self.stats = HaloStats()
        self._plans: dict[tuple[int, int, int], HaloPlan] = {}

    def input_layout(self, x: torch.Tensor) -> Layout:
        return input_layout(self.dist, x)

    def plan(self, layout: Layout, x: torch.Tensor) -> HaloPlan:
        dist, size = layout.dist, (layout.shape[2], layout.shape[3])
        key = (id(dist), *size)
        if key not in self._plans:
            self._plans[key] = plan_halo(size, dist.grid, self.windows, dist.spatial_rank)
        plan = self._plans[key]
        if tuple(x.shape[2:]) != plan.owned.shape:
            raise SpatialError(f"{type(self).__name__}: local block {tuple(x.shape)} is not this rank's "
                               f"block "
                               f"{plan.owned} of a {size[0]}x{size[1]} input")
        return plan

    def tag_output(self, y: torch.Tensor, layout: Layout) -> torch.Tensor:
        if layout.kind == "replicated":
            return tag(y, Layout(layout.dist, "replicated", (layout.shape[0], *y.shape[1:])))
        out_h, out_w = self.windows[0].out_size(layout.shape[2]), self.windows[1].out_size(layout.shape[3])
        return tag(y, Layout(layout.dist, "block", (layout.shape[0], y.shape[1], out_h, out_w)))
