"""Horovod's asynchronous collectives: ``*_async[_]``, ``join``, ``barrier`` (and their handles'
``synchronize``, ``poll``, which live in :mod:`._handles`).

Every call checks its arguments on the calling rank (ValueError before any message), queues one
:class:`~._engine.Op` and returns an integer handle at once; the engine thread negotiates and runs it.
``synchronize(handle)`` waits (with ``_handles.WAIT_POLICY``) and returns the result, re-raising on the
calling thread what failed on the engine thread. Inputs of the out-of-place calls are never modified;
the ``_``-suffixed calls work in place.

Dtypes: uint8/int8/int16/int32/int64/float16/bfloat16/float32/float64. 8/16-bit integers are reduced in
an int32 staging copy and cast back (a sum that overflows wraps around as in the original dtype; an
Average divides the int32 sum), although the Communicator could reduce them in their own width.

Scaling follows Horovod on CPU: floating tensors scale in their dtype (float16/bfloat16 in float32
math), integers in float64 truncated toward zero, the prescaled integer before the sum. Average is
a sum followed by a division by the process set's size (ranks that have joined count, as zeros).

Devices: CPU and CUDA tensors; results are on the input's device. An operation's CUDA tensors must
share one device (a grouped call may mix them with CPU tensors, which are never fused with them), and
every rank must pass each tensor on the same device type (part of the negotiated signature, as
Horovod's "mismatched CPU/GPU device" check). CUDA follows mpitrain's stream rule (``comm._cuda``): the
calling thread records an event on its current stream where the op is queued, and the engine thread
runs the op on the device's side stream after that event, so the caller's stream is never
synchronized as a whole; the op is complete for every stream when ``synchronize()`` returns. Results
are bitwise the CPU call's wherever MPI reduces on the host (staging): the scaling kernels round as
the CPU's do (see :func:`_divisor`).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from .._utils.flat import copy_from_flat, flatten, group_by
from .._utils.stall import DEFAULT_POLICY
from ..comm import after, ready_event
from ..comm.base import Communicator
from ..comm.reducer import ReducePolicy, Reducer
from ._basics import OP_NAMES, Adasum, Average, Max, Min, Product, Sum
from ._engine import JOIN_HANDLERS, Key, Op
from ._handles import poll, submit, synchronize
from ._process_sets import ProcessSet, _resolve, global_process_set

__all__ = ["allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_",
           "alltoall_async", "reducescatter_async", "grouped_reducescatter_async", "synchronize", "poll",
           "join", "barrier", "SUPPORTED_DTYPES", "handle_average_backwards_compatibility"]

SUPPORTED_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                    torch.bfloat16, torch.float32, torch.float64)
_MPI_OP = {Average: "sum", Sum: "sum", Min: "min", Max: "max", Product: "prod"}
_Execute = Callable[[Communicator, list[Any]], Any]
#: the reducer's stall policy here: warn, and leave ending the job to the engine's negotiation waits
_WARN_ONLY = dataclasses.replace(DEFAULT_POLICY, abort_after=None)


# -- argument checks -------------------------------------------------------------------------------------
def handle_average_backwards_compatibility(op: int | None, average: bool | None) -> int:
    """The op to use from Horovod's `op` and deprecated `average` arguments (default Average)."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _check_tensor(t: Any, what: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"Tensor type {t.dtype} is not supported; supported: {[str(d) for d in SUPPORTED_DTYPES]}")
    if not (t.is_cpu or t.is_cuda):
        raise ValueError(f"{what} is on {t.device}; mpitrain.horovod takes CPU and CUDA tensors: move it to "
                         f"one of them (.cpu() or .cuda())")
    if not t.is_contiguous():
        raise ValueError("Tensor is required to be contiguous.")
    return t


def _check_op(op: int) -> int:
    if op == Adasum:
        raise NotImplementedError("Adasum is not supported by mpitrain.horovod; use Average or Sum")
    if op not in _MPI_OP:
        raise ValueError(f"unknown reduction op {op!r}; use hvd.Average, Sum, Min, Max or Product")
    return op


#: The dtypes a reduction travels in as they are; 8/16-bit integers go as int32 (see the module doc).
_WIRE = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)


def _wire(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels in: its own for :data:`_WIRE`, else int32 (8/16-bit ints)."""
    return dtype if dtype in _WIRE else torch.int32


def _specs(ts: Sequence[torch.Tensor], skip_first: bool = False) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    dtypes = tuple(str(t.dtype).removeprefix("torch.") for t in ts)
    shapes = tuple(tuple(t.shape[1:] if skip_first else t.shape) for t in ts)
    return dtypes, shapes


def _devices(ts: Sequence[torch.Tensor]) -> tuple[str, ...]:
    """The device type of each (checked) tensor: a signature field (every rank must agree, as Horovod)
    that also decides fusion. Computed once per operation, where it is queued."""
    return tuple(["cuda" if t.is_cuda else "cpu" for t in ts])


# -- CUDA: the stream rule -----------------------------------------------------------------------------
def _on_device(ts: Sequence[torch.Tensor], devices: tuple[str, ...], execute: _Execute) -> _Execute:
    """`execute` as the engine thread must run it for `ts`: unchanged when no tensor is on a CUDA
    device; otherwise on that device's side stream, after an event recorded here (on the calling
    thread's current stream, where `ts` are produced: call this after any copy of them), complete for
    every stream when it returns. New CUDA tensors it returns were allocated on the side stream: they
    are marked as used by the caller's stream, so the allocator does not hand their memory to a later
    op while the caller's kernels may still read it. ValueError (on the calling rank) for CUDA tensors
    on more than one device. `devices`: :func:`_devices` of `ts`."""
    if "cuda" not in devices:
        return execute
    cuda = [t for t in ts if t.is_cuda]
    anchor = cuda[0]
    if any(t.device != anchor.device for t in cuda):
        raise ValueError(f"the tensors of one operation must be on one CUDA device, got "
                         f"{sorted({str(t.device) for t in cuda})}")
    ready = ready_event(anchor)
    caller = torch.cuda.current_stream(anchor.device)

    def run(comm: Communicator, infos: list[Any]) -> Any:
        with after(anchor, ready):
            result = execute(comm, infos)
        for out in tree_leaves(result):
            if isinstance(out, torch.Tensor) and out.is_cuda:
                out.record_stream(caller)
        return result

    return run


# -- scaling ---------------------------------------------------------------------------------------------
def _divisor(t: torch.Tensor, n: int) -> int | torch.Tensor:
    """`n` as the divisor of `t`: on CUDA a device scalar, because a CUDA kernel divides by a host
    scalar as a product with its reciprocal (an ulp off the CPU's quotient, and an integer average
    truncated from 6.999... instead of 7); a division by a device tensor rounds as the CPU's."""
    return n if t.is_cpu else torch.full((), n, dtype=torch.float64, device=t.device)


def _scale_(t: torch.Tensor, factor: float) -> None:
    """t *= factor in place: float16/bfloat16 in float32 math, integers in float64 truncated toward zero."""
    if t.dtype in (torch.float16, torch.bfloat16):
        t.copy_(t.float() * factor)
    elif t.is_floating_point():
        t.mul_(factor)
    else:
        t.copy_(torch.trunc(t.double() * factor))


def _finish_scale_(t: torch.Tensor, op: int, n: int, post: float) -> None:
    """After the sum: Average divides by `n` (times `post`), other ops multiply by `post`."""
    if op != Average:
        if post != 1.0:
            _scale_(t, post)
    elif post != 1.0:
        _scale_(t, post / n)
    elif t.is_floating_point():
        d = _divisor(t, n)
        t.copy_(t.float() / d) if t.dtype in (torch.float16, torch.bfloat16) else t.div_(d)
    else:
        t.copy_(torch.trunc(t.double() / _divisor(t, n)))


# -- allreduce -------------------------------------------------------------------------------------------
def _reduce_fused(comm: Communicator, ts: Sequence[torch.Tensor], mpi_op: str, devices: Sequence[str]) -> None:
    """Reduce every tensor of `ts` in place: one collective per (device type, wire dtype), on a flat
    copy (on that device) unless a lone tensor already travels as it is: CPU and CUDA tensors are
    never fused together. `devices` are the device types of `ts` (:func:`_devices`); joined ranks call
    this on CPU zeros of the same specs with the active ranks' `devices`, so both sides issue identical
    MPI calls."""
    reduce = _reducer(comm).reduce if mpi_op == "sum" else (lambda ts: comm.allreduce(ts[0], mpi_op))
    for (_, wire), pairs in group_by(zip(ts, devices), lambda tk: (tk[1], _wire(tk[0].dtype))).items():
        group = [t for t, _ in pairs]
        if len(group) == 1 and group[0].dtype == wire:
            reduce([group[0].view(-1)])
            continue
        flat = flatten([t.to(wire) for t in group])
        reduce([flat])
        copy_from_flat(flat, group)


def _reducer(comm: Communicator) -> Reducer:
    """The gradient reducer's blocking form for Sum and Average (a flat sum: the engine thread has just
    negotiated the op, so no order is left to agree on). Min, Max and Product are not gradient reductions
    and stay plain allreduces. It only warns when late, as the engine's watched collectives do."""
    return Reducer(comm, ReducePolicy("flat", op="sum"), _WARN_ONLY, name="horovod allreduce")


def _allreduce_inplace(comm: Communicator, ts: Sequence[torch.Tensor], op: int, pre: float, post: float,
                       devices: Sequence[str]) -> None:
    if pre != 1.0:
        for t in ts:
            _scale_(t, pre)
    _reduce_fused(comm, ts, _MPI_OP[op], devices)
    for t in ts:
        _finish_scale_(t, op, comm.size, post)


def _join_allreduce(comm: Communicator, key: Key) -> None:
    fields = dict(key[2])
    zeros = [torch.zeros(shape, dtype=getattr(torch, dt)) for dt, shape in zip(fields["dtypes"], fields["shapes"])]
    _reduce_fused(comm, zeros, _MPI_OP[[k for k, v in OP_NAMES.items() if v == fields["op"]][0]], fields["devices"])


JOIN_HANDLERS["allreduce"] = _join_allreduce
JOIN_HANDLERS["barrier"] = lambda comm, key: comm.barrier()


def _allreduce_op(outs: list[torch.Tensor], name: str | None, op: int, pre: float, post: float,
                  process_set: ProcessSet, single: bool) -> int:
    _check_op(op)
    pid, _ = _resolve(process_set)
    dtypes, shapes = _specs(outs)
    devices = _devices(outs)
    key: Key = ("allreduce", name, (("dtypes", dtypes), ("shapes", shapes), ("devices", devices),
                                    ("op", OP_NAMES[op])))

    def execute(comm: Communicator, infos: list[Any]) -> Any:
        _allreduce_inplace(comm, outs, op, pre, post, devices)
        return outs[0] if single else outs

    return submit(Op("allreduce", name, pid, key, None, _on_device(outs, devices, execute)))


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start reducing `tensor` over `process_set` into a new tensor; returns a handle. `op` defaults to
    Average; Adasum raises NotImplementedError. The input is not modified."""
    op = handle_average_backwards_compatibility(op, average)
    t = _check_tensor(tensor)
    return _allreduce_op([t.detach().clone()], name, op, prescale_factor, postscale_factor, process_set, True)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """As :func:`allreduce_async`, in place: `tensor` holds the result after synchronize()."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_op([_check_tensor(tensor)], name, op, prescale_factor, postscale_factor, process_set, True)


def _check_list(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not len(tensors):
        raise ValueError("grouped operations take a non-empty list of tensors")
    return [_check_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start reducing a list of tensors as one negotiated, fused operation; results are new tensors."""
    op = handle_average_backwards_compatibility(op, average)
    outs = [t.detach().clone() for t in _check_list(tensors)]
    return _allreduce_op(outs, name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> int:
    """As :func:`grouped_allreduce_async`, in place."""
    op = handle_average_backwards_compatibility(op, average)
    return _allreduce_op(_check_list(tensors), name, op, prescale_factor, postscale_factor, process_set, False)


# -- allgather -------------------------------------------------------------------------------------------
def _gather_rows(comm: Communicator, t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Concatenate every rank's `t` on dim 0, where rank r has rows[r] rows (padded to the longest)."""
    src = t.reshape(1) if t.dim() == 0 else t
    wire = src.to(_wire(src.dtype)).contiguous()
    if all(r == rows[0] for r in rows):
        return comm.allgather(wire).to(t.dtype)
    most = max(rows)
    padded = torch.zeros((most, *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
    padded[:wire.shape[0]] = wire
    gathered = comm.allgather(padded).view(len(rows), most, *wire.shape[1:])
    return torch.cat([gathered[r, :n] for r, n in enumerate(rows)]).to(t.dtype)


def _allgather_op(ts: list[torch.Tensor], name: str | None, process_set: ProcessSet, single: bool,
                  rows_sink: list[list[int]] | None = None) -> int:
    """Queue an allgather; `rows_sink`, if given, receives each tensor's per-rank first dims."""
    pid, _ = _resolve(process_set)
    dtypes, trailing = _specs(ts, skip_first=True)
    devices = _devices(ts)
    key: Key = ("allgather", name, (("dtypes", dtypes), ("trailing shapes", trailing), ("devices", devices)))
    info = tuple(t.shape[0] if t.dim() else 1 for t in ts)

    def execute(comm: Communicator, infos: list[Any]) -> Any:
        outs = [_gather_rows(comm, t, [rows[i] for rows in infos]) for i, t in enumerate(ts)]
        if rows_sink is not None:
            rows_sink.extend([rows[i] for rows in infos] for i in range(len(ts)))
        return outs[0] if single else outs

    return submit(Op("allgather", name, pid, key, info, _on_device(ts, devices, execute)))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start concatenating every rank's `tensor` on dim 0 in rank order (first dims may differ)."""
    return _allgather_op([_check_tensor(tensor)], name, process_set, True)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Start allgathering each tensor of a list, negotiated as one operation."""
    return _allgather_op(_check_list(tensors), name, process_set, False)


# -- broadcast -------------------------------------------------------------------------------------------
def _broadcast_op(out: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> int:
    pid, _ = _resolve(process_set)
    if not isinstance(root_rank, int):
        raise ValueError(f"root_rank must be an int, got {root_rank!r}")
    root = process_set._root(root_rank)
    dtypes, shapes = _specs([out])
    devices = _devices([out])
    key: Key = ("broadcast", name, (("dtype", dtypes[0]), ("shape", shapes[0]), ("device", devices[0]),
                                    ("root_rank", root_rank)))

    def execute(comm: Communicator, infos: list[Any]) -> torch.Tensor:
        wire = _wire(out.dtype)
        buf = out.view(-1) if wire == out.dtype else out.reshape(-1).to(wire)
        comm.broadcast(buf, root)
        if buf.dtype != out.dtype:
            out.view(-1).copy_(buf)
        return out

    return submit(Op("broadcast", name, pid, key, None, _on_device([out], devices, execute)))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start copying global rank `root_rank`'s `tensor` into a new tensor on every rank of the set."""
    return _broadcast_op(_check_tensor(tensor).detach().clone(), root_rank, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """As :func:`broadcast_async`, in place."""
    return _broadcast_op(_check_tensor(tensor), root_rank, name, process_set)


# -- alltoall --------------------------------------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[r]`` rows of `tensor` (dim 0, in order) to set rank r. `splits` is None
    (equal parts: dim 0 must divide by the set size), a list or an int32 tensor. synchronize() returns
    ``(output, received_splits)`` with received_splits an int32 tensor."""
    t = _check_tensor(tensor)
    pid, ranks = _resolve(process_set)
    n = len(ranks)
    if t.dim() == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        if t.shape[0] % n:
            raise ValueError(f"alltoall: the first dimension ({t.shape[0]}) is not a multiple of the number "
                             f"of ranks ({n}); pass splits=")
        send = [t.shape[0] // n] * n
    else:
        if isinstance(splits, torch.Tensor):
            if splits.dtype != torch.int32:
                raise ValueError(f"alltoall splits must be an int32 tensor, got {splits.dtype}")
            send = [int(s) for s in splits.reshape(-1).tolist()]
        else:
            send = [int(s) for s in splits]
        if len(send) != n or any(s < 0 for s in send):
            raise ValueError(f"alltoall splits must hold {n} non-negative counts, got {send}")
        if sum(send) > t.shape[0]:
            raise ValueError(f"alltoall splits sum to {sum(send)}, more than the first dimension ({t.shape[0]})")
    dtypes, trailing = _specs([t], skip_first=True)
    devices = _devices([t])
    key: Key = ("alltoall", name, (("dtype", dtypes[0]), ("trailing shape", trailing[0]), ("device", devices[0])))
    # Horovod: received splits come on the device of a splits tensor, else on the CPU
    splits_device = splits.device if isinstance(splits, torch.Tensor) else None

    def execute(comm: Communicator, infos: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        recv = [info[comm.rank] for info in infos]
        wire = t[:sum(send)].to(_wire(t.dtype)).contiguous()
        out = comm.alltoallv(wire, send, recv).to(t.dtype)
        return out, torch.tensor(recv, dtype=torch.int32, device=splits_device)

    return submit(Op("alltoall", name, pid, key, tuple(send), _on_device([t], devices, execute)))


# -- reducescatter ---------------------------------------------------------------------------------------
def _reducescatter_op(ts: list[torch.Tensor], name: str | None, op: int, pre: float, post: float,
                      process_set: ProcessSet, single: bool) -> int:
    if op == Adasum:
        raise NotImplementedError("reducescatter does not support Adasum")
    if op not in (Average, Sum):
        raise NotImplementedError(f"reducescatter supports Sum and Average, got {OP_NAMES.get(op, op)}")
    pid, _ = _resolve(process_set)
    if any(t.dim() == 0 for t in ts):
        raise ValueError("reducescatter needs tensors with at least one dimension (got a scalar)")
    dtypes, shapes = _specs(ts)
    devices = _devices(ts)
    key: Key = ("reducescatter", name, (("dtypes", dtypes), ("shapes", shapes), ("devices", devices),
                                        ("op", OP_NAMES[op])))

    def execute(comm: Communicator, infos: list[Any]) -> Any:
        outs = []
        for t in ts:
            work = t.to(_wire(t.dtype), copy=True)
            if pre != 1.0:
                _scale_(work, pre)
            out = comm.reduce_scatter(work, "sum")
            _finish_scale_(out, op, comm.size, post)
            outs.append(out.to(t.dtype))
        return outs[0] if single else outs

    return submit(Op("reducescatter", name, pid, key, None, _on_device(ts, devices, execute)))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing `tensor` (same shape everywhere) and keeping this rank's block of dim 0: the first
    ``d0 % size`` ranks get one row more. Sum or Average."""
    return _reducescatter_op([_check_tensor(tensor)], name, op, prescale_factor, postscale_factor, process_set,
                             True)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor of a list, negotiated as one operation."""
    return _reducescatter_op(_check_list(tensors), name, op, prescale_factor, postscale_factor, process_set,
                             False)


# -- join, barrier ---------------------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """Declare that this rank has no more data. Until every rank has joined, this rank takes part in
    the others' allreduces with zeros (Average still divides by size()) and barriers; any other
    collective fails on the ranks that issue it. Returns the last rank to join, the same on every rank.
    Global process set only. `device` is accepted for compatibility (zeros are sent from host memory)."""
    return int(synchronize(submit(Op("join", None, 0, ("join", None, ()), None, lambda c, i: None))))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of `process_set` has called barrier (after their earlier ops)."""
    pid, _ = _resolve(process_set)
    synchronize(submit(Op("barrier", None, pid, ("barrier", None, ()), None, lambda comm, i: comm.barrier())))


