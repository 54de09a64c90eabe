"""The "model" and "hybrid" strategies behind `fit`: a thin loop over :class:`._pipe.Pipeline`.

Set-up (capture, measurement, partition) happens on the first batch; the optimizer is built then, from
this rank's parameters. "model" is one replica of ``partitions == world size``; "hybrid" is
``partitions x replicas == world size``. Arguments are checked on every rank before any message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..._utils.stall import StallPolicy
from ...comm.base import Communicator
from .. import FitError
from ._pipe import Pipeline

__all__ = ["make_trainer", "PipelineTrainer", "OPTIONS"]

#: Strategy options (``fit(..., stall_timeout=60)``): seconds before a stage waiting for a message warns
#: (naming it), seconds after which such a wait ends the job (None: never), the profiling passes of
#: ``balance="time"``, activation recomputation, the virtual stages of interleaved-1f1b, and the
#: seed and per-module initialiser of a model on the meta device (see :class:`Pipeline`).
OPTIONS: dict[str, Any] = {"stall_timeout": 60.0, "stall_abort": 600.0, "profile_passes": 5,
                           "checkpoint": "never", "virtual_stages": 2, "seed": 0, "init_fn": None}


def _check_spec(spec: Any, size: int) -> dict[str, Any]:
    if spec.strategy not in ("model", "hybrid"):
        raise FitError(f"the pipeline trainer runs strategies 'model' and 'hybrid', not {spec.strategy!r}")
    if spec.strategy == "model":
        if spec.replicas not in (None, 1):
            raise FitError(f"strategy 'model' has one replica (got replicas={spec.replicas}); "
                           f"use strategy='hybrid'")
        if spec.partitions != size:
            raise FitError(f"strategy 'model' needs partitions == world size; got partitions={spec.partitions} "
                           f"on {size} ranks: pass partitions={size}")
    unknown = set(spec.options) - set(OPTIONS)
    if unknown:
        raise FitError(f"unknown option(s) {sorted(unknown)} for strategy {spec.strategy!r}; "
                       f"known: {sorted(OPTIONS)}")
    return {**OPTIONS, **spec.options}


def make_trainer(model: nn.Module, loss_fn: Callable, optimizer: Callable, comm: Communicator,
                 spec: Any) -> PipelineTrainer:
    """Validate `spec` locally (same verdict on every rank) and create the pipeline's communicators."""
    opts = _check_spec(spec, comm.size)
    abort = opts["stall_abort"]
    pipe = Pipeline(model, spec.partitions, spec.replicas, spec.micro_batches, spec.schedule, comm,
                    opts["checkpoint"], balance=spec.balance, virtual_stages=opts["virtual_stages"],
                    stall=StallPolicy(float(opts["stall_timeout"]), None if abort is None else float(abort)),
                    profile_passes=opts["profile_passes"], seed=opts["seed"], init_fn=opts["init_fn"])
    return PipelineTrainer(pipe, loss_fn, optimizer)


class PipelineTrainer:
    """`fit`'s Trainer over a :class:`Pipeline`. Every rank calls every method with the same batch."""

    def __init__(self, pipe: Pipeline, loss_fn: Callable, optimizer: Callable) -> None:
        self.pipe, self.loss_fn, self.make_optimizer = pipe, loss_fn, optimizer
        self.optimizer: torch.optim.Optimizer | None = None
        self._built = False

    def train_step(self, inputs: Any, targets: Any) -> float:
        if self.pipe.stages:  # fit's steps start from zero gradients (Pipeline.step adds to them)
            for q in self.pipe.parameters():
                q.grad = None
        loss = self.pipe.step(inputs, targets, self.loss_fn)
        if not self._built:
            params = list(self.pipe.parameters())
            self.optimizer = self.make_optimizer(params) if params else None
            self._built = True
        if self.optimizer is not None:
            self.optimizer.step()
        return loss

    @property
    def bounds(self) -> list[int]:
        """Where the captured graph was cut (node indices ``[0, c1, ..., n]``), once set up."""
        return self.pipe.bounds

    def eval_step(self, inputs: Any, targets: Any) -> Any:
        """Forward only, in eval mode; any batch size."""
        return self.pipe.eval(inputs)

    def trained_model(self) -> nn.Module:
        return self.pipe.trained_model()
