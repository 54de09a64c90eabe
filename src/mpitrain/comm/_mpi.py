"""The MPI backend: mpi4py buffer calls on the tensors' own memory, no pickling on the hot path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from mpi4py import MPI

from .._utils.flat import offsets
from .base import CommError, Communicator, Request, _CallbackRequest, _DoneRequest, split_sizes

__all__ = ["MPICommunicator"]

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
# MPI datatypes by torch dtype. bfloat16 has none: it moves as 16-bit words and reduces in float32.
_MPI_TYPES = {
    torch.float16: MPI.FLOAT16_T if MPI.FLOAT16_T != MPI.DATATYPE_NULL else MPI.SHORT,
    torch.bfloat16: MPI.INT16_T,
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
}
_HALF_NATIVE = MPI.FLOAT16_T != MPI.DATATYPE_NULL

#: Allreduces of more than SPLIT_ABOVE bytes run as consecutive allreduces of SEGMENT_BYTES pieces:
#: Open MPI's shared-memory allreduce of one large buffer is several times slower than of its pieces
#: (measurements, dated: docs/comm.md, "Large allreduces are cut into pieces"). Constants, not
#: options: every rank must cut a tensor alike (each piece is a collective).
SEGMENT_BYTES = 2 << 20
SPLIT_ABOVE = 8 << 20


def _buf(t: torch.Tensor) -> list[Any]:
    """Zero-copy [memory, datatype] of a contiguous CPU tensor (a numpy view shares its storage)."""
    arr = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return [arr, _MPI_TYPES[t.dtype]]


def _pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` itself, or above SPLIT_ABOVE bytes consecutive flat views of SEGMENT_BYTES (same storage, in order)."""
    if t.numel() * t.element_size() <= SPLIT_ABOVE:
        return [t]
    return list(t.view(-1).split(max(1, SEGMENT_BYTES // t.element_size())))


def _staged(t: torch.Tensor) -> bool:
    """Whether a reduction of `t` must go through a float32 copy (MPI cannot add these words)."""
    return t.dtype == torch.bfloat16 or (t.dtype == torch.float16 and not _HALF_NATIVE)


class MPICommunicator(Communicator):
    """A Communicator over an mpi4py ``Intracomm``. Thread-safe as far as MPI_THREAD_MULTIPLE is."""

    backend = "mpi"

    def __init__(self, comm: MPI.Intracomm) -> None:
        self._comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def mpi_comm(self) -> MPI.Intracomm:
        """The underlying mpi4py communicator, for code that needs a call we don't wrap."""
        self._check_open()
        return self._comm

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if not _staged(t):
            return self._allreduce_inplace(t, op)
        self.iallreduce(t, op).wait()  # through a float32 copy, copied back into t
        return t

    def _allreduce_inplace(self, t: torch.Tensor, op: str) -> torch.Tensor:
        self._check(t, "t", op)
        if t.numel() and self._size > 1:
            for piece in _pieces(t):
                self._comm.Allreduce(MPI.IN_PLACE, _buf(piece), op=_MPI_OPS[op])
        if op == "avg":
            t.div_(self._size)
        return t

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._check(t, "t")
        self._check_rank(root, "root")
        if t.numel() and self._size > 1:
            self._comm.Bcast(_buf(t), root=root)
        return t

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        self._check(t, "t")
        src = t.reshape(1) if t.dim() == 0 else t
        out = torch.empty((self._size * src.shape[0], *src.shape[1:]), dtype=t.dtype)
        if out.numel():
            self._comm.Allgather(_buf(src), _buf(out))
        return out

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._check(t, "t", op)
        if t.dim() == 0:
            raise CommError("argument 't' of reduce_scatter must have at least one dimension")
        rows = split_sizes(t.shape[0], self._size)
        row = t[0].numel() if t.shape[0] else 0
        staged = _staged(t)
        src = t.float() if staged else t
        out = torch.empty((rows[self._rank], *t.shape[1:]), dtype=src.dtype)
        if t.numel():
            self._comm.Reduce_scatter(_buf(src), _buf(out), [r * row for r in rows], op=_MPI_OPS[op])
        if op == "avg":
            out.div_(self._size)
        return out.to(t.dtype) if staged else out

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        self._check(send, "send")
        if send.dim() == 0:
            raise CommError("argument 'send' of alltoallv must have at least one dimension")
        sc = self._check_counts(send_counts, "send_counts", rows=send.shape[0])
        rc = self._check_counts(recv_counts, "recv_counts")
        row = send[0].numel() if send.shape[0] else int(torch.Size(send.shape[1:]).numel())
        out = torch.empty((sum(rc), *send.shape[1:]), dtype=send.dtype)
        s_el, r_el = [c * row for c in sc], [c * row for c in rc]
        s_disp, r_disp = offsets(s_el)[:-1], offsets(r_el)[:-1]
        sbuf, rbuf = _buf(send), _buf(out)
        self._comm.Alltoallv([sbuf[0], (s_el, s_disp), sbuf[1]], [rbuf[0], (r_el, r_disp), rbuf[1]])
        return out

    def barrier(self) -> None:
        self._check_open()
        self._comm.Barrier()

    # -- point to point ------------------------------------------------------------------------
    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        self._check(t, "t")
        self._check_rank(dest, "dest")
        self._comm.Send(_buf(t), dest=dest, tag=tag)

    def recv(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        self._check(t, "t")
        self._check_rank(source, "source")
        self._comm.Recv(_buf(t), source=source, tag=tag)
        return t

    def sendrecv(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                 sendtag: int = 0, recvtag: int = 0) -> torch.Tensor:
        self._check(send, "send")
        self._check(recv, "recv")
        self._check_rank(dest, "dest")
        self._check_rank(source, "source")
        self._comm.Sendrecv(_buf(send), dest, sendtag, _buf(recv), source, recvtag)
        return recv

    # -- nonblocking ---------------------------------------------------------------------------
    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request:
        self._check(t, "t", op)
        if not t.numel() or self._size == 1:
            return _DoneRequest(t.div_(self._size) if op == "avg" else t)
        staged = _staged(t)
        work = t.float() if staged else t
        reqs = [self._comm.Iallreduce(MPI.IN_PLACE, _buf(p), op=_MPI_OPS[op]) for p in _pieces(work)]

        def finish() -> None:
            if op == "avg":
                work.div_(self._size)
            if staged:
                t.copy_(work)

        return _CallbackRequest(lambda: MPI.Request.Waitall(reqs), lambda: MPI.Request.Testall(reqs), t, finish,
                                keep=work)

    def ibroadcast(self, t: torch.Tensor, root: int = 0) -> Request:
        self._check(t, "t")
        self._check_rank(root, "root")
        if not t.numel() or self._size == 1:
            return _DoneRequest(t)
        req = self._comm.Ibcast(_buf(t), root=root)
        return _CallbackRequest(req.Wait, req.Test, t)

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Request:
        self._check(t, "t")
        self._check_rank(dest, "dest")
        req = self._comm.Isend(_buf(t), dest=dest, tag=tag)
        return _CallbackRequest(req.Wait, req.Test, None, keep=t)

    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Request:
        self._check(t, "t")
        self._check_rank(source, "source")
        req = self._comm.Irecv(_buf(t), source=source, tag=tag)
        return _CallbackRequest(req.Wait, req.Test, t)

    # -- groups and objects --------------------------------------------------------------------
    def split(self, color: int | None, key: int = 0) -> MPICommunicator | None:
        self._check_open()
        sub = self._comm.Split(MPI.UNDEFINED if color is None else int(color), int(key))
        return None if sub == MPI.COMM_NULL else MPICommunicator(cast(MPI.Intracomm, sub))

    def allgather_object(self, obj: Any) -> list[Any]:
        self._check_open()
        return self._comm.allgather(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_open()
        self._check_rank(root, "root")
        return self._comm.bcast(obj, root=root)

    def send_object(self, obj: Any, dest: int, tag: int = 0) -> None:
        self._check_open()
        self._check_rank(dest, "dest")
        self._comm.send(obj, dest=dest, tag=tag)

    def recv_object(self, source: int, tag: int = 0) -> Any:
        self._check_open()
        self._check_rank(source, "source")
        return self._comm.recv(source=source, tag=tag)

    def abort(self, code: int = 1) -> None:
        MPI.COMM_WORLD.Abort(code or 1)

    def free(self) -> None:
        if not self._closed and self._comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self._comm.Free()
        self._closed = True

