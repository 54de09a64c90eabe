"""Horovod's SyncBatchNorm: batch statistics over every rank, through the engine.

The math is spatial's synchronized batch norm (``spatial.batchnorm.sync_batch_norm``: per-rank count,
mean and variance combined with Chan's formula in one allgather; one allreduce of sum(dy), sum(dy*xhat)
in the backward). Its two collectives go through this package's engine (``_EngineComm``), not a raw
communicator: they are negotiated and ordered with the script's other Horovod operations (the
DistributedOptimizer's buckets are in flight during backward), so a rank that skips one raises
HorovodInternalError on every rank instead of hanging.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..spatial.batchnorm import count_batch, sync_batch_norm, update_running
from ._basics import Sum, size
from ._handles import synchronize
from ._mpi_ops import allgather_async, allreduce_async

__all__ = ["SyncBatchNorm"]


class _EngineComm:
    """The two collectives sync_batch_norm needs, as blocking Horovod operations on the global set."""

    @property
    def size(self) -> int:
        return size()

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        return synchronize(allgather_async(t, name="sync_batch_norm.stats"))  # type: ignore[no-any-return]

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return synchronize(allreduce_async(t, name="sync_batch_norm.grads", op=Sum))  # type: ignore[no-any-return]


class SyncBatchNorm(_BatchNorm):
    """``horovod.torch.SyncBatchNorm``: BatchNorm for (N, C, ...) inputs whose training-mode statistics
    cover the mini-batches of every rank.

    In training (and in eval without running statistics) output, input gradient and running statistics
    equal ``nn.BatchNorm*d`` in one process on the concatenation of the ranks' batches (ranks' batch sizes
    may differ); weight and bias gradients are this rank's (the DistributedOptimizer averages them).
    Every rank must call forward and backward together (collectives on the global process set). Eval
    with running statistics and a job of one rank are plain batch norm. Unlike Horovod, CPU tensors are
    accepted too, and ``momentum=None`` (cumulative average) follows torch's rule."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        """torch's running-statistics rule for the combined batch (unbiased variance over `n` values)."""
        if self.training and self.track_running_stats:
            update_running(self, self.momentum, mean, var, n)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        if size() == 1:  # torch's layer: this rank's batch is the whole batch
            factor = count_batch(self, self.momentum) if self.training and self.track_running_stats else 0.0
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True, factor,
                                self.eps)
        return sync_batch_norm(input, self.weight, self.bias, self, _EngineComm())

