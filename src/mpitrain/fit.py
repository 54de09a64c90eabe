"""One entry point, `fit`, for every strategy: the training loop, progress, history and evaluation."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from . import _registry, checkpoint
from . import timeline as _timeline
from ._data import (
    DataPlan,
    check_global_loader,
    check_not_iterable_dataset,
    check_plan,
    check_same_first_batch,
    eval_loader,
    is_map_dataset,
    read_global,
    read_shares,
    skip,
    split_batch,
    split_first_batch,
    take,
)
from ._schedule import (
    SCHEDULER_KEYWORDS,
    Schedule,
    SchedulerFactory,
    check_schedule_words,
    monitors,
    probe_schedule,
)
from ._utils.deprecation import renamed_options
from ._utils.stall import StallPolicy
from .comm.base import Communicator
from .runtime import world
from .strategies import (
    DEFAULT_IGNORE_INDEX,
    EVERY_COLUMN,
    NAMED,
    Columns,
    LossScaler,
    StepTrainer,
    counted,
    ignore_index_of,
    label_shift,
    optimizer_factory,
    samples,
    slice_share,
    used_columns,
)
from .strategies.base import (
    Balance,
    Batch,
    CheckpointTrainer,
    FitError,
    FitSpec,
    LoopSpec,
    LossFn,
    OptimizerFactory,
    ScalerSpec,
    StrategyOptions,
    Trainer,
    is_int,
    is_number,
)

__all__ = ["fit", "make_trainer", "model_loss", "accuracy", "accuracy_counted", "FitResult", "FitSpec", "Trainer",
           "STRATEGIES", "FitError", "StopTraining", "LoopState"]

#: strategy name -> "module:factory": the concrete strategies of the strategy table (`mpitrain._registry`) and
#: "auto", the planner's, which sits between fit and that table (docs/ARCHITECTURE.md, Layers).
STRATEGIES: dict[str, str] = {**_registry.STRATEGIES, "auto": "mpitrain.planner:make_trainer"}


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> Trainer:
    """The Trainer of `spec.strategy` as :data:`STRATEGIES` names it (what `fit` drives); FitError for an
    unknown name, and the strategy's own FitErrors, on every rank before any message."""
    return _registry.make_trainer(model, loss_fn, optimizer, comm, spec, STRATEGIES)


#: Deprecated spellings of fit's stall keywords (kept for one release, with a DeprecationWarning).
STALL_ALIASES = {"stall_timeout": "warn_after", "stall_abort": "abort_after", "stall_warning_s": "warn_after"}
DEFAULT_WARN_AFTER, DEFAULT_ABORT_AFTER = 60.0, 600.0

Metric = Callable[[torch.Tensor, torch.Tensor], float]


@dataclass
class FitResult:
    """`model`: the user's class with the trained weights (every rank). `history`: per epoch, the mean
    training loss, images/s, and eval loss/metrics when `eval_data` was given. `optimizer`: the optimizer
    that trained, this rank's (over this rank's parameters or ZeRO pieces; None for strategy "auto" and
    strategies without one). An optimizer instance passed to fit is never stepped: fit trains a rebuilt
    copy (docs/training-runs.md, "The optimizer"), and this is that copy."""

    model: nn.Module
    history: list[dict[str, Any]]
    optimizer: torch.optim.Optimizer | None = None



def accuracy(outputs: Any, targets: torch.Tensor) -> float:
    """The fraction of predictions equal to `targets`, read as ``CrossEntropyLoss`` reads its input:
    `outputs` is the logits, or a model output holding them (Hugging Face's ``.logits``, torchvision
    segmentation's ``["out"]``, else a tuple's first element); the class dim is 1 (``(N, C)``,
    ``(N, C, H, W)``) or, for ``(B, T, V)`` logits of ``(B, T)`` targets, the last; targets of -100 (the
    loss's ``ignore_index``) are not counted, and float targets shaped as the logits (soft labels, e.g.
    Mixup) count their largest class. A Hugging Face causal LM called with its labels (a
    ``...CausalLMOutput...`` holding a loss) predicts the next token: logits ``[:, :-1]`` against labels
    ``[:, 1:]``, as its own loss and Hugging Face's ``run_clm`` accuracy compare them. Across eval
    batches fit weighs it by the targets it counts (:func:`accuracy_counted`)."""
    hits, counted = _accuracy_parts(outputs, targets)
    return hits / max(counted, 1)


def accuracy_counted(outputs: Any, targets: torch.Tensor) -> int:
    """How many targets :func:`accuracy` counts (its denominator): fit's weight of a batch's accuracy."""
    return _accuracy_parts(outputs, targets)[1]


def _accuracy_parts(outputs: Any, targets: torch.Tensor) -> tuple[int, int]:
    """(hits, counted targets) of :func:`accuracy`."""
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs["out"]
    if logits is None:
        logits = outputs[0] if isinstance(outputs, (tuple, list)) else outputs
    dim = 1
    if logits.dim() == targets.dim() + 1 and logits.shape[:-1] == targets.shape and \
            logits.shape[:1] + logits.shape[2:] != targets.shape:
        dim = -1
        if "CausalLMOutput" in type(outputs).__name__ and getattr(outputs, "loss", None) is not None:
            logits, targets = logits[:, :-1], targets[:, 1:]  # the labels the model's own loss shifts
    if targets.is_floating_point() and targets.shape == logits.shape:
        targets = targets.argmax(dim=dim)
    counted = targets != DEFAULT_IGNORE_INDEX
    hits = (logits.argmax(dim=dim) == targets) & counted
    return int(hits.sum()), int(counted.sum())


_NAMED_METRICS: dict[str, Metric] = {"accuracy": accuracy}

#: Strategies whose checkpoints (by name) resume only themselves: pipe-sgd's hold gradients in flight, and
#: resuming spatial from another strategy's (or the reverse) is not tested.
_OWN_STRATEGY_ONLY = frozenset({"pipe-sgd", "spatial"})


def model_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """The loss the model computed itself: ``outputs.loss`` (a Hugging Face ``ModelOutput`` of a model
    called with ``labels``) or ``outputs["loss"]``; `targets` are not read (the model had them as
    ``labels``). What ``fit(..., loss_fn=None)`` trains on, as Hugging Face's Trainer does without a
    ``compute_loss``. FitError if the output holds no loss (a model not called with labels)."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if not isinstance(loss, torch.Tensor):
        raise FitError(f"loss_fn=None trains on the model's own loss (outputs.loss, as a Hugging Face model "
                       f"computes it when called with labels), but the model returned a "
                       f"{type(outputs).__name__} without one: give the data a \"labels\" key, or pass loss_fn")
    return loss


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

    def set_postfix(self, refresh: bool = True, **kwargs: str) -> None: ...
    def update(self, n: int) -> object: ...
    def close(self) -> None: ...


def _progress(total: int | None, desc: str, enabled: bool) -> _Bar | None:
    if not enabled:
        return None
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    bar: _Bar = tqdm(total=total, desc=desc, unit="batch", dynamic_ncols=True, leave=True)
    return bar


def _evaluate(trainer: Trainer, data: Iterable[tuple[Batch, torch.Tensor]], loss_fn: LossFn,
              metrics: dict[str, Metric], columns: Columns, shift: int = 0,
              check: tuple[Communicator, int] | None = None) -> dict[str, float]:
    """The eval record over every batch of `data`, as one process computes it on all of them together:
    ``eval_loss`` weighs each batch's (mean) loss by the target elements it counts (:func:`counted`: integer
    targets other than the loss's ignore index, `shift` leading label positions left out; float targets:
    rows), so it is the mean over every counted element of the whole eval (a batch counting none adds
    nothing, its NaN included); :func:`accuracy` likewise by the targets it counts, other metrics by
    rows. Local: every rank holds each
    batch's full outputs (``eval_step``) and targets, so no message is needed beyond the eval steps'; the
    same floats on every rank. With `check` (the communicator, the 0-based epoch) the first batch is
    checked to be the same on every rank (:func:`check_same_first_batch`), as training's is: a rank
    evaluating other rows than the others (a DataLoader shuffling with unseeded global RNGs) would make a
    mean of no one batch's, and a different one per rank."""
    ignore = ignore_index_of(loss_fn)
    sums: dict[str, float] = {}
    weights: dict[str, int] = {}

    def add(name: str, total: float, weight: int) -> None:
        sums[name] = sums.get(name, 0.0) + total
        weights[name] = weights.get(name, 0) + weight

    def weighted(fn: Callable[[Any, Any], Any], outputs: Any, targets: Any, weight: int) -> float:
        # a batch counting nothing: its mean is 0/0 (NaN), left out
        return float(fn(outputs, targets)) * weight if weight else 0.0

    for i, batch in enumerate(data):
        inputs, targets = split_batch(columns(batch))  # a BatchEncoding: its dict
        if i == 0 and check is not None:
            check_same_first_batch(check[0], (inputs, targets), check[1], data, "eval_data")
        outputs = trainer.eval_step(inputs, targets)
        n = samples(inputs, targets)
        with torch.no_grad():
            weight = counted(targets, n, ignore, shift)
            add("eval_loss", weighted(loss_fn, outputs, targets, weight), weight)
            for name, fn in metrics.items():
                if fn is accuracy:  # its hits and count in one pass: the whole eval's fraction
                    hits, weight = _accuracy_parts(outputs, targets)
                    add(f"eval_{name}", float(hits), weight)
                else:
                    add(f"eval_{name}", weighted(fn, outputs, targets, n), n)
    return {k: v / weights[k] if weights[k] else math.nan for k, v in sums.items()}


class StopTraining(Exception):
    """Raise it in an ``on_step_end``/``on_epoch_end`` callback (or return True from one) to end `fit`
    after the current step: the partial epoch is recorded, the final checkpoint written, and `fit`
    returns normally. The decision is combined over ranks (any rank stopping stops all)."""


@dataclass
class LoopState:
    """What callbacks see (the same on every rank). `epoch` is 1-based; `step` counts optimizer steps
    across epochs; `loss` is the step's mean loss (on_step_end) or the epoch's (on_epoch_end); `lr` is
    the first parameter group's learning rate of that step (None if the strategy exposes no optimizer);
    `history` holds the finished epochs' records (on_epoch_end: including this one)."""

    epoch: int
    step: int
    loss: float
    lr: float | None
    history: list[dict[str, Any]]


Callback = Callable[[LoopState], object]


@dataclass
class _Position:
    """Where the loop is: epoch (0-based), global batches consumed in it, its optimizer steps, its
    running loss sum and sample count; `step` counts optimizer steps across epochs."""

    epoch: int = 0
    batch: int = 0
    epoch_steps: int = 0
    loss_sum: float = 0.0
    samples: int = 0
    step: int = 0


@dataclass
class _Settings:
    """fit's loop keywords, checked."""

    epochs: int
    steps: int | None
    accumulate: int
    plan: DataPlan | None
    checkpoint_dir: Path | None
    checkpoint_every: int | None
    resume: bool
    lr_scheduler: SchedulerFactory | None
    loop: LoopSpec
    on_step_end: Callback | None
    on_epoch_end: Callback | None
    #: the keys of mapping items and batches the model is called with (remove_unused_columns)
    columns: Columns = EVERY_COLUMN
    #: the keys dropped from a Dataset's item 0 (shown once on rank 0)
    dropped: tuple[str, ...] = ()
    #: lr_interval and lr_monitor as given (None: the scheduler's kind decides, :meth:`Schedule.of`)
    lr_interval: str | None = None
    lr_monitor: str | None = None
    #: the epoch record's keys lr_monitor may name (:func:`monitors`)
    lr_monitors: tuple[str, ...] = ("loss",)


_FEATURE_WORDS = {"checkpoint": "checkpointing (checkpoint_dir=)", "lr_scheduler": "lr_scheduler=",
                  "grad_clip": "grad_clip=", "bf16": 'precision="bf16"', "fp16": 'precision="fp16"',
                  "shares": "accumulate= > 1"}


def _require(strategy: str, s: _Settings, data: object) -> bool:
    """FitError (local, every rank alike) for a feature `s` needs that the strategy lacks; returns
    whether the strategy reads its own shares."""
    have = _registry.features(strategy, STRATEGIES)
    need = {"checkpoint": s.checkpoint_dir is not None, "lr_scheduler": s.lr_scheduler is not None,
            "grad_clip": s.loop.grad_clip is not None, "bf16": s.loop.precision == "bf16",
            "fp16": s.loop.precision == "fp16",
            "shares": s.accumulate > 1}
    for name, wanted in need.items():
        if wanted and name not in have:
            raise FitError(f"{_FEATURE_WORDS[name]} is not supported by strategy {strategy!r} yet "
                           f"(it supports: {sorted(have) or 'none of the loop features'}); see docs/training-runs.md")
    plan = s.plan
    if "shares" not in have and plan is not None and not plan.drop_last and len(plan.dataset) % plan.batch_size:
        raise FitError(f"strategy {strategy!r} does not take an uneven last batch yet (a Dataset of "
                       f"{len(plan.dataset)} samples in batches of {plan.batch_size} leaves "
                       f"{len(plan.dataset) % plan.batch_size}): pass drop_last=True")
    return "shares" in have


def _strategy_of(strategy: str | StrategyOptions, options: dict[str, object], partitions: int | None,
                 replicas: int | None, size: int) -> tuple[str, dict[str, object] | StrategyOptions]:
    """The strategy's name and its options (fit's leftover keywords, or the options dataclass passed as
    `strategy`, whose class names the strategy). FitError, local, for an options object given with
    keyword options too, or for anything else."""
    if isinstance(strategy, StrategyOptions):
        name = strategy.strategy_name(partitions, replicas, size)
        if options:
            raise FitError(f"fit: strategy={strategy!r} and the keyword option(s) {sorted(options)} were both given: "
                           f"put them in the {type(strategy).__name__}, or pass strategy={name!r} with keywords")
        if name not in STRATEGIES:
            raise FitError(f"fit: {type(strategy).__name__} names no strategy ({name!r}); choose one of "
                           f"{sorted(STRATEGIES)} or its options dataclass")
        return name, strategy
    if not isinstance(strategy, str):
        raise FitError(f"fit: strategy must be a name ({sorted(STRATEGIES)}) or a strategy's options dataclass "
                       f"(mpitrain.DataOptions, ...), got {strategy!r}")
    return strategy, options


#: torch DataLoader keywords fit has no keyword of its own for (its Dataset ones: batch_size, shuffle,
#: drop_last, num_workers, pin_memory, collate_fn): a user copying a DataLoader's arguments into fit
#: is told what to do instead of that a strategy does not take them
LOADER_KEYWORDS = frozenset({"sampler", "batch_sampler", "persistent_workers", "prefetch_factor", "worker_init_fn",
                             "timeout", "multiprocessing_context", "generator", "pin_memory_device", "in_order"})


def _check_loader_keywords(options: Mapping[str, object]) -> None:
    """FitError (local, every rank alike) for :data:`LOADER_KEYWORDS` or :data:`SCHEDULER_KEYWORDS` among
    fit's leftover keywords (else refused as options the strategy does not take, which says less)."""
    lightning = sorted(SCHEDULER_KEYWORDS.keys() & options.keys())
    if lightning:
        raise FitError(f"fit: {lightning} are Lightning's lr_scheduler config keys; fit's keywords are "
                       f"{[SCHEDULER_KEYWORDS[k] for k in lightning]} (docs/training-runs.md, 'Loop features')")
    found = sorted(LOADER_KEYWORDS.intersection(options))
    if found:
        raise FitError(f"fit: {found} are DataLoader keywords, which fit does not take: from a Dataset fit builds "
                       f"each rank's loader itself from batch_size= (the GLOBAL batch), shuffle=, seed=, drop_last=, "
                       f"num_workers=, pin_memory= and collate_fn=. For other DataLoader options pass your own "
                       f"DataLoader(dataset, batch_size=GLOBAL, shuffle=True, generator=torch.Generator()"
                       f".manual_seed(0), ...) as data, without batch_size= (every rank then reads every row)")


def _partitions_of(name: str, partitions: int | None, replicas: int | None, size: int) -> int:
    """`partitions` as given, else what strategy `name` takes on `size` ranks: "model" every rank,
    "hybrid" ``size // replicas``, the others 1 (the whole model). FitError, local, for "hybrid" without
    either or with `replicas` that does not divide the ranks."""
    if partitions is not None:
        return partitions
    if name == "model":
        return size
    if name != "hybrid":
        return 1
    if not is_int(replicas) or replicas < 1 or size % replicas:
        raise FitError(f"strategy 'hybrid' needs partitions=P or replicas=R with P x R = {size} ranks; "
                       f"got replicas={replicas!r}")
    return size // replicas


def _check_first_batch(data: object, columns: Columns) -> None:
    """The columns rule (:meth:`~mpitrain.strategies.Columns.check`), the batch rule
    (:func:`~mpitrain.strategies.split_batch`) and the sharding rule
    (:func:`~mpitrain.strategies._batching.samples`) on the first global batch of a list or tuple of
    batches, before the trainer is built (no message yet). Other iterables cannot be peeked without
    reading them: their batches are checked as they are cut, on every rank alike."""
    if isinstance(data, (list, tuple)) and data:
        columns.check(data[0])
        samples(*split_batch(columns(data[0])))


def _settings(data: object, epochs: int, steps: int | None, batch_size: int | None, shuffle: bool, seed: int,
              drop_last: bool, num_workers: int, pin_memory: bool, checkpoint_dir: str | os.PathLike[str] | None,
              checkpoint_every: int | None, resume: bool, lr_scheduler: SchedulerFactory | None,
              grad_clip: float | None, accumulate: int, precision: str, on_step_end: Callback | None,
              on_epoch_end: Callback | None, collate_fn: Callable[[list[Any]], Any] | None = None,
              columns: Columns | None = None, grad_scaler: torch.amp.GradScaler | None = None,
              lr_interval: str | None = None, lr_monitor: str | None = None) -> _Settings:
    """fit's loop keywords checked locally (FitError: the same verdict on every rank)."""
    if not is_int(epochs) or epochs < 1 or (steps is not None and (not is_int(steps) or steps < 1)):
        raise FitError(f"epochs must be >= 1 and steps None or >= 1, got epochs={epochs}, steps={steps}")
    plan, columns, dropped = None, columns or EVERY_COLUMN, []
    if is_map_dataset(data):
        dropped = check_plan(data, batch_size, seed, num_workers, [("shuffle", shuffle), ("drop_last", drop_last),
                                                                  ("pin_memory", pin_memory)], collate_fn, columns)
        assert batch_size is not None
        plan = DataPlan(data, batch_size, shuffle, seed, drop_last, num_workers, pin_memory, collate_fn, columns)
        if drop_last and len(plan.dataset) < batch_size:
            raise FitError(f"drop_last=True with a Dataset of {len(plan.dataset)} samples and batch_size={batch_size} "
                           f"leaves no batch")
    elif batch_size is not None or num_workers or pin_memory or collate_fn is not None:
        check_not_iterable_dataset(data)
        raise FitError("batch_size, num_workers, pin_memory and collate_fn apply to a map-style Dataset "
                       "(a DataLoader of yours takes its own collate_fn); "
                       f"`data` is a {type(data).__name__} of global batches")
    if not is_int(accumulate) or accumulate < 1:
        raise FitError(f"accumulate must be an int >= 1, got {accumulate!r}")
    if checkpoint_every is not None and (not is_int(checkpoint_every) or checkpoint_every < 1):
        raise FitError(f"checkpoint_every must be None or an int >= 1, got {checkpoint_every!r}")
    if checkpoint_dir is None and (checkpoint_every is not None or resume):
        raise FitError("checkpoint_every= and resume=True need checkpoint_dir=")
    loop = _loop_spec(grad_clip, precision, grad_scaler)
    if isinstance(lr_scheduler, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        # bound to the optimizer it was built on, which is not the one that trains (fit rebuilds it per rank)
        raise FitError(f"lr_scheduler must be a factory optimizer -> scheduler, e.g. lambda opt: "
                       f"{type(lr_scheduler).__name__}(opt, ...); got a {type(lr_scheduler).__name__} instance, bound "
                       f"to the optimizer it was built on, which is not the optimizer fit steps")
    for name, fn in (("lr_scheduler", lr_scheduler), ("on_step_end", on_step_end), ("on_epoch_end", on_epoch_end)):
        if fn is not None and not callable(fn):
            raise FitError(f"{name} must be callable, got {fn!r}")
    check_schedule_words(lr_scheduler, lr_interval, lr_monitor)
    return _Settings(epochs, steps, accumulate, plan, None if checkpoint_dir is None else Path(checkpoint_dir),
                     checkpoint_every, bool(resume), lr_scheduler,
                     loop, on_step_end, on_epoch_end, columns, tuple(dropped), lr_interval, lr_monitor)


#: fit's precisions by every accepted spelling (Lightning's "32-true", "bf16-mixed", "16-mixed" included)
PRECISIONS = {"fp32": "fp32", "32-true": "fp32", "bf16": "bf16", "bf16-mixed": "bf16", "fp16": "fp16",
              "16-mixed": "fp16"}


def _loop_spec(grad_clip: float | None, precision: str, grad_scaler: torch.amp.GradScaler | None) -> LoopSpec:
    """The trainer's loop features from fit's keywords, checked locally (FitError: every rank alike)."""
    if grad_clip is not None and (not is_number(grad_clip) or grad_clip <= 0):
        raise FitError(f"grad_clip must be None or a number > 0, got {grad_clip!r}")
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise FitError(f"precision must be 'fp32', 'bf16' (bf16 autocast) or 'fp16' (float16 autocast with dynamic "
                       f"loss scaling), or Lightning's '32-true', 'bf16-mixed', '16-mixed'; got {precision!r}")
    precision = PRECISIONS[precision]
    if grad_scaler is not None and (precision != "fp16" or not isinstance(grad_scaler, torch.amp.GradScaler)
                                    or not grad_scaler.is_enabled()):
        raise FitError(f"grad_scaler takes an enabled torch.amp.GradScaler, whose numbers (init_scale, growth_factor, "
                       f"backoff_factor, growth_interval) configure precision='fp16'; got {grad_scaler!r} with "
                       f"precision={precision!r}")
    scaler = ScalerSpec() if grad_scaler is None else ScalerSpec.of(grad_scaler)
    return LoopSpec(None if grad_clip is None else float(grad_clip), precision, scaler)


def _data_signature(s: _Settings) -> dict[str, object]:
    """What fixes the sample order; a resumed run must match it."""
    p = s.plan
    if p is None:
        return {"kind": "iterable", "accumulate": s.accumulate}
    return {"kind": "dataset", "length": len(p.dataset), "batch_size": p.batch_size, "shuffle": p.shuffle,
            "seed": p.seed, "drop_last": p.drop_last, "accumulate": s.accumulate}


class _PendingLosses:
    """The step losses of a loop without ``on_step_end`` (nothing reads one before the epoch ends): each
    step's local loss sum is copied into a buffer on its device, unread, and one collective
    (:meth:`StepTrainer.step_losses`) sums them over the ranks every :data:`CAPACITY` steps, at the
    epoch's end and before a checkpoint. So the loop sends no message and waits for no device on the
    other steps (on a GPU the host runs ahead, as a hand-written loop does), and each step's loss is the same float
    as :meth:`StepTrainer.train_shares` returns: the history does not depend on when they were read."""

    #: steps held at most. Small, so that the progress bar's loss is at most this many steps old; the read
    #: it costs (one message, and the host waits for the device once) is then spread over 16 steps: on a
    #: GPU the queue runs dry once per 16 steps, for the time the host takes to queue the next kernels. A
    #: count of steps, not of seconds, since every rank must read at the same step.
    CAPACITY = 16

    def __init__(self, stepper: StepTrainer) -> None:
        self.stepper = stepper
        self.buffer: torch.Tensor | None = None
        self.totals: list[int] = []  # each held step's sample count (the same on every rank)

    def add(self, local: torch.Tensor, total: int) -> bool:
        """Hold one step's `local` sum (a device copy, no wait); True when the buffer is full."""
        if self.buffer is None:  # on the device of the trainer's losses (copy_ would move another's)
            self.buffer = torch.empty(self.CAPACITY, dtype=torch.float64, device=local.device)
        self.buffer[len(self.totals):len(self.totals) + 1].copy_(local.reshape(1))
        self.totals.append(total)
        return len(self.totals) == self.CAPACITY

    def drain(self) -> list[tuple[float, int]]:
        """Collective (one allgather; nothing when no step is held, on every rank alike: the ranks take the
        same steps): each held step's mean loss and sample count, in order."""
        if not self.totals:
            return []
        assert self.buffer is not None
        sums = self.stepper.step_losses(self.buffer[:len(self.totals)])
        out = [(total_loss / n, n) for total_loss, n in zip(sums, self.totals)]
        self.totals = []
        return out


class _Loop:
    """One fit run: epochs of steps over the data, callbacks, checkpoints. Every rank runs it alike."""

    def __init__(self, trainer: Trainer, comm: Communicator, data: Any, s: _Settings, strategy: str,
                 model_keys: list[str], show: bool) -> None:
        self.trainer, self.comm, self.data, self.s = trainer, comm, data, s
        self.strategy, self.model_keys, self.show = strategy, model_keys, show
        #: the trainer's full interface (shares, optimizer, checkpoints): every concrete strategy's; None for
        #: one that declares no loop features ("auto"), which fit drives by whole global batches
        self.stepper: StepTrainer | None = trainer if isinstance(trainer, StepTrainer) else None
        # a strategy without an optimizer before its first step ("auto") records no lr: every rank's
        # history is the same
        self.optimizer: torch.optim.Optimizer | None = None if self.stepper is None else self.stepper.optimizer
        self.scheduler = s.lr_scheduler(self.optimizer) if s.lr_scheduler is not None and self.optimizer else None
        self.schedule = None if self.scheduler is None else \
            Schedule.of(self.scheduler, s.lr_interval, s.lr_monitor, s.lr_monitors)
        # what this rank's DataLoader reads: a trainer may view the Dataset (spatial: its block of each sample)
        self.read_plan: DataPlan | None = s.plan
        if self.stepper is not None and s.plan is not None:
            self.read_plan = replace(s.plan, dataset=self.stepper.rank_view(s.plan.dataset))
        # on_step_end reads every step's loss (and a strategy without StepTrainer returns it): only then is
        # it summed over the ranks per step. A choice every rank makes alike (not the bar, shown on rank 0).
        self.pending = _PendingLosses(self.stepper) if self.stepper is not None and s.on_step_end is None else None
        self.shown_loss: float | None = None  # the progress bar's: the latest step loss read
        self.pos = _Position()
        self.history: list[dict[str, Any]] = []
        self.saved_step = -1
        self.stop = False
        self.dropped_shown = False

    # -- data ---------------------------------------------------------------------------------------
    def _items(self, epoch: int, start: int) -> Iterator[Any]:
        """This epoch's items from global batch `start` on: BatchShares (sharded trainers) or global
        ``(inputs, targets)`` batches."""
        plan, stepper = self.s.plan, self.stepper
        if plan is not None:
            if stepper is not None:
                assert self.read_plan is not None
                yield from read_shares(self.read_plan, epoch, start, stepper.share)
            else:
                yield from read_global(plan, epoch, start)
            return
        for i, batch in enumerate(skip(self.data, start)):
            if i == 0:  # the same verdict on every rank: each holds this global batch
                self._show_dropped(self.s.columns.check(batch))
            batch = self.s.columns(batch)
            # a tokenizer's BatchEncoding: its dict; the first batch's FitError names an IterableDataset's fix
            inputs, targets = split_first_batch(self.data, batch) if i == 0 else split_batch(batch)
            if i == 0:
                check_same_first_batch(self.comm, (inputs, targets), epoch, self.data)
            if stepper is not None:
                yield slice_share(inputs, targets, stepper.share(samples(inputs, targets)))
            else:
                yield inputs, targets

    def _show_dropped(self, names: Iterable[str]) -> None:
        """Print, once per run on rank 0 with the progress (``progress=True``), the keys not passed to the
        model (``remove_unused_columns``), as Trainer logs them."""
        names = list(names)
        if names and self.show and not self.dropped_shown:
            print(f"fit: the columns {names} are not parameters of {self.s.columns.forward}: not passed to it "
                  f"(remove_unused_columns=True; False keeps them)", flush=True)
            self.dropped_shown = True

    def _step(self, group: list[Any]) -> tuple[float | None, int]:
        """One optimizer step: its mean loss (None while :attr:`pending` holds it) and sample count."""
        if self.stepper is not None:
            total = sum(b.n for b in group)
            if self.pending is None:
                return self.stepper.train_shares(group, total), total
            if self.pending.add(self.stepper.train_shares_local(group, total), total):
                self._read_losses()
            return None, total
        inputs, targets = group[0]
        return self.trainer.train_step(inputs, targets), samples(inputs, targets)

    def _read_losses(self) -> None:
        """Collective: add the held steps' losses to the epoch's sum, as the steps would have one by one;
        the latest becomes the progress bar's."""
        if self.pending is not None:
            for loss, n in self.pending.drain():
                self.pos.loss_sum += loss * n
                self.shown_loss = loss

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self, eval_data: Any, loss_fn: LossFn, metrics: dict[str, Metric], shift: int = 0) -> None:
        s = self.s
        self._show_dropped(s.dropped)  # a Dataset's, read from item 0 (an iterable's: at its first batch)
        while self.pos.epoch < s.epochs and not self.stop:
            total = self._steps_in_epoch()
            bar = _progress(total, f"epoch {self.pos.epoch + 1}/{s.epochs}", self.show)
            t0, done0 = time.perf_counter(), self.pos.samples
            items = self._items(self.pos.epoch, self.pos.batch)
            lr = self._lr()
            while (s.steps is None or self.pos.epoch_steps < s.steps) and not self.stop:
                group = take(items, s.accumulate)
                if not group:
                    break
                lr = self._lr()
                skipped = self._skipped()
                with _timeline.span("step", epoch=self.pos.epoch, step=self.pos.step):
                    loss, n = self._step(group)
                if self._per_step() and self._skipped() == skipped:  # fp16: not after a skipped update
                    assert self.scheduler is not None
                    self.scheduler.step()
                p = self.pos
                p.batch, p.epoch_steps, p.step = p.batch + len(group), p.epoch_steps + 1, p.step + 1
                p.samples += n
                if loss is not None:
                    p.loss_sum += loss * n
                self._after_step(bar, loss, lr)
            self._read_losses()
            if bar is not None:
                self._show_loss(bar)
                bar.close()
            if self.stop and s.checkpoint_dir is not None and self.saved_step != self.pos.step:
                self.checkpoint()  # stopped mid-epoch: a resume continues this epoch where it stopped
            elapsed = time.perf_counter() - t0
            p = self.pos
            record: dict[str, Any] = {"epoch": float(p.epoch + 1), "loss": p.loss_sum / max(p.samples, 1),
                                      "samples_per_s": (p.samples - done0) / elapsed if elapsed > 0 else math.nan}
            if lr is not None:
                record["lr"] = lr
            scaler = self._scaler()
            if scaler is not None:  # fp16: the scale after the epoch, the steps skipped since the run began
                record.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
            if eval_data is not None:
                record.update(_evaluate(self.trainer, eval_data, loss_fn, metrics, s.columns, shift,
                                        (self.comm, self.pos.epoch)))
            self._epoch_schedule(record)
            self.history.append(record)
            if self.show:
                print("  ".join(f"{k}={v:.4g}" for k, v in record.items()), flush=True)
            record.update(self.trainer.record)  # strategy="auto": the plan it chose
            self.pos = _Position(epoch=p.epoch + 1, step=p.step)
            self._callback(s.on_epoch_end, LoopState(p.epoch + 1, p.step, record["loss"], lr, self.history))
        if s.checkpoint_dir is not None and self.saved_step != self.pos.step:
            self.checkpoint()

    def _after_step(self, bar: _Bar | None, loss: float | None, lr: float | None) -> None:
        """The progress bar, ``on_step_end`` (which reads `loss`: never None with it) and the checkpoint due."""
        p, s = self.pos, self.s
        if loss is not None:
            self.shown_loss = loss
        if bar is not None:
            self._show_loss(bar)
            bar.update(1)
        if s.on_step_end is not None:
            assert loss is not None
            self._callback(s.on_step_end, LoopState(p.epoch + 1, p.step, loss, lr, self.history))
        if s.checkpoint_every and p.step % s.checkpoint_every == 0:
            self.checkpoint()

    def _show_loss(self, bar: _Bar) -> None:
        """The latest step loss read (held ones are read every :attr:`_PendingLosses.CAPACITY` steps)."""
        if self.shown_loss is not None:
            bar.set_postfix(loss=f"{self.shown_loss:.4f}", refresh=False)  # update() redraws, at most 10 a second

    def _steps_in_epoch(self) -> int | None:
        s = self.s
        count = s.plan.count() if s.plan is not None else _batch_count(self.data)
        if count is not None:
            count = -(-count // s.accumulate)
        return min(count, s.steps) if (count is not None and s.steps is not None) else (count or s.steps)

    def _per_step(self) -> bool:
        """Whether the LR scheduler steps after every optimizer step (lr_interval "step")."""
        return self.schedule is not None and self.schedule.interval == "step"

    def _epoch_schedule(self, record: dict[str, Any]) -> None:
        """lr_interval "epoch": step the scheduler once at the end of the epoch (a partial one too: stopped,
        or cut by `steps`), after its evaluation, with ``record[monitor]`` for a ReduceLROnPlateau: the
        same float on every rank (the record's losses are the job's), so every rank's schedule is alike.
        Not saved in a checkpoint written during the epoch (also at a stop): a resume ends the epoch again
        and steps it then, as the uninterrupted run did."""
        sch = self.schedule
        if sch is None or sch.interval != "epoch":
            return
        assert self.scheduler is not None
        if sch.monitor is None:
            self.scheduler.step()
            return
        value = record.get(sch.monitor)
        if value is None:  # eval_data gave no batch this epoch: every rank alike (each reads it whole)
            raise FitError(f"lr_monitor={sch.monitor!r}: epoch {self.pos.epoch + 1}'s record has no such value "
                           f"(eval_data gave no batch?); it holds {sorted(record)}")
        self.scheduler.step(value)

    def _scaler(self) -> LossScaler | None:
        """fp16's loss scaler (None: another precision, or a trainer without one)."""
        return None if self.stepper is None else self.stepper.loss_scaler

    def _skipped(self) -> int:
        """Steps skipped so far by fp16's loss scaler (every rank alike: the job's verdict)."""
        scaler = self._scaler()
        return 0 if scaler is None else scaler.skipped

    def _lr(self) -> float | None:
        """The first parameter group's learning rate (None for an optimizer without one, e.g. duck-typed)."""
        groups = getattr(self.optimizer, "param_groups", None)
        return float(groups[0]["lr"]) if groups and "lr" in groups[0] else None

    def _callback(self, fn: Callback | None, state: LoopState) -> None:
        """Run `fn`; any rank asking to stop stops every rank (one allreduce per call)."""
        if fn is None:
            return
        try:
            stop = fn(state) is True
        except StopTraining:
            stop = True
        votes = self.comm.allreduce(torch.tensor([1.0 if stop else 0.0]), "max")
        self.stop = self.stop or bool(votes.item() > 0)

    # -- checkpoints ----------------------------------------------------------------------------------
    def _checkpointer(self) -> CheckpointTrainer:
        """The trainer's checkpoint hooks: every StepTrainer's (fit refused checkpoint_dir for the others)."""
        assert self.stepper is not None
        return self.stepper

    def checkpoint(self) -> None:
        """Collective: save the trainer's shard, this rank's RNG and the loop position (atomically)."""
        assert self.s.checkpoint_dir is not None
        self._read_losses()  # the position saved holds every step's loss so far
        trainer = self._checkpointer()
        scaler = self._scaler()
        shard = {"trainer": trainer.state_dict(), "rng": checkpoint.rng_state(),
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                 "scaler": scaler.state_dict() if scaler is not None else None}
        manifest = {"strategy": self.strategy, "layout": trainer.layout(), "position": asdict(self.pos),
                    "history": self.history, "data": _data_signature(self.s), "model_keys": self.model_keys}
        checkpoint.save(self.comm, self.s.checkpoint_dir, self.pos.step, shard, manifest)
        self.saved_step = self.pos.step

    def restore(self, path: Path, manifest: dict[str, Any]) -> None:
        """Every rank: continue from the checkpoint at `path` (FitError if it was another kind of run)."""
        saved, now = manifest["data"], _data_signature(self.s)
        trainer = self._checkpointer()
        # state saved by name loads into any strategy that reads it so (data <-> model/hybrid, any ZeRO);
        # pipe-sgd's and spatial's shards are by name too, but resume only their own strategy
        by_name = bool(manifest["layout"].get(NAMED)) and bool(trainer.layout().get(NAMED)) and \
            not {manifest["strategy"], self.strategy} & _OWN_STRATEGY_ONLY
        if (manifest["strategy"] != self.strategy and not by_name) or saved != now:
            raise FitError(f"cannot resume from {path}: it was written by strategy {manifest['strategy']!r} "
                           f"with data {saved}, this run is strategy {self.strategy!r} with data {now}")
        cache: dict[int, dict[str, Any]] = {}

        def read(rank: int) -> dict[str, Any]:
            if rank not in cache:  # one shard at a time: a trainer resharding reads many, each a replica
                cache.clear()
                cache[rank] = checkpoint.read_shard(path, rank)
            return cache[rank]

        trainer.load_state_dict(lambda r: read(r)["trainer"], manifest["layout"])
        same = manifest["world_size"] == self.comm.size
        own = read(self.comm.rank if same else 0)
        if self.scheduler is not None and own["scheduler"] is not None:
            self.scheduler.load_state_dict(own["scheduler"])
        scaler = self._scaler()
        if scaler is not None and own.get("scaler") is not None:  # equal on every rank: any shard's
            scaler.load_state_dict(own["scaler"])
        if same:
            checkpoint.set_rng_state(own["rng"])
        self.pos = _Position(**manifest["position"])
        self.history = [dict(h) for h in manifest["history"]]
        self.saved_step = self.pos.step


def _find_resume(comm: Communicator, s: _Settings) -> tuple[Path, dict[str, Any]] | None:
    """Collective (one broadcast from rank 0): the checkpoint to resume from, None to start fresh.
    FitError on every rank for a checkpoint_dir that holds checkpoints when resume=False."""
    if s.checkpoint_dir is None:
        return None
    found: tuple[str, dict[str, Any]] | str | None = None
    if comm.rank == 0:
        try:
            path = checkpoint.latest(s.checkpoint_dir)
            found = None if path is None else (str(path), checkpoint.read_manifest(path))
        except (OSError, ValueError, checkpoint.CheckpointError) as e:
            found = f"cannot read checkpoint_dir {s.checkpoint_dir}: {e}"
    found = comm.broadcast_object(found)
    if isinstance(found, str):
        raise FitError(found)
    if found is None:
        return None
    if not s.resume:
        raise FitError(f"checkpoint_dir {s.checkpoint_dir} already holds checkpoints ({found[0]}): pass "
                       f"resume=True to continue from the latest, or use another directory")
    return Path(found[0]), found[1]


def fit(model: nn.Module, data: Any, loss_fn: LossFn | None,
        optimizer: OptimizerFactory | torch.optim.Optimizer, *, strategy: str | StrategyOptions = "data",
        partitions: int | None = None, replicas: int | None = None, micro_batches: int = 1, schedule: str = "1f1b",
        epochs: int = 1, steps: int | None = None, batch_size: int | None = None, shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False, num_workers: int = 0, pin_memory: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None, remove_unused_columns: bool = True,
        eval_data: Iterable[tuple[Batch, torch.Tensor]] | None = None,
        metrics: Iterable[str | Metric] | Mapping[str, Metric] | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None, checkpoint_every: int | None = None,
        resume: bool = False, lr_scheduler: SchedulerFactory | None = None, lr_interval: str | None = None,
        lr_monitor: str | None = None, grad_clip: float | None = None,
        accumulate: int = 1, precision: str = "fp32", grad_scaler: torch.amp.GradScaler | None = None,
        on_step_end: Callback | None = None, on_epoch_end: Callback | None = None,
        comm: Communicator | None = None, progress: bool = True, balance: Balance = "time",
        warn_after: float = DEFAULT_WARN_AFTER, abort_after: float | None = DEFAULT_ABORT_AFTER,
        timeline: str | os.PathLike[str] | None = None, **options: object) -> FitResult:
    """Train `model` on every rank of `comm` (default: the world) with one of :data:`STRATEGIES`.

    `strategy` is a name with the strategy's options as keywords (``strategy="data", zero=1``) or the
    strategy's options dataclass, whose class names it (``strategy=mpitrain.DataOptions(zero=1)``;
    ``PipelineOptions`` runs "model" when `partitions` takes every rank, else "hybrid"); not both.
    `partitions` (the layers' parts) defaults to what the strategy takes: every rank for "model",
    ``world size // replicas`` for "hybrid" (which needs one of the two), 1 for the others.

    `data` is either a map-style Dataset (with ``batch_size=``, the GLOBAL batch) or an iterable of global
    mini-batches, the same on every rank: ``(inputs, targets)`` pairs or, by the same rule as a Dataset's
    items, mappings holding ``"labels"`` (a DataLoader with its own `collate_fn`). Map-style is a
    ``torch.utils.data.Dataset`` with a length that is not an ``IterableDataset``, or any other object
    with ``__len__`` and ``__getitem__`` (a Hugging Face ``datasets.Dataset``) that is not a list, tuple
    or other sequence (of global batches), a mapping or a tensor. An ``IterableDataset`` (a
    ``datasets.IterableDataset`` too) with ``batch_size=`` is refused: wrap it in
    ``DataLoader(ds, batch_size=B, collate_fn=...)``, an iterable of global batches.

    * Dataset: epoch ``e`` visits ``torch.randperm(len(data), generator=torch.Generator().manual_seed(seed
      + e))`` (``arange`` if not `shuffle`) in global batches of `batch_size`, the last one smaller unless
      `drop_last`. Each rank reads only the rows it uses (a DataLoader per rank with `num_workers` and
      `pin_memory`) where the strategy supports it (feature "shares"; otherwise every rank reads each
      global batch). The item at an index is ``(inputs, target)``, ``(input_1, ..., input_k, target)``
      or a mapping holding ``"labels"`` (Hugging Face's convention: the model is called with every key,
      labels included, and the target is ``item["labels"]``; ``loss_fn=None`` (:func:`model_loss`) trains
      on the model's own ``outputs.loss``, as Hugging Face's Trainer does; a ``"label"`` or
      ``"label_ids"`` key without ``"labels"`` is renamed ``"labels"``, as Hugging Face's collators rename
      it); fit reads item 0 once on every rank to check
      that (with `collate_fn`: the batch it collates from item 0) before any message.
      `remove_unused_columns` (Hugging Face Trainer's name and default, True): the keys of a mapping item
      (before `collate_fn`) or iterable batch (before it is split), and of `eval_data`'s, that are not
      parameters of the model's forward are dropped, the labels ("labels", "label", "label_ids") kept:
      a tokenized dataset's "text", "idx" columns. The forward is the one the model is called through (a
      peft model's base model, a ``torch.compile`` module's ``_orig_mod``); one taking ``**kwargs`` keeps
      every key, except a transformers model's, read by its named parameters as Trainer reads it (its
      ``**kwargs`` are the library's options). Rank 0 prints the dropped columns once (with `progress`).
      FitError on every rank before any message when only the labels would be left (an iterable other
      than a list or tuple: at its first batch, every rank alike). False calls the model with every key.
      `collate_fn` joins items into a batch as a DataLoader's does (variable-length items need a
      padding one, e.g. ``transformers.DataCollatorWithPadding(tokenizer)``); it is called on each
      rank's rows, so each rank pads its rows to their own longest, with torch's and Python's RNGs
      seeded by the rows' place (seed, epoch, batch, first row) and restored after: a random collate
      (``DataCollatorForLanguageModeling(mlm=True)``) masks alike on every run of the same seed and
      world size, differently on each rank's rows, and leaves the training's RNG streams alone.
    * Iterable: the first batch of each epoch is checksummed across ranks (FitError naming the ranks
      that differ from rank 0, and for a DataLoader shuffling without ``generator=``, that fix). A
      DataLoader over a ``DistributedSampler`` (a DDP script's, one shard per rank) as `data` or
      `eval_data` is refused (FitError on every rank before any message, naming the Dataset with the
      global ``batch_size=``).

    Each step's loss is the mean over its global batch (``accumulate=k``: over its k batches, one
    optimizer step); a batch that does not split evenly is split as evenly as possible. Each share's
    (rank's, micro-batch's, accumulated batch's) mean loss is weighted by what it averages over: with
    integer targets, their elements other than the loss's ``ignore_index`` (default -100; a Hugging Face
    causal LM's own loss: ``labels[..., 1:]``), else its samples; so a token-mean loss over labels padded
    or masked with -100 is the mean over the step's counted tokens, and a share counting none adds
    nothing (its NaN is not back-propagated). Every strategy thus computes what one process training on
    those batches computes (up to float rounding, and except where the strategy changes the maths on
    purpose: pipe-sgd's staleness, lossy compression). This assumes `loss_fn` is a mean over its counted
    elements (a per-sequence mean would be mis-weighted); a `loss_fn` whose ``ignore_index`` attribute is
    None is weighted by samples (docs/training-runs.md, "Token-level losses"). `optimizer` is a callable ``params ->
    torch.optim.Optimizer`` or an optimizer instance built on `model`'s parameters
    (``torch.optim.SGD(model.parameters(), lr=0.1)``), rebuilt once at entry for the parameters each
    rank holds: same class, each group's hyperparameters, its state if it holds any; the instance
    itself is never stepped, ``FitResult.optimizer`` is the one that trained (FitError for parameters
    not the model's or trainable ones in no group). `lr_scheduler` a callable ``optimizer -> scheduler``
    (not a scheduler instance) built on the optimizer that trains, stepped per `lr_interval`: "step" after
    every optimizer step (the default), "epoch" once after each epoch's evaluation, a partial epoch's too
    (torchvision's scripts and Lightning's default: ``StepLR(opt, step_size=30)`` in epochs). A
    ``ReduceLROnPlateau`` runs per epoch (lr_interval="step" refused), stepped with the epoch record's
    value `lr_monitor` (default ``"eval_loss"`` with `eval_data`, else ``"loss"``; the same float on every
    rank); lr_monitor with another scheduler, or either keyword without `lr_scheduler`, is refused (FitError,
    before any message; to learn the kind fit builds the scheduler once on a throwaway optimizer when
    either keyword is given). `grad_clip` clips the global
    gradient norm as ``clip_grad_norm_`` in one process;
    ``precision="bf16"`` runs forward and loss under bf16 autocast on the model's device (Lightning's "bf16-mixed").
    ``precision="fp16"`` (Lightning's "16-mixed") runs them under float16 autocast with dynamic loss scaling:
    the loss is multiplied by the scale S before backward; each rank divides the gradients its optimizer
    steps (its parameters', or its ZeRO pieces') by S and one allreduce (max) of one float over the job
    says whether any rank's holds an inf or NaN; if one does, EVERY rank skips that optimizer step (and the
    `lr_scheduler` step), else they clip and step. S follows ``torch.amp.GradScaler``'s rule (x0.5 on an
    overflow, x2 after 2000 finite steps; `grad_scaler`, an enabled GradScaler, sets init_scale and those
    numbers: it is read, not stepped). The scale and skipped count are in checkpoints and in each epoch's
    record (``loss_scale``, ``skipped_steps`` since the run began); a skipped step's loss is reported.
    `steps` caps the optimizer steps per epoch. Callbacks ``on_step_end(state)`` / ``on_epoch_end(state)`` get a
    :class:`LoopState`; returning True or raising :class:`StopTraining` ends the run after that step. Without
    ``on_step_end`` nothing needs a step's loss at once: the step losses stay on the device and are summed over the
    ranks in one message every 16 steps (and at the epoch's end, before a checkpoint), so the loop sends no loss message
    and waits for no device on the other steps (integer targets: each step allreduces its counted elements, a
    non-blocking allreduce started before the forward and waited for before the first backward, under the stall policy);
    the history holds the same floats either way, and the progress bar shows the latest step loss read.

    `eval_data` (batches as `data`'s, or a Dataset read in batches of `batch_size`) is evaluated after
    every epoch: the record's ``eval_loss`` and ``eval_<name>`` of each of `metrics` (callables
    ``(outputs, targets) -> float``, or ``"accuracy"``: :func:`accuracy`) are means over the whole eval, the
    same on every rank: ``eval_loss`` over every target element the loss counts (integer targets other than
    its ``ignore_index``, default -100: each batch weighted by its count, as one process computes the token
    mean over all the eval batches together; float targets: by rows), ``"accuracy"`` over every target it
    counts (each batch weighted by its count), any other metric the mean over the batches weighted by
    their rows. The eval forward runs in eval mode without grad (as ``model.eval()``), every module's mode
    restored after it.

    ``checkpoint_dir=DIR, checkpoint_every=N`` saves an atomic sharded checkpoint (docs/training-runs.md)
    after every N optimizer steps (counted across epochs) and at the end; ``resume=True`` continues
    from the latest one in DIR (or starts fresh), ending bit-identical to an uninterrupted run.

    Strategy-specific keywords go in `options` (or in the options dataclass given as `strategy`).
    No wait of the strategy hangs: one still waiting after
    `warn_after` seconds prints a line naming what it waits for (again every `warn_after` seconds);
    after `abort_after` seconds (None: never) the job ends. ``stall_timeout``/``stall_warning_s`` and
    ``stall_abort`` are deprecated spellings of these two. Every rank must call `fit` with the same
    arguments; bad arguments raise FitError on every rank before any message is sent, including a
    feature the strategy does not support yet. `timeline` names a Chrome-trace JSON file that rank 0
    writes at the end: every rank's steps, compute and messages (docs/timeline.md; when a timeline
    already runs, fit's events go to that one instead).
    """
    columns = used_columns(model, remove_unused_columns)
    s = _settings(data, epochs, steps, batch_size, shuffle, seed, drop_last, num_workers, pin_memory, checkpoint_dir,
                  checkpoint_every, resume, lr_scheduler, grad_clip, accumulate, precision, on_step_end,
                  on_epoch_end, collate_fn, columns, grad_scaler, lr_interval, lr_monitor)
    if loss_fn is None:
        loss_fn = model_loss
    elif not callable(loss_fn):
        raise FitError(f"loss_fn must be a callable (outputs, targets) -> loss, or None for the model's own "
                       f"outputs.loss; got {loss_fn!r}")
    factory = optimizer_factory(optimizer, model)  # once, before any message: what every strategy takes
    comm = comm or world()
    named = _metrics(metrics)
    try:  # called here, so that the DeprecationWarning names the caller of fit
        rest = renamed_options(options, STALL_ALIASES, "fit")
    except TypeError as e:
        raise FitError(str(e)) from None
    _check_loader_keywords(rest)
    stall = stall_policy(warn_after, abort_after, rest)
    name, strategy_options = _strategy_of(strategy, rest, partitions, replicas, comm.size)
    partitions = _partitions_of(name, partitions, replicas, comm.size)
    sharded = _require(name, s, data)
    s = replace(s, lr_monitors=monitors(eval_data, named, s.loop.precision))
    if s.lr_scheduler is not None and (s.lr_interval is not None or s.lr_monitor is not None):
        probe_schedule(s.lr_scheduler, s.lr_interval, s.lr_monitor, s.lr_monitors, factory, model)
    check_global_loader(data, "data")
    check_global_loader(eval_data, "eval_data")
    _check_first_batch(data, columns)
    if eval_data is not None and is_map_dataset(eval_data):
        eval_data = eval_loader(eval_data, batch_size or 1, collate_fn, seed, columns)
    resume_from = _find_resume(comm, s)
    spec = FitSpec(strategy=name, partitions=partitions, replicas=replicas, micro_batches=micro_batches,
                   schedule=schedule, balance=balance, options=strategy_options, stall=stall, loop=s.loop)
    if timeline is not None and not isinstance(timeline, (str, os.PathLike)):
        raise FitError(f"fit: timeline must be a file path, got {timeline!r}")
    model_keys = list(model.state_dict())
    shift = label_shift(model, loss_fn)  # eval_loss's label positions the loss does not see (before any split)
    trainer = make_trainer(model, loss_fn, factory, comm, spec)
    if sharded != isinstance(trainer, StepTrainer):  # a strategy's bug: its FEATURES and its trainer disagree
        raise RuntimeError(f"strategy {name!r}: a trainer of every loop feature is a StepTrainer, and only it")
    with _timeline.recording(timeline, comm):  # fit(timeline="trace.json"): written when the loop ends
        loop = _Loop(trainer, comm, data, s, name, model_keys, progress and comm.rank == 0)
        try:
            if resume_from is not None:
                loop.restore(*resume_from)
            loop.run(eval_data, loss_fn, named, shift)
        except FitError:
            # Refused input is refused on every rank, before the step's messages: end the trainer's comm
            # threads collectively, or a caller that catches the error keeps them cycling (and recording).
            trainer.trained_model()
            raise
        result = FitResult(model=trainer.trained_model(), history=loop.history,
                           optimizer=None if loop.stepper is None else loop.stepper.optimizer)
    return result
