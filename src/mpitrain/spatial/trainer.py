"""`fit(..., strategy="spatial", grid=(ph, pw), samples=g)`: hybrid sample x spatial training.

Inputs are full NCHW batches (every rank holds the whole batch; each takes a view of its block) or
:class:`~mpitrain.spatial.data.RegionBatch` objects (each rank reads only its block from the dataset)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator
from ..strategies.broadcast import broadcast_tensors
from .batchnorm import STATS
from .data import RegionBatch, read_block
from .distribution import Distribution, SpatialError, gather
from .parallelize import SpatialParallel, parallelize

__all__ = ["SpatialTrainer", "make_trainer", "OPTIONS"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

#: The keyword options `fit` passes through to this strategy.
OPTIONS = ("grid", "samples", "bn_stats", "overlap")


def _options(spec: Any, comm: Communicator) -> dict[str, Any]:
    from ..strategies import FitError

    opts = dict(spec.options)
    unknown = sorted(set(opts) - set(OPTIONS))
    if unknown:
        raise FitError(f"strategy 'spatial' does not take {unknown}; its options are {OPTIONS}")
    if spec.partitions != 1 or spec.micro_batches != 1:
        raise FitError("strategy 'spatial' splits samples and pixels, not layers: leave partitions and "
                       "micro_batches at 1")
    grid = tuple(opts.get("grid", (comm.size, 1)))
    bad = len(grid) != 2 or any(not isinstance(g, int) or g < 1 for g in grid)
    if bad or comm.size % (grid[0] * grid[1]):
        raise FitError(f"grid={grid!r} must be two positive ints whose product divides the {comm.size} ranks")
    samples = opts.get("samples", comm.size // (grid[0] * grid[1]))
    if samples * grid[0] * grid[1] != comm.size:
        raise FitError(f"samples x ph x pw = {samples} x {grid[0]} x {grid[1]} must equal the "
                       f"{comm.size} ranks")
    if opts.get("bn_stats", "global") not in STATS:
        raise FitError(f"bn_stats={opts['bn_stats']!r}; choose one of {STATS}")
    return {"grid": grid, "samples": samples, "bn_stats": opts.get("bn_stats", "global"),
            "overlap": bool(opts.get("overlap", True))}


def _broadcast_state(model: nn.Module, comm: Communicator) -> None:
    """Start every rank from rank 0's parameters and buffers (in place; one fused broadcast per dtype)."""
    with torch.no_grad():
        broadcast_tensors([t.data for t in [*model.parameters(), *model.buffers()]], comm, 0)


class SpatialTrainer:
    """Trains `model` on `dist`: each global mini-batch is scattered (samples over the groups, pixels over
    each group's grid), the outputs are gathered on every rank and the loss is computed there on the full
    outputs, so any loss function gives the single-process loss and gradients; the parameter gradients
    are summed over all ranks during backward, and every rank steps its own optimizer identically."""

    def __init__(self, model: nn.Module, loss_fn: Callable, optimizer: OptimizerFactory, dist: Distribution,
                 bn_stats: str = "global", overlap: bool = True) -> None:
        self.model, self.loss_fn, self.dist = model, loss_fn, dist
        self.parallel: SpatialParallel = parallelize(model, dist, bn_stats=bn_stats, overlap=overlap)
        _broadcast_state(model, dist.comm)
        self.optimizer = optimizer(model.parameters())

    def _block(self, inputs: Any) -> torch.Tensor:
        """This rank's block of a global batch: read by region from a RegionBatch's dataset (no other
        block's pixels touched), or a view of a full tensor."""
        if isinstance(inputs, RegionBatch):
            return read_block(inputs, self.dist)
        if not isinstance(inputs, torch.Tensor):
            raise SpatialError(f"strategy 'spatial' takes NCHW tensors or RegionBatch inputs, got "
                               f"{type(inputs).__name__}")
        self.dist.check_shape(tuple(inputs.shape), "input batch")
        return self.dist.scatter(inputs)

    def train_step(self, inputs: Any, targets: torch.Tensor) -> float:
        x = self._block(inputs)
        if not self.parallel.training:  # eval_step restores training mode; train() walks every module
            self.parallel.train()
        outputs = gather(self.parallel(x))
        loss = self.loss_fn(outputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def eval_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        x = self._block(inputs)
        self.parallel.eval()
        try:
            with torch.no_grad():
                return gather(self.parallel(x))
        finally:
            self.parallel.train()

    def trained_model(self) -> nn.Module:
        return self.model


def make_trainer(model: nn.Module, loss_fn: Callable, optimizer: Callable, comm: Communicator,
                 spec: Any) -> SpatialTrainer:
    """The `fit` factory: options ``grid=(ph, pw)`` (default ``(world size, 1)``), ``samples=g``
    (default world size / (ph*pw)), ``bn_stats`` ("global" = exact) and ``overlap`` (default True).
    Options are validated on every rank before any message is sent."""
    opts = _options(spec, comm)
    dist = Distribution(comm, opts["grid"], opts["samples"])
    return SpatialTrainer(model, loss_fn, optimizer, dist, opts["bn_stats"], opts["overlap"])
