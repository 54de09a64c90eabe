"""Probe C (a DDP script ported to ``fit``): the DataLoaders such a script passes as ``data=``, at 2, 3 and 4 ranks.

* A DataLoader over a ``DistributedSampler`` (one shard per rank, as DDP reads) is refused with FitError on
  every rank before any message, naming the replacements with the global batch size. Before, ``data=`` failed
  at the first batch's cross-rank check with a message that never mentioned the sampler, and ``eval_data=``
  was evaluated on each rank's shard as if it were the whole eval set.
* The same for ``eval_data=``: its first batch is now checked across ranks as ``data``'s is.
* DataLoader keywords fit has none of (``persistent_workers=``, ``prefetch_factor=``, ``sampler=``, ...) given to
  fit: the FitError names fit's Dataset keywords and the DataLoader route, not the strategy's options.
* A DataLoader shuffling without ``generator=`` whose first batches differ between ranks: the FitError says
  to pass ``generator=`` (before: "seed a shuffling DataLoader alike on every rank").
* Such a DataLoader with torch's global RNG seeded alike on every rank trains as one process under "model",
  "hybrid" and "auto" for several epochs. Before, the pipeline's set-up drew its timing stand-ins for
  received activations from torch's global RNG on the ranks that receive activations only, so epoch 2's
  order differed between ranks (FitError at its first batch). Under "auto" the planner's measurements (not
  run when its cache holds them) drew from torch's global RNG and seeded it (its probe model), so epoch
  2's order was not one process's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from mpitrain.fit import FitError, fit
from tests.helpers import assert_all_ranks, assert_close_all_ranks

pytestmark = pytest.mark.mpi

ROWS, BATCH = 24, 6


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    inputs = torch.randn(ROWS, 5, generator=g, dtype=torch.float64)
    return TensorDataset(inputs, torch.randint(0, 3, (ROWS,), generator=g))


def net() -> nn.Module:
    """Six Linear layers (float64): enough nodes for a partition per rank at 4 ranks."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(5, 8)]
    for _ in range(4):
        layers += [nn.Tanh(), nn.Linear(8, 8)]
    return nn.Sequential(*layers, nn.Tanh(), nn.Linear(8, 3)).double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.3)


def refusal(comm, data: object, model: nn.Module | None = None, **kwargs: Any) -> str:
    """fit's FitError message under "data", the same on every rank (the test fails on every rank otherwise)."""
    try:
        fit(model or net(), data, nn.CrossEntropyLoss(), sgd, strategy="data", progress=False, **kwargs)
    except FitError as e:
        message = str(e)
    else:
        message = ""
    messages = comm.allgather_object(message)
    assert_all_ranks(comm, bool(message) and len(set(messages)) == 1, f"FitError messages {messages}")
    return message


def per_rank_loaders(comm) -> dict[str, DataLoader]:
    ds = dataset()
    sampler = DistributedSampler(ds, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=0)
    return {"sampler": DataLoader(ds, batch_size=3, sampler=sampler),
            "batch_sampler": DataLoader(ds, batch_sampler=BatchSampler(sampler, batch_size=3, drop_last=False))}


@pytest.mark.parametrize("form", ["sampler", "batch_sampler"])
@pytest.mark.parametrize("argument", ["data", "eval_data"])
def test_distributed_sampler_loader_is_refused_naming_the_global_batch(comm, form, argument):
    loader = per_rank_loaders(comm)[form]
    data = DataLoader(dataset(), batch_size=BATCH) if argument == "eval_data" else loader
    kwargs = {"eval_data": loader} if argument == "eval_data" else {}
    message = refusal(comm, data, **kwargs)
    wanted = [f"{argument} is a DataLoader over a DistributedSampler", f"batch_size={3 * comm.size}",
              "Drop the DistributedSampler", "generator=torch.Generator().manual_seed(0)"]
    assert_all_ranks(comm, all(w in message for w in wanted), f"message {message!r} lacks one of {wanted}")


def test_loader_shuffling_with_ranks_apart_global_rng_names_generator(comm):
    model, loader = net(), DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    torch.manual_seed(100 + comm.rank)  # as an unseeded script: each rank's global RNG its own
    message = refusal(comm, loader, model)
    wanted = ["differs between ranks", "without generator=", "generator=torch.Generator().manual_seed(0)"]
    assert_all_ranks(comm, all(w in message for w in wanted), f"message {message!r} lacks one of {wanted}")


@pytest.mark.parametrize("strategy", ["data", "model"])
def test_eval_loader_shuffling_with_ranks_apart_global_rng_is_refused(comm, strategy):
    """Before, each rank evaluated its share of its own shuffled batches: ``eval_loss`` was no one process's
    and differed between ranks (2 ranks, data: 0.9732 and 0.9710 for one process's 1.0030), silently."""
    model, loader = net(), DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    torch.manual_seed(100 + comm.rank)
    try:
        fit(model, [dataset()[:BATCH]], nn.CrossEntropyLoss(), sgd, strategy=strategy, eval_data=loader, progress=False)
    except FitError as e:
        message = str(e)
    else:
        message = ""
    wanted = ["the first global batch of eval_data (after epoch 1) differs between ranks",
              "generator=torch.Generator().manual_seed(0)"]
    assert_all_ranks(comm, all(w in message for w in wanted), f"message {message!r} lacks one of {wanted}")


@pytest.mark.parametrize("keyword", [{"persistent_workers": True}, {"prefetch_factor": 4, "worker_init_fn": None}])
def test_dataloader_keywords_given_to_fit_name_what_fit_takes(comm, keyword):
    """DataLoader keywords copied into fit (before: "strategy 'data' does not take option(s)
    ['persistent_workers']; it takes ['kvstore', ...]") are refused naming fit's own and the DataLoader route."""
    message = refusal(comm, dataset(), batch_size=BATCH, num_workers=2, **keyword)
    wanted = [f"{sorted(keyword)} are DataLoader keywords", "batch_size= (the GLOBAL batch)", "num_workers=",
              "pass your own DataLoader("]
    assert_all_ranks(comm, all(w in message for w in wanted), f"message {message!r} lacks one of {wanted}")


def test_distributed_sampler_of_one_replica_reads_every_row_alike_and_trains_as_one_process(comm):
    """``num_replicas=1`` (a one-process DDP script): the loader yields every row, shuffled by its seed and
    epoch, the same on every rank; it is not refused."""
    ds = dataset()
    loader = DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, num_replicas=1, rank=0, seed=2))
    result = fit(net(), loader, nn.CrossEntropyLoss(), sgd, strategy="data", progress=False)
    want = one_process(net(), DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, num_replicas=1, rank=0,
                                                                                         seed=2)), epochs=1)
    got = dict(result.model.named_parameters())
    for name, p in want.named_parameters():
        assert_close_all_ranks(comm, got[name].detach(), p.detach(), atol=1e-12, what=name)


def one_process(model: nn.Module, loader: DataLoader, epochs: int) -> nn.Module:
    opt = sgd(model.parameters())
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model


OPTIONS: dict[str, dict[str, Any]] = {"model": {}, "hybrid": {"replicas": 2}, "auto": {"cache": False}}


@pytest.mark.parametrize("strategy", list(OPTIONS))
def test_loader_shuffled_by_the_global_rng_seeded_alike_trains_as_one_process(comm, strategy):
    if strategy == "hybrid" and comm.size % 2:
        pytest.skip("hybrid with 2 replicas needs an even world size")
    options = OPTIONS[strategy]
    model = net()
    torch.manual_seed(5)  # on every rank alike: the DataLoader's order comes from it, each epoch
    result = fit(model, DataLoader(dataset(), batch_size=BATCH, shuffle=True), nn.CrossEntropyLoss(), sgd,
                 strategy=strategy, epochs=3, progress=False, **options)
    want = net()
    torch.manual_seed(5)
    one_process(want, DataLoader(dataset(), batch_size=BATCH, shuffle=True), epochs=3)
    got = dict(result.model.named_parameters())
    for name, p in want.named_parameters():
        assert_close_all_ranks(comm, got[name].detach(), p.detach(), atol=1e-12, what=name)


def strided_cnn() -> nn.Module:
    """Three stride-2 convs (8x8 -> 4x4 -> 2x2 -> 1x1) and a linear head, float64, no BatchNorm."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, 2, 1), nn.Tanh(),
                         nn.Sequential(nn.Conv2d(4, 4, 3, 2, 1), nn.Tanh(), nn.Conv2d(4, 4, 3, 2, 1), nn.Tanh()),
                         nn.Flatten(), nn.Linear(4, 3)).double()


def test_spatial_grid_too_fine_for_a_layer_names_switch_at(comm):
    """A grid of ``size`` rows over an 8x8 input: a stride-2 conv of the submodule ``"2"`` has fewer output
    rows than the grid. The SpatialError (every rank alike) names ``switch_at=`` (before: "redistribute before
    this layer", which fit has no keyword for); with ``switch_at="2"`` the run equals one process."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (4,), generator=g))
               for _ in range(2)]
    try:
        fit(strided_cnn(), batches, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=(comm.size, 1), samples=1,
            progress=False)
    except Exception as e:  # noqa: BLE001  # SpatialError, raised in the first forward on every rank
        message = f"{type(e).__name__}: {e}"
    else:
        message = ""
    assert_all_ranks(comm, "switch_at=NAME" in message and "cannot be split" in message, f"message {message!r}")
    result = fit(strided_cnn(), batches, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=(comm.size, 1),
                 samples=1, switch_at="2", progress=False)
    want = strided_cnn()
    opt = sgd(want.parameters())
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(want(x), y).backward()
        opt.step()
    got = dict(result.model.named_parameters())
    for name, p in want.named_parameters():
        assert_close_all_ranks(comm, got[name].detach(), p.detach(), atol=1e-12, what=name)
