"""A communicator layer: a Communicator that hands every call to the one it wraps (its `inner`).

A layer overrides what it adds (staging: the tensor calls on device tensors; tracing: every call) and
inherits the rest, which goes to `inner` unchanged. ``split`` wraps the inner communicator's split in
the same layer (:meth:`Layer.rewrap`), so a sub-communicator carries the layers of its parent. The
layers are composed where a communicator is built (:mod:`mpitrain.comm.compose`), never patched in.

A layer reports its innermost backend's class to ``isinstance`` (``__class__``, as Python's proxies
do), so ``isinstance(mpitrain.init(), MPICommunicator)`` holds as it did before the layers;
``type(comm)`` is the outer layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeGuard, TypeVar

import torch

from .base import Communicator, Request

__all__ = ["Layer", "layer_of", "backend_of"]

L = TypeVar("L", bound=Communicator)


class Layer(Communicator):
    """Delegates every call to `inner`; subclasses override what they add and :meth:`rewrap`."""

    def __init__(self, inner: Communicator) -> None:
        self.inner = inner
        self.backend = inner.backend
        self._rank, self._size = inner.rank, inner.size  # fixed for a communicator's life: read per call

    def rewrap(self, inner: Communicator) -> Layer:
        """This layer, with the same settings, around `inner` (a split of this layer's inner)."""
        raise NotImplementedError

    @property  # type: ignore[misc]  # isinstance sees the backend's class (see the module doc)
    def __class__(self) -> type:
        return type(backend_of(self))

    @property
    def _closed(self) -> bool:  # type: ignore[override]  # the backend's state: a layer is open while it is
        return self.inner._closed

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def mpi_comm(self) -> Any:
        """The backend's mpi4py communicator (AttributeError where the backend has none)."""
        return self.inner.mpi_comm  # type: ignore[attr-defined]

    # -- delegated calls ---------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.inner.allreduce(t, op)

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self.inner.broadcast(t, root)

    def allgather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.allgather(t, out)

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return self.inner.reduce_scatter(t, op)

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        return self.inner.alltoallv(send, send_counts, recv_counts)

    def barrier(self) -> None:
        self.inner.barrier()

    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        self.inner.send(t, dest, tag)

    def recv(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        return self.inner.recv(t, source, tag)

    def sendrecv(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                 sendtag: int = 0, recvtag: int = 0) -> torch.Tensor:
        return self.inner.sendrecv(send, dest, recv, source, sendtag, recvtag)

    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request:
        return self.inner.iallreduce(t, op)

    def ibroadcast(self, t: torch.Tensor, root: int = 0) -> Request:
        return self.inner.ibroadcast(t, root)

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Request:
        return self.inner.isend(t, dest, tag)

    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Request:
        return self.inner.irecv(t, source, tag)

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        sub = self.inner.split(color, key)
        return None if sub is None else self.rewrap(sub)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.inner.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.inner.broadcast_object(obj, root)

    def send_object(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.inner.send_object(obj, dest, tag)

    def recv_object(self, source: int, tag: int = 0) -> Any:
        return self.inner.recv_object(source, tag)

    def abort(self, code: int = 1) -> None:
        self.inner.abort(code)

    def free(self) -> None:
        self.inner.free()

    def __repr__(self) -> str:
        names: list[str] = []
        c: Communicator = self
        while _is_layer(c):
            names.append(type(c).__name__)
            c = c.inner
        return f"<{' > '.join([*names, type(c).__name__])} backend={self.backend} rank={self.rank} size={self.size}>"


def backend_of(comm: Communicator) -> Communicator:
    """The backend at the bottom of `comm`'s layers (`comm` itself when it has none)."""
    while _is_layer(comm):
        comm = comm.inner
    return comm


def layer_of(comm: Communicator, kind: type[L]) -> L | None:
    """The outermost layer (or backend) of class `kind` in `comm`'s stack, or None."""
    c: Communicator | None = comm
    while c is not None:
        if issubclass(type(c), kind):
            return c  # type: ignore[return-value]
        c = c.inner if _is_layer(c) else None
    return None


def _is_layer(c: object) -> TypeGuard[Layer]:
    """Whether `c` is a layer, by its own type: ``isinstance`` would ask ``__class__``, which asks this."""
    return issubclass(type(c), Layer)
