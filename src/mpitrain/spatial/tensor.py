"""The layout the framework carries: :class:`SpatialTensor`, a local block that knows its placement.

A parallelized model's activations are ``SpatialTensor`` objects: ordinary tensors (the local block,
autograd and kernels unchanged) whose :class:`Layout` names the distribution, whether the block is split
over the spatial grid (``"block"``) or holds whole samples replicated over the spatial group
(``"replicated"``), and the global shape. Its ``__torch_function__`` decides the layout of every result:

* element-wise and shape-preserving ops (arithmetic with broadcasting, activations, dropout, ``cat``
  along channels, clones, casts, in-place forms) keep the block layout. A plain tensor operand is
  local data (broadcast against the local block, e.g. a per-channel scale or a mask of the same
  block); a replicated operand must have 1x1 spatial extent (squeeze-and-excitation scales);
* a global average pool (``F.adaptive_avg_pool2d``, ``mean`` over H and W) sums each block and moves
  only the pooled vectors (one allreduce over the spatial group): the result is replicated;
* ``F.interpolate`` and the dense losses (``F.cross_entropy``, ...) run their spatial forms
  (:mod:`mpitrain.spatial.resample`, :mod:`mpitrain.spatial.loss`), on blocks and replicated tensors;
* a whole reduction (``x.sum()``, ``x.mean()``: no dim) reduces the whole global tensor: each rank its
  cells, one scalar allreduce; the plain result is the same on every rank;
* any op on a replicated tensor runs as it is (every rank of the group computes the same result); with
  one sample group its result stays replicated whatever its dim 0 (Swin's windows ``reshape(B * nW, ...)``
  stay whole samples). Under a sample x spatial grid a result whose dim 0 is no longer the group's
  samples becomes a ``"group"`` value: computed as a plain tensor, but refused (:class:`SpatialError`)
  where it meets a block with extent along the split dims, never taken as the block's local data;
* any other op on a block is not spatial (flatten, linear, reductions over H or W, ...): the block is
  redistributed to whole samples first, explicitly — a ``RuntimeWarning`` names the op once and
  ``Distribution.redistributions`` counts it — or, with ``Distribution(nonspatial="error")``, refused
  with :class:`SpatialError`. An unknown *in-place* op on a block is always refused (it would modify a
  copy). Queries (``shape``, ``size()``, ``dim()``) answer for the local block; along the split dims
  with :class:`BlockExtent` ints that remember the whole extent (``F.interpolate(size=x.shape[-2:])``).

One gradient rule: a value several ranks hold whole counts once (see "one gradient rule" below and
docs/spatial.md): the adjoint of whatever made it gives each rank its own part of the gradient, so the
gradient of a replicated tensor is held as shares over its spatial group.

Spatial layers (conv, pools, BN) take these tensors, compute on the plain local block and return a
``SpatialTensor`` again. A result is re-typed in place (``__class__``), never copied or aliased.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from ..comm.base import Communicator
from ..comm.place import Place
from ._exchange import SendQueue
from ._pointwise import is_pointwise
from ._reduce import allreduce_once, allreduce_sum
from ._shapeops import LOCAL_OPS, local_rule

__all__ = ["SpatialTensor", "Layout", "DistributionLike", "SpatialError", "NonSpatialOpError", "BlockExtent",
           "layout_of", "tag", "plain", "global_avg_pool", "register_spatial_function", "own_share", "count_once",
           "sum_once", "whole_size", "block_layout", "nchw", "to_nchw"]


class SpatialError(ValueError):
    """A spatial layer, distribution or shape cannot work; raised on every rank before any message."""


class NonSpatialOpError(SpatialError):
    """A non-spatial op met a block under ``nonspatial="error"`` (fit's loss on blocks falls back to whole
    samples on it)."""


class DistributionLike(Protocol):
    """What a :class:`Layout` and the ops on blocks use of the distribution a block belongs to:
    :class:`~mpitrain.spatial.distribution.Distribution` is the one implementation. A protocol, because
    distribution.py builds on this module (it makes SpatialTensors), so this module cannot import it
    (docs/ARCHITECTURE.md, Import rules); functions that take a block's ``layout.dist`` take this type."""

    #: set by fit while its loss runs on blocks (see ``Distribution.loss_on_blocks``)
    loss_on_blocks: bool

    @property
    def comm(self) -> Communicator: ...
    @property
    def place(self) -> Place: ...
    @property
    def grid(self) -> tuple[int, ...]: ...
    @property
    def samples(self) -> int: ...
    @property
    def per_sample(self) -> int: ...
    @property
    def group(self) -> int: ...
    @property
    def spatial_rank(self) -> int: ...
    @property
    def nonspatial(self) -> str: ...
    @property
    def redistributions(self) -> dict[str, int]: ...
    @property
    def sends(self) -> SendQueue: ...
    @property
    def spatial_comm(self) -> Communicator: ...
    @property
    def sample_comm(self) -> Communicator: ...
    def box(self, shape: tuple[int, ...], rank: int | None = None) -> tuple[tuple[int, int], ...]: ...
    def index(self, shape: tuple[int, ...], rank: int | None = None) -> tuple[slice, ...]: ...
    def local_samples(self, n: int) -> int: ...
    def check_shape(self, shape: tuple[int, ...], what: str = "tensor", *, dense: bool = False) -> None: ...
    def local_shape(self, shape: tuple[int, ...], rank: int | None = None) -> tuple[int, ...]: ...
    def replicate(self, t: torch.Tensor) -> torch.Tensor: ...
    def infer_layout(self, t: torch.Tensor) -> Layout: ...


@dataclass(frozen=True)
class Layout:
    """How a local tensor sits in the global one. ``kind="block"``: the N x C x (spatial) block of
    `dist`; ``kind="replicated"``: samples split over the groups, the rest replicated in each spatial
    group (e.g. after a global pool). `shape` is the global shape. ``kind="group"`` (a sample x spatial
    grid only): a value computed from one group's whole samples whose sample dim a shape op merged (Swin's
    window partition): a plain value counted once that must not meet a block as its local data; `shape`
    is its local shape."""

    dist: DistributionLike
    kind: str
    shape: tuple[int, ...]
    #: where a block's spatial dims sit (in grid order) when a shape op moved them (a permute to
    #: channels-last); None: the trailing dims (N x C x H x W, a channel shuffle's N x g x C/g x H x W)
    spatial: tuple[int, ...] | None = None

    def spatial_dims(self) -> tuple[int, ...]:
        """The positions of the spatial dims (the sample dim is always dim 0)."""
        if self.spatial is not None:
            return self.spatial
        k, g = len(self.shape), len(self.dist.grid)
        return tuple(range(k - g, k))


def block_layout(dist: DistributionLike, shape: tuple[int, ...], spatial: tuple[int, ...]) -> Layout:
    """A block layout of global `shape` with the spatial dims at `spatial` (stored as None when they are
    the trailing dims: one representation per layout)."""
    trailing = tuple(spatial) == tuple(range(len(shape) - len(dist.grid), len(shape)))
    return Layout(dist, "block", shape, None if trailing else tuple(spatial))


def nchw(layout: Layout) -> bool:
    """Whether a block is N x C x (spatial): the form spatial layers and the gathers take."""
    return layout.spatial is None and len(layout.shape) == 2 + len(layout.dist.grid)


class SpatialTensor(torch.Tensor):
    """A local block with its :class:`Layout` (``.placement``); see the module docstring for how ops treat
    it. Made by ``Distribution.scatter``, the spatial layers and :func:`tag`."""

    placement: Layout

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _dispatch(func, args, kwargs or {})

    def __repr__(self, *, tensor_contents: Any = None) -> Any:  # type: ignore[override]
        with torch._C.DisableTorchFunctionSubclass():
            local = torch.Tensor.__repr__(self)
        return f"SpatialTensor({self.placement.kind} of {self.placement.shape}, local={local})"


def layout_of(t: Any) -> Layout | None:
    """`t`'s layout, or None for anything but a :class:`SpatialTensor`."""
    return t.placement if isinstance(t, SpatialTensor) else None


def tag(t: torch.Tensor, layout: Layout) -> SpatialTensor:
    """`t` as a :class:`SpatialTensor` with `layout`: the same object, re-typed in place (no copy, no
    alias; autograd unchanged). Returns it."""
    if type(t) is not SpatialTensor:
        if type(t) is not torch.Tensor:
            raise SpatialError(f"cannot give a layout to a {type(t).__name__}")
        t.__class__ = SpatialTensor
    t.placement = layout  # type: ignore[attr-defined]
    return t  # type: ignore[return-value]


def plain(t: torch.Tensor) -> torch.Tensor:
    """The local block of `t` as a plain tensor (an alias on the autograd graph; `t` itself if plain)."""
    if type(t) is torch.Tensor:
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return t.as_subclass(torch.Tensor)


#: Functions with a spatial form of their own (``F.interpolate``), by name: called instead of the
#: torch function when a block is among the arguments. Filled by the modules that define them.
_SPATIAL_FUNCTIONS: dict[str, Callable[..., Any]] = {}


def register_spatial_function(name: str, fn: Callable[..., Any]) -> None:
    """Route the torch function called `name` to `fn` (same signature) when it gets a block."""
    _SPATIAL_FUNCTIONS[name] = fn


# --- op classes -------------------------------------------------------------------------------------

_QUERIES = frozenset("""
    __get__ grad size dim ndimension numel nelement stride is_contiguous data_ptr element_size storage_offset
    is_floating_point is_complex get_device __len__ __format__ __bool__ backward register_hook
    __reduce_ex__ __deepcopy__ __setstate__ untyped_storage _typed_storage __set__ __delete__
    """.split())
_CAT = frozenset(("cat", "concat", "concatenate", "stack"))


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or name == "__setitem__"


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    name = _name(func)
    flat, _ = pytree.tree_flatten((args, kwargs))
    layouts = [t.placement for t in flat if isinstance(t, SpatialTensor)]
    blocks = [lay for lay in layouts if lay.kind == "block"]
    if name in _QUERIES or not layouts:
        out = _run(func, args, kwargs)
        return _with_extents(func, name, args, out, kwargs) if blocks else out
    groups = [lay for lay in layouts if lay.kind == "group"]
    if groups:
        return _group_op(func, name, args, kwargs, groups[0], blocks[0] if blocks else None)
    if name in _SPATIAL_FUNCTIONS:  # F.interpolate, the dense losses: they take replicated tensors too
        return _SPATIAL_FUNCTIONS[name](*args, **kwargs)
    if name in _REDUCTIONS and _whole_reduction(args, kwargs):
        return _reduce_whole(func, name, args, kwargs, layouts[0])
    if not blocks:  # whole samples replicated over the group: any op applies
        return _retag(_run(func, *_whole_extents(args, kwargs)), layouts[0], "replicated")
    first = blocks[0]
    if nchw(first) and (name in ("adaptive_avg_pool2d", "adaptive_avg_pool3d")
                                  or (name == "mean" and _spatial_mean(args, kwargs))):
        return _global_pool_op(name, args, kwargs, first)
    out = _blockwise(func, name, args, kwargs, flat, first)
    if out is not _NOT_LOCAL:
        return out
    if _in_place(name):
        raise SpatialError(f"in-place {name} on a spatially split block has no spatial form (it would "
                           f"modify a redistributed copy); use an out-of-place op")
    return _redistribute_then(func, name, args, kwargs, first)


_NOT_LOCAL = object()


def _blockwise(func: Any, name: str, args: tuple, kwargs: dict, flat: list, first: Layout) -> Any:
    """The op run on the local blocks when that is its exact blockwise form (a shape op keeping the
    split dims whole, a per-cell op along other dims, a pointwise op); else ``_NOT_LOCAL``."""
    spatial = first.spatial_dims()
    if name in _CAT:
        dims = _cat_rule(name, args, kwargs, first)
        return _NOT_LOCAL if dims is None else _retag(_run(func, args, kwargs), first, "block", dims)
    x = args[0] if args else None
    if name in LOCAL_OPS and layout_of(x) is first:
        with torch._C.DisableTorchFunctionSubclass():
            rule = local_rule(name, x, first.shape, spatial, args, kwargs)  # type: ignore[arg-type]
        if rule is not None:
            dims, args, kwargs = rule
            return _retag(_run(func, args, kwargs), first, "block", dims)
    with torch._C.DisableTorchFunctionSubclass():
        pointwise = is_pointwise(func, name, args, kwargs) and _compatible(flat, first)
    return _retag(_run(func, args, kwargs), first, "block", spatial) if pointwise else _NOT_LOCAL


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _retag(out: Any, layout: Layout, kind: str, spatial: tuple[int, ...] | None = None) -> Any:
    """Give every fresh tensor result the `kind` layout of `layout`'s samples (a block: its spatial dims
    at `spatial`, of `layout`'s global sizes); a result without the local sample dimension (a scalar
    reduction) leaves the layout: a plain tensor, which for a replicated result counts once
    (:func:`count_once`)."""
    local_n = layout.dist.local_samples(layout.shape[0])
    sizes = [layout.shape[p] for p in layout.spatial_dims()] if kind == "block" else []
    spatial = layout.spatial_dims() if spatial is None else spatial
    # One sample group: every rank of the world holds the whole tensor, so a replicated result stays
    # replicated whatever its dim 0 (Swin's windows ``reshape(B * nW, ...)``): later ops keep reading
    # sizes as whole extents and meet blocks as whole samples, never as a block's local data.
    any_rows = kind == "replicated" and layout.dist.samples == 1

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() == 0 or (t.shape[0] != local_n and not any_rows) or (
                kind == "block" and t.dim() <= max(spatial)):
            t = plain(t) if isinstance(t, SpatialTensor) else t
            if kind == "replicated":
                _refuse_group_value(layout.dist, "a value leaving a replicated tensor")
                t = count_once(t, layout)
                return t if t.dim() == 0 else tag(t, Layout(layout.dist, "group", tuple(t.shape)))
            return t
        if kind == "block":
            shape = [layout.shape[0], *t.shape[1:]]
            for p, n in zip(spatial, sizes):
                shape[p] = n
            new = block_layout(layout.dist, tuple(shape), tuple(spatial))
        else:
            new = Layout(layout.dist, kind, (t.shape[0] if any_rows else layout.shape[0], *t.shape[1:]))
        if isinstance(t, SpatialTensor) and t.placement == new:
            return t
        return tag(t if type(t) is torch.Tensor else plain(t), new)

    return pytree.tree_map(one, out)


def _group_op(func: Any, name: str, args: tuple, kwargs: dict, group: Layout, block: Layout | None) -> Any:
    """An op on a ``"group"`` value (whole samples of one sample group whose sample dim a shape op merged,
    under a sample x spatial grid: Swin's windows ``reshape(B * nW, ...)``): it runs as on a plain tensor
    (which it is, counted once) and its tensor results stay group values. Against a block, such a value
    is whole data, not the block's: it may only broadcast without extent along the split dims; anything
    else has no exact form (it cannot be matched to the block's cells) and is refused, never silently
    taken as the block's local data."""
    flat, _ = pytree.tree_flatten((args, kwargs))
    if block is not None:
        k, dims = len(block.shape), block.spatial_dims()
        for t in flat:
            lay = layout_of(t)
            if lay is not None and lay.kind == "group" and not _no_extent(t, k, dims):
                raise SpatialError(
                    f"spatial: {name} combines a block split over grid {block.dist.grid} with a "
                    f"{tuple(t.shape)} value computed from whole samples after a reshape merged their sample "
                    f"dim (e.g. window attention's reshape(B * windows, ...)); under {block.dist.samples} "
                    f"sample groups it has no exact spatial form. Train it with samples=1 (a spatial grid "
                    f"over all ranks) or on whole samples (strategy='data')")
    def ungroup(t: Any) -> Any:
        lay = layout_of(t)
        return plain(t) if lay is not None and lay.kind == "group" else t

    args, kwargs = pytree.tree_map(ungroup, (args, kwargs))
    others = any(layout_of(t) is not None for t in pytree.tree_flatten((args, kwargs))[0])
    out = _dispatch(func, args, kwargs) if others else _run(func, args, kwargs)

    def one(t: Any) -> Any:
        if type(t) is torch.Tensor and t.dim() > 0:
            return tag(t, Layout(group.dist, "group", tuple(t.shape)))
        return t
    return pytree.tree_map(one, out)


def _same_block(lay: Layout, first: Layout) -> bool:
    """Whether block `lay` splits its tensor as `first` does (channels and other dims may differ)."""
    dims = first.spatial_dims()
    return (lay.dist is first.dist and lay.shape[0] == first.shape[0] and lay.spatial_dims() == dims
            and len(lay.shape) == len(first.shape) and all(lay.shape[p] == first.shape[p] for p in dims))


def _compatible(flat: list, first: Layout) -> bool:
    """Whether a pointwise op keeps `first`'s block layout: every block shares it (but channels), every
    replicated operand broadcasts without extent along the spatial dims; a plain tensor operand is
    local data (a per-channel scale, a mask of this block)."""
    k, dims = len(first.shape), first.spatial_dims()
    for t in flat:
        if not isinstance(t, torch.Tensor):
            continue
        lay = layout_of(t)
        if t.dim() > k or (lay is not None and lay.kind == "block" and not _same_block(lay, first)):
            return False
        if lay is not None and lay.kind != "block" and not _no_extent(t, k, dims):
            return False  # whole samples against a block: must be 1x1 there
    return True


def _no_extent(t: torch.Tensor, k: int, dims: tuple[int, ...]) -> bool:
    """Whether `t`, broadcast against a `k`-dim block with spatial dims `dims`, has size 1 (or no dim)
    along every one of them."""
    offset = k - t.dim()
    return t.dim() <= k and all(p - offset < 0 or t.shape[p - offset] == 1 for p in dims)


def _cat_rule(name: str, args: tuple, kwargs: dict, first: Layout) -> tuple[int, ...] | None:
    """The spatial dims of ``cat``/``stack`` of blocks of one layout along another dim, or None."""
    tensors = _first_arg(args, kwargs, "tensors")
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    k = len(first.shape)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    for t in tensors:
        lay = layout_of(t)
        if not isinstance(t, torch.Tensor) or t.dim() != k or (lay is not None and not (
                lay.kind == "block" and _same_block(lay, first))):
            return None
    spatial = first.spatial_dims()
    if name != "stack":
        return None if dim % k in (0, *spatial) or not -k <= dim < k else spatial
    d = dim % (k + 1) if -(k + 1) <= dim <= k else 0
    return None if d == 0 else tuple(p + (p >= d) for p in spatial)


def _first_arg(args: tuple, kwargs: dict, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[0] if args else None


def _spatial_mean(args: tuple, kwargs: dict) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    x = args[0]
    if dim is None or not isinstance(x, torch.Tensor):
        return False
    dims = {d % x.dim() for d in ((dim,) if isinstance(dim, int) else dim)}
    return dims == set(range(2, x.dim()))


def _global_pool_op(name: str, args: tuple, kwargs: dict, layout: Layout) -> SpatialTensor:
    x = args[0]
    if name == "mean":
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        y = global_avg_pool(x, (1,) * (x.dim() - 2))
        if keep:
            return y
        return tag(plain(y).flatten(2).squeeze(2), Layout(layout.dist, "replicated", y.placement.shape[:2]))
    size = kwargs.get("output_size", args[1] if len(args) > 1 else None)
    nd = x.dim() - 2
    size = (size,) * nd if isinstance(size, int) else tuple(size)  # type: ignore[arg-type]
    return global_avg_pool(x, size)


def _membership(n: int, out: int, lo: int, hi: int, like: torch.Tensor) -> torch.Tensor:
    """(out, hi-lo) 0/1 matrix: global cell lo+k is in adaptive window
    i = [floor(i*n/out), ceil((i+1)*n/out))."""
    m = like.new_zeros((out, hi - lo))
    for i in range(out):
        a, b = (i * n) // out, -((-(i + 1) * n) // out)
        a, b = max(a, lo), min(b, hi)
        if b > a:
            m[i, a - lo:b - lo] = 1.0
    return m


def global_avg_pool(x: torch.Tensor, output_size: tuple[int, ...]) -> SpatialTensor:
    """Adaptive average pool of the whole (distributed) sample to `output_size`: each rank sums its
    cells into every output window, one allreduce over the spatial group completes the sums; the
    result is replicated over the group. Collective over the spatial group; differentiable."""
    layout = layout_of(x)
    if layout is None:
        raise SpatialError("global_avg_pool needs a SpatialTensor")
    if any(s is None for s in output_size):
        raise SpatialError("a spatial adaptive average pool needs an explicit output size (no None)")
    local = plain(x)
    if layout.kind == "replicated":
        pool = torch.nn.functional.adaptive_avg_pool2d if local.dim() == 4 else torch.nn.functional.adaptive_avg_pool3d
        return tag(pool(local, output_size), layout)  # type: ignore[arg-type]
    dist = layout.dist
    box = dist.box(layout.shape)[1:]
    mats = [_membership(n, o, a, b, local) for n, o, (a, b) in zip(layout.shape[2:], output_size, box)]
    letters = "hwd"[:len(mats)] if len(mats) == 2 else "dhw"
    outs = "ijk"[:len(mats)]
    spec = ",".join(f"{o}{s}" for o, s in zip(outs, letters))
    partial = torch.einsum(f"nc{letters},{spec}->nc{outs}", local, *mats)
    total = allreduce_sum(partial, dist.spatial_comm)
    area = local.new_ones(())
    for n, o in zip(layout.shape[2:], output_size):
        area = area[..., None] * _membership(n, o, 0, n, local).sum(1)
    y = total / area
    return tag(y, Layout(dist, "replicated", (layout.shape[0], *y.shape[1:])))


def _redistribute_then(func: Any, name: str, args: tuple, kwargs: dict, first: Layout) -> Any:
    dist = first.dist
    _refuse_group_value(dist, name)
    if dist.per_sample == 1:  # a 1x1 grid: the block already is this group's whole samples
        args, kwargs = pytree.tree_map(_local, (args, kwargs))
        return _retag(_run(func, args, kwargs), first, "replicated")
    if dist.nonspatial == "error":
        raise NonSpatialOpError(f"{name} is not a spatial op and cannot run on a block split over grid "
                           f"{dist.grid}; use a global pool before it or Distribution(nonspatial='replicate')")
    if name not in dist.redistributions:
        warnings.warn(f"spatial: {name} is not a spatial op; its {first.shape} input is redistributed to "
                      f"whole samples (one allgather over the spatial group) before it runs",
                      RuntimeWarning, stacklevel=3)
    dist.redistributions[name] = dist.redistributions.get(name, 0) + 1

    def whole(t: Any) -> Any:
        lay = layout_of(t)
        if lay is None or lay.kind != "block":
            return t
        canonical, restore = to_nchw(t)
        return restore(dist.replicate(canonical))

    args, kwargs = pytree.tree_map(whole, _whole_extents(args, kwargs))
    return _retag(_run(func, args, kwargs), first, "replicated")


def _whole_extents(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args`, `kwargs` with every :class:`BlockExtent` (also in slices and sizes) read as its whole extent:
    an op on whole samples (replicated, or redistributed) means the whole tensor's sizes that the model
    read from a block's ``x.shape`` (Swin's ``x[:, :H, :W]`` crop after its padding redistributed)."""
    def one(v: Any) -> Any:
        if isinstance(v, BlockExtent):
            return v.whole
        if isinstance(v, slice):
            return slice(one(v.start), one(v.stop), one(v.step))
        if isinstance(v, torch.Size):
            return torch.Size(whole_size(v))
        return v

    out: tuple[tuple, dict] = pytree.tree_map(one, (args, kwargs))
    return out


def _local(t: Any) -> Any:
    return plain(t) if isinstance(t, SpatialTensor) else t


# --- one gradient rule ------------------------------------------------------------------------------
# A value that several ranks hold whole (a gathered tensor, a redistributed or replicated one, a sum over
# ranks) counts once: every rank computes the same loss from it, so the adjoint of whatever made it gives
# each rank only its own part of the (identical) gradient, never a sum over the ranks holding it. The
# gradient of a replicated SpatialTensor is therefore held as shares over its spatial group (summed where
# it came from blocks: the redistribution's and the global pool's adjoints); a value leaving the layout
# turns its whole gradient into shares here.

def own_share(g: torch.Tensor, layout: Layout) -> torch.Tensor:
    """This rank's part of `g`, the gradient of a value its whole spatial group holds (the group's
    samples, every cell) made from a tensor of `layout`: its own block of `g` for a block, all of `g` at
    spatial rank 0 and zero at the others for a replicated tensor (whose gradient is held as shares)."""
    dist = layout.dist
    if layout.kind == "block":
        return g[(slice(None), *dist.index(layout.shape)[1:])].contiguous()
    return g.contiguous() if dist.spatial_rank == 0 else torch.zeros_like(g)


class _CountOnce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, keep: bool) -> torch.Tensor:
        ctx.keep = keep
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (g if ctx.keep else torch.zeros_like(g)), None


def _refuse_group_value(dist: DistributionLike, what: str) -> None:
    """While fit's loss runs on blocks (``dist.loss_on_blocks``), refuse what would make a value of one
    sample group only (fit then computes the loss on whole samples)."""
    if dist.loss_on_blocks:
        raise NonSpatialOpError(f"{what} is not a spatial op: its result would hold one sample group's samples")


def count_once(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """`t`, a plain value computed alike on every rank of the spatial group from a replicated tensor of
    `layout` (a loss on the group's samples), as a value that counts once: its gradient, the same on
    every rank, becomes shares (spatial rank 0 keeps it)."""
    if not t.requires_grad or layout.dist.per_sample == 1:
        return t
    out: torch.Tensor = _CountOnce.apply(t, layout.dist.spatial_rank == 0)
    return out


def sum_once(t: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The sum over the whole global tensor of this rank's partial sum `t` of a tensor of `layout` (a
    block: its cells; replicated: its group's samples), on every rank, counting once. Collective over
    the world (a block) or the ranks of this grid position (replicated)."""
    dist = layout.dist
    if layout.kind == "block":
        return allreduce_once(t, dist.comm)
    if dist.samples == 1:
        return count_once(t, layout)
    return allreduce_once(t, dist.sample_comm, keep=dist.spatial_rank == 0)


# --- whole reductions: x.sum(), x.mean() of the global tensor ---------------------------------------------

_REDUCTIONS = frozenset(("sum", "nansum", "mean"))


def _whole_reduction(args: tuple, kwargs: dict) -> bool:
    """``x.sum()``, ``torch.mean(x, dtype=...)``: no dimension named."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return (dim is None or isinstance(dim, torch.dtype)) and layout_of(args[0]) is not None


def _reduce_whole(func: Any, name: str, args: tuple, kwargs: dict, layout: Layout) -> torch.Tensor:
    """The sum (mean) of every cell of the global tensor `args[0]` stands for: each rank sums its own
    cells, one allreduce of a scalar; the result is plain, on every rank, and counts once."""
    x = args[0]
    lay = layout_of(x)
    assert lay is not None
    dtype = kwargs.get("dtype", args[1] if len(args) > 1 else None)
    local = _run(torch.nansum if name == "nansum" else torch.sum, (plain(x),), {"dtype": dtype})
    if name == "mean" and not (local.is_floating_point() or local.is_complex()):
        raise SpatialError(f"mean of a {local.dtype} tensor: give a floating dtype (as torch.mean requires)")
    total = sum_once(local, lay)
    return total / math.prod(lay.shape) if name == "mean" else total


# --- shape queries: local sizes that know the whole extent -----------------------------------------------

class BlockExtent(int):
    """A block's local size along a dimension the grid splits, as ``x.shape`` and ``x.size()`` of a block
    answer (an int: views and reshapes act on the local block), remembering the whole tensor's size
    there (`whole`), so that ``F.interpolate(y, size=x.shape[-2:])`` resizes `y` to `x`'s whole extent,
    as a model written for whole tensors means it."""

    whole: int

    def __new__(cls, local: int, whole: int) -> BlockExtent:
        out = super().__new__(cls, local)
        out.whole = whole
        return out

    def __getnewargs__(self) -> tuple[int, int]:  # type: ignore[override]
        return int(self), self.whole


_SHAPE = torch._C.TensorBase.__dict__["shape"]


def _with_extents(func: Any, name: str, args: tuple, out: Any, kwargs: dict) -> Any:
    """A block's ``shape`` / ``size()`` / ``size(d)`` with :class:`BlockExtent` along the split dims."""
    if not (name == "size" or (name == "__get__" and getattr(func, "__self__", None) is _SHAPE)):
        return out
    lay = layout_of(args[0])
    if lay is None or lay.kind != "block":
        return out
    nd, dims = len(lay.shape), lay.spatial_dims()
    if plain(args[0]).dim() != nd:
        return out
    if isinstance(out, int):
        d = kwargs.get("dim", args[1] if len(args) > 1 else 0) % nd
        return BlockExtent(out, lay.shape[d]) if d in dims else out
    return torch.Size([BlockExtent(v, lay.shape[d]) if d in dims else v for d, v in enumerate(out)])


def whole_size(size: Any) -> Any:
    """`size` (an int or a sequence of ints) with every :class:`BlockExtent` read as its whole extent."""
    if isinstance(size, BlockExtent):
        return size.whole
    if isinstance(size, (tuple, list)):
        return tuple(whole_size(v) for v in size)
    return size
def to_nchw(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Block `t` as an N x C x (spatial) block (its other dims permuted before the spatial ones and
    merged into C; `t` itself when already so) and the function that takes a tensor laid out like that
    block — or whole samples of it — back to `t`'s dim order (a replicated result keeps its layout with
    `t`'s other dims and global sizes). Local; differentiable."""
    lay = layout_of(t)
    if lay is None or lay.kind != "block" or nchw(lay):
        return t, lambda y: y
    spatial, k = lay.spatial_dims(), t.dim()
    others = [d for d in range(1, k) if d not in spatial]
    perm = [0, *others, *spatial]
    inverse = [perm.index(d) for d in range(k)]
    sizes = [int(t.shape[d]) for d in others]
    channels = math.prod(sizes)
    local = plain(t).permute(perm)
    local = local.reshape(local.shape[0], channels, *local.shape[len(others) + 1:])
    canonical = tag(local, Layout(lay.dist, "block", (lay.shape[0], channels, *(lay.shape[p] for p in spatial))))

    def restore(y: torch.Tensor) -> torch.Tensor:
        out = plain(y).reshape(y.shape[0], *sizes, *y.shape[2:]).permute(inverse)
        ylay = layout_of(y)
        if ylay is not None and ylay.kind == "replicated":
            return tag(out, Layout(lay.dist, "replicated", (ylay.shape[0], *lay.shape[1:])))
        return out

    return canonical, restore
