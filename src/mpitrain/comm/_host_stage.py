"""The intra-host stages of the hierarchical allreduce for large floating sums, through one file in the
host's shared memory (/dev/shm) that every rank of the host maps, instead of ``MPI_Reduce``/``MPI_Bcast``.

Every rank of the host owns a slot of the file. A non-leader copies its tensor into its slot, tells the
leader (a zero-byte message), sleeps until the leader says the result is in the leader's slot, and
copies it out. The leader hands the others' slots to the leaders' ring, which adds them chunk by chunk
while its transfers run (:func:`mpitrain.comm.ring.ring_allreduce`'s `addends`), and copies each chunk
of the result into its slot as soon as the ring has it final (`on_final`), also while the ring still
transfers. So each byte is copied twice and added once on the host, overlapped with the network,
where Open MPI's reduce and broadcast over its shared-memory transport copy it several times before the
ring may start and after it ends, and the non-leaders wait asleep while the ring runs, leaving the cores
to the leaders and the network stack (measurements: docs/multihost.md). A plain file rather than an MPI
shared-memory window: Open MPI 5.0's wheel prints an error from its UCX one-sided component at every
window allocation.

Slots only grow (to the largest allreduce seen; growing is collective over the host, so every rank grows
at the same call, as every rank runs the same allreduces in the same order). A slot is rewritten only
after the previous allreduce's messages: a non-leader writes after it received "done" (the leader
finished reading its slot before that), the leader writes after every non-leader said "ready" for the
next one (each had copied the previous result out before that). The messages order the memory accesses
(their completion involves the transport's memory barriers).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
from collections.abc import Callable
from typing import Protocol

import torch
from mpi4py import MPI

from .._utils.stall import StallPolicy, poll

__all__ = ["HostStage", "SHM_DIR"]

#: Where the slots live: a file in the host's shared memory, unlinked as soon as every rank mapped it.
SHM_DIR = "/dev/shm"
#: Tags of the two zero-byte messages on the host's communicator.
_READY_TAG, _DONE_TAG = 7312, 7313
#: How a waiting rank tests for its message: sleeps of at most 1 ms in between (the stages this waits
#: for move megabytes: copies, the ring across hosts).
_ASLEEP = StallPolicy(max_nap=1e-3)


def _signal(comm: MPI.Comm, dests: range | list[int], tag: int) -> None:
    MPI.Request.Waitall([comm.Isend([None, 0, MPI.BYTE], d, tag=tag) for d in dests])


def _await(comm: MPI.Comm, sources: range | list[int], tag: int) -> None:
    reqs = [comm.Irecv([None, 0, MPI.BYTE], s, tag=tag) for s in sources]
    poll(lambda: bool(MPI.Request.Testall(reqs)), _ASLEEP)


class Across(Protocol):
    """The leaders' part, run on a host's leader: see :meth:`HostStage.allreduce`."""

    def __call__(self, flat: torch.Tensor, others: list[torch.Tensor],
                 on_final: Callable[[int, int], object]) -> object: ...


class HostStage:
    """The shared slots of one host's ranks (`node`, leader = rank 0). Construction is not collective;
    `allreduce` is (over `node`)."""

    @staticmethod
    def available() -> bool:
        """Whether this host has the shared memory the stage lives in (the same verdict on its ranks)."""
        return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)

    def __init__(self, node: MPI.Comm) -> None:
        self.node = node
        self.rank, self.size = node.Get_rank(), node.Get_size()
        self._map: mmap.mmap | None = None
        self._capacity = 0
        self._slots: list[torch.Tensor] = []  # bytes of each rank's slot

    def allreduce(self, flat: torch.Tensor, across: Across) -> None:
        """Sum the contiguous 1-D floating `flat` in place over the host's ranks. On the leader
        ``across(flat, others, on_final)`` must leave in `flat` the global sum of ``flat + sum(others)``
        (`others`: the other ranks' tensors, in host-rank order; the leaders' ring adds them chunk by chunk
        while it transfers) and call ``on_final(lo, hi)`` once for every element, as soon as
        ``flat[lo:hi]`` is final (it copies that range into the leader's slot). Every rank of the host must
        call it, in the same order as its other allreduces."""
        nbytes = flat.numel() * flat.element_size()
        self._reserve(nbytes)
        mine = self._slots[self.rank][:nbytes].view(flat.dtype)
        if self.rank:
            mine.copy_(flat)
            _signal(self.node, [0], _READY_TAG)
            _await(self.node, [0], _DONE_TAG)
            flat.copy_(self._slots[0][:nbytes].view(flat.dtype))
            return
        _await(self.node, range(1, self.size), _READY_TAG)

        def on_final(lo: int, hi: int) -> None:
            mine[lo:hi].copy_(flat[lo:hi])

        across(flat, [self._slots[r][:nbytes].view(flat.dtype) for r in range(1, self.size)], on_final)
        _signal(self.node, range(1, self.size), _DONE_TAG)

    def _reserve(self, nbytes: int) -> None:
        """Slots of at least `nbytes` (collective over the host when they must grow): the leader creates a
        file in /dev/shm holding every rank's slot, the others map it, then the leader unlinks it (the
        mapping lives on until closed, and nothing is left behind should a rank die)."""
        if nbytes <= self._capacity:
            return
        self.close()
        capacity = max(nbytes, 2 * self._capacity)
        path = ""
        if self.rank == 0:
            path = os.path.join(SHM_DIR, f"mpitrain-host-stage-{os.getpid()}-{uuid.uuid4().hex}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, capacity * self.size)
            finally:
                os.close(fd)
        path = self.node.bcast(path, root=0)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), capacity * self.size)
        self.node.Barrier()
        if self.rank == 0:
            os.unlink(path)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self._slots = list(whole.split(capacity))
        self._capacity = capacity

    def close(self) -> None:
        """Unmap the slots (not collective)."""
        self._slots, self._capacity = [], 0
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still alive somewhere: unmapped when collected
                self._map.close()
            self._map = None
