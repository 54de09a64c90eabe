"""`mpitrain bench memory`: a row is collective, and its "own" shares add up to one process's params + grads;
ZeRO's rows (`--zero`) count the model built inside the run."""

from __future__ import annotations

import argparse

import pytest

from mpitrain.bench.memory import Contender, contenders, fit_peak, zero_contenders
from tests.helpers import assert_all_ranks


@pytest.mark.mpi
def test_a_row_measures_every_rank_and_own_shares_add_up_to_one_process(comm):
    args = argparse.Namespace(width=32, depth=2 * comm.size, batch=4, micro_batches=2, steps=1, optimizer="sgd")
    row = Contender("model", "model", "meta", {"partitions": comm.size, "balance": "params"})
    model_grown, model_own = fit_peak(comm, row, args)
    ok = (len(model_grown) == comm.size and all(g > 0 for g in model_grown)
          and sum(model_own) == pytest.approx(1.0))  # the partitions' params + grads add up to one process's
    names = [r.name for r in contenders(comm.size)]
    ok = ok and names[0] == "data" and f"model P={comm.size} time meta" in names
    assert_all_ranks(comm, ok, f"model {model_grown} {model_own}, rows {names}")


@pytest.mark.mpi
def test_zero_rows_build_the_model_inside_the_measured_run_on_every_rank(comm):
    args = argparse.Namespace(width=32, depth=4, batch=8, micro_batches=2, steps=1, optimizer="adam")
    rows = {r.name: r for r in zero_contenders(comm.size)}
    grown, own = fit_peak(comm, rows["data zero=2"], args)
    # the trained model's parameters are whole on every rank (its gradients dropped): a quarter of the
    # reference's params + grads + Adam, counted as built in the run
    ok = len(grown) == comm.size and own == pytest.approx([0.25] * comm.size)
    ok = ok and rows["data zero=3"].target == 0.35 and rows["data zero=0"].target is None
    ok = ok and (f"hybrid P={comm.size // 2}xR=2 zero=2" in rows) == (comm.size >= 4 and comm.size % 2 == 0)
    assert_all_ranks(comm, ok, f"zero=2 {grown} {own}, rows {sorted(rows)}")


@pytest.mark.mpi
def test_lora_rows_freeze_the_weights_and_count_them_once(comm):
    """``--lora R``: the reference is the frozen weights once + the adapters' params, grads and Adam state;
    after data parallelism every rank holds the whole model and the adapters' gradients, nothing for the
    frozen weights' (a frozen weight with a gradient would add its bytes to "own")."""
    args = argparse.Namespace(width=32, depth=4, batch=8, micro_batches=2, steps=1, optimizer="adam", lora=2)
    rows = {r.name: r for r in zero_contenders(comm.size)}
    grown, own = fit_peak(comm, rows["data zero=0"], args)
    frozen, adapters = 4 * (32 * 32 + 32) * 4, 4 * (2 * 32 * 2) * 4  # bytes: depth x (W, b); depth x (A, B)
    want = (frozen + 2 * adapters) / (frozen + 4 * adapters)
    assert_all_ranks(comm, len(grown) == comm.size and own == pytest.approx([want] * comm.size), f"{grown} {own}")
