"""One entry point, `fit`, for every strategy: the training loop, progress, history and evaluation."""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .comm.base import Communicator
from .runtime import world
from .strategies import FitError

__all__ = ["fit", "make_trainer", "FitResult", "FitSpec", "Trainer", "STRATEGIES", "FitError"]

#: strategy name -> "module:factory". The factory is ``make_trainer(model, loss_fn, optimizer, comm,
#: spec) -> Trainer`` and must refuse bad input on every rank before sending any message.
STRATEGIES: dict[str, str] = {
    "data": "mpitrain.strategies.data_parallel:make_trainer",
    "model": "mpitrain.strategies.pipeline:make_trainer",
    "hybrid": "mpitrain.strategies.pipeline:make_trainer",
    "pipe-sgd": "mpitrain.strategies.pipesgd:make_trainer",
    "spatial": "mpitrain.spatial.trainer:make_trainer",
}

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Metric = Callable[[torch.Tensor, torch.Tensor], float]




@dataclass(frozen=True)
class FitSpec:
    """Everything `fit` was told about how to split the work; `options` holds strategy-specific
    keyword arguments (e.g. ``staleness``, ``grid``) that the strategy validates itself."""

    strategy: str = "data"
    partitions: int = 1
    replicas: int | None = None
    micro_batches: int = 1
    schedule: str = "1f1b"
    balance: Any = "time"
    options: Mapping[str, Any] = field(default_factory=dict)


class Trainer(Protocol):
    """What a strategy gives `fit`. Every rank calls every method, with the same global batch."""

    def train_step(self, inputs: Any, targets: torch.Tensor) -> float:
        """One optimizer step on the global mini-batch; returns its mean loss, equal on every rank."""

    def eval_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Forward only (no grad) on the global batch; returns the full outputs on every rank."""

    def trained_model(self) -> nn.Module:
        """A model of the user's class holding the trained weights, on every rank."""


@dataclass
class FitResult:
    """`model`: the user's class with the trained weights (every rank). `history`: per epoch, the mean
    training loss, images/s, and eval loss/metrics when `eval_data` was given."""

    model: nn.Module
    history: list[dict[str, float]]


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    return (outputs.argmax(dim=1) == targets).float().mean().item()


_NAMED_METRICS: dict[str, Metric] = {"accuracy": accuracy}


def _metrics(metrics: Iterable[str | Metric] | Mapping[str, Metric] | None) -> dict[str, Metric]:
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        return dict(metrics)
    out = {}
    for m in metrics:
        if isinstance(m, str):
            if m not in _NAMED_METRICS:
                raise FitError(f"unknown metric {m!r}; named metrics: {sorted(_NAMED_METRICS)} "
                               f"(or pass a callable)")
            out[m] = _NAMED_METRICS[m]
        else:
            out[getattr(m, "__name__", repr(m))] = m
    return out


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> Trainer:
    """The strategy's Trainer for `spec` (what `fit` drives; benchmarks time its steps directly)."""
    if spec.strategy not in STRATEGIES:
        raise FitError(f"unknown strategy {spec.strategy!r}; choose one of {sorted(STRATEGIES)}")
    module, _, name = STRATEGIES[spec.strategy].partition(":")
    return getattr(importlib.import_module(module), name)(model, loss_fn, optimizer, comm, spec)


def _batch_count(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None


def _progress(total: int | None, desc: str, enabled: bool):  # -> tqdm | None
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, leave=True)


def _evaluate(trainer: Trainer, data: Iterable, loss_fn: LossFn,
              metrics: dict[str, Metric]) -> dict[str, float]:
    totals: dict[str, float] = {}
    count = 0
    for inputs, targets in data:
        outputs = trainer.eval_step(inputs, targets)
        n = len(targets)
        with torch.no_grad():
            totals["eval_loss"] = totals.get("eval_loss", 0.0) + float(loss_fn(outputs, targets)) * n
        for name, fn in metrics.items():
            totals[f"eval_{name}"] = totals.get(f"eval_{name}", 0.0) + float(fn(outputs, targets)) * n
        count += n
    return {k: v / max(count, 1) for k, v in totals.items()}


def fit(model: nn.Module, data: Iterable, loss_fn: LossFn, optimizer: OptimizerFactory, *,
        strategy: str = "data", partitions: int = 1, replicas: int | None = None, micro_batches: int = 1,
        schedule: str = "1f1b", epochs: int = 1, steps: int | None = None, eval_data: Iterable | None = None,
        metrics: Iterable[str | Metric] | Mapping[str, Metric] | None = None,
        comm: Communicator | None = None, progress: bool = True, balance: Any = "time",
        **options: Any) -> FitResult:
    """Train `model` on every rank of `comm` (default: the world) with one of :data:`STRATEGIES`.

    `data` yields ``(inputs, targets)`` *global* mini-batches, the same on every rank; the strategy
    slices them, so every strategy computes what one process training on those batches computes
    (up to float rounding, and except where the strategy changes the maths on purpose: pipe-sgd's
    staleness, lossy compression). `optimizer` is a callable ``params -> torch.optim.Optimizer``.
    `steps` caps the optimizer steps per epoch. Strategy-specific keywords go in `options`.
    Every rank must call `fit` with the same arguments.
    """
    if epochs < 1 or (steps is not None and steps < 1):
        raise FitError(f"epochs must be >= 1 and steps None or >= 1, got epochs={epochs}, steps={steps}")
    comm = comm or world()
    named = _metrics(metrics)
    spec = FitSpec(strategy=strategy, partitions=partitions, replicas=replicas, micro_batches=micro_batches,
                   schedule=schedule, balance=balance, options=dict(options))
    trainer = make_trainer(model, loss_fn, optimizer, comm, spec)
    history: list[dict[str, float]] = []
    show = progress and comm.rank == 0
    for epoch in range(epochs):
        total = _batch_count(data)
        total = min(total, steps) if (total is not None and steps is not None) else (total or steps)
        bar = _progress(total, f"epoch {epoch + 1}/{epochs}", show)
        loss_sum, samples, t0 = 0.0, 0, time.perf_counter()
        for i, (inputs, targets) in enumerate(data):
            if steps is not None and i >= steps:
                break
            loss = trainer.train_step(inputs, targets)
            loss_sum += loss * len(targets)
            samples += len(targets)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}")
                bar.update(1)
        elapsed = time.perf_counter() - t0
        if bar is not None:
            bar.close()
        record = {"epoch": float(epoch + 1), "loss": loss_sum / max(samples, 1),
                  "samples_per_s": samples / elapsed if elapsed > 0 else math.nan}
        if eval_data is not None:
            record.update(_evaluate(trainer, eval_data, loss_fn, named))
        history.append(record)
        if show:
            print("  ".join(f"{k}={v:.4g}" for k, v in record.items()), flush=True)
    return FitResult(model=trainer.trained_model(), history=history)
