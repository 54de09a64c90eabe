"""Spatially parallel 3-D layers for volumes split over a ``(pd, ph, pw)`` grid: Conv3d, MaxPool3d,
AvgPool3d (BatchNorm3d is :class:`~mpitrain.spatial.batchnorm.SpatialBatchNorm3d`, the global average
pool :func:`~mpitrain.spatial.tensor.global_avg_pool`).

Each layer assembles the halo-extended block of the input its output block reads (one halo exchange
over the spatial group, corners and edges of the 3-D neighbourhood included; its backward is the
exact adjoint) and runs torch's kernel on it without padding: the 2-D conv's interior/strip overlap is
not used here, so the extended block is a full copy — simple and exact, at the cost of memory traffic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._window import (
    PADDING_MODES,
    WindowLayer,
    input_layout,
    pad_by_mode,
    padding_mode_problem,
    register_functional_pools,
)
from .distribution import Distribution
from .halo import Box, HaloPlan, halo_exchange, window_of
from .tensor import SpatialError

__all__ = ["SpatialConv3d", "SpatialMaxPool3d", "SpatialAvgPool3d"]


class SpatialConv3d(WindowLayer):
    """Conv3d (any kernel, stride, padding incl. "same", dilation, groups, bias, ``padding_mode`` as
    :func:`~mpitrain.spatial._window.pad_by_mode` allows) on local blocks of a volume, sharing `conv`'s
    parameters; output and gradients equal the single-process layer's."""

    def __init__(self, conv: nn.Conv3d, dist: Distribution) -> None:
        if conv.padding_mode not in PADDING_MODES:
            raise SpatialError(f"SpatialConv3d: padding_mode {conv.padding_mode!r} has no spatial form")
        super().__init__(dist, window_of(conv.kernel_size, conv.stride, conv.padding, conv.dilation, dims=3))
        self.conv = conv
        self.weight, self.bias = conv.weight, conv.bias

    def check_plans(self, plans: list[HaloPlan], grid: tuple[int, ...]) -> None:
        mode = self.conv.padding_mode
        problem = padding_mode_problem(plans, mode, grid) if mode != "zeros" else None
        if problem:
            raise SpatialError(problem)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = input_layout(self, x)
        c = self.conv
        if layout.kind == "replicated":
            return self.tag_output(c._conv_forward(x, self.weight, self.bias), layout)
        plan = self.plan(layout, x)
        ext = halo_exchange(x, plan, layout.dist.spatial_comm, 0.0, layout.dist.sends)
        if c.padding_mode != "zeros":
            ext = pad_by_mode(ext, plan, c.padding_mode)
        y = F.conv3d(ext, self.weight, self.bias, c.stride, 0, c.dilation, c.groups)
        return self.tag_output(y, layout)


class SpatialMaxPool3d(WindowLayer):
    """MaxPool3d on local blocks (−inf padding, ``ceil_mode``); not ``return_indices``."""

    def __init__(self, pool: nn.MaxPool3d, dist: Distribution) -> None:
        if pool.return_indices:
            raise SpatialError("SpatialMaxPool3d cannot return indices (they would be local to each block)")
        super().__init__(dist, window_of(pool.kernel_size, pool.stride or pool.kernel_size, pool.padding,
                                         pool.dilation, pool.ceil_mode, dims=3))
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = input_layout(self, x)
        if layout.kind == "replicated":
            return self.tag_output(self.pool(x), layout)
        ext = halo_exchange(x, self.plan(layout, x), layout.dist.spatial_comm, float("-inf"), layout.dist.sends)
        w = self.windows
        y = F.max_pool3d(ext, [v.kernel for v in w], [v.stride for v in w], 0, [v.dilation for v in w])
        return self.tag_output(y, layout)


class SpatialAvgPool3d(WindowLayer):
    """AvgPool3d on local blocks; each window's divisor is counted as torch counts it (real cells, or
    the padded input's with ``count_include_pad``; ``ceil_mode``; ``divisor_override``)."""

    def __init__(self, pool: nn.AvgPool3d, dist: Distribution) -> None:
        super().__init__(dist, window_of(pool.kernel_size, pool.stride or pool.kernel_size, pool.padding, 1,
                                         pool.ceil_mode, dims=3))
        self.pool = pool
        self._counts: dict[int, torch.Tensor] = {}

    def _count(self, plan: HaloPlan, like: torch.Tensor) -> torch.Tensor:
        key = id(plan)
        if key not in self._counts:
            mask = like.new_zeros((1, 1, *plan.ext_shape))
            counted = plan.valid if not self.pool.count_include_pad else Box(
                *((a - w.pad[0], b + w.pad[1]) for (a, b), w in zip(plan.valid.dims, self.windows)))
            inside = plan.need & counted
            if not inside.empty:
                mask[(..., *inside.within(plan.need))] = 1.0
            w = self.windows
            self._counts[key] = F.avg_pool3d(mask, [v.kernel for v in w], [v.stride for v in w], 0,
                                             divisor_override=1)
        return self._counts[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = input_layout(self, x)
        if layout.kind == "replicated":
            return self.tag_output(self.pool(x), layout)
        plan = self.plan(layout, x)
        ext = halo_exchange(x, plan, layout.dist.spatial_comm, 0.0, layout.dist.sends)
        w, p = self.windows, self.pool
        sums = F.avg_pool3d(ext, [v.kernel for v in w], [v.stride for v in w], 0, divisor_override=1)
        y = sums / (p.divisor_override or self._count(plan, x))
        return self.tag_output(y, layout)



register_functional_pools(3, SpatialMaxPool3d, SpatialAvgPool3d)
