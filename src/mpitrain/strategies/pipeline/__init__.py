"""Model (pipeline) and hybrid parallelism of an unmodified model, HyPar-Flow style.

Public surface: :class:`Pipeline` (the user's own loop), ``make_trainer`` (what ``fit(strategy=
"model"|"hybrid")`` runs), the schedules as data (:mod:`.schedule`) and :class:`TraceFailure`."""

from ._graph import TraceFailure
from ._pipe import CHECKPOINTS, Pipeline
from ._trainer import FEATURES, make_trainer
from .schedule import SCHEDULES

__all__ = ["Pipeline", "make_trainer", "FEATURES", "TraceFailure", "SCHEDULES", "CHECKPOINTS"]
