"""Spatially parallel pooling: MaxPool2d (padding is -inf), AvgPool2d (count_include_pad honoured), both
with ``ceil_mode``, and AdaptiveAvgPool2d whose output is replicated over the spatial group."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._window import WindowLayer, input_layout, register_functional_pools
from .distribution import Distribution
from .halo import Box, HaloPlan, halo_exchange, window_of
from .tensor import SpatialError, global_avg_pool

__all__ = ["SpatialMaxPool2d", "SpatialAvgPool2d", "SpatialAdaptiveAvgPool2d"]


class SpatialMaxPool2d(WindowLayer):
    """MaxPool2d on local blocks: halos exchanged, global-edge padding is -inf (never selected), so the
    output and its gradient (to the first maximal cell, as torch) equal the single-process layer."""

    def __init__(self, pool: nn.MaxPool2d, dist: Distribution) -> None:
        if pool.return_indices:
            raise SpatialError("SpatialMaxPool2d cannot return indices (they would be local to each block)")
        super().__init__(dist, window_of(pool.kernel_size, pool.stride or pool.kernel_size, pool.padding,
                                         pool.dilation, pool.ceil_mode))
        self.ceil_mode = pool.ceil_mode
        self.kernel = [w.kernel for w in self.windows]
        self.stride_ = [w.stride for w in self.windows]
        self.dilation = [w.dilation for w in self.windows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = input_layout(self, x)
        if layout.kind == "replicated":
            pads = [w.pad[0] for w in self.windows]
            y = F.max_pool2d(x, self.kernel, self.stride_, pads, self.dilation, self.ceil_mode)
            return self.tag_output(y, layout)
        # the needed rectangle covers exactly this block's windows (ceil_mode's partial last window
        # included: the cells past the padded input are -inf too)
        ext = halo_exchange(x, self.plan(layout, x), layout.dist.spatial_comm, float("-inf"), layout.dist.sends)
        return self.tag_output(F.max_pool2d(ext, self.kernel, self.stride_, 0, self.dilation), layout)


class SpatialAvgPool2d(WindowLayer):
    """AvgPool2d on local blocks. Each window's divisor is counted on a mask of the global tensor as
    torch counts it: the real cells (``count_include_pad=False``) or the cells of the padded input
    (``True``; with ``ceil_mode`` a partial last window counts only those); ``divisor_override`` is
    honoured."""

    def __init__(self, pool: nn.AvgPool2d, dist: Distribution) -> None:
        super().__init__(dist, window_of(pool.kernel_size, pool.stride or pool.kernel_size, pool.padding, 1,
                                         pool.ceil_mode))
        self.ceil_mode = pool.ceil_mode
        self.kernel = [w.kernel for w in self.windows]
        self.stride_ = [w.stride for w in self.windows]
        self.count_include_pad, self.divisor_override = pool.count_include_pad, pool.divisor_override
        self._counts: dict[int, torch.Tensor] = {}

    def _count(self, plan: HaloPlan, like: torch.Tensor) -> torch.Tensor:
        """Cells counted by torch per output window of this rank's block, shape (1, 1, oh, ow)."""
        key = id(plan)
        if key not in self._counts:
            mask = like.new_zeros((1, 1, *plan.ext_shape))
            (h0, h1), (w0, w1) = plan.valid.rows, plan.valid.cols
            (pt, pb), (pl, pr) = self.windows[0].pad, self.windows[1].pad
            counted = plan.valid if not self.count_include_pad else Box((h0 - pt, h1 + pb), (w0 - pl, w1 + pr))
            inside = plan.need & counted
            if not inside.empty:
                mask[(..., *inside.within(plan.need))] = 1.0
            self._counts[key] = F.avg_pool2d(mask, self.kernel, self.stride_, 0, divisor_override=1)
        return self._counts[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = input_layout(self, x)
        if layout.kind == "replicated":
            raise SpatialError("SpatialAvgPool2d on a tensor replicated over the spatial group: "
                               "use nn.AvgPool2d")
        plan = self.plan(layout, x)
        ext = halo_exchange(x, plan, layout.dist.spatial_comm, 0.0, layout.dist.sends)
        if self.divisor_override or (self.count_include_pad and not self.ceil_mode):
            y = F.avg_pool2d(ext, self.kernel, self.stride_, 0, divisor_override=self.divisor_override)
        else:
            y = F.avg_pool2d(ext, self.kernel, self.stride_, 0, divisor_override=1) / self._count(plan, x)
        return self.tag_output(y, layout)


class SpatialAdaptiveAvgPool2d(nn.Module):
    """AdaptiveAvgPool2d of the whole (distributed) sample: each rank sums its cells into every output
    window, one allreduce over the spatial group completes the sums. The output is *replicated* over
    the spatial group (layout ``"replicated"``), ready for an ordinary head (Flatten, Linear)."""

    def __init__(self, pool: nn.AdaptiveAvgPool2d | nn.AdaptiveAvgPool3d, dist: Distribution) -> None:
        super().__init__()
        size = pool.output_size
        dims = 3 if isinstance(pool, nn.AdaptiveAvgPool3d) else 2
        sizes = (size,) * dims if isinstance(size, int) else tuple(size)  # type: ignore[arg-type]
        if any(s is None for s in sizes):
            raise SpatialError("SpatialAdaptiveAvgPool2d needs an explicit output size (no None)")
        self.output_size: tuple[int, ...] = tuple(int(s) for s in sizes if s is not None)
        self.dist = dist

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_layout(self, x)  # refuses a tensor without a layout
        return global_avg_pool(x, self.output_size)



register_functional_pools(2, SpatialMaxPool2d, SpatialAvgPool2d)
