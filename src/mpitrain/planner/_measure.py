"""Run a plan for a few steps and time them: what ``mpitrain plan --measure`` and ``bench planner``
compare the predictions with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from .._registry import make_trainer
from ..comm.base import Communicator
from ..strategies.base import Batch, FitSpec, LossFn
from ._types import Plan, spec_for

__all__ = ["measure_plan"]


def measure_plan(make_model: Callable[[], nn.Module], chosen: Plan, batch: tuple[Batch, torch.Tensor],
                 loss_fn: LossFn, comm: Communicator, steps: int = 5, warmup: int = 2) -> float:
    """Median seconds per optimizer step of `chosen` on `batch` (SGD), after `warmup` steps; every
    step is timed from a barrier to its end on the slowest rank (an allreduce of the times). Collective:
    every rank calls with the same arguments and gets the same number."""
    trainer = make_trainer(make_model(), loss_fn, lambda p: torch.optim.SGD(p, lr=1e-3), comm,
                           spec_for(chosen, FitSpec()))
    inputs, targets = batch
    for _ in range(warmup):
        trainer.train_step(inputs, targets)
    times = []
    for _ in range(steps):
        comm.barrier()
        t0 = time.perf_counter()
        trainer.train_step(inputs, targets)
        times.append(time.perf_counter() - t0)
    local = torch.tensor(times, dtype=torch.float64)
    if comm.size > 1:
        comm.allreduce(local, op="max")
    trainer.trained_model()  # ends the strategy's background work (pipe-sgd's communication thread)
    return float(statistics.median(local.tolist()))
