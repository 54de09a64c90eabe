"""``fit(..., strategy="auto")``: plan on the first batch, then train with ``plan(...)[0]``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from .._registry import make_trainer as build
from ..comm.base import Communicator
from ..strategies.base import (
    Batch,
    FitError,
    FitSpec,
    LossFn,
    OptimizerFactory,
    StrategyOptions,
    Trainer,
    require_whole_model,
)
from ._plan import plan
from ._types import Plans, spec_for

__all__ = ["AutoOptions", "AutoTrainer", "make_trainer", "FEATURES"]

#: None of fit's loop features (strategies/base.py: FEATURE_NAMES): the trainer exists only after the
#: plan, on the first batch, so there is no share, optimizer or layout before it; fit refuses them.
FEATURES: frozenset[str] = frozenset()

#: Runners-up printed under the chosen plan.
RUNNERS_UP = 3


@dataclass(frozen=True)
class AutoOptions(StrategyOptions):
    """Options of ``fit(strategy="auto", ...)``: passed to :func:`~mpitrain.planner.plan`. `exact`
    (default True) trains only with a plan that computes what one process computes; ``exact=False``
    also admits pipe-sgd with staleness or lossy compression when the planner predicts them faster
    (with staleness K the first K steps apply no update)."""

    strategy: ClassVar[str] = "auto"
    memory_limit: float | str | None = None
    strategies: tuple[str, ...] | None = None
    cache: bool | str = True
    exact: bool = True

    def __post_init__(self) -> None:
        if self.strategies is not None:
            self.require("strategies", isinstance(self.strategies, (list, tuple, set, frozenset)),
                         "a collection of strategy names")
            self.replace_value("strategies", tuple(self.strategies))
        self.require("cache", isinstance(self.cache, (bool, str)), "True, False or a folder")
        self.require("exact", isinstance(self.exact, bool), "True or False")


class AutoTrainer:
    """Plans on the first batch it sees (every rank, collectively), then delegates to the chosen
    strategy's trainer. `plans` and `record` (what fit adds to its history) exist after that batch."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec, opts: AutoOptions) -> None:
        self.model, self.loss_fn, self.optimizer, self.comm, self.spec, self.opts = (
            model, loss_fn, optimizer, comm, spec, opts)
        self.inner: Trainer | None = None
        self.plans: Plans | None = None
        self.record: dict[str, Any] = {}

    def _start(self, inputs: Batch, targets: torch.Tensor) -> Trainer:
        if self.inner is not None:
            return self.inner
        plans = plan(self.model, (inputs, targets), self.loss_fn, comm=self.comm, memory_limit=self.opts.memory_limit,
                     strategies=self.opts.strategies, exact=self.opts.exact, cache=self.opts.cache,
                     warn_after=self.spec.stall.warn_after, abort_after=self.spec.stall.abort_after)
        if not plans:
            raise FitError("strategy 'auto': no plan fits this model, batch and memory limit:\n"
                           + plans.explanation())
        chosen = plans[0]
        if self.comm.rank == 0:
            print(f"auto: {chosen.describe()}  (predicted {chosen.step_s * 1e3:.1f} ms/step, "
                  f"{chosen.memory_bytes / 2**20:.0f} MiB/rank)", flush=True)
            for p in plans[1:1 + RUNNERS_UP]:
                print(f"  runner-up: {p.describe()}  ({p.step_s * 1e3:.1f} ms/step)", flush=True)
        self.inner = build(self.model, self.loss_fn, self.optimizer, self.comm, spec_for(chosen, self.spec))
        self.plans = plans
        self.record = {"plan": chosen.describe(), "plan_step_s": chosen.step_s}
        return self.inner

    def train_step(self, inputs: Batch, targets: torch.Tensor) -> float:
        return self._start(inputs, targets).train_step(inputs, targets)

    def eval_step(self, inputs: Batch, targets: torch.Tensor) -> torch.Tensor:
        return self._start(inputs, targets).eval_step(inputs, targets)

    def trained_model(self) -> nn.Module:
        return self.model if self.inner is None else self.inner.trained_model()


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> AutoTrainer:
    """fit's factory for ``strategy="auto"``: options ``memory_limit``, ``strategies``, ``exact`` (default
    True) and ``cache`` (see :func:`~mpitrain.planner.plan`); partitions, replicas and micro_batches are the planner's
    to choose, so they must be left at their defaults (FitError on every rank before any message)."""
    require_whole_model(spec, comm)
    if spec.micro_batches != 1:
        raise FitError("strategy 'auto' chooses micro_batches itself: leave it at 1")
    return AutoTrainer(model, loss_fn, optimizer, comm, spec, AutoOptions.from_spec(spec))
