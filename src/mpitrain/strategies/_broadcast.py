"""Making replicas equal: broadcast of parameters, buffers and optimizer state from one rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from .._utils.flat import copy_from_flat, flatten, group_by
from ..comm.base import Communicator
from ..runtime import world
from ._buckets import plan_buckets

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_tensors", "check_same_everywhere",
           "module_tensors", "ReplicaBuffers"]


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


#: Fused broadcasts carry at most this many bytes each (a tensor beyond it goes alone, in place): the
#: flat buffer is a transient copy, and fusing a whole 268 MB model cost every rank 268 MB more than
#: the model at DataParallel's start (measured with ``bench memory --zero``, docs/data-parallel.md).
FUSE_BYTES = 16 << 20


class ReplicaBuffers:
    """The buffers of a replica strategy's model (BatchNorm statistics), which each rank's training forwards
    move by its own rows: :meth:`moved` marks that they may differ, :meth:`agree` makes them rank 0's on
    every rank once after such steps (a broadcast; nothing when nothing moved since). So the evaluated and
    the returned model are the same on every rank (data: DDP's broadcast_buffers state; pipe-sgd)."""

    def __init__(self, buffers: list[torch.Tensor], comm: Communicator) -> None:
        self.buffers, self.comm, self._moved = buffers, comm, False

    def moved(self) -> None:
        """A training forward ran since the last agreement (or broadcast): the ranks' buffers may differ."""
        self._moved = bool(self.buffers)

    def broadcast_before_forwards(self) -> None:
        """Rank 0's buffers on every rank now, before training forwards that will move them again (DDP's
        ``broadcast_buffers`` once per step). Collective on the communicator."""
        if self.buffers:
            broadcast_tensors(self.buffers, self.comm, 0)
            self.moved()

    def agree(self) -> None:
        """Rank 0's buffers on every rank if they moved since the last call. Collective on the communicator
        (every rank calls it at the same point; each knows alike whether they moved: every rank runs a step)."""
        if self._moved:
            broadcast_tensors(self.buffers, self.comm, 0)
            self._moved = False


def broadcast_tensors(tensors: list[torch.Tensor], comm: Communicator, root: int = 0) -> None:
    """Overwrite every tensor with root's, in place; fused broadcasts per dtype/device of at most
    :data:`FUSE_BYTES` each (grouped by ``plan_buckets``).

    Collective over `comm`: every rank passes tensors of the same shapes and dtypes in the same order.
    A lone contiguous tensor is broadcast in place; otherwise a flat buffer costs one copy each way.
    """
    if comm.size == 1:  # root's tensors are these: nothing to send (and, on a GPU, no host round trip)
        return
    groups = group_by((t for t in tensors if t.numel()), lambda t: (t.dtype, t.device))
    for group in groups.values():
        for idx in plan_buckets([(t.numel() * t.element_size(), "") for t in group], FUSE_BYTES):
            ts = [group[i] for i in idx]
            if len(ts) == 1 and ts[0].is_contiguous():
                comm.broadcast(ts[0], root)
                continue
            flat = flatten(ts)
            comm.broadcast(flat, root)
            if comm.rank != root:
                copy_from_flat(flat, ts)


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


@dataclass(frozen=True)
class _Placeholder:
    """Where a tensor was in a state dict sent without its tensors: its shape, dtype name and device
    type. The fresh tensor is made on the same device type (a CUDA one on this rank's current CUDA
    device), so every rank groups the fused broadcasts alike: Adam's ``step`` stays on the CPU while
    its moments live on the GPU."""

    shape: tuple[int, ...]
    dtype_name: str
    device_type: str = "cpu"

    @classmethod
    def of(cls, t: torch.Tensor) -> _Placeholder:
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), t.device.type)

    def empty(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype_name)
        assert isinstance(dtype, torch.dtype)
        device = torch.device("cuda", torch.cuda.current_device()) if self.device_type == "cuda" else None
        return torch.empty(self.shape, dtype=dtype, device=device)


def _tensor_leaves(tree: object) -> list[torch.Tensor]:
    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


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
    # root's state dict travels pickled with placeholders for its tensors (pytree leaves, in order),
    # then the tensors themselves travel as fused broadcasts into fresh ones on the other ranks
    state = optimizer.state_dict() if comm.rank == root_rank else None
    skeleton = tree_map(lambda x: _Placeholder.of(x) if isinstance(x, torch.Tensor) else x, state)
    skeleton = comm.broadcast_object(skeleton, root_rank)
    if comm.rank != root_rank:
        state = tree_map(lambda x: x.empty() if isinstance(x, _Placeholder) else x, skeleton)
    broadcast_tensors(_tensor_leaves(state), comm, root_rank)
    if comm.rank != root_rank:
        assert isinstance(state, dict)
        optimizer.load_state_dict(state)


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of `module` (tied ones once), named, in registration order."""
    return [*((n, p.detach()) for n, p in module.named_parameters()), *module.named_buffers()]
