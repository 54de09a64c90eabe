"""Ring allreduce: exact without a codec, bitwise-identical on every rank, per-hop codec error bounded."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm.base import CommError, split_sizes
from mpitrain.comm.codecs import CODECS, Int8Codec, get_codec
from mpitrain.comm.ring import chunk_bounds, ring_allreduce, ring_schedule
from tests.helpers import assert_all_ranks, assert_close_all_ranks


def _inputs(n: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(size)]


def _identical_everywhere(comm, t: torch.Tensor) -> bool:
    everyone = comm.allgather(t.reshape(1, -1).contiguous())
    return all(torch.equal(everyone[0].view(torch.int32), everyone[i].view(torch.int32))
               for i in range(comm.size))


def _simulate_ring(xs: list[torch.Tensor], codec_name: str, chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One-process ring: block b starts at rank b and is re-encoded at every hop; returns the result and
    the per-element bound (sum over the hops of half that hop's quantization step)."""
    p, codec = len(xs), get_codec(codec_name)
    n = xs[0].numel()
    result, bound = torch.empty(n), torch.zeros(n)
    for b, chunks in enumerate(chunk_bounds(n, p, max(1, chunk_bytes // 4))):
        for lo, hi in chunks:
            acc = xs[b][lo:hi].clone()
            for hop in range(1, p + 1):
                payload = codec.encode(acc)
                bound[lo:hi] += Int8Codec.scale_of(payload) / 2
                if hop == p:
                    codec.decode(payload, acc)
                else:
                    acc = codec.decode_add(payload, xs[(b + hop) % p][lo:hi].clone())
            result[lo:hi] = acc
    return result, bound


def test_schedule_sends_every_block_once_and_receives_what_the_left_neighbour_sends():
    for p in (2, 3, 4, 5):
        scheds = [ring_schedule(p, r) for r in range(p)]
        for r in range(p):
            rs = [s for s in scheds[r] if s.phase == "reduce-scatter"]
            ag = [s for s in scheds[r] if s.phase == "allgather"]
            assert sorted([s.send for s in rs] + [ag[0].send]) == list(range(p))
            assert ag[0].send == (r + 1) % p == rs[-1].recv  # the block reduced last is the owned one
            left = scheds[(r - 1) % p]
            assert all(mine.recv == theirs.send for mine, theirs in zip(scheds[r], left))


def test_chunk_bounds_cover_each_block_in_order_within_the_chunk_limit():
    for n, p, c in [(0, 3, 4), (2, 3, 1), (10, 3, 3), (1001, 4, 64), (7, 2, 100)]:
        blocks = chunk_bounds(n, p, c)
        flat = [b for blk in blocks for b in blk]
        assert [hi - lo for lo, hi in flat] and all(0 < hi - lo <= c for lo, hi in flat) or n == 0
        assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
        assert [sum(hi - lo for lo, hi in blk) for blk in blocks] == split_sizes(n, p)


@pytest.mark.mpi
@pytest.mark.parametrize("n,chunk_bytes", [(1, 4), (2, 8), (5, 8), (1001, 64), (4099, 1 << 18)])
def test_uncompressed_ring_equals_the_sum_and_is_bitwise_identical(comm, n, chunk_bytes):
    xs = _inputs(n, comm.size, seed=n)
    t = xs[comm.rank].clone()
    assert ring_allreduce(comm, t, chunk_bytes=chunk_bytes) is t
    expected = torch.stack(xs).double().sum(0)
    assert_close_all_ranks(comm, t, expected, atol=1e-5, rtol=1e-6, what="ring sum")
    assert_all_ranks(comm, _identical_everywhere(comm, t), "ranks differ")


@pytest.mark.mpi
@pytest.mark.parametrize("n,chunk_bytes", [(1, 4), (5, 8), (1001, 64)])
def test_addends_give_bitwise_the_ring_of_the_presummed_tensor(comm, n, chunk_bytes):
    """`addends` (added chunk by chunk inside the ring) = adding them first, then the plain ring."""
    xs = _inputs(n, 3 * comm.size, seed=7 * n)
    mine, others = xs[3 * comm.rank], xs[3 * comm.rank + 1: 3 * comm.rank + 3]
    t = mine.clone()
    ring_allreduce(comm, t, chunk_bytes=chunk_bytes, addends=others)
    ref = mine.clone()
    for a in others:
        ref.add_(a)
    ring_allreduce(comm, ref, chunk_bytes=chunk_bytes)
    assert_all_ranks(comm, torch.equal(t, ref), f"addends differ from presumming: {t} vs {ref}")
    assert_close_all_ranks(comm, t, torch.stack(xs).double().sum(0), atol=1e-5, rtol=1e-6, what="ring sum")


@pytest.mark.mpi
@pytest.mark.parametrize("codec", [None, "int8"])
def test_napping_waits_give_bitwise_the_result_of_blocking_waits(comm, codec):
    xs = _inputs(1001, comm.size, seed=5)
    napping, blocking = xs[comm.rank].clone(), xs[comm.rank].clone()
    ring_allreduce(comm, napping, codec=codec, chunk_bytes=64, nap=1e-4)
    ring_allreduce(comm, blocking, codec=codec, chunk_bytes=64)
    assert_all_ranks(comm, torch.equal(napping, blocking), "napping waits changed the result")


@pytest.mark.mpi
@pytest.mark.parametrize("n,chunk_bytes,codec", [(1, 4, None), (2, 8, None), (1001, 64, None), (1001, 64, "int8")])
def test_on_final_reports_every_element_once_already_holding_its_result(comm, n, chunk_bytes, codec):
    """`on_final(lo, hi)` covers each element exactly once, and the range holds then what it holds at the end."""
    xs = _inputs(n, 2 * comm.size, seed=11 * n)
    t, other = xs[2 * comm.rank].clone(), xs[2 * comm.rank + 1]
    seen, times = torch.full_like(t, float("nan")), torch.zeros(n, dtype=torch.int64)

    def on_final(lo: int, hi: int) -> None:
        seen[lo:hi] = t[lo:hi]
        times[lo:hi] += 1

    ring_allreduce(comm, t, codec=codec, chunk_bytes=chunk_bytes, addends=[other], on_final=on_final)
    assert_all_ranks(comm, bool((times == 1).all()), f"elements reported {times.unique().tolist()} times")
    assert_all_ranks(comm, torch.equal(seen, t), "a range reported final changed afterwards")


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 7, 1001])
def test_int8_ring_matches_one_process_ring_and_stays_within_the_sum_of_half_steps(comm, n):
    xs = [x * 10 ** (i % 3) for i, x in enumerate(_inputs(n, comm.size, seed=3 * n))]
    t = xs[comm.rank].clone()
    ring_allreduce(comm, t, codec="int8", chunk_bytes=40)
    simulated, bound = _simulate_ring(xs, "int8", 40)
    exact = torch.stack(xs).double().sum(0)
    err = (t.double() - exact).abs()
    assert_all_ranks(comm, bool((err <= bound.double() * (1 + 1e-4) + 1e-6).all()),
                     f"int8 error {err.max().item():.3g} exceeds bound")
    assert_close_all_ranks(comm, t, simulated, atol=1e-5, rtol=1e-5, what="vs one-process ring")
    assert_all_ranks(comm, _identical_everywhere(comm, t), "ranks differ")


@pytest.mark.mpi
@pytest.mark.parametrize("name", [k for k in CODECS if k is not None])
def test_every_codec_gives_bitwise_identical_results_close_to_the_mean(comm, name):
    xs = _inputs(333, comm.size, seed=7)
    t = xs[comm.rank].clone()
    ring_allreduce(comm, t, codec=name, op="avg", chunk_bytes=256)
    expected = torch.stack(xs).double().mean(0)
    tol = {"bf16": 2 ** -6, "bf16-rne": 2 ** -7, "fp16": 2 ** -10, "int8": 2 / 127}[name]
    assert_close_all_ranks(comm, t, expected, atol=tol * 4, rtol=tol * 2, what=name)
    assert_all_ranks(comm, _identical_everywhere(comm, t), "ranks differ")


@pytest.mark.mpi
def test_error_feedback_carries_all_lost_mass_to_the_next_call(comm):
    """Sum over T calls of the outputs plus every rank's final residual equals T times the exact sum."""
    xs = _inputs(257, comm.size, seed=11)
    residual = torch.zeros(257)
    outputs = torch.zeros(257, dtype=torch.float64)
    for _ in range(5):
        t = xs[comm.rank].clone()
        ring_allreduce(comm, t, codec="int8", chunk_bytes=64, error_feedback=residual)
        outputs += t.double()
    residual_sum = comm.allgather(residual.view(1, -1).double()).sum(0)
    expected = 5 * torch.stack(xs).double().sum(0)
    assert_close_all_ranks(comm, outputs + residual_sum, expected, atol=1e-4, rtol=1e-5, what="EF mass")
    assert_all_ranks(comm, residual.abs().max().item() > 0, "int8 left no residual at all")


@pytest.mark.mpi
def test_bad_arguments_raise_on_every_rank_before_any_message(comm):
    cases = [dict(t=torch.zeros(4, 2).t(), kw={}), dict(t=torch.zeros(4), kw={"op": "max"}),
             dict(t=torch.zeros(4, dtype=torch.float64), kw={"codec": "bf16"}),
             dict(t=torch.zeros(4), kw={"error_feedback": torch.zeros(3)}),
             dict(t=torch.zeros(4), kw={"codec": "lz4"}), dict(t=torch.zeros(4), kw={"chunk_bytes": 0}),
             dict(t=torch.zeros(4), kw={"addends": [torch.zeros(3)]}),
             dict(t=torch.zeros(4), kw={"op": "avg", "on_final": lambda lo, hi: None}),
             dict(t=torch.zeros(4), kw={"nap": 0.0})]
    raised = []
    for case in cases:
        try:
            ring_allreduce(comm, case["t"], **case["kw"])
            raised.append(False)
        except CommError:
            raised.append(True)
    assert_all_ranks(comm, all(raised), f"not refused: {[c['kw'] for c, r in zip(cases, raised) if not r]}")


def test_ring_allreduce_former_stall_warning_s_name_warns_and_still_applies():
    from mpi4py import MPI

    from mpitrain.comm._mpi import MPICommunicator

    t = torch.ones(3)
    with pytest.warns(DeprecationWarning, match="'stall_warning_s' is deprecated.*'warn_after'"):
        ring_allreduce(MPICommunicator(MPI.COMM_SELF), t, stall_warning_s=5.0)
    assert torch.equal(t, torch.ones(3))
