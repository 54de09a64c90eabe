"""What one rank per emulated host can push through its link in the allreduce ring's pattern (every rank
sends to its right neighbour while receiving from its left), for comparison with the allreduce's share
of the bandwidth floor (docs/multihost.md). Prints one line per transport, rank 0 only:

- tcp: plain sockets (one sender thread, one receiver), the kernel's ceiling for this traffic;
- mpi-1msg: one Isend/Irecv of the whole buffer per step (Open MPI's TCP transport);
- mpi-chunks: the same bytes in 256 KiB messages, all posted at once (the ring's chunking);
- ring: our ring_allreduce of the same size (share of ITS floor 2S(n-1)/n).

Run: python -m tests.multihost.emulated --hosts 4 --slots 1 --rate 1gbit -- run python
tests/multihost/jobs/link_throughput.py [MiB] [link Gbit/s]
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import numpy as np
import torch
from mpi4py import MPI

import mpitrain
from mpitrain.comm.ring import ring_allreduce

MIB = 1 << 20
size_mib = int(sys.argv[1]) if len(sys.argv) > 1 else 16
link = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
nbytes = size_mib * MIB
comm = mpitrain.init()
world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
right, left = (rank + 1) % n, (rank - 1) % n
link_bps = link * 1e9 / 8


def report(name: str, seconds: float, moved: float, floor: float | None = None) -> None:
    worst = max(world.allgather(seconds))
    if rank == 0:
        share = moved / worst / link_bps
        extra = f"  share of floor {floor / worst:.3f}" if floor else ""
        print(f"LINK {name:11s} {size_mib} MiB: {worst * 1e3:8.1f} ms  {moved / worst / 1e6:7.1f} MB/s per "
              f"link direction = {share:.3f} of the link{extra}", flush=True)


def tcp_ring() -> float:
    addr = socket.gethostbyname(socket.gethostname())
    srv = socket.create_server((addr, 0))
    ports = world.allgather((addr, srv.getsockname()[1]))
    out = socket.create_connection(ports[right])
    inc, _ = srv.accept()
    send, recv = bytearray(nbytes), bytearray(nbytes)
    world.Barrier()

    def sender() -> None:
        out.sendall(send)

    t0 = time.perf_counter()
    th = threading.Thread(target=sender)
    th.start()
    view, got = memoryview(recv), 0
    while got < nbytes:
        got += inc.recv_into(view[got:])
    th.join()
    dt = time.perf_counter() - t0
    for s in (out, inc, srv):
        s.close()
    return dt


def mpi_ring(chunk: int) -> float:
    send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    world.Barrier()
    t0 = time.perf_counter()
    reqs = [world.Irecv(recv[o:o + chunk], left, tag=5) for o in range(0, nbytes, chunk)]
    reqs += [world.Isend(send[o:o + chunk], right, tag=5) for o in range(0, nbytes, chunk)]
    MPI.Request.Waitall(reqs)
    return time.perf_counter() - t0


for rep in range(2):  # the first round sets up connections
    t_tcp = tcp_ring()
    t_one = mpi_ring(nbytes)
    t_chunks = mpi_ring(256 << 10)
    buf = torch.ones(nbytes // 4)
    world.Barrier()
    t0 = time.perf_counter()
    ring_allreduce(comm, buf)
    t_ar = time.perf_counter() - t0
    if rep:
        report("tcp", t_tcp, nbytes)
        report("mpi-1msg", t_one, nbytes)
        report("mpi-chunks", t_chunks, nbytes)
        report("ring", t_ar, 2 * nbytes * (n - 1) / n, floor=2 * nbytes * (n - 1) / n / link_bps)
