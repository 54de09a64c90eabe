"""Training strategies: data parallel, pipeline (model/hybrid), pipe-sgd. Each exposes make_trainer."""

__all__ = ["FitError"]


class FitError(ValueError):
    """`fit` was called with something inconsistent (world size, partitions, batch, options); every
    strategy raises it on every rank before any message is sent, saying what to change."""
