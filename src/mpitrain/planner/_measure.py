"""Run a plan: for a few steps, timed (what ``mpitrain plan --measure`` and ``bench planner`` compare the
predictions with), or one forward on a few rows (whether the plan can run the model at all)."""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from .._registry import make_trainer
from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm import wait_request
from ..comm.base import Communicator
from ..strategies import Trainer
from ..strategies.base import Batch, FitError, FitSpec, LossFn
from ._types import Plan, spec_for

__all__ = ["measure_plan", "trial_forward"]


def _trainer(model: nn.Module, chosen: Plan, loss_fn: LossFn, comm: Communicator,
             stall: StallPolicy = DEFAULT_POLICY) -> Trainer:
    """The trainer `fit` would build for `chosen` (SGD), waits bounded by `stall`. Collective."""
    return make_trainer(model, loss_fn, lambda p: torch.optim.SGD(p, lr=1e-3), comm,
                        spec_for(chosen, FitSpec(stall=stall)))


def measure_plan(make_model: Callable[[], nn.Module], chosen: Plan, batch: tuple[Batch, torch.Tensor],
                 loss_fn: LossFn, comm: Communicator, steps: int = 5, warmup: int = 2,
                 stall: StallPolicy = DEFAULT_POLICY) -> float:
    """Median seconds per optimizer step of `chosen` on `batch` (SGD), after `warmup` steps; every
    step is timed from a barrier to its end on the slowest rank (an allreduce of the times); the
    trainer's waits are bounded by `stall`. Collective: every rank calls with the same arguments and gets
    the same number."""
    trainer = _trainer(make_model(), chosen, loss_fn, comm, stall)
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


def trial_forward(model: nn.Module, chosen: Plan, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: LossFn,
                  comm: Communicator, rows: int, stall: StallPolicy = DEFAULT_POLICY) -> str | None:
    """None if `chosen`'s trainer runs the forward of `model` (a copy) on the first `rows` samples of
    `batch` (``eval_step``: the path fit's steps take, on every rank's block or share), else why not:
    the first failing rank's exception, the same text on every rank.

    Each rank catches its own exception, then one allreduce of the verdicts (a flag per rank) and, on a
    failure, a broadcast of the first failing rank's text. The strategy's own messages (halo exchanges,
    on its private communicators) are bounded by `stall`, and so is the verdict's wait: a rank that failed
    while another waits in a message of the forward ends the job after ``stall.abort_after``, saying what
    it waited for — never a hang. Collective over `comm`."""
    error: BaseException | None = None
    try:
        trainer = _trainer(copy.deepcopy(model), chosen, loss_fn, comm, stall)
        trainer.eval_step(batch[0][:rows], batch[1][:rows])
    except Exception as e:  # any failure of the model's forward is the verdict; a strategy's FitError names its cause
        error = e.__cause__ if isinstance(e, FitError) and isinstance(e.__cause__, Exception) else e
    failed = torch.zeros(comm.size, dtype=torch.float64)
    failed[comm.rank] = float(error is not None)
    if comm.size > 1:
        wait_request(comm.iallreduce(failed, op="max"),
                     lambda: f"the other ranks' verdicts on a trial forward of {chosen.describe()}", stall,
                     who=f"rank {comm.rank}", abort=comm.abort)
    first = next((r for r, f in enumerate(failed.tolist()) if f), None)
    if first is None:
        return None
    text = f"{type(error).__name__}: {error}" if error is not None else None
    if comm.size > 1:
        text = comm.broadcast_object(text, first)
    return f"rank {first}: {text}"
