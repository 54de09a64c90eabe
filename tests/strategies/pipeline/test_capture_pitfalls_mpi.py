"""What a captured graph (strategy "model") must not silently get wrong about ordinary model code.

An fx-traced forward calling ``F.dropout(x, p, self.training)`` or ``F.batch_norm(..., training=self.training)``
records the flag it saw while tracing (True) as a constant: fit's eval under "model" still dropped out and
normalized with the batch's statistics (and updated the running ones). The partitions' eval switch now sets
those calls' flag too; fit's eval_loss equals one process's ``model.eval()`` loss of the trained model.

fx also ran ``self.count += 1`` / ``self.ema.mul_(0.9)`` (a buffer changed in place from no input) once while
tracing and recorded nothing: the captured model never counted (count 1 after 2 steps and 2 evals, one
process 4). Such a forward is now captured by torch.export, which keeps the update. A Python branch on
``self.training`` beyond the mode flags is computed in its training branch in eval too: fit warns (rank 0).
A ``torch.jit.script``-ed submodule was called by fx as an opaque object whose parameters no partition
held: they never trained (2e-3 off after 2 steps), silently; it is refused (FitError on every rank). A
buffer read by one partition and updated by another (at 3-4 partitions a.weight 7e-4 off, the EMA 0.16):
the cut keeps its reads and writes in one partition. Forward hooks on a non-leaf submodule,
weight_norm, spectral_norm and ``torch.compile(model)`` train as one
process (guards)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpitrain.fit import FitError, fit
from tests.helpers import assert_all_ranks, assert_close_all_ranks

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


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.c = nn.Linear(6, 16), nn.Linear(16, 3)
        self.blk = nn.Sequential(nn.Linear(16, 16), nn.Tanh())  # a non-leaf submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.blk(torch.tanh(self.a(x))))


class Counting(Base):
    """A step counter and an EMA of an activation, updated in place in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.count += 1
        self.ema.mul_(0.9).add_(h.mean().detach())
        return self.c(self.blk(h)) + 0.0 * self.ema


class ReadBeforeUpdate(Base):
    """A buffer read by the first layer and updated after the second: a partition between them read its
    own copy, which the writing partition's updates never reached."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blk(torch.tanh(self.a(x * self.scale)))
        self.scale.mul_(0.9)
        return self.c(h)


class TrainingBranch(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.training:
            h = h + 0.5
        return self.c(self.blk(h))


def forward_hook() -> nn.Module:
    model = Base()
    model.blk.register_forward_hook(lambda module, args, out: out * 2.0)
    return model


def forward_pre_hook() -> nn.Module:
    model = Base()
    model.blk.register_forward_pre_hook(lambda module, args: (args[0] + 1.0,))
    return model


def weight_norm() -> nn.Module:
    model = Base()
    nn.utils.parametrizations.weight_norm(model.a)
    return model


def spectral_norm() -> nn.Module:
    model = Base()
    nn.utils.parametrizations.spectral_norm(model.blk[0])  # its u/v buffers advance in every training forward
    return model


def one_process(model: nn.Module, data, eval_data) -> tuple[nn.Module, float]:
    """The training in one process (one SGD step per batch), then the eval forwards as fit runs them
    (a buffer the forward updates moves in eval too): the model and the mean eval loss."""
    model = copy.deepcopy(model).train()
    opt = sgd(model.parameters())
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        losses = [F.mse_loss(model(x), y).item() * len(y) for x, y in eval_data]
    return model, sum(losses) / sum(len(y) for _, y in eval_data)


def compiled() -> nn.Module:
    return torch.compile(Base().double())


@pytest.mark.parametrize("make", [Counting, ReadBeforeUpdate, forward_hook, forward_pre_hook, weight_norm,
                                  spectral_norm, compiled])
def test_state_changed_in_forward_trains_and_evaluates_as_one_process(comm, make):
    """One micro-batch per step: a buffer updated per forward advances once per step as in one process
    (with M micro-batches it advances M times a step, as BatchNorm's statistics do: docs/pipeline.md)."""
    torch.manual_seed(0)
    model = make().double()
    data, eval_data = batches(2, seed=1), batches(2, seed=2)
    want, want_eval = one_process(model, data, eval_data)
    result = fit(model, data, F.mse_loss, sgd, strategy="model", partitions=comm.size, micro_batches=1,
                 eval_data=eval_data, progress=False)
    got = result.model.state_dict()
    for name, t in want.state_dict().items():
        assert_close_all_ranks(comm, got[name], t, atol=1e-12, what=f"{make.__name__}.{name}")
    got_eval = result.history[-1]["eval_loss"]
    assert_all_ranks(comm, abs(got_eval - want_eval) < 1e-12, f"eval_loss {got_eval} vs one process {want_eval}")


def test_a_branch_on_self_training_warns_on_rank_0(comm):
    """The graph keeps the captured (training) branch in eval: fit says so once, on rank 0."""
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(TrainingBranch().double(), batches(1, seed=1), F.mse_loss, sgd, strategy="model", partitions=comm.size,
            progress=False)
    said = [w for w in caught if "branches on self.training" in str(w.message)]
    assert_all_ranks(comm, len(said) == (comm.rank == 0), f"rank {comm.rank} warned {len(said)} times")
    with warnings.catch_warnings(record=True) as caught:  # a model without one: no warning
        warnings.simplefilter("always")
        fit(Base().double(), batches(1, seed=1), F.mse_loss, sgd, strategy="model", partitions=comm.size,
            progress=False)
    assert_all_ranks(comm, not [w for w in caught if "self.training" in str(w.message)], "warned for Base")


def test_a_scripted_submodule_is_refused_on_every_rank(comm):
    torch.manual_seed(0)
    model = Base().double()
    model.blk = torch.jit.script(model.blk)
    try:
        fit(model, batches(1, seed=1), F.mse_loss, sgd, strategy="model", partitions=comm.size, progress=False)
        said = "trained"
    except FitError as e:
        said = str(e)
    assert_all_ranks(comm, "torch.jit.script" in said, f"rank {comm.rank}: {said[:300]}")
