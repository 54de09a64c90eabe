"""When and with what fit steps the LR scheduler: lr_interval ("step" after every optimizer step, "epoch"
once after each epoch, as torchvision's scripts and Lightning's default interval) and lr_monitor (the
epoch record's value a ``ReduceLROnPlateau`` is stepped with, the same float on every rank)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .strategies import probe_optimizer
from .strategies.base import FitError, OptimizerFactory

__all__ = ["SchedulerFactory", "LR_INTERVALS", "SCHEDULER_KEYWORDS", "Schedule", "check_schedule_words", "monitors",
           "probe_schedule"]


#: fit's ``lr_scheduler``: optimizer -> scheduler (built on the optimizer that trains)
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

#: Lightning's lr_scheduler config keys given to fit as keywords -> fit's names for them
SCHEDULER_KEYWORDS = {"interval": "lr_interval", "monitor": "lr_monitor"}


#: lr_interval's values (Lightning's ``interval``): when fit steps the LR scheduler
LR_INTERVALS = ("step", "epoch")


def check_schedule_words(lr_scheduler: SchedulerFactory | None, lr_interval: object, lr_monitor: object) -> None:
    """FitError (local, every rank alike) for an lr_interval other than :data:`LR_INTERVALS`, an lr_monitor
    that is not a name, or either without an lr_scheduler (they would change nothing)."""
    if lr_interval is not None and lr_interval not in LR_INTERVALS:
        raise FitError(f"lr_interval must be 'step' (the scheduler stepped after every optimizer step) or 'epoch' "
                       f"(once after every epoch, as torchvision's scripts and Lightning's default interval step it); "
                       f"got {lr_interval!r}")
    if lr_monitor is not None and not isinstance(lr_monitor, str):
        raise FitError(f"lr_monitor must be the name of a value in fit's epoch record (e.g. 'eval_loss'), "
                       f"got {lr_monitor!r}")
    if lr_scheduler is None and (lr_interval is not None or lr_monitor is not None):
        raise FitError(f"lr_interval={lr_interval!r} and lr_monitor={lr_monitor!r} say when and with what fit "
                       f"steps lr_scheduler=, which was not given")


def monitors(eval_data: object, metrics: Iterable[str], precision: str) -> tuple[str, ...]:
    """The keys of fit's epoch record that lr_monitor may name: every value the same on every rank
    (``samples_per_s`` is timed per rank: a schedule stepped on it would differ between the ranks)."""
    keys = ["loss"]
    if eval_data is not None:
        keys += ["eval_loss", *(f"eval_{name}" for name in metrics)]
    if precision == "fp16":
        keys += ["loss_scale", "skipped_steps"]
    return tuple(keys)


@dataclass(frozen=True)
class Schedule:
    """When fit steps the LR scheduler (`interval`, one of :data:`LR_INTERVALS`) and with what: `monitor`,
    the epoch record's value a ReduceLROnPlateau is stepped with (None: ``step()`` without one)."""

    interval: str
    monitor: str | None

    @staticmethod
    def of(scheduler: object, interval: str | None, monitor: str | None, keys: tuple[str, ...]) -> Schedule:
        """fit's `interval` and `monitor` (lr_interval, lr_monitor as given) resolved for `scheduler`'s kind;
        FitError (local: every rank builds the same kind) for what that kind refuses. A ReduceLROnPlateau
        needs a value per step: one of the epoch record's, so it runs per epoch ("step" refused) on
        `monitor` (one of the record's `keys`, :func:`monitors`; default "eval_loss" with eval_data, else
        "loss"); any other scheduler steps without a value (lr_monitor refused), per step unless
        lr_interval="epoch"."""
        kind = type(scheduler).__name__
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if monitor is not None:
                raise FitError(f"lr_monitor={monitor!r} is the value a ReduceLROnPlateau is stepped with; "
                               f"a {kind} steps without one: leave lr_monitor out")
            return Schedule(interval or "step", None)
        if interval == "step":
            raise FitError("a ReduceLROnPlateau is stepped with a value of fit's epoch record (lr_monitor=), which "
                           "exists once per epoch: pass lr_interval='epoch' or leave it out (its default then)")
        monitor = monitor or ("eval_loss" if "eval_loss" in keys else "loss")
        if monitor not in keys:
            hint = " (eval_loss needs eval_data=)" if monitor.startswith("eval_") and \
                "eval_loss" not in keys else ""
            if monitor.startswith("val_"):
                hint = f" (Lightning's {monitor!r} is fit's 'eval_{monitor[4:]}', with eval_data=)"
            raise FitError(f"lr_monitor={monitor!r} is not a value of fit's epoch record{hint}: this run's "
                           f"records hold {list(keys)}")
        return Schedule("epoch", monitor)


def probe_schedule(lr_scheduler: SchedulerFactory, interval: str | None, monitor: str | None,
                   keys: tuple[str, ...], factory: OptimizerFactory, model: nn.Module) -> None:
    """FitError, before any message, for an lr_interval or lr_monitor that the scheduler's kind refuses
    (:meth:`Schedule.of`). The kind is known only from a built scheduler: fit calls this when either keyword
    was given, and the scheduler factory is called once here on a throwaway optimizer
    (:func:`probe_optimizer`), as an optimizer instance is rebuilt once at entry."""
    Schedule.of(lr_scheduler(probe_optimizer(factory, model)), interval, monitor, keys)
