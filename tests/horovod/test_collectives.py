"""mpitrain.horovod collectives, adapted from Horovod 0.28.1's test/parallel/test_torch.py (same cases and
assertions, our code), over real MPI at 2, 3 and 4 ranks. References are computed in one process from
what every rank holds (tensors are seeded, so each rank can rebuild every other rank's input)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch

import mpitrain.horovod as hvd
from tests.helpers import assert_all_ranks

from ._util import ALL_TYPES, INT_TYPES, close, raises_everywhere, same

# Horovod's cases use the deprecated `average=`; its DeprecationWarning is expected here.
pytestmark = [pytest.mark.mpi, pytest.mark.filterwarnings("ignore:Parameter `average`:DeprecationWarning")]


@pytest.fixture(autouse=True)
def _init():
    hvd.init()


def _rand(shape, dtype, seed=1234, low=-100, high=100):
    torch.manual_seed(seed)
    t = torch.empty(shape).random_(low, high)
    if dtype == torch.uint8:
        t = t.abs()
    return t.to(dtype)


def _fp(t):
    return t.float() if t.dtype == torch.float16 else t


# -- lifecycle and queries -----------------------------------------------------------------------------
def test_init_is_repeatable_and_shutdown_leaves_mpi_initialized(comm):
    from mpi4py import MPI

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    assert_all_ranks(comm, hvd.is_initialized())
    hvd.shutdown()
    ok = not hvd.is_initialized() and MPI.Is_initialized() and not MPI.Is_finalized()
    hvd.init()
    assert_all_ranks(comm, ok and (hvd.rank(), hvd.size()) == (rank, size) == (comm.rank, comm.size))
    same(comm, hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(comm.size)), "after re-init")


def test_rank_size_and_host_queries(comm):
    ok = (hvd.rank(), hvd.size()) == (comm.rank, comm.size)
    ok &= hvd.local_size() == comm.size and hvd.local_rank() == comm.rank  # one host
    ok &= hvd.cross_size() == 1 and hvd.cross_rank() == 0 and hvd.is_homogeneous()
    ok &= isinstance(hvd.mpi_threads_supported(), bool) and hvd.mpi_built() and hvd.mpi_enabled()
    ok &= not hvd.gloo_built() and not hvd.gloo_enabled() and not hvd.nccl_built() and not hvd.ccl_built()
    ok &= issubclass(hvd.HorovodInternalError, RuntimeError)
    assert_all_ranks(comm, ok)


# -- allreduce -----------------------------------------------------------------------------------------
def test_allreduce_sums_every_dtype_and_dim(comm):
    for dtype, dim in itertools.product(ALL_TYPES, [1, 2, 3]):
        tensor = _rand([17] * dim, dtype)
        summed = hvd.allreduce(tensor, average=False)
        same(comm, summed, (tensor.to(torch.int64) * comm.size).to(dtype) if not dtype.is_floating_point
             else (_fp(tensor) * comm.size).to(dtype), f"sum {dtype} dim {dim}")


def test_allreduce_average_of_integers_truncates_toward_zero(comm):
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float32, torch.float64], [1, 2, 3]):
        tensor = _rand([17] * dim, dtype)
        same(comm, hvd.allreduce(tensor, average=True), tensor, f"average {dtype}")
    n = comm.size
    mine = torch.full((3,), -(comm.rank + 1), dtype=torch.int32)  # sum -n(n+1)/2, mean -(n+1)/2
    expected = torch.full((3,), int(-(n + 1) / 2), dtype=torch.int32)
    same(comm, hvd.allreduce(mine, op=hvd.Average), expected, "toward zero")
    # prescaled integers are truncated before the sum: trunc(3 * 0.5) = 1 per rank
    same(comm, hvd.allreduce(torch.full((2,), 3), op=hvd.Sum, prescale_factor=0.5), torch.full((2,), n), "pre")


def test_allreduce_min_max_product(comm):
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float32, torch.float64], [1, 2, 3]):
        every = torch.stack([_rand([17] * dim, dtype, seed=r, low=-3, high=4) for r in range(comm.size)])
        mine = every[comm.rank]
        same(comm, hvd.allreduce(mine, op=hvd.Min), every.min(0).values, f"min {dtype}")
        same(comm, hvd.allreduce(mine, op=hvd.Max), every.max(0).values, f"max {dtype}")
        same(comm, hvd.allreduce(mine, op=hvd.Product), every.prod(0).to(dtype), f"product {dtype}")


def test_allreduce_inplace_and_zero_dim(comm):
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float32, torch.float64], [1, 2, 3]):
        tensor = _rand([17] * dim, dtype)
        expected = tensor * comm.size
        out = hvd.allreduce_(tensor, op=hvd.Sum)
        assert_all_ranks(comm, out is tensor)
        same(comm, tensor, expected, f"inplace {dtype}")
    same(comm, hvd.allreduce(torch.tensor(2.0), op=hvd.Sum), torch.tensor(2.0 * comm.size), "0-dim")
    same(comm, hvd.allreduce(torch.tensor(4)), torch.tensor(4), "0-dim int average")


def test_allreduce_async_fused_is_asynchronous(comm):
    tests, polled_false = [], False
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float16, torch.float32, torch.float64],
                                        [1, 2, 3]):
        tensor = _rand([17] * dim, dtype)
        handle = hvd.allreduce_async(tensor, average=False)
        polled_false |= not hvd.poll(handle)
        tests.append((tensor * comm.size, handle))
    assert_all_ranks(comm, polled_false, "hvd.poll() always returned True, not an async op?")
    for expected, handle in tests:
        same(comm, hvd.synchronize(handle), expected)


def test_async_call_returns_before_peers_issue_it(comm):
    """Rank 0's call returns while the other ranks have not issued theirs: poll is False, then True."""
    if comm.rank == 0:
        handle = hvd.allreduce_async(torch.ones(4), op=hvd.Sum, name="late")
        early = hvd.poll(handle)
        comm.barrier()
    else:
        comm.barrier()
        time.sleep(0.05)
        handle = hvd.allreduce_async(torch.ones(4), op=hvd.Sum, name="late")
        early = False
    out = hvd.synchronize(handle)
    assert_all_ranks(comm, not early, "poll() was True before every rank had issued the op")
    same(comm, out, torch.full((4,), float(comm.size)))
    assert_all_ranks(comm, hvd.synchronize(handle) is None, "a second synchronize() returns None")


def test_allreduce_prescale_and_postscale(comm):
    size = comm.size
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float16, torch.float32, torch.float64],
                                        [1, 2, 3]):
        np.random.seed(1234)
        factor = float(np.random.uniform())
        tensor = _rand([17] * dim, dtype)
        math = torch.float64 if dtype in INT_TYPES else torch.float32 if dtype == torch.float16 else dtype
        pre = hvd.allreduce(tensor, average=False, prescale_factor=factor)
        expected_pre = _fp((torch.tensor(factor, dtype=math) * tensor.to(math)).to(dtype)) * size
        post = hvd.allreduce(tensor, average=False, postscale_factor=factor)
        expected_post = ((size * tensor.to(math)) * torch.tensor(factor, dtype=math)).to(dtype)
        tol = 0.0 if size <= 2 or dtype != torch.float16 else 1.0  # float16 rounding of 3 and 4 summands
        close(comm, _fp(pre), expected_pre, f"prescale {dtype}", tol)
        close(comm, _fp(post), _fp(expected_post), f"postscale {dtype}", tol)


def _even_odd_sets(comm):
    evens = hvd.add_process_set([r for r in range(comm.size) if r % 2 == 0])
    odds = hvd.add_process_set([r for r in range(comm.size) if r % 2 == 1])
    mine = evens if comm.rank % 2 == 0 else odds
    return evens, odds, mine


def test_allreduce_on_process_sets(comm):
    evens, odds, mine = _even_odd_sets(comm)
    try:
        for dtype, dim in itertools.product([torch.int32, torch.float32, torch.float64], [1, 2, 3]):
            every = [_rand([17] * dim, dtype, seed=r) for r in range(comm.size)]
            expected = sum(every[r] for r in mine.ranks)
            same(comm, hvd.allreduce(every[comm.rank], op=hvd.Sum, process_set=mine), expected, f"set {dtype}")
        ok = mine.rank() == mine.ranks.index(comm.rank) and mine.size() == len(mine.ranks) and mine.included()
        assert_all_ranks(comm, ok)
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


def test_allreduce_shape_dtype_mismatch_raises_everywhere_and_library_stays_usable(comm):
    msg = raises_everywhere(comm, RuntimeError, lambda: hvd.allreduce(torch.ones([17 + comm.rank] * 3), name="x"))
    assert_all_ranks(comm, "ranks [" in msg and "'x'" in msg and "shape" in msg, msg)
    dims = [17, 23 * 57] if comm.rank == 0 else [17, 23, 57]
    raises_everywhere(comm, RuntimeError, lambda: hvd.allreduce(torch.ones(dims)))
    t = torch.ones(17, dtype=torch.int32 if comm.rank % 2 == 0 else torch.float32)
    raises_everywhere(comm, hvd.HorovodInternalError, lambda: hvd.allreduce(t), match="dtype")
    msg = raises_everywhere(comm, hvd.HorovodInternalError, lambda: hvd.allreduce(torch.ones(3)) if comm.rank % 2 == 0
                            else hvd.allgather(torch.ones(3)))  # different collectives: no hang either
    assert_all_ranks(comm, "runs allreduce" in msg and "runs allgather" in msg, msg)
    same(comm, hvd.allreduce(torch.ones(3), op=hvd.Sum), torch.full((3,), float(comm.size)), "usable after errors")


def test_duplicate_name_of_concurrent_ops_raises_valueerror(comm):
    tensor = torch.ones(17, 17)
    handle = hvd.allreduce_async(tensor, name="duplicate_name")
    raises_everywhere(comm, ValueError, lambda: hvd.allreduce_async(tensor, name="duplicate_name"))
    hvd.synchronize(handle)
    hvd.synchronize(hvd.allreduce_async(tensor, name="duplicate_name"))  # fine once the first completed


def test_adasum_and_bad_arguments_are_refused_locally(comm):
    raises_everywhere(comm, NotImplementedError, lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum),
                      match="Adasum")
    raises_everywhere(comm, ValueError, lambda: hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum))
    raises_everywhere(comm, ValueError, lambda: hvd.allreduce(torch.ones(4, 4).t()), match="contiguous")
    raises_everywhere(comm, ValueError, lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)), match="type")


def test_allreduce_gradients(comm):
    for dtype, dim, average in itertools.product([torch.float32, torch.float64], [1, 2, 3], [False, True]):
        tensor = _rand([17] * dim, dtype).requires_grad_()
        hvd.allreduce(tensor, average=average).backward(torch.ones([17] * dim, dtype=dtype))
        expected = torch.ones([17] * dim, dtype=dtype) * (1 if average else comm.size)
        same(comm, tensor.grad, expected, f"grad {dtype} average={average}")


def test_grouped_allreduce(comm):
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float32, torch.float64], [1, 2, 3]):
        tensors = [_rand([17] * dim, dtype, seed=1234 + i) for i in range(5)]
        summed = hvd.grouped_allreduce(tensors, average=False)
        averaged = hvd.grouped_allreduce(tensors, average=True)
        for t, s, a in zip(tensors, summed, averaged):
            same(comm, s, t * comm.size, f"grouped sum {dtype}")
            same(comm, a, t, f"grouped average {dtype}")
        copies = [t.clone() for t in tensors]
        hvd.grouped_allreduce_(copies, op=hvd.Sum)
        for t, c in zip(tensors, copies):
            same(comm, c, t * comm.size, f"grouped inplace {dtype}")
    mixed = [torch.ones(3, dtype=torch.int8), torch.ones(2), torch.ones(4, dtype=torch.float64)]
    for t, s in zip(mixed, hvd.grouped_allreduce(mixed, op=hvd.Sum)):
        same(comm, s, t * comm.size, "mixed dtypes in one group")


def test_grouped_allreduce_gradients_and_process_sets(comm):
    evens, odds, mine = _even_odd_sets(comm)
    try:
        for dtype, average in itertools.product([torch.float32, torch.float64], [False, True]):
            tensors = [_rand([17, 17], dtype, seed=i).requires_grad_() for i in range(3)]
            outs = hvd.grouped_allreduce(tensors, average=average, process_set=mine)
            torch.autograd.backward(outs, [torch.ones(17, 17, dtype=dtype)] * 3)
            for t in tensors:
                same(comm, t.grad, torch.ones(17, 17, dtype=dtype) * (1 if average else mine.size()))
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


# -- allgather -----------------------------------------------------------------------------------------
def test_allgather_every_dtype_with_uneven_first_dims(comm):
    sizes = [3, 2, 7, 4, 6, 8, 10][:comm.size]
    for dtype, dim in itertools.product(ALL_TYPES, [1, 2, 3]):
        mine = (torch.ones([sizes[comm.rank]] + [17] * (dim - 1)) * comm.rank).to(dtype)
        expected = torch.cat([(torch.ones([sizes[r]] + [17] * (dim - 1)) * r).to(dtype) for r in range(comm.size)])
        same(comm, hvd.allgather(mine), expected, f"allgather {dtype} dim {dim}")
        equal = (torch.ones([17] * dim) * comm.rank).to(dtype)
        same(comm, hvd.allgather(equal), torch.cat([(torch.ones([17] * dim) * r).to(dtype)
                                                     for r in range(comm.size)]), "equal dims")


def test_allgather_async_fused_and_grouped(comm):
    handles = []
    for dtype, dim in itertools.product([torch.int32, torch.float32, torch.float64], [1, 2, 3]):
        t = (torch.ones([17] * dim) * comm.rank).to(dtype)
        handles.append((hvd.allgather_async(t), torch.cat([(torch.ones([17] * dim) * r).to(dtype)
                                                           for r in range(comm.size)])))
    for h, expected in handles:
        same(comm, hvd.synchronize(h), expected)
    tensors = [torch.ones(comm.rank + 1 + i, 2) * comm.rank for i in range(3)]
    outs = hvd.grouped_allgather(tensors)
    for i, out in enumerate(outs):
        same(comm, out, torch.cat([torch.ones(r + 1 + i, 2) * r for r in range(comm.size)]), "grouped")


def test_allgather_mismatch_raises_everywhere(comm):
    raises_everywhere(comm, RuntimeError, lambda: hvd.allgather(torch.ones(17, 17 + comm.rank)))
    t = torch.ones(3, dtype=torch.int32 if comm.rank % 2 == 0 else torch.float32)
    raises_everywhere(comm, RuntimeError, lambda: hvd.allgather(t))
    h = hvd.allgather_async(torch.ones(2), name="dup")
    raises_everywhere(comm, ValueError, lambda: hvd.allgather_async(torch.ones(2), name="dup"))
    hvd.synchronize(h)


def test_allgather_gradients_and_process_sets(comm):
    sizes = [3, 2, 7, 4, 6, 8, 10][:comm.size]
    for dtype, dim in itertools.product([torch.float32, torch.float64], [1, 2, 3]):
        tensor = (torch.ones([sizes[comm.rank]] + [17] * (dim - 1)) * comm.rank).to(dtype).requires_grad_()
        grad_ys = torch.cat([torch.ones([s] + [17] * (dim - 1), dtype=dtype) * r for r, s in enumerate(sizes)])
        hvd.allgather(tensor).backward(grad_ys)
        same(comm, tensor.grad, torch.ones([sizes[comm.rank]] + [17] * (dim - 1), dtype=dtype) * comm.rank)
    evens, odds, mine = _even_odd_sets(comm)
    try:
        t = torch.ones(2, 3) * comm.rank
        same(comm, hvd.allgather(t, process_set=mine), torch.cat([torch.ones(2, 3) * r for r in mine.ranks]))
        tensors = [torch.ones(2, dtype=torch.float64).requires_grad_() for _ in range(2)]
        outs = hvd.grouped_allgather(tensors, process_set=mine)
        torch.autograd.backward(outs, [torch.arange(2.0 * mine.size(), dtype=torch.float64)] * 2)
        r = mine.rank()
        for t in tensors:
            same(comm, t.grad, torch.tensor([2.0 * r, 2.0 * r + 1], dtype=torch.float64), "grouped grad")
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


# -- broadcast -----------------------------------------------------------------------------------------
def test_broadcast_every_dtype_root_and_inplace(comm):
    for dtype, dim, root in itertools.product(ALL_TYPES, [1, 2, 3], range(comm.size)):
        tensor = (torch.ones([17] * dim) * comm.rank).to(dtype)
        root_tensor = (torch.ones([17] * dim) * root).to(dtype)
        out = hvd.broadcast(tensor, root)
        same(comm, out, root_tensor, f"broadcast {dtype} root {root}")
        same(comm, tensor, (torch.ones([17] * dim) * comm.rank).to(dtype), "input unchanged")
        out = hvd.broadcast_(tensor, root)
        assert_all_ranks(comm, out is tensor)
        same(comm, tensor, root_tensor, "inplace")


def test_broadcast_errors(comm):
    raises_everywhere(comm, RuntimeError, lambda: hvd.broadcast(torch.ones([17 + comm.rank] * 3), 0))
    t = torch.ones(17, dtype=torch.int32 if comm.rank % 2 == 0 else torch.float32)
    raises_everywhere(comm, RuntimeError, lambda: hvd.broadcast(t, 0))
    msg = raises_everywhere(comm, RuntimeError, lambda: hvd.broadcast(torch.ones(3), comm.rank, name="root"))
    assert_all_ranks(comm, "root_rank" in msg, msg)
    raises_everywhere(comm, ValueError, lambda: hvd.broadcast(torch.ones(3), comm.size))
    h = hvd.broadcast_async(torch.ones(2), 0, name="dup")
    raises_everywhere(comm, ValueError, lambda: hvd.broadcast_async(torch.ones(2), 0, name="dup"))
    hvd.synchronize(h)


def test_broadcast_gradients_and_process_sets_use_global_roots(comm):
    for dtype, root in itertools.product([torch.float32, torch.float64], range(comm.size)):
        tensor = (torch.ones(17, 17) * comm.rank).to(dtype).requires_grad_()
        hvd.broadcast(tensor, root).backward(torch.ones(17, 17, dtype=dtype))
        same(comm, tensor.grad, torch.ones(17, 17, dtype=dtype) * (1 if comm.rank == root else 0))
    evens, odds, mine = _even_odd_sets(comm)
    try:
        root = mine.ranks[-1]  # a global rank
        same(comm, hvd.broadcast(torch.ones(3) * comm.rank, root, process_set=mine), torch.ones(3) * root)
        other = next((r for r in range(comm.size) if r not in mine.ranks), None)
        if other is not None:
            raises_everywhere(comm, ValueError, lambda: hvd.broadcast(torch.ones(3), other, process_set=mine))
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


# -- alltoall ------------------------------------------------------------------------------------------
def _alltoall_input(comm, dim, dtype):
    vals = []
    for i in range(comm.size):
        vals += [i] * (comm.rank + 1)
    tensor = torch.tensor(vals, dtype=torch.float32)
    for _ in range(dim - 1):
        tensor = tensor.unsqueeze(1)
        tensor = torch.cat((tensor, tensor), dim=1)
    return tensor.to(dtype)


def test_alltoall_with_splits_every_dtype(comm):
    size, rank = comm.size, comm.rank
    for dtype, dim in itertools.product(ALL_TYPES, [1, 2, 3]):
        tensor = _alltoall_input(comm, dim, dtype)
        splits = torch.tensor([rank + 1] * size, dtype=torch.int32)
        collected, received = hvd.alltoall(tensor, splits)
        ok = _fp(collected).min() == rank and _fp(collected).max() == rank
        ok &= collected.numel() == size * (size + 1) // 2 * 2 ** (dim - 1) and collected.dtype == dtype
        ok &= received.dtype == torch.int32 and received.tolist() == [r + 1 for r in range(size)]
        assert_all_ranks(comm, bool(ok), f"alltoall {dtype} dim {dim}")
    out = hvd.alltoall(torch.arange(size) * 1.0, splits=[1] * size)  # a list works too: still a pair
    assert_all_ranks(comm, isinstance(out, tuple) and out[1].tolist() == [1] * size)
    handle = hvd.alltoall_async(torch.arange(size) * 1.0)
    pair = hvd.synchronize(handle)
    assert_all_ranks(comm, isinstance(pair, tuple) and len(pair) == 2, "synchronize returns the pair")


def test_alltoall_equal_split_returns_the_tensor_alone(comm):
    size, rank = comm.size, comm.rank
    for dtype, dim in itertools.product(ALL_TYPES, [1, 2, 3]):
        collected = hvd.alltoall(_alltoall_input(comm, dim, dtype))
        ok = isinstance(collected, torch.Tensor) and collected.dtype == dtype
        ok = ok and _fp(collected).min() == rank and _fp(collected).max() == rank
        ok = ok and collected.numel() == size * (size + 1) // 2 * 2 ** (dim - 1)
        assert_all_ranks(comm, bool(ok), f"equal split {dtype} dim {dim}")


def test_alltoall_errors(comm):
    size = comm.size
    t = torch.empty(size, dtype=torch.int32 if comm.rank % 2 else torch.float32)
    raises_everywhere(comm, RuntimeError, lambda: hvd.alltoall(t))
    raises_everywhere(comm, ValueError, lambda: hvd.alltoall(torch.empty(size + 1)))
    ones = torch.ones(size, dtype=torch.int32)
    raises_everywhere(comm, ValueError, lambda: hvd.alltoall(torch.empty(size - 1), ones))
    raises_everywhere(comm, ValueError, lambda: hvd.alltoall(torch.empty(size), torch.empty(size)))
    shape = [2 * size] * 3
    shape[1] = 10 * (comm.rank + 1)
    raises_everywhere(comm, RuntimeError, lambda: hvd.alltoall(torch.ones(shape)))


def test_alltoall_gradients_and_process_sets(comm):
    size, rank = comm.size, comm.rank
    for dtype, dim in itertools.product([torch.float32, torch.float64], [1, 2, 3]):
        tensor = _alltoall_input(comm, dim, dtype).requires_grad_()
        splits = torch.tensor([rank + 1] * size, dtype=torch.int32)
        collected, _ = hvd.alltoall(tensor, splits)
        collected.backward(torch.ones(collected.shape, dtype=dtype))
        same(comm, tensor.grad, torch.ones(tensor.shape, dtype=dtype), f"alltoall grad {dtype}")
        tensor = torch.ones([size * 2] + [2] * (dim - 1), dtype=dtype).requires_grad_()
        out = hvd.alltoall(tensor)
        out.backward(torch.ones(out.shape, dtype=dtype))
        same(comm, tensor.grad, torch.ones(tensor.shape, dtype=dtype), "equal split grad")
    evens, odds, mine = _even_odd_sets(comm)
    try:
        n = mine.size()
        sent = torch.arange(n, dtype=torch.float32) + 100 * rank
        out, received = hvd.alltoall(sent, [1] * n, process_set=mine)
        same(comm, out, torch.tensor([100.0 * r + mine.rank() for r in mine.ranks]), "set alltoall")
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


# -- reducescatter -------------------------------------------------------------------------------------
def _block(t, size, rank):
    base, extra = divmod(t.shape[0], size)
    start = rank * base + min(rank, extra)
    return t[start:start + base + (1 if rank < extra else 0)]


def test_reducescatter_sum_and_average_with_uneven_rows(comm):
    size, rank = comm.size, comm.rank
    for dtype, dim in itertools.product([torch.int32, torch.int64, torch.float16, torch.float32, torch.float64],
                                        [1, 2, 3]):
        tensor = _rand([size * 4] * dim, dtype)
        same(comm, hvd.reducescatter(tensor, op=hvd.Sum), (_block(tensor, size, rank) * size).to(dtype), "sum")
        same(comm, hvd.reducescatter(tensor, op=hvd.Average), _block(tensor, size, rank), "average")
    rows = size * 2 + 1  # the first rows % size ranks get one more
    out = hvd.reducescatter(torch.ones(rows, 3), op=hvd.Sum)
    assert_all_ranks(comm, out.shape[0] == 2 + (1 if rank < 1 else 0), f"rows {tuple(out.shape)}")


def test_reducescatter_prescale_postscale_and_async_fused(comm):
    size, rank = comm.size, comm.rank
    for dtype in [torch.int32, torch.int64, torch.float32, torch.float64]:
        np.random.seed(1234)
        factor = float(np.random.uniform())
        tensor = _rand([size * 4] * 2, dtype)
        math = torch.float64 if dtype in INT_TYPES else dtype
        pre = hvd.reducescatter(tensor, op=hvd.Sum, prescale_factor=factor)
        expected = (torch.tensor(factor, dtype=math) * tensor.to(math)).to(dtype) * size
        same(comm, pre, _block(expected, size, rank), f"prescale {dtype}")
        post = hvd.reducescatter(tensor, op=hvd.Sum, postscale_factor=factor)
        expected = ((size * tensor.to(math)) * torch.tensor(factor, dtype=math)).to(dtype)
        same(comm, post, _block(expected, size, rank), f"postscale {dtype}")
    tensors = [_rand([size * 4, 3], torch.float64, seed=s) for s in range(3)]
    outs = hvd.grouped_reducescatter(tensors, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    for t, o in zip(tensors, outs):
        close(comm, o, _block(t * 0.5 * size * 3.0, size, rank), "grouped pre/postscale", 1e-12)
    handles = [(hvd.reducescatter_async(_rand([size * 4, 3], d), op=hvd.Sum), d)
               for d in [torch.int32, torch.float32, torch.float64]]
    for h, d in handles:
        same(comm, hvd.synchronize(h), _block(_rand([size * 4, 3], d) * size, size, rank))


def test_reducescatter_errors(comm):
    raises_everywhere(comm, (RuntimeError, ValueError), lambda: hvd.reducescatter(torch.tensor(float(comm.rank))))
    raises_everywhere(comm, RuntimeError, lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum))
    raises_everywhere(comm, RuntimeError, lambda: hvd.reducescatter(torch.ones([17 + comm.rank] * 2)))
    t = torch.ones(8, dtype=torch.int32 if comm.rank % 2 == 0 else torch.float32)
    raises_everywhere(comm, RuntimeError, lambda: hvd.reducescatter(t))


def test_reducescatter_gradients_and_process_sets(comm):
    size = comm.size
    for dtype, op in itertools.product([torch.float32, torch.float64], [hvd.Sum, hvd.Average]):
        tensor = _rand([size * 4] * 2, dtype).requires_grad_()
        hvd.reducescatter(tensor, op=op).backward(torch.ones([4, size * 4], dtype=dtype))
        same(comm, tensor.grad, torch.ones([size * 4] * 2, dtype=dtype) * (size if op == hvd.Sum else 1))
        tensors = [_rand([size * 4, 2], dtype, seed=i).requires_grad_() for i in range(2)]
        outs = hvd.grouped_reducescatter(tensors, op=op)
        torch.autograd.backward(outs, [torch.ones(4, 2, dtype=dtype)] * 2)
        for t in tensors:
            same(comm, t.grad, torch.ones(size * 4, 2, dtype=dtype) * (size if op == hvd.Sum else 1))
    evens, odds, mine = _even_odd_sets(comm)
    try:
        every = [_rand([6, 2], torch.float64, seed=r) for r in range(size)]
        expected = sum(every[r] for r in mine.ranks)
        out = hvd.reducescatter(every[comm.rank], op=hvd.Sum, process_set=mine)
        same(comm, out, _block(expected, mine.size(), mine.rank()), "set reducescatter")
        outs = hvd.grouped_reducescatter([every[comm.rank]] * 2, op=hvd.Average, process_set=mine)
        for o in outs:
            close(comm, o, _block(expected / mine.size(), mine.size(), mine.rank()), "grouped set", 1e-12)
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


# -- objects, barrier, process sets --------------------------------------------------------------------
def test_objects_and_barriers(comm):
    obj = {"hello": 123, 0: [1, 2]} if comm.rank == 0 else None
    assert_all_ranks(comm, hvd.broadcast_object(obj, root_rank=0) == {"hello": 123, 0: [1, 2]})
    assert_all_ranks(comm, hvd.allgather_object({"rank": comm.rank}) == [{"rank": r} for r in range(comm.size)])
    evens, odds, mine = _even_odd_sets(comm)
    try:
        got = hvd.broadcast_object(comm.rank, root_rank=mine.ranks[0], process_set=mine)
        assert_all_ranks(comm, got == mine.ranks[0])
        assert_all_ranks(comm, hvd.allgather_object(comm.rank, process_set=mine) == mine.ranks)
        hvd.barrier(process_set=mine)
        handles = [hvd.allreduce_async(torch.ones(3), op=hvd.Sum) for _ in range(3)]
        hvd.barrier()
        for h in handles:
            same(comm, hvd.synchronize(h), torch.full((3,), float(comm.size)))
    finally:
        hvd.remove_process_set(evens)
        hvd.remove_process_set(odds)


def test_process_set_rules(comm):
    raises_everywhere(comm, ValueError, lambda: hvd.add_process_set(list(range(comm.size))), match="duplicate")
    ps = hvd.add_process_set([0])
    raises_everywhere(comm, ValueError, lambda: hvd.add_process_set(hvd.ProcessSet([0])), match="duplicate")
    ok = hvd.remove_process_set(ps) and ps.process_set_id is None and not hvd.remove_process_set(ps)
    ok &= not hvd.remove_process_set(hvd.global_process_set) and hvd.global_process_set.process_set_id == 0
    ok &= hvd.global_process_set.ranks == list(range(comm.size)) and hvd.global_process_set.rank() == comm.rank
    assert_all_ranks(comm, ok)
    raises_everywhere(comm, hvd.HorovodInternalError, lambda: hvd.add_process_set([comm.rank]), match="ranks")
    ps = hvd.add_process_set([0])  # the failed add left nothing behind
    hvd.remove_process_set(ps)


# -- join ----------------------------------------------------------------------------------------------
def test_join_with_allreduce_counts_joined_ranks_as_zeros(comm):
    size, rank = comm.size, comm.rank
    for dtype, dim, first, caching in itertools.product([torch.int32, torch.int64, torch.float32, torch.float64],
                                                        [1, 2], range(size), [False, True]):
        tensor_a = _rand([5] * dim, dtype)
        tensor_b = _rand([17] * dim, dtype, seed=4321)
        if caching:
            for h in [hvd.allreduce_async(tensor_a, name="a", average=True),
                      hvd.allreduce_async(tensor_b, name="b", average=True)]:
                hvd.synchronize(h)
        ok = True
        if rank == first:
            ret = hvd.join()
        else:
            ha = hvd.allreduce_async(tensor_a, name="a", average=True)
            hb = hvd.allreduce_async(tensor_b, name="b", average=True)
            averaged_a, averaged_b = hvd.synchronize(ha), hvd.synchronize(hb)
            ret = hvd.join()
            for t, avg in [(tensor_a, averaged_a), (tensor_b, averaged_b)]:
                expected = (t * (size - 1)).div(size, rounding_mode="trunc") if dtype in INT_TYPES \
                    else t * (size - 1) / size
                ok &= bool(torch.allclose(avg, expected, rtol=0, atol=1e-6))
        assert_all_ranks(comm, ok, f"join allreduce {dtype} first={first}")
        rets = hvd.allgather_object(ret)
        assert_all_ranks(comm, ret != first and rets == [ret] * size, f"join returned {rets}, first {first}")


def test_join_makes_other_collectives_raise(comm):
    for first in range(comm.size):
        if comm.rank == first:
            ret = hvd.join()
        else:
            for fn in (lambda: hvd.allgather(torch.ones(3)), lambda r=first: hvd.broadcast(torch.ones(3), r),
                       lambda: hvd.reducescatter(torch.ones(8)), lambda: hvd.alltoall(torch.ones(comm.size))):
                try:
                    fn()
                    raise AssertionError("collective did not raise while a rank had joined")
                except hvd.HorovodInternalError as e:
                    assert "join" in str(e), e
            ret = hvd.join()
        rets = hvd.allgather_object(ret)
        assert_all_ranks(comm, ret != first and rets == [ret] * comm.size, f"{rets}")
