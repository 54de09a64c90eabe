"""Aligning the ranks' clocks: each rank's offset to rank 0, from ping-pongs, the fastest one kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.base import Communicator
from ._recorder import now

__all__ = ["ClockSync", "measure", "ROUNDS", "TAG"]

#: Ping-pongs per rank; the one with the shortest round trip gives the offset.
ROUNDS = 8
#: The tag of the ping-pongs on the timeline's communicator (below MPI's guaranteed tag bound 32767).
TAG = 32123


@dataclass(frozen=True)
class ClockSync:
    """``rank 0's clock = this rank's clock + offset_ns``, measured with a round trip of `rtt_ns`, so
    the error of the offset is at most ``rtt_ns / 2`` (0 on rank 0)."""

    offset_ns: int
    rtt_ns: int


def measure(comm: Communicator, rounds: int = ROUNDS) -> ClockSync:
    """Collective over `comm`: rank 0 answers `rounds` pings of each other rank in turn with its
    clock; a rank takes the sample with the smallest round trip and assumes the reply was stamped
    half-way (Cristian's algorithm). Uses blocking send/recv of one int64 with tag :data:`TAG`."""
    buf = torch.zeros(1, dtype=torch.int64)
    if comm.rank == 0:
        for r in range(1, comm.size):
            for _ in range(rounds):
                comm.recv(buf, r, TAG)
                buf[0] = now()
                comm.send(buf, r, TAG)
        return ClockSync(0, 0)
    best: ClockSync | None = None
    for _ in range(rounds):
        t1 = now()
        comm.send(buf, 0, TAG)
        comm.recv(buf, 0, TAG)
        t2 = now()
        sample = ClockSync(int(buf[0]) - (t1 + t2) // 2, t2 - t1)
        if best is None or sample.rtt_ns < best.rtt_ns:
            best = sample
    assert best is not None
    return best
