"""Communicator collectives against numpy references: every dtype, sizes 0, 1, odd, not a multiple of size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpitrain.comm import DTYPES, split_sizes
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi

#: the floating and 32/64-bit integer dtypes, with every op they take (all other dtypes: test_dtypes.py)
COMMON = DTYPES[:6]


LENGTHS = (0, 1, 7, 13)  # 13 and 7: odd, and not a multiple of 2, 3 or 4
FLOATS = [d for d in COMMON if d.is_floating_point]


def rank_data(rank: int, n: int, dtype: torch.dtype, shape_tail: tuple[int, ...] = ()) -> torch.Tensor:
    """Small integers (exact in every dtype, sums included) that differ by rank and position."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    return torch.randint(-4, 5, (n, *shape_tail), generator=g).to(dtype)


def reference(op: str, size: int, n: int, dtype: torch.dtype, tail: tuple[int, ...] = ()) -> torch.Tensor:
    stack = np.stack([rank_data(r, n, dtype, tail).double().numpy() for r in range(size)])
    out = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.max(0), "min": stack.min(0),
           "prod": stack.prod(0)}[op]
    return torch.from_numpy(out).to(dtype)


def tol(dtype: torch.dtype) -> float:
    return {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-6)


@pytest.mark.parametrize("dtype", COMMON, ids=str)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
def test_allreduce_matches_numpy_in_place(comm, dtype, op):
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg is refused for integer dtypes (tested below)")
    for n in LENGTHS:
        t = rank_data(comm.rank, n, dtype)
        ptr = t.data_ptr()
        out = comm.allreduce(t, op=op)
        assert_all_ranks(comm, out is t and t.data_ptr() == ptr, "allreduce must work in place")
        expected = reference(op, comm.size, n, dtype)
        assert_close_all_ranks(comm, t, expected, atol=tol(dtype) * max(1.0, expected.abs().max().item() if n else 1),
                               what=f"allreduce {op} {dtype} n={n}")


@pytest.mark.parametrize("dtype", COMMON, ids=str)
def test_broadcast_from_every_root(comm, dtype):
    for root in range(comm.size):
        for n in LENGTHS:
            t = rank_data(comm.rank, n, dtype, (2,))
            comm.broadcast(t, root=root)
            assert_close_all_ranks(comm, t, rank_data(root, n, dtype, (2,)), what=f"bcast root={root} n={n}")


@pytest.mark.parametrize("dtype", COMMON, ids=str)
def test_allgather_concatenates_in_rank_order(comm, dtype):
    for n in LENGTHS:
        out = comm.allgather(rank_data(comm.rank, n, dtype, (3,)))
        expected = torch.cat([rank_data(r, n, dtype, (3,)) for r in range(comm.size)])
        assert_close_all_ranks(comm, out, expected, what=f"allgather n={n}")
    scalar = comm.allgather(torch.tensor(comm.rank, dtype=dtype))
    assert_close_all_ranks(comm, scalar, torch.arange(comm.size).to(dtype), what="allgather of 0-d")


@pytest.mark.parametrize("dtype", COMMON, ids=str)
def test_allgather_into_out_also_in_place_from_this_ranks_block(comm, dtype):
    """``out=`` is filled and returned; a send tensor that is block `rank` of `out` (ZeRO's parameter
    buffers) gathers in place; a storage resized to nothing and back still takes it (ZeRO-3 frees it)."""
    n = 5
    expected = torch.cat([rank_data(r, n, dtype, (3,)) for r in range(comm.size)])
    out = torch.zeros(comm.size * n, 3, dtype=dtype)
    got = comm.allgather(rank_data(comm.rank, n, dtype, (3,)), out=out)
    assert_all_ranks(comm, got is out, "allgather(out=) returned another tensor")
    assert_close_all_ranks(comm, out, expected, what="allgather into out")
    flat = torch.zeros(comm.size * n, 3, dtype=dtype)
    flat.untyped_storage().resize_(0)
    flat.untyped_storage().resize_(comm.size * n * 3 * flat.element_size())
    block = flat[comm.rank * n:(comm.rank + 1) * n]
    block.copy_(rank_data(comm.rank, n, dtype, (3,)))
    comm.allgather(block, out=flat)
    assert_close_all_ranks(comm, flat, expected, what="allgather in place")
    flat.untyped_storage().resize_(0)  # MPI did not pin the storage
    with pytest.raises(Exception, match="out"):
        comm.allgather(rank_data(comm.rank, n, dtype, (3,)), out=torch.zeros(n, 3, dtype=dtype))


@pytest.mark.parametrize("dtype", COMMON, ids=str)
@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter_gives_this_ranks_block(comm, dtype, op):
    for n in LENGTHS:
        out = comm.reduce_scatter(rank_data(comm.rank, n, dtype, (2,)), op=op)
        full = reference(op, comm.size, n, dtype, (2,))
        start = sum(split_sizes(n, comm.size)[: comm.rank])
        expected = full[start:start + split_sizes(n, comm.size)[comm.rank]]
        assert_close_all_ranks(comm, out, expected, atol=tol(dtype) * 10, what=f"reduce_scatter {op} n={n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_alltoallv_routes_rows_by_counts(comm, dtype):
    # rank s sends (s + d) % 3 rows to rank d; row values encode (source, dest, index).
    def rows(s: int, d: int) -> torch.Tensor:
        k = (s + d) % 3
        return (torch.arange(k) + 100 * s + 10 * d).to(dtype).reshape(k, 1).expand(k, 2).contiguous()

    send = torch.cat([rows(comm.rank, d) for d in range(comm.size)])
    sc = [(comm.rank + d) % 3 for d in range(comm.size)]
    rc = [(s + comm.rank) % 3 for s in range(comm.size)]
    out = comm.alltoallv(send, sc, rc)
    expected = torch.cat([rows(s, comm.rank) for s in range(comm.size)])
    assert_close_all_ranks(comm, out, expected, what="alltoallv")


@pytest.mark.parametrize("dtype", COMMON, ids=str)
def test_ring_of_send_recv_and_sendrecv(comm, dtype):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    got = comm.sendrecv(rank_data(comm.rank, 7, dtype), right, torch.empty(7, dtype=dtype), left, 5, 5)
    assert_close_all_ranks(comm, got, rank_data(left, 7, dtype), what="sendrecv")
    # blocking send/recv without deadlock: even ranks send first
    buf = torch.empty(13, dtype=dtype)
    if comm.rank % 2 == 0:
        comm.send(rank_data(comm.rank, 13, dtype), right, tag=3)
        comm.recv(buf, left, tag=3)
    else:
        comm.recv(buf, left, tag=3)
        comm.send(rank_data(comm.rank, 13, dtype), right, tag=3)
    assert_close_all_ranks(comm, buf, rank_data(left, 13, dtype), what="send/recv")


@pytest.mark.parametrize("dtype", COMMON, ids=str)
def test_nonblocking_ops_complete_with_wait_and_test(comm, dtype):
    a = rank_data(comm.rank, 13, dtype)
    ra = comm.iallreduce(a, op="max")
    b = rank_data(comm.rank, 7, dtype)
    rb = comm.ibroadcast(b, root=comm.size - 1)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    recv = torch.empty(5, dtype=dtype)
    rr = comm.irecv(recv, left, tag=9)
    rs = comm.isend(rank_data(comm.rank, 5, dtype), right, tag=9)
    while not rr.test():
        pass
    assert_all_ranks(comm, ra.wait() is a and rb.wait() is b and rs.wait() is None and rr.test(), "returns")
    assert_close_all_ranks(comm, a, reference("max", comm.size, 13, dtype), what="iallreduce")
    assert_close_all_ranks(comm, b, rank_data(comm.size - 1, 7, dtype), what="ibroadcast")
    assert_close_all_ranks(comm, recv, rank_data(left, 5, dtype), what="irecv")


def test_iallreduce_avg_bf16_copies_back_on_wait(comm):
    t = rank_data(comm.rank, 13, torch.bfloat16)
    comm.iallreduce(t, op="avg").wait()
    assert_close_all_ranks(comm, t, reference("avg", comm.size, 13, torch.bfloat16), atol=5e-2, what="bf16 avg")


def test_split_forms_groups_by_color_ordered_by_key(comm):
    sub = comm.split(comm.rank % 2, key=comm.rank)
    members = [r for r in range(comm.size) if r % 2 == comm.rank % 2]
    assert_all_ranks(comm, sub.size == len(members) and sub.rank == members.index(comm.rank), "split rank/size")
    t = torch.tensor([float(comm.rank)])
    sub.allreduce(t)
    assert_close_all_ranks(comm, t, torch.tensor([float(sum(members))]), what="allreduce in sub-communicator")
    none = comm.split(None if comm.rank == 0 else 1)
    assert_all_ranks(comm, (none is None) == (comm.rank == 0), "color None joins no group")
    sub.free()


def test_bad_input_raises_naming_the_argument(comm):
    from mpitrain.comm import CommError

    cases = {
        "not contiguous": lambda: comm.allreduce(torch.zeros(4, 4).t()),
        "moves but does not reduce": lambda: comm.allreduce(torch.zeros(3, dtype=torch.float8_e4m3fn)),
        "not defined for argument 't' of dtype torch.bool": lambda: comm.allreduce(torch.zeros(3, dtype=torch.bool)),
        "must be a torch.Tensor": lambda: comm.broadcast([1, 2, 3]),
        "op 'avg' needs a floating dtype": lambda: comm.allreduce(torch.zeros(3, dtype=torch.int32), op="avg"),
        "supported ops": lambda: comm.allreduce(torch.zeros(3), op="xor"),
        "not a rank": lambda: comm.broadcast(torch.zeros(3), root=comm.size),
        "send_counts": lambda: comm.alltoallv(torch.zeros(3), [1] * (comm.size + 1), [1] * comm.size),
    }
    bad = []
    for needle, call in cases.items():
        try:
            call()
            bad.append(f"{needle}: no error")
        except CommError as e:
            if needle not in str(e):
                bad.append(f"{needle}: message was {e}")
    assert_all_ranks(comm, not bad, "; ".join(bad))


def test_use_after_free_is_refused(comm):
    from mpitrain.comm import CommError

    sub = comm.split(0)
    sub.free()
    try:
        sub.allreduce(torch.zeros(2))
        ok = False
    except CommError as e:
        ok = "freed" in str(e)
    assert_all_ranks(comm, ok, "use after free must raise CommError")


def test_init_twice_returns_the_same_world(comm):
    import mpitrain

    assert_all_ranks(comm, mpitrain.init() is comm and mpitrain.size() == comm.size and mpitrain.rank() == comm.rank
                     and 0 <= mpitrain.local_rank() < comm.size, "init() twice")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_allreduce_in_pieces_is_exact_and_in_place(comm, dtype, monkeypatch):
    """Large allreduces run as SEGMENT_BYTES pieces (MPI backend); the result must not notice."""
    from mpitrain.comm import _mpi as mpi

    monkeypatch.setattr(mpi, "SEGMENT_BYTES", 64)
    monkeypatch.setattr(mpi, "SPLIT_ABOVE", 64)  # the same on every rank
    for op in ("sum", "max"):
        a, b = rank_data(comm.rank, 103, dtype), rank_data(comm.rank, 103, dtype)
        comm.allreduce(a, op=op)
        comm.iallreduce(b, op=op).wait()
        expected = reference(op, comm.size, 103, dtype)
        assert_close_all_ranks(comm, a, expected, atol=tol(dtype) * 10, what=f"pieces {op}")
        assert_close_all_ranks(comm, b, expected, atol=tol(dtype) * 10, what=f"ipieces {op}")

