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
* any op on a replicated tensor runs as it is (every rank of the group computes the same result);
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
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ._reduce import allreduce_once, allreduce_sum

if TYPE_CHECKING:
    from .distribution import Distribution

__all__ = ["SpatialTensor", "Layout", "SpatialError", "NonSpatialOpError", "BlockExtent", "layout_of", "tag",
           "plain", "global_avg_pool", "register_spatial_function", "own_share", "count_once", "sum_once",
           "whole_size"]


class SpatialError(ValueError):
    """A spatial layer, distribution or shape cannot work; raised on every rank before any message."""


class NonSpatialOpError(SpatialError):
    """A non-spatial op met a block under ``nonspatial="error"`` (fit's loss on blocks falls back to whole
    samples on it)."""


@dataclass(frozen=True)
class Layout:
    """How a local tensor sits in the global one. ``kind="block"``: the N x C x (spatial) block of
    `dist`; ``kind="replicated"``: samples split over the groups, the rest replicated in each spatial
    group (e.g. after a global pool). `shape` is the global shape."""

    dist: Distribution
    kind: str
    shape: tuple[int, ...]


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

_ELEMENTWISE = frozenset("""
    add sub mul div true_divide floor_divide rsub neg negative abs pow exp log sqrt rsqrt reciprocal square
    sigmoid tanh relu relu6 hardtanh silu gelu elu selu celu leaky_relu hardswish hardsigmoid mish softplus
    softsign tanhshrink threshold clamp clip clamp_min clamp_max where maximum minimum lerp addcmul addcdiv
    dropout alpha_dropout feature_alpha_dropout contiguous clone detach to float double half bfloat16
    type_as zeros_like ones_like empty_like full_like rand_like randn_like copy_ fill_ zero_ masked_fill
    cat concat concatenate requires_grad_ retain_grad
    """.split())
_DUNDER_ARITH = frozenset(f"__{p}{op}__" for op in ("add", "sub", "mul", "truediv", "pow", "neg", "abs")
                          for p in ("", "r", "i"))
_QUERIES = frozenset("""
    __get__ grad size dim ndimension numel nelement stride is_contiguous data_ptr element_size storage_offset
    is_floating_point is_complex get_device __len__ __format__ __bool__ backward register_hook
    __reduce_ex__ __deepcopy__ __setstate__ untyped_storage _typed_storage __set__ __delete__
    """.split())
_CAT = frozenset(("cat", "concat", "concatenate"))


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


def _elementwise(name: str) -> bool:
    return name in _ELEMENTWISE or name in _DUNDER_ARITH or (name.endswith("_") and name[:-1] in _ELEMENTWISE)


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
    if name in _SPATIAL_FUNCTIONS:  # F.interpolate, the dense losses: they take replicated tensors too
        return _SPATIAL_FUNCTIONS[name](*args, **kwargs)
    if name in _REDUCTIONS and _whole_reduction(args, kwargs):
        return _reduce_whole(func, name, args, kwargs, layouts[0])
    if not blocks:  # whole samples replicated over the group: any op applies
        return _retag(_run(func, args, kwargs), layouts[0], "replicated")
    first = blocks[0]
    if name in ("adaptive_avg_pool2d", "adaptive_avg_pool3d") or (name == "mean" and _spatial_mean(args, kwargs)):
        return _global_pool_op(name, args, kwargs, first)
    if _elementwise(name) and _compatible(name, flat, args, kwargs, first):
        return _retag(_run(func, args, kwargs), first, "block")
    if _in_place(name):
        raise SpatialError(f"in-place {name} on a spatially split block has no spatial form (it would "
                           f"modify a redistributed copy); use an out-of-place op")
    return _redistribute_then(func, name, args, kwargs, first)


def _run(func: Any, args: tuple, kwargs: dict) -> Any:
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _retag(out: Any, layout: Layout, kind: str) -> Any:
    """Give every fresh tensor result the `kind` layout of `layout`'s samples; a result without the local
    sample dimension (a scalar reduction) leaves the layout: a plain tensor, which for a replicated
    result counts once (:func:`count_once`)."""
    local_n = layout.dist.local_samples(layout.shape[0])
    k = len(layout.dist.grid)

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() == 0 or t.shape[0] != local_n or (kind == "block" and t.dim() <= k):
            t = plain(t) if isinstance(t, SpatialTensor) else t
            if kind == "replicated":
                _refuse_group_value(layout.dist, "a value leaving a replicated tensor")
                return count_once(t, layout)
            return t
        if kind == "block":
            shape = (layout.shape[0], *t.shape[1:t.dim() - k], *layout.shape[len(layout.shape) - k:])
        else:
            shape = (layout.shape[0], *t.shape[1:])
        if isinstance(t, SpatialTensor) and t.placement.kind == kind and t.placement.shape == shape:
            return t
        return tag(t if type(t) is torch.Tensor else plain(t), Layout(layout.dist, kind, shape))

    return pytree.tree_map(one, out)


def _compatible(name: str, flat: list, args: tuple, kwargs: dict, first: Layout) -> bool:
    """Whether an element-wise op keeps `first`'s block layout: every block shares it (but channels),
    every other tensor broadcasts without extent along the split (sample and spatial) dimensions."""
    if name in _CAT:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if dim not in (1, 1 - len(first.shape)):
            return False
    local = None
    for t in flat:
        if not isinstance(t, torch.Tensor):
            continue
        lay = layout_of(t)
        k = len(first.dist.grid)
        if lay is not None and lay.kind == "block":
            if lay.dist is not first.dist or lay.shape[0] != first.shape[0] or lay.shape[-k:] != first.shape[-k:]:
                return False
            local = tuple(t.shape)
            continue
        if lay is not None and any(s != 1 for s in t.shape[max(0, t.dim() - k):]):
            return False  # whole samples against a block: the op must see the same cells
    return local is not None


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
        return dist.replicate(t) if lay is not None and lay.kind == "block" else t

    args, kwargs = pytree.tree_map(whole, (args, kwargs))
    return _retag(_run(func, args, kwargs), first, "replicated")


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


def _refuse_group_value(dist: Distribution, what: str) -> None:
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
    nd, k = len(lay.shape), len(lay.dist.grid)
    if plain(args[0]).dim() != nd:
        return out
    if isinstance(out, int):
        d = kwargs.get("dim", args[1] if len(args) > 1 else 0) % nd
        return BlockExtent(out, lay.shape[d]) if d >= nd - k else out
    return torch.Size([*out[:nd - k], *(BlockExtent(v, w) for v, w in zip(out[nd - k:], lay.shape[nd - k:]))])


def whole_size(size: Any) -> Any:
    """`size` (an int or a sequence of ints) with every :class:`BlockExtent` read as its whole extent."""
    if isinstance(size, BlockExtent):
        return size.whole
    if isinstance(size, (tuple, list)):
        return tuple(whole_size(v) for v in size)
    return size
