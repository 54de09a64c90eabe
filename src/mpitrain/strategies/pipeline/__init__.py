"""Model (pipeline) and hybrid parallelism of an unmodified model, HyPar-Flow style.

Public surface: :class:`Pipeline` (the user's own loop), ``make_trainer`` (what ``fit(strategy=
"model"|"hybrid")`` runs), the schedules as data (:mod:`.schedule`) and :class:`TraceFailure`; and for
the planner, which prices pipelines on the same graph the strategy cuts: the capture (``capture``,
``model_args``), its per-node measurements (``profile``, ``measure``, ``param_counts``), where it
may be cut (``local_nodes``, ``cut_points``) and the partitioning rule (``balanced_bounds``)."""

from ._graph import (
    Traced,
    TraceFailure,
    ValueMeta,
    capture,
    cut_points,
    local_nodes,
    measure,
    model_args,
    param_counts,
    profile,
)
from ._partition import balanced_bounds
from ._pipe import CHECKPOINTS, Pipeline
from ._trainer import PipelineOptions, make_trainer
from .schedule import SCHEDULES

__all__ = ["Pipeline", "make_trainer", "PipelineOptions", "TraceFailure", "SCHEDULES", "CHECKPOINTS",
           "Traced", "ValueMeta", "capture", "model_args", "profile", "measure", "param_counts", "local_nodes",
           "cut_points", "balanced_bounds"]
