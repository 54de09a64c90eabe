"""Allreduce latency and bus bandwidth, interleaved in one job: Open MPI's own choice (raw mpi4py), our
ring over every rank (flat), our communicator's allreduce (hierarchical when the ranks span hosts), and
torch.distributed's gloo. With ``--link-gbit`` the table also gives each contender's share of the
bandwidth floor: an allreduce of S bytes among H hosts must move 2S(H-1)/H bytes over each host's link.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from .common import add_outputs, header, print_table, save_outputs

__all__ = ["main"]

KIB = 1024


def _sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4
    return out


def _per_call(fn: Callable[[], object], iters: int, barrier: Callable[[], object]) -> float:
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def _contenders(nbytes: int, tcomm: Any) -> dict[str, Callable[[], object]]:
    """One buffer per contender, all float32 sum in place; each call is one complete allreduce."""
    from mpi4py import MPI

    from ..comm.ring import ring_allreduce
    from ..runtime import world

    comm = world()
    n = nbytes // 4
    raw_buf = np.ones(n, dtype=np.float32)
    ring_buf = torch.ones(n)
    ours_buf = torch.ones(n)
    out: dict[str, Callable[[], object]] = {
        "ompi": lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, raw_buf, op=MPI.SUM),
        "ring": lambda: ring_allreduce(comm, ring_buf),
        "mpitrain": lambda: comm.allreduce(ours_buf),
    }
    if tcomm is not None:
        gloo_buf = torch.ones(n)
        out["gloo"] = lambda: tcomm.allreduce(gloo_buf)
    return out


def _round_order(names: list[str], round_: int) -> list[str]:
    """The contenders' order in round `round_`: rotated by one each round, so over as many rounds as
    contenders each runs once in every position, first of its round included (one contender's traffic can
    slow the next: docs/multihost.md). The cyclic order stays: a contender follows the same one within
    every round but one, where it opens the round after the one it followed closed the previous round."""
    k = round_ % len(names)
    return names[k:] + names[:k]


def _measure(nbytes: int, rounds: int, tcomm: Any, log: list[str] | None = None) -> dict[str, float]:
    """Median seconds per allreduce for each contender; contenders alternate inside every round, in an
    order rotated each round (:func:`_round_order`). `log`: gets one line per round, each contender's
    time in the order they ran."""
    from ..runtime import world

    comm = world()
    fns = _contenders(nbytes, tcomm)
    iters = max(2, min(200, (8 << 20) // max(nbytes, 1)))
    for fn in fns.values():  # warm-up: connection set-up, page faults
        _per_call(fn, 2, comm.barrier)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(rounds):
        order = _round_order(list(fns), r)
        for name in order:
            t = _per_call(fns[name], iters, comm.barrier)
            samples[name].append(max(comm.allgather_object(t)))  # the slowest rank defines the time
        if log is not None:
            log.append(f"# {_fmt_size(nbytes)} round {r}: " + ", ".join(f"{k} {samples[k][-1] * 1e3:.1f} ms"
                                                                       for k in order))
    return {k: float(np.median(v)) for k, v in samples.items()}


def _fmt_size(b: int) -> str:
    return f"{b // (1 << 20)} MiB" if b >= 1 << 20 else f"{b // KIB} KiB"


def _hosts(comm: Any) -> list[int]:
    """Ranks per host (MPI's shared-memory split), hosts in order of their lowest rank."""
    from ..comm import host_leaders

    leaders = host_leaders(comm.mpi_comm)
    return [leaders.count(r) for r in sorted(set(leaders))]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mpitrain bench allreduce")
    p.add_argument("--min-bytes", type=int, default=KIB)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size (median reported)")
    p.add_argument("--per-round", action="store_true",
                   help="also print every round's times in the order the contenders ran")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed (gloo) backend")
    p.add_argument("--link-gbit", type=float, default=None,
                   help="each host's link speed (Gbit/s): adds the floor 2S(H-1)/H/link and each share of it")
    add_outputs(p)
    args = p.parse_args(argv)

    from ..comm import init_torch_world
    from ..runtime import world

    comm = world()
    n = comm.size
    hosts = _hosts(comm)
    tcomm = None if args.no_torch else init_torch_world(comm.rank, n, comm)
    # Collect the start-up garbage and leave every object alive now (torch's and numpy's modules: a full
    # collection of them took 56 ms of CPU here) out of later collections, as timeit keeps the collector
    # out of its timings: a rank's full collection otherwise lands in whichever contender's round
    # happens to allocate past the threshold, and stalls every rank in that allreduce (docs/multihost.md).
    gc.collect()
    gc.freeze()
    names = list(_contenders(KIB, tcomm))
    rows: list[list[object]] = []
    log: list[str] | None = [] if args.per_round else None
    for nbytes in _sizes(args.min_bytes, args.max_bytes):
        t = _measure(nbytes, args.rounds, tcomm, log)
        row: list[object] = [_fmt_size(nbytes)]
        for name in names:
            row += [t[name] * 1e6, nbytes / t[name] * 2 * (n - 1) / n / 1e9]
        if args.link_gbit and len(hosts) > 1:
            floor = 2 * nbytes * (len(hosts) - 1) / len(hosts) / (args.link_gbit * 1e9 / 8)
            row.append(floor * 1e6)
            row += [floor / t[name] for name in names]
        rows.append(row)
    if comm.rank == 0:
        heads = ["size"]
        for name in names:
            heads += [f"{name} us", f"{name} busbw GB/s"]
        if args.link_gbit and len(hosts) > 1:
            heads += ["floor us", *(f"{name}/floor" for name in names)]
        print(header("allreduce, float32 sum in place (busbw = algbw*2(n-1)/n over ranks; x/floor: share of the "
                     "link's bandwidth floor, 1 = at the floor)", n))
        print(f"# hosts: {len(hosts)} with {hosts} ranks; link: {args.link_gbit or 'not given'} Gbit/s")
        print("# ompi: Open MPI's own Allreduce; ring: our ring over all ranks; mpitrain: Communicator.allreduce "
              "(hierarchical across hosts); gloo: torch.distributed")
        print(f"# rounds: {args.rounds} interleaved, order rotated each round; median of per-round means; "
              "slowest rank per round")
        print_table(heads, rows)
        if log:
            print("\n".join(log))
    save_outputs(args, "allreduce", n, comm.rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
