"""Model (pipeline) and hybrid parallelism of an unmodified model, HyPar-Flow style."""

from .trainer import make_trainer

__all__ = ["make_trainer"]
