"""Spatially parallel BatchNorm2d: batch statistics over every rank (exact), the spatial group, or local.

``stats="global"`` (default) aggregates over all ranks, i.e. all samples and all of every sample's
cells: output, gradients and running statistics equal the single-process layer on the whole mini-batch.
``"spatial"`` aggregates over the sample group's ranks only (one group's samples, whole images: what a
data-parallel run of unsynchronised BN computes), ``"local"`` over this rank's block (the paper's
"purely local" variant). Per-rank (count, mean, variance) are combined with Chan's formula: one
allgather of 2C+1 numbers in the forward, one allreduce of 2C in the backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..comm.base import Communicator
from ._memory import dense
from ._window import input_layout
from .distribution import Distribution
from .tensor import DistributionLike, SpatialError, layout_of, nchw, plain, register_spatial_function, tag

__all__ = ["SpatialBatchNorm2d", "SpatialBatchNorm3d", "STATS", "sync_batch_norm", "count_batch", "update_running",
           "batch_norm"]

STATS = ("global", "spatial", "local")


def _combine(comm: Communicator, n: int, mean: torch.Tensor, var: torch.Tensor
             ) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Count, mean and biased variance of the union of every rank's cells (Chan's formula, float64)."""
    c = mean.numel()
    mine = torch.empty(2 * c + 1, dtype=torch.float64, device=mean.device)
    mine[0] = n
    mine[1:c + 1] = mean
    mine[c + 1:] = var
    rows = comm.allgather(mine).view(comm.size, 2 * c + 1)
    total = float(rows[:, 0].sum())
    share = rows[:, 0] / total
    gmean = share @ rows[:, 1:c + 1]
    dev = rows[:, 1:c + 1] - gmean
    gvar = share @ torch.addcmul(rows[:, c + 1:], dev, dev)  # sum_r share_r (var_r + (mean_r - mean)^2)
    return total, gmean.to(mean.dtype), gvar.to(var.dtype)


def _bshape(t: torch.Tensor, dims: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over an N x C x (`dims` spatial) tensor."""
    return t.view(1, -1, *([1] * dims))


class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                layer: SpatialBatchNorm2d, comm: Communicator) -> torch.Tensor:
        x = dense(x)
        # one pass for the local statistics (torch's BN kernel: 10x faster than var_mean on CPU), one
        # to normalise with the combined ones: the passes of the single-process layer
        # A bf16/fp16 block (autocast) takes the single-process layer's mixed-dtype path: statistics
        # accumulated and returned in float32. The kernel takes that path only when given float32 running
        # buffers (scratch ones here, left as they are by momentum 0); without them it returns the
        # statistics rounded to the block's dtype (a float16 mean near 6 off by up to 2e-3: every output
        # and the weight gradients shift, and runs drift from one process)
        low = x.dtype in (torch.bfloat16, torch.float16)
        if x.numel():
            scratch = x.new_zeros(2, x.shape[1], dtype=torch.float32) if low else None
            running = (scratch[0], scratch[1]) if scratch is not None else (None, None)
            mean, var = torch.batch_norm_update_stats(x, running[0], running[1], 0.0)
        else:  # a sample group without samples in an uneven batch: it weighs 0 in the combination
            mean = var = x.new_zeros(x.shape[1])
        if low:
            mean, var = mean.float(), var.float()
        n, mean, var = _combine(comm, x.numel() // x.shape[1], mean, var)
        invstd = torch.rsqrt(var + layer.eps)
        y = torch.batch_norm(x, weight, bias, mean, var, False, 0.0, layer.eps, False)
        layer.update_running(mean, var, n)
        ctx.save_for_backward(x, weight, mean, invstd)
        ctx.comm, ctx.n, ctx.has_bias, ctx.eps = comm, n, bias is not None, layer.eps
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd = ctx.saved_tensors
        dy = dense(dy)
        c = mean.numel()
        # torch's fused kernel gives the local sum(dy * xhat) and sum(dy) for the given (global) stats
        if x.numel():
            # weight ones: the kernel's grad_weight is then sum(dy * xhat) whatever the layer's weight
            # (CUDA's kernel refuses an undefined weight, the CPU one takes it)
            _, sum_dyxhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, torch.ones_like(mean), None, None, mean, invstd, True, ctx.eps, [False, True, True])
        else:  # an empty block (a sample group without samples) adds nothing; torch's kernel refuses it
            sum_dyxhat = sum_dy = mean.new_zeros(c)
        local = torch.cat([sum_dy, sum_dyxhat])
        total = ctx.comm.allreduce(local.clone(), "sum")  # local stays: its halves are this rank's dw, db
        dx = None
        if ctx.needs_input_grad[0]:
            # dx = scale * (dy - Sdy/n - xhat * Sdyxhat/n) = scale*dy + k1*x + k2, per channel
            scale = invstd if weight is None else invstd * weight
            means = total / -ctx.n  # -Sdy/n, -Sdyxhat/n
            k1 = scale * invstd * means[c:]
            k2 = torch.addcmul(scale * means[:c], k1, mean, value=-1)
            dims = x.dim() - 2
            dx = torch.addcmul(_bshape(k2, dims), x, _bshape(k1, dims))
            dx.addcmul_(dy, _bshape(scale, dims))
        dw = local[c:] if weight is not None and ctx.needs_input_grad[1] else None
        db = local[:c] if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None


def count_batch(bn: nn.Module, momentum: float | None) -> float:
    """Count one training batch in `bn`'s ``num_batches_tracked`` and return torch's averaging factor for
    it: `momentum`, or the cumulative average's 1/batches when `momentum` is None (as ``nn.BatchNorm2d``)."""
    tracked = bn.num_batches_tracked
    assert isinstance(tracked, torch.Tensor)  # only called when statistics are tracked
    tracked.add_(1)
    return 1.0 / float(tracked) if momentum is None else momentum


def update_running(bn: nn.Module, momentum: float | None, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
    """torch's running-statistics rule on `bn`'s buffers for one training batch of `n` values per channel
    with these batch statistics: counted (:func:`count_batch`), the unbiased variance, in the buffers' dtype."""
    running_mean, running_var = bn.running_mean, bn.running_var
    assert isinstance(running_mean, torch.Tensor) and isinstance(running_var, torch.Tensor)  # tracked
    _lerp_running(running_mean, running_var, count_batch(bn, momentum), mean, var, n)


def _lerp_running(running_mean: torch.Tensor, running_var: torch.Tensor, factor: float, mean: torch.Tensor,
                  var: torch.Tensor, n: float) -> None:
    """torch's update of running statistics by `factor` with one batch's (`n` values per channel; the
    variance made unbiased), in the buffers' dtype."""
    with torch.no_grad():
        running_mean.lerp_(mean.to(running_mean.dtype), factor)
        running_var.lerp_((var * (n / max(n - 1, 1))).to(running_var.dtype), factor)


def sync_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, layer: Any,
                    comm: Any) -> torch.Tensor:
    """Batch norm of `x` (N x C x ...) with statistics over every rank's `x`, differentiable: output and
    input gradient equal the single-process layer on the concatenation of the ranks' inputs; weight and
    bias gradients are this rank's share (sum them over the ranks). `layer` gives ``eps`` and
    ``update_running(mean, var, n)`` (called with the combined batch statistics); `comm` is anything with
    ``size``, ``allgather(t)`` and ``allreduce(t, "sum")`` of a Communicator (mpitrain.horovod passes its
    engine, so the two collectives keep the engine's order)."""
    return _BatchNorm.apply(x, weight, bias, layer, comm)  # type: ignore[no-any-return]


class _Running:
    """`_BatchNorm`'s `layer` for a functional call: its `eps`, and the running buffers it was given
    (None: not tracked) updated with its momentum, which the caller computed (it counted the batch)."""

    def __init__(self, running_mean: torch.Tensor | None, running_var: torch.Tensor | None, momentum: float,
                 eps: float) -> None:
        self.running_mean, self.running_var, self.momentum, self.eps = running_mean, running_var, momentum, eps

    def update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        if self.running_mean is not None and self.running_var is not None:
            _lerp_running(self.running_mean, self.running_var, self.momentum, mean, var, n)


def batch_norm(x: torch.Tensor, running_mean: torch.Tensor | None = None, running_var: torch.Tensor | None = None,
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5) -> torch.Tensor:
    """``F.batch_norm`` on a block or a replicated tensor (routed here by the tensor's rules): what a
    BatchNorm subclass with its own ``forward`` calls (timm's ``BatchNormAct2d``; :func:`convert` leaves
    such a module whole). With batch statistics (`training`) they are the ``"global"`` ones of
    :class:`SpatialBatchNorm2d`, over every rank (one rank per sample group for a replicated tensor):
    output, gradients and the running buffers given (updated by torch's rule with `momentum`) equal one
    process's on the whole batch. With running statistics it is per channel and runs on the block."""
    layout = layout_of(x)
    if layout is None:  # a plain input beside a block argument (weight or statistics): not a layer's call
        raise SpatialError("batch_norm: the input is not a spatial block; weight and statistics must be plain")
    if layout.kind == "block" and not nchw(layout):
        raise SpatialError(f"batch_norm takes N x C x (spatial) blocks, got one of shape {tuple(layout.shape)} "
                           f"whose spatial dims sit at {layout.spatial_dims()}")
    block, dist = plain(x), layout.dist
    comm = (dist.sample_comm if layout.kind == "replicated" else dist.comm) if training else None
    if comm is None or comm.size == 1:
        y = F.batch_norm(block, running_mean, running_var, weight, bias, training, momentum, eps)
    else:
        y = _BatchNorm.apply(block, weight, bias, _Running(running_mean, running_var, momentum, eps), comm)
    return tag(y, layout)


def _batch_norm_either_form(*args: Any, **kwargs: Any) -> torch.Tensor:
    """The spatial form of both torch functions named ``batch_norm``: ``F.batch_norm`` and the ATen-order
    ``torch.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)``."""
    if len(args) + len(kwargs) == 9 or "cudnn_enabled" in kwargs:
        return _aten_batch_norm(*args, **kwargs)
    return batch_norm(*args, **kwargs)


def _aten_batch_norm(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                     momentum: float, eps: float, cudnn_enabled: bool) -> torch.Tensor:
    return batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


register_spatial_function("batch_norm", _batch_norm_either_form)


class SpatialBatchNorm2d(nn.Module):
    """BatchNorm2d on local blocks, sharing `bn`'s parameters *and* running buffers (updated in place,
    so the original module holds the trained statistics). Eval mode normalises locally with the running
    statistics. The local dL/dw, dL/db are this rank's partial sums (:func:`parallelize` sums them)."""

    def __init__(self, bn: nn.BatchNorm2d | nn.BatchNorm3d | nn.SyncBatchNorm, dist: Distribution,
                 stats: str = "global") -> None:
        super().__init__()
        if stats not in STATS:
            raise SpatialError(f"BatchNorm stats must be one of {STATS}, got {stats!r}")
        self.dist, self.stats = dist, stats
        self.weight, self.bias = bn.weight, bn.bias
        self.eps, self.momentum = bn.eps, bn.momentum
        self.bn = [bn]  # a list: the original stays reachable for its buffers without being a submodule
        self.track = bn.track_running_stats

    def extra_repr(self) -> str:
        return f"{self.bn[0]!r}, stats={self.stats!r}"

    def update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        """torch's running-statistics rule (unbiased variance, momentum or cumulative average)."""
        if self.training and self.track:
            update_running(self.bn[0], self.momentum, mean, var, n)

    def _comm(self, dist: DistributionLike, kind: str) -> Communicator | None:
        """Who combines statistics. A replicated tensor (after a global pool: ASPP's pooled branch) holds
        its group's whole samples on every rank of the group, so the global statistics combine one rank
        per group (the sample communicator) and the others are the group's own; the backward, linear in
        the output gradient's shares, then sums them over the same ranks and stays exact."""
        if kind == "replicated":
            return dist.sample_comm if self.stats == "global" else None
        return {"global": dist.comm, "spatial": dist.spatial_comm, "local": None}[self.stats]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, layout = input_layout(self, x)
        bn, comm = self.bn[0], self._comm(layout.dist, layout.kind)
        if not self.training and self.track:
            y = torch.batch_norm(x, self.weight, self.bias, bn.running_mean, bn.running_var, False, 0.0,
                                 self.eps, False)
        elif comm is None or comm.size == 1:  # this block's own statistics: torch's layer and autograd
            running = (bn.running_mean, bn.running_var) if self.track else (None, None)
            factor = count_batch(bn, self.momentum) if self.track else 0.0
            y = F.batch_norm(x, *running, self.weight, self.bias, True, factor, self.eps)
        else:
            y = _BatchNorm.apply(x, self.weight, self.bias, self, comm)
        return tag(y, layout)


class SpatialBatchNorm3d(SpatialBatchNorm2d):
    """BatchNorm3d on local blocks of volumes (a 3-D grid): the same statistics and rules as
    :class:`SpatialBatchNorm2d`."""
