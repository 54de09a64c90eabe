"""Dense losses where the pixels are: a loss of an output split over the grid against a target laid out alike.

``F.cross_entropy(y, t)`` (and ``nn.CrossEntropyLoss``, the other losses of :data:`DENSE_LOSSES`) with a
block `y` of a segmentation output runs on each rank's block only: torch's own function with
``reduction="none"`` on the local block and the local target, then one allreduce of two numbers, this
rank's sum and its share of the mean's denominator (non-ignored pixels, or their class weights, for
cross-entropy and NLL; the elementwise weights for weighted MSE/L1/Huber; the element count otherwise).
The result is the loss of the whole global batch, the same on every rank, and it *counts once*
(:func:`~mpitrain.spatial.tensor.sum_once`): each rank's backward gives exactly its own block's
gradient. So a mean over pixels with ``ignore_index`` is the global count's mean, not a mean of means,
and the sample groups of a hybrid grid add up to the one-process loss too. No output is gathered.

The target (and an elementwise ``weight``) may be a block of the same distribution (``dist.scatter(t)``,
what ``fit`` passes), this rank's block as a plain tensor, or the whole global tensor (cropped here). A
replicated input (a head after a global pool) reduces over the sample groups the same way.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .distribution import ranges
from .tensor import Layout, SpatialError, layout_of, plain, register_spatial_function, sum_once, tag

__all__ = ["DENSE_LOSSES", "local_operand"]

#: The losses with a form on blocks, and which of their arguments are laid out like the input.
DENSE_LOSSES: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target",),
    "nll_loss": ("target",),
    "mse_loss": ("target", "weight"),
    "l1_loss": ("target", "weight"),
    "huber_loss": ("target", "weight"),
    "smooth_l1_loss": ("target",),
    "binary_cross_entropy": ("target", "weight"),
    "binary_cross_entropy_with_logits": ("target", "weight"),
    "soft_margin_loss": ("target",),
    "kl_div": ("target",),
}
_CLASS_INDEX = ("cross_entropy", "nll_loss")  # mean over non-ignored targets, weighted by class weights
_WEIGHTED_MEAN = ("mse_loss", "l1_loss", "huber_loss")  # mean = sum(w * l) / sum(w)


def local_operand(t: Any, layout: Layout, what: str, broadcast: bool = False) -> Any:
    """This rank's part of `t`, an operand laid out like a tensor of `layout` (a dense target): a
    SpatialTensor of the same distribution and extent, this rank's part as a plain tensor, the whole
    global tensor (cropped: a view), or — with `broadcast` (an elementwise weight, not a target) — a
    plain tensor of fewer dims that broadcasts without extent along the split dims (as is). Anything
    else is refused (SpatialError, local: no message)."""
    if not isinstance(t, torch.Tensor):
        return t
    dist = layout.dist
    k = len(dist.grid) if layout.kind == "block" else 0
    extent = tuple(layout.shape[len(layout.shape) - k:])
    lay = layout_of(t)
    if lay is not None:
        if (lay.dist is not dist or lay.kind != layout.kind or lay.shape[0] != layout.shape[0]
                or tuple(lay.shape[len(lay.shape) - k:]) != extent):
            raise SpatialError(f"{what}: laid out as {lay.kind} of {lay.shape}, but the input is {layout.kind} "
                               f"of {layout.shape} (same samples and extent needed)")
        return plain(t)
    nd = len(layout.shape)
    if broadcast and t.dim() < nd and all(d < nd - t.dim() or t.shape[d - nd + t.dim()] == 1
                                          for d in (0, *range(nd - k, nd))):
        return t  # broadcasts with no extent along the split dims (BCE's per-class weight): local data
    mine = dist.local_shape(layout.shape) if layout.kind == "block" else (dist.local_samples(layout.shape[0]),)
    local = (mine[0], *mine[len(mine) - k:]) if k else mine[:1]
    if t.dim() >= 1 + k and (t.shape[0], *t.shape[t.dim() - k:]) == local:
        return t
    if t.dim() >= 1 + k and (t.shape[0], *t.shape[t.dim() - k:]) == (layout.shape[0], *extent):
        if layout.kind == "block":
            return t[dist.index(tuple(t.shape))]
        return t[slice(*ranges(layout.shape[0], dist.samples)[dist.group])]
    raise SpatialError(f"{what} of shape {tuple(t.shape)} is neither this rank's part (samples x extent "
                       f"{local}) nor the whole (samples x extent {(layout.shape[0], *extent)}) of an input "
                       f"laid out as {layout.kind} of {layout.shape}")


def _spatial_loss(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., Any]:
    sig = inspect.signature(fn)
    dense = DENSE_LOSSES[name]

    def loss(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise SpatialError(f"{name} on a spatial tensor: {e}") from None
        bound.apply_defaults()
        a = bound.arguments
        layout = layout_of(a["input"])
        if layout is None:
            raise SpatialError(f"{name}: the target is laid out over the grid but the input is not; pass the "
                               f"model's (spatial) output as the input")
        reduction = a["reduction"]
        if a.get("size_average") is not None or a.get("reduce") is not None:
            reduction = torch.nn._reduction.legacy_get_string(a["size_average"], a["reduce"])
            a["size_average"] = a["reduce"] = None
        for key in dense:
            a[key] = local_operand(a[key], layout, f"{name}'s {key}", broadcast=key != "target")
        a["input"], a["reduction"] = plain(a["input"]), "none"
        a = {k: plain(v) if isinstance(v, torch.Tensor) else v for k, v in a.items()}
        per = fn(**a)
        return _reduce(name, per, a, layout, reduction)

    loss.__name__ = name
    return loss


def _reduce(name: str, per: torch.Tensor, a: dict[str, Any], layout: Layout, reduction: str) -> torch.Tensor:
    """`per` (this rank's elementwise losses) reduced as `reduction` over the whole global tensor."""
    if reduction == "none":
        k = len(layout.dist.grid) if layout.kind == "block" else 0
        shape = (layout.shape[0], *per.shape[1:per.dim() - k], *layout.shape[len(layout.shape) - k:])
        return tag(per, Layout(layout.dist, layout.kind, shape))
    if reduction == "sum":
        return sum_once(per.sum(), layout)
    if reduction == "batchmean":  # kl_div: the sum over the global batch's samples
        return sum_once(per.sum(), layout) / layout.shape[0]
    if reduction != "mean":
        raise SpatialError(f"{name}: reduction {reduction!r} is not one of 'none', 'mean', 'sum'")
    both = sum_once(torch.stack([per.sum(), _denominator(name, per, a).to(per.dtype)]), layout)
    return both[0] / both[1]


def _denominator(name: str, per: torch.Tensor, a: dict[str, Any]) -> torch.Tensor:
    """This rank's part of the mean's denominator, exactly as torch divides on the whole tensor."""
    target: torch.Tensor = a["target"]
    weight: torch.Tensor | None = a.get("weight")
    if name in _CLASS_INDEX and not target.is_floating_point():
        kept: torch.Tensor = target != a["ignore_index"]
        if weight is None:
            return kept.sum()
        total: torch.Tensor = weight[target[kept]].sum()
        return total
    if name in _WEIGHTED_MEAN and weight is not None:
        return weight.sum()
    return torch.tensor(float(math.prod(per.shape)), device=per.device)


for _name in DENSE_LOSSES:
    register_spatial_function(_name, _spatial_loss(_name, getattr(F, _name)))
