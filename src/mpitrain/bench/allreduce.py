"""Allreduce latency and bus bandwidth: our MPI path, our torch (gloo) path and raw mpi4py, interleaved."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

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


def _contenders(nbytes: int, tcomm) -> dict[str, Callable[[], object]]:
    """One buffer per contender, all float32 sum in place; each call is one complete allreduce."""
    from mpi4py import MPI

    from ..runtime import world

    comm = world()
    n = nbytes // 4
    raw_buf = np.ones(n, dtype=np.float32)
    ours_buf = torch.ones(n)
    out = {
        "mpi4py": lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, raw_buf, op=MPI.SUM),
        "mpitrain[mpi]": lambda: comm.allreduce(ours_buf),
    }
    if tcomm is not None:
        gloo_buf = torch.ones(n)
        out["mpitrain[torch/gloo]"] = lambda: tcomm.allreduce(gloo_buf)
    return out


def _measure(nbytes: int, rounds: int, tcomm) -> dict[str, float]:
    """Median seconds per allreduce for each contender; contenders alternate inside every round."""
    from ..runtime import world

    comm = world()
    fns = _contenders(nbytes, tcomm)
    iters = max(2, min(200, (8 << 20) // max(nbytes, 1)))
    for fn in fns.values():  # warm-up: connection set-up, page faults
        _per_call(fn, 2, comm.barrier)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t = _per_call(fn, iters, comm.barrier)
            samples[name].append(max(comm.allgather_object(t)))  # the slowest rank defines the time
    return {k: float(np.median(v)) for k, v in samples.items()}


def _fmt_size(b: int) -> str:
    return f"{b // (1 << 20)} MiB" if b >= 1 << 20 else f"{b // KIB} KiB"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mpitrain bench allreduce")
    p.add_argument("--min-bytes", type=int, default=KIB)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size (median reported)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed (gloo) backend")
    add_outputs(p)
    args = p.parse_args(argv)

    from ..comm._torchdist import init_torch_world
    from ..runtime import world

    comm = world()
    n = comm.size
    tcomm = None if args.no_torch else init_torch_world(comm.rank, n, comm)
    rows = []
    for nbytes in _sizes(args.min_bytes, args.max_bytes):
        t = _measure(nbytes, args.rounds, tcomm)
        raw = t["mpi4py"]
        row = [_fmt_size(nbytes)]
        for name in t:
            busbw = nbytes / t[name] * 2 * (n - 1) / n / 1e9
            row += [t[name] * 1e6, busbw]
        row.append(t["mpitrain[mpi]"] / raw)
        if tcomm is not None:
            row.append(t["mpitrain[torch/gloo]"] / raw)
        rows.append(row)
    if comm.rank == 0:
        names = list(_contenders(KIB, tcomm))
        heads = ["size"]
        for name in names:
            heads += [f"{name} us", f"{name} busbw GB/s"]
        heads.append("mpi/raw time")
        if tcomm is not None:
            heads.append("gloo/raw time")
        print(header("allreduce, float32 sum in place (busbw = algbw*2(n-1)/n; time ratio < 1 is faster)", n))
        print(f"# rounds: {args.rounds} interleaved; median of per-round means; slowest rank per round")
        print_table(heads, rows)
    save_outputs(args, "allreduce", n, comm.rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
