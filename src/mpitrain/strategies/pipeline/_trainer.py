"""The "model" and "hybrid" strategies behind `fit`: a thin loop over :class:`._pipe.Pipeline`.

Set-up (capture, measurement, partition) happens on the first batch; the optimizer is built then, from
this rank's parameters. "model" is one replica of ``partitions == world size``; "hybrid" is
``partitions x replicas == world size``. Arguments are checked on every rank before any message.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ...comm.base import Communicator
from ..base import FitError, FitSpec, LossFn, OptimizerFactory, StrategyOptions, is_int
from ._materialize import InitFn
from ._pipe import CHECKPOINTS, Pipeline

__all__ = ["make_trainer", "PipelineTrainer", "PipelineOptions"]


@dataclass(frozen=True)
class PipelineOptions(StrategyOptions):
    """Options of ``fit(strategy="model"|"hybrid", ...)``: the profiling passes of ``balance="time"``,
    activation recomputation (:data:`CHECKPOINTS`), the virtual stages of interleaved-1f1b, and the
    seed and per-module initialiser of a model on the meta device (see :class:`Pipeline`). Waits
    follow ``spec.stall`` (fit's `warn_after`/`abort_after`)."""

    strategy: ClassVar[str] = "model/hybrid"
    profile_passes: int = 5
    checkpoint: str = "never"
    virtual_stages: int = 2
    seed: int = 0
    init_fn: InitFn | None = None

    def __post_init__(self) -> None:
        self.require("profile_passes", is_int(self.profile_passes) and self.profile_passes >= 1, "an int >= 1")
        self.require("checkpoint", self.checkpoint in CHECKPOINTS, f"one of {CHECKPOINTS}")
        self.require("virtual_stages", is_int(self.virtual_stages) and self.virtual_stages >= 1, "an int >= 1")
        self.require("seed", is_int(self.seed), "an int")
        self.require("init_fn", self.init_fn is None or callable(self.init_fn), "None or a callable(module)")


def _check_spec(spec: FitSpec, size: int) -> PipelineOptions:
    if spec.strategy not in ("model", "hybrid"):
        raise FitError(f"the pipeline trainer runs strategies 'model' and 'hybrid', not {spec.strategy!r}")
    if spec.strategy == "model":
        if spec.replicas not in (None, 1):
            raise FitError(f"strategy 'model' has one replica (got replicas={spec.replicas}); "
                           f"use strategy='hybrid'")
        if spec.partitions != size:
            raise FitError(f"strategy 'model' needs partitions == world size; got partitions={spec.partitions} "
                           f"on {size} ranks: pass partitions={size}")
    return PipelineOptions.from_spec(spec)


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> PipelineTrainer:
    """Validate `spec` locally (same verdict on every rank) and create the pipeline's communicators."""
    opts = _check_spec(spec, comm.size)
    pipe = Pipeline(model, spec.partitions, spec.replicas, spec.micro_batches, spec.schedule, comm,
                    opts.checkpoint, balance=spec.balance, virtual_stages=opts.virtual_stages, stall=spec.stall,
                    profile_passes=opts.profile_passes, seed=opts.seed, init_fn=opts.init_fn)
    return PipelineTrainer(pipe, loss_fn, optimizer)


class PipelineTrainer:
    """`fit`'s Trainer over a :class:`Pipeline`. Every rank calls every method with the same batch."""

    def __init__(self, pipe: Pipeline, loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer: OptimizerFactory) -> None:
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
