"""The gradient reducer: every policy equals a plain reduction of the same buckets, buckets post in
registration order whatever the submission order, many in flight, every dtype, and a stall ends the job."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch

from mpitrain.comm.base import CommError
from mpitrain.comm.reducer import ReduceError, ReducePolicy, Reducer
from mpitrain.comm.ring import ring_allreduce
from tests.helpers import assert_all_ranks, bitwise_equal, run_job

MODES = [False, True]  # the caller posts, or one worker thread does


def _grads(rank: int, shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float64, seed: int = 0,
           integral: bool = False) -> list[torch.Tensor]:
    """This rank's tensors (different on every rank); `integral`: small whole numbers, whose sums are exact
    in any order, so reductions by different algorithms agree to the bit."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    out = []
    for s in shapes:
        t = torch.randint(-50, 50, s, generator=g) if integral else torch.randn(s, generator=g, dtype=torch.float64)
        out.append(t.to(dtype))
    return out


def _expected(comm, tensors: list[torch.Tensor], op: str) -> list[torch.Tensor]:
    """The plain blocking allreduce of each tensor (copies)."""
    return [comm.allreduce(t.clone(), op) for t in tensors]


# -- serial checks: local, before any message ------------------------------------------------------------

def test_a_policy_refuses_unknown_kinds_ops_codecs_and_a_codec_outside_compressed():
    for bad in [dict(kind="tree"), dict(op="max"), dict(kind="compressed", codec="zip"),
                dict(kind="flat", codec="int8"), dict(kind="ring", error_feedback=True), dict(chunk_bytes=0)]:
        with pytest.raises(CommError):
            ReducePolicy(**bad)  # type: ignore[arg-type]
    assert ReducePolicy("compressed", codec="int8", error_feedback=True).codec_obj.name == "int8"


# -- MPI -------------------------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("thread", MODES)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_flat_policy_equals_a_plain_allreduce_of_each_bucket_to_the_bit(comm, thread, op):
    shapes = [(5, 3), (7,), (2, 2, 2), (11,), (1,)]
    ts = _grads(comm.rank, shapes, integral=True)
    expected = _expected(comm, ts, op)
    buf = torch.cat([t.reshape(-1) for t in ts[:3]])  # the first bucket: views of one buffer (in place)
    views = [buf[0:15].view(5, 3), buf[15:22], buf[22:30].view(2, 2, 2)]
    red = Reducer(comm, ReducePolicy("flat", op=op), thread=thread)
    joined, copied = red.register(views), red.register(ts[3:])
    assert joined.in_place and not copied.in_place
    handles = [red.submit(copied), red.submit(joined)]  # out of order: posted joined first
    for h in handles:
        red.wait(h)
    red.close()
    ok = all(torch.equal(a, b) for a, b in zip(views + ts[3:], expected))
    assert_all_ranks(comm, ok, f"flat {op} thread={thread}")


@pytest.mark.mpi
@pytest.mark.parametrize("thread", MODES)
def test_ring_policy_equals_ring_allreduce_to_the_bit_and_a_plain_allreduce_within_rounding(comm, thread):
    ts = _grads(comm.rank, [(40,), (3, 7), (100,)], seed=1)
    ring = [ring_allreduce(comm, t.clone(), None, "avg", 64) for t in ts]
    plain = _expected(comm, ts, "avg")
    red = Reducer(comm, ReducePolicy("ring", op="avg", chunk_bytes=64), thread=thread)
    buckets = [red.register([t]) for t in ts]
    for b in reversed(buckets):
        red.submit(b)
    red.wait_all()
    red.close()
    ok = all(torch.equal(a, b) and torch.allclose(a, c, rtol=1e-12, atol=1e-12) for a, b, c in zip(ts, ring, plain))
    assert_all_ranks(comm, ok, f"ring thread={thread}")


@pytest.mark.mpi
@pytest.mark.parametrize("thread", MODES)
@pytest.mark.parametrize("codec", ["int8", "bf16-rne"])
def test_compressed_policy_with_error_feedback_equals_ring_allreduce_with_a_residual_over_rounds(comm, thread, codec):
    """Two buckets, three rounds: each bucket's residual carries its own compression error into its next
    round exactly as ring_allreduce's error_feedback argument does."""
    rounds = [_grads(comm.rank, [(50,), (30,)], dtype=torch.float32, seed=10 + k) for k in range(3)]
    res = [torch.zeros(50), torch.zeros(30)]
    want = [[ring_allreduce(comm, t.clone(), codec, "avg", 48, res[i]) for i, t in enumerate(ts)] for ts in rounds]
    red = Reducer(comm, ReducePolicy("compressed", op="avg", codec=codec, error_feedback=True, chunk_bytes=48),
                  thread=thread)
    bufs = [torch.zeros(50), torch.zeros(30)]
    buckets = [red.register([b]) for b in bufs]
    ok = True
    for ts, w in zip(rounds, want):
        for b, t in zip(bufs, ts):
            b.copy_(t)
        later = red.submit(buckets[1])  # held until bucket 0 is submitted
        red.wait(red.submit(buckets[0]))
        red.wait(later)
        ok = ok and all(torch.equal(b, x) for b, x in zip(bufs, w))
    red.close()
    ok = ok and all(torch.equal(red.residuals[i], res[i]) for i in range(2))
    assert_all_ranks(comm, ok, f"compressed {codec} thread={thread}")


@pytest.mark.mpi
def test_buckets_of_one_feedback_group_share_one_residual_from_one_bucket_to_the_next(comm):
    red = Reducer(comm, ReducePolicy("compressed", op="sum", codec="int8", error_feedback=True, chunk_bytes=48))
    a, b = torch.zeros(20), torch.zeros(20)
    ba, bb = red.register([a], feedback="g"), red.register([b], feedback="g")
    xa, xb = _grads(comm.rank, [(20,), (20,)], dtype=torch.float32, seed=3)
    one = torch.zeros(20)
    wa = ring_allreduce(comm, xa.clone(), "int8", "sum", 48, one)
    wb = ring_allreduce(comm, xb.clone(), "int8", "sum", 48, one)
    a.copy_(xa)
    b.copy_(xb)
    red.submit(ba)
    red.submit(bb)
    red.wait_all()
    assert_all_ranks(comm, torch.equal(a, wa) and torch.equal(b, wb) and torch.equal(red.residuals["g"], one),
                     "shared feedback group")


@pytest.mark.mpi
@pytest.mark.parametrize("thread", MODES)
def test_buckets_post_in_registration_order_whatever_order_each_rank_submits_them(comm, thread):
    """Equal-sized buckets submitted in a different order on every rank: posted in submission order,
    bucket i of one rank would be summed with bucket j of another and the sums would be wrong."""
    n = 6
    bufs = [torch.full((8,), float(100 * i + comm.rank), dtype=torch.float64) for i in range(n)]
    red = Reducer(comm, ReducePolicy("flat", op="sum"), thread=thread)
    buckets = [red.register([b]) for b in bufs]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(comm.rank)).tolist()
    for _round in range(2):
        for i, b in enumerate(bufs):
            b.fill_(100 * i + comm.rank)
        for i in order:
            red.submit(buckets[i])
        red.wait_all()
        ranks = sum(range(comm.size))
        ok = all(torch.equal(b, torch.full((8,), float(100 * i * comm.size + ranks), dtype=torch.float64))
                 for i, b in enumerate(bufs))
        assert_all_ranks(comm, ok, f"order {order} thread={thread}")
    red.close()


@pytest.mark.mpi
@pytest.mark.parametrize("thread", MODES)
@pytest.mark.parametrize("kind", ["flat", "ring"])
def test_many_buckets_in_flight_each_equal_a_plain_allreduce(comm, thread, kind):
    sizes = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    ts = _grads(comm.rank, [(n,) for n in sizes], integral=True)
    expected = _expected(comm, ts, "avg")
    red = Reducer(comm, ReducePolicy(kind, op="avg", chunk_bytes=256), thread=thread)
    handles = [red.submit(red.register([t])) for t in ts]  # every bucket before any wait
    for h in reversed(handles):
        red.wait(h)
    red.close()
    # sums of whole numbers are exact in any order; the average divides once: equal to the bit
    assert_all_ranks(comm, all(torch.equal(a, b) for a, b in zip(ts, expected)), f"{kind} thread={thread}")


@pytest.mark.mpi
@pytest.mark.parametrize("thread", MODES)
def test_buckets_of_every_reducible_dtype_in_one_round_equal_a_plain_allreduce(comm, thread):
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8]
    ts = [_grads(comm.rank, [(13,), (4, 3)], dtype=d, integral=True, seed=7) for d in dtypes]
    for group, d in zip(ts, dtypes):
        if d == torch.uint8:
            for t in group:
                t.copy_(torch.arange(t.numel()).reshape(t.shape) % 7)  # small non-negatives: no wrap
    expected = [_expected(comm, group, "sum") for group in ts]
    red = Reducer(comm, ReducePolicy("flat", op="sum"), thread=thread)
    buckets = [red.register(group) for group in ts]
    for b in buckets:
        red.submit(b)
    red.wait_all()
    red.close()
    ok = all(bitwise_equal(a, b) for group, want in zip(ts, expected) for a, b in zip(group, want))
    assert_all_ranks(comm, ok, f"dtypes thread={thread}")


@pytest.mark.mpi
def test_bad_buckets_and_a_bucket_submitted_twice_in_a_round_are_refused_locally(comm):
    red = Reducer(comm, ReducePolicy("ring"))
    refused = []
    for tensors in ([], [torch.zeros(2), torch.zeros(2, dtype=torch.float64)], [torch.zeros(2, dtype=torch.int64)]):
        try:
            red.register(tensors)
            refused.append(False)
        except CommError:
            refused.append(True)
    b = red.register([torch.zeros(3)])
    red.register([torch.zeros(3)])
    held = red.submit(b)  # round 1's bucket 0 is posted at once (a ring: it runs here, on every rank) ...
    early = red.submit(b)  # ... and round 2's is held for round 1's bucket 1
    errors = []
    for attempt in (lambda: red.submit(b), lambda: red.wait(early), red.wait_all):
        try:
            attempt()
            errors.append("")
        except CommError as e:
            errors.append(str(e))
    red.wait(held)
    assert_all_ranks(comm, all(refused), f"refused {refused}")
    assert_all_ranks(comm, "submitted twice" in errors[0] and "submitted first" in errors[1]
                     and "never submitted" in errors[2], f"errors {errors}")


@pytest.mark.mpi
def test_a_failed_reduction_on_the_worker_raises_reduce_error_in_wait_and_every_later_wait(comm):
    red = Reducer(comm.split(0), ReducePolicy("flat"), thread=True)
    bad = red.register([torch.zeros(4)])
    bad.flat = torch.zeros(4, 2)[:, 0]  # not contiguous: the backend refuses it locally on every rank
    ok_bucket = red.register([torch.zeros(4)])
    _assert_each_wait_raises(comm, red, [red.submit(bad), red.submit(ok_bucket)])


def test_a_rank_that_never_submits_makes_the_waiting_rank_warn_then_end_the_job_naming_the_bucket():
    t0 = time.monotonic()
    job = run_job("""
        import time
        import torch
        import mpitrain
        from mpitrain._utils.stall import StallPolicy
        from mpitrain.comm.reducer import Reducer, ReducePolicy

        comm = mpitrain.init()
        red = Reducer(comm, ReducePolicy("flat"), StallPolicy(warn_after=1.0, abort_after=2.0), thread=True)
        b = red.register([torch.zeros(1000)])
        if comm.rank == 1:
            time.sleep(60)
        red.wait(red.submit(b))
        print("rank", comm.rank, "completed")
    """, timeout=60)
    assert job.returncode != 0 and "completed" not in job.stdout, job.stdout + job.stderr
    assert re.search(r"reducer rank 0: still waiting after 1s for the reduction of bucket 0 \(1000 elements\)",
                     job.stderr), job.stderr[-2000:]
    assert "aborting the job" in job.stderr
    assert time.monotonic() - t0 < 40


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["flat", "ring"])
def test_the_blocking_form_reduces_scattered_tensors_like_a_plain_allreduce_and_refuses_to_jump_held_buckets(
        comm, kind):
    ts = _grads(comm.rank, [(3, 4), (9,), (2, 5)], integral=True, seed=11)
    expected = _expected(comm, ts, "sum")
    red = Reducer(comm, ReducePolicy(kind, op="sum", chunk_bytes=40))
    red.reduce(ts)  # three separate tensors: one flat copy, reduced, copied back
    ok = all(torch.equal(a, b) for a, b in zip(ts, expected))
    first, second = red.register([torch.zeros(2)]), red.register([torch.zeros(2)])
    red.submit(second)  # held for `first`
    try:
        red.reduce([torch.zeros(2)])
        refused = False
    except CommError:
        refused = True
    red.submit(first)
    red.wait_all()
    assert_all_ranks(comm, ok and refused, f"{kind}: equal {ok}, refused {refused}")


@pytest.mark.mpi
def test_a_flat_bucket_the_communicator_refuses_raises_at_submit_on_the_callers_thread(comm):
    red = Reducer(comm, ReducePolicy("flat", op="avg"))
    bucket = red.register([torch.zeros(4, dtype=torch.int64)])  # avg of integers: refused by the backend
    try:
        red.submit(bucket)
        raised = False
    except CommError:
        raised = True
    red.wait_all()  # nothing in flight: returns
    assert_all_ranks(comm, raised, "no CommError at submit")


# -- ordered ops: posted in call order on the same worker ------------------------------------------------

def _rows(comm, numel_per_rank: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + comm.rank)
    return torch.randn(comm.size, numel_per_rank, generator=g, dtype=torch.float64)


@pytest.mark.mpi
@pytest.mark.parametrize("thread", MODES)
def test_ordered_ops_equal_the_plain_collectives_to_the_bit(comm, thread):
    """post_allreduce / post_reduce_scatter / post_allgather, several in flight at once, against the
    communicator's blocking allreduce, reduce_scatter and allgather of the same float64 data."""
    red = Reducer(comm.split(0), ReducePolicy("flat", op="sum"), thread=thread)
    flat = _grads(comm.rank, [(37,)], seed=21)[0]
    rows = _rows(comm, 11, seed=22)
    out = torch.zeros(comm.size * 5, dtype=torch.float64)
    block = out[comm.rank * 5:(comm.rank + 1) * 5]
    block.copy_(torch.arange(5, dtype=torch.float64) + 10 * comm.rank)  # in place: this rank's block of out
    want_all = comm.allreduce(flat.clone(), "sum")
    want_rs = comm.reduce_scatter(rows.clone(), "sum")[0]
    want_ag = comm.allgather(block.clone())
    handles = [red.post_allreduce(flat), red.post_reduce_scatter(rows), red.post_allgather(block, out)]
    for h in reversed(handles):  # waited in any order
        red.wait(h)
    red.close()
    red.comm.free()
    a, r, g = (h.result for h in handles)
    ok = (a is flat and torch.equal(flat, want_all) and r is not None and torch.equal(r, want_rs)
          and g is out and torch.equal(out, want_ag) and handles[1].tensor is None)
    assert_all_ranks(comm, ok, f"thread={thread}")


@pytest.mark.mpi
@pytest.mark.parametrize("thread", MODES)
def test_rounds_and_ordered_ops_interleave_in_program_order_and_an_op_inside_an_open_round_is_refused(comm, thread):
    """Registered buckets submitted in a different order on every rank, with ordered ops of the same sizes
    between rounds: a bucket and an op swapped on one rank would sum different data, so every result
    checks the order. An op while a round is open is a local CommError, on every rank."""
    n = 4
    bufs = [torch.zeros(8, dtype=torch.float64) for _ in range(n)]
    red = Reducer(comm.split(0), ReducePolicy("flat", op="sum"), thread=thread)
    buckets = [red.register([b]) for b in bufs]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(comm.rank + 3)).tolist()
    ranks = float(sum(range(comm.size)))
    ok, refused = True, []
    for rnd in range(3):
        extra = torch.full((8,), 1000.0 * (rnd + 1) + comm.rank, dtype=torch.float64)
        rows = torch.full((comm.size, 8), 500.0 + rnd + comm.rank, dtype=torch.float64)
        before = red.post_allreduce(extra)  # between rounds: fine
        for i, b in enumerate(bufs):
            b.fill_(100 * i + comm.rank)
        for k, i in enumerate(order):
            red.submit(buckets[i])
            if k == 0:
                try:
                    red.post_allgather(torch.zeros(1, dtype=torch.float64),
                                       torch.zeros(comm.size, dtype=torch.float64))
                    refused.append(False)
                except CommError:
                    refused.append(True)
        after_round = red.post_reduce_scatter(rows)
        red.wait_all()
        ok = ok and torch.equal(extra, torch.full((8,), 1000.0 * (rnd + 1) * comm.size + ranks, dtype=torch.float64))
        ok = ok and all(torch.equal(b, torch.full((8,), 100.0 * i * comm.size + ranks, dtype=torch.float64))
                        for i, b in enumerate(bufs))
        assert after_round.result is not None and before.finished
        ok = ok and torch.equal(after_round.result, torch.full((8,), (500.0 + rnd) * comm.size + ranks,
                                                               dtype=torch.float64))
    red.close()
    red.comm.free()
    assert_all_ranks(comm, ok and all(refused) and len(refused) == 3, f"order {order} thread={thread} "
                     f"equal {ok} refused {refused}")


@pytest.mark.mpi
def test_ordered_ops_refuse_bad_tensors_locally_before_any_message(comm):
    red = Reducer(comm, ReducePolicy("flat", op="sum"), thread=True)
    attempts = [lambda: red.post_allreduce(torch.zeros(4, 2)[:, 0]),
                lambda: red.post_reduce_scatter(torch.zeros(comm.size + 1, 3)),
                lambda: red.post_allgather(torch.zeros(3), torch.zeros(3 * comm.size + 1))]
    refused = []
    for attempt in attempts:
        try:
            attempt()
            refused.append(False)
        except CommError:
            refused.append(True)
    red.close()
    assert_all_ranks(comm, all(refused), f"refused {refused}")


@pytest.mark.mpi
def test_a_failed_ordered_op_on_the_worker_raises_reduce_error_in_its_wait_and_every_later_wait(comm):
    red = Reducer(comm.split(0), ReducePolicy("flat", op="avg"), thread=True)
    bad = red.post_reduce_scatter(torch.zeros(comm.size, 3, dtype=torch.int64))  # avg of integers: refused
    later = red.post_allgather(torch.zeros(2), torch.zeros(2 * comm.size))
    _assert_each_wait_raises(comm, red, [bad, later])


def test_a_rank_that_never_posts_its_ordered_op_makes_the_waiting_rank_warn_then_end_the_job():
    t0 = time.monotonic()
    job = run_job("""
        import time
        import torch
        import mpitrain
        from mpitrain._utils.stall import StallPolicy
        from mpitrain.comm.reducer import Reducer, ReducePolicy

        comm = mpitrain.init()
        red = Reducer(comm, ReducePolicy("flat"), StallPolicy(warn_after=1.0, abort_after=2.0), thread=True,
                      name="zero")
        if comm.rank == 1:
            time.sleep(60)
        red.wait(red.post_reduce_scatter(torch.zeros(comm.size, 500), what="zero.b3 reduce-scatter"))
        print("rank", comm.rank, "completed")
    """, timeout=60)
    assert job.returncode != 0 and "completed" not in job.stdout, job.stdout + job.stderr
    assert re.search(r"zero rank 0: still waiting after 1s for zero.b3 reduce-scatter", job.stderr), job.stderr[-2000:]
    assert "aborting the job" in job.stderr
    assert time.monotonic() - t0 < 40


# -- policy "hierarchical" ---------------------------------------------------------------------------------

def _hosts(comm, emulated: bool):
    """A duplicate MPI backend with its host hierarchy built here and counting the allreduces it runs:
    emulated, rank parity is the host (tests/multihost's trick: hosts {0, 2, ...} and {1, 3, ...}, so the
    real two-level path, reduce, leaders, broadcast, runs); else the real hosts (this machine: one)."""
    from mpitrain.comm._hierarchical import Hierarchy
    from mpitrain.comm._mpi import MPICommunicator

    class Counting(Hierarchy):
        calls = 0

        def allreduce(self, *args, **kwargs):
            self.calls += 1
            super().allreduce(*args, **kwargs)

    sub = MPICommunicator(comm.mpi_comm.Dup())
    sub._hierarchy = Counting(sub.mpi_comm, ring_comm=lambda c: MPICommunicator(c, hierarchy=False),
                              host_of=comm.rank % 2 if emulated else None)
    return sub, sub._hierarchy


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hosts", ["emulated", "one"])
@pytest.mark.parametrize("thread", MODES)
def test_hierarchical_policy_equals_a_plain_allreduce(comm, hosts, thread):
    """Every size goes through the hierarchy (a few elements, a 256 KiB-plus bucket, one above the leaders'
    ring threshold). Integer-valued float64 and int64: equal to the bit (exact sums in any order). Random
    float64: within 1e-12 relative, since the hierarchy sums per host first, then across hosts, a different
    order from the plain allreduce's. On one host: the two host stages only, still the plain result."""
    if comm.backend != "mpi":
        pytest.skip("the host hierarchy belongs to the mpi backend")  # same verdict on every rank
    from mpitrain.comm._hierarchical import HIERARCHY_ABOVE, RING_ABOVE

    sub, hierarchy = _hosts(comm, hosts == "emulated")
    sizes = [(5,), (HIERARCHY_ABOVE // 8 + 3,), (2 * RING_ABOVE // 8 + 1,)]
    exact = _grads(comm.rank, sizes, integral=True, seed=31) + _grads(comm.rank, [(9,)], torch.int64, 32, True)
    rough = _grads(comm.rank, sizes, seed=33)
    want_exact = _expected(comm, exact, "sum")
    want_rough = _expected(comm, rough, "avg")
    red_sum = Reducer(sub, ReducePolicy("hierarchical", op="sum"), thread=thread)
    red_avg = Reducer(sub, ReducePolicy("hierarchical", op="avg"), thread=thread)
    for red, ts in ((red_sum, exact), (red_avg, rough)):
        for t in ts:
            red.submit(red.register([t]))
        red.wait_all()
        red.close()
    counted, calls = hierarchy.hosts, hierarchy.calls
    sub.free()
    ok_exact = all(torch.equal(a, b) for a, b in zip(exact, want_exact))
    ok_rough = all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(rough, want_rough))
    want_hosts = min(2, comm.size) if hosts == "emulated" else 1
    ok_path = counted == want_hosts and calls == len(exact) + len(rough)  # every bucket, small ones too
    assert_all_ranks(comm, ok_exact and ok_rough and ok_path,
                     f"{hosts} thread={thread}: exact {ok_exact} rough {ok_rough} hosts {counted} calls {calls}")


@pytest.mark.mpi
def test_hierarchical_policy_is_refused_without_the_mpi_backend_and_needs_no_floating_buckets(comm):
    """On the MPI backend an int32 bucket is summed exactly; on any other backend (the torch backend run of
    tests/comm in `make test`) the real communicator is refused at construction, before any message."""
    sub = comm.split(0)
    try:
        red = Reducer(sub, ReducePolicy("hierarchical", op="sum"))
    except CommError as e:
        sub.free()
        refused = comm.backend != "mpi" and "MPI backend" in str(e)
        assert_all_ranks(comm, refused, f"{comm.backend} backend: {e}")
        return
    t = torch.full((6,), comm.rank + 1, dtype=torch.int32)  # integers are fine: no ring codec involved
    red.reduce([t])
    sub.free()
    ok = torch.equal(t, torch.full((6,), sum(r + 1 for r in range(comm.size)), dtype=torch.int32))
    assert_all_ranks(comm, comm.backend == "mpi" and ok, f"{comm.backend} backend: accepted, equal {ok}")


def _assert_each_wait_raises(comm: Any, red: Reducer, handles: list[Any]) -> None:
    """Every handle's wait raises ReduceError (the first failure and each later one), on every rank;
    then the reducer and its communicator are closed."""
    raised = []
    for h in handles:
        try:
            red.wait(h)
            raised.append(False)
        except ReduceError:
            raised.append(True)
    red.close()
    red.comm.free()
    assert_all_ranks(comm, all(raised), f"raised {raised}")
