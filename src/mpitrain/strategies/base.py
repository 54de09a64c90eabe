"""What every strategy shares with `fit`: the `Trainer` protocol, the `FitSpec` it is built from,
the one error type `FitError`, and `StrategyOptions`, the base of each strategy's typed options.

A strategy is a factory ``make_trainer(model, loss_fn, optimizer, comm, spec: FitSpec) -> Trainer``
(see :data:`TrainerFactory`) that refuses bad input with :class:`FitError` on every rank before any
message is sent. Its keyword options (``fit(..., staleness=2)``) arrive untyped in ``spec.options``;
the strategy turns them into a frozen dataclass in one call, ``MyOptions.from_spec(spec)``, which
refuses unknown names and bad values (FitError, a local check: the same verdict on every rank).

Declaring a strategy's options::

    @dataclass(frozen=True)
    class ShuffleOptions(StrategyOptions):
        strategy: ClassVar[str] = "shuffle"     # named in error messages
        rounds: int = 1                          # fit(..., rounds=3); the default when not given
        mode: str = "ring"

        def __post_init__(self) -> None:         # every check of a value lives here
            self.require("rounds", is_int(self.rounds) and self.rounds >= 1, "an int >= 1")
            self.require("mode", self.mode in ("ring", "tree"), "'ring' or 'tree'")

    def make_trainer(model, loss_fn, optimizer, comm, spec: FitSpec) -> ShuffleTrainer:
        opts = ShuffleOptions.from_spec(spec)    # FitError: unknown option / bad value
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar, Protocol, Self, TypeAlias, TypeGuard

import torch
from torch import nn

from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm.base import Communicator
from ._scaler import ScalerSpec

__all__ = ["FitError", "FitSpec", "LoopSpec", "DEFAULT_LOOP", "Trainer", "ShardedTrainer", "CheckpointTrainer", "Share",
           "BatchShare", "FEATURE_NAMES", "ScalerSpec",
           "TrainerFactory", "StrategyOptions", "Batch", "Balance", "LossFn",
           "OptimizerFactory", "is_int", "is_number", "require_whole_model"]


class FitError(ValueError):
    """`fit` was called with something inconsistent (world size, partitions, batch, options); every
    strategy raises it on every rank before any message is sent, saying what to change."""


#: The inputs of a global mini-batch: one tensor, a tuple/list of positional inputs of the model, or a
#: dict of keyword inputs (``{"input_ids": ..., "attention_mask": ...}``); every tensor with a dimension
#: is sliced along dim 0, anything else is passed as is (``strategies._batching``).
Batch: TypeAlias = torch.Tensor | tuple[object, ...] | list[object] | dict[str, object]
#: How the pipeline strategies weigh nodes: "time", "params" or node counts per partition.
Balance: TypeAlias = str | Sequence[int]
LossFn: TypeAlias = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory: TypeAlias = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


#: The loop features of fit that ask something of the trainer. Every concrete strategy supports every
#: one (its trainer is a :class:`~.step.StepTrainer`); a strategy module that cannot declares the ones
#: it does support in a module-level ``FEATURES`` frozenset next to its ``make_trainer`` (today only
#: "auto", which plans on its first batch: before it there is no share, optimizer or layout), and `fit`
#: refuses, on every rank and before any message, a run that needs one it lacks:
#:
#: * ``"shares"``: each rank reads only its rows of a global batch (:class:`ShardedTrainer`; uneven
#:   batches; ``accumulate``). Without it fit hands every rank the whole global batch through
#:   ``train_step`` (read on every rank) and ``accumulate`` must be 1.
#: * ``"checkpoint"``: :class:`CheckpointTrainer` (``checkpoint_dir``, ``resume``).
#: * ``"lr_scheduler"``: an ``optimizer`` attribute (this rank's optimizer, stepped once per step),
#:   which fit hands to ``lr_scheduler`` and steps the scheduler on per step or per epoch (``lr_interval``).
#: * ``"grad_clip"``: clipping by ``spec.loop.grad_clip``: the norm of the WHOLE model's gradient (all
#:   partitions, after averaging over replicas), so it equals one process's ``clip_grad_norm_``, applied
#:   right before each optimizer step.
#: * ``"bf16"``: forward and loss under ``torch.autocast(device, torch.bfloat16)`` when
#:   ``spec.loop.precision == "bf16"`` (parameters, gradients and optimizer state stay in their dtype).
#: * ``"fp16"``: forward and loss under ``torch.autocast(device, torch.float16)`` when
#:   ``spec.loop.precision == "fp16"``, the loss times the loss scale before backward, and the step
#:   unscaled, skipped on every rank alike when any rank's gradient is not finite (:mod:`._scaler`).
FEATURE_NAMES = ("shares", "checkpoint", "lr_scheduler", "grad_clip", "bf16", "fp16")


@dataclass(frozen=True)
class LoopSpec:
    """The loop features `fit` asks of the trainer itself (see :data:`FEATURE_NAMES`): `grad_clip`
    (max global norm, None: no clipping), `precision` ("fp32", "bf16" or "fp16") and, for "fp16", the
    loss scaler's numbers (`scaler`). A strategy that does not declare a feature is never given a
    non-default value for it."""

    grad_clip: float | None = None
    precision: str = "fp32"
    scaler: ScalerSpec = ScalerSpec()


#: LoopSpec(): no clipping, fp32.
DEFAULT_LOOP = LoopSpec()


@dataclass(frozen=True)
class FitSpec:
    """Everything `fit` was told about how to split the work.

    `options` holds the strategy-specific keywords (e.g. ``staleness``, ``grid``) as given, or the
    strategy's options dataclass itself (``fit(strategy=DataOptions(zero=1))``); the strategy reads either
    with its :class:`StrategyOptions` (``from_spec``). `stall` bounds every wait of the strategy: it
    warns after ``stall.warn_after`` seconds and ends the job after ``stall.abort_after``
    (``fit(..., warn_after=, abort_after=)``)."""

    strategy: str = "data"
    partitions: int = 1
    replicas: int | None = None
    micro_batches: int = 1
    schedule: str = "1f1b"
    balance: Balance = "time"
    options: Mapping[str, object] | StrategyOptions = field(default_factory=dict)
    stall: StallPolicy = DEFAULT_POLICY
    loop: LoopSpec = DEFAULT_LOOP


class Trainer(Protocol):
    """What a strategy gives `fit`. Every rank calls every method, with the same global batch.

    These three methods and `record` are required. Every concrete strategy's trainer is a
    :class:`~.step.StepTrainer`, which is also a :class:`ShardedTrainer` and a :class:`CheckpointTrainer`
    with an ``optimizer``; a trainer that is not (strategy "auto") declares the loop features it lacks
    (:data:`FEATURE_NAMES`), which fit refuses with a FitError on every rank before any message.
    """

    @property
    def record(self) -> Mapping[str, object]:
        """What fit adds to each epoch's history record (strategy "auto": the plan it chose)."""
        ...

    def train_step(self, inputs: Batch, targets: torch.Tensor) -> float:
        """One optimizer step on the global mini-batch; returns its mean loss, equal on every rank."""
        ...

    def eval_step(self, inputs: Batch, targets: torch.Tensor) -> torch.Tensor:
        """Forward only (no grad) on the global batch; returns the full outputs on every rank."""
        ...

    def trained_model(self) -> nn.Module:
        """A model of the user's class holding the trained weights, on every rank. Collective; the
        trainer takes no more steps afterwards."""
        ...


@dataclass(frozen=True)
class Share:
    """The rows ``[start, stop)`` of a global batch that one rank reads, and which parts it uses
    (a middle pipeline stage uses neither, the first stage only inputs, the last only targets)."""

    start: int
    stop: int
    inputs: bool = True
    targets: bool = True

    @property
    def rows(self) -> int:
        return self.stop - self.start if (self.inputs or self.targets) else 0


@dataclass
class BatchShare:
    """This rank's part of one global batch of `n` samples: the rows of its :class:`Share`, None for
    a part the share does not use or when the share is empty."""

    inputs: Batch | None
    targets: torch.Tensor | None
    n: int
    share: Share


class ShardedTrainer(Protocol):
    """Feature ``"shares"``: the trainer trains on the rows each rank reads itself.

    Contract (fit relies on every line):

    * ``share(n)`` is a pure function of `n` and the layout (the same answer whenever asked); the
      shares of the ranks that read inputs cover ``range(n)`` once per replica; any `n` >= 1 is valid
      (an uneven batch is split as evenly as possible, :func:`~mpitrain.comm.base.split_sizes`; a rank
      may get no rows and must still take part).
    * ``train_shares(batches, total)`` is ONE optimizer step on the concatenation of the global batches
      (``accumulate`` > 1 passes several; ``total`` = the sum of their ``n``): its gradient is that of the
      mean loss over all `total` samples (each rank weights its rows by their count), so the step equals
      one process's on those samples; it returns that mean loss, equal on every rank. `loss_fn` returns
      the mean over the rows it is given (as ``nn.CrossEntropyLoss()`` does).
    * optional ``rank_view(dataset) -> Dataset``: what this rank's DataLoader reads instead of a
      map-style `dataset` (same length and indices; e.g. spatial's block of each sample). fit calls it
      once, before training from a Dataset; the BatchShares then hold what the view returns.
    """

    def share(self, n: int) -> Share: ...

    def train_shares(self, batches: Sequence[BatchShare], total: int) -> float: ...


class CheckpointTrainer(Protocol):
    """Feature ``"checkpoint"``: the trainer saves and restores its exact state.

    * ``layout()``: a small JSON-able dict describing how the state is split (strategy, world size, ...);
      equal on every rank; written to the checkpoint manifest.
    * ``state_dict()``: this rank's shard, only tensors, numbers, strings, None and lists/tuples/dicts
      of them (it is loaded with ``torch.load(weights_only=True)``). Key ``"model"`` maps names of the
      USER's ``model.state_dict()`` to the tensors this rank holds: ``mpitrain.load_checkpoint`` merges
      the shards' ``"model"`` dicts (lowest rank first) into the full state_dict without MPI. Everything
      needed to continue bit-identically goes in: optimizer state, in-flight gradients, step counters.
      Collective (a trainer may complete in-flight communication); called after a step, on every rank.
    * ``load_state_dict(read, saved_layout)``: restore from a checkpoint whose layout was `saved_layout`;
      ``read(r)`` returns saved rank r's shard (loaded on demand). Same layout: read your own rank. A
      different layout the trainer can reshard (replicated weights) is read from the ranks it needs;
      one it cannot raises FitError naming both layouts (a local decision: every rank raises alike).
      Called on every rank before the first step.
    """

    def layout(self) -> dict[str, object]: ...

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, read: Callable[[int], dict[str, object]], saved_layout: Mapping[str, object]) -> None:
        ...


#: A strategy's entry point, ``make_trainer(model, loss_fn, optimizer, comm, spec)``.
TrainerFactory: TypeAlias = Callable[[nn.Module, LossFn, OptimizerFactory, Communicator, FitSpec], Trainer]

def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (``True`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class StrategyOptions:
    """Base of a strategy's options: a frozen dataclass whose fields are the option names, with their
    defaults (see the module docstring for an example).

    * :meth:`from_spec` builds it from ``spec.options``, refusing unknown names with a FitError that
      lists the known ones;
    * the subclass checks types and ranges in ``__post_init__`` with :meth:`require` (FitError), and
      may normalise a value with :meth:`replace_value` (e.g. a list into a tuple);
    * :meth:`signature` is a picklable summary for the cross-rank agreement check
      (``check_same_everywhere``)."""

    #: The strategy's name (``fit(strategy=SomeOptions(...))`` runs it; also in messages).
    strategy: ClassVar[str] = "?"

    def strategy_name(self, partitions: int | None, replicas: int | None, world_size: int) -> str:
        """The strategy an instance passed as ``fit(strategy=...)`` runs, given fit's layout keywords:
        :attr:`strategy` (a class serving two strategies decides here)."""
        return self.strategy

    @classmethod
    def from_spec(cls, spec: FitSpec) -> Self:
        """The options of ``spec.options`` (defaults for the others), or ``spec.options`` itself when it
        is an instance of this class. Local: every rank given the same options raises the same FitError,
        before any message."""
        if isinstance(spec.options, StrategyOptions):
            if not isinstance(spec.options, cls):
                raise FitError(f"strategy {spec.strategy!r} takes {cls.__name__}, not {type(spec.options).__name__}")
            return spec.options
        known = cls.names()
        unknown = sorted(set(spec.options) - set(known))
        if unknown:
            raise FitError(f"strategy {spec.strategy!r} does not take option(s) {unknown}; it takes {list(known)}")
        return cls(**spec.options)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in declaration order."""
        return tuple(f.name for f in fields(cls))

    def require(self, name: str, ok: bool, expected: str) -> None:
        """Raise FitError "strategy 's': option name=value: expected <expected>" unless `ok`."""
        if not ok:
            raise FitError(f"strategy {self.strategy!r}: option {name}={getattr(self, name)!r}: expected {expected}")

    def replace_value(self, name: str, value: object) -> None:
        """Set field `name` of this frozen instance; only for normalising inside ``__post_init__``."""
        object.__setattr__(self, name, value)

    def signature(self) -> tuple[tuple[str, str], ...]:
        """``(name, repr(value))`` of every option: equal on two ranks iff they were given the same."""
        return tuple((name, repr(getattr(self, name))) for name in self.names())


def require_whole_model(spec: FitSpec, comm: Communicator) -> None:
    """FitError unless `spec` asks for what a strategy that keeps the whole model on every rank does:
    ``partitions`` 1, ``replicas`` None or ``comm.size``, ``micro_batches`` a positive int."""
    if spec.partitions != 1 or spec.replicas not in (None, comm.size):
        raise FitError(f"strategy {spec.strategy!r} keeps the whole model on every rank: it needs partitions=1 "
                       f"(strategy 'model' or 'hybrid' splits layers) and replicas None or {comm.size} (every "
                       f"rank); got partitions={spec.partitions}, replicas={spec.replicas}")
    if not is_int(spec.micro_batches) or spec.micro_batches < 1:
        raise FitError(f"micro_batches must be an int >= 1, got {spec.micro_batches!r}")
