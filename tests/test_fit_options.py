"""`fit(strategy=<options dataclass>)`: the dataclass's class names the strategy, and the run equals the
keyword form to the bit and one process (float64; spatial float32) over real MPI at 2, 3, 4 ranks; an
options object given with keyword options, or something that is neither a name nor an options object, is
refused with FitError on every rank before any message."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
from mpitrain.fit import FitError, fit
from mpitrain.spatial.mesh import mesh_batch, mesh_model
from mpitrain.strategies.base import StrategyOptions
from tests.helpers import assert_all_ranks, assert_close_all_ranks, bitwise_equal
from tests.strategies.test_pipesgd import _simulate


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three global batches of 9, 7 and 5 rows: uneven over 2, 3 and 4 ranks (float64)."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
            for n in (9, 7, 5)]


def one_process(model: nn.Module, data, clip: float | None) -> nn.Module:
    opt = sgd(model.parameters())
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return model


def _same_bits(comm, a: nn.Module, b: nn.Module, what: str) -> None:
    assert_all_ranks(comm, bitwise_equal(a.state_dict(), b.state_dict()), f"{what}: options vs keywords differ")


def _close(comm, a: nn.Module, b: nn.Module, atol: float, what: str) -> None:
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert_close_all_ranks(comm, p.double(), q.double(), atol, atol, f"{what}: {name}")


def _layouts(size: int) -> list[tuple[int, int | None]]:
    """(partitions, replicas) for "model" (every rank a partition) and "hybrid" (2 x size/2, or 1 x size)."""
    return [(size, None), (2, size // 2) if size % 2 == 0 else (1, size)]


# -- MPI: every strategy's options object trains exactly as its keywords -------------------------------
@pytest.mark.mpi
def test_data_options_object_trains_as_the_keywords_and_as_one_process(comm):
    opts = mpitrain.DataOptions(zero=1, bucket_mb=0.0001)
    by_object = fit(mlp(), batches(), F.cross_entropy, sgd, strategy=opts, micro_batches=2, grad_clip=0.3,
                    progress=False).model
    by_words = fit(mlp(), batches(), F.cross_entropy, sgd, strategy="data", zero=1, bucket_mb=0.0001,
                   micro_batches=2, grad_clip=0.3, progress=False).model
    _same_bits(comm, by_object, by_words, "data zero=1")
    _close(comm, by_object, one_process(mlp(), batches(), 0.3), 1e-10, "data vs one process")


@pytest.mark.mpi
@pytest.mark.parametrize("which", [0, 1], ids=["model", "hybrid"])
def test_pipeline_options_object_trains_as_the_keywords_and_as_one_process(comm, which):
    partitions, replicas = _layouts(comm.size)[which]
    name = ["model", "hybrid"][which]
    layout = {"partitions": partitions, "replicas": replicas, "micro_batches": 2, "balance": "params"}
    by_object = fit(mlp(), batches(), F.cross_entropy, sgd, strategy=mpitrain.PipelineOptions(profile_passes=1),
                    grad_clip=0.3, progress=False, **layout).model
    by_words = fit(mlp(), batches(), F.cross_entropy, sgd, strategy=name, profile_passes=1, grad_clip=0.3,
                   progress=False, **layout).model
    _same_bits(comm, by_object, by_words, name)
    _close(comm, by_object, one_process(mlp(), batches(), 0.3), 1e-10, f"{name} vs one process")


@pytest.mark.mpi
@pytest.mark.parametrize("which", [0, 1], ids=["model", "hybrid"])
def test_partitions_left_out_are_what_the_strategy_takes_and_train_as_given(comm, which):
    """"model" without `partitions` splits over every rank; "hybrid" with `replicas` only takes
    ``size // replicas`` partitions: the same run, to the bit, as the layout spelled out."""
    partitions, replicas = _layouts(comm.size)[which]
    name = ["model", "hybrid"][which]
    common = {"micro_batches": 2, "balance": "params", "profile_passes": 1, "progress": False}
    inferred = fit(mlp(), batches(), F.cross_entropy, sgd, strategy=name, replicas=replicas, **common)
    given = fit(mlp(), batches(), F.cross_entropy, sgd, strategy=name, partitions=partitions, replicas=replicas,
                **common)
    _same_bits(comm, inferred.model, given.model, f"{name} without partitions")
    _close(comm, inferred.model, one_process(mlp(), batches(), None), 1e-10, f"{name} vs one process")


@pytest.mark.mpi
def test_hybrid_without_partitions_or_dividing_replicas_is_refused_on_every_rank(comm):
    with pytest.raises(FitError, match=rf"strategy 'hybrid' needs partitions=P or replicas=R with P x R = "
                                       rf"{comm.size} ranks; got replicas=None"):
        fit(mlp(), batches(), F.cross_entropy, sgd, strategy="hybrid", progress=False)
    with pytest.raises(FitError, match=rf"with P x R = {comm.size} ranks; got replicas={comm.size + 1}"):
        fit(mlp(), batches(), F.cross_entropy, sgd, strategy="hybrid", replicas=comm.size + 1, progress=False)
    assert_all_ranks(comm, True)  # every rank got here: nothing was sent before the refusals


@pytest.mark.mpi
def test_pipe_sgd_options_object_trains_as_the_keywords_and_as_algorithm_1(comm):
    by_object = fit(mlp(), batches(), F.cross_entropy, sgd, strategy=mpitrain.PipeSGDOptions(staleness=2),
                    epochs=2, progress=False).model
    by_words = fit(mlp(), batches(), F.cross_entropy, sgd, strategy="pipe-sgd", staleness=2, epochs=2,
                   progress=False).model
    _same_bits(comm, by_object, by_words, "pipe-sgd K=2")
    ref, _ = _simulate(mlp(), batches() * 2, 2, 0, sgd)
    _close(comm, by_object, ref, 1e-10, "pipe-sgd K=2 vs Algorithm 1 in one process")


@pytest.mark.mpi
def test_spatial_options_object_trains_as_the_keywords_and_as_one_process(comm):
    grid = (comm.size, 1)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return mesh_model(in_channels=3, widths=(4, 6, 8), convs_per_block=2)

    data = [mesh_batch(2, 28, in_channels=3, blocks=3, seed=s) for s in range(2)]
    loss_fn = nn.CrossEntropyLoss()
    by_object = fit(model(), data, loss_fn, sgd, strategy=mpitrain.SpatialOptions(grid=grid), progress=False).model
    by_words = fit(model(), data, loss_fn, sgd, strategy="spatial", grid=grid, progress=False).model
    _same_bits(comm, by_object, by_words, "spatial")
    ref = copy.deepcopy(model())
    opt = sgd(ref.parameters())
    for x, y in data:
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        opt.step()
    _close(comm, by_object, ref, 1e-5, "spatial vs one process")


@pytest.mark.mpi
def test_options_object_with_keyword_options_is_refused_on_every_rank_naming_both(comm):
    with pytest.raises(FitError, match=r"strategy=DataOptions\(.*\) and the keyword option\(s\) \['zero'\]"):
        fit(mlp(), batches(), F.cross_entropy, sgd, strategy=mpitrain.DataOptions(), zero=1, progress=False)
    with pytest.raises(FitError, match="strategy must be a name"):
        fit(mlp(), batches(), F.cross_entropy, sgd, strategy=3, progress=False)  # type: ignore[arg-type]
    assert_all_ranks(comm, True)  # every rank got here: nothing was sent before the refusals


# -- one process -------------------------------------------------------------------------------------
def test_each_options_class_names_its_strategy():
    assert mpitrain.DataOptions().strategy_name(1, None, 4) == "data"
    assert mpitrain.PipeSGDOptions().strategy_name(1, None, 4) == "pipe-sgd"
    assert mpitrain.SpatialOptions().strategy_name(1, None, 4) == "spatial"
    assert mpitrain.AutoOptions().strategy_name(1, None, 4) == "auto"


@pytest.mark.parametrize("partitions, replicas, expected", [(4, None, "model"), (4, 1, "model"), (2, 2, "hybrid"),
                                                            (2, None, "hybrid"), (1, 4, "hybrid"),
                                                            (None, None, "model"), (None, 2, "hybrid")])
def test_pipeline_options_run_model_when_the_partitions_take_every_rank_else_hybrid(partitions, replicas, expected):
    assert mpitrain.PipelineOptions().strategy_name(partitions, replicas, 4) == expected


def test_an_options_class_of_no_strategy_is_refused():
    with pytest.raises(FitError, match="StrategyOptions names no strategy"):
        fit(mlp(), batches(), F.cross_entropy, sgd, strategy=StrategyOptions(), progress=False)


def test_a_strategy_given_another_strategys_options_refuses_them():
    from mpitrain.strategies.base import FitSpec

    spec = FitSpec(strategy="data", options=mpitrain.PipeSGDOptions())
    with pytest.raises(FitError, match="strategy 'data' takes DataOptions, not PipeSGDOptions"):
        mpitrain.DataOptions.from_spec(spec)
    opts = mpitrain.DataOptions(zero=2)
    assert mpitrain.DataOptions.from_spec(FitSpec(strategy="data", options=opts)) is opts


def test_options_object_trains_as_the_keywords_in_one_process():
    by_object = fit(mlp(), batches(), F.cross_entropy, sgd, strategy=mpitrain.DataOptions(kvstore="local"),
                    grad_clip=0.3, progress=False).model
    by_words = fit(mlp(), batches(), F.cross_entropy, sgd, strategy="data", kvstore="local", grad_clip=0.3,
                   progress=False).model
    assert bitwise_equal(by_object.state_dict(), by_words.state_dict())
    ref = one_process(mlp(), batches(), 0.3)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(by_object.parameters(), ref.parameters()))
