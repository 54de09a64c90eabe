"""What the planner returns: :class:`Plan`, the ranked :class:`Plans` with the candidates it dropped."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..strategies.base import FitError, FitSpec

__all__ = ["Plan", "Dropped", "Plans", "PlanError", "format_options", "spec_for", "FIT_FIELDS"]

#: The keys of :attr:`Plan.breakdown`, in display order.
BREAKDOWN = ("compute", "communication", "bubble", "halo")
#: Plan options that are ``fit`` keywords of their own (FitSpec fields), not strategy options.
FIT_FIELDS = ("partitions", "replicas", "micro_batches", "schedule")


class PlanError(FitError):
    """`plan` was called with something it cannot plan for; raised on every rank before any message."""


def format_options(options: dict[str, Any]) -> str:
    return " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in options.items()) or "-"


@dataclass(frozen=True)
class Plan:
    """One way to run the model: ``fit(model, data, loss_fn, opt, strategy=p.strategy, **p.options)``.

    `step_s`: predicted seconds per optimizer step on the global batch; `memory_bytes`: predicted peak
    bytes per rank (parameters, gradients, one optimizer state, kept activations, message buffers);
    `breakdown`: `step_s` split into compute, communication, bubble and halo seconds (for display; they
    sum to `step_s`). `measured`: False when priced for a rank count other than the ranks that
    calibrated (``plan(world_size=W)``): the network's alpha-beta is extrapolated, not measured."""

    strategy: str
    options: dict[str, Any]
    step_s: float
    memory_bytes: int
    breakdown: dict[str, float] = field(default_factory=dict)
    measured: bool = True

    def describe(self) -> str:
        return f"{self.strategy} {format_options(self.options)}" + ("" if self.measured else " (not measured)")

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "options": {k: list(v) if isinstance(v, tuple) else v
                                                       for k, v in self.options.items()},
                "step_s": self.step_s, "memory_bytes": self.memory_bytes, "breakdown": dict(self.breakdown),
                "measured": self.measured}


@dataclass(frozen=True)
class Dropped:
    """A candidate the planner left out, and why."""

    strategy: str
    options: dict[str, Any]
    reason: str

    def describe(self) -> str:
        return f"{self.strategy} {format_options(self.options)}: {self.reason}"


class Plans(list[Plan]):
    """The plans, fastest first; `dropped` lists the candidates left out (over memory, cannot run)."""

    def __init__(self, plans: list[Plan], dropped: list[Dropped]) -> None:
        super().__init__(plans)
        self.dropped = dropped

    def table(self, limit: int | None = None) -> str:
        """The ranked table as text: rank, strategy, options, step, memory and breakdown."""
        rows = [["#", "strategy", "options", "step ms", "memory MiB", *(f"{k} ms" for k in BREAKDOWN)]]
        for i, p in enumerate(self[:limit]):
            name = p.strategy + ("" if p.measured else "*")
            rows.append([str(i), name, format_options(p.options), f"{p.step_s * 1e3:.1f}",
                         f"{p.memory_bytes / 2**20:.0f}", *(f"{p.breakdown.get(k, 0.0) * 1e3:.1f}" for k in BREAKDOWN)])
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        note = ["* not measured: priced for another rank count from the calibration's ranks (extrapolated)"]
        return "\n".join(["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
                         + (note if any(not p.measured for p in self[:limit]) else []))

    def explanation(self) -> str:
        return "\n".join(f"dropped: {d.describe()}" for d in self.dropped)


def spec_for(chosen: Plan, spec: FitSpec) -> FitSpec:
    """The FitSpec that runs `chosen`: its fit-level keywords as fields, the rest as options."""
    fields = {k: v for k, v in chosen.options.items() if k in FIT_FIELDS}
    opts = {k: v for k, v in chosen.options.items() if k not in FIT_FIELDS}
    return replace(spec, strategy=chosen.strategy, options=opts, **fields)
