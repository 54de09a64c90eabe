"""`mpitrain bench memory`: a row is collective, and its "own" shares add up to one process's params + grads."""

from __future__ import annotations

import argparse

import pytest

from mpitrain.bench.memory import Contender, contenders, fit_peak
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
