"""Every collective kvstore type against closed-form sums, at any world size, in any per-rank order."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from mpitrain import kvstore
from mpitrain.kvstore import KVStoreError
from tests.helpers import assert_all_ranks, assert_close_all_ranks

TYPES = ["funnel", "concurrent", "depchain", "dist_sync_mpi"]
#: fixture name -> (type, options); "depchain-inplace" is DataParallel's zero-copy depchain
VARIANTS = {**{t: (t, {}) for t in TYPES}, "depchain-inplace": ("depchain", {"copy_inputs": False})}


@pytest.fixture(params=list(VARIANTS))
def kv(request, comm):
    name, options = VARIANTS[request.param]
    store = kvstore.create(name, comm, **options)
    yield store
    store.close()


def _value(rank: int, key: int, step: int, n: int = 7) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * (key + 1) + 10 * rank + step


def _sum(size: int, key: int, step: int, n: int = 7) -> torch.Tensor:
    return sum(_value(r, key, step, n) for r in range(size))


@pytest.mark.mpi
def test_pushpull_in_place_is_the_sum_whatever_the_per_rank_order(kv, comm):
    keys = list(range(6))
    kv.init(keys, [torch.zeros(7) for _ in keys])
    for step in range(3):
        bufs = {k: _value(comm.rank, k, step) for k in keys}
        order = keys[comm.rank % len(keys):] + keys[:comm.rank % len(keys)]  # differs per rank
        if comm.rank % 2:
            order.reverse()
        for k in order:
            kv.pushpull(k, bufs[k])  # outs default to ins: in place
        kv.wait()
        for k in keys:
            assert_close_all_ranks(comm, bufs[k], _sum(comm.size, k, step), what=f"{kv.type} key {k}")


@pytest.mark.mpi
def test_pushpull_out_of_place_lists_and_string_keys(kv, comm):
    keys = ["w", "b"]
    kv.init(keys, [torch.zeros(7), torch.zeros(7, dtype=torch.float64)])
    ins = [_value(comm.rank, 0, 0), _value(comm.rank, 1, 0).double()]
    kept = [t.clone() for t in ins]
    outs = [torch.empty(7), torch.empty(7, dtype=torch.float64)]
    kv.pushpull(keys, ins, outs)
    kv.wait(keys)
    assert_close_all_ranks(comm, outs[0], _sum(comm.size, 0, 0), what="out w")
    assert_close_all_ranks(comm, outs[1], _sum(comm.size, 1, 0).double(), what="out b")
    assert_all_ranks(comm, all(torch.equal(a, b) for a, b in zip(ins, kept)), "inputs were modified")


@pytest.mark.mpi
def test_one_key_with_a_list_of_device_values_sums_them_first(kv, comm):
    kv.init(3, torch.zeros(7))
    parts = [_value(comm.rank, 3, 0), torch.ones(7)]
    out = torch.empty(7)
    kv.pushpull(3, parts, out)
    kv.wait(3)
    assert_close_all_ranks(comm, out, _sum(comm.size, 3, 0) + comm.size, what="device sum")


@pytest.mark.mpi
def test_repeated_pushpull_of_a_key_within_a_round_keeps_both_results(kv, comm):
    kv.init([0, 1], [torch.zeros(7), torch.zeros(7)])
    a, b, c = _value(comm.rank, 0, 0), _value(comm.rank, 0, 1), _value(comm.rank, 1, 0)
    seq = [(0, a), (0, b), (1, c)] if comm.rank % 2 == 0 else [(1, c), (0, a), (0, b)]
    for k, t in seq:
        kv.pushpull(k, t)
    kv.wait()
    for t, exp in ((a, _sum(comm.size, 0, 0)), (b, _sum(comm.size, 0, 1)), (c, _sum(comm.size, 1, 0))):
        assert_close_all_ranks(comm, t, exp, what="repeated key")


@pytest.mark.mpi
def test_init_takes_rank0_value_and_push_pull_store_the_sum(kv, comm):
    kv.init("p", torch.full((4,), float(comm.rank + 5)))
    out = torch.empty(4)
    kv.pull("p", out)
    assert_close_all_ranks(comm, out, torch.full((4,), 5.0), what="init value")
    kv.push("p", torch.full((4,), float(comm.rank)))
    kv.pull("p", out)
    assert_close_all_ranks(comm, out, torch.full((4,), float(sum(range(comm.size)))), what="pushed sum")


@pytest.mark.mpi
def test_set_optimizer_steps_the_stored_value_like_one_process(kv, comm):
    torch.manual_seed(0)
    w0 = torch.randn(5)
    kv.init("w", w0)
    kv.set_optimizer(torch.optim.SGD([torch.zeros(1)], lr=0.1, momentum=0.9))
    ref = w0.clone().requires_grad_(False)
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for step in range(3):
        grads = [torch.randn(5, generator=torch.Generator().manual_seed(100 * step + r))
                 for r in range(comm.size)]
        kv.push("w", grads[comm.rank])
        ref.grad = sum(grads)
        ref_opt.step()
    out = torch.empty(5)
    kv.pull("w", out)
    assert_close_all_ranks(comm, out, ref, atol=1e-6, what="optimizer-updated weight")


@pytest.mark.mpi
def test_broadcast_from_every_root(kv, comm):
    for root in range(comm.size):
        out = torch.empty(3)
        kv.broadcast(f"b{root}", torch.full((3,), float(comm.rank)), out, root_rank=root)
        assert_close_all_ranks(comm, out, torch.full((3,), float(root)), what=f"broadcast root {root}")


@pytest.mark.mpi
def test_init_with_different_shapes_raises_on_every_rank(kv, comm):
    with pytest.raises(KVStoreError, match="different keys/shapes"):
        kv.init("x", torch.zeros(2 + (comm.rank == 1)))


def _refusal(op) -> str:
    """The KVStoreError message `op` raised here ('' if it raised none)."""
    try:
        op()
    except KVStoreError as e:
        return str(e)
    return ""


@pytest.mark.mpi
def test_pushpull_only_keys_hold_no_value_sum_and_refuse_push_pull_broadcast(kv, comm):
    """init(..., pushpull_only=True), as DataParallel registers its buckets: the store's own accounting
    grows by nothing (a plain init grows it by the value), pushpull still sums, and push/pull/broadcast of
    such a key raise on every rank before anything moves: a plain key listed first is neither pushed nor
    broadcast (it keeps its init value), and the sums after the refusals are still right."""
    sizes = {"g0": 300, "g1": 5}
    bufs = {k: _value(comm.rank, i, 0, n) for i, (k, n) in enumerate(sizes.items())}
    kv.init(list(sizes), list(bufs.values()), pushpull_only=True)
    bare = kv.held_bytes()
    kv.init("w", torch.zeros(3))
    plain = kv.held_bytes() - bare
    ones = torch.ones(3) * (comm.rank + 1)
    refused = [_refusal(lambda: kv.pull("g0", torch.empty(300))),
               _refusal(lambda: kv.push(["w", "g1"], [ones, torch.zeros(5)])),
               _refusal(lambda: kv.broadcast(["w", "g1"], [ones, torch.zeros(5)], [torch.empty(3), torch.empty(5)]))]
    w = torch.empty(3)
    kv.pull("w", w)
    assert_close_all_ranks(comm, w, torch.zeros(3), what="plain key listed before a refused one")
    for step in range(2):
        for i, (k, n) in enumerate(sizes.items()):
            bufs[k].copy_(_value(comm.rank, i, step, n))
        kv.pushpull(list(sizes), list(bufs.values()))
        kv.wait(list(sizes))
        for i, (k, n) in enumerate(sizes.items()):
            assert_close_all_ranks(comm, bufs[k], _sum(comm.size, i, step, n), what=f"pushpull_only {k}")
    assert_all_ranks(comm, bare == 0 and plain == 12 and all("pushpull_only" in r for r in refused),
                     f"held {bare} B, plain key {plain} B, refusals {refused}")


@pytest.mark.mpi
def test_pushpull_only_differing_across_ranks_raises_on_every_rank(kv, comm):
    with pytest.raises(KVStoreError, match="different keys/shapes"):
        kv.init("x", torch.zeros(2), pushpull_only=comm.rank == comm.size - 1)


@pytest.mark.mpi
def test_rank_num_workers_and_type(kv, comm):
    assert_all_ranks(comm, (kv.rank, kv.num_workers) == (comm.rank, comm.size) and kv.type in TYPES,
                     f"{kv.rank} {kv.num_workers} {kv.type}")


@pytest.mark.mpi
def test_dist_sync_mpi_shape_mismatch_names_key_shapes_and_ranks_on_every_rank(comm):
    kv = kvstore.create("dist_sync_mpi", comm)
    t0 = time.monotonic()
    kv.pushpull("grad7", torch.zeros(2 + (comm.rank == comm.size - 1)))
    with pytest.raises(KVStoreError) as info:
        kv.wait()
    msg = str(info.value)
    last = comm.size - 1
    named = "'grad7'" in msg and f"rank {last}: shape [3]" in msg and "rank 0: shape [2]" in msg
    assert_all_ranks(comm, named, msg)
    assert_all_ranks(comm, time.monotonic() - t0 < 10, "mismatch took too long")
    kv.close()


@pytest.mark.mpi
def test_dist_sync_mpi_stall_warning_names_the_missing_rank(comm, caplog):
    kv = kvstore.create("dist_sync_mpi", comm, warn_after=0.3, abort_after=60)
    late = comm.size - 1
    t = torch.ones(4)
    with caplog.at_level(logging.WARNING, logger="mpitrain.kvstore"):
        if comm.rank == late:
            time.sleep(1.0)
        kv.pushpull("slowkey", t)
        kv.wait()
    kv.close()
    if comm.rank == 0:
        text = caplog.text
        ok = "stall" in text and "'slowkey'" in text and f"ranks [{late}]" in text
    else:
        ok, text = True, ""
    assert_all_ranks(comm, ok, f"warning missing or wrong: {text!r}")
    assert_close_all_ranks(comm, t, torch.full((4,), float(comm.size)), what="late sum")


@pytest.mark.mpi
def test_dist_sync_mpi_steady_state_uses_the_cache(comm):
    kv = kvstore.create("dist_sync_mpi", comm)
    ts = [torch.ones(3) for _ in range(4)]
    for _ in range(3):
        for i in (range(4) if comm.rank % 2 else reversed(range(4))):
            ts[i].fill_(1.0)
            kv.pushpull(i, ts[i])
        kv.wait()
    slots = len(kv._slots)
    kv.close()
    assert_all_ranks(comm, slots == 4, f"{slots} cache slots for 4 keys")
    for t in ts:
        assert_close_all_ranks(comm, t, torch.full((3,), float(comm.size)), what="cached sum")


@pytest.mark.mpi
@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_gradient_compression_stays_within_the_codec_error_bound(kv, comm, codec):
    kv.set_gradient_compression({"type": codec})
    n = 1000
    vals = [torch.rand(n, generator=torch.Generator().manual_seed(r)) * 2 - 1 for r in range(comm.size)]
    kv.init("g", torch.zeros(n))
    t = vals[comm.rank].clone()
    kv.pushpull("g", t)
    kv.wait()
    exact = sum(vals)
    p = comm.size
    # fp16: <= 2^-11 relative per encoding, p encodings; int8: <= half a step (max|partial| / 127) per hop
    atol = p * p / 254 if codec == "int8" else p * p * 2.0 ** -11
    assert_close_all_ranks(comm, t, exact, atol=atol, what=f"{codec} compressed sum")
    ref = comm.allgather(t.view(1, -1))
    assert_all_ranks(comm, all(torch.equal(ref[0], row) for row in ref), "ranks disagree bitwise")


@pytest.mark.mpi
def test_value_the_codec_cannot_encode_is_refused_before_queueing(kv, comm):
    kv.set_gradient_compression({"type": "bf16"})  # bf16 truncation takes float32 only
    kv.init("d", torch.zeros(4, dtype=torch.float64))
    with pytest.raises(KVStoreError, match="float32|must be"):
        kv.pushpull("d", torch.ones(4, dtype=torch.float64))
    kv.wait()


@pytest.mark.mpi
def test_a_failing_background_step_is_reraised_once_by_wait_on_every_rank(kv, comm):
    kv.init("f", torch.zeros(3))
    kv.set_optimizer(lambda params: torch.optim.SGD(params, lr=-1.0))  # fails when first built
    kv.push("f", torch.ones(3))
    with pytest.raises(ValueError, match="learning rate"):
        kv.wait()
    kv.wait()  # delivered once; the store still works
    out = torch.zeros(3)
    kv.pushpull("f", torch.ones(3), out)
    kv.wait()
    assert_close_all_ranks(comm, out, torch.full((3,), float(comm.size)), what="after the error")


@pytest.mark.mpi
def test_outputs_of_the_wrong_shape_are_refused_before_queueing(kv, comm):
    kv.init("o", torch.zeros(3))
    with pytest.raises(KVStoreError, match="every input and output"):
        kv.pushpull("o", torch.ones(3), [torch.zeros(3), torch.zeros(2)])


@pytest.mark.mpi
@pytest.mark.parametrize("num_comms, outstanding", [(3, 1), (2, 4)])
def test_concurrent_with_more_keys_than_communicators_keeps_a_common_order(comm, num_comms, outstanding):
    kv = kvstore.create("concurrent", comm, num_comms=num_comms, outstanding=outstanding)
    keys = list(range(7))
    kv.init(keys, [torch.zeros(7) for _ in keys])
    bufs = {k: _value(comm.rank, k, 0) for k in keys}
    for k in (keys if comm.rank % 2 else keys[::-1]):
        kv.pushpull(k, bufs[k])
    kv.wait()
    kv.close()
    for k in keys:
        assert_close_all_ranks(comm, bufs[k], _sum(comm.size, k, 0), what=f"key {k}")


@pytest.mark.mpi
def test_dist_sync_mpi_fuses_small_keys_and_keeps_every_sum(comm):
    kv = kvstore.create("dist_sync_mpi", comm, fusion_bytes=256)
    specs = {"a": (7, torch.float32), "b": (9, torch.float32), "c": (5, torch.float64),
             "big": (200, torch.float32), "d": (3, torch.float32)}
    ts = {k: (torch.arange(n, dtype=dt) + 1) * (comm.rank + 1) for k, (n, dt) in specs.items()}
    kv.pushpull(list(ts), list(ts.values()))  # first use: negotiated
    kv.wait()
    for k in ts:
        ts[k].copy_((torch.arange(specs[k][0], dtype=specs[k][1]) + 1) * (comm.rank + 1))
    for k in (list(ts) if comm.rank % 2 else list(ts)[::-1]):
        kv.pushpull(k, ts[k])  # steady state: cached, fused where small
    kv.wait()
    fused = [dt for dt, _device in kv._fusion]  # keyed by (dtype, device)
    kv.close()
    total = comm.size * (comm.size + 1) // 2
    for k, (n, dt) in specs.items():
        assert_close_all_ranks(comm, ts[k], (torch.arange(n, dtype=dt) + 1) * total, what=f"key {k}")
    assert_all_ranks(comm, torch.float32 in fused, f"no fusion buffer was used: {fused}")


@pytest.mark.mpi
def test_depchain_inplace_reduces_the_callers_buffer_and_copying_depchain_does_not(comm):
    inplace = kvstore.create("depchain", comm, copy_inputs=False)
    copying = kvstore.create("depchain", comm)
    results = []
    for kv in (inplace, copying):
        kv.init(0, torch.zeros(5))
        buf, out = _value(comm.rank, 0, 0, n=5), torch.zeros(5)
        if kv is inplace:
            kv.pushpull(0, buf)
        else:
            kv.pushpull(0, buf, out)
            buf.fill_(-1.0)  # the copying store took its copy already: the input may be reused at once
        kv.wait()
        results.append(buf.clone() if kv is inplace else out)
        kv.close()
    assert_close_all_ranks(comm, results[0], _sum(comm.size, 0, 0, n=5), what="in-place sum")
    assert_close_all_ranks(comm, results[1], _sum(comm.size, 0, 0, n=5), what="copying sum")


@pytest.mark.mpi
def test_depchain_late_rank_warning_names_the_key(comm, capfd):
    kv = kvstore.create("depchain", comm, warn_after=0.2)
    kv.init("latekey", torch.zeros(3))
    late = comm.size - 1
    t = torch.ones(3)
    if comm.rank == late:
        time.sleep(0.8)
    kv.pushpull("latekey", t)
    kv.wait()
    kv.close()
    err = capfd.readouterr().err
    ok = comm.rank == late or ("still waiting" in err and "key 'latekey'" in err)
    assert_all_ranks(comm, ok, f"warning missing: {err!r}")
    assert_close_all_ranks(comm, t, torch.full((3,), float(comm.size)), what="late sum")


@pytest.mark.mpi
def test_dist_sync_mpi_idle_comm_thread_does_not_cycle_in_a_loop(comm, monkeypatch):
    from mpitrain.kvstore._coordinator import CoordinatorStore

    cycles = []
    real = CoordinatorStore._cycle
    monkeypatch.setattr(CoordinatorStore, "_cycle", lambda self: (cycles.append(1), real(self))[1])
    kv = kvstore.create("dist_sync_mpi", comm)
    t = torch.ones(4)
    kv.pushpull("k", t)
    kv.wait()
    before = len(cycles)
    time.sleep(0.5)
    idle = len(cycles) - before
    kv.close()
    # a rank with nothing queued joins a cycle only on a local push or every 50 ms (for the watchdog)
    assert_all_ranks(comm, idle <= 15, f"{idle} cycles in 0.5 s while idle")
    assert_close_all_ranks(comm, t, torch.full((4,), float(comm.size)), what="sum")


@pytest.mark.mpi
def test_a_buffer_larger_than_a_segment_is_summed_exactly_in_segments(kv, comm, monkeypatch):
    from mpitrain.comm import _mpi as mpi

    monkeypatch.setattr(mpi, "SEGMENT_BYTES", 64)
    monkeypatch.setattr(mpi, "SPLIT_ABOVE", 64)  # the same on every rank: 16 floats per allreduce
    kv.init(0, torch.zeros(103))
    t = _value(comm.rank, 0, 0, n=103)
    kv.pushpull(0, t)
    kv.wait()
    assert_close_all_ranks(comm, t, _sum(comm.size, 0, 0, n=103), what="segmented sum")
