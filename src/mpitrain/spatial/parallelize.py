"""`parallelize`: an ordinary CNN as its spatially parallel form (spatial layers swapped in, the rest as is).

The model's own ``forward`` runs unchanged on :class:`~mpitrain.spatial.tensor.SpatialTensor` blocks:
the layers that need halos or global statistics are replaced by their spatial forms, and every other
op keeps, pools or explicitly redistributes the layout (see :mod:`mpitrain.spatial.tensor`). No tracing:
models with Python control flow work as long as it does not depend on the local block's size.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ._reduce import GradBucket
from ._window import WindowLayer
from .batchnorm import SpatialBatchNorm2d, SpatialBatchNorm3d
from .conv import SpatialConv2d
from .distribution import Distribution
from .pooling import SpatialAdaptiveAvgPool2d, SpatialAvgPool2d, SpatialMaxPool2d
from .redistribute import Redistribute, SampleSwitch, sample_distribution
from .resample import SpatialConvTranspose2d, SpatialUpsample
from .tensor import SpatialError, layout_of, tag
from .volume import SpatialAvgPool3d, SpatialConv3d, SpatialMaxPool3d

__all__ = ["parallelize", "SpatialParallel", "SpatialSequential", "convert", "switch_to_samples"]

_SPATIAL = (WindowLayer, SpatialBatchNorm2d, SpatialAdaptiveAvgPool2d, SpatialUpsample, Redistribute, SampleSwitch)
_REFUSED = (nn.Conv1d, nn.ConvTranspose1d, nn.ConvTranspose3d,
            nn.AdaptiveMaxPool2d, nn.MaxPool1d,
            nn.LPPool2d, nn.FractionalMaxPool2d, nn.GroupNorm, nn.InstanceNorm2d,
            nn.LocalResponseNorm)


#: The torch layers :func:`convert` swaps for their spatial forms (subclasses too, unless :func:`_own_forward`).
_SWAPPED = (nn.Conv2d, nn.BatchNorm2d, nn.SyncBatchNorm, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Conv3d,
            nn.BatchNorm3d, nn.MaxPool3d, nn.AvgPool3d, nn.AdaptiveAvgPool3d, nn.ConvTranspose2d, nn.Upsample)


def _own_forward(m: nn.Module) -> bool:
    """Whether `m` subclasses a layer of :data:`_SWAPPED` but replaces what its call computes (``forward``,
    or a conv's ``_conv_forward``): timm's ``BatchNormAct2d`` (batch norm, then its activation),
    ``Conv2dSame`` (a pad computed from the input's size, then the conv), ``StdConv2d``."""
    return any(isinstance(m, base) and any(getattr(type(m), f, None) is not getattr(base, f, None)
                                           for f in ("forward", "_conv_forward"))
               for base in _SWAPPED)


def convert(m: nn.Module, dist: Distribution, bn_stats: str = "global", overlap: bool = True) -> nn.Module:
    """The spatial form of one module, sharing its parameters and buffers; modules without a spatial
    meaning (element-wise, heads) are returned as they are; a container is returned as a shallow copy
    holding its converted children (the original model is not modified). A subclass of a swapped layer
    with its own forward (:func:`_own_forward`) is not swapped — the spatial layer would silently drop what
    it adds (timm's EfficientNet, MobileNetV3 and RegNet, whose ``BatchNormAct2d`` lost its activation, trained
    0.8 to 2 relative off one process, silently) — but kept,
    and its forward runs on blocks by the tensor's rules: ``F.batch_norm`` has a spatial form (global
    statistics: `bn_stats` applies to the swapped layers), other calls redistribute, warned."""
    if isinstance(m, _SPATIAL):
        return m
    form = None if _own_forward(m) else _spatial_form(m, dist, bn_stats, overlap)
    if form is not None:
        return form
    if isinstance(m, _REFUSED):
        raise SpatialError(f"{type(m).__name__} has no spatially parallel form; redistribute before it")
    if next(m.children(), None) is None:
        return m
    out = copy.copy(m)  # its own __dict__ and child table; parameters, buffers and hooks are shared
    if type(m) is nn.Sequential:
        out = SpatialSequential()
        out.__dict__.update({k: v for k, v in m.__dict__.items() if k != "_modules"})
    out._modules = {name: None if c is None else convert(c, dist, bn_stats, overlap)
                    for name, c in m._modules.items()}
    return out


def _spatial_form(m: nn.Module, dist: Distribution, bn_stats: str, overlap: bool) -> nn.Module | None:
    """The spatial layer standing for `m` (an instance of a :data:`_SWAPPED` class), or None."""
    if isinstance(m, nn.Conv2d):
        return SpatialConv2d(m, dist, overlap)
    if isinstance(m, nn.BatchNorm2d):
        return SpatialBatchNorm2d(m, dist, bn_stats)
    if isinstance(m, nn.SyncBatchNorm):  # a DDP user's: its statistics over the job are "global"'s
        return (SpatialBatchNorm3d if len(dist.grid) == 3 else SpatialBatchNorm2d)(m, dist, bn_stats)
    if isinstance(m, nn.MaxPool2d):
        return SpatialMaxPool2d(m, dist)
    if isinstance(m, nn.AvgPool2d):
        return SpatialAvgPool2d(m, dist)
    if isinstance(m, nn.AdaptiveAvgPool2d):
        return SpatialAdaptiveAvgPool2d(m, dist)
    if isinstance(m, nn.Conv3d):
        return SpatialConv3d(m, dist)
    if isinstance(m, nn.BatchNorm3d):
        return SpatialBatchNorm3d(m, dist, bn_stats)
    if isinstance(m, nn.MaxPool3d):
        return SpatialMaxPool3d(m, dist)
    if isinstance(m, nn.AvgPool3d):
        return SpatialAvgPool3d(m, dist)
    if isinstance(m, nn.AdaptiveAvgPool3d):
        return SpatialAdaptiveAvgPool2d(m, dist)
    if isinstance(m, nn.ConvTranspose2d):
        return SpatialConvTranspose2d(m, dist)
    if isinstance(m, nn.Upsample):
        return SpatialUpsample(m, dist)
    return None


class SpatialSequential(nn.Sequential):
    """The converted form of an ``nn.Sequential`` (layouts travel on the tensors: nothing else to do)."""


class SpatialParallel(nn.Module):
    """The spatially parallel model returned by :func:`parallelize`: takes and returns local blocks
    (:class:`~mpitrain.spatial.tensor.SpatialTensor`); after ``backward()`` every parameter's ``.grad``
    is the single-process gradient on every rank (each rank's partial gradients are summed over the
    world communicator by one fused allreduce when autograd finishes; gradients accumulate across
    backward passes as in torch). When a forward or backward returns, none of its halo sends is in
    flight (``dist.sends`` is empty)."""

    def __init__(self, module: nn.Module, converted: nn.Module, dist: Distribution) -> None:
        super().__init__()
        self.module, self.dist = converted, dist
        self._original = [module]

    @property
    def original(self) -> nn.Module:
        return self._original[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layout_of(x) is None:  # a bare local block: one allgather of its sizes gives the layout
            x = tag(x.view_as(x), self.dist.infer_layout(x))
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
        self.dist.sends.complete()  # nothing of this forward stays in flight (backward completes its own)
        out: torch.Tensor = y
        return out


def _param_slots(module: nn.Module) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Each parameter of `module` once (in ``named_parameters`` order) with every (module, attribute)
    that holds it: a tied weight has several."""
    slots: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                slots.setdefault(id(p), (p, []))[1].append((m, name))
    return list(slots.values())


def switch_to_samples(converted: nn.Module, name: str, dist: Distribution) -> Distribution:
    """Wrap the submodule `name` of a :func:`convert`-ed model in a :class:`SampleSwitch` (in place: the
    converted containers are copies, the user's model is untouched), so that it and what runs after
    it are sample-parallel. Returns the sample distribution (not yet connected). Local: a name that is
    not a submodule raises :class:`SpatialError` on every rank before any message."""
    if not isinstance(name, str) or not name:
        raise SpatialError(f"switch_at must name a submodule (e.g. 'layer3' or '4'), got {name!r}")
    parent_name, _, leaf = name.rpartition(".")
    try:
        parent = converted.get_submodule(parent_name)
        inner = parent.get_submodule(leaf)
    except AttributeError:
        names = [n for n, _ in converted.named_children()]
        raise SpatialError(f"switch_at={name!r} is not a submodule of the model (its children: {names})"
                           ) from None
    if isinstance(inner, SampleSwitch):
        return inner.dst
    sample = sample_distribution(dist)
    parent._modules[leaf] = SampleSwitch(inner, dist, sample)
    return sample


def parallelize(module: nn.Module, dist: Distribution, *, bn_stats: str = "global",
                overlap: bool = True, switch_at: str | None = None) -> SpatialParallel:
    """The spatially parallel form of `module` over `dist`, sharing its weights and BN buffers.

    Conv2d, ConvTranspose2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, BatchNorm2d and Upsample — and on a
    3-D grid Conv3d, MaxPool3d, AvgPool3d, BatchNorm3d, AdaptiveAvgPool3d; SyncBatchNorm on either, as the
    grid's BatchNorm — become their spatial forms (see
    those classes); every other op runs on the blocks by the rules of
    :mod:`mpitrain.spatial.tensor` (element-wise ops keep the layout, global pools replicate the pooled
    vectors, any other op redistributes to whole samples first, visibly, or is refused). `bn_stats`:
    ``"global"`` (exact), ``"spatial"`` or ``"local"``. `overlap`: compute conv interiors while halos
    are in flight. Every rank must call it (and the result) the same way: it is collective over
    ``dist.comm`` (it splits the distribution's communicators) only after every module was accepted, so
    an unsupported one raises :class:`SpatialError` on every rank before any message.

    `switch_at`: the name of a submodule (``"layer3"``, ``"4"``) from whose input on the model runs
    sample-parallel (§V-C's per-layer distributions): its spatially split input is redistributed by
    one alltoall so that each rank holds whole samples (see :class:`SampleSwitch`), and the layers
    that run after it compute on those (BatchNorm's ``"global"`` statistics then reduce over every
    rank, exact). The batch must have at least as many samples as there are ranks."""
    converted = convert(module, dist, bn_stats, overlap)
    sample = None if switch_at is None else switch_to_samples(converted, switch_at, dist)
    dist.connect()
    if sample is not None:
        sample.connect()
    return SpatialParallel(module, converted, dist)
