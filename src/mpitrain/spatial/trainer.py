"""`fit(..., strategy="spatial", grid=(ph, pw), samples=g)`: hybrid sample x spatial training.

Inputs: a map-style Dataset (each rank reads its sample group's rows; only its block of each when the
Dataset reads regions, see :mod:`mpitrain.spatial.data`), full NCHW batches (each rank takes a view of
its block of its group's rows) or :class:`~mpitrain.spatial.data.RegionBatch` objects (each rank reads
only its block of its group's samples)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.data import Dataset

from ..comm import settle_on_error
from ..comm.base import Communicator
from ..comm.place import Place, PlaceError
from ..strategies import (
    NAMED,
    StepTrainer,
    as_float,
    autocast,
    broadcast_tensors,
    load_replica,
    model_device,
    replica_entries,
    samples,
    slice_share,
    to_device,
)
from ..strategies.base import (
    DEFAULT_LOOP,
    Batch,
    BatchShare,
    FitError,
    FitSpec,
    LoopSpec,
    LossFn,
    OptimizerFactory,
    Share,
    StrategyOptions,
    is_int,
)
from ._fit_loss import StepLoss, TargetInfo
from .batchnorm import STATS
from .data import BlockReader, RegionBatch, dense_target_shape, reads_regions, region_of
from .distribution import NONSPATIAL, Distribution, SpatialError, gather, ranges
from .parallelize import SpatialParallel, parallelize
from .tensor import Layout, layout_of, tag

__all__ = ["SpatialTrainer", "SpatialOptions", "make_trainer"]


@dataclass(frozen=True)
class SpatialOptions(StrategyOptions):
    """Options of ``fit(strategy="spatial", ...)``: ``grid=(ph, pw)`` ranks per sample (default: every
    rank, ``(world size, 1)``) — ``(pd, ph, pw)`` for volumes and video clips (N, C, D, H, W): a model
    with 3-D layers needs a 3-D grid —, ``samples`` groups (default world size / (ph*pw)), ``bn_stats``
    ("global" = exact, "spatial", "local"), ``overlap`` (conv interiors while halos fly) and
    ``nonspatial`` ("replicate": a non-spatial op redistributes its block to whole samples, warned;
    "error": it is refused) and ``switch_at`` (a submodule name: from its input on, the model runs
    sample-parallel over every rank, §V-C's per-layer distributions; see ``parallelize``)."""

    strategy: ClassVar[str] = "spatial"
    grid: tuple[int, ...] | None = None
    samples: int | None = None
    bn_stats: str = "global"
    overlap: bool = True
    nonspatial: str = "replicate"
    switch_at: str | None = None

    def __post_init__(self) -> None:
        if self.grid is not None:
            grid = tuple(self.grid) if isinstance(self.grid, (tuple, list)) else self.grid
            ok = isinstance(grid, tuple) and len(grid) in (2, 3) and all(is_int(g) and g >= 1 for g in grid)
            self.require("grid", ok, "two or three positive ints: (ph, pw), or (pd, ph, pw) for volumes")
            self.replace_value("grid", grid)
        self.require("samples", self.samples is None or (is_int(self.samples) and self.samples >= 1),
                     "a positive int")
        self.require("bn_stats", self.bn_stats in STATS, f"one of {STATS}")
        self.require("overlap", isinstance(self.overlap, bool), "True or False")
        self.require("nonspatial", self.nonspatial in NONSPATIAL, f"one of {NONSPATIAL}")
        self.require("switch_at", self.switch_at is None or (isinstance(self.switch_at, str) and self.switch_at != ""),
                     "None or a submodule name")

    def layout(self, comm: Communicator) -> tuple[tuple[int, ...], int]:
        """(grid, samples) for the ranks of `comm`, defaults filled in (FitError if they do not fit)."""
        grid = self.grid or (comm.size, 1)
        try:
            place = Place.of(comm.size, comm.rank, replicas=self.samples, grid=grid)
        except PlaceError as e:
            samples = self.samples if self.samples is not None else comm.size // math.prod(grid)
            raise FitError(f"strategy 'spatial': samples x grid = {samples} x {' x '.join(map(str, grid))} must "
                           f"equal the {comm.size} ranks ({e})") from None
        return grid, place.replicas


#: Layers that make a model volumetric (N, C, D, H, W): it needs a 3-D grid.
_VOLUME_LAYERS = (nn.Conv3d, nn.BatchNorm3d, nn.MaxPool3d, nn.AvgPool3d, nn.AdaptiveAvgPool3d)


def grid_for(dims: int, grid: tuple[int, ...]) -> tuple[int, ...]:
    """The grid to suggest for `dims` spatial dims in place of `grid` (its splits kept, depth unsplit)."""
    if dims == 3:
        return (1, *grid) if len(grid) == 2 else grid
    return grid[1:] if len(grid) == 3 and grid[0] == 1 else (grid[0] * grid[1], grid[2]) if len(grid) == 3 else grid


def grid_problem(dims: int, grid: tuple[int, ...], what: str) -> str | None:
    """Why a `what` with `dims` spatial dims cannot run on `grid` (None if it can): the FitError text."""
    if dims == len(grid):
        return None
    shape = "(N, C, D, H, W)" if dims == 3 else "(N, C, H, W)"
    axes = "(pd, ph, pw)" if dims == 3 else "(ph, pw)"
    return (f"strategy 'spatial': {what} is {shape}, which needs a {dims}-D grid {axes}, but grid={grid} is "
            f"{len(grid)}-D; pass grid={grid_for(dims, grid)}")


def _broadcast_state(model: nn.Module, comm: Communicator) -> None:
    """Start every rank from rank 0's parameters and buffers (in place; one fused broadcast per dtype)."""
    with torch.no_grad():
        broadcast_tensors([t.data for t in [*model.parameters(), *model.buffers()]], comm, 0)


class SpatialTrainer(StepTrainer):
    """Trains `model` on `dist`; the step is :class:`~mpitrain.strategies.step.StepTrainer`'s.

    A global batch of n samples is split over the sample groups as evenly as possible
    (:func:`~mpitrain.comm.base.split_sizes`; a group may get none) and each sample over its group's grid.
    Every rank of a group reads the group's rows (:meth:`share`), only its block of each sample when the
    data can be read by region (:meth:`rank_view`, ``RegionBatch`` inputs), otherwise whole samples that it
    crops. Dense targets (laid out like the output: segmentation) are taken as this rank's block and the
    loss runs on blocks, the whole batch's loss on every rank; for other targets the group's outputs are
    gathered on each of its ranks (:func:`~mpitrain.spatial.distribution.gather_group`) and the loss is
    computed there on whole samples, weighted by the group's share of the step's samples
    (:mod:`mpitrain.spatial._fit_loss`). The parameter gradients are summed over all ranks during
    backward, so after it every rank holds the gradient of the step's mean loss (any loss function whose
    value is the mean over its rows; on blocks, any loss of :mod:`mpitrain.spatial.loss`), as one
    process would, and steps its own optimizer identically (clipping by that global gradient's norm). BatchNorm
    statistics "global" cover the whole global batch (exact). Batches and targets are moved to the
    model's device (blocks read by region are read on the CPU, then moved); :meth:`eval_step` returns
    its outputs on the CPU."""

    #: spatial weighs its own losses (:mod:`mpitrain.spatial._fit_loss`: global counts on blocks, rows else)
    token_weights = False

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, dist: Distribution,
                 bn_stats: str = "global", overlap: bool = True, loop: LoopSpec = DEFAULT_LOOP,
                 switch_at: str | None = None) -> None:
        self.model, self.loss_fn, self.dist, self.loop = model, loss_fn, dist, loop
        self.comm = dist.comm  # replicas stays 1: the gradients are summed over every rank, not averaged
        self.bn_stats, self.switch_at = bn_stats, switch_at
        self.device = model_device(model)
        self.parallel: SpatialParallel = parallelize(model, dist, bn_stats=bn_stats, overlap=overlap,
                                                     switch_at=switch_at)
        _broadcast_state(model, dist.comm)
        self.optimizer = optimizer(model.parameters())
        self._sample_shape: tuple[int, ...] | None = None  # set by rank_view: inputs arrive as blocks
        self._target_shape: tuple[int, ...] | None = None  # set by rank_view: dense targets arrive as blocks
        self.step_loss = StepLoss(loss_fn, dist, gather_world=switch_at is not None)

    # -- reading (ShardedTrainer) ----------------------------------------------------------------------
    def share(self, n: int) -> Share:
        """The rows of this rank's sample group (every rank of the group reads the same rows)."""
        a, b = ranges(n, self.dist.samples)[self.dist.group]
        return Share(a, b)

    def rank_view(self, dataset: Dataset[Any]) -> Dataset[Any]:
        """What this rank's DataLoader reads of `dataset` (fit calls it once, before training from a
        Dataset): a :class:`~mpitrain.spatial.data.BlockReader` of this rank's region when the dataset
        reads regions (``read(index, region)`` and ``target(index)``), else `dataset` itself (whole
        samples, cropped in :meth:`train_shares`)."""
        if not reads_regions(dataset):
            return dataset
        shape = tuple(dataset.sample_shape)  # type: ignore[attr-defined]
        self._sample_shape = shape
        self._target_shape = dense_target_shape(dataset)
        return BlockReader(dataset, region_of(self.dist, shape))  # type: ignore[arg-type]

    def _share_block(self, b: BatchShare, blocks: bool) -> tuple[torch.Tensor, TargetInfo | None]:
        """This rank's block of its group's rows of `b` (possibly no rows) and what every rank knows of
        the targets (one sample's global shape, dtype; None for targets that are not one tensor);
        `blocks`: tensor inputs are blocks read by region already (rank_view), not whole samples.
        Collective only for a batch smaller than the number of groups (rank 0 tells the empty groups the
        sample shape, dtype and the targets')."""
        x, dist = b.inputs, self.dist
        block: torch.Tensor | None = None
        shape: tuple[int, ...] | None = None
        if isinstance(x, RegionBatch):
            shape = (b.n, *x.dataset.sample_shape)
        elif isinstance(x, torch.Tensor):
            shape = (b.n, *(self._sample_shape if blocks and self._sample_shape is not None else x.shape[1:]))
        elif x is not None:
            raise SpatialError(f"strategy 'spatial' takes NCHW tensors or RegionBatch inputs, got {type(x).__name__}")
        # a batch of the wrong rank for the grid is refused on every rank before any message (where some
        # group has no sample, after the broadcast that tells it the shape)
        problem = None if shape is None else self._grid_problem(shape)
        if problem and b.n >= dist.samples:
            raise FitError(problem)
        if isinstance(x, RegionBatch) and not problem:  # an iterable of (RegionBatch, targets): read my rows' blocks
            region = region_of(dist, tuple(x.dataset.sample_shape))
            block = torch.stack([x.dataset.read(i, region) for i in x.indices[b.share.start:b.share.stop]])
        elif isinstance(x, torch.Tensor) and not problem:
            if blocks and self._sample_shape is not None:  # read by region already (rank_view)
                block = x
            else:  # whole samples of my rows: crop (a view)
                block = x[(slice(None), slice(None), *region_of(dist, tuple(x.shape[1:])))]
        if block is not None:  # blocks read on the CPU (a RegionBatch's reader, the loader) go to the model
            block = to_device(block, self.device)
        info = self._target_info(b.targets, blocks)
        if b.n < dist.samples:  # some group has no sample: it learns the shapes from rank 0 (group 0 has one)
            shape, dtype, info = dist.comm.broadcast_object((shape, None if block is None else block.dtype, info)
                                                            if dist.comm.rank == 0 else None)
            problem = self._grid_problem(shape)
            if problem:
                raise FitError(problem)
            if block is None:
                block = torch.empty((0, *dist.local_shape(shape)[1:]), dtype=dtype, device=self.device)
        assert block is not None and shape is not None
        dist.check_shape((max(shape[0], dist.samples), *shape[1:]), "input batch")
        return tag(block, Layout(dist, "block", shape)), info

    def _target_info(self, targets: torch.Tensor | None, blocks: bool) -> TargetInfo | None:
        if blocks and self._target_shape is not None:  # dense targets read by region: blocks
            return TargetInfo(self._target_shape, targets.dtype, blocks=True) if targets is not None else None
        if isinstance(targets, torch.Tensor):
            return TargetInfo(tuple(targets.shape[1:]), targets.dtype)
        return None

    def _grid_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a batch of global `shape` cannot run on this grid (a volume on a 2-D grid, an image on a 3-D
        one), or None."""
        if len(shape) not in (4, 5):
            return None  # check_shape names other ranks' problems
        return grid_problem(len(shape) - 2, self.dist.grid, f"the batch of shape {tuple(shape)}")

    def begin_step(self, batches: Sequence[BatchShare]) -> None:
        if not self.parallel.training:  # eval_step restores training mode; train() walks every module
            self.parallel.train()
        self.optimizer.zero_grad(set_to_none=True)

    def local_pass(self, batches: Sequence[BatchShare], total: int) -> torch.Tensor:
        """One forward and backward per batch of this group's rows (gradients accumulate, summed over
        every rank during backward). Each batch's loss runs where
        :class:`~mpitrain.spatial._fit_loss.StepLoss` says: on blocks for dense targets (the batch's loss
        on every rank), else on each group's whole samples; weighted by its rows."""
        # the step's summed per-sample loss (on the ranks that log it), on the model's device: no host sync per batch
        local = torch.zeros(1, dtype=torch.float64, device=self.device)
        with settle_on_error(self.dist.sends.abandon):  # a failed step's deferred halo sends are kept alive
            for b in batches:
                x, info = self._share_block(b, blocks=True)
                with autocast(self.loop.precision, self.device):
                    out = self.step_loss(self.forward(x), b, info, self.device)
                if out.loss is None:
                    assert out.zero is not None
                    out.zero.backward()
                    continue
                part = self.backward(out.loss, out.rows, total)
                if out.logs:
                    local += part
        return local

    def forward(self, x: torch.Tensor) -> Any:
        """The spatial model on this rank's block `x`. A model whose own code refuses the block (an
        assert or a shape error: timm's ``PatchEmbed`` checks its input's size, so ViT and Swin cannot
        run on blocks) raises FitError naming the block and the batch's shapes, the model's message
        (its exception is the FitError's cause) and the strategies that run the model whole; the
        spatial package's own errors pass as they are."""
        try:
            return self.parallel(x)
        except (AssertionError, RuntimeError, ValueError) as e:
            if isinstance(e, SpatialError):
                raise
            layout = layout_of(x)
            whole = tuple(layout.shape[1:]) if layout is not None else "?"
            raise FitError(f"strategy 'spatial': the model's forward failed on rank {self.dist.comm.rank}'s "
                           f"spatial block {tuple(x.shape[1:])} of the batch's {whole} samples (grid "
                           f"{self.dist.grid}): {type(e).__name__}: {e} — a model that reads its input's size "
                           f"cannot run on blocks; use strategy 'data', 'model' or 'hybrid' (strategy 'auto' "
                           f"drops such spatial plans)") from e

    def clip_grad_norm_(self, max_norm: float) -> None:
        """The gradients are already the global ones on every rank: each clips them alike."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    # -- whole global batches (train_step: StepTrainer's, RegionBatch inputs pass whole) ----------------
    def eval_step(self, inputs: Batch | RegionBatch, targets: torch.Tensor) -> torch.Tensor:
        """Forward only on a global batch every rank holds in full (any size: a group may get no sample);
        returns the full outputs on every rank (a dict of them for a model that returns one)."""
        n = samples(inputs, targets)
        x, _ = self._share_block(slice_share(inputs, targets, self.share(n)), blocks=False)  # type: ignore[arg-type]
        self.parallel.eval()
        try:
            with torch.no_grad(), autocast(self.loop.precision, self.device), settle_on_error(self.dist.sends.abandon):
                out = pytree.tree_map(lambda t: gather(t) if layout_of(t) is not None else t, self.forward(x))
            return pytree.tree_map(  # type: ignore[no-any-return]
                lambda t: as_float(t).cpu() if isinstance(t, torch.Tensor) else t,
                out)
        finally:
            self.parallel.train()

    # -- checkpoints (CheckpointTrainer) -----------------------------------------------------------------
    def layout(self) -> dict[str, object]:
        """Every rank holds the whole model (weights, optimizer state; BatchNorm buffers too, equal on
        every rank with ``bn_stats="global"``); the shards are by name (``NAMED``)."""
        return {"strategy": "spatial", "world_size": self.dist.comm.size, "grid": list(self.dist.grid),
                "samples": self.dist.samples, "bn_stats": self.bn_stats, "replicated": True, NAMED: True}

    def state_dict(self) -> dict[str, object]:
        """This rank's shard by name (no message): its share of the parameters and of their optimizer state
        (equal on every rank: the gradients are summed over the world before each step; together the
        shards hold each once, split by bytes) and its own buffers (BatchNorm statistics, per rank under
        ``bn_stats`` "spatial"/"local")."""
        shard, _ = replica_entries(self.model, self.optimizer, self.dist.comm.size, self.dist.comm.rank)
        return shard

    def load_state_dict(self, read: Callable[[int], dict[str, object]], saved_layout: Mapping[str, object]) -> None:
        """Same layout: this rank's shard first (its own buffers), the parameters and optimizer state from
        whichever shard holds them. Another grid, sample count or world size: rank 0's first (BatchNorm
        buffers of ``bn_stats`` "spatial"/"local", which differ per rank, restart from rank 0's). A
        checkpoint of the older layout (every rank wrote its whole replica, not by name) loads alike."""
        now = self.layout()
        if saved_layout.get("strategy") != "spatial" or not saved_layout.get("replicated"):
            raise FitError(f"cannot resume strategy 'spatial' (layout {now}) from a checkpoint of layout "
                           f"{dict(saved_layout)}: resharding between these layouts is not supported")
        same = all(saved_layout.get(k) == now[k] for k in ("world_size", "grid", "samples", "bn_stats"))
        first = self.dist.comm.rank if same else 0
        if not saved_layout.get(NAMED):  # older: every shard a whole replica, the optimizer's own state_dict
            state = read(first)
            self.model.load_state_dict(state["model"])  # type: ignore[arg-type]
            self.optimizer.load_state_dict(state["optimizer"])  # type: ignore[arg-type]
            return
        world = int(saved_layout["world_size"])  # type: ignore[call-overload]
        load_replica(self.model, self.optimizer, read, [first, *(r for r in range(world) if r != first)])

    def trained_model(self) -> nn.Module:
        return self.model


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> SpatialTrainer:
    """The `fit` factory (options: :class:`SpatialOptions`; ``spec.stall`` bounds every halo wait:
    ``warn_after`` seconds before it warns, ``abort_after`` before it ends the job). Options are
    validated on every rank before any message is sent."""
    if spec.partitions != 1 or spec.micro_batches != 1:
        raise FitError("strategy 'spatial' splits samples and pixels, not layers: leave partitions and "
                       "micro_batches at 1")
    opts = SpatialOptions.from_spec(spec)
    grid, samples = opts.layout(comm)
    if opts.switch_at is not None and samples != 1:
        # After the switch the world holds samples split evenly over its ranks, which does not refine a
        # split over several sample groups (the loss of each group needs its rows back): not built yet.
        raise FitError(f"strategy 'spatial': switch_at={opts.switch_at!r} needs samples=1 (one spatial group "
                       f"over all {comm.size} ranks), got samples={samples}; drop switch_at or use samples=1")
    volume = any(isinstance(m, _VOLUME_LAYERS) for m in model.modules())
    if volume and opts.grid is None:  # the default grid splits the first spatial dim: depth for volumes
        grid = (math.prod(grid), 1, 1)
    problem = grid_problem(3 if volume else 2, grid, f"the input of a model with {'3' if volume else '2'}-D layers")
    if problem:
        raise FitError(problem)
    dist = Distribution(comm, grid, samples, nonspatial=opts.nonspatial, stall=spec.stall)
    trainer = SpatialTrainer(model, loss_fn, optimizer, dist, opts.bn_stats, opts.overlap, spec.loop, opts.switch_at)
    trainer.stall = spec.stall  # bounds the step's waits of StepTrainer (fp16's overflow verdict)
    return trainer
