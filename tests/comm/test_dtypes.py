"""Every dtype torch has crosses the Communicator (point-to-point, broadcast, allgather, alltoallv), bit for bit
the values sent; each dtype reduces with exactly the ops of ``reduce_ops`` (compared with the same reduction in
one process), and any other op is refused with CommError on every rank before a message is sent."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm import DTYPES, CommError, reduce_ops, split_sizes
from tests.helpers import assert_all_ranks

pytestmark = pytest.mark.mpi

OPS = ("sum", "avg", "max", "min", "prod")
#: the six dtypes test_collectives reduces; here every other one with an op
REDUCED = [d for d in DTYPES[6:] if reduce_ops(d)]


def payload(rank: int, n: int, dtype: torch.dtype, tail: tuple[int, ...] = (2,), seed: int = 0) -> torch.Tensor:
    """Random bit patterns of `dtype` (bool: 0/1 bytes, the only valid ones), different per rank and size."""
    g = torch.Generator().manual_seed(7919 * rank + 31 * n + seed)
    count = n * int(torch.Size(tail).numel())
    top = 2 if dtype == torch.bool else 256
    raw = torch.randint(0, top, (count * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(n, *tail)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def check(comm, bad: list[str]) -> None:
    assert_all_ranks(comm, not bad, "; ".join(bad[:6]))


def test_every_dtype_moves_point_to_point_bit_for_bit(comm):
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    bad = []
    for k, d in enumerate(DTYPES):
        got = comm.sendrecv(payload(comm.rank, 7, d), right, torch.empty(7, 2, dtype=d), left, 2 * k, 2 * k)
        if not same_bits(got, payload(left, 7, d)):
            bad.append(f"sendrecv {d}")
        buf = torch.empty(5, 2, dtype=d)
        if comm.rank % 2 == 0:  # even ranks send first: no cycle of blocking sends
            comm.send(payload(comm.rank, 5, d), right, tag=2 * k + 1)
            comm.recv(buf, left, tag=2 * k + 1)
        else:
            comm.recv(buf, left, tag=2 * k + 1)
            comm.send(payload(comm.rank, 5, d), right, tag=2 * k + 1)
        if not same_bits(buf, payload(left, 5, d)):
            bad.append(f"send/recv {d}")
        into = torch.empty(3, 2, dtype=d)
        reqs = [comm.irecv(into, left, tag=1000 + k), comm.isend(payload(comm.rank, 3, d), right, tag=1000 + k)]
        for q in reqs:
            q.wait()
        if not same_bits(into, payload(left, 3, d)):
            bad.append(f"isend/irecv {d}")
    check(comm, bad)


def test_every_dtype_broadcasts_from_every_root(comm):
    bad = []
    for d in DTYPES:
        for root in range(comm.size):
            for n in (0, 1, 7):
                t = payload(comm.rank, n, d)
                comm.broadcast(t, root)
                u = payload(comm.rank, n, d, seed=1)
                comm.ibroadcast(u, root).wait()
                if not (same_bits(t, payload(root, n, d)) and same_bits(u, payload(root, n, d, seed=1))):
                    bad.append(f"{d} root={root} n={n}")
    check(comm, bad)


def test_every_dtype_allgathers_and_alltoallvs_rows_in_rank_order(comm):
    bad = []
    for d in DTYPES:
        for n in (0, 1, 3):
            out = comm.allgather(payload(comm.rank, n, d, (3,)))
            if not same_bits(out, torch.cat([payload(r, n, d, (3,)) for r in range(comm.size)])):
                bad.append(f"allgather {d} n={n}")
        scalar = payload(comm.rank, 1, d, ()).reshape(())
        if not same_bits(comm.allgather(scalar), torch.cat([payload(r, 1, d, ()) for r in range(comm.size)])):
            bad.append(f"allgather 0-d {d}")
        # rank s sends (s + q) % 3 rows to rank q: rows of a (5 + s)-row payload, blocks by split_sizes
        send = payload(comm.rank, 5 + comm.rank, d, (2,))
        send_counts = split_sizes(5 + comm.rank, comm.size)
        recv_counts = [split_sizes(5 + s, comm.size)[comm.rank] for s in range(comm.size)]
        out = comm.alltoallv(send, send_counts, recv_counts)
        mine = [payload(s, 5 + s, d, (2,))[sum(split_sizes(5 + s, comm.size)[:comm.rank]):][:recv_counts[s]]
                for s in range(comm.size)]
        if not same_bits(out, torch.cat(mine)):
            bad.append(f"alltoallv {d}")
    check(comm, bad)


def test_every_dtype_allgathers_from_a_block_of_out_that_is_not_its_own(comm):
    # the send block lies inside `out` but at another rank's place: the backend must send a copy of it
    # (int1 ... uint7 have no clone kernel: the copy is of its bytes)
    bad = []
    for d in DTYPES:
        out = torch.zeros(2 * comm.size, 3 * d.itemsize, dtype=torch.uint8).view(d)  # as payload builds its bits
        other = (comm.rank + 1) % comm.size
        src = out[2 * other:2 * other + 2]
        src.view(torch.uint8).copy_(payload(comm.rank, 2, d, (3,)).view(torch.uint8))
        try:
            comm.allgather(src, out=out)
        except Exception as e:  # noqa: BLE001 - reported as this dtype's failure, on every rank
            bad.append(f"{d}: {type(e).__name__}: {e}")
            continue
        if not same_bits(out, torch.cat([payload(r, 2, d, (3,)) for r in range(comm.size)])):
            bad.append(f"allgather from another block {d}")
    check(comm, bad)


def small(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small values whose sums and products are exact in `dtype` at up to 4 ranks."""
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_complex:
        re, im = torch.randint(-4, 5, (2, n), generator=g).double()
        return torch.complex(re, im).to(dtype)
    low = 0 if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else -2
    return torch.randint(low, low + 4, (n,), generator=g).to(dtype)


def reference(op: str, size: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The reduction in one process: integers in int64 then cast back (wrapping alike), complex in complex128."""
    if dtype == torch.bool:
        stack = torch.stack([small(r, n, dtype) for r in range(size)])
        return stack.any(0) if op == "max" else stack.all(0)
    wide = torch.complex128 if dtype.is_complex else torch.int64
    stack = torch.stack([small(r, n, dtype).to(wide) for r in range(size)])
    out = {"sum": lambda: stack.sum(0), "avg": lambda: stack.sum(0) / size, "max": lambda: stack.max(0).values,
           "min": lambda: stack.min(0).values, "prod": lambda: stack.prod(0)}[op]()
    return out.to(dtype)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_complex:  # avg rounds (complex32: in half precision)
        return a.dtype == b.dtype and torch.allclose(a.to(torch.complex128), b.to(torch.complex128), atol=2e-3)
    return same_bits(a, b)


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_reductions_of_each_dtype_match_one_process(comm, dtype):
    bad = []
    for op in reduce_ops(dtype):
        for n in (0, 1, 13):
            expected = reference(op, comm.size, n, dtype)
            a, b = small(comm.rank, n, dtype), small(comm.rank, n, dtype)
            out = comm.allreduce(a, op)
            comm.iallreduce(b, op).wait()
            if not (out is a and close(a, expected) and close(b, expected)):
                bad.append(f"allreduce/iallreduce {op} n={n}")
            rows = split_sizes(n, comm.size)
            start = sum(rows[:comm.rank])
            got = comm.reduce_scatter(small(comm.rank, n, dtype), op)
            if not close(got, expected[start:start + rows[comm.rank]]):
                bad.append(f"reduce_scatter {op} n={n}")
    check(comm, bad)


def test_uint64_max_min_and_wrapping_sum_use_all_64_bits(comm):
    """uint64 values above 2**63 (the torch backend reduces uint64 as int64 words: order must not break)."""
    def words(values: list[int]) -> torch.Tensor:
        return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64).view(
            torch.uint64)

    mine = [(1 << 64) - 1 - comm.rank, comm.rank, (1 << 63) + comm.rank]
    ranks = [[(1 << 64) - 1 - r, r, (1 << 63) + r] for r in range(comm.size)]
    cases = {"max": [max(c) for c in zip(*ranks)], "min": [min(c) for c in zip(*ranks)],
             "sum": [sum(c) % (1 << 64) for c in zip(*ranks)]}
    bad = [op for op, want in cases.items() if not same_bits(comm.allreduce(words(mine), op), words(want))]
    check(comm, bad)


def test_refused_reductions_raise_on_every_rank_before_any_message(comm):
    bad = []
    for d in DTYPES:
        for op in OPS:
            if op in reduce_ops(d):
                continue
            for call in (comm.allreduce, comm.iallreduce, comm.reduce_scatter):
                try:
                    call(torch.zeros(4, dtype=torch.uint8).view(d) if d.itemsize == 1 else
                         torch.zeros(4 * d.itemsize, dtype=torch.uint8).view(d), op)
                    bad.append(f"{call.__name__} {op} {d}: no error")
                except CommError as e:
                    if str(d) not in str(e) or op not in str(e):
                        bad.append(f"{call.__name__} {op} {d}: message {e}")
    # nothing was sent: the next collective still matches on every rank
    t = torch.ones(3)
    comm.allreduce(t)
    check(comm, bad + ([] if torch.equal(t, torch.full((3,), float(comm.size))) else ["desynchronised"]))


def test_quantized_tensors_are_refused_naming_the_way_out(comm):
    q = torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)
    try:
        comm.broadcast(q)
        ok, msg = False, "no error"
    except CommError as e:
        ok, msg = "int_repr" in str(e), str(e)
    assert_all_ranks(comm, ok, msg)
