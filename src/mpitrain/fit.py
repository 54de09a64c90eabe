"""One entry point, `fit`, for every strategy: the training loop, progress, history and evaluation."""

from __future__ import annotations

import importlib
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sized
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from . import timeline as _timeline
from ._utils.deprecation import renamed_options
from ._utils.stall import StallPolicy
from .comm.base import Communicator
from .runtime import world
from .strategies.base import (
    Balance,
    Batch,
    FitError,
    FitSpec,
    LossFn,
    OptimizerFactory,
    Trainer,
    TrainerFactory,
    is_number,
)

__all__ = ["fit", "make_trainer", "FitResult", "FitSpec", "Trainer", "STRATEGIES", "FitError"]

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

#: Deprecated spellings of fit's stall keywords (kept for one release, with a DeprecationWarning).
STALL_ALIASES = {"stall_timeout": "warn_after", "stall_abort": "abort_after", "stall_warning_s": "warn_after"}
DEFAULT_WARN_AFTER, DEFAULT_ABORT_AFTER = 60.0, 600.0

Metric = Callable[[torch.Tensor, torch.Tensor], float]


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
    factory: TrainerFactory = getattr(importlib.import_module(module), name)
    return factory(model, loss_fn, optimizer, comm, spec)


def stall_policy(warn_after: float, abort_after: float | None, renamed: dict[str, object]) -> StallPolicy:
    """fit's StallPolicy from its keywords and from `renamed`, fit's other options after
    ``renamed_options(options, STALL_ALIASES, "fit")``; takes ``warn_after``/``abort_after`` out of
    `renamed`. FitError for a value given twice or out of range; local, so every rank raises alike."""
    for key, value, default in (("warn_after", warn_after, DEFAULT_WARN_AFTER),
                                ("abort_after", abort_after, DEFAULT_ABORT_AFTER)):
        if key in renamed and value != default:
            raise FitError(f"fit: {key} given twice (as {key}={value!r} and by a deprecated name)")
    warn = renamed.pop("warn_after", warn_after)
    abort = renamed.pop("abort_after", abort_after)
    if not is_number(warn) or not (abort is None or is_number(abort)):
        raise FitError(f"fit: warn_after must be a number of seconds and abort_after one or None, got "
                       f"{warn!r} and {abort!r}")
    assert isinstance(warn, (int, float)) and (abort is None or isinstance(abort, (int, float)))
    try:
        return StallPolicy(warn_after=float(warn), abort_after=None if abort is None else float(abort))
    except ValueError as e:
        raise FitError(f"fit: {e}") from None


def _batch_count(data: object) -> int | None:
    try:  # a DataLoader over an IterableDataset has __len__ and raises TypeError
        return len(data) if isinstance(data, Sized) else None
    except TypeError:
        return None


class _Bar(Protocol):
    """The part of a tqdm progress bar that fit uses."""

    def set_postfix(self, **kwargs: str) -> None: ...
    def update(self, n: int) -> object: ...
    def close(self) -> None: ...


def _progress(total: int | None, desc: str, enabled: bool) -> _Bar | None:
    if not enabled:
        return None
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    bar: _Bar = tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, leave=True)
    return bar


def _evaluate(trainer: Trainer, data: Iterable[tuple[Batch, torch.Tensor]], loss_fn: LossFn,
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


def fit(model: nn.Module, data: Iterable[tuple[Batch, torch.Tensor]], loss_fn: LossFn,
        optimizer: OptimizerFactory, *, strategy: str = "data", partitions: int = 1, replicas: int | None = None,
        micro_batches: int = 1, schedule: str = "1f1b", epochs: int = 1, steps: int | None = None,
        eval_data: Iterable[tuple[Batch, torch.Tensor]] | None = None,
        metrics: Iterable[str | Metric] | Mapping[str, Metric] | None = None,
        comm: Communicator | None = None, progress: bool = True, balance: Balance = "time",
        warn_after: float = DEFAULT_WARN_AFTER, abort_after: float | None = DEFAULT_ABORT_AFTER,
        timeline: str | os.PathLike[str] | None = None, **options: object) -> FitResult:
    """Train `model` on every rank of `comm` (default: the world) with one of :data:`STRATEGIES`.

    `data` yields ``(inputs, targets)`` *global* mini-batches, the same on every rank; the strategy
    slices them, so every strategy computes what one process training on those batches computes
    (up to float rounding, and except where the strategy changes the maths on purpose: pipe-sgd's
    staleness, lossy compression). `optimizer` is a callable ``params -> torch.optim.Optimizer``.
    `steps` caps the optimizer steps per epoch. Strategy-specific keywords go in `options`.
    No wait of the strategy hangs: one still waiting after `warn_after` seconds prints a line naming
    what it waits for (again every `warn_after` seconds); after `abort_after` seconds (None: never) the
    job ends. ``stall_timeout``/``stall_warning_s`` and ``stall_abort`` are deprecated spellings of
    these two. Every rank must call `fit` with the same arguments; bad arguments raise FitError on
    every rank before any message is sent. `timeline` names a Chrome-trace JSON file that rank 0
    writes at the end: a timeline of every rank's steps, compute and messages (docs/timeline.md;
    when a timeline already runs, fit's events go to that one instead).
    """
    if epochs < 1 or (steps is not None and steps < 1):
        raise FitError(f"epochs must be >= 1 and steps None or >= 1, got epochs={epochs}, steps={steps}")
    comm = comm or world()
    named = _metrics(metrics)
    try:  # called here, so that the DeprecationWarning names the caller of fit
        rest = renamed_options(options, STALL_ALIASES, "fit")
    except TypeError as e:
        raise FitError(str(e)) from None
    stall = stall_policy(warn_after, abort_after, rest)
    spec = FitSpec(strategy=strategy, partitions=partitions, replicas=replicas, micro_batches=micro_batches,
                   schedule=schedule, balance=balance, options=rest, stall=stall)
    if timeline is not None and not isinstance(timeline, (str, os.PathLike)):
        raise FitError(f"fit: timeline must be a file path, got {timeline!r}")
    trainer = make_trainer(model, loss_fn, optimizer, comm, spec)
    own_timeline = timeline is not None and not _timeline.active()
    if own_timeline:
        assert timeline is not None
        _timeline.start(timeline, comm)
    try:
        history = _train(trainer, data, loss_fn, comm, epochs, steps, eval_data, named, progress)
        result = FitResult(model=trainer.trained_model(), history=history)
    except BaseException:
        if own_timeline:
            _timeline.discard()
        raise
    if own_timeline:
        _timeline.stop()
    return result


def _train(trainer: Trainer, data: Iterable[tuple[Batch, torch.Tensor]], loss_fn: LossFn, comm: Communicator,
           epochs: int, steps: int | None, eval_data: Iterable[tuple[Batch, torch.Tensor]] | None,
           named: dict[str, Metric], progress: bool) -> list[dict[str, float]]:
    """fit's loop over epochs and steps; the history it returns."""
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
            with _timeline.span("step", epoch=epoch, step=i):
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
    return history
