"""What every spatially parallel window layer shares: the input's layout, the cached halo plan, tagging."""

from __future__ import annotations

import torch
from torch import nn

from ._exchange import HaloStats
from .distribution import Distribution
from .halo import HaloPlan, Window, plan_halo
from .tensor import Layout, SpatialError, layout_of, plain, tag

__all__ = ["WindowLayer", "input_layout"]


def input_layout(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """(the plain local block, its layout) of a spatial layer's input, which must be a SpatialTensor
    (produced by ``Distribution.scatter`` and the model's ops: see :mod:`mpitrain.spatial.tensor`)."""
    layout = layout_of(x)
    if layout is None:
        raise SpatialError(f"{type(layer).__name__} received a tensor without a spatial layout "
                           f"(shape {tuple(x.shape)}); feed the parallelized model Distribution.scatter's "
                           f"blocks and build activations from them")
    return plain(x), layout


class WindowLayer(nn.Module):
    """Base of the sliding-window layers (conv, pools): one plan per input distribution and global
    size, cached. The input's distribution (after a :class:`Redistribute`, not necessarily `dist`)
    decides the grid. A block replicated inside the spatial group (after a global pool) is processed
    locally with no halo."""

    def __init__(self, dist: Distribution, windows: tuple[Window, Window]) -> None:
        super().__init__()
        self.dist, self.windows = dist, windows
        self.stats = HaloStats()
        self._plans: dict[tuple[int, int, int], HaloPlan] = {}

    def windows_for(self, size: tuple[int, int]) -> tuple[Window, Window]:
        """The (height, width) windows for a global input of `size` (fixed, unless a layer's geometry
        depends on the input size, as an upsampling's does)."""
        return self.windows

    def plan(self, layout: Layout, x: torch.Tensor) -> HaloPlan:
        dist, size = layout.dist, (layout.shape[2], layout.shape[3])
        key = (id(dist), *size)
        if key not in self._plans:
            self._plans[key] = plan_halo(size, dist.grid, self.windows_for(size), dist.spatial_rank)
        plan = self._plans[key]
        if tuple(x.shape[2:]) != plan.owned.shape:
            raise SpatialError(f"{type(self).__name__}: local block {tuple(x.shape)} is not this rank's "
                               f"block {plan.owned} of a {size[0]}x{size[1]} input")
        return plan

    def tag_output(self, y: torch.Tensor, layout: Layout) -> torch.Tensor:
        if layout.kind == "replicated":
            return tag(y, Layout(layout.dist, "replicated", (layout.shape[0], *y.shape[1:])))
        wh, ww = self.windows_for((layout.shape[2], layout.shape[3]))
        out_h, out_w = wh.out_size(layout.shape[2]), ww.out_size(layout.shape[3])
        return tag(y, Layout(layout.dist, "block", (layout.shape[0], y.shape[1], out_h, out_w)))
