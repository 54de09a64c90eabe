"""Training strategies: data parallel, pipeline (model/hybrid), pipe-sgd. Each module named in
``strategies._registry.STRATEGIES`` exposes ``make_trainer(model, loss_fn, optimizer, comm, spec) -> Trainer``;
what they share lives in :mod:`.base`."""

from .base import FitError, FitSpec, StrategyOptions, Trainer

__all__ = ["FitError", "FitSpec", "StrategyOptions", "Trainer"]
