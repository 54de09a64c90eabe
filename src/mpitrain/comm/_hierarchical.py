"""Hierarchical allreduce for ranks spread over several hosts.

Three stages: reduce onto one leader per host over shared memory (``MPI_Reduce`` on the host's
``COMM_TYPE_SHARED`` communicator), allreduce among the leaders across the network, broadcast from the
leader inside each host. Across the network each link then carries a host's data once instead of once
per rank, and the leaders' allreduce is chosen by size: below :data:`RING_ABOVE` bytes Open MPI's
allreduce (latency-bound; its recursive doubling), above it our pipelined ring
(:func:`mpitrain.comm.ring.ring_allreduce`: reduce-scatter + allgather, 2S(n-1)/n bytes per link, the
bandwidth floor), which Open MPI's default over TCP does not reach (docs/multihost.md). Ring allreduces
of at least :data:`SHARED_STAGES_ABOVE` bytes do the host stages through shared memory instead
(:mod:`._host_stage`: the ring adds the host's other tensors while it transfers, the other ranks wait
asleep); the result is bitwise the same.

Called by the MPI backend (:class:`~mpitrain.comm._mpi.MPICommunicator`, which hands it a way to
make the leaders' communicator for the ring: this module imports no backend) for allreduces of at
least :data:`HIERARCHY_ABOVE` bytes when its ranks span more than one host (:func:`Hierarchy.applies`).
All stages run on private duplicates of the communicators, on one worker thread per communicator, in
submission order (a blocking allreduce issued while none is queued or running runs on the calling
thread instead): a blocking and a nonblocking allreduce issued in the same order on every rank match,
and the caller's own collectives on the parent communicator never interleave with these. The first allreduce of at least
:data:`HIERARCHY_ABOVE` bytes on a communicator finds its hosts (a collective), so that one call blocks
until every rank has issued it, even when nonblocking.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from mpi4py import MPI

from .._utils.stall import watched
from ._host_stage import HostStage
from .base import Communicator
from .ring import ring_allreduce

__all__ = ["Hierarchy", "HIERARCHY_ABOVE", "RING_ABOVE", "SHARED_STAGES_ABOVE", "ring_chunk_bytes"]

#: Allreduces smaller than this stay flat (one Open MPI call): latency, not bandwidth, dominates them.
HIERARCHY_ABOVE = 256 << 10
#: The leaders' allreduce is our ring from this size (floating sum/avg), Open MPI's below it.
RING_ABOVE = 1 << 20
#: From this size the host stages of a ring allreduce go through shared memory (HostStage); below it the
#: non-leaders' sleeping waits cost more than the copies they save (docs/multihost.md).
SHARED_STAGES_ABOVE = 4 << 20
#: Below :data:`BLOCK_CHUNKS_ABOVE` bytes the leaders' ring sends chunks of this size: under Open MPI's
#: default TCP eager limit (64 KiB including its header), so each goes out at once, where a larger message
#: first waits for the receiver to answer a rendezvous, which a rank busy in Python or asleep answers late
#: (4 MiB over 4 hosts: 0.85 of the floor against 0.72 with 256 KiB chunks; docs/multihost.md).
EAGER_CHUNK_BYTES = 64000
BLOCK_CHUNKS_ABOVE = 16 << 20
#: From :data:`BLOCK_CHUNKS_ABOVE` bytes the leaders' ring cuts each host's block into chunks of an eighth
#: of it, within these bounds: larger chunks cost fewer messages and Python steps per byte (the ring is
#: CPU-bound where cores are scarce), smaller ones fill the pipeline sooner (docs/multihost.md).
RING_CHUNK_BYTES = (256 << 10, 1 << 20)
#: With the shared-memory host stages (the other ranks asleep), the leaders' ring waits for each message
#: with sleeps of at most this long between tests, instead of Open MPI's busy polling: across hosts the
#: kernel moves the bytes, and a polling leader takes a core from the network stack and the other ranks
#: where cores are scarce. Not with the MPI host stages, whose non-leaders spin in MPI_Bcast meanwhile: a
#: sleeping leader waits for a core there (measurements: docs/multihost.md).
RING_NAP_S = 2e-4
#: A wait on the worker longer than this warns (naming the tensor size), as every blocking wait does.
_WARN_S = 60.0


def ring_chunk_bytes(nbytes: int, hosts: int) -> int:
    """Chunk size of the leaders' ring for an allreduce of `nbytes` over `hosts` hosts (see
    :data:`EAGER_CHUNK_BYTES`, :data:`RING_CHUNK_BYTES`); the same on every rank."""
    if nbytes < BLOCK_CHUNKS_ABOVE:
        return EAGER_CHUNK_BYTES
    lo, hi = RING_CHUNK_BYTES
    return min(hi, max(lo, nbytes // max(hosts, 1) // 8))


@dataclass
class _Job:
    buf: list[Any]  # [numpy array, MPI datatype] of the contiguous tensor, reduced in place
    tensor: torch.Tensor
    op: Any  # MPI.Op
    ring: bool
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Hierarchy:
    """The host structure of an MPI communicator and the worker that runs hierarchical allreduces on it.

    Construction is collective over `comm` (every rank must construct it, in the same order relative to
    other collectives on `comm`). `ring_comm` makes the leaders' communicator for the ring (point-to-point
    calls on host memory only: a backend without the hierarchy). `host_of` (tests only) groups ranks into
    hosts by this number instead of by shared memory, so one machine can check the algorithm against a
    flat allreduce."""

    def __init__(self, comm: MPI.Intracomm, *, ring_comm: Callable[[MPI.Intracomm], Communicator],
                 host_of: int | None = None) -> None:
        rank = comm.Get_rank()
        self.node = (comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank) if host_of is None
                     else comm.Split(host_of, key=rank))
        self.is_leader = self.node.Get_rank() == 0
        leaders = comm.Split(0 if self.is_leader else MPI.UNDEFINED, key=rank)
        self.leaders: MPI.Intracomm | None = None if leaders == MPI.COMM_NULL else MPI.Intracomm(leaders)
        sizes = comm.allgather(self.node.Get_size() if self.is_leader else 0)
        self.host_sizes = [s for s in sizes if s]  # ranks per host, hosts in order of their lowest rank
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._state = threading.Lock()  # guards _pending
        self._pending = 0  # allreduces submitted or running inline, not finished
        self._executing = threading.Lock()  # held by whichever thread runs an allreduce's stages
        self._ring_factory = ring_comm
        self._leader_comm: Communicator | None = None
        self._stage = HostStage(self.node)
        self._shared = all(self.node.allgather(HostStage.available()))

    @property
    def hosts(self) -> int:
        return len(self.host_sizes)

    def applies(self, nbytes: int) -> bool:
        """Whether an allreduce of `nbytes` goes hierarchical (the same verdict on every rank)."""
        return self.hosts > 1 and nbytes >= HIERARCHY_ABOVE

    def _job(self, buf: list[Any], tensor: torch.Tensor, op: Any, ring_ok: bool) -> _Job:
        ring = ring_ok and tensor.is_floating_point() and tensor.numel() * tensor.element_size() >= RING_ABOVE
        return _Job(buf, tensor, op, ring)

    def submit(self, buf: list[Any], tensor: torch.Tensor, op: Any, ring_ok: bool) -> _Job:
        """Queue an in-place allreduce of `buf` (which views `tensor`); returns the job to wait on.
        `ring_ok`: the op is a sum, so the leaders may use the ring (for floating tensors)."""
        job = self._job(buf, tensor, op, ring_ok)
        with self._state:
            self._pending += 1
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="mpitrain-hierarchical-allreduce", daemon=True)
            self._worker.start()
        self._queue.put(job)
        return job

    def allreduce(self, buf: list[Any], tensor: torch.Tensor, op: Any, ring_ok: bool) -> None:
        """A blocking :meth:`submit` + :meth:`wait`. When no earlier allreduce is queued or running it runs
        on the calling thread (in order all the same: every later one waits for it), saving the hand-over
        to the worker and back (measured: docs/multihost.md)."""
        with self._state:
            inline = self._pending == 0
            if inline:
                self._pending += 1
                self._executing.acquire()  # before the state lock is released: a later job waits for it
        if not inline:
            self.wait(self.submit(buf, tensor, op, ring_ok))
            return
        try:
            with watched("hierarchical allreduce", f"{tensor.numel() * tensor.element_size()} bytes; are all ranks "
                         "calling the same allreduce?", _WARN_S):
                self._allreduce(self._job(buf, tensor, op, ring_ok))
        finally:
            self._executing.release()
            with self._state:
                self._pending -= 1

    def wait(self, job: _Job) -> None:
        """Block until `job` is done; re-raises its error. Warns if it takes longer than a minute."""
        if not job.done.is_set():
            nbytes = job.tensor.numel() * job.tensor.element_size()
            with watched("hierarchical allreduce", f"{nbytes} bytes; are all ranks calling the same allreduce?",
                         _WARN_S):
                job.done.wait()
        if job.error is not None:
            raise job.error

    def finished(self, job: _Job) -> bool:
        """Whether `job` is done (without blocking); re-raises its error once it is."""
        if not job.done.is_set():
            return False
        if job.error is not None:
            raise job.error
        return True

    def close(self) -> None:
        """Stop the worker (after the queued jobs) and free the communicators."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None
        self._stage.close()
        for c in (self.leaders, self.node):
            if c is not None:
                c.Free()
        self.leaders = None

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                with self._executing:
                    self._allreduce(job)
            except BaseException as e:  # handed to the waiting caller, never swallowed
                job.error = e
            finally:
                with self._state:
                    self._pending -= 1
                job.done.set()

    def _allreduce(self, job: _Job) -> None:
        nbytes = job.tensor.numel() * job.tensor.element_size()
        if job.ring and self.node.Get_size() > 1 and self._shared and nbytes >= SHARED_STAGES_ABOVE:
            self._stage.allreduce(job.tensor.view(-1), self._across)
            return
        if self.node.Get_size() > 1:
            send = MPI.IN_PLACE if self.is_leader else job.buf
            self.node.Reduce(send, job.buf if self.is_leader else None, op=job.op, root=0)
        if self.leaders is not None and self.leaders.Get_size() > 1:
            if job.ring:
                ring_allreduce(self._ring_comm(), job.tensor.view(-1), chunk_bytes=ring_chunk_bytes(nbytes, self.hosts))
            else:
                self.leaders.Allreduce(MPI.IN_PLACE, job.buf, op=job.op)
        if self.node.Get_size() > 1:
            self.node.Bcast(job.buf, root=0)

    def _across(self, flat: torch.Tensor, others: list[torch.Tensor], on_final: Callable[[int, int], object]
                ) -> None:
        """On a leader: `flat` plus the host's `others`, summed over all hosts by the leaders' ring, calling
        `on_final` on each chunk once it is final (HostStage's contract)."""
        if self.leaders is not None and self.leaders.Get_size() > 1:
            chunk = ring_chunk_bytes(flat.numel() * flat.element_size(), self.hosts)
            ring_allreduce(self._ring_comm(), flat, chunk_bytes=chunk, addends=others, on_final=on_final,
                           nap=RING_NAP_S)
        else:
            for o in others:
                flat.add_(o)
            on_final(0, flat.numel())

    def _ring_comm(self) -> Communicator:
        """The leaders as a Communicator for the ring (its point-to-point calls only)."""
        if self._leader_comm is None:
            assert self.leaders is not None  # only leaders run the ring
            self._leader_comm = self._ring_factory(self.leaders)
        return self._leader_comm
