"""`fit(model, data, loss_fn, torch.optim.SGD(model.parameters(), ...))`: an optimizer INSTANCE, as DDP,
Lightning and Horovod users write it, trains exactly as the equivalent factory (to the bit) and as one
process (float64) over real MPI at 2, 3 and 4 ranks, for data (plain, zero=1/2/3), model, hybrid,
pipe-sgd, spatial and auto; per-group hyperparameters are kept; state the instance holds is carried;
the instance is never stepped. A string, an instance over another model or leaving a trainable parameter out, and a
scheduler instance are refused with FitError on every rank before any message."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.fit import FitError, fit
from mpitrain.spatial.mesh import mesh_batch, mesh_model
from mpitrain.strategies import optimizer_factory
from tests.helpers import assert_all_ranks, assert_close_all_ranks, bitwise_equal
from tests.strategies.test_pipesgd import _simulate


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def two_groups(params) -> torch.optim.Optimizer:
    """The factory: the first two layers (4 tensors) at lr 0.2, momentum 0.9; the rest at lr 0.05,
    momentum 0.5, weight decay 0.01 (the strategies hand the whole model's parameters, in order)."""
    ps = list(params)
    return torch.optim.SGD([{"params": ps[:4]}, {"params": ps[4:], "lr": 0.05, "momentum": 0.5,
                                                  "weight_decay": 0.01}], lr=0.2, momentum=0.9)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three global batches of 9, 7 and 5 rows: uneven over 2, 3 and 4 ranks (float64)."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for n in (9, 7, 5)]


def one_process(model: nn.Module, data, opt: torch.optim.Optimizer | None = None) -> nn.Module:
    opt = opt or two_groups(model.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _close(comm, a: nn.Module, b: nn.Module, atol: float, what: str) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert_close_all_ranks(comm, p.double(), q.double(), atol, atol, f"{what}: {name}")


def _instance_vs_factory(comm, what: str, **kwargs) -> nn.Module:
    """fit with an instance and with the factory: bitwise equal on every rank; returns the instance's model."""
    m = mlp()
    opt = two_groups(m.parameters())
    before = copy.deepcopy(opt.state_dict())
    result = fit(m, batches(), F.cross_entropy, opt, progress=False, **kwargs)
    by_factory = fit(mlp(), batches(), F.cross_entropy, two_groups, progress=False, **kwargs).model
    assert_all_ranks(comm, bitwise_equal(result.model.state_dict(), by_factory.state_dict()),
                     f"{what}: instance vs factory differ")
    # the user's instance is not the one that trained: unchanged; the result's is, with both groups' lrs
    assert_all_ranks(comm, bitwise_equal(opt.state_dict(), before), f"{what}: the user's instance changed")
    trained = result.optimizer
    ok = trained is not None and trained is not opt and [g["lr"] for g in trained.param_groups] == [0.2, 0.05]
    assert_all_ranks(comm, ok, f"{what}: FitResult.optimizer is not the rebuilt two-group SGD")
    return result.model


# -- MPI: each strategy trains an instance as its factory and as one process -----------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=["plain", "zero1", "zero2", "zero3"])
def test_data_instance_trains_as_the_factory_and_one_process(comm, zero):
    model = _instance_vs_factory(comm, f"data zero={zero}", strategy="data", zero=zero, bucket_mb=0.0001)
    _close(comm, model, one_process(mlp(), batches()), 1e-10, f"data zero={zero} vs one process")


@pytest.mark.mpi
@pytest.mark.parametrize("which", ["model", "hybrid"])
def test_pipeline_instance_trains_as_the_factory_and_one_process(comm, which):
    partitions, replicas = (comm.size, None) if which == "model" else (
        (2, comm.size // 2) if comm.size % 2 == 0 else (1, comm.size))
    model = _instance_vs_factory(comm, which, strategy=which, partitions=partitions, replicas=replicas,
                                 micro_batches=2, balance="params", profile_passes=1)
    _close(comm, model, one_process(mlp(), batches()), 1e-10, f"{which} vs one process")


@pytest.mark.mpi
def test_pipe_sgd_instance_trains_as_the_factory_and_algorithm_1(comm):
    model = _instance_vs_factory(comm, "pipe-sgd", strategy="pipe-sgd", staleness=2)
    ref, _ = _simulate(mlp(), batches(), 2, 0, two_groups)
    _close(comm, model, ref, 1e-10, "pipe-sgd K=2 vs Algorithm 1 in one process")


@pytest.mark.mpi
def test_spatial_instance_trains_as_the_factory(comm):
    def model() -> nn.Module:
        torch.manual_seed(0)
        return mesh_model(in_channels=3, widths=(4, 6, 8), convs_per_block=2)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.2, momentum=0.9)

    data = [mesh_batch(2, 28, in_channels=3, blocks=3, seed=s) for s in range(2)]
    m = model()
    opt = sgd(m.parameters())
    result = fit(m, data, nn.CrossEntropyLoss(), opt, strategy="spatial", grid=(comm.size, 1), progress=False)
    by_factory = fit(model(), data, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=(comm.size, 1),
                     progress=False).model
    assert_all_ranks(comm, bitwise_equal(result.model.state_dict(), by_factory.state_dict()),
                     "spatial: instance vs factory differ")
    assert_all_ranks(comm, not opt.state and result.optimizer is not None and result.optimizer is not opt
                     and len(result.optimizer.state) > 0, "spatial: the user's instance stepped, or no result's")


@pytest.mark.mpi
def test_auto_trains_an_instance_as_one_process(comm):
    m = mlp()
    result = fit(m, batches(), F.cross_entropy, two_groups(m.parameters()), strategy="auto",
                 strategies=("data", "model", "hybrid"), cache=False, progress=False)
    _close(comm, result.model, one_process(mlp(), batches()), 1e-10, f"auto ({result.history[0].get('plan')})")


@pytest.mark.mpi
def test_a_stepped_instance_continues_from_its_state(comm):
    """Momentum built by a step before fit is carried: fit continues as one process stepping on."""
    warm = batches()[0]
    m, ref = mlp(), mlp()
    opt, ref_opt = two_groups(m.parameters()), two_groups(ref.parameters())
    for model, o in ((m, opt), (ref, ref_opt)):
        F.cross_entropy(model(warm[0]), warm[1]).backward()
        o.step()
        o.zero_grad()
    trained = fit(m, batches(), F.cross_entropy, opt, strategy="data", zero=2, progress=False).model
    _close(comm, trained, one_process(ref, batches(), ref_opt), 1e-10, "stepped instance vs one process")


@pytest.mark.mpi
def test_bad_optimizers_are_refused_on_every_rank(comm):
    m = mlp()
    with pytest.raises(FitError, match="optimizer must be a torch.optim.Optimizer .* got str 'sgd'"):
        fit(m, batches(), F.cross_entropy, "sgd", progress=False)  # type: ignore[arg-type]
    with pytest.raises(FitError, match=r"holds 8 parameter\(s\) that are not this model's"):
        fit(m, batches(), F.cross_entropy, two_groups(mlp().parameters()), strategy="model",
            partitions=comm.size, progress=False)
    part = torch.optim.SGD(m[0].parameters(), lr=0.1)
    with pytest.raises(FitError, match=r"no group holding the model's trainable parameter\(s\) \['2.bias'"):
        fit(m, batches(), F.cross_entropy, part, strategy="data", zero=2, progress=False)
    opt = two_groups(m.parameters())
    with pytest.raises(FitError, match="lr_scheduler must be a factory optimizer -> scheduler"):
        fit(m, batches(), F.cross_entropy, opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1),
            progress=False)
    assert_all_ranks(comm, True)  # every rank got here: nothing was sent before the refusals


# -- one process -------------------------------------------------------------------------------------
def test_instance_trains_as_the_factory_in_one_process():
    m = mlp()
    by_instance = fit(m, batches(), F.cross_entropy, two_groups(m.parameters()), progress=False).model
    by_factory = fit(mlp(), batches(), F.cross_entropy, two_groups, progress=False).model
    assert bitwise_equal(by_instance.state_dict(), by_factory.state_dict())
    ref = one_process(mlp(), batches())
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(by_instance.parameters(), ref.parameters()))


def test_the_factory_maps_groups_by_identity_onto_the_handed_parameters():
    m = mlp()
    opt = two_groups(m.parameters())
    factory = optimizer_factory(opt, m)
    built = factory([m[6].bias, m[2].weight, m[0].weight])  # a rank holding three tensors, handed out of order
    assert type(built) is torch.optim.SGD
    assert [g["params"] for g in built.param_groups] == [[m[0].weight, m[2].weight], [m[6].bias]]
    hyper = [(g["lr"], g["momentum"], g["weight_decay"]) for g in built.param_groups]
    assert hyper == [(0.2, 0.9, 0), (0.05, 0.5, 0.01)]
    assert optimizer_factory(two_groups, m) is two_groups


def test_frozen_parameters_may_stay_out_and_adagrads_initial_state_is_carried():
    m = mlp()
    m[0].weight.requires_grad_(False)
    opt = torch.optim.Adagrad([p for p in m.parameters() if p.requires_grad], lr=0.1, initial_accumulator_value=0.5)
    for st in opt.state.values():
        st["sum"].fill_(0.7)  # state the instance holds, not what its class would create
    built = optimizer_factory(opt, m)([p for p in m.parameters() if p.requires_grad])
    assert type(built) is torch.optim.Adagrad
    assert all(torch.equal(built.state[p]["sum"], torch.full_like(p, 0.7)) for p in built.param_groups[0]["params"])
    assert all(built.state[p]["sum"] is not opt.state[p]["sum"] for p in built.param_groups[0]["params"])


def test_an_optimizer_that_cannot_be_rebuilt_is_refused():
    class Odd(torch.optim.SGD):
        def __init__(self, params, lr, extra):  # a constructor argument that is not among its defaults
            super().__init__(params, lr=lr)

    m = mlp()
    with pytest.raises(FitError, match="cannot rebuild the Odd passed as optimizer .* pass a factory"):
        optimizer_factory(Odd(m.parameters(), 0.1, extra=1), m)
