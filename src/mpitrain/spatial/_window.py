"""What every spatially parallel window layer shares: the input's layout, the cached halo plan, tagging."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._exchange import HaloStats
from .distribution import Distribution
from .halo import HaloPlan, plan_grid
from .tensor import DistributionLike, Layout, SpatialError, layout_of, nchw, plain, register_spatial_function, tag

__all__ = ["WindowLayer", "input_layout", "pad_by_mode", "padding_mode_problem", "PADDING_MODES",
           "register_functional", "register_functional_pools"]

#: Conv ``padding_mode`` values with a spatial form ("circular" only along dimensions the grid does not split).
PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def padding_mode_problem(plans: list[HaloPlan], mode: str, grid: tuple[int, ...]) -> str | None:
    """Why `mode` padding cannot be applied to the needed boxes of these plans (every rank's: the
    verdict is the same on every rank), or None."""
    for plan in plans:
        inside = plan.need & plan.valid
        for d, ((a, b), (lo, hi), g) in enumerate(zip(plan.need.dims, inside.dims, grid)):
            low, high = lo - a, b - hi
            if mode == "circular" and g > 1 and (low or high):
                return (f"padding_mode='circular' along spatial dimension {d}, which the grid {grid} splits, "
                        f"has no spatial form (it wraps to the far rank); split another dimension")
            if mode == "reflect" and max(low, high) >= hi - lo:
                return (f"padding_mode='reflect' needs more than {max(low, high)} in-tensor cells next to the "
                        f"edge along dimension {d}; spatial rank {plan.rank}'s needed box has {hi - lo}")
    return None


def pad_by_mode(ext: torch.Tensor, plan: HaloPlan, mode: str) -> torch.Tensor:
    """The needed box `ext` (halos in place, padding cells arbitrary) with its padding cells set as
    torch's ``padding_mode`` sets them on the global tensor: the in-tensor part of `ext` is padded
    again with ``F.pad(mode)``. Reflect and replicate read only cells next to the global edge, which the
    edge rank's needed box holds; circular reads the opposite edge, so only a dimension the grid does
    not split may wrap (:func:`padding_mode_problem` checks, for every rank at once). Differentiable
    (slicing and ``F.pad``)."""
    inside = plan.need & plan.valid
    pads: list[int] = []
    for (a, b), (lo, hi) in zip(plan.need.dims, inside.dims):
        pads = [lo - a, b - hi] + pads  # F.pad lists the last dimension first
    if not any(pads):
        return ext
    core = ext[(slice(None), slice(None), *inside.within(plan.need))]
    return F.pad(core, pads, mode=mode)


def input_layout(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Layout]:
    """(the plain local block, its layout) of a spatial layer's input, which must be a SpatialTensor
    (produced by ``Distribution.scatter`` and the model's ops: see :mod:`mpitrain.spatial.tensor`)."""
    layout = layout_of(x)
    if layout is None:
        raise SpatialError(f"{type(layer).__name__} received a tensor without a spatial layout "
                           f"(shape {tuple(x.shape)}); feed the parallelized model Distribution.scatter's "
                           f"blocks and build activations from them")
    if layout.kind == "block" and not nchw(layout):
        raise SpatialError(f"{type(layer).__name__} received a block of shape {tuple(layout.shape)} whose spatial "
                           f"dims sit at {layout.spatial_dims()}; it takes N x C x (spatial) blocks")
    return plain(x), layout


class WindowLayer(nn.Module):
    """Base of the sliding-window layers (conv, pools): one plan per input distribution and global
    size, cached. The input's distribution (after a :class:`Redistribute`, not necessarily `dist`)
    decides the grid. A block replicated inside the spatial group (after a global pool) is processed
    locally with no halo."""

    def __init__(self, dist: Distribution, windows: tuple[Any, ...]) -> None:
        super().__init__()
        self.dist, self.windows = dist, windows
        self.stats = HaloStats()
        self._plans: dict[tuple[int, ...], HaloPlan] = {}

    def windows_for(self, size: tuple[int, ...]) -> tuple[Any, ...]:
        """One window per spatial dimension for a global input of `size` (fixed, unless a layer's
        geometry depends on the input size, as an upsampling's does)."""
        return self.windows

    def plan(self, layout: Layout, x: torch.Tensor) -> HaloPlan:
        dist, size = layout.dist, tuple(layout.shape[2:])
        if len(size) != len(dist.grid) or len(size) != len(self.windows):
            raise SpatialError(f"{type(self).__name__} ({len(self.windows)}-D) cannot take a block with "
                               f"{len(size)} spatial dimensions on grid {dist.grid}")
        key = (id(dist), *size)
        if key not in self._plans:
            plans = plan_grid(size, dist.grid, self.windows_for(size))
            self.check_plans(plans, dist.grid)
            self._plans[key] = plans[dist.spatial_rank]
        plan = self._plans[key]
        if tuple(x.shape[2:]) != plan.owned.shape:
            raise SpatialError(f"{type(self).__name__}: local block {tuple(x.shape)} is not this rank's "
                               f"block {plan.owned} of a {'x'.join(map(str, size))} input")
        return plan

    def check_plans(self, plans: list[HaloPlan], grid: tuple[int, ...]) -> None:
        """Refuse (SpatialError, the same verdict on every rank: it sees every rank's plan) a geometry
        this layer cannot run; called once per input size, before any halo message."""

    def tag_output(self, y: torch.Tensor, layout: Layout) -> torch.Tensor:
        if layout.kind == "replicated":
            return tag(y, Layout(layout.dist, "replicated", (layout.shape[0], *y.shape[1:])))
        size = tuple(layout.shape[2:])
        out = tuple(w.out_size(n) for w, n in zip(self.windows_for(size), size))
        return tag(y, Layout(layout.dist, "block", (layout.shape[0], y.shape[1], *out)))


#: Per distribution, the window layers standing for functional calls, by the call's arguments.
_FUNCTIONAL: weakref.WeakKeyDictionary[DistributionLike, dict[Any, nn.Module]] = weakref.WeakKeyDictionary()


def register_functional(name: str, build: Callable[..., nn.Module]) -> None:
    """Route ``F.<name>(block, *args, **kwargs)`` (e.g. ``F.max_pool2d(x, 1, 2, 0)`` in an FPN's extra
    level) to the spatial layer ``build(dist, *args, **kwargs)`` returns, built once per distribution and
    arguments (its halo plans are cached with it)."""

    def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        layout = layout_of(x)
        if layout is None:
            raise SpatialError(f"F.{name} got a tensor without a spatial layout")
        layers = _FUNCTIONAL.setdefault(layout.dist, {})
        key = (name, args, tuple(sorted(kwargs.items())))
        if key not in layers:
            layers[key] = build(layout.dist, *args, **kwargs)
        out: torch.Tensor = layers[key](x)
        return out

    register_spatial_function(name, run)


def register_functional_pools(dims: int, max_layer: Callable[[Any, Distribution], nn.Module],
                              avg_layer: Callable[[Any, Distribution], nn.Module]) -> None:
    """Route ``F.max_pool{dims}d`` and ``F.avg_pool{dims}d`` on blocks to `max_layer` / `avg_layer` built
    from the equivalent ``nn`` pool (:func:`register_functional`)."""
    max_nn, avg_nn = (nn.MaxPool2d, nn.AvgPool2d) if dims == 2 else (nn.MaxPool3d, nn.AvgPool3d)

    def max_pool(dist: Distribution, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
                 ceil_mode: bool = False, return_indices: bool = False) -> nn.Module:
        return max_layer(max_nn(kernel_size, stride, padding, dilation, return_indices, ceil_mode), dist)

    def avg_pool(dist: Distribution, kernel_size: Any, stride: Any = None, padding: Any = 0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None) -> nn.Module:
        return avg_layer(avg_nn(kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override), dist)

    register_functional(f"max_pool{dims}d", max_pool)
    register_functional(f"avg_pool{dims}d", avg_pool)
