"""`parallelize`: an ordinary CNN (Sequential or fx-traceable) as its spatially parallel form."""

from __future__ import annotations

import torch
import torch.fx
from torch import nn

from .base import WindowLayer
from .batchnorm import SpatialBatchNorm2d
from .conv import SpatialConv2d
from .distribution import Distribution, Layout, SpatialError, layout_of, tag
from .halo import complete_sends
from .pooling import SpatialAdaptiveAvgPool2d, SpatialAvgPool2d, SpatialMaxPool2d
from .redistribute import Redistribute
from .reduce import GradBucket

__all__ = ["parallelize", "SpatialParallel", "SpatialSequential", "convert"]

_SPATIAL = (WindowLayer, SpatialBatchNorm2d, SpatialAdaptiveAvgPool2d, Redistribute)


def convert(m: nn.Module, dist: Distribution, bn_stats: str = "global", overlap: bool = True) -> nn.Module:
    """The spatial form of one module, sharing its parameters and buffers; modules without a spatial
    meaning (element-wise, heads) are returned as they are."""
    if isinstance(m, _SPATIAL):
        return m
    if isinstance(m, nn.Conv2d):
        return SpatialConv2d(m, dist, overlap)
    if isinstance(m, nn.BatchNorm2d):
        return SpatialBatchNorm2d(m, dist, bn_stats)
    if isinstance(m, nn.MaxPool2d):
        return SpatialMaxPool2d(m, dist)
    if isinstance(m, nn.AvgPool2d):
        return SpatialAvgPool2d(m, dist)
    if isinstance(m, nn.AdaptiveAvgPool2d):
        return SpatialAdaptiveAvgPool2d(m, dist)
    if isinstance(m, nn.Sequential):
        return SpatialSequential(*(convert(c, dist, bn_stats, overlap) for c in m))
    if isinstance(m, (nn.Conv1d, nn.Conv3d, nn.ConvTranspose2d, nn.AdaptiveMaxPool2d, nn.Upsample,
                      nn.MaxPool1d, nn.MaxPool3d, nn.LPPool2d, nn.FractionalMaxPool2d)):
        raise SpatialError(f"{type(m).__name__} has no spatially parallel form; redistribute before it")
    if next(m.children(), None) is None:
        return m
    return _convert_traced(m, dist, bn_stats, overlap)


def _convert_traced(m: nn.Module, dist: Distribution, bn_stats: str, overlap: bool) -> torch.fx.GraphModule:
    try:
        gm = torch.fx.symbolic_trace(m)
    except Exception as e:  # fx raises many types; the message is what matters
        raise SpatialError(f"cannot parallelize {type(m).__name__}: it is neither a Sequential nor "
                           f"fx-traceable ({e})") from e
    for node in gm.graph.nodes:
        if node.op == "call_module":
            parent, _, name = node.target.rpartition(".")
            owner = gm.get_submodule(parent) if parent else gm
            setattr(owner, name, convert(gm.get_submodule(node.target), dist, bn_stats, overlap))
    return gm


class SpatialSequential(nn.Sequential):
    """A Sequential that carries the layout from layer to layer: an element-wise module keeps its input's
    layout; any module may follow a replicated layout or whole samples (a 1x1 grid, e.g. after a
    Redistribute); a non-spatial module that changes the shape of a spatially split block is refused
    (its result would depend on the split)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for m in self:
            before = layout_of(x)
            y = m(x)
            if before is not None and layout_of(y) is None:
                y = _propagate(m, x, y, before)
            x = y
        return x


def _propagate(m: nn.Module, x: torch.Tensor, y: torch.Tensor, layout: Layout) -> torch.Tensor:
    if y.shape == x.shape:  # element-wise: same layout
        return tag(y, layout)
    if layout.kind == "replicated" or layout.dist.per_sample == 1:  # whole samples: any module applies
        return tag(y, Layout(layout.dist, "replicated", (layout.shape[0], *y.shape[1:])))
    raise SpatialError(f"{type(m).__name__} changed a spatial block from {tuple(x.shape)} to "
                       f"{tuple(y.shape)}; only spatial layers may do that: add a global AdaptiveAvgPool2d "
                       f"or Redistribute to a sample distribution before it")


class SpatialParallel(nn.Module):
    """The spatially parallel model returned by :func:`parallelize`: takes and returns local blocks;
    after ``backward()`` every parameter's ``.grad`` is the single-process gradient on every rank
    (each rank's partial gradients are summed over the world communicator by one fused allreduce when
    autograd finishes; gradients accumulate across backward passes as in torch)."""

    def __init__(self, module: nn.Module, converted: nn.Module, dist: Distribution) -> None:
        super().__init__()
        self.module, self.dist = converted, dist
        self._original = [module]

    @property
    def original(self) -> nn.Module:
        return self._original[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # looked up on every call (~0.1 ms): parameters added, replaced or frozen since are honoured
        live = [(p, owners) for p, owners in _param_slots(self.module) if p.requires_grad]
        bucket = GradBucket(self.dist.comm, [p for p, _ in live])
        # every module that holds a parameter reads the bucket's view of it for this call (an instance
        # attribute shadows the registered parameter): what torch.func.functional_call does, at a
        # fraction of its cost
        for view, (_, owners) in zip(bucket.views(), live):
            for m, name in owners:
                m.__dict__[name] = view
        try:
            y = self.module(x)
        finally:
            for _, owners in live:
                for m, name in owners:
                    del m.__dict__[name]
        complete_sends()  # nothing of this forward stays in flight (backward completes its own)
        if layout_of(y) is None and y.dim() == 4:
            tag(y, self.dist.infer_layout(y))
        return y


def _param_slots(module: nn.Module) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Each parameter of `module` once (in ``named_parameters`` order) with every (module, attribute)
    that holds it: a tied weight has several."""
    slots: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), (p, []))[1].append((m, name))
    return list(slots.values())


def parallelize(module: nn.Module, dist: Distribution, *, bn_stats: str = "global",
                overlap: bool = True) -> SpatialParallel:
    """The spatially parallel form of `module` over `dist`, sharing its weights and BN buffers.

    Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d and BatchNorm2d become their spatial forms (see
    those classes); element-wise modules run on blocks as they are; a head after a global pool or a
    :class:`Redistribute` runs on whatever layout it receives. `bn_stats`: ``"global"`` (exact),
    ``"spatial"`` or ``"local"``. `overlap`: compute conv interiors while halos are in flight.
    Every rank must call it (and the result) the same way: it is collective over ``dist.comm`` (it
    splits the distribution's communicators) only after every module was accepted, so an unsupported
    one raises :class:`SpatialError` on every rank before any message."""
    converted = convert(module, dist, bn_stats, overlap)
    dist.connect()
    return SpatialParallel(module, converted, dist)
