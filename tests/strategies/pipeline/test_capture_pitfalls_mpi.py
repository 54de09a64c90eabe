"""What a captured graph (strategy "model") must not silently get wrong about ordinary model code.

An fx-traced forward calling ``F.dropout(x, p, self.training)`` or ``F.batch_norm(..., training=self.training)``
records the flag it saw while tracing (True) as a constant: fit's eval under "model" still dropped out and
normalized with the batch's statistics (and updated the running ones). The partitions' eval switch now sets
those calls' flag too; fit's eval_loss equals one process's ``model.eval()`` loss of the trained model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpitrain.fit import fit
from tests.helpers import assert_all_ranks

pytestmark = pytest.mark.mpi

B = 8


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def batches(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(B, 6, generator=g, dtype=torch.float64), torch.randn(B, 3, generator=g, dtype=torch.float64))
            for _ in range(n)]


class FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(torch.tanh(self.a(x)), 0.5, self.training)
        x = F.dropout(torch.tanh(self.b(x)), p=0.5, training=self.training)
        return self.c(x)


class FunctionalBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)
        self.weight, self.bias = nn.Parameter(torch.ones(16)), nn.Parameter(torch.zeros(16))
        self.register_buffer("mean", torch.full((16,), 0.3))
        self.register_buffer("var", torch.full((16,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        x = F.batch_norm(self.b(x), self.mean, self.var, self.weight, self.bias, training=self.training)
        return self.c(torch.tanh(x))


def one_process_eval_loss(model: nn.Module, data) -> float:
    """fit's eval_loss computed in one process: the mean MSE over every eval row, in ``model.eval()``."""
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        return sum(F.mse_loss(model(x), y).item() * len(y) for x, y in data) / sum(len(y) for _, y in data)


@pytest.mark.parametrize("make", [FunctionalDropout, FunctionalBatchNorm])
def test_eval_of_functional_dropout_and_batch_norm_under_model_equals_model_eval(comm, make):
    torch.manual_seed(0)
    model = make().double()
    eval_data = batches(2, seed=2)
    result = fit(model, batches(2, seed=1), F.mse_loss, sgd, strategy="model", partitions=comm.size, micro_batches=2,
                 eval_data=eval_data, progress=False)
    got = result.history[-1]["eval_loss"]
    want = one_process_eval_loss(result.model, eval_data)
    assert_all_ranks(comm, abs(got - want) < 1e-12, f"{make.__name__}: eval_loss {got} vs model.eval() {want}")
