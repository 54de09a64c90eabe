"""The spatial conformance set, measured: per model and grid, whether training equals one process, how
many whole-sample redistributions a step does, and the step memory per rank.

``mpitrain bench spatial_models -n N [--models resnet18,convnext] [--size 64] [--video]`` trains every
model of :data:`~mpitrain.spatial.models.CLASSIFIERS` (``--video``: :data:`~mpitrain.spatial.models.VIDEO`
on 3-D grids, clips of 2 frames) in float64 with dropout off, batch 2, for 2 SGD-momentum steps on
every grid of :func:`~mpitrain.spatial.models.suite_grids` for the world size, and
prints per (model, grid): the relative gap of the parameter update to one process's (rank 0 alone),
the redistributions per step (``Distribution.redistributions`` after the steps, over the steps) and
the tensor-level step memory (:func:`~mpitrain.perf.memory.step_memory` of the second step: the peak
rise of live tensor bytes; largest rank) against one process's, beside the parameters' gradient
bytes (at the set's small inputs gradients and their allreduce buffer dominate the step memory; the
activations, which spatial splitting divides, dominate at larger ones: ``--size``). Not timed: these
sizes are for checking, not speed.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..comm.base import Communicator
from ..perf.memory import step_memory
from ..spatial.distribution import Distribution
from ..spatial.models import CLASSIFIERS, VIDEO, no_dropout, suite_grids
from ..spatial.trainer import SpatialTrainer
from .common import header, print_table, rank_max

STEPS = 2
MIB = 2.0 ** 20


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench spatial_models", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="", help="comma-separated names (default: the whole set)")
    p.add_argument("--size", type=int, default=64, help="image side (clips: height and width); at 3 ranks "
                   "the height is 1.5x (a 3-row split of the last feature map)")
    p.add_argument("--video", action="store_true", help="the video models on 3-D grids")
    return p.parse_args(list(argv))


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _one_process(comm: Communicator, model: nn.Module, batches: list, loss_fn: nn.Module) -> tuple[torch.Tensor, int]:
    """(the parameter update of one process, its second step's memory), computed on rank 0, sent to all."""
    ref = copy.deepcopy(model)
    mem = 0
    if comm.rank == 0:
        opt = _sgd(ref.parameters())

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            loss_fn(ref(x), y).backward()
            opt.step()
        step(*batches[0])
        mem = step_memory(lambda: step(*batches[1]))
    update = comm.broadcast(_flat(ref) - _flat(model), 0)
    return update, int(comm.broadcast(torch.tensor([mem], dtype=torch.float64), 0)[0])


def _row(comm: Communicator, name: str, model: nn.Module, batches: list, grid: tuple[int, ...], samples: int,
         expected: torch.Tensor, base_mem: int) -> list[object]:
    trainer = SpatialTrainer(copy.deepcopy(model), nn.CrossEntropyLoss(), _sgd, Distribution(comm, grid, samples))
    start = _flat(model)
    trainer.train_step(*batches[0])
    mem = rank_max(comm, step_memory(lambda: trainer.train_step(*batches[1])))
    gap = float((_flat(trainer.model) - start - expected).norm() / expected.norm())
    moves = sum(trainer.dist.redistributions.values()) / STEPS
    where = ",".join(sorted(trainer.dist.redistributions)) or "-"
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return [name, "x".join(map(str, grid)) + (f" x{samples}" if samples > 1 else ""),
            "equal" if gap < 1e-9 else "DIFFERS", gap, moves, where, mem / MIB, base_mem / MIB, mem / max(base_mem, 1),
            grads / MIB]


def main(argv: Sequence[str]) -> int:
    import mpitrain

    args = _parse(argv)
    comm = mpitrain.init()
    zoo: dict[str, Callable[[], nn.Module]] = VIDEO if args.video else CLASSIFIERS
    names = [n for n in args.models.split(",") if n] or list(zoo)
    h = args.size * 3 // 2 if comm.size == 3 else args.size
    shape = (2, 3, 2, h, args.size) if args.video else (2, 3, h, args.size)
    rows = []
    for name in names:
        torch.manual_seed(0)
        model = no_dropout(zoo[name]().double())
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(shape, dtype=torch.float64, generator=g), torch.randint(0, 10, (2,), generator=g))
                   for _ in range(STEPS)]
        expected, base = _one_process(comm, model, batches, nn.CrossEntropyLoss())
        for grid, samples in suite_grids(comm.size, args.video):
            rows.append(_row(comm, name, model, batches, grid, samples, expected, base))
    if comm.rank == 0:
        print(header(f"spatial conformance set, input {tuple(shape)}, float64, {STEPS} steps", comm.size))
        print_table(["model", "grid", "result", "update gap", "redistributions/step", "ops",
                     "step MiB/rank", "1 proc MiB", "mem ratio", "grads MiB"], rows)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
