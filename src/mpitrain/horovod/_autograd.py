"""Horovod's blocking collectives, differentiable as in Horovod: each is an autograd Function whose
backward runs the adjoint collective (allreduce <-> allreduce, allgather -> averaged slice, broadcast ->
averaged gradient on the root, alltoall -> reverse alltoall, reducescatter -> allgather). As in Horovod,
backward assumes the upstream gradient is replicated and averages where the forward gathered."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._basics import Average, Sum, rank
from ._compression import Compression, Compressor
from ._mpi_ops import (
    _allgather_op,
    _check_list,
    _check_tensor,
    _reducescatter_op,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    handle_average_backwards_compatibility,
    synchronize,
)
from ._process_sets import ProcessSet, global_process_set

__all__ = ["allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "grouped_allgather",
           "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter"]


# -- allreduce -------------------------------------------------------------------------------------------
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, name: str | None, pre: float, post: float,
                ps: ProcessSet) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, ps))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        out = allreduce(grad.contiguous(), op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
        return out, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` over `process_set` (every member calls, same shape and dtype, same order) and
    return a new tensor; the input is unchanged. Differentiable. `op` defaults to Average."""
    op = handle_average_backwards_compatibility(op, average)
    compressed, cctx = compression.compress(tensor)
    out = _Allreduce.apply(compressed, op, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, cctx)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place allreduce; returns `tensor`. Not differentiable."""
    op = handle_average_backwards_compatibility(op, average)
    return synchronize(allreduce_async_(tensor, None, name, op, prescale_factor, postscale_factor,  # type: ignore[no-any-return]
                                        process_set))


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, op: int, name: str | None, pre: float, post: float, ps: ProcessSet,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, ps)
        return tuple(synchronize(grouped_allreduce_async(list(tensors), None, name, op, pre, post, ps)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        out = grouped_allreduce([g.contiguous() for g in grads], op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=ps)
        return (None, None, None, None, None, *out)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allreduce of a list of tensors as one negotiated, fused operation; new tensors. Differentiable."""
    op = handle_average_backwards_compatibility(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduce.apply(op, name, prescale_factor, postscale_factor, process_set,
                                   *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """In-place grouped allreduce; returns the tensors."""
    op = handle_average_backwards_compatibility(op, average)
    return synchronize(grouped_allreduce_async_(tensors, None, name, op, prescale_factor,  # type: ignore[no-any-return]
                                                postscale_factor, process_set))


# -- allgather -------------------------------------------------------------------------------------------
def _slice_mine(grad: torch.Tensor, rows: list[int], ps: ProcessSet, shape: torch.Size) -> torch.Tensor:
    r = ps.rank() or 0
    return grad.narrow(0, sum(rows[:r]), rows[r]).reshape(shape)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        rows: list[list[int]] = []
        out = synchronize(_allgather_op([_check_tensor(tensor)], name, ps, True, rows))
        ctx.args = (rows[0], ps, tensor.shape)
        return out  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rows, ps, shape = ctx.args
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ps)
        return _slice_mine(reduced, rows, ps, shape), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Every rank's `tensor` concatenated on dim 0 in set-rank order (first dims may differ; a 0-d tensor
    counts as one row). Differentiable."""
    return _Allgather.apply(tensor, name, process_set)  # type: ignore[no-any-return]


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, ps: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows: list[list[int]] = []
        outs = synchronize(_allgather_op(_check_list(tensors), name, ps, False, rows))
        ctx.args = (rows, ps, [t.shape for t in tensors])
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        rows, ps, shapes = ctx.args
        reduced = grouped_allreduce([g.contiguous() for g in grads], op=Average, process_set=ps)
        return (None, None, *[_slice_mine(g, r, ps, s) for g, r, s in zip(reduced, rows, shapes)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Allgather of each tensor of a list, negotiated as one operation. Differentiable."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast -------------------------------------------------------------------------------------------
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.args = (root_rank, ps)
        return synchronize(broadcast_async(tensor, root_rank, name, ps))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        root_rank, ps = ctx.args
        reduced = allreduce(grad.contiguous(), op=Average, process_set=ps)
        if rank() != root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """A new tensor holding global rank `root_rank`'s `tensor` on every member. Differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)  # type: ignore[no-any-return]


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """In-place broadcast from global rank `root_rank`; returns `tensor`."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))  # type: ignore[no-any-return]


# -- alltoall --------------------------------------------------------------------------------------------
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name, ps))
        ctx.args = (received, ps, tensor.shape)
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:
        received, ps, shape = ctx.args
        back, _ = alltoall(grad.contiguous(), splits=received, process_set=ps)
        if back.shape[0] < shape[0]:  # rows beyond sum(splits) were not sent: no gradient
            back = torch.cat([back, back.new_zeros((shape[0] - back.shape[0], *back.shape[1:]))])
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[r]`` rows of `tensor` to set rank r and receive theirs, concatenated in rank order.
    Without `splits` (equal parts) returns the output alone; with `splits` (list or int32 tensor)
    returns ``(output, received_splits)`` (int32). Differentiable in `tensor`."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# -- reducescatter ---------------------------------------------------------------------------------------
def _reducescatter_grad(grad: torch.Tensor, op: int, pre: float, post: float, ps: ProcessSet) -> torch.Tensor:
    grad = grad.contiguous()
    if op == Sum:
        grad = grad * (ps.size() or 1)
    if pre != 1.0:
        grad = grad * pre
    if post != 1.0:
        grad = grad * post
    return grad


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, ps: ProcessSet, pre: float,
                post: float) -> torch.Tensor:
        ctx.args = (op, pre, post, ps)
        return synchronize(_reducescatter_op([_check_tensor(tensor)], name, op, pre, post, ps, True))  # type: ignore[no-any-return]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        return allgather(_reducescatter_grad(grad, op, pre, post, ps), process_set=ps), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none,
                  op: int = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` (same shape on every member) and return this rank's block of dim 0; the first
    ``d0 % size`` ranks get one row more. Sum or Average (default). Differentiable."""
    compressed, cctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, cctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, ps: ProcessSet, pre: float, post: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, pre, post, ps)
        return tuple(synchronize(_reducescatter_op(_check_list(tensors), name, op, pre, post, ps, False)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, pre, post, ps = ctx.args
        scaled = [_reducescatter_grad(g, op, pre, post, ps) for g in grads]
        return (None, None, None, None, None, *grouped_allgather(scaled, process_set=ps))


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reducescatter of each tensor of a list, negotiated as one operation. Differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                       *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]
