"""The staging layer: calls on tensors MPI cannot read run on pinned host mirrors, on the MPI backend below.

:class:`Staged` wraps an :class:`~._mpi.MPICommunicator` (the backend: CPU tensors, and CUDA tensors
where MPI is CUDA-aware). A tensor on a device the backend does not take directly (`direct`) is
mirrored to the host (:class:`~._staging.Staging`), the backend works on the mirror, and what it wrote
is copied back; so is a direct CUDA tensor whose allreduce goes hierarchical (the leaders' ring works
on host memory: a verdict from sizes only, alike on every rank). Staged isends are copied and posted by
a worker thread (:class:`~._staged_sends.StagedSends`), not the caller's, where MPI runs with
MPI_THREAD_MULTIPLE. A CPU tensor the backend takes pays one attribute and one flag here.

``direct`` without "cpu" stages CPU tensors too: the staging path, checkable against the direct one
over real MPI without a GPU (tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from mpi4py import MPI

from ._layer import Layer
from ._mpi import DEVICES, MPICommunicator, pieces, widened
from ._staged_sends import StagedSends
from ._staging import Staging, copy_bits
from .base import Communicator, Request, _CallbackRequest

__all__ = ["Staged"]


class Staged(Layer):
    """Host staging over an MPI backend `inner` for the device types not in `direct` (see the module doc)."""

    _devices = DEVICES
    inner: MPICommunicator

    def __init__(self, inner: MPICommunicator, direct: frozenset[str]) -> None:
        super().__init__(inner)
        self.direct = direct
        self._stage_cpu = "cpu" not in direct  # flags, not set lookups: read on every call
        self._cuda_direct = "cuda" in direct
        self._staging = Staging()
        self._sends: StagedSends | None = None  # staged isends' worker thread, started by the first

    def rewrap(self, inner: Communicator) -> Staged:
        assert isinstance(inner, MPICommunicator)  # a split of the MPI backend
        return Staged(inner, self.direct)

    def _staged_call(self, t: torch.Tensor, reduce: bool = False) -> bool:
        """Whether a call on `t` runs on host mirrors: a CPU tensor when staging is forced; a tensor on a
        device MPI does not take (the checks refuse devices nobody takes); and, for an allreduce
        (`reduce`), a direct device tensor whose reduction goes hierarchical. What is not a tensor goes
        down to the backend, whose checks refuse it."""
        if not isinstance(t, torch.Tensor):
            return False
        if t.is_cpu:
            return self._stage_cpu
        if not (t.is_cuda and self._cuda_direct):
            return True
        return reduce and self.inner.hierarchy_for(t) is not None

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        # one rank sends nothing: the backend's path (no MPI call, no host round trip for a device tensor)
        if self._size == 1 or not self._staged_call(t, reduce=True):
            return self.inner.allreduce(t, op)
        self._check(t, "t", op)
        host = self.inner
        if widened(t) or host.hierarchy_for(t) is not None:  # a float32 copy, or the hosts' stages: whole
            return self._staging.inplace(t, lambda h: host.allreduce(h, op))
        # the direct path's pieces (the same MPI calls, so the same bits), each copied while another is reduced
        return self._staging.pieces(t, pieces, lambda h: host.allreduce(h, op))

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        if self._size == 1 or not self._staged_call(t):
            return self.inner.broadcast(t, root)
        self._check(t, "t")
        self._check_rank(root, "root")
        return self._staging.pieces(t, pieces, lambda h: self.inner.broadcast(h, root))

    def allgather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if not self._staged_call(t):
            return self.inner.allgather(t, out)
        self._check(t, "t")
        src = t.reshape(1) if t.dim() == 0 else t
        given = None if out is None else self._gather_out(src, out)  # checked before any message
        got = self._staging.out(src, self.inner.allgather)  # `src` is mirrored to the host before `out` is written
        if given is None:
            return got
        copy_bits(given, got)  # as bytes: int1 ... uint7 have no copy kernel
        return given

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not self._staged_call(t):
            return self.inner.reduce_scatter(t, op)
        self._check(t, "t", op)
        return self._staging.out(t, lambda h: self.inner.reduce_scatter(h, op))

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        if not self._staged_call(send):
            return self.inner.alltoallv(send, send_counts, recv_counts)
        self._check(send, "send")
        return self._staging.out(send, lambda h: self.inner.alltoallv(h, send_counts, recv_counts))

    # -- point to point ------------------------------------------------------------------------
    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        if not self._staged_call(t):
            return self.inner.send(t, dest, tag)
        self._check(t, "t")
        h = self._staging.to_host(t)
        try:
            self.inner.send(h, dest, tag)
        finally:
            self._staging.give(h)

    def recv(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        if not self._staged_call(t):
            return self.inner.recv(t, source, tag)
        self._check(t, "t")
        return self._staging.inplace(t, lambda h: self.inner.recv(h, source, tag), read=False)

    def sendrecv(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                 sendtag: int = 0, recvtag: int = 0) -> torch.Tensor:
        if not (self._staged_call(send) or self._staged_call(recv)):
            return self.inner.sendrecv(send, dest, recv, source, sendtag, recvtag)
        self._check(send, "send")
        self._check(recv, "recv")
        hs = self._staging.to_host(send)
        try:
            self._staging.inplace(recv, lambda hr: self.inner.sendrecv(hs, dest, hr, source, sendtag, recvtag),
                                  read=False)
        finally:
            self._staging.give(hs)
        return recv

    # -- nonblocking ---------------------------------------------------------------------------
    def _request(self, t: torch.Tensor, start: Callable[[torch.Tensor], Request], read: bool = True,
                 write: bool = True) -> Request:
        """Start `start` on a host mirror of `t`; on completion the mirror is copied back into `t` (when
        `write`) and returned for reuse."""
        staging = self._staging
        h = staging.to_host(t) if read else staging.take(t)
        try:
            req = start(h)
        except BaseException:
            staging.give(h)
            raise
        finish = (lambda: staging.back(t, h)) if write else (lambda: staging.give(h))
        return _CallbackRequest(req.wait, req.test, t if write else None, finish, keep=h, cancel=req.cancel)

    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request:
        if self._size == 1 or not self._staged_call(t, reduce=True):
            return self.inner.iallreduce(t, op)
        self._check(t, "t", op)
        return self._request(t, lambda h: self.inner.iallreduce(h, op))

    def ibroadcast(self, t: torch.Tensor, root: int = 0) -> Request:
        if self._size == 1 or not self._staged_call(t):
            return self.inner.ibroadcast(t, root)
        self._check(t, "t")
        self._check_rank(root, "root")
        return self._request(t, lambda h: self.inner.ibroadcast(h, root))

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Request:
        if not self._staged_call(t):
            return self.inner.isend(t, dest, tag)
        self._check(t, "t")
        self._check_rank(dest, "dest")
        if _thread_multiple():  # the copy to the host waits for t's producer: off this thread
            if self._sends is None:
                self._sends = StagedSends(self._staging, self.inner.isend, self.abort, f"rank {self._rank}")
            return self._sends.isend(t, dest, tag)
        return self._request(t, lambda h: self.inner.isend(h, dest, tag), write=False)

    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Request:
        if not self._staged_call(t):
            return self.inner.irecv(t, source, tag)
        self._check(t, "t")
        self._check_rank(source, "source")
        return self._request(t, lambda h: self.inner.irecv(h, source, tag), read=False)

    def free(self) -> None:
        if self._sends is not None:
            self._sends.close()
            self._sends = None
        self.inner.free()


@functools.cache
def _thread_multiple() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (staged sends post from a worker thread)."""
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)
