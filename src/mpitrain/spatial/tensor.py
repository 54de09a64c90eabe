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
* ``F.interpolate`` runs its spatial form (:mod:`mpitrain.spatial.resample`);
* any op on a replicated tensor runs as it is (every rank of the group computes the same result);
* any other op on a block is not spatial (flatten, linear, reductions over H or W, ...): the block is
  redistributed to whole samples first, explicitly — a ``RuntimeWarning`` names the op once and
  ``Distribution.redistributions`` counts it — or, with ``Distribution(nonspatial="error")``, refused
  with :class:`SpatialError`. An unknown *in-place* op on a block is always refused (it would modify a
  copy). Queries (``shape``, ``size()``, ``dim()``) answer for the local block.

Spatial layers (conv, pools, BN) take these tensors, compute on the plain local block and return a
``SpatialTensor`` again. A result is re-typed in place (``__class__``), never copied or aliased.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ._reduce import allreduce_sum

if TYPE_CHECKING:
    from .distribution import Distribution

__all__ = ["SpatialTensor", "Layout", "SpatialError", "layout_of", "tag", "plain", "global_avg_pool",
           "register_spatial_function"]


class SpatialError(ValueError):
    """A spatial layer, distribution or shape cannot work; raised on every rank before any message."""


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
        return _run(func, args, kwargs)
    if not blocks:  # whole samples replicated over the group: any op applies
        return _retag(_run(func, args, kwargs), layouts[0], "replicated")
    first = blocks[0]
    if name in _SPATIAL_FUNCTIONS:
        return _SPATIAL_FUNCTIONS[name](*args, **kwargs)
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
    sample dimension (a scalar reduction) stays plain."""
    local_n = None

    def one(t: Any) -> Any:
        nonlocal local_n
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] != layout.dist.local_samples(layout.shape[0]):
            return plain(t) if isinstance(t, SpatialTensor) else t
        if kind == "block":
            shape = (layout.shape[0], t.shape[1], *layout.shape[2:])
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
        if lay is not None and lay.kind == "block":
            if lay.dist is not first.dist or lay.shape[0] != first.shape[0] or lay.shape[2:] != first.shape[2:]:
                return False
            local = tuple(t.shape)
            continue
        if lay is not None and any(s != 1 for s in t.shape[max(0, t.dim() - (len(first.shape) - 2)):]):
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
    if dist.per_sample == 1:  # a 1x1 grid: the block already is this group's whole samples
        args, kwargs = pytree.tree_map(_local, (args, kwargs))
        return _retag(_run(func, args, kwargs), first, "replicated")
    if dist.nonspatial == "error":
        raise SpatialError(f"{name} is not a spatial op and cannot run on a block split over grid "
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
