"""Which torch calls are element-wise ("pointwise"), decided by torch's own operator tags.

A call is pointwise when the aten overload it resolves to carries ``torch.Tag.pointwise`` and returns
tensors (``equal``, tagged too, returns one bool): the
``__torch_function__`` func's name (``sin``, ``__radd__`` -> ``add``, ``special_erf``) names an aten
packet, and ``torch._C._jit_resolve_packet`` picks the overload the arguments select, so that
``torch.max(a, b)`` (``max.other``, pointwise) stays local while ``torch.max(x, 1)`` (``max.dim``, a
reduction) does not. Calls that resolve to no tagged overload — Python composites (``F.softsign``),
aliases without tags (``torch.special.expit``), untagged overloads of pointwise packets
(``where.ScalarOther``, ``masked_fill.Tensor``) — are traced once on small stand-ins: pointwise when
every aten op they run is tagged pointwise or only moves values (casts, copies, fills) and the result
has the operands' broadcast shape. The verdict is cached per (func, argument kinds).

torch leaves a few element-wise ops untagged and opaque to that trace (single kernels without a
tag); :data:`UNTAGGED` names them, with the random ones (dropout: each rank draws its own mask, so
masks differ from one process's whether or not the block moves) and the value-preserving tensor
methods (``to``, ``clone``, ``zeros_like``, ...), which are cheaper to name than to trace.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload, OpOverloadPacket
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["is_pointwise", "UNTAGGED"]

#: Element-wise in effect, but not recognised by the tag rule (see the module docstring).
UNTAGGED = frozenset("""
    hardswish hardswish_ floor_divide floor_divide_ log_sigmoid rrelu rrelu_
    dropout dropout_ alpha_dropout alpha_dropout_ feature_alpha_dropout
    contiguous clone detach detach_ to float double half bfloat16 type_as zeros_like ones_like empty_like
    full_like rand_like randn_like copy_ fill_ zero_ requires_grad_ retain_grad cpu cuda
    """.split())

#: Tensor dunders and the aten packet each resolves to (the reflected forms take the same arguments).
_DUNDERS = {
    **{f"__{p}{op}__": aten for op, aten in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"),
                                             ("div", "div"), ("floordiv", "floor_divide"), ("mod", "remainder"),
                                             ("pow", "pow"), ("and", "bitwise_and"), ("or", "bitwise_or"),
                                             ("xor", "bitwise_xor"), ("lshift", "bitwise_left_shift"),
                                             ("rshift", "bitwise_right_shift")) for p in ("", "r")},
    **{f"__i{op}__": f"{aten}_" for op, aten in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("truediv", "div"),
                                                 ("div", "div"), ("floordiv", "floor_divide"), ("mod", "remainder"),
                                                 ("pow", "pow"), ("and", "bitwise_and"), ("or", "bitwise_or"),
                                                 ("xor", "bitwise_xor"), ("lshift", "bitwise_left_shift"),
                                                 ("rshift", "bitwise_right_shift"))},
    "__rsub__": "rsub", "__neg__": "neg", "__pos__": "positive", "__abs__": "abs", "__invert__": "bitwise_not",
    "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge",
}

#: aten ops a traced composite may run besides pointwise ones: they move values, never mix cells.
_VALUE_MOVES = frozenset("""
    _to_copy clone copy_ detach alias lift_fresh lift_fresh_copy empty_like zeros_like ones_like full_like
    fill_ zero_ scalar_tensor _local_scalar_dense empty expand
    """.split())

_CACHE: dict[Any, bool] = {}


def _packet(name: str) -> OpOverloadPacket | None:
    try:
        packet = getattr(torch.ops.aten, _DUNDERS.get(name, name))
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, OpOverloadPacket) else None


def _key(func: Any, args: tuple, kwargs: dict) -> Any:
    """What the verdict may depend on: the func and each argument's kind (a tensor by rank and dtype, a
    number by type — a scale that changes every step must not grow the cache —, anything else by value
    when hashable)."""
    def kind(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return ("T", a.dim(), a.dtype)
        if isinstance(a, (int, float, complex)) and not isinstance(a, bool):
            return type(a)
        try:
            hash(a)
        except TypeError:
            return type(a)
        return a
    flat, spec = pytree.tree_flatten((args, kwargs))
    return func, str(spec), tuple(kind(a) for a in flat)


def is_pointwise(func: Any, name: str, args: tuple, kwargs: dict) -> bool:
    """Whether calling `func` (named `name`) on `args`, `kwargs` is element-wise: every output cell
    depends only on the operands' cells at the same (broadcast) index. Cached; no message."""
    if name in UNTAGGED or (name.endswith("_") and name[:-1] in UNTAGGED):
        return True
    if isinstance(func, OpOverload):
        return _tensor_pointwise(func)
    key = _key(func, args, kwargs)
    verdict = _CACHE.get(key)
    if verdict is None:
        verdict = _CACHE[key] = _tagged(name, args, kwargs) or _traced(func, args, kwargs)
    return verdict


def _tagged(name: str, args: tuple, kwargs: dict) -> bool:
    packet = _packet(name)
    if packet is None:
        return False
    if _all_pointwise(packet):  # nothing to resolve (and F.elu's Python signature would not resolve)
        return True
    try:
        overload = torch._C._jit_resolve_packet(packet._qualified_op_name, *args, **kwargs)
    except RuntimeError:  # no overload takes these arguments (a Python-level signature): trace it
        return False
    return _tensor_pointwise(getattr(packet, overload))


def _all_pointwise(packet: OpOverloadPacket) -> bool:
    """Every overload of `packet` but its ``out=`` forms is pointwise (cached by the caller's cache)."""
    ops = [getattr(packet, o) for o in packet.overloads()]
    return all(_tensor_pointwise(op) for op in ops
               if not any(a.kwarg_only and a.is_out for a in op._schema.arguments))


def _tensor_pointwise(op: OpOverload) -> bool:
    """Tagged pointwise and returning tensors (``equal``, tagged too, returns one bool: a reduction)."""
    return torch.Tag.pointwise in op.tags and all(str(r.type) == "Tensor" for r in op._schema.returns)


class _Recorder(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # else torch wraps __torch_dispatch__ in dynamo.disable: a seconds-long import at first use

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpOverload] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _broadcast(shapes: list[torch.Size]) -> tuple[int, ...]:
    """numpy broadcasting (torch.broadcast_shapes imports torch.fx's symbolic shapes, a second)."""
    k = max((len(s) for s in shapes), default=0)
    out = [1] * k
    for s in shapes:
        for i, n in enumerate(s, k - len(s)):
            if n != 1 and out[i] not in (1, n):
                raise ValueError(f"shapes {shapes} do not broadcast")
            out[i] = n if n != 1 else out[i]
    return tuple(out)


def _traced(func: Any, args: tuple, kwargs: dict) -> bool:
    """Run `func` once on small CPU stand-ins of the operands (each dim of size > 1 cut to 2: the same
    broadcasting; not meta tensors, whose Python kernels import torch._dynamo, seconds) and judge the
    aten ops it ran."""
    def small(a: Any) -> Any:
        if not isinstance(a, torch.Tensor):
            return a
        return torch.zeros([min(n, 2) for n in a.shape], dtype=a.dtype)
    sargs, skwargs = pytree.tree_map(small, (args, kwargs))
    shapes = [a.shape for a in pytree.tree_leaves((sargs, skwargs)) if isinstance(a, torch.Tensor)]
    try:
        with torch._C.DisableTorchFunctionSubclass(), torch.no_grad(), torch.random.fork_rng(devices=[]), \
                _Recorder() as rec:  # fork_rng: a random op traced here leaves the rank's stream as it was
            out = func(*sargs, **skwargs)
        expected = _broadcast(shapes)
    except Exception:  # operands that do not broadcast, or an op that refuses them: not known pointwise
        return False
    ops_ok = all(_tensor_pointwise(op) or op.__name__.split(".")[0] in _VALUE_MOVES for op in rec.ops)
    return bool(rec.ops) and ops_ok and isinstance(out, torch.Tensor) and tuple(out.shape) == expected
