"""plan() over real MPI: the same decision on every rank, bad input refused on every rank before any
message, the disk cache, and fit(strategy="auto") against one process training the same batches."""

from __future__ import annotations

import copy
import json
from collections import UserDict
from pathlib import Path

import pytest
import torch
from torch import nn

import mpitrain
from mpitrain.fit import FitError, fit
from mpitrain.planner import PlanError, plan
from mpitrain.planner._candidates import TIE_MARGIN, machinery
from tests.helpers import assert_all_ranks, assert_close_all_ranks
from tests.planner.models import cnn_batch, mlp_batches, tiny_cnn, tiny_mlp
from tests.strategies.pipeline.tiny_transformers import build, lm_batches, lm_loss

CE = nn.functional.cross_entropy


@pytest.mark.mpi(min_size=1)
def test_every_rank_reaches_the_same_ranked_plans(comm, tmp_path_factory):
    x, y = cnn_batch(n=12)
    torch.manual_seed(comm.rank)  # ranks measure different times: the agreement makes them equal
    plans = plan(tiny_cnn(), (x, y), CE, comm=comm, cache=False)
    mine = [(p.describe(), p.step_s, p.memory_bytes) for p in plans]
    seen = comm.allgather_object(mine)
    assert_all_ranks(comm, all(s == seen[0] for s in seen), f"rank 0 {seen[0][:2]} vs mine {mine[:2]}")
    assert_all_ranks(comm, len(plans) > 0 and plans[0].step_s > 0, "no plan")
    keys = [p.step_s * (1 + TIE_MARGIN * machinery(p)) for p in plans]
    assert_all_ranks(comm, keys == sorted(keys), "not fastest first (up to the tie margin)")
    names = {p.strategy for p in plans}
    assert_all_ranks(comm, "data" in names and (comm.size == 1 or "pipe-sgd" in names), f"{names}")


class Keywords(nn.Module):
    """A model called with keyword arguments, as a Hugging Face model is."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.inner(features)


@pytest.mark.mpi(min_size=1)
def test_a_mapping_that_is_no_dict_plans_as_its_dict(comm):
    """A tokenizer's BatchEncoding (a UserDict) as the sample batch's inputs: planned as its dict."""
    (x, y), = mlp_batches(1)
    plans = plan(Keywords(tiny_mlp().double()), (UserDict(features=x), y), CE, comm=comm, cache=False)
    names = {p.strategy for p in plans}
    assert_all_ranks(comm, "data" in names and (comm.size == 1 or "model" in names), f"{names}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bad, message", [
    ({"model": "not a model"}, "torch.nn.Module"),
    ({"sample_batch": torch.zeros(3)}, "sample_batch"),
    ({"sample_batch": (torch.zeros(12, 16), torch.zeros(13, dtype=torch.long))}, "multiple"),  # the sharding rule
    ({"memory_limit": "-4G"}, "memory_limit"),
    ({"strategies": ["data", "warp-drive"]}, "warp-drive"),
    ({"world_size": 0}, "world_size"),
    ({"exact": "yes"}, "exact"),
    ({"warn_after": 0}, "warn_after"),
    ({"warn_after": 5.0, "abort_after": 1.0}, "abort_after"),
])
def test_bad_input_is_refused_on_every_rank_before_any_message(comm, bad, message):
    args = {"model": tiny_mlp(), "sample_batch": mlp_batches(1)[0], "loss_fn": CE}
    kwargs = {k: bad.pop(k) for k in ("memory_limit", "strategies", "world_size", "exact", "warn_after", "abort_after")
              if k in bad}
    args.update(bad)
    with pytest.raises(PlanError) as e:
        plan(args["model"], args["sample_batch"], args["loss_fn"], comm=comm, cache=False, **kwargs)
    assert_all_ranks(comm, message in str(e.value), str(e.value))


@pytest.mark.mpi(min_size=2)
def test_ranks_given_different_models_are_refused_together(comm):
    model = tiny_mlp(width=32 if comm.rank == 0 else 48)
    with pytest.raises(PlanError) as e:
        plan(model, mlp_batches(1)[0], CE, comm=comm, cache=False)
    assert_all_ranks(comm, "different model" in str(e.value), str(e.value))


@pytest.mark.mpi(min_size=1)
def test_the_cache_gives_the_same_plans_without_measuring_again(comm, tmp_path):
    folder = comm.broadcast_object(str(tmp_path), 0)  # rank 0 writes, every rank reads rank 0's verdict
    batch = mlp_batches(1)[0]
    first = plan(tiny_mlp().double(), batch, CE, comm=comm, cache=folder)
    second = plan(tiny_mlp().double(), batch, CE, comm=comm, cache=folder)
    assert_all_ranks(comm, [p.to_dict() for p in first] == [p.to_dict() for p in second], "cache changed plans")


@pytest.mark.mpi(min_size=1)
def test_fit_auto_trains_what_one_process_trains_and_records_the_plan(comm, capsys):
    batches = mlp_batches(3)
    model = tiny_mlp().double()
    reference = copy.deepcopy(model)
    opt = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    result = fit(model, batches, CE, opt, strategy="auto", strategies=("data", "model", "hybrid"),
                 cache=False, progress=False, comm=comm)
    ref_opt = opt(reference.parameters())
    for x, y in batches:
        ref_opt.zero_grad()
        CE(reference(x), y).backward()
        ref_opt.step()
    got = torch.cat([p.detach().flatten() for p in result.model.parameters()])
    want = torch.cat([p.detach().flatten() for p in reference.parameters()])
    assert_close_all_ranks(comm, got, want, atol=1e-10, what=f"auto chose {result.history[0].get('plan')}")
    record = result.history[0]
    assert_all_ranks(comm, isinstance(record.get("plan"), str) and record["plan_step_s"] > 0, f"{record}")
    out = capsys.readouterr().out
    assert_all_ranks(comm, ("auto: " in out) == (comm.rank == 0), out[-300:])


def _inexact(p: mpitrain.Plan) -> bool:
    return p.options.get("staleness", 1) > 1 or p.options.get("compression") is not None


@pytest.mark.mpi(min_size=2)
def test_exact_drops_every_stale_or_lossy_plan_and_keeps_the_others(comm, tmp_path_factory):
    folder = comm.broadcast_object(str(tmp_path_factory.mktemp("plan")), 0)  # one calibration for both calls
    batch = mlp_batches(1)[0]
    every = plan(tiny_mlp().double(), batch, CE, comm=comm, strategies=("data", "pipe-sgd"), cache=folder)
    exact = plan(tiny_mlp().double(), batch, CE, comm=comm, strategies=("data", "pipe-sgd"), exact=True,
                 cache=folder)
    assert_all_ranks(comm, any(_inexact(p) for p in every), f"no stale or lossy candidate: {every.table()}")
    kept = [p.describe() for p in every if not _inexact(p)]
    assert_all_ranks(comm, [p.describe() for p in exact] == kept, f"{exact.table()}\nvs\n{every.table()}")
    why = [d for d in exact.dropped if "exact=True" in d.reason]
    assert_all_ranks(comm, len(why) == sum(_inexact(p) for p in every), exact.explanation())


@pytest.mark.mpi(min_size=1)
def test_fit_auto_plans_exactly_unless_told_otherwise(comm, monkeypatch):
    import mpitrain.planner._auto as auto

    asked: list[bool] = []

    def spy(*args, **kwargs):
        asked.append(kwargs["exact"])
        return plan(*args, **kwargs)

    monkeypatch.setattr(auto, "plan", spy)
    for options in ({}, {"exact": False}):
        fit(tiny_mlp().double(), mlp_batches(1), CE, lambda p: torch.optim.SGD(p, lr=0.1), strategy="auto",
            strategies=("data",), cache=False, progress=False, comm=comm, **options)
    assert_all_ranks(comm, asked == [True, False], f"auto asked the planner for exact={asked}")
    with pytest.raises(FitError) as e:
        fit(tiny_mlp(), mlp_batches(1), CE, lambda p: torch.optim.SGD(p, lr=0.1), strategy="auto", exact="yes",
            progress=False, comm=comm)
    assert_all_ranks(comm, "exact" in str(e.value), str(e.value))


@pytest.mark.mpi(min_size=1)
def test_fit_auto_refuses_layout_keywords_it_chooses_itself(comm):
    with pytest.raises(FitError) as e:
        fit(tiny_mlp(), mlp_batches(1), CE, lambda p: torch.optim.SGD(p, lr=0.1), strategy="auto",
            partitions=2, progress=False, comm=comm)
    assert_all_ranks(comm, "partitions=1" in str(e.value), str(e.value))


def test_plan_is_exported_lazily_from_the_package():
    assert mpitrain.plan is plan and mpitrain.Plan.__name__ == "Plan"


@pytest.mark.mpi(min_size=2)
def test_a_mixed_plan_runs_under_fit_as_one_process_trains(comm):
    x, y = cnn_batch(n=2 * comm.size + 1)  # a batch that does not split equally: data cannot run it
    batches = [(x.double(), y), (x.double().flip(0), y.flip(0))]
    model = tiny_cnn().double()
    reference = copy.deepcopy(model)
    plans = plan(model, batches[0], CE, comm=comm, cache=False, strategies={"mixed"})
    assert_all_ranks(comm, len(plans) == 1 and "switch_at" in plans[0].options, f"{plans.explanation()}")
    chosen = plans[0]
    opt = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    result = fit(model, batches, CE, opt, strategy=chosen.strategy, progress=False, comm=comm, **chosen.options)
    ref_opt = opt(reference.parameters())
    for xb, yb in batches:
        ref_opt.zero_grad()
        CE(reference(xb), yb).backward()
        ref_opt.step()
    got = torch.cat([p.detach().flatten() for p in result.model.parameters()])
    want = torch.cat([p.detach().flatten() for p in reference.parameters()])
    assert_close_all_ranks(comm, got, want, atol=1e-10, what=f"mixed plan {chosen.describe()}")


@pytest.mark.mpi(min_size=2)
def test_plans_for_another_world_size_are_priced_for_it_and_marked_not_measured(comm):
    W = 2 * comm.size
    x, y = cnn_batch(n=4 * W)
    plans = plan(tiny_cnn(), (x, y), CE, comm=comm, cache=False, world_size=W, strategies={"data", "model", "hybrid"})
    mine = [p.to_dict() for p in plans]
    seen = comm.allgather_object(mine)
    assert_all_ranks(comm, all(s == seen[0] for s in seen), "ranks disagree")
    assert_all_ranks(comm, len(plans) > 0 and not any(p.measured for p in plans), f"{mine}")
    parts = {p.options.get("partitions") for p in plans if p.strategy in ("model", "hybrid")}
    assert_all_ranks(comm, all(W % P == 0 for P in parts) and (W in parts or "model" in plans.explanation()),
                     f"partitions {parts} for {W} ranks; {plans.explanation()}")
    assert_all_ranks(comm, "not measured" in plans.table(), plans.table())


@pytest.mark.mpi(min_size=2)
def test_on_one_host_the_intra_and_inter_levels_are_one_measurement(comm):
    from mpitrain.planner._plan import host_layout, measure_levels

    hosts = host_layout(comm)
    assert_all_ranks(comm, hosts == (0,) * comm.size, f"one machine, hosts {hosts}")
    inter, intra = measure_levels(comm, hosts)
    assert_all_ranks(comm, inter is intra and inter.ranks == comm.size and inter.allreduce.beta > 0, f"{inter}")


@pytest.mark.mpi(min_size=1)
def test_a_language_model_with_flattened_targets_is_timed_on_the_shares_of_its_batch(comm, tmp_path):
    """(B*T,) token targets: the batch is B sequences (the inputs' dim 0), not B*T. The profile that plan()
    caches holds that batch and the step timed at the shares of a W-rank plan, B/(4W) and B/W sequences
    (before the fix: at B*T/(4W) and B*T/W, clamped to the whole batch), and the data plans split B."""
    W, T = comm.size, 8
    (inputs, targets), = lm_batches(4 * W, 1, seed=1, lengths=(T,))
    folder = comm.broadcast_object(str(tmp_path), 0)
    plans = plan(build("gpt2"), (inputs, targets.reshape(-1)), lm_loss, comm=comm, cache=folder,
                 strategies={"data", "model"})
    profile = comm.broadcast_object(json.loads(next(Path(folder).glob("*.json")).read_text())["profile"]
                                    if comm.rank == 0 else None, 0)
    timed = [n for n, _ in profile["step_at"]]
    assert_all_ranks(comm, profile["batch"] == 4 * W and timed == [1.0, 4.0],
                     f"batch {profile['batch']}, timed {timed}")
    micro = [p.options.get("micro_batches", 1) for p in plans if p.strategy == "model"]
    assert_all_ranks(comm, all(4 * W % m == 0 for m in micro), f"micro-batches {micro} of a batch of {4 * W}")


@pytest.mark.mpi(min_size=2)
def test_a_cnn_keeps_every_spatial_plan_its_trial_forward_runs(comm):
    """The trial forward that drops a model reading its input's size (tests/test_fit_timm.py: ViT) runs a
    CNN's blocks: every grid of every sample-group count is a plan, none dropped."""
    x, y = cnn_batch(n=4 * comm.size)
    plans = plan(tiny_cnn(), (x, y), CE, comm=comm, cache=False, strategies={"spatial"})
    layouts = {(p.options["grid"], p.options["samples"]) for p in plans if "switch_at" not in p.options}
    want = {((a, per // a), comm.size // per) for per in range(2, comm.size + 1) if comm.size % per == 0
            for a in range(1, per + 1) if per % a == 0}
    assert_all_ranks(comm, layouts == want and not [d for d in plans.dropped if d.strategy == "spatial"],
                     f"{layouts} vs {want}; {plans.explanation()}")


class BranchesOnRank(nn.Module):
    """A forward that runs other code on rank 0 (a shape check no input fails): torch.export captures a
    different graph there, so the ranks measure different numbers of times."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.inner = rank, tiny_cnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rank == 0 and x.shape[-1] * x.shape[-2] < 4:
            raise ValueError("never: the images are larger")
        return self.inner(x)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_capture_different_graphs_are_refused_together_not_inside_mpi(comm):
    """Before: the profile's allreduce of different lengths failed inside MPI (MPI_ERR_TRUNCATE) on one
    rank while the others waited."""
    x, y = cnn_batch(n=2 * comm.size)
    with pytest.raises(PlanError) as e:
        plan(BranchesOnRank(comm.rank), (x, y), CE, comm=comm, cache=False, strategies={"data"})
    assert_all_ranks(comm, "different graphs" in str(e.value), str(e.value))


def test_a_model_with_sync_batchnorm_gets_no_hybrid_plan_with_replicas_and_is_told_why():
    from mpitrain.planner._plan import _without_synced_replicas
    from mpitrain.planner._types import Plan

    plans = [Plan("data", {}, 1.0, 1), Plan("hybrid", {"partitions": 2, "replicas": 2}, 0.5, 1),
             Plan("hybrid", {"partitions": 4}, 0.7, 1)]
    synced = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4))
    kept, dropped = _without_synced_replicas(synced, plans, [])
    assert [p.options for p in kept] == [{}, {"partitions": 4}]
    assert [(d.strategy, d.options) for d in dropped] == [("hybrid", {"partitions": 2, "replicas": 2})]
    assert "SyncBatchNorm" in dropped[0].reason
    assert _without_synced_replicas(tiny_cnn(), plans, []) == (plans, [])
