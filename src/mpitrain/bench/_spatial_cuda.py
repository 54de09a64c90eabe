"""``mpitrain bench spatial --device cuda``: milliseconds per training step of the spatial strategy
(:class:`~mpitrain.spatial.trainer.SpatialTrainer` on every grid of ``--grids``, with and without halo
overlap) against ONE process of plain torch training the same global batch on the same GPU, in every
memory format of ``--formats`` and precision of ``--precisions``, contenders interleaved round by round
in one job (:func:`~.common.paired_rounds`).

Every rank builds the ``--model`` (default the mesh model; ``--size`` 512, ``--batch`` 4 on CUDA) on
:func:`mpitrain.device` (``init`` binds rank -> ``cuda:local_rank % count``). The global batch is made on
the CPU, as a loader gives it: the spatial trainer slices each rank's block there and moves it, plain
torch moves the whole batch inside its step. Plain torch runs on rank 0 alone, the other ranks asleep.
Ranks may share one GPU (MPI backend, halos CUDA-aware or staged through pinned host memory); they then
time-share it (no MPS). "peak MiB/rank" is the rise of the CUDA caching allocator's peak during one
step (activations, gradients, halos, workspaces; not the model or the batch that exist before it), the
largest over the ranks.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
from collections.abc import Callable

import torch
from torch import nn

import mpitrain

from ..comm.base import Communicator
from ..perf.memory import step_memory
from ..spatial.distribution import Distribution
from ..spatial.trainer import SpatialTrainer
from ..strategies import autocast
from ..strategies.base import LoopSpec
from .common import (
    device_alone_timer,
    device_line,
    device_timer,
    header,
    ms_against,
    on_rank0_alone,
    paired_rounds,
    print_table,
    rank_max,
)

__all__ = ["run"]

Timer = Callable[[], float]


def _peak_mib(step: Callable[[], object], dev: torch.device) -> float:
    """MiB by which the allocator's peak rises during one `step` (CUDA's peak statistics on a GPU; the
    profiler's allocation events, :func:`~mpitrain.perf.memory.step_memory`, on the CPU)."""
    if dev.type != "cuda":
        return step_memory(step) / 2**20
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    step()
    torch.cuda.synchronize(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / 2**20


class _Contender:
    """One row: what it is, its timer (seconds per step) and its one-step memory probe (MiB)."""

    def __init__(self, label: str, grid: tuple[int, ...], groups: int, timer: Timer,
                 memory: Callable[[], float]) -> None:
        self.label, self.grid, self.groups, self.timer, self.memory = label, grid, groups, timer, memory


def _torch(args: argparse.Namespace, comm: Communicator, dev: torch.device, model: nn.Module, x: torch.Tensor,
           y: torch.Tensor, loop: LoopSpec, label: str) -> _Contender:
    """Plain torch on rank 0 alone: the whole global batch, moved to `dev` in the step."""
    def make() -> Callable[[], None]:
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with autocast(loop.precision, dev):  # the strategies' rule
                loss = args.loss_fn(m(x.to(dev, non_blocking=True)), y.to(dev, non_blocking=True))
            loss.backward()
            opt.step()
        return step

    step = make() if comm.rank == 0 else None

    def memory() -> float:
        assert step is not None
        return _peak_mib(step, dev)

    return _Contender(label, (1, 1), 1, device_alone_timer(comm, step, args.steps, dev),
                      lambda: on_rank0_alone(comm, memory))


def _spatial(args: argparse.Namespace, comm: Communicator, dev: torch.device, model: nn.Module, x: torch.Tensor,
             y: torch.Tensor, loop: LoopSpec, grid: tuple[int, ...], groups: int, overlap: bool,
             label: str) -> _Contender:
    trainer = SpatialTrainer(copy.deepcopy(model), args.loss_fn, lambda p: torch.optim.SGD(p, lr=1e-3),
                             Distribution(comm, grid, groups), overlap=overlap, loop=loop)

    def step() -> None:
        trainer.train_step(x, y)

    return _Contender(label, grid, groups, device_timer(comm, step, args.steps, dev),
                      lambda: rank_max(comm, _peak_mib(step, dev)))


def _contenders(args: argparse.Namespace, comm: Communicator, dev: torch.device, model: nn.Module,
                x: torch.Tensor, y: torch.Tensor, fmt: str, loop: LoopSpec,
                grids: list[tuple[tuple[int, ...], int]], memory_format: torch.memory_format) -> list[_Contender]:
    m = copy.deepcopy(model).to(memory_format=memory_format)  # type: ignore[call-overload]
    xf = x.contiguous(memory_format=memory_format)
    tag = f"({fmt}, {loop.precision})"
    out = [_torch(args, comm, dev, m, xf, y, loop, f"torch, 1 process {tag}")]
    for grid, groups in grids:
        name = "x".join(map(str, grid))
        out.append(_spatial(args, comm, dev, m, xf, y, loop, grid, groups, True, f"spatial {name} {tag}"))
        if math.prod(grid) > 1 and not args.no_overlap_row and len(grid) == 2:
            out.append(_spatial(args, comm, dev, m, xf, y, loop, grid, groups, False,
                                f"spatial {name} {tag} no-overlap"))
    return out


def run(args: argparse.Namespace, model: nn.Module, x: torch.Tensor, y: torch.Tensor, title: str,
        grids: list[tuple[tuple[int, ...], int]],
        memory_format: Callable[[str, int], torch.memory_format]) -> list[list[object]]:
    """Time every contender (module doc) on `model` (moved to this rank's device) and the CPU batch
    (`x`, `y`) for every grid of `grids` ((grid, sample groups)); rank 0 prints the header, then a table
    per precision and format as soon as it is measured. Returns every row. Collective: every rank calls
    it with the same arguments."""
    comm = mpitrain.init()
    dev = mpitrain.device()
    if comm.rank == 0:
        print(header(f"spatial on CUDA: {title}; ms/step vs one process of plain torch, interleaved rounds",
                     comm.size))
        print(device_line(comm, dev))
        print(f"# global batch made on the CPU, moved by each contender; {args.rounds} rounds x {args.steps} steps; "
              f"'x torch' = ms/step over torch alone in the same format and precision (median of per-round "
              f"ratios); peak MiB/rank: the allocator's rise during one step, largest rank", flush=True)
    if dev.type == "cuda":
        torch.backends.cudnn.benchmark = True  # every contender's shapes are tuned in the warm-up round
    model = model.to(dev)
    rows: list[list[object]] = []
    for precision in args.precisions:
        loop = LoopSpec(precision=precision)
        for fmt in args.formats:
            contenders = _contenders(args, comm, dev, model, x, y, fmt, loop, grids, memory_format(fmt, x.dim()))
            t = paired_rounds({c.label: c.timer for c in contenders}, args.rounds)
            mems = [c.memory() for c in contenders]
            base, base_mem = t[contenders[0].label], mems[0]
            table = []
            for c, mem in zip(contenders, mems):
                table.append([c.label, math.prod(c.grid), c.groups, *ms_against(t[c.label], base), mem,
                              mem / base_mem if base_mem else "-"])
            if comm.rank == 0:
                print_table(["config", "ranks/sample", "groups", "ms/step", "min", "max", "x torch", "q25-q75",
                             "peak MiB/rank", "mem ratio"], table)
            rows += table
            del contenders
            gc.collect()  # the trainers (and their GPU memory) go before the next ones are built
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return rows
