"""mpitrain: train ordinary PyTorch models across many processes over MPI."""

from __future__ import annotations

import importlib
from typing import Any

from .comm import CommError, Communicator, Request

# Imported eagerly: the function `fit` must shadow the submodule `mpitrain.fit` for good (a lazy
# lookup loses to the attribute the import system sets when any module imports mpitrain.fit).
from .fit import FitError, FitResult, LoopState, StopTraining, fit
from .runtime import device, init, local_rank, rank, size
from .runtime import on_init as _on_init
from .timeline import start_from_env as _timeline_from_env

# MPITRAIN_TIMELINE=trace.json starts a timeline when init() builds the world: wired here, at the top,
# because runtime sits below the timeline and does not import it (docs/ARCHITECTURE.md).
_on_init(_timeline_from_env)

__version__ = "0.1.0"

# Public names that live in heavier modules, imported on first use: name -> (module, attribute);
# attribute None exports the module itself as a namespace (mpitrain.kvstore.create, ...).
_LAZY: dict[str, tuple[str, str | None]] = {
    "DataParallel": ("mpitrain.strategies.data_parallel", "DataParallel"),
    "Pipeline": ("mpitrain.strategies.pipeline", "Pipeline"),
    "broadcast_parameters": ("mpitrain.strategies.data_parallel", "broadcast_parameters"),
    "broadcast_optimizer_state": ("mpitrain.strategies.data_parallel", "broadcast_optimizer_state"),
    "load_checkpoint": ("mpitrain.checkpoint", "load_checkpoint"),
    "engine": ("mpitrain.engine", None),
    "kvstore": ("mpitrain.kvstore", None),
    "spatial": ("mpitrain.spatial", None),
    "plan": ("mpitrain.planner", "plan"),
    # each strategy's options dataclass: fit(strategy=DataOptions(zero=1)) runs "data" with them
    "DataOptions": ("mpitrain.strategies.data_parallel", "DataOptions"),
    "PipelineOptions": ("mpitrain.strategies.pipeline", "PipelineOptions"),
    "PipeSGDOptions": ("mpitrain.strategies.pipesgd", "PipeSGDOptions"),
    "SpatialOptions": ("mpitrain.spatial.trainer", "SpatialOptions"),
    "AutoOptions": ("mpitrain.planner", "AutoOptions"),
    "Plan": ("mpitrain.planner", "Plan"),
}

__all__ = [
    "init", "rank", "size", "local_rank", "device",
    "Communicator", "Request", "CommError",
    "fit", "FitResult", "FitError", "StopTraining", "LoopState",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module_name, attr = _LAZY[name]
        module = importlib.import_module(module_name)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'mpitrain' has no attribute {name!r}")
