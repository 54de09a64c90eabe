"""KVStore benchmarks: the parameter-server table of the MPI-allreduce proposal and the DAG paper's
funnel / concurrent / depchain epoch-time comparison.

``mpitrain bench kvstore -n 6 -- --table ps [--workers 2] [--servers 1,2,4] [--mb 64]``: push+pull of
one large payload by every worker through ``dist_sync`` with S servers (the last S of the first
workers+S ranks), against ``allreduce`` on the workers (the Communicator, and ``dist_sync_mpi``).

``mpitrain bench kvstore -n 2 -- --table dag [--epochs 3] [--steps 6]``: MXNet-style training of a
small CNN where every parameter's gradient is its own key, pushed by a post-accumulate hook the
moment autograd produces it (``pushpull`` in place, ``wait`` after backward, SGD step). Epochs of
every type are interleaved so machine noise hits them alike; "compute only" trains without
communication (the ceiling).

Both tables use the store API directly, without ``declare_order``: their ``dist_sync_mpi`` rows measure
the negotiated coordinator (``mpitrain bench dataparallel``'s row measures the declared order).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
from mpitrain import kvstore
from mpitrain._utils.stall import StallPolicy, wait_until
from mpitrain.bench.common import add_outputs, header, print_table, save_outputs, slowest_rank_times
from mpitrain.comm.base import Communicator
from mpitrain.kvstore import ServerStore

__all__ = ["main"]


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench kvstore", description=__doc__.splitlines()[0])
    p.add_argument("--table", choices=("ps", "dag", "both"), default="both")
    p.add_argument("--workers", type=int, default=2, help="ps table: worker ranks")
    p.add_argument("--servers", default="1,2,4", help="ps table: server counts (those that fit in -n)")
    p.add_argument("--mb", type=float, default=64.0, help="ps table: payload per worker (MiB, float32)")
    p.add_argument("--repeats", type=int, default=5, help="ps table: timed push+pull per row")
    p.add_argument("--epochs", type=int, default=3, help="dag table: timed epochs per type")
    p.add_argument("--steps", type=int, default=6, help="dag table: steps per epoch")
    p.add_argument("--types", default="funnel,concurrent,depchain,dist_sync_mpi")
    add_outputs(p)  # --json FILE, --plot FILE.png (this benchmark draws its own bar chart of the dag table)
    return p.parse_args(argv)


# -- parameter server vs allreduce ---------------------------------------------------------------
def _median_time(fn: Callable[[], None], comm: Communicator, repeats: int) -> float:
    return statistics.median(slowest_rank_times(comm, fn, repeats))


def _ps_row(world: Communicator, workers: int, servers: int, n: int, repeats: int) -> float | None:
    """Seconds for one push+pull of `n` floats per worker through dist_sync with `servers` servers."""
    member = world.rank < workers + servers
    sub = world.split(0 if member else None, world.rank)
    result = None
    if sub is not None:
        kv = kvstore.create("dist_sync", sub, num_servers=servers, bigarray_bound=1 << 16)
        assert isinstance(kv, ServerStore)  # for the type checker: create("dist_sync") builds one
        if kv.is_server:
            kv.serve()
        else:
            wsub = kv._ctl
            value, out = torch.ones(n), torch.empty(n)
            kv.init(0, value)

            def push_pull() -> None:
                kv.push(0, value)
                kv.pull(0, out)

            result = _median_time(push_pull, wsub, repeats)
            kv.close()
        sub.free()
    _rendezvous(world)
    row: float | None = world.broadcast_object(result, 0)
    return row


def _allreduce_rows(world: Communicator, workers: int, n: int, repeats: int) -> list[tuple[str, float]]:
    sub = world.split(0 if world.rank < workers else None, world.rank)
    rows: list[tuple[str, float]] = []
    if sub is not None:
        t = torch.ones(n)

        def allreduce() -> None:
            sub.allreduce(t)

        rows.append(("allreduce (Communicator)", _median_time(allreduce, sub, repeats)))
        kv = kvstore.create("dist_sync_mpi", sub)

        def pushpull() -> None:
            kv.pushpull(0, t)
            kv.wait()

        rows.append(("pushpull (dist_sync_mpi)", _median_time(pushpull, sub, repeats)))
        kv.close()
        sub.free()
    _rendezvous(world)
    table: list[tuple[str, float]] = world.broadcast_object(rows, 0)
    return table


def _rendezvous(world: Communicator) -> None:
    """Wait for every rank without spinning: ranks left out of a row must not steal the cores."""
    wait_until(world.iallreduce(torch.zeros(1)).test, "the other ranks between benchmark rows",
               StallPolicy(max_nap=2e-3), who=f"bench kvstore rank {world.rank}", abort=world.abort)


def ps_table(world: Communicator, args: argparse.Namespace) -> None:
    n = int(args.mb * (1 << 20) / 4)
    servers = [int(s) for s in args.servers.split(",")]
    fits = [s for s in servers if args.workers + s <= world.size]
    rows = []
    for s in fits:
        sec = _ps_row(world, args.workers, s, n, args.repeats)
        rows.append(["ParameterServer (push+pull)", s, args.workers, sec, args.mb / 1024 / sec])
    for name, sec in _allreduce_rows(world, args.workers, n, args.repeats):
        rows.append([name, "N/A", args.workers, sec, args.mb / 1024 / sec])
    if world.rank == 0:
        print(header(f"push+pull of {args.mb:g} MiB per worker: parameter server vs allreduce", world.size))
        skipped = sorted(set(servers) - set(fits))
        if skipped:
            print(f"# skipped server counts {skipped}: need -n >= workers + servers")
        print_table(["method", "servers", "workers", "time (s)", "GiB/s per worker"], rows)


# -- funnel vs concurrent vs depchain ------------------------------------------------------------
def small_cnn() -> nn.Module:
    """~0.3 M parameters in 10 tensors: enough keys for ordering to matter, quick on 2 cores."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(64 * 16, 256), nn.ReLU(), nn.Linear(256, 10))


class _HookTrainer:
    """Per-parameter keys pushed from post-accumulate hooks; wait after backward; plain SGD."""

    def __init__(self, kind: str, comm: Communicator, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = small_cnn()
        self.kv = None if kind == "compute only" else kvstore.create(kind, comm)
        self.scale = 1.0 / comm.size
        params = list(self.model.parameters())
        for p in params:
            p.grad = torch.zeros_like(p)
        if self.kv is not None:
            order = params[::-1]  # keys in the order autograd produces them
            self.kv.init(list(range(len(order))), [p.detach() for p in order])
            key = {p: i for i, p in enumerate(order)}
            for p in params:
                p.register_post_accumulate_grad_hook(lambda q, k=key[p]: self.kv.pushpull(k, q.grad))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.zero_()
        F.cross_entropy(self.model(x), y).backward()
        if self.kv is not None:
            self.kv.wait()
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-0.01 * self.scale)

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()


def dag_table(comm: Communicator, args: argparse.Namespace) -> dict[str, float]:
    kinds = ["compute only", *args.types.split(",")]
    trainers = {k: _HookTrainer(k, comm) for k in kinds}
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.epochs):
        for k, tr in trainers.items():
            tr.step(x, y)  # warm-up: first-use negotiation, allocator
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                tr.step(x, y)
            times[k].append(max(comm.allgather_object(time.perf_counter() - t0)))
    for tr in trainers.values():
        tr.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    if comm.rank == 0:
        print(header(f"epoch time ({args.steps} steps, per-parameter keys pushed from hooks): "
                     f"funnel vs concurrent vs depchain", comm.size))
        base = med.get("funnel", next(iter(med.values())))
        rows = [[k, med[k], min(times[k]), max(times[k]), base / med[k]] for k in kinds]
        print_table(["type", "epoch (s)", "min", "max", "speed-up vs funnel"], rows)
    return med


def _plot(med: dict[str, float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar(list(med), list(med.values()))
    ax.set_ylabel("epoch time (s)")
    ax.set_title("funnel vs concurrent vs depchain")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else list(argv))
    comm = mpitrain.init()
    if args.table in ("ps", "both"):
        ps_table(comm, args)
    if args.table in ("dag", "both"):
        med = dag_table(comm, args)
        if args.plot and comm.rank == 0:
            _plot(med, args.plot)
    save_outputs(args, "kvstore", comm.size, comm.rank, plot=args.table == "ps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
