"""Spatially parallel upsampling: ConvTranspose2d and Upsample / ``F.interpolate`` (nearest, bilinear).

Both read, for this rank's block of *output* rows and columns (the blocking rule applied to the output
size), a rectangle of input rows and columns that depends on the stride or the scale; the halo plan
brings the parts other ranks own, as for a convolution. The transposed convolution then runs torch's
kernel on the halo-extended block and keeps its rows; the interpolation applies, per dimension, the
0/1 (nearest) or two-tap (bilinear) weights torch uses, written as a small matrix over global indices,
so the edge rules (clamping, ``align_corners``) are the single-process ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._window import WindowLayer, input_layout
from .distribution import Distribution
from .halo import HaloPlan, halo_exchange, plan_halo
from .tensor import BlockExtent, DistributionLike, Layout, SpatialError, register_spatial_function, tag, whole_size

__all__ = ["SpatialConvTranspose2d", "SpatialUpsample", "TransposedWindow", "ResampleWindow", "interpolate"]


@dataclass(frozen=True)
class TransposedWindow:
    """One dimension of a transposed convolution: input ``i`` adds to outputs
    ``i*stride - pad + dilation*t`` for ``t in range(kernel)``."""

    kernel: int
    stride: int
    pad: int
    dilation: int
    output_padding: int

    def out_size(self, n: int) -> int:
        return (n - 1) * self.stride - 2 * self.pad + self.dilation * (self.kernel - 1) + self.output_padding + 1

    def needed(self, o0: int, o1: int) -> tuple[int, int]:
        """Half-open input range that adds to outputs ``[o0, o1)``."""
        lo = -((-(o0 + self.pad - self.dilation * (self.kernel - 1))) // self.stride)
        return lo, (o1 - 1 + self.pad) // self.stride + 1

    def start(self, i0: int) -> int:
        """Global output index of the first row of torch's unpadded result on inputs from ``i0``."""
        return i0 * self.stride - self.pad


class SpatialConvTranspose2d(WindowLayer):
    """ConvTranspose2d (any kernel, stride, padding, output_padding, dilation, groups, bias) on local
    blocks, sharing `conv`'s parameters; output and gradients equal the single-process layer's."""

    def __init__(self, conv: nn.ConvTranspose2d, dist: Distribution) -> None:
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise SpatialError("SpatialConvTranspose2d supports zero padding only")
        dims = [TransposedWindow(conv.kernel_size[i], conv.stride[i], int(conv.padding[i]), conv.dilation[i],
                                 conv.output_padding[i]) for i in range(2)]
        super().__init__(dist, (dims[0], dims[1]))
        self.weight, self.bias = conv.weight, conv.bias
        self.conv = conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = input_layout(self, x)
        c = self.conv
        if layout.kind == "replicated":
            y = F.conv_transpose2d(x, self.weight, self.bias, c.stride, c.padding,  # type: ignore[arg-type]
                                   c.output_padding, c.groups, c.dilation)
            return self.tag_output(y, layout)
        plan = self.plan(layout, x)
        ext = halo_exchange(x, plan, layout.dist.spatial_comm, 0.0, layout.dist.sends)
        y = F.conv_transpose2d(ext, self.weight, None, c.stride, 0, 0, c.groups, c.dilation)
        wh, ww = self.windows
        pads = []
        for w, need, out, size in ((ww, plan.need.cols, plan.out.cols, y.shape[3]),
                                   (wh, plan.need.rows, plan.out.rows, y.shape[2])):
            start = w.start(need[0])
            pads += [start - out[0], out[1] - (start + size)]  # negative: crop, positive: rows no input reaches
        y = F.pad(y, pads)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, 1, 1).to(y.dtype)  # autocast: bf16 as torch's layer adds it
        return self.tag_output(y, layout)


@dataclass(frozen=True)
class ResampleWindow:
    """One dimension of an interpolation from `n` to `out` cells (``mode`` "nearest" or "linear",
    ``scale`` torch's source/destination scale, ``align_corners``)."""

    n: int
    out: int
    mode: str
    scale: float
    align_corners: bool

    def out_size(self, n: int) -> int:
        return self.out

    def taps(self, o: int) -> list[tuple[int, float]]:
        """(input index, weight) pairs that make output `o`, as torch's CPU kernels compute them."""
        if self.mode == "nearest":
            return [(min(math.floor(o * self.scale), self.n - 1), 1.0)]
        src = self.scale * o if self.align_corners else max(self.scale * (o + 0.5) - 0.5, 0.0)
        i0 = int(src)
        i1 = i0 + (1 if i0 < self.n - 1 else 0)
        lam = src - i0
        return [(i0, 1.0 - lam), (i1, lam)]

    def needed(self, o0: int, o1: int) -> tuple[int, int]:
        cells = [i for o in range(o0, o1) for i, _ in self.taps(o)]
        return min(cells), max(cells) + 1

    def matrix(self, o0: int, o1: int, like: torch.Tensor) -> torch.Tensor:
        """(o1 - o0, needed cells) weights of outputs ``[o0, o1)``."""
        a, b = self.needed(o0, o1)
        m = like.new_zeros((o1 - o0, b - a))
        for o in range(o0, o1):
            for i, w in self.taps(o):
                m[o - o0, i - a] += w
        return m


def _axes(size: tuple[int, int], out: tuple[int, int], mode: str, scales: tuple[float | None, float | None],
          align_corners: bool) -> tuple[ResampleWindow, ResampleWindow]:
    axes = []
    for n, o, s in zip(size, out, scales):
        if mode == "linear" and align_corners:
            scale = (n - 1) / (o - 1) if o > 1 else 0.0
        else:
            scale = 1.0 / s if s else n / o
        axes.append(ResampleWindow(n, o, mode, scale, align_corners))
    return axes[0], axes[1]


@lru_cache(maxsize=256)
def _plan(size: tuple[int, int], grid: tuple[int, int], axes: tuple[ResampleWindow, ResampleWindow],
          rank: int) -> HaloPlan:
    return plan_halo(size, grid, axes, rank)


_MODES = {"nearest": "nearest", "bilinear": "linear"}


def interpolate(x: torch.Tensor, size: Any = None, scale_factor: Any = None, mode: str = "nearest",
                align_corners: bool | None = None, recompute_scale_factor: bool | None = None,
                antialias: bool = False) -> torch.Tensor:
    """``F.interpolate`` of a SpatialTensor (what ``F.interpolate`` on one calls): modes "nearest" and
    "bilinear"; the output is split by the blocking rule like any block. Collective over the spatial
    group (one halo exchange); differentiable."""
    if mode not in _MODES or antialias:
        raise SpatialError(f"interpolate(mode={mode!r}, antialias={antialias}) has no spatial form; "
                           f"supported: nearest, bilinear")
    local, layout = input_layout(interpolate_layer, x)
    h, w = layout.shape[2], layout.shape[3]
    to_block = any(isinstance(v, BlockExtent) for v in (size if isinstance(size, (tuple, list)) else (size,)))
    size = whole_size(size)  # x.shape[-2:] of a block: that block's whole extent
    if size is not None:
        out = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        scales: tuple[float | None, float | None] = (None, None)
    else:
        sf = (scale_factor, scale_factor) if isinstance(scale_factor, (int, float)) else tuple(scale_factor)
        out = (math.floor(h * sf[0]), math.floor(w * sf[1]))
        scales = (None, None) if recompute_scale_factor else (float(sf[0]), float(sf[1]))
    axes = _axes((h, w), out, _MODES[mode], scales, bool(align_corners))
    shape = (layout.shape[0], layout.shape[1], *out)
    if layout.kind == "replicated" and to_block:  # to another tensor's extent: that tensor's block of it
        return _replicated_to_block(local, layout.dist, axes, shape)
    if layout.kind == "replicated":
        y = F.interpolate(local, size=out, mode=mode, align_corners=align_corners)
        return tag(y, Layout(layout.dist, "replicated", shape))
    dist = layout.dist
    plan = _plan((h, w), dist.grid, axes, dist.spatial_rank)
    ext = halo_exchange(local, plan, dist.spatial_comm, 0.0, dist.sends)
    mh = axes[0].matrix(*plan.out.rows, ext)
    mw = axes[1].matrix(*plan.out.cols, ext)
    y = torch.einsum("nchw,ih,jw->ncij", ext, mh, mw)
    return tag(y, Layout(dist, "block", shape))


def _replicated_to_block(local: torch.Tensor, dist: DistributionLike, axes: tuple[ResampleWindow, ResampleWindow],
                         shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's block of the interpolation of whole samples (replicated over the group; ASPP's pooled
    branch resized to the feature map): only the block's rows and columns are computed, no message. Its
    gradient is this rank's share of the replicated input's (the shares sum to the whole gradient)."""
    dist.check_shape((max(shape[0], dist.samples), *shape[1:]), "interpolate output")  # a group may hold none
    (o0, o1), (p0, p1) = dist.box(shape)[1:]
    (a, b), (c, d) = axes[0].needed(o0, o1), axes[1].needed(p0, p1)
    mh, mw = axes[0].matrix(o0, o1, local), axes[1].matrix(p0, p1, local)
    y = torch.einsum("nchw,ih,jw->ncij", local[:, :, a:b, c:d], mh, mw)
    return tag(y, Layout(dist, "block", shape))


class _InterpolateName(nn.Module):
    """Names ``F.interpolate`` in the error for an input without a layout."""


interpolate_layer = _InterpolateName()
register_spatial_function("interpolate", interpolate)


class SpatialUpsample(nn.Module):
    """``nn.Upsample`` (nearest, bilinear) on local blocks (see :func:`interpolate`)."""

    def __init__(self, up: nn.Upsample, dist: Distribution) -> None:
        super().__init__()
        if up.mode not in _MODES:
            raise SpatialError(f"Upsample(mode={up.mode!r}) has no spatial form; supported: nearest, bilinear")
        self.up, self.dist = up, dist

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up
        return interpolate(x, up.size, up.scale_factor, up.mode, up.align_corners, up.recompute_scale_factor)

