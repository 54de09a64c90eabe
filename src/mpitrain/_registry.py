"""The strategy table: every concrete `fit(strategy=...)` name and the factory that builds its Trainer.

It sits above the strategies and spatial and below the planner (docs/ARCHITECTURE.md, Layers): the planner
builds its chosen plan's trainer through it, and `fit.STRATEGIES` is this table plus "auto" (the planner).
Factories are named as "module:attribute" strings and imported on first use, so this table imports none
of the strategies, and a strategy's heavy imports cost nothing until it is chosen."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from torch import nn

from .comm.base import Communicator
from .strategies.base import FEATURE_NAMES, FitError, FitSpec, LossFn, OptimizerFactory, Trainer, TrainerFactory

__all__ = ["STRATEGIES", "make_trainer", "features"]

#: strategy name -> "module:factory". The factory is a :data:`~mpitrain.strategies.base.TrainerFactory`,
#: ``make_trainer(model, loss_fn, optimizer, comm, spec) -> Trainer``, and must refuse bad input on every
#: rank before sending any message.
STRATEGIES: dict[str, str] = {
    "data": "mpitrain.strategies.data_parallel:make_trainer",
    "model": "mpitrain.strategies.pipeline:make_trainer",
    "hybrid": "mpitrain.strategies.pipeline:make_trainer",
    "pipe-sgd": "mpitrain.strategies.pipesgd:make_trainer",
    "spatial": "mpitrain.spatial.trainer:make_trainer",
}


def _entry(strategy: str, table: Mapping[str, str]) -> tuple[str, str]:
    """(module, factory name) of `strategy` in `table`; FitError for an unknown name."""
    if strategy not in table:
        raise FitError(f"unknown strategy {strategy!r}; choose one of {sorted(table)}")
    module, _, name = table[strategy].partition(":")
    return module, name


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec, table: Mapping[str, str] = STRATEGIES) -> Trainer:
    """The Trainer of `spec.strategy` as `table` names it (what `fit` drives; benchmarks and the planner
    time its steps)."""
    module, name = _entry(spec.strategy, table)
    factory: TrainerFactory = getattr(importlib.import_module(module), name)
    return factory(model, loss_fn, optimizer, comm, spec)


def features(strategy: str, table: Mapping[str, str] = STRATEGIES) -> frozenset[str]:
    """The loop features `strategy` supports: all of :data:`~mpitrain.strategies.base.FEATURE_NAMES`
    (its trainer is a StepTrainer) unless its module declares fewer in ``FEATURES`` (strategy "auto").
    Imports the strategy's module, sends nothing; FitError for an unknown name."""
    module = importlib.import_module(_entry(strategy, table)[0])
    return frozenset(getattr(module, "FEATURES", FEATURE_NAMES))
