"""``mpitrain bench fit``: what `fit` costs over the hand-written loop it replaces, on short epochs.

Run as ``mpitrain bench fit -n 1 [--device cpu|cuda] [--model small224|cnn|resnet50] [--epochs 5]
[--steps-per-epoch 10] [--rounds 5] [--progress]``. Two contenders, interleaved round by round
(:func:`~.common.paired_rounds`), on the same model, optimizer (SGD, momentum 0.9) and batches (held on
the CPU, as a loader yields them; each contender moves them to the model's device):

- ``plain torch``: ``for epoch: for x, y in batches: zero_grad; loss_fn(model(x), y).backward(); step``;
- ``fit``: one ``fit(model, batches, loss_fn, optimizer, epochs=E, progress=...)`` call (strategy
  "data"), its set-up and tear-down included.

Each is timed over its E epochs of S steps (the device drained at both ends, the slowest rank's time)
and reported per step, with the median over rounds of fit's per-round ratio over plain torch and fit's
extra milliseconds per epoch. One rank isolates fit's own cost; with ``-n N`` fit trains data-parallel
on global batches of N x the per-rank batch while plain torch trains each rank's batch alone, so the
ratio then includes the gradient allreduce. The target (issue #30): fit <= 1.03x plain torch on
10-step epochs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
from mpitrain.bench._dataparallel_cuda import resnet50
from mpitrain.bench.common import (
    add_outputs,
    add_precisions,
    device_line,
    device_timer,
    header,
    ms_against,
    paired_rounds,
    print_table,
    rank_max,
    save_outputs,
    without_cuda,
)
from mpitrain.bench.dataparallel import cnn
from mpitrain.comm.base import Communicator
from mpitrain.fit import fit

__all__ = ["main"]

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def small224() -> nn.Module:
    """A small CNN on ResNet-50's input (3 x 224^2, 1000 classes): on one CPU core a step of a batch of 64
    (38.5 MB, the batch of ResNet-50 on a GPU) takes tens of milliseconds, as ResNet-50 does on a GPU,
    so costs that grow with the batch's bytes weigh on the CPU as they do there."""
    return nn.Sequential(nn.AvgPool2d(4), nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(16, 1000))


#: name -> (factory, image side, classes, per-rank batch on the CPU, on CUDA)
MODELS: dict[str, tuple[Callable[[], nn.Module], int, int, int, int]] = {
    "small224": (small224, 224, 1000, 64, 64),
    "cnn": (cnn, 32, 10, 16, 256),
    "resnet50": (resnet50, 224, 1000, 4, 64),
}


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench fit", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--model", choices=sorted(MODELS), default=None,
                   help="default: small224 on the CPU, resnet50 on CUDA")
    p.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the model's, per device)")
    p.add_argument("--epochs", type=int, default=5, help="epochs per timed fit call")
    p.add_argument("--steps-per-epoch", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--progress", action="store_true", help="fit draws its progress bar (rank 0)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the process's CPU seconds instead of wall-clock ones (--device cpu only): other "
                        "jobs on a loaded machine then stretch both contenders' times less")
    add_precisions(p)
    add_outputs(p)
    args = p.parse_args(argv)
    if args.device == "cpu" and argv.count("--precisions") == 0:
        args.precisions = ["fp32"]
    args.model = args.model or ("resnet50" if args.device == "cuda" else "small224")
    if args.clock == "cpu" and args.device == "cuda":
        p.error("--clock cpu times the host alone: use it with --device cpu")
    if min(args.epochs, args.steps_per_epoch, args.rounds) < 1 or (args.batch is not None and args.batch < 1):
        p.error("--epochs, --steps-per-epoch, --rounds and --batch must be >= 1")
    return args


def _batches(args: argparse.Namespace, rows: int, seed: int) -> Batches:
    _, side, classes, _, _ = MODELS[args.model]
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 3, side, side, generator=g), torch.randint(0, classes, (rows,), generator=g))
            for _ in range(args.steps_per_epoch)]


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)  # type: ignore[arg-type]


def _plain(model: nn.Module, batches: Batches, epochs: int, bf16: bool) -> Callable[[], None]:
    """The hand-written loop: `epochs` passes over `batches` (moved to the model's device per step)."""
    dev = next(model.parameters()).device
    opt = _sgd(model.parameters())

    def run() -> None:
        for _ in range(epochs):
            for x, y in batches:
                opt.zero_grad()
                ctx = torch.autocast(dev.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
                with ctx:
                    loss = F.cross_entropy(model(x.to(dev, non_blocking=True)), y.to(dev, non_blocking=True))
                loss.backward()
                opt.step()

    return run


def _fit(comm: Communicator, model: nn.Module, batches: Batches, args: argparse.Namespace,
         precision: str) -> Callable[[], None]:
    def run() -> None:
        fit(model, batches, F.cross_entropy, _sgd, epochs=args.epochs, progress=args.progress and comm.rank == 0,
            precision=precision, comm=comm)

    return run


def _cpu_timer(comm: Communicator, run: Callable[[], None]) -> Callable[[], float]:
    """A timer for :func:`~.common.paired_rounds`: the CPU seconds this process spends in `run` (every
    thread), the largest rank's. Collective over `comm`."""
    def timer() -> float:
        comm.barrier()
        t0 = time.process_time()
        run()
        return rank_max(comm, time.process_time() - t0)

    return timer


def _per(timer: Callable[[], float], steps: int) -> Callable[[], float]:
    return lambda: timer() / steps


def measure(comm: Communicator, args: argparse.Namespace, dev: torch.device, precision: str) -> list[list[object]]:
    """The table rows of one precision: plain torch, then fit with its ratio and extra ms per epoch."""
    factory, _, _, cpu_batch, cuda_batch = MODELS[args.model]
    per_rank = args.batch or (cuda_batch if dev.type == "cuda" else cpu_batch)
    steps = args.epochs * args.steps_per_epoch
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(factory().to(dev))
    everyone = _batches(args, per_rank * comm.size, seed=0)  # the global batches fit splits
    rows = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
    mine = [(x[rows], y[rows]) for x, y in everyone]  # what this rank alone trains in plain torch
    bf16 = precision == "bf16"
    runs = {"plain torch": _plain(models[0], mine, args.epochs, bf16),
            "fit": _fit(comm, models[1], everyone, args, precision)}
    timers = {k: device_timer(comm, f, 1, dev) if args.clock == "wall" else _cpu_timer(comm, f)
              for k, f in runs.items()}
    t = paired_rounds({k: _per(f, steps) for k, f in timers.items()}, args.rounds)
    out = []
    for name, v in t.items():
        extra = [(a - b) * args.steps_per_epoch * 1e3 for a, b in zip(v, t["plain torch"])]
        out.append([precision, name, *ms_against(v, t["plain torch"]), sorted(extra)[len(extra) // 2]])
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if args.device == "cuda":
        refused = without_cuda("fit")  # the same verdict on every rank, before any message
        if refused is not None:
            return refused
    else:
        torch.set_num_threads(1)
    comm = mpitrain.init()
    dev = mpitrain.device() if args.device == "cuda" else torch.device("cpu")
    load0 = os.getloadavg()[0]
    rows = [r for precision in args.precisions for r in measure(comm, args, dev, precision)]
    if comm.rank == 0:
        print(header("fit vs a hand-written loop (plain torch): ms/step on short epochs, interleaved rounds",
                     comm.size))
        print(device_line(comm, dev))
        print(f"# {args.model}, per-rank batch {args.batch or MODELS[args.model][4 if dev.type == 'cuda' else 3]}; "
              f"{args.rounds} rounds of {args.epochs} epochs x {args.steps_per_epoch} steps; {args.clock} clock; "
              f"fit progress bar "
              f"{'on' if args.progress else 'off'}; 1-min load average at start {load0:.1f}, at end "
              f"{os.getloadavg()[0]:.1f}")
        print_table(["precision", "contender", "ms/step", "min", "max", "vs plain", "q25-q75",
                     "ms/epoch over plain"], rows)
    save_outputs(args, "fit", comm.size, comm.rank, plot=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
