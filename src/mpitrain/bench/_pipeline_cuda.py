"""``mpitrain bench pipeline --device cuda``: milliseconds per training step of our pipeline (``fit``'s
"model" strategy over every rank with the gpipe, 1f1b and interleaved-1f1b schedules; "hybrid" P=2 where
the ranks pair up; "data" for scale) against ONE process of plain torch training the same global batch
on the same GPU, contenders interleaved round by round in one job (:func:`~.common.paired_rounds`).

The model is a deep MLP (``--mlp-depth`` hidden Linear+ReLU layers of ``--mlp-width``, 10 classes): it
traces with torch.fx and balances by parameters (``balance="params"``: ``balance="time"`` profiles per
node from the host clock, which on a GPU times kernel launches, not kernels). Every rank builds its
model on :func:`mpitrain.device` (``init`` binds rank -> ``cuda:local_rank % count``); the global batch
(``--batch`` x ``--mlp-width``, CPU tensors, as a loader gives them) is moved to the GPU by the strategy,
and by plain torch inside its step. Plain torch runs on rank 0 alone, the other ranks asleep, twice: the
whole batch in one pass ("torch"), and in the pipeline's M micro-batches with gradients accumulated
("torch M": the same arithmetic as the pipeline). Ranks may share one GPU (MPI backend: CUDA-aware or
staged through pinned host memory); they then time-share it (no MPS), so the pipeline has no GPU of
its own per stage to gain from: the table shows what the stages and their messages cost.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Iterable

import torch
from torch import nn

import mpitrain

from ..comm.base import Communicator
from ..fit import FitSpec, make_trainer
from ..strategies import autocast
from ..strategies.base import LoopSpec
from .common import (
    device_alone_timer,
    device_line,
    device_timer,
    header,
    ms_against,
    paired_ratio,
    paired_rounds,
    print_table,
)

__all__ = ["run", "mlp"]

Timer = Callable[[], float]


def mlp(depth: int, width: int, classes: int = 10) -> nn.Sequential:
    """`depth` hidden Linear(width, width)+ReLU layers after an input Linear(width, width)+ReLU, then a
    Linear(width, classes): uniform layers, so a split by parameters is a split by time."""
    layers: list[nn.Module] = [nn.Linear(width, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _model(args: argparse.Namespace, dev: torch.device) -> nn.Module:
    """The same initial weights for every contender, built on `dev` (no host copy of the weights)."""
    torch.manual_seed(0)
    with dev:
        return mlp(args.mlp_depth, args.mlp_width)


def _torch_step(args: argparse.Namespace, dev: torch.device, x: torch.Tensor, y: torch.Tensor, micro: int,
                precision: str) -> Callable[[], None]:
    """One process's step on the whole global batch (moved to `dev` as a user would), in `micro`
    micro-batches with the gradients accumulated."""
    model, loss_fn = _model(args, dev), nn.CrossEntropyLoss()
    opt = _sgd(model.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        xd, yd = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
        for xs, ys in zip(xd.chunk(micro), yd.chunk(micro)):
            with autocast(precision, dev):  # the strategies' rule
                loss = loss_fn(model(xs), ys) / micro
            loss.backward()
        opt.step()

    return step


def _strategy_step(args: argparse.Namespace, comm: Communicator, dev: torch.device, x: torch.Tensor,
                   y: torch.Tensor, strategy: str, partitions: int, schedule: str, precision: str,
                   finish: list[Callable[[], object]]) -> Callable[[], None]:
    """One step of `fit`'s trainer for `strategy` on the global batch (CPU tensors: it moves them). A
    data trainer's ``trained_model`` (collective: it closes its kvstore's thread) is appended to
    `finish`, called when the timing is over, as fit does."""
    micro = args.micro_batches if strategy != "data" else 1
    spec = FitSpec(strategy=strategy, partitions=partitions, micro_batches=micro, schedule=schedule,
                   balance="params", loop=LoopSpec(precision=precision))
    trainer = make_trainer(_model(args, dev), nn.CrossEntropyLoss(), _sgd, comm, spec)
    if strategy == "data":
        finish.append(trainer.trained_model)

    def step() -> None:
        trainer.train_step(x, y)

    return step


def _contenders(args: argparse.Namespace, comm: Communicator, dev: torch.device, x: torch.Tensor,
                y: torch.Tensor, precision: str,
                finish: list[Callable[[], object]]) -> dict[str, tuple[int, int, Timer]]:
    """label -> (pipeline stages P, micro-batches M, timer in seconds per step); what to call after the
    timing goes to `finish`."""
    size, M, steps = comm.size, args.micro_batches, args.steps

    def torch_timer(micro: int) -> Timer:  # only rank 0 builds the model it times
        step = _torch_step(args, dev, x, y, micro, precision) if comm.rank == 0 else None
        return device_alone_timer(comm, step, steps, dev)

    def ours(strategy: str, partitions: int, schedule: str = "1f1b") -> Timer:
        step = _strategy_step(args, comm, dev, x, y, strategy, partitions, schedule, precision, finish)
        return device_timer(comm, step, steps, dev)

    out: dict[str, tuple[int, int, Timer]] = {"torch, 1 process": (1, 1, torch_timer(1))}
    if M > 1:
        out[f"torch, 1 process, M={M}"] = (1, M, torch_timer(M))
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        if schedule == "interleaved-1f1b" and M % size:
            continue  # interleaved needs M a multiple of P
        out[f"model {schedule}"] = (size, M, ours("model", size, schedule))
    if size >= 4 and size % 2 == 0:
        out["hybrid 1f1b (P=2)"] = (2, M, ours("hybrid", 2))
    if size > 1:
        out["data"] = (1, 1, ours("data", 1))
    return out


def run(args: argparse.Namespace) -> list[list[object]]:
    """Time every contender (module doc) for each of ``args.precisions``; rank 0 prints the header, then
    a table per precision as soon as it is measured. Returns every row. Collective: every rank calls
    it with the same arguments."""
    comm = mpitrain.init()
    dev = mpitrain.device()
    if comm.rank == 0:
        print(header("pipeline on CUDA: ms/step of model/hybrid/data vs one process of plain torch, interleaved "
                     "rounds", comm.size))
        print(device_line(comm, dev))
        print(f"# MLP {args.mlp_depth + 2} Linear layers x {args.mlp_width} (fx-traced, balance='params'); global "
              f"batch {args.batch} (CPU tensors, moved by each contender); M={args.micro_batches}; "
              f"{args.rounds} rounds x {args.steps} steps; 'x torch' = ms/step over torch alone on the whole "
              f"batch, 'x torch M' over torch alone in M micro-batches (medians of per-round ratios)", flush=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.mlp_width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    rows: list[list[object]] = []
    for precision in args.precisions:
        finish: list[Callable[[], object]] = []
        contenders = _contenders(args, comm, dev, x, y, precision, finish)
        t = paired_rounds({label: timer for label, (_, _, timer) in contenders.items()}, args.rounds)
        base, base_m = t["torch, 1 process"], t.get(f"torch, 1 process, M={args.micro_batches}")
        table = []
        for label, (P, M, _) in contenders.items():
            table.append([precision, label, P, M, *ms_against(t[label], base),
                          paired_ratio(t[label], base_m) if base_m else "-"])
        if comm.rank == 0:
            print_table(["precision", "contender", "P", "M", "ms/step", "min", "max", "x torch", "q25-q75",
                         "x torch M"], table)
        rows += table
        for f in finish:
            f()
        del contenders, finish
        gc.collect()  # the trainers (and their GPU memory) go before the next precision's are built
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows
