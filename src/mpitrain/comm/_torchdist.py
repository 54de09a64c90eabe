"""The torch.distributed backend: gloo for CPU tensors and, where torch sees a GPU, NCCL for CUDA tensors
within the same job (one process group per communicator holding both backends, torch's
``"cpu:gloo,cuda:nccl"``: each call goes to the backend of its tensor's device). Same surface as the MPI one.

CUDA tensors follow torch.distributed's stream rule: a call is ordered on the calling thread's current
stream, and a request's ``wait`` orders that stream after the collective (NCCL's ``work.wait``)."""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ._rendezvous import choose_address, host_leaders, interfaces, route_interface
from .base import CommError, Communicator, Request, _CallbackRequest, _DoneRequest, split_sizes

__all__ = ["TorchCommunicator", "init_torch_world", "torchrun_env"]

#: The default group's backends where torch sees a GPU: gloo for CPU tensors, NCCL for CUDA ones.
_BOTH = "cpu:gloo,cuda:nccl"

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}

#: Dtypes gloo's collectives take themselves. Every other dtype moves as the bytes of its own storage (a
#: uint8 view: no copy), and the integers among them reduce in a wider copy (_WIDE) or, uint64, as int64 words.
_NATIVE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                     torch.int32, torch.int64, torch.bool, torch.complex32, torch.complex64, torch.complex128})
#: The dtype a reduction of these runs in: exact for max/min, and sum/prod wrap alike once cast back.
_WIDE = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_SIGN = -(1 << 63)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """`t` as gloo moves it: itself for a native dtype, else a uint8 view of its storage that keeps dim 0
    (rows stay rows for allgather and alltoallv's counts)."""
    if t.dtype in _NATIVE:
        return t
    rows = t.shape[0] if t.dim() else 1
    return t.reshape(rows, t.numel() // rows if rows else int(torch.Size(t.shape[1:]).numel())).view(torch.uint8)


def _flip(t: torch.Tensor) -> torch.Tensor:
    """A uint64 tensor's int64 view with the sign bit flipped in place (an involution): signed order of the
    flipped words is the unsigned order of the values, so int64 max/min reduce uint64 exactly."""
    return t.view(torch.int64).bitwise_xor_(_SIGN)


def init_torch_world(rank: int, size: int, bootstrap: Communicator | None) -> TorchCommunicator:
    """Start the default process group. Under torchrun (MASTER_ADDR set) use env://; under mpiexec
    rank 0 picks a free port and tells the others through `bootstrap` (the MPI world).

    No host name is resolved: on one host the group meets on 127.0.0.1 over the loopback interface;
    across hosts (per MPI's shared-memory split) it meets at rank 0's address on the network MPI's TCP
    traffic uses (``btl_tcp_if_include``/``oob_tcp_if_include`` when set), and gloo is told the interface
    that reaches it (``GLOO_SOCKET_IFNAME``, unless the user set it). Collective over `bootstrap`."""
    backend = _BOTH if torch.cuda.is_available() and os.environ.get("MPITRAIN_TORCH_BACKEND") != "gloo" else "gloo"
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size)
        else:
            if bootstrap is None:
                raise CommError("backend 'torch' needs MASTER_ADDR/MASTER_PORT (torchrun) or an MPI job to bootstrap")
            host, port, ifname = _rendezvous(bootstrap)
            if ifname is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
            dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size)
        # Tear the groups down before interpreter shutdown: gloo threads touching freed Python
        # objects at exit abort the process (seen here with sub-groups alive at exit).
        atexit.register(dist.destroy_process_group)
    return TorchCommunicator(None, list(range(size)))


def torchrun_env(bootstrap: Communicator) -> dict[str, str]:
    """The environment ``torchrun`` gives this rank, for the MPI job of `bootstrap`: RANK, WORLD_SIZE,
    LOCAL_RANK and LOCAL_WORLD_SIZE (ranks sharing a host, per MPI's shared-memory split), GROUP_RANK (the
    host's index), MASTER_ADDR and MASTER_PORT (the rendezvous backend 'torch' uses: loopback on one host,
    rank 0's address on MPI's network across hosts) and GLOO_SOCKET_IFNAME where that route is known.
    A script written for ``torchrun`` (``init_process_group(init_method="env://")``) then runs under
    MPI unchanged (``mpitrain run --torch-env``). Collective over `bootstrap`; the same on every rank but
    for the per-rank values."""
    leaders = host_leaders(_mpi_comm(bootstrap))
    host, port, ifname = _rendezvous(bootstrap)
    me, mine = bootstrap.rank, leaders[bootstrap.rank]
    local = [r for r, leader in enumerate(leaders) if leader == mine]
    env = {"RANK": str(me), "WORLD_SIZE": str(bootstrap.size), "LOCAL_RANK": str(local.index(me)),
           "LOCAL_WORLD_SIZE": str(len(local)), "GROUP_RANK": str(sorted(set(leaders)).index(mine)),
           "MASTER_ADDR": host, "MASTER_PORT": str(port)}
    if ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return env


def _rendezvous(bootstrap: Communicator) -> tuple[str, int, str | None]:
    """(address, port, this rank's interface name or None) to meet at; the same verdict on every rank."""
    leaders = host_leaders(_mpi_comm(bootstrap))
    mine = interfaces()
    port = None
    if bootstrap.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    port = bootstrap.broadcast_object(port)
    if len(set(leaders)) == 1:
        return "127.0.0.1", port, next((m.name for m in mine if m.loopback), None)
    # Every rank must agree on rank 0's address: rank 0 decides from every host's interfaces and MPI's
    # restriction, and broadcasts it (an error too, so every rank raises it).
    seen = bootstrap.allgather_object(mine)
    addr: str | LookupError | None = None
    if bootstrap.rank == 0:
        others = [seen[r] for r in sorted(set(leaders)) if leaders[r] != leaders[0]]
        try:
            addr = choose_address(mine, others)
        except LookupError as e:
            addr = e
    addr = bootstrap.broadcast_object(addr)
    if isinstance(addr, LookupError):
        raise CommError(f"backend 'torch' across hosts: {addr}")
    return addr, port, route_interface(addr, mine)


def _same_host(bootstrap: Communicator) -> bool:
    """Whether every rank of `bootstrap` runs on one host, per MPI's shared-memory split (not host names,
    which different hosts may share). Collective over `bootstrap`."""
    return len(set(host_leaders(_mpi_comm(bootstrap)))) == 1


def _mpi_comm(bootstrap: Communicator) -> Any:
    mpi_comm = getattr(bootstrap, "mpi_comm", None)
    if mpi_comm is None:
        raise CommError("deciding which ranks share a host needs an MPI bootstrap communicator")
    return mpi_comm


class TorchCommunicator(Communicator):
    """A Communicator over a torch.distributed process group (None = the default world group)."""

    backend = "torch"

    def __init__(self, group: Any, ranks: list[int]) -> None:
        self._group = group
        self._ranks = ranks  # global rank of each group rank
        self._rank = dist.get_rank(group)
        self._devices = ("cpu", "cuda") if "nccl" in str(dist.get_backend_config(group)) else ("cpu",)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return len(self._ranks)

    def _c(self, t: Any, name: str, op: str | None = None) -> None:
        self._check(t, name, op, devices=self._devices)

    def _g(self, r: int) -> int:
        return self._ranks[r]

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.iallreduce(t, op).wait()
        return t  # reduced in place

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        self.ibroadcast(t, root).wait()
        return t

    def allgather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        self._c(t, "t")
        src = t.reshape(1) if t.dim() == 0 else t
        out = self._gather_out(src, out)
        if out.numel():  # gloo reads the input while writing the output: a block of `out` goes as a copy
            shared = src.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
            dist.all_gather_single(_wire(out), _wire(src).clone() if shared else _wire(src), group=self._group)
        return out

    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self._c(t, "t", op)
        if t.dim() == 0:
            raise CommError("argument 't' of reduce_scatter must have at least one dimension")
        if t.dtype in _WIDE or t.dtype == torch.uint64:  # through a copy gloo reduces (see iallreduce)
            full = t.clone()
            self.allreduce(full, op)
            rows = split_sizes(t.shape[0], self.size)
            start = sum(rows[: self._rank])
            return full[start:start + rows[self._rank]].clone()
        rows = split_sizes(t.shape[0], self.size)
        start = sum(rows[: self._rank])
        if t.numel() and t.shape[0] % self.size == 0:
            out = torch.empty((rows[self._rank], *t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.reduce_scatter_single(out, t, op=_OPS[op], group=self._group)
        else:  # gloo has no uneven reduce-scatter: reduce a copy, keep our block
            full = t.clone()
            if t.numel():
                dist.all_reduce(full, op=_OPS[op], group=self._group)
            out = full[start:start + rows[self._rank]].clone()
        return out.div_(self.size) if op == "avg" else out

    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        self._c(send, "send")
        if send.dim() == 0:
            raise CommError("argument 'send' of alltoallv must have at least one dimension")
        sc = self._check_counts(send_counts, "send_counts", rows=send.shape[0])
        rc = self._check_counts(recv_counts, "recv_counts")
        out = torch.empty((sum(rc), *send.shape[1:]), dtype=send.dtype, device=send.device)
        dist.all_to_all_single(_wire(out), _wire(send), rc, sc, group=self._group)
        return out

    def barrier(self) -> None:
        self._check_open()
        dist.barrier(group=self._group)

    # -- point to point ------------------------------------------------------------------------
    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None:
        self.isend(t, dest, tag).wait()

    def recv(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        self.irecv(t, source, tag).wait()
        return t

    def sendrecv(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                 sendtag: int = 0, recvtag: int = 0) -> torch.Tensor:
        self._c(send, "send")
        self._c(recv, "recv")
        r = self.irecv(recv, source, recvtag)
        s = self.isend(send, dest, sendtag)
        s.wait()
        r.wait()
        return recv

    # -- nonblocking ---------------------------------------------------------------------------
    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request:
        self._c(t, "t", op)
        if not t.numel() or self.size == 1:
            return _DoneRequest(t)
        if t.dtype in _WIDE:  # gloo has no such integer words: reduce a wider copy, cast back (wraps alike)
            wide = t.to(_WIDE[t.dtype])
            work = dist.all_reduce(wide, op=_OPS[op], group=self._group, async_op=True)
            return _CallbackRequest(work.wait, work.is_completed, t, lambda: t.copy_(wide), keep=wide)
        if t.dtype == torch.uint64:  # as int64 words: sum and prod wrap alike; max/min on flipped sign bits
            order = op in ("max", "min")
            words = _flip(t) if order else t.view(torch.int64)
            work = dist.all_reduce(words, op=_OPS[op], group=self._group, async_op=True)
            return _CallbackRequest(work.wait, work.is_completed, t, (lambda: _flip(t)) if order else None)
        work = dist.all_reduce(t, op=_OPS[op], group=self._group, async_op=True)
        finish = (lambda: t.div_(self.size)) if op == "avg" else None
        return _CallbackRequest(work.wait, work.is_completed, t, finish)

    def ibroadcast(self, t: torch.Tensor, root: int = 0) -> Request:
        self._c(t, "t")
        self._check_rank(root, "root")
        if not t.numel() or self.size == 1:
            return _DoneRequest(t)
        work = dist.broadcast(_wire(t), src=self._g(root), group=self._group, async_op=True)
        return _CallbackRequest(work.wait, work.is_completed, t)

    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Request:
        self._c(t, "t")
        self._check_rank(dest, "dest")
        work = dist.isend(_wire(t), dst=self._g(dest), group=self._group, tag=tag)
        return _p2p_request(work, None, t)

    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Request:
        self._c(t, "t")
        self._check_rank(source, "source")
        work = dist.irecv(_wire(t), src=self._g(source), group=self._group, tag=tag)
        return _p2p_request(work, t, t)

    # -- groups and objects --------------------------------------------------------------------
    def split(self, color: int | None, key: int = 0) -> TorchCommunicator | None:
        self._check_open()
        if self._group is not None:
            raise CommError("the torch backend can split only the world communicator (torch.distributed "
                            "groups are created by every world rank); use the mpi backend for nested splits")
        entries = self.allgather_object((color, int(key)))
        mine = None
        # new_group is collective over the world: every rank creates every group, in color order.
        for c in sorted({c for c, _ in entries if c is not None}):
            members = [r for _, r in sorted((k, r) for r, (c2, k) in enumerate(entries) if c2 == c)]
            if members != sorted(members):
                raise CommError("the torch backend orders a group's ranks by world rank (torch sorts them); a "
                                "`key` that reorders ranks is not supported, use the mpi backend")
            group = dist.new_group(members)
            if c == color:
                mine = TorchCommunicator(group, members)
        return mine

    def allgather_object(self, obj: Any) -> list[Any]:
        self._check_open()
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        self._check_open()
        self._check_rank(root, "root")
        box = [obj]
        dist.broadcast_object_list(box, src=self._g(root), group=self._group)
        return box[0]

    def send_object(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Pickles `obj` and sends its length, then its bytes, both on `tag` (blocking). Not torch's
        ``send_object_list``, which has no tag: tagged objects keep a library's messages (the timeline's
        gather) apart from the user's. Gloo's send waits for the matching receive, so unlike MPI's eager
        small sends, a receiver taking tags in another order than they were sent deadlocks."""
        self._check_open()
        self._check_rank(dest, "dest")
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        self.send(torch.tensor([data.numel()], dtype=torch.int64), dest, tag)
        self.send(data, dest, tag)

    def recv_object(self, source: int, tag: int = 0) -> Any:
        """The object :meth:`send_object` sent from `source` on `tag` (blocking)."""
        self._check_open()
        self._check_rank(source, "source")
        n = torch.empty(1, dtype=torch.int64)
        self.recv(n, source, tag)
        data = torch.empty(int(n), dtype=torch.uint8)
        self.recv(data, source, tag)
        return pickle.loads(data.numpy().tobytes())

    def abort(self, code: int = 1) -> None:
        try:
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(code or 1)
        finally:
            os._exit(code or 1)

    def free(self) -> None:
        self._closed = True


def _p2p_request(work: Any, out: torch.Tensor | None, keep: torch.Tensor) -> Request:
    """Gloo's send/recv work reports completion only inside wait(), so test() could never succeed:
    a helper thread waits, and test() asks whether it has finished. Errors reach wait()'s caller.
    NCCL's work (CUDA tensors) reports completion itself: no thread (NCCL ignores tags; order matches)."""
    if keep.is_cuda:
        return _CallbackRequest(work.wait, work.is_completed, out, keep=keep)
    error: list[BaseException] = []

    def run() -> None:
        try:
            work.wait()
        except BaseException as e:  # handed to the waiter below, never swallowed
            error.append(e)

    waiter = threading.Thread(target=run, daemon=True, name="mpitrain-p2p-wait")
    waiter.start()

    def wait() -> None:
        waiter.join()
        if error:
            raise error[0]

    return _CallbackRequest(wait, lambda: not waiter.is_alive(), out, keep=keep)
