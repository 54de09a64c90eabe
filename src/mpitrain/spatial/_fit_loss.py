"""Where ``fit(strategy="spatial")`` computes a batch's loss: on blocks, or on each group's whole samples.

* **Dense targets** — a target whose trailing dims are the output's extent (N x H x W class indices,
  N x C x H x W values, for an N x C x H x W output) — are laid out like the output: each rank takes its
  block (a view of the batch's targets, or the block a :class:`~mpitrain.spatial.data.RegionSamples`
  read by region) and the user's ``loss_fn`` runs on the output's blocks (a dict of them for torchvision's
  segmentation models) and the target's. The losses of :mod:`mpitrain.spatial.loss` and whole reductions
  (``x.sum()``, ``x.mean()``) give the whole batch's loss on every rank, counted once, so every rank's
  backward of it gives exactly its block's gradient: nothing is gathered.
* If that loss needs an op with no form on blocks (a non-spatial op on a block, or a value of one sample
  group leaving the layout) it raises :class:`~mpitrain.spatial.tensor.NonSpatialOpError` before any
  data moves for it; the batch's loss is then computed as for any other target, on every group's whole
  samples (outputs gathered by ``gather_group``, targets whole), weighted by the group's rows. That
  choice is remembered for later batches (warned once).
* Other targets (class labels of a classification head) use the whole-sample path directly.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..strategies.base import BatchShare, LossFn
from .distribution import Distribution, gather, gather_group
from .tensor import Layout, NonSpatialOpError, SpatialError, SpatialTensor, layout_of, tag

__all__ = ["TargetInfo", "BatchLoss", "StepLoss"]


@dataclass(frozen=True)
class TargetInfo:
    """One sample's global target shape and the targets' dtype (known on every rank, also in a sample
    group without samples); `blocks`: the targets arrive as this rank's blocks (read by region)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    blocks: bool = False


@dataclass(frozen=True)
class BatchLoss:
    """A batch's loss on this rank (None: no sample here, `zero` keeps the backward collective), the
    rows of the step it covers, and whether this rank adds it to the logged loss."""

    loss: torch.Tensor | None
    rows: int
    logs: bool
    zero: torch.Tensor | None = None


def _first_block(y: Any) -> SpatialTensor | None:
    for t in pytree.tree_leaves(y):
        if isinstance(t, SpatialTensor) and t.placement.kind == "block":
            return t
    return None


class StepLoss:
    """Runs `loss_fn` on a batch's outputs where it can (see the module docstring). `on_blocks`: None
    until a batch with dense targets was seen, then whether the loss runs on blocks."""

    def __init__(self, loss_fn: LossFn, dist: Distribution, gather_world: bool) -> None:
        self.loss_fn, self.dist, self.gather_world = loss_fn, dist, gather_world
        self.on_blocks: bool | None = None

    def __call__(self, y: Any, b: BatchShare, info: TargetInfo | None, device: torch.device) -> BatchLoss:
        targets = self._dense(y, b, info, device)
        if targets is not None and self.on_blocks is not False:
            dist = targets.placement.dist
            dist.loss_on_blocks = True
            try:
                loss = self.loss_fn(y, targets)
                self.on_blocks = True
                return BatchLoss(loss, b.n, dist.comm.rank == 0)
            except NonSpatialOpError as e:
                self.on_blocks = False
                warnings.warn(f"spatial fit: loss_fn needs whole samples ({e}); its outputs are gathered to "
                              f"whole samples per sample group for the loss", RuntimeWarning, stacklevel=2)
            finally:
                dist.loss_on_blocks = False
        return self._on_samples(y, b, info, targets if info is not None and info.blocks else None, device)

    def _dense(self, y: Any, b: BatchShare, info: TargetInfo | None, device: torch.device
               ) -> SpatialTensor | None:
        """This rank's block of the batch's targets laid out like the output `y`, when they are dense
        (their trailing dims are the output's extent); None for other targets."""
        out = _first_block(y)
        if out is None or info is None or out.placement.dist is not self.dist:
            return None
        lay, dist = out.placement, self.dist
        k = len(dist.grid)
        extent = lay.shape[len(lay.shape) - k:]
        if len(info.shape) < k or tuple(info.shape[len(info.shape) - k:]) != tuple(extent):
            return None
        shape = (b.n, *info.shape)
        mine = dist.local_shape(shape)
        if b.targets is None or b.share.rows == 0:
            block = torch.empty(mine, dtype=info.dtype, device=device)
        elif info.blocks:  # read by region already
            block = b.targets
            if tuple(block.shape) != mine:
                raise SpatialError(f"targets read by region have block {tuple(block.shape)}, expected {mine} of "
                                   f"a {shape} batch laid out like the output")
        else:
            block = b.targets[(slice(None), *dist.index(shape)[1:])]
        return tag(block.to(device), Layout(dist, "block", shape))

    def _no_samples(self, outputs: Any, info: TargetInfo | None, device: torch.device) -> torch.Tensor:
        """The loss of a group without samples, to be multiplied by 0: `loss_fn` on the empty outputs and
        targets, so that its backward reaches the parameters the other groups' losses reach (the fused
        gradient allreduce needs the same ones on every rank); if `loss_fn` refuses empty tensors, the
        sum of every output."""
        if info is not None:
            try:
                loss: torch.Tensor = self.loss_fn(outputs, torch.empty((0, *info.shape), dtype=info.dtype,
                                                                        device=device))
                return loss
            except Exception:  # user code may refuse empty tensors; the sum below serves the same end
                pass
        return sum((t.float().sum() for t in pytree.tree_leaves(outputs)
                    if isinstance(t, torch.Tensor) and t.requires_grad), torch.zeros((), device=device))

    def _on_samples(self, y: Any, b: BatchShare, info: TargetInfo | None, read: torch.Tensor | None,
                    device: torch.device) -> BatchLoss:
        """The loss on this group's whole samples (every group's when `gather_world`: after ``switch_at``
        the outputs are spread over the world by samples), weighted by the group's rows; `read`: the
        target blocks read by region, gathered to the group's whole targets."""
        whole = gather if self.gather_world else gather_group
        outputs = pytree.tree_map(lambda t: whole(t) if layout_of(t) is not None else t, y)
        if not b.share.rows:  # no sample here: take part in the backward's collectives with a zero gradient
            return BatchLoss(None, 0, False, self._no_samples(outputs, info, device) * 0.0)
        targets = b.targets if read is None else gather_group(read)
        assert targets is not None
        loss = self.loss_fn(outputs, targets.to(device))
        return BatchLoss(loss, b.share.rows, self.dist.spatial_rank == 0)
