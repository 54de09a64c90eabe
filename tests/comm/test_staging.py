"""The MPI backend's host-staging path (what CUDA tensors take when MPI is not CUDA-aware), forced for
CPU tensors: every call gives bitwise the results of the direct path, over real MPI."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm import DTYPES, split_sizes
from mpitrain.comm._mpi import SPLIT_ABOVE
from mpitrain.comm._staged import Staged
from mpitrain.comm.compose import layer_of, mpi_communicator
from tests.helpers import assert_all_ranks

pytestmark = pytest.mark.mpi

#: the floating and 32/64-bit integer dtypes, with every op they take (all other dtypes: test_dtypes.py)
COMMON = DTYPES[:6]

OPS = ("sum", "avg", "max", "min", "prod")


@pytest.fixture(scope="module")
def pair(comm):
    """(direct, staged): the world communicator and one that stages every tensor through host mirrors."""
    if comm.backend != "mpi":
        pytest.skip("host staging is the MPI backend's path")
    return comm, mpi_communicator(comm.mpi_comm, direct=frozenset())


def data(rank: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * rank + 31 * n + seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3
    return x.to(dtype) if dtype.is_floating_point else x.round().to(dtype)


def same(comm, a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    ok = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    assert_all_ranks(comm, ok, f"{what}: staged differs from direct")


@pytest.mark.parametrize("dtype", COMMON, ids=str)
def test_staged_allreduce_is_bitwise_the_direct_one(pair, dtype):
    direct, staged = pair
    for op in OPS:
        if op == "avg" and not dtype.is_floating_point:
            continue
        for n in (0, 1, 13, 1000):
            a, b = data(direct.rank, n, dtype), data(direct.rank, n, dtype)
            ptr = b.data_ptr()
            direct.allreduce(a, op)
            out = staged.allreduce(b, op)
            assert_all_ranks(direct, out is b and b.data_ptr() == ptr, "staged allreduce is in place")
            same(direct, a, b, f"allreduce {op} {dtype} n={n}")
            a, b = data(direct.rank, n, dtype, 1), data(direct.rank, n, dtype, 1)
            direct.iallreduce(a, op).wait()
            staged.iallreduce(b, op).wait()
            same(direct, a, b, f"iallreduce {op} {dtype} n={n}")


def test_a_split_of_a_staged_communicator_carries_the_staging_layer_and_is_bitwise_the_direct_split(pair):
    comm, staged = pair
    color = comm.rank % 2
    subs = [c.split(color, comm.rank) for c in (comm, staged)]
    layered = layer_of(subs[1], Staged) is not None and layer_of(subs[0], Staged) is None
    got = [s.allreduce(data(comm.rank, 1000, torch.float32)) for s in subs]
    for s in subs:
        s.free()
    same(comm, got[1], got[0], "allreduce on a split")
    assert_all_ranks(comm, layered, "the staged communicator's split must stage, the world's not")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_staged_allreduce_and_broadcast_of_a_large_tensor_piece_by_piece(pair, dtype):
    """Above SPLIT_ABOVE the staged path copies and reduces piece by piece (the direct path's pieces);
    bf16 goes whole through its float32 copy. Either way the bits of the direct path."""
    direct, staged = pair
    n = SPLIT_ABOVE // dtype.itemsize + 5
    for op in ("sum", "avg"):
        a, b = data(direct.rank, n, dtype), data(direct.rank, n, dtype)
        direct.allreduce(a, op)
        assert_all_ranks(direct, staged.allreduce(b, op) is b, "staged allreduce is in place")
        same(direct, a, b, f"large allreduce {op}")
    root = direct.size - 1
    a, b = data(direct.rank, n, dtype), data(direct.rank, n, dtype)
    direct.broadcast(a, root)
    staged.broadcast(b, root)
    same(direct, a, b, "large broadcast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_staged_broadcast_gather_scatter_alltoallv_are_the_direct_ones(pair, dtype):
    direct, staged = pair
    r, p = direct.rank, direct.size
    for root in range(p):
        a, b = data(r, 9, dtype), data(r, 9, dtype)
        direct.broadcast(a, root)
        staged.broadcast(b, root)
        same(direct, a, b, f"broadcast root={root}")
        a, b = data(r, 9, dtype), data(r, 9, dtype)
        direct.ibroadcast(a, root).wait()
        staged.ibroadcast(b, root).wait()
        same(direct, a, b, f"ibroadcast root={root}")
    x = data(r, 7, dtype).reshape(7, 1)
    same(direct, direct.allgather(x), staged.allgather(x.clone()), "allgather")
    for op in ("sum", "max"):
        x = data(r, 2 * p + 1, dtype)
        same(direct, direct.reduce_scatter(x.clone(), op), staged.reduce_scatter(x.clone(), op), f"reduce_scatter {op}")
    send_counts = split_sizes(5 + r, p)
    recv_counts = [split_sizes(5 + q, p)[r] for q in range(p)]
    x = data(r, 5 + r, dtype).reshape(-1, 1)
    same(direct, direct.alltoallv(x, send_counts, recv_counts), staged.alltoallv(x.clone(), send_counts, recv_counts),
         "alltoallv")


def test_staged_point_to_point_is_the_direct_one(pair):
    direct, staged = pair
    r, p = direct.rank, direct.size
    right, left = (r + 1) % p, (r - 1) % p
    expected = data(left, 11, torch.float32)
    got = torch.zeros(11)
    staged.sendrecv(data(r, 11, torch.float32), right, got, left, 3, 3)
    same(direct, got, expected, "sendrecv")
    got = torch.zeros(11)
    reqs = [staged.irecv(got, left, 4), staged.isend(data(r, 11, torch.float32), right, 4)]
    for q in reqs:
        q.wait()
    same(direct, got, expected, "isend/irecv")
    got = torch.zeros(11)
    if r % 2 == 0:  # even ranks send first: no cycle of blocking sends
        staged.send(data(r, 11, torch.float32), right, 5)
        staged.recv(got, left, 5)
    else:
        staged.recv(got, left, 5)
        staged.send(data(r, 11, torch.float32), right, 5)
    same(direct, got, expected, "send/recv")


def test_staged_paths_move_every_dtype_as_the_direct_ones(pair):
    """The host mirrors are dtype-agnostic: bool, unsigned, complex, float8 ... move bit for bit."""
    direct, staged = pair
    r, p = direct.rank, direct.size
    right, left = (r + 1) % p, (r - 1) % p
    bad = []
    for k, d in enumerate(DTYPES):
        def x(d: torch.dtype = d) -> torch.Tensor:  # a fresh copy each time (no clone kernel for int1 ... uint7)
            return data(r, 6 * d.itemsize, torch.float64).to(torch.int64).to(torch.uint8).view(d)

        got = torch.empty(6, dtype=d)
        reqs = [staged.irecv(got, left, 100 + k), staged.isend(x(), right, 100 + k)]
        for q in reqs:
            q.wait()
        want = direct.sendrecv(x(), right, torch.empty(6, dtype=d), left, 300 + k, 300 + k)
        a, b = direct.broadcast(x(), p - 1), staged.broadcast(x(), p - 1)
        if not (torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                and torch.equal(staged.allgather(x()).view(torch.uint8), direct.allgather(x()).view(torch.uint8))):
            bad.append(str(d))
    assert_all_ranks(direct, not bad, f"staged differs from direct for {bad}")


def test_staged_isends_to_one_peer_with_one_tag_arrive_in_the_order_sent(pair):
    """Staged isends are posted by a worker thread (the host copy waits for the tensor's producer off the
    caller's thread), in the order they were queued."""
    direct, staged = pair
    r, p = direct.rank, direct.size
    right, left = (r + 1) % p, (r - 1) % p
    got = [torch.zeros(1000) for _ in range(6)]
    recvs = [direct.irecv(g, left, 6) for g in got]  # posted in order: they match in order
    sends = [staged.isend(data(r, 1000, torch.float32, seed=k), right, 6) for k in range(6)]
    for q in sends + recvs:
        q.wait()
    assert_all_ranks(direct, all(q.test() for q in sends), "completed sends test true")
    for k, g in enumerate(got):
        same(direct, g, data(left, 1000, torch.float32, seed=k), f"message {k} in order")


def test_a_staged_isend_of_a_view_that_requires_grad_sends_its_data(pair):
    """A halo exchange sends, from inside an autograd Function's forward (no_grad), a rank's whole block:
    a view of an activation that requires grad. The staged-send thread runs with grad mode on; it must
    send the data (it failed to copy such a view, and the receiver waited forever)."""
    direct, staged = pair
    r, p = direct.rank, direct.size
    right, left = (r + 1) % p, (r - 1) % p
    weight = torch.ones(1, requires_grad=True)
    activation = data(r, 12, torch.float32).reshape(1, 3, 1, 4) * weight  # a layer's output
    with torch.no_grad():
        block = activation[..., 0:1, 0:4].contiguous()  # the view itself: it requires grad
        got = torch.zeros(1, 3, 1, 4)
        reqs = [direct.irecv(got, left, 8), staged.isend(block, right, 8)]
    assert_all_ranks(direct, block.requires_grad and block._is_view(), "the sent block is a view requiring grad")
    for q in reqs:
        q.wait()
    same(direct, got, data(left, 12, torch.float32).reshape(1, 3, 1, 4), "whole-block halo")


def test_staged_calls_refuse_bad_input_before_any_message(pair):
    _, staged = pair
    errors = []
    for call in (lambda: staged.allreduce(torch.zeros(4, device="meta")),
                 lambda: staged.allreduce(torch.zeros(4, 4).t()),
                 lambda: staged.allreduce(torch.zeros(4, dtype=torch.int32), "avg")):
        try:
            call()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - the message is the verdict
            errors.append(str(e))
    ok = ("is on device meta" in errors[0] and "move it there first" in errors[0]
          and "not contiguous" in errors[1] and "needs a floating dtype" in errors[2])
    assert_all_ranks(pair[0], ok, f"errors: {errors}")
