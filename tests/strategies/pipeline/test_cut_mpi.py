"""The cut's collective step and a Pipeline built complete at construction, over real MPI."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mpitrain
from mpitrain.strategies.base import FitError
from mpitrain.strategies.pipeline._cut import agree
from tests.helpers import assert_all_ranks, assert_close_all_ranks

from .models import MODELS, batches, reference_train


@pytest.mark.mpi
def test_agree_averages_each_node_over_the_ranks_that_measured_it_the_same_on_every_rank(comm):
    n = 2 * comm.size + 1
    # rank r measures nodes r and r + size (value 10 r + node); node 2 size nobody (0.0); every rank node 0
    mine = [float(10 * comm.rank + i) if i % comm.size == comm.rank and i < 2 * comm.size else None
            for i in range(n)]
    mine[0] = float(comm.rank)
    got = agree(comm, ("same",), mine)
    want = [sum(range(comm.size)) / comm.size] + [float(10 * (i % comm.size) + i) for i in range(1, 2 * comm.size)]
    want.append(0.0)
    gathered = comm.allgather_object(got)
    assert_all_ranks(comm, got == want and all(g == got for g in gathered), f"{got} != {want}")
    # a rank without costs (its partition could not run on stand-ins): every rank keeps its split
    none = agree(comm, ("same",), None if comm.rank == comm.size - 1 else mine)
    assert_all_ranks(comm, none is None, f"costs {none} although the last rank measured nothing")


@pytest.mark.mpi
def test_agree_raises_a_rank_s_error_or_a_different_key_on_every_rank(comm):
    last = comm.size - 1
    with pytest.raises(FitError, match=f"rank {last}: init failed"):
        agree(comm, ("same",), None, "init failed" if comm.rank == last else None)
    with pytest.raises(FitError, match=rf"ranks \[{last}\] set up the pipeline with a different"):
        agree(comm, ("other",) if comm.rank == last else ("same",), [1.0])


def _trained(pipe: mpitrain.Pipeline, data: list) -> nn.Module:
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        pipe.step(x, y, nn.CrossEntropyLoss())
        opt.step()
    return pipe.trained_model()


@pytest.mark.mpi
@pytest.mark.parametrize("name, schedule", [("skip", "1f1b"), ("resnet", "gpipe"), ("mlp", "zb1p")])
def test_pipeline_built_with_an_example_steps_like_the_lazy_one_and_one_process(comm, name, schedule):
    """float64, 3 steps of SGD with momentum, P = world size (and 2 x 2 on four ranks): the pipeline
    built complete at construction (`example`) cuts where the lazy one cuts on its first step, holds
    only this rank's parameters before any step, and ends with one process's parameters."""
    cls, shape = MODELS[name]
    for P, R in [(comm.size, 1)] + ([(2, 2)] if comm.size == 4 else []):
        torch.manual_seed(0)
        model = cls().double()
        data = [(x.double(), y) for x, y in batches(shape, 4 * R, 3, seed=1)]
        want = reference_train(model, data, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 2 * R)
        kwargs = {"partitions": P, "replicas": R, "micro_batches": 2, "schedule": schedule, "comm": comm,
                  "balance": "params"}
        built = mpitrain.Pipeline(copy.deepcopy(model), example=data[0][0], **kwargs)
        lazy = mpitrain.Pipeline(copy.deepcopy(model), **kwargs)
        assert_all_ranks(comm, built.runtime is not None and lazy.runtime is None, "built / lazy state")
        held = {id(q) for s in built.stages for q in s.part.module.parameters()}
        assert_all_ranks(comm, {id(q) for q in built.parameters()} == held, "parameters() before a step")
        got_built, got_lazy = _trained(built, data), _trained(lazy, data)
        assert_all_ranks(comm, built.bounds == lazy.bounds, f"bounds {built.bounds} != {lazy.bounds}")
        for (pname, a), b, c in zip(got_built.named_parameters(), got_lazy.parameters(), want.parameters()):
            assert_close_all_ranks(comm, a.detach(), b.detach(), atol=1e-12, what=f"built vs lazy {pname}")
            assert_close_all_ranks(comm, a.detach(), c.detach(), atol=1e-10, what=f"built vs one process {pname}")
