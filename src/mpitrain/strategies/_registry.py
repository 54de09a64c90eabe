"""The strategy table: every `fit(strategy=...)` name and the factory that builds its Trainer.

Factories are named as "module:attribute" strings and imported on first use, so this table (below
`fit` and the planner) imports none of the strategies, and a strategy's heavy imports cost nothing until
it is chosen."""

from __future__ import annotations

import importlib

from torch import nn

from ..comm.base import Communicator
from .base import FitError, FitSpec, LossFn, OptimizerFactory, Trainer, TrainerFactory

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
    "auto": "mpitrain.planner:make_trainer",
}


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> Trainer:
    """The strategy's Trainer for `spec` (what `fit` drives; benchmarks and the planner time its steps)."""
    if spec.strategy not in STRATEGIES:
        raise FitError(f"unknown strategy {spec.strategy!r}; choose one of {sorted(STRATEGIES)}")
    module, _, name = STRATEGIES[spec.strategy].partition(":")
    factory: TrainerFactory = getattr(importlib.import_module(module), name)
    return factory(model, loss_fn, optimizer, comm, spec)


def features(strategy: str) -> frozenset[str]:
    """The loop features `strategy` declares (its module's FEATURES: "checkpoint", "grad_clip", ...).
    Imports the strategy's module, sends nothing; FitError for an unknown name."""
    if strategy not in STRATEGIES:
        raise FitError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    module = importlib.import_module(STRATEGIES[strategy].partition(":")[0])
    return frozenset(getattr(module, "FEATURES", frozenset()))
