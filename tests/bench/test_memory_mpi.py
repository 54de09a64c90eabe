"""`mpitrain bench memory`: rows are collective, and "own" splits one process's params + grads."""

from __future__ import annotations

import argparse

import pytest

from mpitrain.bench.memory import Contender, contenders, fit_peak
from tests.helpers import assert_all_ranks


@pytest.mark.mpi
def test_rows_measure_every_rank_and_own_shares_add_up_to_one_process(comm):
    args = argparse.Namespace(width=32, depth=2 * comm.size, batch=4, micro_batches=2, steps=1, optimizer="sgd")
    rows = [Contender("data", "data", "cpu"),
            Contender("model", "model", "meta", {"partitions": comm.size, "balance": "params"})]
    (data_grown, data_own), (model_grown, model_own) = [fit_peak(comm, row, args) for row in rows]
    ok = (len(data_grown) == len(model_grown) == comm.size and all(g > 0 for g in data_grown + model_grown)
          and all(o == pytest.approx(0.5) for o in data_own)  # every rank: all gradients, no parameters
          and sum(model_own) == pytest.approx(1.0))  # the partitions' params + grads add up to one process's
    names = [r.name for r in contenders(comm.size)]
    ok = ok and names[0] == "data" and f"model P={comm.size} time meta" in names
    assert_all_ranks(comm, ok, f"data {data_grown} {data_own}, model {model_grown} {model_own}, rows {names}")
