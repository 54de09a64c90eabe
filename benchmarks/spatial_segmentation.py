"""torchvision's segmentation models through the spatial trainer, per model and (grid, samples) of the world
size: the relative gap of the parameter update after 2 SGD-momentum steps to one process's (float64, dropout
off, the test's inputs: batch 2 of 32x32, 48x32 on 3 ranks, with ignored pixels), the redistributions, where
the loss ran (on blocks or gathered samples), and the tensor-level step memory per rank (largest rank;
float32, batch 2 of --size x --size) against one process's.

    mpitrain run -n 2 -- python benchmarks/spatial_segmentation.py --models fcn_resnet50,lraspp_mobilenet_v3_large

Prints one markdown row per (model, layout) on rank 0. Not timed (these sizes are for checking).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import warnings

import torch
from torch import nn

import mpitrain
from mpitrain.perf.memory import step_memory
from mpitrain.spatial import Distribution
from mpitrain.spatial.models import torchvision_module
from mpitrain.spatial.trainer import SpatialTrainer

IGNORE = 255
LAYOUTS = {2: [((2, 1), 1), ((1, 2), 1)], 3: [((3, 1), 1)], 4: [((2, 2), 1), ((2, 1), 2)]}
MODELS = "lraspp_mobilenet_v3_large,deeplabv3_mobilenet_v3_large,fcn_resnet50,deeplabv3_resnet50"


def criterion(inputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """torchvision's references/segmentation criterion."""
    losses = {k: nn.functional.cross_entropy(v, target, ignore_index=IGNORE) for k, v in inputs.items()}
    return losses["out"] if len(losses) == 1 else losses["out"] + 0.5 * losses["aux"]


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def flat(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def batches(shape: tuple[int, ...], dtype: torch.dtype, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        t = torch.randint(0, 3, (shape[0], *shape[2:]), generator=g)
        t[0, : shape[2] // 3] = IGNORE
        t[1, :, -5:] = IGNORE
        out.append((torch.randn(shape, generator=g).to(dtype), t))
    return out


def model_rows(comm: mpitrain.Communicator, name: str, size: int) -> None:
    torch.manual_seed(0)
    model = getattr(torchvision_module("models.segmentation"), name)(weights=None, weights_backbone=None,
                                                                     num_classes=3)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    m64, small = copy.deepcopy(model).double(), batches((2, 3, 48 if comm.size == 3 else 32, 32), torch.float64, 2)
    start, ref = flat(m64), copy.deepcopy(m64)
    big = batches((2, 3, size, size), torch.float32, 1)[0]
    base = 0.0
    if comm.rank == 0:
        opt = sgd(ref.parameters())
        for x, t in small:
            opt.zero_grad()
            criterion(ref(x), t).backward()
            opt.step()
        one = copy.deepcopy(model)
        opt1 = sgd(one.parameters())

        def step() -> None:
            opt1.zero_grad()
            criterion(one(big[0]), big[1]).backward()
            opt1.step()
        step()
        base = step_memory(step) / 2**20
        del one, opt1
    expected = comm.broadcast(flat(ref) - start, 0)
    base = float(comm.broadcast(torch.tensor([base], dtype=torch.float64), 0)[0])
    del ref
    gc.collect()
    for grid, samples in LAYOUTS[comm.size]:
        trainer = SpatialTrainer(copy.deepcopy(m64), criterion, sgd, Distribution(comm, grid, samples))
        for x, t in small:
            trainer.train_step(x, t)
        gap = float(((flat(trainer.model) - start) - expected).norm() / expected.norm())
        moves, blocks = trainer.dist.redistributions, trainer.step_loss.on_blocks
        del trainer
        gc.collect()
        fp32 = SpatialTrainer(copy.deepcopy(model), criterion, sgd, Distribution(comm, grid, samples))
        fp32.train_step(*big)
        mem = max(comm.allgather_object(step_memory(functools.partial(fp32.train_step, *big)) / 2**20))
        del fp32
        gc.collect()
        if comm.rank == 0:
            layout = f"{grid[0]}x{grid[1]}" + (f" x{samples}" if samples > 1 else "")
            print(f"| `{name}` | {layout} | {gap:.1e} | {moves or '{}'} | {'blocks' if blocks else 'samples'} "
                  f"| {mem:.0f} MiB ({mem / base:.2f}x of {base:.0f}) |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=MODELS)
    p.add_argument("--size", type=int, default=128, help="image side of the memory measurement")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    comm = mpitrain.init()
    for name in args.models.split(","):
        model_rows(comm, name, args.size)


if __name__ == "__main__":
    main()
