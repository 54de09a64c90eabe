"""Horovod's helpers: broadcast of parameters, optimizer state and Python objects; allgather of objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..comm.base import Communicator
from ..strategies import broadcast_optimizer_state as _broadcast_optimizer_state
from ..strategies import broadcast_tensors
from ._basics import state
from ._engine import Key, Op
from ._handles import submit, synchronize
from ._mpi_ops import _check_tensor, _devices, _on_device, _specs
from ._process_sets import ProcessSet, _resolve, global_process_set

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def _named(params: Any) -> list[tuple[str | None, torch.Tensor]]:
    if isinstance(params, Mapping):
        return [(k, v) for k, v in sorted((str(k), v) for k, v in params.items())]
    if isinstance(params, Iterable) and not isinstance(params, (str, torch.Tensor)):
        return [p if isinstance(p, tuple) else (None, p) for p in params]
    raise ValueError(f"invalid params of type: {type(params)}")


@torch.no_grad()
def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int) -> None:
    """Overwrite, in place, every tensor of `params` with global rank `root_rank`'s.

    `params` is a ``state_dict()`` (broadcast in name order, as Horovod), a list of ``(name, tensor)``
    (``named_parameters()``) or of tensors. Collective over all ranks: one negotiation checks names,
    shapes, dtypes and device types (a mismatch raises HorovodInternalError on every rank), then one
    fused broadcast per dtype and device. CPU and CUDA tensors (one CUDA device) are taken."""
    items = _named(params)
    tensors = [_check_tensor(t, f"parameter {n or i}") for i, (n, t) in enumerate(items)]
    names = tuple(n for n, _ in items)
    dtypes, shapes = _specs(tensors)
    devices = _devices(tensors)
    root = global_process_set._root(root_rank)
    key: Key = ("broadcast_parameters", None, (("names", names), ("dtypes", dtypes), ("shapes", shapes),
                                               ("devices", devices), ("root_rank", root_rank)))

    def execute(comm: Communicator, infos: list[Any]) -> None:
        broadcast_tensors(tensors, comm, root)  # every dtype moves as it is (8/16-bit ints too)

    synchronize(submit(Op("broadcast_parameters", None, 0, key, None, _on_device(tensors, devices, execute))))


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Make every rank's optimizer state and hyper-parameters global rank `root_rank`'s, in place.

    Works when the other ranks' optimizers are fresh (no state yet): root's state travels as a pickled
    skeleton plus fused tensor broadcasts and is loaded with ``load_state_dict`` (no dummy step).
    Collective over all ranks, run on the calling thread (CUDA state in order on its current stream).
    L-BFGS is refused as in Horovod; `model` is accepted and unused (sparse parameters are not
    supported)."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    st = state()
    _broadcast_optimizer_state(optimizer, root_rank, comm=st.world)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Global rank `root_rank`'s `obj` (pickled) on every member of `process_set`."""
    pid, _ = _resolve(process_set)
    root = process_set._root(root_rank)
    key: Key = ("broadcast_object", name, (("root_rank", root_rank),))
    return synchronize(submit(Op("broadcast_object", name, pid, key, None,
                                  lambda comm, infos: comm.broadcast_object(obj, root))))


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every member's `obj` (pickled), in set-rank order."""
    pid, _ = _resolve(process_set)
    key: Key = ("allgather_object", name, ())
    return synchronize(submit(Op("allgather_object", name, pid, key, None,  # type: ignore[no-any-return]
                                  lambda comm, infos: comm.allgather_object(obj))))
