"""Mesh-model strong scaling (Table I shape): time per training step and step memory per rank, spatial
vs one process. ``mpitrain bench spatial -n 1`` then ``-n 2`` (and ``-n 4``); ``--baseline`` also times
the plain torch model on rank 0 alone inside a multi-rank run.

Step memory is the rise of the resident set during one training step: the kernel's peak-RSS counter is
reset (``/proc/self/clear_refs``), malloc is told to map every block >= 64 KiB separately and trimmed
(so freed tensors leave the RSS), then one step runs and ``VmHWM - VmRSS(before)`` is read. It counts
everything a step allocates (activations, gradients, halos, gathered outputs), not the model or the
global input batch that exist before the step.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import ctypes.util
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..perf.spatial import conv_shapes, predict, time_local_conv
from ..spatial.conv import SpatialConv2d
from ..spatial.distribution import Distribution
from ..spatial.mesh import WIDTHS, mesh_batch, mesh_model
from ..spatial.trainer import SpatialTrainer
from .common import header, median, print_table, time_call

__all__ = ["main", "step_memory_mib"]

_M_MMAP_THRESHOLD = -3


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(key))


def step_memory_mib(step: Callable[[], object]) -> float:
    """MiB by which one call of `step` raises this process's resident set at its peak (see module doc)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    step()
    return (_status("VmHWM") - before) / 1024.0


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench spatial", description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=1024, help="input side (paper: 1024 or 2048)")
    p.add_argument("--batch", type=int, default=1, help="global mini-batch N")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    p.add_argument("--convs", type=int, default=3, help="conv-BN-ReLU per block (paper: 3 at 1K, 5 at 2K)")
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)), help="filters per block")
    p.add_argument("--grids", default="auto", help="e.g. '2x1,1x2' (ph x pw per sample); auto: all splits")
    p.add_argument("--no-overlap-row", action="store_true", help="skip the overlap=False comparison row")
    p.add_argument("--baseline", action="store_true", help="time plain torch on rank 0 alone first")
    p.add_argument("--ref", type=float, nargs=2, metavar=("SECONDS", "MIB"),
                   help="1-rank torch min step time and memory from an earlier -n 1 run, for the ratios")
    return p.parse_args(list(argv))


def _grids(size: int, batch: int, spec: str) -> list[tuple[int, int, int]]:
    """(ph, pw, samples) configurations for `size` ranks."""
    if spec != "auto":
        out = []
        for g in spec.split(","):
            ph, pw = (int(v) for v in g.lower().split("x"))
            out.append((ph, pw, size // (ph * pw)))
        return out
    per = [p for p in (1, 2, 4, 8) if size % p == 0 and size // p <= batch]
    out = []
    for p in per:
        out += [(p, 1, size // p)] + ([(1, p, size // p)] if p == 2 else [])
        out += [(2, 2, size // 4)] if p == 4 else []
    return out


def _torch_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], float]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def _measure(step: Callable[[], object], steps: int, sync: Callable[[], object]
             ) -> tuple[float, float, float, float]:
    """(median wall, fastest wall, fastest CPU) seconds per step and the step memory. On a shared machine
    the fastest step is the least disturbed; CPU time leaves out the time this process was descheduled
    (it still counts MPI's busy-polling while waiting for the other rank)."""
    step()
    walls, cpus = [], []
    for _ in range(steps):
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    sync()
    return median(walls), min(walls), min(cpus), step_memory_mib(step)


def _idle_until_all_arrive(comm) -> None:
    """A barrier that sleeps instead of busy-polling, so waiting ranks leave rank 0's baseline alone."""
    req = comm.iallreduce(torch.zeros(1))
    while not req.test():
        time.sleep(0.005)


def _link(comm) -> tuple[float, float]:
    """(alpha, beta) of a halo-sized exchange between neighbours: sendrecv times at 8 B and 4 MiB."""
    if comm.size == 1:
        return 0.0, 0.0
    peer = comm.rank ^ 1 if (comm.rank ^ 1) < comm.size else comm.rank
    times = []
    for n in (2, 1 << 20):
        buf, out = torch.zeros(n), torch.empty(n)
        ts = time_call(lambda b=buf, o=out: comm.sendrecv(b, peer, o, peer), 5, warmup=1, sync=comm.barrier)
        times.append(min(ts))
    alpha = times[0]
    return alpha, max(0.0, (times[1] - alpha) / (4 << 20))


def _predicted(model: nn.Module, shape: tuple[int, ...], grid: tuple[int, int], samples: int,
               link: tuple[float, float], overlap: bool) -> float:
    """§V-A model: measured local conv times on this rank's block plus modelled halo/allreduce time."""
    shapes = conv_shapes(model, shape)
    measured = {s: time_local_conv(s, grid, samples) for s in set(shapes)}
    return predict(shapes, grid, samples, measured.__getitem__, *link, overlap=overlap)


def _spatial_row(args, comm, model, x, y, grid, samples, overlap: bool) -> list[object]:
    dist = Distribution(comm, grid[:2], samples)
    trainer = SpatialTrainer(copy.deepcopy(model), nn.CrossEntropyLoss(),
                             lambda p: torch.optim.SGD(p, lr=1e-3), dist, overlap=overlap)
    convs = [m for m in trainer.parallel.modules() if isinstance(m, SpatialConv2d)]
    measured = _measure(lambda: trainer.train_step(x, y), args.steps, comm.barrier)
    for m in convs:
        m.stats.reset()
    trainer.train_step(x, y)
    wait = sum(m.stats.wait_s for m in convs)
    model_s = _predicted(model, tuple(x.shape), grid, samples, args.link, overlap)
    worst = comm.allgather_object((*measured, wait, model_s))
    label = f"spatial {grid[0]}x{grid[1]}" + ("" if overlap else " no-overlap")
    return [label, grid[0] * grid[1], samples, *(max(v[i] for v in worst) for i in range(6))]


def main(argv: Sequence[str]) -> int:
    import mpitrain

    args = _parse(argv)
    comm = mpitrain.init()
    widths = tuple(int(w) for w in args.widths.split(","))
    torch.manual_seed(0)
    model = mesh_model(widths=widths, convs_per_block=args.convs)
    x, y = mesh_batch(args.batch, args.size, blocks=len(widths))
    rows: list[list[object]] = []
    ref = tuple(args.ref) if args.ref else None
    args.link = _link(comm)
    if args.baseline or comm.size == 1:
        res = (0.0, 0.0, 0.0, 0.0)
        if comm.rank == 0:
            res = _measure(_torch_step(copy.deepcopy(model), x, y), args.steps, lambda: None)
        _idle_until_all_arrive(comm)
        res = comm.broadcast_object(res, 0)
        rows.append(["torch, 1 process", 1, 1, *res, 0.0, _predicted(model, tuple(x.shape), (1, 1), 1,
                                                                      (0.0, 0.0), False)])
        ref = ref or (res[1], res[3])
    for ph, pw, samples in _grids(comm.size, args.batch, args.grids):
        rows.append(_spatial_row(args, comm, model, x, y, (ph, pw), samples, True))
        if ph * pw > 1 and not args.no_overlap_row:
            rows.append(_spatial_row(args, comm, model, x, y, (ph, pw), samples, False))
    if comm.rank == 0:
        print(header(f"spatial: mesh model {args.size}^2, N={args.batch}, widths {widths}, "
                     f"{args.convs} convs/block", comm.size))
        print(f"# link: alpha {args.link[0] * 1e6:.1f} us, beta {args.link[1] * 1e9:.3f} ns/B; model = §V-A "
              f"conv cost (measured local convs + modelled halos/allreduce; other layers free)")
        table = [[*r[:5], (ref[0] / r[4]) if ref else "-", r[5], r[6],
                  (r[6] / ref[1]) if ref and ref[1] else "-", r[7], r[8]] for r in rows]
        print_table(["config", "ranks/sample", "groups", "median s", "min s", "speedup(min)", "min cpu s",
                     "step MiB/rank", "mem ratio", "halo wait s", "model conv s"], table)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
