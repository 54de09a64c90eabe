"""The planner: which strategy, with which options, trains a model fastest on these ranks.

It sits between ``fit`` and the strategies: it calibrates on the ranks (per-layer compute, the
network's alpha-beta, Pipe-SGD's constants), prices every candidate with the cost models of
:mod:`mpitrain.perf`, and builds the chosen strategy's trainer for ``fit(strategy="auto")``.
"""

from ._auto import FEATURES, AutoOptions, make_trainer
from ._measure import measure_plan
from ._plan import plan
from ._types import Dropped, Plan, PlanError, Plans

__all__ = ["plan", "Plan", "Plans", "Dropped", "PlanError", "make_trainer", "measure_plan", "FEATURES", "AutoOptions"]
