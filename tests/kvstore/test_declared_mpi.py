"""dist_sync_mpi's declared order (declare_order): keys pushed in one fixed order each round go straight to the
gradient reducer, with no negotiation cycle, against closed-form float64 sums at any world size."""

from __future__ import annotations

import pytest
import torch

from mpitrain import kvstore
from mpitrain.kvstore import KVStoreError
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi

SIZES = [5, 1, 300, 17, 2, 64]  # one key per size: small and large buckets, declared in this order


def _value(rank: int, key: int, step: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * (key + 1) / 7 + 10 * rank + step / 3


def _sum(size: int, key: int, step: int, n: int) -> torch.Tensor:
    return sum(_value(r, key, step, n) for r in range(size))


def _declared_store(comm, **options):
    kv = kvstore.create("dist_sync_mpi", comm, lazy_thread=True, **options)
    keys = [f"b{i}" for i in range(len(SIZES))]
    bufs = [torch.zeros(n, dtype=torch.float64) for n in SIZES]
    kv.init(keys, bufs)
    kv.declare_order(keys, bufs)
    return kv, keys, bufs


def _rank_order(rank: int, n: int, step: int) -> list[int]:
    """A different submission order per rank and step (rotated, reversed on odd ranks)."""
    order = list(range(n))
    order = order[(rank + step) % n:] + order[:(rank + step) % n]
    return order[::-1] if rank % 2 else order


def test_declared_keys_sum_in_any_submission_order_without_a_negotiation_cycle(comm):
    kv, keys, bufs = _declared_store(comm)
    for step in range(3):
        for i in _rank_order(comm.rank, len(keys), step):
            bufs[i].copy_(_value(comm.rank, i, step, SIZES[i]))
            kv.pushpull(keys[i], bufs[i])
        kv.wait(keys if step % 2 else None)
        for i, n in enumerate(SIZES):
            # the same sum as one process adding every rank's value (float64: sums of a few terms)
            assert_close_all_ranks(comm, bufs[i], _sum(comm.size, i, step, n), atol=1e-12,
                                   what=f"declared key {keys[i]} step {step}")
    cycles, slots = kv.cycles, len(kv._slots)
    kv.close()
    # a real observable: the coordinator counts every negotiation cycle it runs; none ran, nothing cached
    assert_all_ranks(comm, cycles == 0 and slots == 0, f"{cycles} negotiation cycles, {slots} cache slots")


def test_declared_and_negotiated_keys_in_one_round(comm):
    kv, keys, bufs = _declared_store(comm)
    free = torch.full((3,), float(comm.rank))
    for step in range(2):
        for i in _rank_order(comm.rank, len(keys), step):
            bufs[i].copy_(_value(comm.rank, i, step, SIZES[i]))
            if i == comm.rank % len(keys):
                free.fill_(float(comm.rank + step))
                kv.pushpull("free", free)  # not declared: negotiated, interleaved differently per rank
            kv.pushpull(keys[i], bufs[i])
        kv.wait()
        expected = torch.full((3,), float(sum(range(comm.size)) + step * comm.size))
        assert_close_all_ranks(comm, free, expected, what=f"negotiated key step {step}")
        for i, n in enumerate(SIZES):
            assert_close_all_ranks(comm, bufs[i], _sum(comm.size, i, step, n), atol=1e-12, what=f"{keys[i]}")
    cycles = kv.cycles
    kv.close()
    assert_all_ranks(comm, cycles > 0, "the negotiated key ran no cycle")


def test_eager_store_declared_path_and_compression(comm):
    kv = kvstore.create("dist_sync_mpi", comm)  # the comm thread runs from construction (the default)
    bufs = [torch.zeros(40), torch.zeros(9)]
    kv.init([0, 1], bufs)
    kv.declare_order([0, 1], bufs)
    kv.set_gradient_compression({"type": "fp16"})  # after declaring: the declared keys take it too

    def value(rank: int, i: int) -> torch.Tensor:
        return (torch.arange(bufs[i].numel()) + 1) / 3 + rank / 7  # not exact in fp16

    for i in (1, 0) if comm.rank % 2 else (0, 1):
        bufs[i].copy_(value(comm.rank, i))
        kv.pushpull(i, bufs[i])
    kv.wait([0, 1])
    slots = len(kv._slots)
    kv.close()
    for i, t in enumerate(bufs):
        exact = sum(value(r, i).double() for r in range(comm.size))
        err = (t.double() - exact).abs().max().item()
        # fp16 at every hop: an error far above float32 rounding (so the codec ran), within fp16's bound
        assert_all_ranks(comm, 1e-4 < err < 0.05 * comm.size, f"key {i}: error {err} against the exact sum")
    assert_all_ranks(comm, slots == 0, f"declared keys reached the coordinator's cache: {slots} slots")


@pytest.mark.parametrize("case", ["order", "size", "not initialized", "dtype"])
def test_a_rank_declaring_differently_gets_the_error_on_every_rank_before_data_moves(comm, case):
    kv = kvstore.create("dist_sync_mpi", comm, lazy_thread=True)
    a, b = torch.zeros(4), torch.zeros(6)
    kv.init(["a", "b"], [a, b])
    keys, values = ["a", "b"], [a, b]
    odd = comm.rank == comm.size - 1
    if odd and case == "order":
        keys, values = ["b", "a"], [b, a]
    elif odd and case == "size":
        values = [a, torch.zeros(5)]
    elif odd and case == "not initialized":
        keys = ["a", "c"]
    elif odd and case == "dtype":
        values = [a, torch.zeros(6, dtype=torch.float64)]
    try:
        kv.declare_order(keys, values)
        msg = ""
    except KVStoreError as e:
        msg = str(e)
    cycles = kv.cycles
    # no data moved: the store is undeclared everywhere and still sums negotiated pushes
    a.fill_(1.0)
    kv.pushpull("a", a)
    kv.wait()
    kv.close()
    named = f"rank {comm.size - 1}" in msg and "declare_order" in msg
    assert_all_ranks(comm, named and cycles == 0, f"{case}: expected the error naming the rank, got {msg!r}")
    assert_close_all_ranks(comm, a, torch.full((4,), float(comm.size)), what="store usable after the error")


def test_pushpull_of_a_declared_key_with_another_tensor_is_refused_before_queueing(comm):
    kv, keys, bufs = _declared_store(comm)
    errors = []
    for call in (lambda: kv.pushpull(keys[0], bufs[0].clone()),
                 lambda: kv.pushpull(keys[0], bufs[0], torch.empty_like(bufs[0])),
                 lambda: kv.declare_order(keys, bufs)):
        try:
            call()
        except KVStoreError as e:
            errors.append(str(e))
    for i in range(len(keys)):  # a complete round still works after the refusals
        bufs[i].fill_(1.0)
        kv.pushpull(keys[i], bufs[i])
    try:
        kv.pushpull(keys[0], bufs[0])  # again before wait
    except KVStoreError as e:
        errors.append(str(e))
    kv.wait()
    kv.close()
    ok = len(errors) == 4 and "in place" in errors[0] and "already" in errors[2] and "again" in errors[3]
    assert_all_ranks(comm, ok, f"errors: {errors}")
    for t in bufs:
        assert_close_all_ranks(comm, t, torch.full_like(t, float(comm.size)), what="round after refusals")
