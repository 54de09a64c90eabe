"""The dist_sync parameter server against closed-form sums and one-process optimizer steps."""

from __future__ import annotations

import pytest
import torch

from mpitrain import kvstore
from mpitrain.kvstore import KVStoreError
from tests.helpers import assert_all_ranks, assert_close_all_ranks, calls_recorded


def _store(comm, servers: int, **kw):
    if servers >= comm.size:
        pytest.skip(f"{servers} servers need more than {comm.size} ranks")
    return kvstore.create("dist_sync", comm, num_servers=servers, bigarray_bound=16, **kw)


def _grad(worker: int, step: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) + 100 * worker + step


@pytest.mark.mpi
@pytest.mark.parametrize("servers", [1, 2])
def test_dist_sync_push_pull_and_pushpull_give_the_sum_over_workers(comm, servers):
    kv = _store(comm, servers)
    ok, msg = isinstance(kv, kvstore.KVStore), "not a mpitrain.kvstore.KVStore"
    if kv.is_server:
        kv.serve()
    else:
        w, nw = kv.rank, kv.num_workers
        sizes = {"small": 5, "big": 37}  # big is split over the servers (bound 16)
        kv.init(list(sizes), [torch.full((n,), float(w + 7)) for n in sizes.values()])
        out = torch.empty(37)
        kv.pull("big", out)
        ok &= torch.equal(out, torch.full((37,), 7.0))
        for step in range(3):
            for k, n in sizes.items():
                kv.push(k, _grad(w, step, n))
            for k, n in sizes.items():
                got = torch.empty(n)
                kv.pull(k, got)
                exp = sum(_grad(v, step, n) for v in range(nw))
                if not torch.equal(got, exp):
                    ok, msg = False, f"step {step} key {k}: {got} vs {exp}"
        t = _grad(w, 9, 37)
        kv.pushpull("big", t)
        kv.wait()
        ok &= torch.equal(t, sum(_grad(v, 9, 37) for v in range(nw)))
        kv.close()
    assert_all_ranks(comm, ok, msg or "wrong value")


@pytest.mark.mpi
@pytest.mark.parametrize("servers", [1, 2])
def test_dist_sync_server_side_optimizer_matches_one_process(comm, servers, tmp_path_factory):
    kv = _store(comm, servers)
    ok, err = True, 0.0
    if kv.is_server:
        kv.serve()
    else:
        w, nw = kv.rank, kv.num_workers
        w0 = torch.linspace(-1, 1, 20)
        kv.init("w", w0)
        kv.set_optimizer(torch.optim.Adam([torch.zeros(1)], lr=0.05))
        ref = w0.clone()
        ref_opt = torch.optim.Adam([ref], lr=0.05)
        for step in range(3):
            kv.push("w", _grad(w, step, 20) / 50)
            ref.grad = sum(_grad(v, step, 20) / 50 for v in range(nw))
            ref_opt.step()
        got = torch.empty(20)
        kv.pull("w", got)
        err = (got - ref).abs().max().item()
        ok = err < 1e-6
        with pytest.raises(KVStoreError, match="use push"):
            kv.pushpull("w", got)
        path = str(tmp_path_factory.getbasetemp() / "opt_states.pt") if kv.rank == 0 else ""
        path = kv._ctl.broadcast_object(path)
        kv.save_optimizer_states(path)
        kv.load_optimizer_states(path)
        kv.push("w", _grad(w, 5, 20) / 50)
        ref.grad = sum(_grad(v, 5, 20) / 50 for v in range(nw))
        ref_opt.step()
        kv.pull("w", got)
        ok &= (got - ref).abs().max().item() < 1e-6
        kv.close()
    assert_all_ranks(comm, ok, f"max abs err {err}")


@pytest.mark.mpi
def test_dist_sync_worker_calls_on_a_server_rank_raise(comm):
    kv = _store(comm, 1)
    if kv.is_server:
        with pytest.raises(KVStoreError, match="server"):
            kv.push(0, torch.zeros(1))
        kv.serve()
    else:
        with pytest.raises(KVStoreError, match="not a dist_sync server|worker"):
            kv.serve()
        kv.close()
    assert_close_all_ranks(comm, torch.zeros(1), torch.zeros(1), what="reached the end")


@pytest.mark.mpi
@pytest.mark.parametrize("servers", [1, 2])
def test_dist_sync_pushpull_only_keys_keep_no_worker_copy_and_refuse_pull(comm, servers):
    """init(..., pushpull_only=True) on the parameter server: the workers keep no copy of the value (their
    held_bytes stay 0; a plain key counts), pushpull still gives the sum, and pull/push of such a key are
    refused on every worker before any request is sent (the next pushpull still pairs up)."""
    kv = _store(comm, servers)
    ok, msg = True, ""
    if kv.is_server:
        kv.serve()
    else:
        w, nw = kv.rank, kv.num_workers
        kv.init(["small", "big"], [torch.zeros(5), torch.zeros(37)], pushpull_only=True)
        bare = kv.held_bytes()
        kv.init("plain", torch.zeros(4))
        refused: list[str] = []
        with calls_recorded() as calls:  # the calls on every communicator of this (worker) process
            for op in (lambda: kv.pull("big", torch.empty(37)), lambda: kv.push("small", torch.zeros(5))):
                try:
                    op()
                    refused.append("")
                except KVStoreError as e:
                    refused.append(str(e))
        for step in range(2):
            t, u = _grad(w, step, 37), _grad(w, step, 5)
            kv.pushpull(["big", "small"], [t, u])
            kv.wait()
            ok &= torch.equal(t, sum(_grad(v, step, 37) for v in range(nw)))
            ok &= torch.equal(u, sum(_grad(v, step, 5) for v in range(nw)))
        ok &= bare == 0 and kv.held_bytes() == 16 and all("pushpull_only" in r for r in refused) and not calls
        msg = f"held {bare} B then {kv.held_bytes()} B, refusals {refused}, calls made by them {calls}"
        kv.close()
    assert_all_ranks(comm, ok, msg or "wrong sum")

