"""Probe B (vision / HPC users): what a user of ``fit`` expects, at 2, 3 and 4 ranks.

Evaluation under the strategies that keep a whole replica per rank (data, ZeRO, pipe-sgd) runs the model
as one process evaluates it, in eval mode: Dropout off (``eval_loss``/``eval_accuracy`` equal one
process's ``model.eval()`` of the trained model, float64) and BatchNorm's running statistics neither used
from the eval batch nor updated by it (the trained model's buffers are the ones a run without
``eval_data`` leaves). Before the fix the eval forward ran in training mode: dropout drew masks and every
eval batch moved the running statistics and ``num_batches_tracked``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mpitrain.fit import fit
from tests.helpers import assert_all_ranks, bitwise_equal

pytestmark = pytest.mark.mpi
STEPS = 3

STRATEGIES: dict[str, dict[str, Any]] = {
    "data": {"strategy": "data"},
    "data-zero1": {"strategy": "data", "zero": 1},
    "pipe-sgd": {"strategy": "pipe-sgd", "staleness": 1},
    "pipe-sgd-K2": {"strategy": "pipe-sgd"},
}


def net(dropout: bool) -> nn.Module:
    """A small CNN, float64: with Dropout (no BatchNorm: every rank's weights and buffers are equal), or with
    BatchNorm (no Dropout)."""
    torch.manual_seed(0)
    norm: nn.Module = nn.Dropout(0.5) if dropout else nn.BatchNorm2d(6)
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), norm, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(6, 4)).double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def data(size: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """`STEPS` training batches of 2 rows per rank, and an eval set of 13 rows (batches of 5: a short last one)."""
    g = torch.Generator().manual_seed(1)
    train = [(torch.randn(2 * size, 3, 8, 8, generator=g, dtype=torch.float64),
              torch.randint(0, 4, (2 * size,), generator=g)) for _ in range(STEPS)]
    ex = torch.randn(13, 3, 8, 8, generator=g, dtype=torch.float64)
    return train, ex, torch.randint(0, 4, (13,), generator=g)


def run(train, ex, ey, dropout: bool, options: dict[str, Any], evaluate: bool = True):
    kw = dict(eval_data=DataLoader(TensorDataset(ex, ey), batch_size=5), metrics=["accuracy"]) if evaluate else {}
    return fit(net(dropout), train, nn.CrossEntropyLoss(), sgd, progress=False, **kw, **options)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_eval_runs_in_eval_mode_dropout_off_as_one_process(comm, name):
    train, ex, ey = data(comm.size)
    result = run(train, ex, ey, True, STRATEGIES[name])
    model = result.model.eval()
    with torch.no_grad():
        out = model(ex)
    loss = float(nn.functional.cross_entropy(out, ey))
    acc = float((out.argmax(1) == ey).double().mean())
    got = (result.history[-1]["eval_loss"], result.history[-1]["eval_accuracy"])
    assert_all_ranks(comm, got == pytest.approx((loss, acc), rel=1e-12, abs=1e-12),
                     f"{name} on {comm.size} ranks: fit's (eval_loss, eval_accuracy) {got}, one process {(loss, acc)}")


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_eval_leaves_batchnorm_running_statistics_alone(comm, name):
    train, ex, ey = data(comm.size)
    evaluated = run(train, ex, ey, False, STRATEGIES[name]).model.state_dict()
    plain = run(train, ex, ey, False, STRATEGIES[name], evaluate=False).model.state_dict()
    tracked = int(evaluated["1.num_batches_tracked"])
    assert_all_ranks(comm, tracked == STEPS and bitwise_equal(evaluated, plain),
                     f"{name} on {comm.size} ranks: after eval num_batches_tracked {tracked} (steps {STEPS}); "
                     f"state equal to a run without eval_data: {bitwise_equal(evaluated, plain)}")


@pytest.mark.parametrize("name", ["data", "data-zero1"])
def test_data_batchnorm_model_is_the_same_on_every_rank_and_is_what_eval_scores(comm, name):
    """Under data each rank's forwards move its BatchNorm statistics by its own rows (DDP's state after a
    step); the next step would take rank 0's. The returned model and the evaluated one take rank 0's now:
    the same state on every rank, and ``eval_loss`` is one process's eval of it (before: each rank's
    share was scored with that rank's own statistics, and ``result.model`` differed between ranks).
    (pipe-sgd keeps each rank's buffers its own by design: docs/pipe-sgd.md.)"""
    train, ex, ey = data(comm.size)
    result = run(train, ex, ey, False, STRATEGIES[name])
    state = result.model.state_dict()
    rank0 = comm.broadcast_object(state if comm.rank == 0 else None)
    model = result.model.eval()
    with torch.no_grad():
        out = model(ex)
    loss = float(nn.functional.cross_entropy(out, ey))
    got = result.history[-1]["eval_loss"]
    assert_all_ranks(comm, bitwise_equal(state, rank0) and got == pytest.approx(loss, rel=1e-12),
                     f"{name} on {comm.size} ranks: state equal to rank 0's {bitwise_equal(state, rank0)}; "
                     f"eval_loss {got}, one process {loss}")
