"""Where the hierarchical allreduce's time goes on emulated hosts (docs/multihost.md): per size, interleaved
in one job, the slowest rank's median time of

- mpi-stages: MPI_Reduce on the host, the leaders' ring, MPI_Bcast on the host (the former algorithm);
- shm-stages: the host stages through shared memory (HostStage), the ring adding the host's slots;
- allreduce: Communicator.allreduce (the same, on the hierarchy's worker thread);
- ring-alone: the leaders' ring by itself while the other ranks sleep (the inter-host part's own limit);

and each one's share of the floor 2S(H-1)/H / link. Run:
python -m tests.multihost.emulated --hosts 4 --slots 2 --rate 1gbit -- run python
tests/multihost/jobs/host_stages.py [MiB ...] [--with-open-mpi]
(--with-open-mpi: Open MPI's allreduce and ours, alternating, instead; --chunks: the shared-memory stages
with ring chunks of 256 KiB, 1 MiB and 4 MiB, each followed by Open MPI's allreduce with --with-open-mpi;
--variants: Communicator.allreduce against the shared-memory stages with 256 KiB chunks and the leader's
copy after the ring, as before on_final and the chunk rule, likewise; --tuning: Communicator.allreduce with
one constant changed at a time; --reps N: N rounds, the first one dropped, default 4.)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from mpi4py import MPI

import mpitrain
from mpitrain.comm._hierarchical import RING_NAP_S, Hierarchy, ring_chunk_bytes
from mpitrain.comm._host_stage import HostStage
from mpitrain.comm._mpi import MPICommunicator
from mpitrain.comm.ring import ring_allreduce

LINK_BPS = 1e9 / 8
comm = mpitrain.init()
world = MPI.COMM_WORLD
h = Hierarchy(comm.mpi_comm, ring_comm=lambda c: MPICommunicator(c, hierarchy=False))
ring_comm = h._ring_comm() if h.leaders is not None else None
stage = HostStage(h.node)


def mpi_stages(t: torch.Tensor, buf: list) -> None:
    h.node.Reduce(MPI.IN_PLACE if h.is_leader else buf, buf if h.is_leader else None, op=MPI.SUM, root=0)
    if ring_comm is not None:
        ring_allreduce(ring_comm, t)
    h.node.Bcast(buf, root=0)


def shm_stages(t: torch.Tensor, buf: list) -> None:
    stage.allreduce(t, lambda flat, others, fin: ring_allreduce(ring_comm, flat, addends=others, on_final=fin))


def allreduce(t: torch.Tensor, buf: list) -> None:
    comm.allreduce(t)


def _ring_while_the_others_sleep(t: torch.Tensor, **ring_options: object) -> None:
    """The leaders' ring by itself; the other ranks wait asleep in a barrier meanwhile."""
    if ring_comm is not None:
        ring_allreduce(ring_comm, t, **ring_options)  # type: ignore[arg-type]
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def ring_alone(t: torch.Tensor, buf: list) -> None:
    _ring_while_the_others_sleep(t)


def ring_alone_as_used(t: torch.Tensor, buf: list) -> None:
    """The leaders' ring alone with the chunks and naps Communicator.allreduce gives it."""
    _ring_while_the_others_sleep(t, chunk_bytes=ring_chunk_bytes(t.numel() * 4, h.hosts), nap=RING_NAP_S)


def open_mpi(t: torch.Tensor, buf: list) -> None:
    world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


CONTENDERS: dict[str, Callable[[torch.Tensor, list], None]] = {
    "mpi-stages": mpi_stages, "shm-stages": shm_stages, "allreduce": allreduce, "ring-alone": ring_alone,
    "ring-alone-as-used": ring_alone_as_used}
def shm_chunks(chunk_bytes: int) -> Callable[[torch.Tensor, list], None]:
    def fn(t: torch.Tensor, buf: list) -> None:
        stage.allreduce(t, lambda flat, others, fin: ring_allreduce(ring_comm, flat, addends=others,
                                                                    chunk_bytes=chunk_bytes, on_final=fin))
    return fn


def before_this_change(t: torch.Tensor, buf: list) -> None:
    """The shared-memory stages as they were: 256 KiB chunks, the leader's copy into its slot after the ring."""
    def across(flat: torch.Tensor, others: list[torch.Tensor], fin: Callable[[int, int], object]) -> None:
        ring_allreduce(ring_comm, flat, addends=others)
        fin(0, flat.numel())
    stage.allreduce(t, across)


def napping(t: torch.Tensor, buf: list) -> None:
    """Communicator.allreduce with the ring's waits sleeping between tests (at most 200 us) instead of
    Open MPI's busy-polling wait."""
    import mpitrain.comm.ring as ring_module
    from mpitrain._utils.stall import StallPolicy, poll

    busy = ring_module._wait
    ring_module._wait = lambda req, what, warn_after: poll(req.test, StallPolicy(max_nap=2e-4))  # type: ignore
    try:
        comm.allreduce(t)
    finally:
        ring_module._wait = busy


def patched(module: object, **values: object) -> Callable[[torch.Tensor, list], None]:
    """Communicator.allreduce with some of `module`'s constants replaced for the call."""
    def fn(t: torch.Tensor, buf: list) -> None:
        saved = {k: getattr(module, k) for k in values}
        for k, v in values.items():
            setattr(module, k, v)
        try:
            comm.allreduce(t)
        finally:
            for k, v in saved.items():
                setattr(module, k, v)
    return fn


if "--tuning" in sys.argv:  # constants of the hierarchical allreduce, one at a time
    from mpitrain._utils.stall import StallPolicy
    from mpitrain.comm import _hierarchical, _host_stage

    def inline(t: torch.Tensor, buf: list) -> None:  # the worker thread's code, on the calling thread
        h._stage.allreduce(t, h._across)

    CONTENDERS = {"now": allreduce, "inline": inline,
                  "host-naps-200us": patched(_host_stage, _ASLEEP=StallPolicy(max_nap=2e-4)),
                  "ring-naps-50us": patched(_hierarchical, RING_NAP_S=5e-5),
                  "chunks-128K": patched(_hierarchical, RING_CHUNK_BYTES=(128 << 10, 1 << 20)),
                  "chunks-512K": patched(_hierarchical, RING_CHUNK_BYTES=(512 << 10, 1 << 20)),
                  "chunks-1M": patched(_hierarchical, RING_CHUNK_BYTES=(1 << 20, 1 << 20)),
                  # under Open MPI's TCP eager limit (64 KiB with its header): no rendezvous per message
                  "chunks-62.5K": patched(_hierarchical, RING_CHUNK_BYTES=(64000, 64000))}
elif "--variants" in sys.argv:  # this tree's allreduce against the same before this change
    CONTENDERS = {"before": before_this_change, "now": allreduce, "napping": napping}
    if "--with-open-mpi" in sys.argv:
        CONTENDERS = {k: v for c, fn in CONTENDERS.items() for k, v in ((c, fn), (f"ompi<{c}", open_mpi))}
elif "--chunks" in sys.argv:  # the shared-memory stages with the ring's chunks of 256 KiB, 1 MiB, 4 MiB
    CONTENDERS = {f"shm-{c >> 10}K": shm_chunks(c) for c in (256 << 10, 1 << 20, 4 << 20)}
    if "--with-open-mpi" in sys.argv:
        CONTENDERS = {k: v for c, fn in CONTENDERS.items() for k, v in ((c, fn), (f"ompi<{c}", open_mpi))}
elif "--with-open-mpi" in sys.argv:  # Open MPI's own allreduce between the others, as the benchmark has it
    CONTENDERS = {"open-mpi": open_mpi, "allreduce": allreduce, "open-mpi-2": open_mpi, "allreduce-2": allreduce}

sizes = [int(a) for i, a in enumerate(sys.argv[1:], 1) if a.isdigit() and sys.argv[i - 1] != "--reps"]
for mib in sizes or [4, 16, 64]:
    t = torch.ones(mib * (1 << 20) // 4)
    buf = [t.numpy(), MPI.FLOAT]
    times: dict[str, list[float]] = {k: [] for k in CONTENDERS}
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 4
    for rep in range(reps):  # the first round warms up (connections, slots)
        for name, fn in CONTENDERS.items():
            world.Barrier()
            t0 = time.perf_counter()
            fn(t, buf)
            slowest = max(world.allgather(time.perf_counter() - t0))
            if rep:
                times[name].append(slowest)
    if world.Get_rank() == 0:
        hosts = h.hosts
        floor = 2 * mib * (1 << 20) * (hosts - 1) / hosts / LINK_BPS
        print(f"STAGES {mib} MiB floor {floor * 1e3:.1f} ms: " + "  ".join(
            f"{k} {np.median(v) * 1e3:.1f} ms ({floor / np.median(v):.3f})" for k, v in times.items()), flush=True)
