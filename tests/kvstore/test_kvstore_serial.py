"""One-process checks: the local store, the release order as data, argument errors, the stall abort."""

from __future__ import annotations

import textwrap

import pytest
import torch

from mpitrain import kvstore
from mpitrain.kvstore import KVStoreError
from mpitrain.kvstore._allreduce import Entry
from mpitrain.kvstore._sequencer import Sequencer
from tests.helpers import run_job


def _release_order(arrivals: list[str], keys: list[str]) -> list[tuple[str, int]]:
    seq = Sequencer()
    for k in keys:
        seq.add_key(k)
    out = []
    for k in arrivals:
        out += [(e.key, e.seq) for e in seq.arrive(Entry(k, torch.zeros(1), None))]
    return out + [(e.key, e.seq) for e in seq.flush()]


def test_sequencer_releases_the_same_order_for_any_arrival_order():
    keys = ["a", "b", "c", "d"]
    orders = [["a", "b", "c", "d", "a"], ["d", "c", "b", "a", "a"], ["b", "a", "a", "d", "c"],
              ["c", "a", "d", "a", "b"]]
    released = [_release_order(o, keys) for o in orders]
    assert released[0] == [("a", 0), ("b", 0), ("c", 0), ("d", 0), ("a", 1)]
    assert all(r == released[0] for r in released), released


def test_sequencer_releases_an_init_order_prefix_eagerly_and_holds_the_rest():
    seq = Sequencer()
    for k in (0, 1, 2):
        seq.add_key(k)
    assert [e.key for e in seq.arrive(Entry(0, torch.zeros(1), None))] == [0]
    assert seq.arrive(Entry(2, torch.zeros(1), None)) == []  # waits for key 1
    assert [e.key for e in seq.arrive(Entry(1, torch.zeros(1), None))] == [1, 2]
    assert seq.flush() == []


def test_local_store_semantics():
    kv = kvstore.create("local")
    assert (kv.type, kv.rank, kv.num_workers) == ("local", 0, 1)
    kv.init(["w", 3], [torch.ones(2), torch.zeros(2)])
    out = torch.empty(2)
    kv.pushpull("w", [torch.ones(2), torch.full((2,), 2.0)], out)  # two "devices" summed
    kv.wait("w")
    assert torch.equal(out, torch.full((2,), 3.0))
    kv.push(3, torch.full((2,), 4.0))
    kv.pull(3, out=out)
    assert torch.equal(out, torch.full((2,), 4.0))
    kv.set_optimizer(torch.optim.SGD([torch.zeros(1)], lr=0.5))
    kv.push(3, torch.ones(2))
    kv.pull(3, out)
    assert torch.equal(out, torch.full((2,), 3.5))
    kv.close()


def test_local_optimizer_states_round_trip(tmp_path):
    kv = kvstore.create("local")
    kv.init("w", torch.zeros(3))
    kv.set_optimizer(torch.optim.SGD([torch.zeros(1)], lr=1.0, momentum=0.5))
    kv.push("w", torch.ones(3))
    kv.save_optimizer_states(str(tmp_path / "s.pt"))
    kv.push("w", torch.ones(3))
    a = torch.empty(3)
    kv.pull("w", a)
    kv2 = kvstore.create("local")
    kv2.init("w", torch.full((3,), -1.0))
    kv2.set_optimizer(torch.optim.SGD([torch.zeros(1)], lr=1.0, momentum=0.5))
    kv2.load_optimizer_states(str(tmp_path / "s.pt"))
    kv2.push("w", torch.ones(3))
    b = torch.empty(3)
    kv2.pull("w", b)
    assert torch.equal(a, torch.full((3,), -2.5)) and torch.equal(b, torch.full((3,), -2.5))


@pytest.mark.parametrize("call, match", [
    (lambda kv: kvstore.create("nope"), "unknown kvstore type"),
    (lambda kv: kvstore.create("local", bogus=1), r"unknown option\(s\) \['bogus'\]; valid options: \['warn_after'"),
    (lambda kv: kvstore.create("local", warn_after=5, abort_after=1), "abort_after must be None or >= warn_after"),
    (lambda kv: kv.pushpull("missing", torch.zeros(2)), "not initialized"),
    (lambda kv: kv.pushpull("w", torch.zeros(3)), r"initialized as \(2,\)"),
    (lambda kv: kv.init("w", torch.zeros(2)), "already initialized"),
    (lambda kv: kv.init(1.5, torch.zeros(2)), "ints or strings"),
    (lambda kv: kv.pushpull(["w", "v"], [torch.zeros(2)]), "2 keys need a list of 2"),
    (lambda kv: kv.pull("w"), "pass `out`"),
    (lambda kv: kv.set_gradient_compression({"type": "fp16"}), "does not communicate"),
    (lambda kv: kv.set_optimizer(3), "set_optimizer takes"),
    (lambda kv: kv.save_optimizer_states("x"), "no optimizer set"),
])
def test_bad_input_raises_a_clear_error(call, match):
    kv = kvstore.create("local")
    kv.init(["w", "v"], [torch.zeros(2), torch.zeros(2)])
    with pytest.raises(KVStoreError, match=match):
        call(kv)


def test_closed_store_refuses_calls():
    kv = kvstore.create("local")
    kv.close()
    with pytest.raises(KVStoreError, match="closed"):
        kv.init("w", torch.zeros(1))


STALL_SCRIPT = textwrap.dedent("""
    import time, torch, mpitrain
    from mpitrain import kvstore
    comm = mpitrain.init()
    kv = kvstore.create("dist_sync_mpi", comm, warn_after=0.5, abort_after=2.0)
    if comm.rank == 0:
        kv.pushpull("never_on_1", torch.ones(3))
        kv.wait()
    else:
        time.sleep(60)
""")


def test_dist_sync_mpi_stall_abort_ends_the_job_naming_rank_and_key():
    proc = run_job(STALL_SCRIPT, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "'never_on_1' missing on ranks [1]" in out and "ending the job" in out, out


def test_fusion_groups_are_consecutive_same_dtype_and_bounded():
    from mpitrain.kvstore._coordinator import _fusion_groups

    def e(n, dt=torch.float32):
        return Entry("k", torch.zeros(n, dtype=dt), None)

    entries = [e(10), e(10), e(10, torch.float64), e(100), e(5), e(5), e(30)]
    groups = _fusion_groups(entries, limit=120)
    shapes = [[(x.buf.numel(), x.buf.dtype) for x in g] for g in groups]
    f32, f64 = torch.float32, torch.float64
    assert shapes == [[(10, f32), (10, f32)], [(10, f64)], [(100, f32)], [(5, f32), (5, f32)], [(30, f32)]]


def test_dist_sync_mpi_old_stall_option_names_warn_and_still_apply():
    from mpi4py import MPI

    from mpitrain.comm._mpi import MPICommunicator

    with pytest.warns(DeprecationWarning, match="'stall_timeout' is deprecated"):
        kv = kvstore.create("dist_sync_mpi", MPICommunicator(MPI.COMM_SELF), stall_timeout=0.5, stall_abort=2.0)
    try:
        assert (kv._policy.warn_after, kv._policy.abort_after) == (0.5, 2.0)
    finally:
        kv.close()


def test_a_real_type_error_in_a_constructor_propagates(monkeypatch):
    from mpitrain.kvstore._local import LocalStore

    def broken(self, comm=None, warn_after=60.0, abort_after=600.0):
        raise TypeError("a bug inside the constructor")

    monkeypatch.setattr(LocalStore, "__init__", broken)
    with pytest.raises(TypeError, match="a bug inside the constructor"):
        kvstore.create("local")


def test_every_type_is_a_kvstore_and_takes_the_stall_options():
    import importlib
    import inspect

    for name, where in kvstore.TYPES.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(f"mpitrain.kvstore.{module}"), cls_name)
        params = inspect.signature(cls).parameters
        assert issubclass(cls, kvstore.KVStore) and {"warn_after", "abort_after"} <= set(params), name


DECLARED_STALL_SCRIPT = textwrap.dedent("""
    import time, torch, mpitrain
    from mpitrain import kvstore
    comm = mpitrain.init()
    kv = kvstore.create("dist_sync_mpi", comm, warn_after=0.5, abort_after=2.0, lazy_thread=True)
    dp = mpitrain.DataParallel(torch.nn.Linear(4, 2), kvstore=kv, comm=comm)
    if comm.rank == 0:
        dp(torch.ones(3, 4)).sum().backward()   # its buckets wait for rank 1's, which never come
    else:
        time.sleep(600)  # longer than the test's timeout: only rank 0's stall abort ends the job in time
""")


def test_dist_sync_mpi_declared_path_stall_ends_the_job_with_the_stall_message():
    proc = run_job(DECLARED_STALL_SCRIPT, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    gave_up = [line for line in out.splitlines() if "dist_sync_mpi (declared)" in line and "gave up after" in line]
    assert gave_up and "aborting the job" in gave_up[0], out


def test_local_pushpull_only_key_holds_nothing_sums_and_refuses_pull():
    kv = kvstore.create("local")
    kv.init(["g", "w"], [torch.ones(4), torch.ones(2)], pushpull_only=True)
    held = kv.held_bytes()
    t = torch.arange(4.0)
    kv.pushpull("g", t)
    kv.wait()
    with pytest.raises(KVStoreError, match="pushpull_only"):
        kv.pull("g", torch.empty(4))
    with pytest.raises(KVStoreError, match="pushpull_only"):
        kv.push("w", torch.ones(2))
    kv.close()
    assert held == 0 and torch.equal(t, torch.arange(4.0))
