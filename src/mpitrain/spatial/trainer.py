"""`fit(..., strategy="spatial", grid=(ph, pw), samples=g)`: hybrid sample x spatial training.

Inputs are full NCHW batches (every rank holds the whole batch; each takes a view of its block) or
:class:`~mpitrain.spatial.data.RegionBatch` objects (each rank reads only its block from the dataset)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..comm.base import Communicator
from ..strategies._broadcast import broadcast_tensors
from ..strategies.base import Batch, FitError, FitSpec, LossFn, OptimizerFactory, StrategyOptions, is_int
from .batchnorm import STATS
from .data import RegionBatch, read_block
from .distribution import NONSPATIAL, Distribution, SpatialError, gather
from .parallelize import SpatialParallel, parallelize

__all__ = ["SpatialTrainer", "SpatialOptions", "make_trainer"]


@dataclass(frozen=True)
class SpatialOptions(StrategyOptions):
    """Options of ``fit(strategy="spatial", ...)``: ``grid=(ph, pw)`` ranks per sample (default: every
    rank, ``(world size, 1)``), ``samples`` groups (default world size / (ph*pw)), ``bn_stats``
    ("global" = exact, "spatial", "local"), ``overlap`` (conv interiors while halos fly) and
    ``nonspatial`` ("replicate": a non-spatial op redistributes its block to whole samples, warned;
    "error": it is refused) and ``switch_at`` (a submodule name: from its input on, the model runs
    sample-parallel over every rank, §V-C's per-layer distributions; see ``parallelize``)."""

    strategy: ClassVar[str] = "spatial"
    grid: tuple[int, int] | None = None
    samples: int | None = None
    bn_stats: str = "global"
    overlap: bool = True
    nonspatial: str = "replicate"
    switch_at: str | None = None

    def __post_init__(self) -> None:
        if self.grid is not None:
            grid = tuple(self.grid) if isinstance(self.grid, (tuple, list)) else self.grid
            self.require("grid", isinstance(grid, tuple) and len(grid) == 2 and all(is_int(g) and g >= 1 for g in grid),
                         "two positive ints (ph, pw)")
            self.replace_value("grid", grid)
        self.require("samples", self.samples is None or (is_int(self.samples) and self.samples >= 1),
                     "a positive int")
        self.require("bn_stats", self.bn_stats in STATS, f"one of {STATS}")
        self.require("overlap", isinstance(self.overlap, bool), "True or False")
        self.require("nonspatial", self.nonspatial in NONSPATIAL, f"one of {NONSPATIAL}")
        self.require("switch_at", self.switch_at is None or (isinstance(self.switch_at, str) and self.switch_at != ""),
                     "None or a submodule name")

    def layout(self, comm: Communicator) -> tuple[tuple[int, int], int]:
        """(grid, samples) for the ranks of `comm`, defaults filled in (FitError if they do not fit)."""
        grid = self.grid or (comm.size, 1)
        per = grid[0] * grid[1]
        samples = self.samples if self.samples is not None else comm.size // per
        if comm.size % per or samples * per != comm.size:
            raise FitError(f"strategy 'spatial': samples x ph x pw = {samples} x {grid[0]} x {grid[1]} must "
                           f"equal the {comm.size} ranks")
        return grid, samples


def _broadcast_state(model: nn.Module, comm: Communicator) -> None:
    """Start every rank from rank 0's parameters and buffers (in place; one fused broadcast per dtype)."""
    with torch.no_grad():
        broadcast_tensors([t.data for t in [*model.parameters(), *model.buffers()]], comm, 0)


class SpatialTrainer:
    """Trains `model` on `dist`: each global mini-batch is scattered (samples over the groups, pixels over
    each group's grid), the outputs are gathered on every rank and the loss is computed there on the full
    outputs, so any loss function gives the single-process loss and gradients; the parameter gradients
    are summed over all ranks during backward, and every rank steps its own optimizer identically."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, dist: Distribution,
                 bn_stats: str = "global", overlap: bool = True, switch_at: str | None = None) -> None:
        self.model, self.loss_fn, self.dist = model, loss_fn, dist
        self.parallel: SpatialParallel = parallelize(model, dist, bn_stats=bn_stats, overlap=overlap,
                                                     switch_at=switch_at)
        _broadcast_state(model, dist.comm)
        self.optimizer = optimizer(model.parameters())

    def _block(self, inputs: Batch | RegionBatch) -> torch.Tensor:
        """This rank's block of a global batch: read by region from a RegionBatch's dataset (no other
        block's pixels touched), or a view of a full tensor."""
        if isinstance(inputs, RegionBatch):
            return read_block(inputs, self.dist)
        if not isinstance(inputs, torch.Tensor):
            raise SpatialError(f"strategy 'spatial' takes NCHW tensors or RegionBatch inputs, got "
                               f"{type(inputs).__name__}")
        self.dist.check_shape(tuple(inputs.shape), "input batch")
        return self.dist.scatter(inputs)

    def train_step(self, inputs: Batch | RegionBatch, targets: torch.Tensor) -> float:
        x = self._block(inputs)
        if not self.parallel.training:  # eval_step restores training mode; train() walks every module
            self.parallel.train()
        outputs = gather(self.parallel(x))
        loss = self.loss_fn(outputs, targets)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def eval_step(self, inputs: Batch | RegionBatch, targets: torch.Tensor) -> torch.Tensor:
        x = self._block(inputs)
        self.parallel.eval()
        try:
            with torch.no_grad():
                return gather(self.parallel(x))
        finally:
            self.parallel.train()

    def trained_model(self) -> nn.Module:
        return self.model


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> SpatialTrainer:
    """The `fit` factory (options: :class:`SpatialOptions`; ``spec.stall.warn_after`` bounds every halo
    wait before it warns). Options are validated on every rank before any message is sent."""
    if spec.partitions != 1 or spec.micro_batches != 1:
        raise FitError("strategy 'spatial' splits samples and pixels, not layers: leave partitions and "
                       "micro_batches at 1")
    opts = SpatialOptions.from_spec(spec)
    grid, samples = opts.layout(comm)
    dist = Distribution(comm, grid, samples, nonspatial=opts.nonspatial, stall=spec.stall)
    return SpatialTrainer(model, loss_fn, optimizer, dist, opts.bn_stats, opts.overlap, opts.switch_at)
