"""The spatial conformance set, measured: per model and grid, whether training equals one process, how
many whole-sample redistributions a step does, where fit's loss runs, and the step memory per rank.

``mpitrain bench spatial_models -n N [--models resnet18,convnext] [--size 64] [--video | --segmentation]
[--mem-size 128]`` trains every model of :data:`~mpitrain.spatial.models.CLASSIFIERS` (``--video``:
:data:`~mpitrain.spatial.models.VIDEO` on 3-D grids, clips of 2 frames; ``--segmentation``:
:data:`~mpitrain.spatial.models.SEGMENTATION` under torchvision's criterion, dense targets with ignored
pixels, more in some blocks than others) in float64 with dropout off, batch 2, for 2 SGD-momentum steps
on every grid of :func:`~mpitrain.spatial.models.suite_grids` for the world size, and prints per
(model, grid): the relative gap of the parameter update to one process's (rank 0 alone), the
redistributions per step (``Distribution.redistributions`` after the steps, over the steps), where the
loss ran (``blocks``: dense targets laid out like the output; ``samples``: gathered), and the
tensor-level step memory (:func:`~mpitrain.perf.memory.step_memory` of a second step: the peak rise of
live tensor bytes; largest rank) against one process's, beside the parameters' gradient bytes — of the
float64 check itself, or with ``--mem-size S`` of a float32 step on batch 2 of S x S (at the set's small
inputs gradients and their allreduce buffer dominate the step memory; the activations, which spatial
splitting divides, dominate at larger ones). Not timed: these sizes are for checking, not speed.
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
from ..spatial.models import CLASSIFIERS, IGNORE, SEGMENTATION, VIDEO, no_dropout, segmentation_criterion, suite_grids
from ..spatial.trainer import SpatialTrainer
from .common import header, print_table, rank_max

STEPS = 2
MIB = 2.0 ** 20
LossFn = Callable[..., torch.Tensor]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench spatial_models", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="", help="comma-separated names (default: the whole set)")
    p.add_argument("--size", type=int, default=0, help="image side (clips: height and width; default 64, "
                   "segmentation 32); at 3 ranks the height is 1.5x (a 3-row split of the last feature map)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--video", action="store_true", help="the video models on 3-D grids")
    kind.add_argument("--segmentation", action="store_true", help="the segmentation models, dense targets")
    p.add_argument("--mem-size", type=int, default=0, help="measure the memory on a float32 step at this "
                   "image side (default: the float64 check's step)")
    return p.parse_args(list(argv))


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _one_process(comm: Communicator, model: nn.Module, batches: list, loss_fn: LossFn) -> torch.Tensor:
    """The parameter update of one process, computed on rank 0, sent to all."""
    ref = copy.deepcopy(model)
    if comm.rank == 0:
        opt = _sgd(ref.parameters())
        for x, y in batches:
            opt.zero_grad()
            loss_fn(ref(x), y).backward()
            opt.step()
    return comm.broadcast(_flat(ref) - _flat(model), 0)


def _one_process_memory(comm: Communicator, model: nn.Module, batches: list, loss_fn: LossFn) -> int:
    """One process's step memory (its second step on `batches`), measured on rank 0, sent to all."""
    mem = 0
    if comm.rank == 0:
        ref = copy.deepcopy(model)
        opt = _sgd(ref.parameters())

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            loss_fn(ref(x), y).backward()
            opt.step()
        step(*batches[0])
        mem = step_memory(lambda: step(*batches[1]))
    return int(comm.broadcast(torch.tensor([mem], dtype=torch.float64), 0)[0])


def _memory(comm: Communicator, model: nn.Module, batches: list, loss_fn: LossFn, grid: tuple[int, ...],
            samples: int) -> float:
    """The largest rank's step memory (the second step on `batches`) on (`grid`, `samples`)."""
    trainer = SpatialTrainer(copy.deepcopy(model), loss_fn, _sgd, Distribution(comm, grid, samples))
    trainer.train_step(*batches[0])
    return rank_max(comm, step_memory(lambda: trainer.train_step(*batches[1])))


def _row(comm: Communicator, name: str, model: nn.Module, batches: list, loss_fn: LossFn, grid: tuple[int, ...],
         samples: int, expected: torch.Tensor) -> tuple[list[object], float]:
    """The check's row (but the memory columns) and its step memory."""
    trainer = SpatialTrainer(copy.deepcopy(model), loss_fn, _sgd, Distribution(comm, grid, samples))
    start = _flat(model)
    trainer.train_step(*batches[0])
    mem = rank_max(comm, step_memory(lambda: trainer.train_step(*batches[1])))
    gap = float((_flat(trainer.model) - start - expected).norm() / expected.norm())
    moves = sum(trainer.dist.redistributions.values()) / STEPS
    where = ",".join(sorted(trainer.dist.redistributions)) or "-"
    row: list[object] = [name, "x".join(map(str, grid)) + (f" x{samples}" if samples > 1 else ""),
                         "equal" if gap < 1e-9 else "DIFFERS", gap, moves, where,
                         "blocks" if trainer.step_loss.on_blocks else "samples"]
    return row, mem


def _batches(shape: tuple[int, ...], dense: bool, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`STEPS` batches of `shape`: class labels, or dense targets with ignored pixels (the tests')."""
    g, out = torch.Generator().manual_seed(1), []
    for _ in range(STEPS):
        if dense:
            y = torch.randint(0, 3, (shape[0], *shape[2:]), generator=g)
            y[0, : shape[2] // 3] = IGNORE  # more ignored pixels in some blocks and samples than others
            y[1, :, -5:] = IGNORE
        else:
            y = torch.randint(0, 10, (shape[0],), generator=g)
        out.append((torch.randn(shape, dtype=torch.float64, generator=g).to(dtype), y))
    return out


def main(argv: Sequence[str]) -> int:
    import mpitrain

    args = _parse(argv)
    comm = mpitrain.init()
    zoo = VIDEO if args.video else SEGMENTATION if args.segmentation else CLASSIFIERS
    loss_fn: LossFn = segmentation_criterion if args.segmentation else nn.CrossEntropyLoss()
    names = [n for n in args.models.split(",") if n] or list(zoo)
    size = args.size or (32 if args.segmentation else 64)
    h = size * 3 // 2 if comm.size == 3 else size
    shape = (2, 3, 2, h, size) if args.video else (2, 3, h, size)
    mem_shape = (*shape[:-2], args.mem_size, args.mem_size) if args.mem_size else None
    rows = []
    for name in names:
        torch.manual_seed(0)
        model = no_dropout(zoo[name]().double())
        batches = _batches(shape, args.segmentation, torch.float64)
        expected = _one_process(comm, model, batches, loss_fn)
        mem_model, mem_batches = model, batches
        if mem_shape is not None:
            mem_model, mem_batches = copy.deepcopy(model).float(), _batches(mem_shape, args.segmentation, torch.float32)
        base = _one_process_memory(comm, mem_model, mem_batches, loss_fn)
        grads = sum(p.numel() * p.element_size() for p in mem_model.parameters())
        for grid, samples in suite_grids(comm.size, args.video):
            row, mem = _row(comm, name, model, batches, loss_fn, grid, samples, expected)
            if mem_shape is not None:
                mem = _memory(comm, mem_model, mem_batches, loss_fn, grid, samples)
            rows.append([*row, mem / MIB, base / MIB, mem / max(base, 1), grads / MIB])
    if comm.rank == 0:
        memory = f"memory: float32 {mem_shape}" if mem_shape else "memory: the check's steps"
        print(header(f"spatial conformance set, input {tuple(shape)}, float64, {STEPS} steps; {memory}", comm.size))
        print_table(["model", "grid", "result", "update gap", "redistributions/step", "ops", "loss on",
                     "step MiB/rank", "1 proc MiB", "mem ratio", "grads MiB"], rows)
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
