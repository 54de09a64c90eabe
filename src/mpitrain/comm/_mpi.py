"""The MPI backend: mpi4py buffer calls on the tensors' own memory, no pickling on the hot path.

The bottom of a composed MPI communicator (:mod:`mpitrain.comm.compose`): CPU tensors, and CUDA tensors
handed to MPI as they are (for a CUDA-aware library, :func:`~._cuda.mpi_cuda_aware`), in order on the
calling thread's current stream (see :mod:`._cuda`) and complete for every stream when the call (or the
request's ``wait``) returns. Where MPI cannot read device memory the staging layer above it
(:mod:`._staged`) hands it host mirrors instead. Large allreduces across hosts go through the host
hierarchy (:mod:`._hierarchical`), a hook this backend calls from inside its own allreduce: it works on
the backend's MPI buffers, after its widening copy and before its averaging."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import torch
from mpi4py import MPI

from .._utils.flat import offsets
from ._cuda import host_wait, mpi_cuda_aware
from ._hierarchical import HIERARCHY_ABOVE, Hierarchy
from ._staging import clone_bits
from .base import CommError, Communicator, Request, _CallbackRequest, _DoneRequest, split_sizes

__all__ = ["MPICommunicator", "DEVICES", "default_direct", "pieces", "widened"]

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


def pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` itself, or above SPLIT_ABOVE bytes consecutive flat views of SEGMENT_BYTES (same storage, in order)."""
    if t.numel() * t.element_size() <= SPLIT_ABOVE:
        return [t]
    return list(t.view(-1).split(max(1, SEGMENT_BYTES // t.element_size())))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of `a` and `b` overlaps (MPI forbids aliased send and receive buffers)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def widened(t: torch.Tensor) -> bool:
    """Whether a reduction of `t` must go through a wider copy (MPI cannot add these words: :data:`_WIDE`)."""
    return t.dtype in _WIDE


class MPICommunicator(Communicator):
    """A Communicator over an mpi4py ``Intracomm``: the MPI backend. Thread-safe as far as
    MPI_THREAD_MULTIPLE is.

    Takes CPU tensors, and CUDA tensors handed to MPI as they are: build communicators with
    :func:`mpitrain.comm.compose.mpi_communicator`, which puts the staging layer above this backend where
    MPI cannot read device memory. With `hierarchy` (the default) an allreduce of at least
    :data:`~._hierarchical.HIERARCHY_ABOVE` bytes over ranks on several hosts goes hierarchical
    (:meth:`hierarchy_for`); the leaders' ring runs on a backend without it."""

    backend = "mpi"
    _devices = DEVICES

    def __init__(self, comm: MPI.Intracomm, *, hierarchy: bool = True) -> None:
        self._comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._hierarchical = hierarchy and self._size > 1
        self._hierarchy: Hierarchy | None = None  # hosts and leaders: built by the first large allreduce

    def hierarchy_for(self, t: torch.Tensor) -> Hierarchy | None:
        """The host hierarchy if an allreduce of `t` goes hierarchical (ranks on several hosts, large
        enough; the same verdict on every rank). The first large allreduce builds it (collective)."""
        nbytes = t.numel() * t.element_size()
        if nbytes < HIERARCHY_ABOVE or not self._hierarchical:
            return None
        hier = self.hierarchy()
        return hier if hier.applies(nbytes) else None

    def hierarchy(self) -> Hierarchy:
        """The host hierarchy of this communicator, built by the first call (collective: every rank must
        reach it at the same point of its collectives), whatever the sizes reduced."""
        if self._hierarchy is None:
            self._hierarchy = Hierarchy(self._comm, ring_comm=_ring_comm)
        return self._hierarchy

    def hierarchical_allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`allreduce` through the host hierarchy whatever the size of `t` and however many hosts (the
        reducer's "hierarchical" policy): reduce onto each host's leader, the leaders' allreduce (their
        ring for floating sums of at least RING_ABOVE bytes), broadcast from the leader. On one host only
        the two host stages run: still the reduction on every rank. Host memory only (a device tensor
        goes through a host mirror first: the caller's). bfloat16 reduces in a float32 copy, as
        :meth:`allreduce` does; the same checks (CommError before any message)."""
        self._check(t, "t", op)
        if not t.is_cpu:
            raise CommError(f"hierarchical_allreduce works on host memory, got a tensor on {t.device}")
        work = t.to(_WIDE[t.dtype]) if widened(t) else t
        self._allreduce_inplace(work, op, hierarchy=True)
        if work is not t:
            t.copy_(work)  # one rounding, as allreduce's
        return t

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
        if not widened(t):
            return self._allreduce_inplace(t, op)
        self.iallreduce(t, op).wait()  # through a float32 copy, copied back into t
        return t

    def _allreduce_inplace(self, t: torch.Tensor, op: str, hierarchy: bool = False) -> torch.Tensor:
        """The direct allreduce of a checked `t` (see :meth:`allreduce`); through the host hierarchy where
        :meth:`hierarchy_for` picks it, or always with `hierarchy` (:meth:`hierarchical_allreduce`)."""
        busy = bool(t.numel()) and self._size > 1
        hier = (self.hierarchy() if hierarchy else self.hierarchy_for(t)) if busy else None
        if hier is not None:
            hier.allreduce(_buf(t), t, _op(op, t.dtype), op in ("sum", "avg"))
        elif busy:
            for piece in pieces(t):
                self._comm.Allreduce(MPI.IN_PLACE, _buf(piece), op=_op(op, t.dtype))
        if op == "avg":
            t.div_(self._size)
        return t

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        self._check(t, "t")
        self._check_rank(root, "root")
        if t.numel() and self._size > 1:
            self._comm.Bcast(_buf(t), root=root)
        return t

    def allgather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self._check(t, "t")
        src = t.reshape(1) if t.dim() == 0 else t
        out = self._gather_out(src, out)  # checked before any message
        if out.numel():
            own = out[self._rank * src.shape[0]:(self._rank + 1) * src.shape[0]]
            if src.data_ptr() == own.data_ptr():  # block `rank` of out itself: MPI's in-place allgather
                self._comm.Allgather(MPI.IN_PLACE, _buf(out))
            else:
                # a block of `out` goes as a copy (MPI forbids aliased buffers), of its bytes (int1 ... uint7
                # have no clone kernel), held in `send` while MPI reads it: _buf holds only its address
                send = clone_bits(src) if _overlap(src, out) else src
                self._comm.Allgather(_buf(send), _buf(out))
        return out

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._check(t, "t", op)
        if t.dim() == 0:
            raise CommError("argument 't' of reduce_scatter must have at least one dimension")
        rows = split_sizes(t.shape[0], self._size)
        row = t[0].numel() if t.shape[0] else 0
        staged = widened(t)
        src = t.to(_WIDE[t.dtype]) if staged else t
        out = torch.empty((rows[self._rank], *t.shape[1:]), dtype=src.dtype, device=t.device)
        if t.numel():
            self._comm.Reduce_scatter(_buf(src), _buf(out), [r * row for r in rows], op=_op(op, t.dtype))
        if op == "avg":
            out.div_(self._size)
        return out.to(t.dtype) if staged else out

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        self._check(send, "send")
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
        staged = widened(t)
        work = t.to(_WIDE[t.dtype]) if staged else t
        hier = self.hierarchy_for(work)
        mpi_op = _op(op, t.dtype)
        job = hier.submit(_buf(work), work, mpi_op, op in ("sum", "avg")) if hier is not None else None
        reqs = [] if job is not None else [
            self._comm.Iallreduce(MPI.IN_PLACE, _buf(p), op=mpi_op) for p in pieces(work)]

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
        return _CallbackRequest(req.Wait, req.Test, t, cancel=req.Cancel)

    # -- groups and objects --------------------------------------------------------------------
    def split(self, color: int | None, key: int = 0) -> MPICommunicator | None:
        self._check_open()
        sub = self._comm.Split(MPI.UNDEFINED if color is None else int(color), int(key))
        return None if sub == MPI.COMM_NULL else MPICommunicator(cast(MPI.Intracomm, sub),
                                                                      hierarchy=self._hierarchical)

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
        if self._hierarchy is not None and not self._closed:
            self._hierarchy.close()
        if not self._closed and self._comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self._comm.Free()
        self._closed = True


def _ring_comm(leaders: MPI.Intracomm) -> MPICommunicator:
    """The hierarchy's leaders as a communicator for its ring (point-to-point on host memory only)."""
    return MPICommunicator(leaders, hierarchy=False)


@functools.cache
def default_direct() -> frozenset[str]:
    """CPU, plus CUDA when the MPI library reads device memory (asked once per process)."""
    return frozenset({"cpu", "cuda"}) if mpi_cuda_aware() else frozenset({"cpu"})
