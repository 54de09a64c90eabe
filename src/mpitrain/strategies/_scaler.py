"""Dynamic loss scaling for ``fit(..., precision="fp16")``, with the verdict of the whole job.

A float16 backward underflows small gradients to zero; the loss is multiplied by a scale S before
backward and each gradient divided by S before the step, as ``torch.amp.GradScaler`` does. The one
difference from a GradScaler on each rank: under ZeRO, a pipeline or a spatial grid every rank holds
different gradients, so one rank may find an inf another does not; a rank-local verdict would skip the
step on some ranks only and the replicas would diverge silently. Here each rank checks and unscales
the gradients its optimizer steps, then ONE allreduce (max) of one float over the job's communicator
makes the verdict the job's: every rank skips the same steps and halves the same scale.

The arithmetic is torch's own: ``torch._amp_foreach_non_finite_check_and_unscale_`` (the unscale and
the non-finite check GradScaler runs) and ``torch._amp_update_scale_`` (its growth/back-off rule:
x ``backoff_factor`` on an overflow, x ``growth_factor`` after ``growth_interval`` finite steps in a row).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm import wait_request
from ..comm.base import Communicator

__all__ = ["ScalerSpec", "LossScaler"]


@dataclass(frozen=True)
class ScalerSpec:
    """GradScaler's four numbers, its defaults included (``fit(grad_scaler=torch.amp.GradScaler(...))``
    reads them from a GradScaler; :meth:`of`)."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    @classmethod
    def of(cls, scaler: torch.amp.GradScaler) -> ScalerSpec:
        """The numbers `scaler` was built with (its public getters; it is not stepped)."""
        return cls(float(scaler.get_scale()), scaler.get_growth_factor(), scaler.get_backoff_factor(),
                   scaler.get_growth_interval())


class LossScaler:
    """The scale S, its growth tracker, and the job's verdict per step. Every rank holds the same
    state: it changes only by the job's verdict (:meth:`unscale_and_agree`)."""

    def __init__(self, spec: ScalerSpec) -> None:
        self.spec = spec
        # CPU tensors: torch's update op works on them in place; the scale is read as a float per step
        self._scale = torch.full((), spec.init_scale, dtype=torch.float32)
        self._growth = torch.zeros((), dtype=torch.int32)
        #: the current scale as a float (what backward multiplies the loss by)
        self.scale = spec.init_scale
        #: steps skipped (non-finite gradient somewhere in the job) since construction
        self.skipped = 0
        #: whether the latest :meth:`unscale_and_agree` found the step finite
        self.stepped = True

    def unscale_and_agree(self, grads: Iterable[torch.Tensor], comm: Communicator, made_with: float | None = None,
                          stall: StallPolicy = DEFAULT_POLICY) -> bool:
        """Divide `grads` (this rank's, those its optimizer steps) by the scale they were made with
        (`made_with`, default the current one), find whether any element of any rank's is inf or NaN
        (one allreduce max of one float on `comm`: collective, the job's verdict; a rank still waiting for
        it after ``stall.warn_after`` s says so, the job ends after ``stall.abort_after``) and update the scale
        by GradScaler's rule. Returns True when the step may go on (every rank alike). A gradient made
        with a scale above the current one (pipe-sgd's stale gradients, backed off since) that
        overflows skips its step without backing off again: its scale's overflow was counted already."""
        made = self.scale if made_with is None else made_with
        found = torch.zeros(1, dtype=torch.float32)
        inv = torch.full((), 1.0 / made, dtype=torch.float32)
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for g in grads:
            by_device.setdefault((g.device, g.dtype), []).append(g)
        for (device, _), group in by_device.items():
            here = torch.zeros(1, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(group, here, inv.to(device))
            found += here.cpu()  # a CUDA rank waits for its device here, as GradScaler.step does
        wait_request(comm.iallreduce(found, "max"), "the fp16 overflow verdict's allreduce", stall,
                     who=f"rank {comm.rank}", abort=comm.abort)
        finite = bool(found[0] == 0)
        if finite or made <= self.scale:  # made with a larger scale, since backed off: counted already
            s = self.spec
            torch._amp_update_scale_(self._scale, self._growth, found, s.growth_factor, s.backoff_factor,
                                     s.growth_interval)
            self.scale = float(self._scale)
        self.stepped = finite
        self.skipped += not finite
        return finite

    def state_dict(self) -> dict[str, float | int]:
        """The scale, the growth tracker and the skipped count (equal on every rank)."""
        return {"scale": self.scale, "growth_tracker": int(self._growth), "skipped": self.skipped}

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._growth.fill_(int(state["growth_tracker"]))
        self.scale = float(self._scale)
        self.skipped = int(state.get("skipped", 0))
