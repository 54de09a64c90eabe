"""DataParallel training steps/s for each kvstore type vs torch DDP (gloo), interleaved in one job.

Run as ``mpitrain bench dataparallel -n 2 [--models cnn,fc] [--rounds 5] [--steps 8] [--plot out.png]``;
``--models transformer`` adds a model of a real size (170 MB of gradients, slow: use fewer steps).
Each round runs every contender for `steps` timed steps (after one untimed step) on the same per-rank
batch, so machine noise hits every contender alike; the table reports the median over rounds. Two
reference rows are timed in the same rounds: ``solo`` (rank 0 trains alone while the others sleep) and
``pair-local`` (every rank trains alone at once, no communication): scaling efficiency is a
contender's steps/s over ``solo``, and ``pair-local`` over ``solo`` is the ceiling that two
processes sharing the cores and the memory bus already impose. The ``dist_sync_mpi`` row measures
DataParallel's declared order (its buckets go straight to the store's gradient reducer, no negotiation);
the negotiated coordinator is measured by ``mpitrain bench kvstore`` (the store API used directly).

``--device cuda`` times ResNet-50 on the GPU instead: DataParallel vs DDP (NCCL) vs plain torch, fp32
and bf16, in ms/step (:mod:`mpitrain.bench._dataparallel_cuda`); without CUDA it exits with status 2
and says why.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
from mpitrain.bench.common import (
    DEVICE_STEPS,
    add_outputs,
    add_precisions,
    header,
    on_rank0_alone,
    print_table,
    save_outputs,
    without_cuda,
)
from mpitrain.comm.base import Communicator
from mpitrain.kvstore import Key
from mpitrain.strategies.data_parallel import DataParallel

__all__ = ["main", "MODELS"]


def cnn() -> nn.Module:
    """Compute-heavy: 0.77 M parameters (3.1 MB of gradients), most time in convolutions."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(128 * 16, 256), nn.ReLU(), nn.Linear(256, 10))


def fc() -> nn.Module:
    """Communication-heavy: 16.8 M parameters (67 MB of gradients) in three large FC layers."""
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 3072), nn.ReLU(),
                         nn.Linear(3072, 10))


class _MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def transformer() -> nn.Module:
    """At a real size: 6 encoder layers of width 768 (BERT-base's layer; 42.5 M parameters, 170 MB of
    gradients) over 32 tokens of 768 features, mean-pooled into 10 classes. Compute and messages both
    weigh (about 0.45 s a step per rank on a 2-core VM)."""
    layer = nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.TransformerEncoder(layer, 6, enable_nested_tensor=False), _MeanPool(),
                         nn.Linear(768, 10))


#: name -> (factory, input shape per sample, per-rank batch)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "cnn": (cnn, (3, 32, 32), 16),
    "fc": (fc, (1024,), 32),
    "transformer": (transformer, (32, 768), 4),
}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench dataparallel", description=__doc__.splitlines()[0])
    p.add_argument("--models", default="cnn,fc", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--kvstores", default="dist_sync_mpi,depchain,concurrent,funnel",
                   help="comma list of kvstore types for DataParallel")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8, help="timed steps per contender per round")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DataParallel and DDP bucket size")
    p.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                   help="DataParallel's overlap setting; 'both' times each kvstore with overlap off and on")
    p.add_argument("--no-ddp", action="store_true", help="skip torch DDP (e.g. without gloo)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time forward / backward / exposed gradient wait / optimizer step per kvstore")
    p.add_argument("--no-poll-thread", dest="poll_thread", action="store_false",
                   help="by default a thread wakes every 100 us in every rank for the whole run, so every "
                        "contender gets the scheduling boost that a polling comm thread earns on a busy VM")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: ResNet-50 on each rank's GPU vs DDP (NCCL) and plain torch (module doc)")
    p.add_argument("--batch", type=int, default=64, help="--device cuda: per-rank batch")
    p.add_argument("--image", type=int, default=224, help="--device cuda: image side")
    add_precisions(p)
    p.add_argument("--trace", metavar="DIR", help="--device cuda: after the timings, profile two DataParallel "
                   "steps per rank (Chrome traces in DIR) and count the host's blocking CUDA calls during "
                   "backward, on the thread that launches its kernels vs the comm threads")
    add_outputs(p)  # --json FILE, --plot FILE.png (this benchmark draws its own bar chart)
    return p.parse_args(argv)


class _Step:
    """One training step on a fixed per-rank batch: zero_grad, forward, backward, SGD step."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.model, self.x, self.y = model, x, y
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def __call__(self) -> None:
        self.opt.zero_grad()
        F.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()


def _timed(comm: Communicator, step: Callable[[], None], steps: int) -> float:
    """Steps/s of `steps` calls of `step` on every rank after one warm-up call; the slowest rank counts."""
    comm.barrier()
    step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - t0
    return steps / comm.allreduce(torch.tensor([elapsed], dtype=torch.float64), "max").item()


def _solo(comm: Communicator, step: Callable[[], None], steps: int) -> float:
    """Steps/s of rank 0 training alone while the other ranks sleep (:func:`bench.common.on_rank0_alone`)."""
    comm.barrier()

    def rate() -> float:
        step()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return steps / (time.perf_counter() - t0)

    return on_rank0_alone(comm, rate)


class _Breakdown:
    """Per-phase wall time of one rank's steps: forward, backward (its last part is the exposed wait
    for the gradient reductions, measured separately for DataParallel), optimizer step."""

    def __init__(self) -> None:
        self.t = {"forward": 0.0, "backward": 0.0, "exposed wait": 0.0, "step": 0.0}

    def run(self, st: _Step, steps: int, dp: DataParallel | None) -> dict[str, float]:
        if dp is not None:
            wait = dp.kv.wait

            def timed_wait(keys: Key | Sequence[Key] | None = None) -> None:
                t0 = time.perf_counter()
                wait(keys)
                self.t["exposed wait"] += time.perf_counter() - t0

            dp.kv.wait = timed_wait  # type: ignore[method-assign]  # instrumented for this run only
        for _ in range(steps):
            t0 = time.perf_counter()
            st.opt.zero_grad()
            loss = F.cross_entropy(st.model(st.x), st.y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            st.opt.step()
            t3 = time.perf_counter()
            self.t["forward"] += t1 - t0
            self.t["backward"] += t2 - t1
            self.t["step"] += t3 - t2
        if dp is not None:
            dp.kv.wait = wait  # type: ignore[method-assign]
        return {k: 1e3 * v / steps for k, v in self.t.items()}


def _contenders(args: argparse.Namespace, comm: Communicator, name: str) -> dict[str, Callable[[int], float]]:
    """name -> run(steps) -> steps/s. DataParallel is rebuilt each round over one shared module (its
    hooks and kvstore are released after the round); DDP keeps its own copy of the model."""
    factory, shape, batch = MODELS[name]
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    torch.manual_seed(0)
    shared = factory()
    plain = _Step(shared, x, y)
    out: dict[str, Callable[[int], float]] = {
        "solo": lambda n: _solo(comm, plain, n),
        "pair-local": lambda n: _timed(comm, plain, n),
    }
    if not args.no_ddp:
        ddp_step = _Step(_ddp(factory(), args.bucket_mb), x, y)
        out["ddp (gloo)"] = lambda n: _timed(comm, ddp_step, n)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    for kv in args.kvstores.split(","):
        for mode in modes:
            label = f"mpitrain/{kv}" + ("" if mode or args.overlap != "both" else " no-overlap")
            out[label] = _dp_runner(comm, shared, kv, args.bucket_mb, x, y, mode)
    return out


def _dp_runner(comm: Communicator, module: nn.Module, kv: str, bucket_mb: float, x: torch.Tensor,
               y: torch.Tensor, overlap: bool) -> Callable[[int], float]:
    def run(steps: int) -> float:
        dp = DataParallel(module, kvstore=kv, bucket_mb=bucket_mb, comm=comm, overlap=overlap)
        try:
            return _timed(comm, _Step(dp, x, y), steps)
        finally:
            dp.close()
    return run


def _ddp(model: nn.Module, bucket_mb: float) -> nn.Module:
    import torch.distributed as dist

    from mpitrain.comm import init_torch_world

    if not dist.is_initialized():
        init_torch_world(mpitrain.rank(), mpitrain.size(), mpitrain.init())
    return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)


def _measure(args: argparse.Namespace, comm: Communicator, name: str) -> dict[str, list[float]]:
    runs = _contenders(args, comm, name)
    names = list(runs)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate: no fixed neighbour
        for n in order:
            rates[n].append(runs[n](args.steps))
        if comm.rank == 0:
            print(f"# {name} round {r + 1}/{args.rounds}: " +
                  ", ".join(f"{n}={rates[n][-1]:.3g}" for n in names), flush=True)
    return rates


def _rows(name: str, rates: dict[str, list[float]]) -> list[list[object]]:
    med = {n: statistics.median(v) for n, v in rates.items()}
    ddp, solo = med.get("ddp (gloo)"), med["solo"]
    rows: list[list[object]] = []
    for n, v in rates.items():
        ratio = f"{med[n] / ddp:.3f}" if ddp else "-"
        rows.append([name, n, med[n], min(v), max(v), ratio, f"{med[n] / solo:.3f}"])
    return rows


def _breakdown(args: argparse.Namespace, comm: Communicator, name: str) -> list[list[object]]:
    """Per-phase milliseconds per contender; one DataParallel (and its store threads) alive at a time."""
    factory, shape, batch = MODELS[name]
    g = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(batch, *shape, generator=g), torch.randint(0, 10, (batch,), generator=g)
    module = factory()
    makers: list[tuple[str, Callable[[], tuple[nn.Module, DataParallel | None]]]] = []
    if not args.no_ddp:
        ddp = _ddp(factory(), args.bucket_mb)
        makers.append(("ddp (gloo)", lambda: (ddp, None)))
    for kv in args.kvstores.split(","):
        def make(kv: str = kv) -> tuple[nn.Module, DataParallel]:
            dp = DataParallel(module, kvstore=kv, bucket_mb=args.bucket_mb, comm=comm,
                              overlap=args.overlap != "off")
            return dp, dp
        makers.append((f"mpitrain/{kv}", make))
    rows: list[list[object]] = []
    for label, build in makers:
        model, dp = build()
        st = _Step(model, x, y)
        st()
        comm.barrier()
        ms = _Breakdown().run(st, args.steps, dp)
        if dp is not None:
            dp.close()
        worst = {k: comm.allreduce(torch.tensor([v], dtype=torch.float64), "max").item()
                 for k, v in ms.items()}
        rows.append([name, label, *(worst[k] for k in ("forward", "backward", "exposed wait", "step"))])
    return rows


def _plot(path: str, rows: list[list[object]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({str(r[0]) for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        mine = [r for r in rows if r[0] == m]
        ax.bar([str(r[1]) for r in mine], [cast(float, r[2]) for r in mine], color="tab:blue")
        ax.set_title(f"{m}: training steps/s (median)")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _poll_forever() -> None:
    """On a contended VM, a process with a thread that wakes often computes several times faster (its
    vCPU keeps being scheduled); with ``--poll-thread`` every contender gets the same help."""
    while True:
        time.sleep(1e-4)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args.device == "cuda":
        return _main_cuda(args)
    torch.set_num_threads(1)
    comm = mpitrain.init()
    if args.poll_thread:
        threading.Thread(target=_poll_forever, name="bench-poller", daemon=True).start()
    load0 = os.getloadavg()[0]
    rows: list[list[object]] = []
    for name in args.models.split(","):
        rows += _rows(name, _measure(args, comm, name))
    if comm.rank == 0:
        print(header("DataParallel steps/s per kvstore vs torch DDP (gloo), interleaved rounds", comm.size))
        print(f"# per-rank batch: {', '.join(f'{m}={MODELS[m][2]}' for m in args.models.split(','))}; "
              f"{args.rounds} rounds x {args.steps} steps; bucket {args.bucket_mb} MiB; "
              f"eff = steps/s over solo (pair-local/solo: the ceiling of processes sharing the machine)")
        print(f"# poll thread: {args.poll_thread}; 1-min load average at start {load0:.1f}, "
              f"at end {os.getloadavg()[0]:.1f} (the machine's other jobs)")
        print_table(["model", "contender", "steps/s", "min", "max", "vs ddp", "eff"], rows)
    if args.breakdown:
        brows = [r for name in args.models.split(",") for r in _breakdown(args, comm, name)]
        if comm.rank == 0:
            print("# per-step milliseconds, slowest rank (backward includes the exposed wait)")
            print_table(["model", "contender", "forward", "backward", "exposed wait", "step"], brows)
    if args.plot and comm.rank == 0:
        _plot(args.plot, rows)
        print(f"# plot written to {args.plot}")
    save_outputs(args, "dataparallel", comm.size, comm.rank, plot=False)
    return 0


def _main_cuda(args: argparse.Namespace) -> int:
    from mpitrain.bench import _dataparallel_cuda as cuda

    refused = without_cuda("dataparallel")  # the same verdict on every rank, before any message
    if refused is not None:
        return refused
    if args.kvstores == _parse([]).kvstores:
        args.kvstores = "dist_sync_mpi"  # the GPU table times the default store unless asked
    args.steps = max(args.steps, DEVICE_STEPS)
    cuda.run(args)
    save_outputs(args, "dataparallel-cuda", mpitrain.size(), mpitrain.rank())
    return 0


if __name__ == "__main__":
    sys.exit(main())
