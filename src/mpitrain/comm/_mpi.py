"""The MPI backend: mpi4py buffer calls on the tensors' own memory, no pickling on the hot path.

CUDA tensors go to MPI directly when the library is CUDA-aware (:func:`~._cuda.mpi_cuda_aware`), and
otherwise through pinned host mirrors (:mod:`._staging`); either way in order on the calling thread's
current stream (see :mod:`._cuda`), and complete for every stream when the call (or the request's
``wait``) returns. CPU tensors pay one device check for this."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from mpi4py import MPI

from .._utils.flat import offsets
from ._cuda import host_wait, mpi_cuda_aware
from ._hierarchical import HIERARCHY_ABOVE, Hierarchy
from ._staged_sends import StagedSends
from ._staging import Staging, copy_bits
from .base import CommError, Communicator, Request, _CallbackRequest, _DoneRequest, split_sizes

__all__ = ["MPICommunicator"]

_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
#: bool's ops (base.reduce_ops: max and min only) as MPI's logical ones: MPI defines no MAX on C_BOOL.
_BOOL_OPS = {"max": MPI.LOR, "min": MPI.LAND}
# MPI datatypes by torch dtype. A dtype not here (bfloat16, complex32, float8, ...) moves as the bytes of
# its own storage (MPI.BYTE); bfloat16 as 16-bit words. Reductions of bfloat16 and complex32 (and float16 if
# MPI lacks it) run in a wider copy (_WIDE).
_MPI_TYPES = {
    torch.float16: MPI.FLOAT16_T if MPI.FLOAT16_T != MPI.DATATYPE_NULL else MPI.SHORT,
    torch.bfloat16: MPI.INT16_T,
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.bool: MPI.C_BOOL,
    torch.int8: MPI.INT8_T,
    torch.int16: MPI.INT16_T,
    torch.uint8: MPI.UINT8_T,
    torch.uint16: MPI.UINT16_T,
    torch.uint32: MPI.UINT32_T,
    torch.uint64: MPI.UINT64_T,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
_HALF_NATIVE = MPI.FLOAT16_T != MPI.DATATYPE_NULL
#: The dtype a reduction of these runs in (MPI cannot add their words): one copy each way.
_WIDE = {torch.bfloat16: torch.float32, torch.complex32: torch.complex64,
         **({} if _HALF_NATIVE else {torch.float16: torch.float32})}
#: Device types a tensor may live on: CUDA ones go direct or staged (see the module doc).
DEVICES = ("cpu", "cuda")

#: Allreduces of more than SPLIT_ABOVE bytes run as consecutive allreduces of SEGMENT_BYTES pieces:
#: Open MPI's shared-memory allreduce of one large buffer is several times slower than of its pieces
#: (measurements, dated: docs/comm.md, "Large allreduces are cut into pieces"). Constants, not
#: options: every rank must cut a tensor alike (each piece is a collective).
SEGMENT_BYTES = 2 << 20
SPLIT_ABOVE = 8 << 20


def _buf(t: torch.Tensor) -> list[Any]:
    """Zero-copy [memory, datatype] of a contiguous tensor: a CPU tensor's memory by address (not a
    numpy view: ``Tensor.numpy()`` marks the storage as never resizable again, and ZeRO-3 frees and
    re-allocates its parameter buffers by resizing their storage); a CUDA tensor itself
    (``__cuda_array_interface__``, for CUDA-aware MPI) once the current stream has produced it (MPI
    knows no streams). A dtype MPI has no type for goes as its storage's bytes. The caller keeps `t`
    alive until MPI is done with it."""
    mpi_type = _MPI_TYPES.get(t.dtype)
    if mpi_type is None:
        t, mpi_type = t.reshape(-1).view(torch.uint8), MPI.BYTE
    elif t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    if t.is_cpu:
        return [MPI.buffer.fromaddress(t.data_ptr(), t.numel() * t.element_size()), mpi_type]
    host_wait(t)
    return [t, mpi_type]


def _items(dtype: torch.dtype) -> int:
    """MPI items per element of `dtype` in :func:`_buf` (its bytes where MPI has no type)."""
    return 1 if dtype in _MPI_TYPES else dtype.itemsize


def _op(op: str, dtype: torch.dtype) -> Any:
    """MPI's op for reduction `op` of `dtype` (checked against base.reduce_ops already)."""
    return _BOOL_OPS[op] if dtype == torch.bool else _MPI_OPS[op]


def _pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` itself, or above SPLIT_ABOVE bytes consecutive flat views of SEGMENT_BYTES (same storage, in order)."""
    if t.numel() * t.element_size() <= SPLIT_ABOVE:
        return [t]
    return list(t.view(-1).split(max(1, SEGMENT_BYTES // t.element_size())))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of `a` and `b` overlaps (MPI forbids aliased send and receive buffers)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _staged(t: torch.Tensor) -> bool:
    """Whether a reduction of `t` must go through a wider copy (MPI cannot add these words: :data:`_WIDE`)."""
    return t.dtype in _WIDE


class MPICommunicator(Communicator):
    """A Communicator over an mpi4py ``Intracomm``. Thread-safe as far as MPI_THREAD_MULTIPLE is.

    `direct` (private, for tests): the device types handed to MPI as they are; a tensor on another
    device goes through host staging. Default: CPU, plus CUDA when MPI is CUDA-aware. An empty set
    stages CPU tensors too (the staging path, checkable against the direct one without a GPU)."""

    backend = "mpi"
    _devices = DEVICES

    def __init__(self, comm: MPI.Intracomm, *, _direct: frozenset[str] | None = None) -> None:
        self._comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._hierarchy: Hierarchy | None = None  # hosts and leaders: built by the first large allreduce
        self._direct = _direct if _direct is not None else _default_direct()
        self._stage_cpu = "cpu" not in self._direct  # flags, not set lookups: read on every call
        self._cuda_direct = "cuda" in self._direct
        self._staged_to: MPICommunicator | None = None  # the direct CPU view staged calls run on
        self._staging: Staging | None = None
        self._sends: StagedSends | None = None  # staged isends' worker thread, started by the first

    def _staged_call(self, t: torch.Tensor, reduce: bool = False) -> bool:
        """Whether a call on `t` (not a CPU tensor, or staging forced) runs on host mirrors: a CPU tensor
        when staging is forced; a tensor on a device MPI does not take (the staging path's checks refuse
        devices nobody takes); and, for an allreduce (`reduce`), a direct device tensor whose reduction
        goes hierarchical, whose leaders' ring works on host memory (a verdict from sizes only, alike on
        every rank). Callers check `t` (``_check``), then test ``t.is_cpu`` first, so a CPU tensor pays
        that attribute and one flag."""
        if t.is_cpu:
            return self._stage_cpu
        if not (t.is_cuda and self._cuda_direct):
            return True
        return reduce and self._hierarchical(t) is not None

    def _stage(self, t: Any, name: str, op: str | None = None) -> tuple[MPICommunicator, Staging]:
        """Check `t`, then (the CPU communicator over the same MPI communicator, the host mirrors) that
        run a call on a tensor MPI does not take directly."""
        self._check(t, name, op)
        if self._staged_to is None or self._staging is None:
            host = MPICommunicator(self._comm, _direct=frozenset({"cpu"}))
            host._hierarchical = self._hierarchical  # type: ignore[method-assign]  # one host hierarchy
            self._staged_to, self._staging = host, Staging()
        return self._staged_to, self._staging

    def _hierarchical(self, t: torch.Tensor) -> Hierarchy | None:
        """The host hierarchy if an allreduce of `t` goes hierarchical (ranks on several hosts, large
        enough; the same verdict on every rank). The first large allreduce builds it (collective)."""
        nbytes = t.numel() * t.element_size()
        if nbytes < HIERARCHY_ABOVE or self._size < 2:
            return None
        if self._hierarchy is None:
            self._hierarchy = Hierarchy(self._comm)
        return self._hierarchy if self._hierarchy.applies(nbytes) else None

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
        self._check(t, "t", op)
        # device tensors are staged where MPI cannot read them, and where the allreduce goes hierarchical
        # (its leaders' ring works on host memory); the verdict depends on sizes only, alike on every rank.
        # One rank sends nothing: the direct path below (no MPI call, no host round trip for a device tensor)
        if (not t.is_cpu or self._stage_cpu) and self._size > 1 and self._staged_call(t, reduce=True):
            host, staging = self._stage(t, "t", op)
            if _staged(t) or self._hierarchical(t) is not None:  # a float32 copy, or the hosts' stages: whole
                return staging.inplace(t, lambda h: host.allreduce(h, op))
            # the direct path's pieces (the same MPI calls, so the same bits), each copied while another
            # is reduced
            return staging.pieces(t, _pieces, lambda h: host.allreduce(h, op))
        if not _staged(t):
            return self._allreduce_inplace(t, op)
        self.iallreduce(t, op).wait()  # through a float32 copy, copied back into t
        return t

    def _allreduce_inplace(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """The direct allreduce of a checked `t` (see :meth:`allreduce`)."""
        hier = self._hierarchical(t) if t.numel() and self._size > 1 else None
        if hier is not None:
            hier.allreduce(_buf(t), t, _op(op, t.dtype), op in ("sum", "avg"))
        elif t.numel() and self._size > 1:
            for piece in _pieces(t):
                self._comm.Allreduce(MPI.IN_PLACE, _buf(piece), op=_op(op, t.dtype))
        if op == "avg":
            t.div_(self._size)
        return t

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._check(t, "t")
        self._check_rank(root, "root")
        if (not t.is_cpu or self._stage_cpu) and self._size > 1 and self._staged_call(t):
            host, staging = self._stage(t, "t")
            return staging.pieces(t, _pieces, lambda h: host.broadcast(h, root))
        if t.numel() and self._size > 1:
            self._comm.Bcast(_buf(t), root=root)
        return t

    def allgather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check(t, "t")
        src = t.reshape(1) if t.dim() == 0 else t
        given = None if out is None else self._gather_out(src, out)  # checked before any message
        if (not t.is_cpu or self._stage_cpu) and self._staged_call(t):
            host, staging = self._stage(t, "t")
            got = staging.out(src, host.allgather)  # `src` is mirrored to the host before `out` is written
            if given is None:
                return got
            copy_bits(given, got)  # as bytes: int1 ... uint7 have no copy kernel
            return given
        out = given if given is not None else self._gather_out(src, None)
        if out.numel():
            own = out[self._rank * src.shape[0]:(self._rank + 1) * src.shape[0]]
            if src.data_ptr() == own.data_ptr():  # block `rank` of out itself: MPI's in-place allgather
                self._comm.Allgather(MPI.IN_PLACE, _buf(out))
            else:
                self._comm.Allgather(_buf(src.clone() if _overlap(src, out) else src), _buf(out))
        return out

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._check(t, "t", op)
        if (not t.is_cpu or self._stage_cpu) and self._staged_call(t):
            host, staging = self._stage(t, "t", op)
            return staging.out(t, lambda h: host.reduce_scatter(h, op))
        if t.dim() == 0:
            raise CommError("argument 't' of reduce_scatter must have at least one dimension")
        rows = split_sizes(t.shape[0], self._size)
        row = t[0].numel() if t.shape[0] else 0
        staged = _staged(t)
        src = t.to(_WIDE[t.dtype]) if staged else t
        out = torch.empty((rows[self._rank], *t.shape[1:]), dtype=src.dtype, device=t.device)
        if t.numel():
            self._comm.Reduce_scatter(_buf(src), _buf(out), [r * row for r in rows], op=_op(op, t.dtype))
        if op == "avg":
            out.div_(self._size)
        return out.to(t.dtype) if staged else out

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        self._check(send, "send")
        if (not send.is_cpu or self._stage_cpu) and self._staged_call(send):
            host, staging = self._stage(send, "send")
            return staging.out(send, lambda h: host.alltoallv(h, send_counts, recv_counts))
        if send.dim() == 0:
            raise CommError("argument 'send' of alltoallv must have at least one dimension")
        sc = self._check_counts(send_counts, "send_counts", rows=send.shape[0])
        rc = self._check_counts(recv_counts, "recv_counts")
        row = int(torch.Size(send.shape[1:]).numel()) * _items(send.dtype)  # MPI items per row
        out = torch.empty((sum(rc), *send.shape[1:]), dtype=send.dtype, device=send.device)
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
        if (not t.is_cpu or self._stage_cpu) and self._staged_call(t):
            host, staging = self._stage(t, "t")
            h = staging.to_host(t)
            try:
                host.send(h, dest, tag)
            finally:
                staging.give(h)
            return
        self._check_rank(dest, "dest")
        self._comm.Send(_buf(t), dest=dest, tag=tag)

    def recv(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        self._check(t, "t")
        if (not t.is_cpu or self._stage_cpu) and self._staged_call(t):
            host, staging = self._stage(t, "t")
            return staging.inplace(t, lambda h: host.recv(h, source, tag), read=False)
        self._check_rank(source, "source")
        self._comm.Recv(_buf(t), source=source, tag=tag)
        return t

    def sendrecv(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                 sendtag: int = 0, recvtag: int = 0) -> torch.Tensor:
        self._check(send, "send")
        self._check(recv, "recv")
        if (not send.is_cpu or not recv.is_cpu or self._stage_cpu) and \
                (self._staged_call(send) or self._staged_call(recv)):
            return self._staged_sendrecv(send, dest, recv, source, sendtag, recvtag)
        self._check_rank(dest, "dest")
        self._check_rank(source, "source")
        self._comm.Sendrecv(_buf(send), dest, sendtag, _buf(recv), source, recvtag)
        return recv

    def _staged_sendrecv(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                         sendtag: int, recvtag: int) -> torch.Tensor:
        host, staging = self._stage(send, "send")
        self._check(recv, "recv")
        hs = staging.to_host(send)
        try:
            staging.inplace(recv, lambda hr: host.sendrecv(hs, dest, hr, source, sendtag, recvtag), read=False)
        finally:
            staging.give(hs)
        return recv

    # -- nonblocking ---------------------------------------------------------------------------
    def _staged_request(self, t: torch.Tensor, start: Callable[[torch.Tensor], Request], staging: Staging,
                        read: bool = True, write: bool = True) -> Request:
        """Start `start` on a host mirror of `t`; on completion the mirror is copied back into `t` (when
        `write`) and returned for reuse."""
        h = staging.to_host(t) if read else staging.take(t)
        try:
            req = start(h)
        except BaseException:
            staging.give(h)
            raise
        finish = (lambda: staging.back(t, h)) if write else (lambda: staging.give(h))
        return _CallbackRequest(req.wait, req.test, t if write else None, finish, keep=h, cancel=req.cancel)

    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request:
        self._check(t, "t", op)
        if (not t.is_cpu or self._stage_cpu) and self._size > 1 and self._staged_call(t, reduce=True):
            host, staging = self._stage(t, "t", op)
            return self._staged_request(t, lambda h: host.iallreduce(h, op), staging)
        if not t.numel() or self._size == 1:
            return _DoneRequest(t.div_(self._size) if op == "avg" else t)
        staged = _staged(t)
        work = t.to(_WIDE[t.dtype]) if staged else t
        hier = self._hierarchical(work)
        mpi_op = _op(op, t.dtype)
        job = hier.submit(_buf(work), work, mpi_op, op in ("sum", "avg")) if hier is not None else None
        reqs = [] if job is not None else [
            self._comm.Iallreduce(MPI.IN_PLACE, _buf(p), op=mpi_op) for p in _pieces(work)]

        def finish() -> None:
            if op == "avg":
                work.div_(self._size)
            if staged:
                t.copy_(work)

        if hier is not None and job is not None:
            return _CallbackRequest(lambda: hier.wait(job), lambda: hier.finished(job), t,
                                    finish, keep=work)
        return _CallbackRequest(lambda: MPI.Request.Waitall(reqs), lambda: MPI.Request.Testall(reqs), t, finish,
                                keep=work)

    def ibroadcast(self, t: torch.Tensor, root: int = 0) -> Request:
        self._check(t, "t")
        self._check_rank(root, "root")
        if (not t.is_cpu or self._stage_cpu) and self._size > 1 and self._staged_call(t):
            host, staging = self._stage(t, "t")
            return self._staged_request(t, lambda h: host.ibroadcast(h, root), staging)
        if not t.numel() or self._size == 1:
            return _DoneRequest(t)
        req = self._comm.Ibcast(_buf(t), root=root)
        return _CallbackRequest(req.Wait, req.Test, t)

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Request:
        self._check(t, "t")
        self._check_rank(dest, "dest")
        if (not t.is_cpu or self._stage_cpu) and self._staged_call(t):
            host, staging = self._stage(t, "t")
            if _thread_multiple():  # the copy to the host waits for t's producer: off this thread
                if self._sends is None:
                    self._sends = StagedSends(staging, host.isend, self.abort, f"rank {self._rank}")
                return self._sends.isend(t, dest, tag)
            return self._staged_request(t, lambda h: host.isend(h, dest, tag), staging, write=False)
        req = self._comm.Isend(_buf(t), dest=dest, tag=tag)
        return _CallbackRequest(req.Wait, req.Test, None, keep=t)

    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Request:
        self._check(t, "t")
        self._check_rank(source, "source")
        if (not t.is_cpu or self._stage_cpu) and self._staged_call(t):
            host, staging = self._stage(t, "t")
            return self._staged_request(t, lambda h: host.irecv(h, source, tag), staging, read=False)
        req = self._comm.Irecv(_buf(t), source=source, tag=tag)
        return _CallbackRequest(req.Wait, req.Test, t, cancel=req.Cancel)

    # -- groups and objects --------------------------------------------------------------------
    def split(self, color: int | None, key: int = 0) -> MPICommunicator | None:
        self._check_open()
        sub = self._comm.Split(MPI.UNDEFINED if color is None else int(color), int(key))
        return None if sub == MPI.COMM_NULL else MPICommunicator(cast(MPI.Intracomm, sub), _direct=self._direct)

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
        if self._sends is not None:
            self._sends.close()
            self._sends = None
        if self._hierarchy is not None and not self._closed:
            self._hierarchy.close()
        if not self._closed and self._comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self._comm.Free()
        if self._staged_to is not None:
            self._staged_to._closed = True  # shares our MPI communicator
        self._closed = True


@functools.cache
def _thread_multiple() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE (staged sends post from a worker thread)."""
    return bool(MPI.Query_thread() == MPI.THREAD_MULTIPLE)


@functools.cache
def _default_direct() -> frozenset[str]:
    """CPU, plus CUDA when the MPI library reads device memory (asked once per process)."""
    return frozenset({"cpu", "cuda"}) if mpi_cuda_aware() else frozenset({"cpu"})
