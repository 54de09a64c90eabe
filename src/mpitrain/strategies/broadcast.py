"""Making replicas equal: broadcast of parameters, buffers and optimizer state from one rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..comm.base import Communicator
from ..runtime import world

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_tensors", "check_same_everywhere",
           "module_tensors"]


def check_same_everywhere(comm: Communicator, what: str, signature: object,
                          error: type[ValueError] = ValueError) -> None:
    """Collective: raise `error` on every rank unless every rank passed an equal `signature`.

    One pickled allgather; the message names the ranks that differ from rank 0 and the first entry
    that differs, so a setup mistake fails before any tensor is sent."""
    sigs = comm.allgather_object(signature)
    bad = [r for r, s in enumerate(sigs) if s != sigs[0]]
    if not bad:
        return
    detail = ""
    first, other = sigs[0], sigs[bad[0]]
    if isinstance(first, (list, tuple)) and isinstance(other, (list, tuple)):
        diff = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b), min(len(first), len(other)))
        a = first[diff] if diff < len(first) else "<missing>"
        b = other[diff] if diff < len(other) else "<missing>"
        detail = (f"; entry {diff}: rank 0 has {a!r}, rank {bad[0]} has {b!r} "
                  f"(lengths {len(first)}/{len(other)})")
    raise error(f"{what}: ranks {bad} disagree with rank 0{detail}")


def broadcast_tensors(tensors: list[torch.Tensor], comm: Communicator, root: int = 0) -> None:
    """Overwrite every tensor with root's, in place; one fused broadcast per dtype/device.

    Collective over `comm`: every rank passes tensors of the same shapes and dtypes in the same order.
    A lone contiguous tensor is broadcast in place; otherwise a flat buffer costs one copy each way.
    """
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        if len(ts) == 1 and ts[0].is_contiguous():
            comm.broadcast(ts[0], root)
            continue
        flat = torch.cat([t.reshape(-1) for t in ts])
        comm.broadcast(flat, root)
        if comm.rank != root:
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        return [(str(k), v) for k, v in params.items()]
    out = []
    for i, item in enumerate(params):
        name, t = item if isinstance(item, tuple) else (str(i), item)
        out.append((str(name), t))
    return out


@torch.no_grad()
def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int = 0,
                         comm: Communicator | None = None) -> None:
    """Overwrite, in place, every tensor of `params` with `root_rank`'s (Horovod's name).

    `params` is a ``state_dict()``, ``named_parameters()`` or a plain iterable of tensors. Collective:
    every rank must call it with the same names, shapes and dtypes, otherwise every rank raises
    ValueError naming the first difference, before any tensor is sent.
    """
    comm = comm or world()
    comm._check_rank(root_rank, "root_rank")
    items = _named(params)
    check_same_everywhere(comm, "broadcast_parameters: parameter names/shapes/dtypes",
                          [(n, tuple(t.shape), str(t.dtype)) for n, t in items])
    broadcast_tensors([t.detach() for _, t in items], comm, root_rank)


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """`obj` with every tensor replaced by a (shape, dtype, index) placeholder appended to `tensors`."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Placeholder(tuple(obj.shape), str(obj.dtype).removeprefix("torch."), len(tensors) - 1)
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Placeholder):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fill(v, tensors) for v in obj)
    return obj


class _Placeholder(NamedTuple):
    """Where a tensor was in a stripped state dict: its shape, dtype name and index in the tensor list."""

    shape: tuple[int, ...]
    dtype_name: str
    index: int

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)


@torch.no_grad()
def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              comm: Communicator | None = None) -> None:
    """Make every rank's optimizer state and hyper-parameters (lr, momentum buffers, steps) root's.

    Collective over `comm`; the optimizers must manage parameters of the same shapes in the same
    groups (checked first, raising ValueError on every rank). Root's ``state_dict`` structure travels
    pickled once (no tensor data); its tensors travel as fused broadcasts, then every other rank
    loads it with ``load_state_dict`` (so the state tensors are placed like the parameters).
    """
    comm = comm or world()
    comm._check_rank(root_rank, "root_rank")
    layout = [[(tuple(p.shape), str(p.dtype)) for p in g["params"]] for g in optimizer.param_groups]
    check_same_everywhere(comm, "broadcast_optimizer_state: parameter groups (shapes/dtypes)", layout)
    tensors: list[torch.Tensor] = []
    skeleton = _strip(optimizer.state_dict(), tensors) if comm.rank == root_rank else None
    skeleton = comm.broadcast_object(skeleton, root_rank)
    if comm.rank != root_rank:
        specs: list[_Placeholder] = []
        _collect(skeleton, specs)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(specs, key=lambda s: s.index)]
    broadcast_tensors([t if t.is_contiguous() else t.contiguous() for t in tensors], comm, root_rank)
    if comm.rank != root_rank:
        optimizer.load_state_dict(_fill(skeleton, tensors))


def _collect(obj: Any, out: list[_Placeholder]) -> None:
    if isinstance(obj, _Placeholder):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect(v, out)


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `module` (tied ones once), named, in registration order."""
    return [*((n, p.detach()) for n, p in module.named_parameters()), *module.named_buffers()]
