"""How much of P ranks' speed this machine delivers: each kernel alone vs on every rank at once.

``mpitrain bench machine -n 2``. A parallel step can be at most P times faster than one process only
if P processes each run as fast as one process alone. On shared machines they do not: cores share
the last-level cache and memory bandwidth, and virtual cores share hosts. This benchmark times the
same kernels on rank 0 alone (the other ranks asleep) and on every rank at once (no messages), in
interleaved rounds (:func:`~mpitrain.bench.common.paired_rounds`), and prints the slowdown and the
speed-up ceiling it implies, ``P / slowdown``: no strategy of this package, or any other, can beat it
for a step whose time is spent in such kernels. The kernels span the range from compute-bound (a
small matmul that stays in L1/L2) through cache- and DRAM-bandwidth-bound streams to the layers the
spatial and pipeline benchmarks run.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..comm.base import Communicator
from ..runtime import init
from .common import (
    add_outputs,
    alone_timer,
    header,
    median,
    paired_rounds,
    print_table,
    quartiles,
    save_outputs,
    step_timer,
)

__all__ = ["main", "KERNELS"]

Kernel = Callable[[], object]


def _matmul(n: int = 128, repeats: int = 3000) -> tuple[Kernel, int]:
    a, b, c = torch.randn(n, n), torch.randn(n, n), torch.empty(n, n)

    def run() -> None:
        for _ in range(repeats):
            torch.mm(a, b, out=c)

    return run, 3 * n * n * 4


def _stream(nbytes: int) -> tuple[Kernel, int]:
    """``c = a + b`` over float32 vectors whose three buffers total `nbytes`, repeated until ~400 MiB
    have moved (more passes over smaller buffers)."""
    n = max(nbytes // 12, 1)
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    repeats = max(1, (400 << 20) // (12 * n))

    def run() -> None:
        for _ in range(repeats):
            torch.add(a, b, out=c)

    return run, 12 * n


def _conv_block(channels: int = 16, h: int = 256, w: int = 512) -> tuple[Kernel, int]:
    """3x3 conv, BatchNorm, ReLU, forward and backward, channels-last, 16 channels on 256x512: a
    memory-bound layer (the first block of the narrow mesh model, ``bench spatial --widths 16,...``, on
    half of a 1024x1024 image)."""
    cl = torch.channels_last
    conv = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False).to(memory_format=cl)  # type: ignore[call-overload]  # torch's stubs omit memory_format
    bn = torch.nn.BatchNorm2d(channels)
    x = torch.randn(1, channels, h, w).contiguous(memory_format=cl).requires_grad_()

    def run() -> None:
        F.relu(bn(conv(x))).sum().backward()

    return run, 6 * channels * h * w * 4


#: name -> (kernel factory, what it measures)
KERNELS: dict[str, tuple[Callable[[], tuple[Kernel, int]], str]] = {
    "matmul": (_matmul, "128x128 matmul: compute, in L1/L2"),
    "add-l2": (lambda: _stream(768 << 10), "c=a+b, 768 KiB: the private L2"),
    "add-l3": (lambda: _stream(6 << 20), "c=a+b, 6 MiB: the shared L3"),
    "add-dram": (lambda: _stream(192 << 20), "c=a+b, 192 MiB: DRAM"),
    "conv-block": (_conv_block, "3x3 conv-BN-ReLU fwd+bwd, 16x256x512"),
}


def measure(comm: Communicator, names: Sequence[str], rounds: int) -> list[list[object]]:
    """One table row per kernel: alone ms, all-ranks ms, paired slowdown, its spread and the ceiling."""
    rows = []
    for name in names:
        factory, what = KERNELS[name]
        torch.manual_seed(0)
        run, nbytes = factory()
        t = paired_rounds({"alone": alone_timer(comm, run, 1), "all": step_timer(comm, run, 1)}, rounds)
        slow = [b / a for a, b in zip(t["alone"], t["all"])]  # per round (see paired_ratio)
        s = median(slow)
        rows.append([name, what, nbytes / 2**20, median(t["alone"]) * 1e3, median(t["all"]) * 1e3, s,
                     quartiles(slow), comm.size / s])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mpitrain bench machine", description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated names (default: all)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (ratios taken per round)")
    add_outputs(p)
    args = p.parse_args(list(argv or []))
    names = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in names if k not in KERNELS]
    if unknown:
        p.error(f"unknown kernel(s) {unknown}; choose from {list(KERNELS)}")
    comm = init()
    rows = measure(comm, names, args.rounds)
    if comm.rank == 0:
        print(header("machine: each kernel on one rank alone vs on every rank at once (no messages)", comm.size))
        cores = os.cpu_count() or 1
        note = f"OVERSUBSCRIBED: {comm.size} ranks" if comm.size > cores else f"{comm.size} ranks"
        print(f"# {note} on {cores} cores; torch threads per rank: {torch.get_num_threads()}")
        print(f"# slowdown = all-ranks time / alone time (median of per-round ratios); "
              f"ceiling = {comm.size} / slowdown: the best speed-up {comm.size} ranks can reach on such work")
        print_table(["kernel", "what", "MiB", "alone ms", "all ranks ms", "slowdown", "q25-q75",
                     f"ceiling x{comm.size}"], rows)
    save_outputs(args, "machine", comm.size, comm.rank)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
