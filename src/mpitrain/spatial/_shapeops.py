"""Shape and per-cell ops on blocks: whether they act locally, and where the spatial dims go.

A block's sample dim is dim 0 and its spatial dims sit at ``Layout.spatial_dims()`` (the trailing ones
unless a shape op moved them). An op acts on the block without communication when it keeps dim 0 and
every spatial dim whole (each moves, if at all, to a dim of its own): then each rank's result is its
block of the global result. The rules here are pure: given the op and the local block they return the
output's spatial positions, or None when the op mixes a split dim with another (that op redistributes).

* ``view``/``reshape``/``view_as``/``reshape_as``/``flatten``/``unflatten``: the target shape (the local
  sizes, as ``x.size()`` reports them — or the global sizes, mapped to the block's) keeps dim 0 and
  each spatial dim when the product of the dims before it is unchanged and its size is unchanged
  (channel shuffle's ``view(B, g, C/g, H, W)`` and back); merging or splitting a spatial dim is not
  local (``flatten(2)``). Kept dims are matched in order, each to the first fitting place (a block 1 x 1
  in H and W, viewed as N x g x C/g x 1 x 1, maps H and W to the last two dims).
* ``permute``/``transpose``/``swapaxes``/``swapdims``/``movedim``/``moveaxis`` that keep dim 0: the
  spatial dims are tracked wherever they go (ConvNeXt's channels-last blocks).
* ``squeeze``/``unsqueeze``, decided on the global shape (a block's size-1 dims are not the tensor's).
* ``chunk``/``split``/``tensor_split``/``unbind``/``narrow``/``select`` and basic indexing
  (``x[:, :c]``, ``x[:, 0]``) along dims other than 0 and the spatial ones; ``cat``/``stack`` of blocks
  of one layout along such a dim.
* per-cell ops along other dims: ``linear`` (the last dim), ``layer_norm`` (its trailing normalized
  dims), ``softmax``/``log_softmax``/``cumsum``/``cumprod``/``normalize``/``glu`` (their ``dim``), and
  reductions with an explicit ``dim`` (``sum``, ``mean``, ``amax``, ``max(x, dim)``, ``var``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["local_rule", "LOCAL_OPS"]

Dims = tuple[int, ...]

_VIEWS = frozenset(("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten"))
_PERMUTES = frozenset(("permute", "transpose", "swapaxes", "swapdims", "movedim", "moveaxis"))
_SPLITS = frozenset(("chunk", "split", "tensor_split", "unbind", "narrow", "select", "split_with_sizes"))
_DIM_KEEP = {"softmax": 1, "log_softmax": 1, "cumsum": 1, "cumprod": 1, "normalize": 2, "glu": 1}
_DIM_DEFAULTS = {"normalize": 1, "glu": -1}
_REDUCE = frozenset(("sum", "mean", "nansum", "nanmean", "amax", "amin", "logsumexp", "prod", "var", "std",
                     "argmax", "argmin", "max", "min", "all", "any", "count_nonzero"))
#: Names this module may keep local (checked before anything else in the dispatch).
LOCAL_OPS = _VIEWS | _PERMUTES | _SPLITS | frozenset(("squeeze", "unsqueeze", "cat", "concat", "concatenate",
                                                      "stack", "__getitem__", "linear", "layer_norm")) \
    | frozenset(_DIM_KEEP) | _REDUCE


def _norm(d: int, k: int) -> int:
    return d % k if -k <= d < k else -1


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return kwargs[name] if name in kwargs else args[i] if len(args) > i else default


def _ints(v: Any) -> list[int]:
    return [v] if isinstance(v, int) else list(v)


def map_view(src: Sequence[int], dst: Sequence[int], keep: Sequence[int]) -> Dims | None:
    """The positions in `dst` of the `keep` dims of `src` (dim 0 and the spatial ones) under a row-major
    reshape, or None when a kept dim would merge or split. A kept dim keeps its size and the product of
    the dims before it; kept dims of size 1 next to other size-1 dims are matched in order (a reshape
    never reorders dims), the first free place each."""
    out: dict[int, int] = {}
    last = -1
    for i in sorted(keep):
        before = math.prod(src[:i])
        j = next((j for j in range(last + 1, len(dst)) if dst[j] == src[i] and math.prod(dst[:j]) == before), None)
        if j is None:
            return None
        out[i], last = j, j
    return tuple(out[i] for i in keep)


def _target(name: str, x: torch.Tensor, args: tuple, kwargs: dict) -> list[int] | None:
    """The local target shape of a view-like op (``-1`` resolved), or None if not given by sizes."""
    shape = list(x.shape)
    if name in ("view_as", "reshape_as"):
        other = _arg(args, kwargs, 1, "other")
        return list(other.shape) if isinstance(other, torch.Tensor) else None
    if name == "flatten":
        k = max(x.dim(), 1)
        a, b = _norm(_arg(args, kwargs, 1, "start_dim", 0), k), _norm(_arg(args, kwargs, 2, "end_dim", -1), k)
        return shape[:a] + [math.prod(shape[a:b + 1])] + shape[b + 1:]
    if name == "unflatten":
        d, sizes = _norm(_arg(args, kwargs, 1, "dim"), x.dim()), list(_arg(args, kwargs, 2, "sizes"))
        if sizes.count(-1) == 1:
            sizes[sizes.index(-1)] = shape[d] // max(1, math.prod(s for s in sizes if s != -1))
        return shape[:d] + sizes + shape[d + 1:]
    given: tuple[Any, ...] = args[1:] if "shape" not in kwargs and "size" not in kwargs else (
        kwargs.get("shape", kwargs.get("size")),)
    if len(given) == 1 and isinstance(given[0], (tuple, list, torch.Size)):
        given = tuple(given[0])
    if not given or not all(isinstance(s, int) for s in given):
        return None  # view(dtype) and the like
    sizes = [int(s) for s in given]
    if sizes.count(-1) == 1:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = x.numel() // known if known else 0
    return sizes


def _view_rule(name: str, x: torch.Tensor, glob: Sequence[int], spatial: Dims, args: tuple, kwargs: dict
               ) -> tuple[Dims, tuple[Any, ...], dict] | None:
    """(output spatial dims, local args, kwargs) of a view-like op on a block, or None."""
    target = _target(name, x, args, kwargs)
    if target is None:
        return None
    keep = (0, *spatial)
    if math.prod(target) == x.numel():
        dims = map_view(list(x.shape), target, keep)
        return None if dims is None or dims[0] != 0 else (dims[1:], args, kwargs)
    mixed = list(x.shape)  # the block's samples, whole spatial dims: a target naming the global sizes
    for p in spatial:
        mixed[p] = glob[p]
    if name not in ("view", "reshape") or math.prod(target) != math.prod(mixed):
        return None
    dims = map_view(mixed, target, keep)
    if dims is None or dims[0] != 0:
        return None
    local = list(target)
    for i, j in zip(keep, dims):
        local[j] = x.shape[i]
    return dims[1:], (args[0], tuple(local)), {}


def _perm(name: str, k: int, args: tuple, kwargs: dict) -> list[int] | None:
    """The permutation (output dim i holds input dim perm[i]) of a permute-like op."""
    if name == "permute":
        dims = args[1:] if "dims" not in kwargs else (kwargs["dims"],)
        perm = _ints(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else list(dims)
        return [_norm(d, k) for d in perm]
    if name in ("transpose", "swapaxes", "swapdims"):
        a = _norm(_arg(args, kwargs, 1, "dim0"), k)
        b = _norm(_arg(args, kwargs, 2, "dim1"), k)
        perm = list(range(k))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    src = [_norm(d, k) for d in _ints(_arg(args, kwargs, 1, "source"))]
    dst = [_norm(d, k) for d in _ints(_arg(args, kwargs, 2, "destination"))]
    perm: list[int | None] = [None] * k  # type: ignore[no-redef]
    for s, d in zip(src, dst):
        perm[d] = s
    rest = iter(d for d in range(k) if d not in src)
    return [next(rest) if p is None else p for p in perm]


def _getitem(x: torch.Tensor, keep: Dims, index: Any) -> Dims | None:
    """The kept dims' positions after basic indexing `x[index]`, or None if it touches them."""
    idx = list(index) if isinstance(index, tuple) else [index]
    if any(not (i is None or i is Ellipsis or isinstance(i, (int, slice))) or isinstance(i, bool) for i in idx):
        return None  # advanced indexing (tensors, lists, bools)
    if idx.count(Ellipsis) > 1:
        return None
    used = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if Ellipsis in idx:
        at = idx.index(Ellipsis)
        idx[at:at + 1] = [slice(None)] * (x.dim() - used)
    idx += [slice(None)] * (x.dim() - sum(1 for i in idx if i is not None))
    out: dict[int, int] = {}
    d = o = 0
    for i in idx:
        if i is None:
            o += 1
            continue
        if d in keep and i != slice(None):
            return None
        if not isinstance(i, int):
            out[d] = o
            o += 1
        d += 1
    return tuple(out[d] for d in keep)


def _reduced(k: int, dims: Any, keepdim: bool, keep: Dims) -> Dims | None:
    if dims is None:
        return None
    red = {_norm(d, k) for d in _ints(dims)}
    if red & set(keep) or -1 in red:
        return None
    return keep if keepdim else tuple(p - sum(1 for r in red if r < p) for p in keep)


def local_rule(name: str, x: torch.Tensor, glob: Sequence[int], spatial: Dims, args: tuple, kwargs: dict
               ) -> tuple[Dims, tuple[Any, ...], dict] | None:
    """For the op `name` whose first block operand is `x` (local block of global shape `glob`, spatial
    dims at `spatial`): (the output's spatial dims, the args and kwargs to run it on the block with), or
    None when the op is not local. `cat`/`stack` are judged by the caller (several blocks)."""
    k, keep = x.dim(), (0, *spatial)
    if name in _VIEWS:
        return _view_rule(name, x, glob, spatial, args, kwargs)
    if name in _PERMUTES:
        perm = _perm(name, k, args, kwargs)
        if perm is None or -1 in perm or sorted(perm) != list(range(k)) or perm[0] != 0:
            return None
        return tuple(perm.index(s) for s in spatial), args, kwargs
    if name == "unsqueeze":
        d = _arg(args, kwargs, 1, "dim")
        d = d % (k + 1) if -(k + 1) <= d <= k else -1
        return (None if d <= 0 else (tuple(p + (p >= d) for p in spatial), args, kwargs))
    if name == "squeeze":
        dims = _arg(args, kwargs, 1, "dim")
        red = [d for d in range(k) if glob[d] == 1] if dims is None else [_norm(d, k) for d in _ints(dims)]
        red = [d for d in red if glob[d] == 1 and x.shape[d] == 1]  # squeeze skips dims of size > 1
        if set(red) & set(keep):
            return None
        return tuple(p - sum(1 for r in red if r < p) for p in spatial), (args[0], tuple(red)), {}
    if name in _SPLITS:
        d = _norm(_arg(args, kwargs, 1 if name in ("unbind", "narrow", "select") else 2, "dim", 0), k)
        if d in keep or d < 0:
            return None
        if name in ("unbind", "select"):
            return tuple(p - (p > d) for p in spatial), args, kwargs
        return spatial, args, kwargs
    if name == "__getitem__":
        dims = _getitem(x, keep, args[1])
        return None if dims is None or dims[0] != 0 else (dims[1:], args, kwargs)
    if name == "linear":
        return (spatial, args, kwargs) if k - 1 not in keep else None
    if name == "layer_norm":
        shape = _ints(_arg(args, kwargs, 1, "normalized_shape"))
        return (spatial, args, kwargs) if not set(range(k - len(shape), k)) & set(keep) else None
    if name in _DIM_KEEP:
        d = _arg(args, kwargs, _DIM_KEEP[name], "dim", _DIM_DEFAULTS.get(name))
        return (spatial, args, kwargs) if d is not None and _norm(d, k) not in keep and _norm(d, k) >= 0 else None
    if name in _REDUCE:
        dims = _arg(args, kwargs, 1, "dim")
        if isinstance(dims, torch.Tensor) or (name in ("max", "min") and not isinstance(dims, int)):
            return None  # max(a, b) is element-wise (judged elsewhere); max(x) reduces all
        keepdim = bool(_arg(args, kwargs, 3 if name in ("var", "std") else 2, "keepdim", False))
        dims_out = _reduced(k, dims, keepdim, keep)
        return None if dims_out is None else (dims_out[1:], args, kwargs)
    return None
