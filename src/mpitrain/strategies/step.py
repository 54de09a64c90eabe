"""The one training step every strategy shares: :class:`StepTrainer`.

`fit` drives every concrete strategy (data, model, hybrid, pipe-sgd, spatial) through this class, so the
order of a step is written once (:meth:`StepTrainer.train_shares`):

1. refuse a finished trainer (``trained_model()`` closed it);
2. :meth:`~StepTrainer.begin_step`: clear the gradients (and what the strategy does first: a pipeline's
   set-up on its first batch, broadcast buffers, pipe-sgd's stale update);
3. :meth:`~StepTrainer.weigh`: the step's weight, the sum over every share of the target elements its
   mean loss counts (:func:`~._batching.counted`: integer targets other than the loss's ignore index,
   else rows) -- one allreduce of one number per step once the first step found integer targets, none
   otherwise (then the weight is the step's samples). Non-blocking: started here, before any forward,
   and waited for (under :attr:`~StepTrainer.stall`) where :attr:`~StepTrainer.step_weight` is first
   read: the first share's scale, after its forward. Why not scale the gradients after backward, which
   would hide the wait behind backward too: that costs a pass over every gradient per step and cannot
   reach gradients that leave the rank during backward (data's buckets, ZeRO's reduce-scatter, a
   pipeline's partial errors, pipe-sgd's thread); the wait it saves is microseconds;
4. :meth:`~StepTrainer.local_pass`: this rank's forward and backward on its rows, each share's (batch's,
   micro-batch's) mean loss weighted by :meth:`~StepTrainer.scale` = ``weight * replicas / step weight``
   (the gradient finish averages over `replicas`: undo it, divide by the step's weight), so the gradient
   is that of the mean over the step's counted elements, as one process computes it on the whole step;
   a share counting nothing back-propagates zero (:func:`~._batching.zero_loss`), not its NaN. Returns
   the sum of this rank's weighted losses in float64, rescaled to samples (``* total / step weight``);
5. :meth:`~StepTrainer.finish_gradients`: what makes the gradient whole (reduce over replicas, drain a
   pipeline, hand it to a communication thread); it says whether this step's gradient is ready now;
6. if it is, :meth:`~StepTrainer.update`: with ``precision="fp16"`` unscale the gradients this rank's
   optimizer steps and agree over the job whether any is inf/NaN (one allreduce of one float:
   :mod:`._scaler`; every rank then skips the step, or none does), then clip by the global norm
   (``spec.loop.grad_clip``, the strategy's :meth:`~StepTrainer.clip_grad_norm_`) and ``optimizer.step()``;
7. :meth:`~StepTrainer.step_losses`: one allgather of the ranks' loss sums over :attr:`~StepTrainer.comm`,
   added up correctly rounded and divided by ``total``: the step's mean loss, equal on every rank. Steps
   1-6 alone are :meth:`~StepTrainer.train_shares_local`; fit (without ``on_step_end``) gathers 16 steps'
   losses in one message, so its loop neither waits for the device nor sends per step.

A strategy supplies its share of a global batch (:meth:`~StepTrainer.share`), those hooks, and its layout
(:meth:`~StepTrainer.layout`, :meth:`~StepTrainer.state_dict`, :meth:`~StepTrainer.load_state_dict`:
:class:`~.base.CheckpointTrainer`). Everything fit may use is declared here, so fit needs no ``getattr``:
``rank_view`` (default: the Dataset itself) and ``record`` (default: nothing) included.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm import settle_on_error, wait_collective
from ..comm.base import Communicator, Request
from ..comm.place import Place
from ._batching import (
    call_rows,
    counted,
    counted_rows,
    even_share,
    gather_outputs,
    ignore_index_of,
    integer_targets,
    samples,
    slice_share,
    zero_loss,
)
from ._device import autocast
from ._scaler import LossScaler
from .base import DEFAULT_LOOP, Batch, BatchShare, LoopSpec, Share

__all__ = ["StepTrainer", "replica_eval"]


class StepTrainer(ABC):
    """The base of every concrete strategy's Trainer (:class:`~.base.Trainer`,
    :class:`~.base.ShardedTrainer` and :class:`~.base.CheckpointTrainer` in one). Every rank calls every
    method, in the same order.

    A subclass sets :attr:`optimizer`, :attr:`comm` (where the loss is summed: every rank of the job),
    :attr:`loop` and :attr:`replicas` (how many copies the gradient finish averages over; 1 where it sums)
    and implements :meth:`local_pass`, :meth:`clip_grad_norm_`, :meth:`eval_step`, :meth:`trained_model`
    and the checkpoint methods; the other hooks have defaults.
    """

    #: this rank's optimizer, stepped once per :meth:`train_shares` (fit hands it to an LR scheduler)
    optimizer: torch.optim.Optimizer
    #: the communicator of the whole job (the step's loss is summed over it)
    comm: Communicator
    #: fit's loop features (grad_clip, precision)
    loop: LoopSpec = DEFAULT_LOOP
    #: the number of copies of the model whose gradients the finish averages (the weight undoes it)
    replicas: int = 1
    #: the strategy's name in messages ("this <label> trainer is finished")
    label: str = "?"
    #: this rank's place, read by the default :meth:`share` (its replicas); a subclass that defines
    #: share() itself need not set it
    place: Place
    #: whether shares are weighted by :meth:`weight` (False: by rows; spatial counts its loss's elements itself)
    token_weights: bool = True
    #: label positions per row the loss does not see (:func:`~._batching.label_shift`; set from the model)
    label_shift: int = 0
    #: the current step's weight, once :attr:`step_weight` has waited for it
    _step_weight: float = 1.0
    #: the weight's allreduce in flight (request, its buffer, the step's samples); None once read
    _weighing: tuple[Request, torch.Tensor, int] | None = None
    #: how many weight allreduces this trainer started (the same on every rank: names a late one)
    _weighings: int = 0
    #: bounds the wait for the step's weight (fit's warn_after/abort_after; make_trainer sets it)
    stall: StallPolicy = DEFAULT_POLICY
    #: whether the job's targets are counted (integer); None until the first step asked every rank
    _counting: bool | None = None
    #: fp16's loss scaler (:attr:`loss_scaler` builds it from ``loop.scaler`` on first use)
    _scaler: LossScaler | None = None

    # -- what fit reads ---------------------------------------------------------------------------------
    def share(self, n: int) -> Share:
        """The rows of a global batch of `n` this rank reads: by default replica r's block of
        :func:`~mpitrain.comm.base.split_sizes` (as even as possible). A pure function of `n` and the layout."""
        return even_share(n, self.place.replicas, self.place.replica)

    def rank_view(self, dataset: Dataset[Any]) -> Dataset[Any]:
        """What this rank's DataLoader reads of a map-style `dataset` (same length and indices); fit calls
        it once, before training from a Dataset. Default: the dataset itself."""
        return dataset

    @property
    def record(self) -> dict[str, Any]:
        """What fit adds to each epoch's history record (default: nothing)."""
        return {}

    @property
    def closed(self) -> bool:
        """True once :meth:`trained_model` finished the trainer: no more steps."""
        return False

    # -- the step ---------------------------------------------------------------------------------------
    def train_step(self, inputs: Batch, targets: torch.Tensor) -> float:
        """One step on a global batch every rank holds in full (any size): :meth:`train_shares` of this
        rank's :meth:`share` of it."""
        n = samples(inputs, targets)
        return self.train_shares([slice_share(inputs, targets, self.share(n))], n)

    def train_shares(self, batches: Sequence[BatchShare], total: int) -> float:
        """ONE optimizer step on the concatenation of `batches` (:class:`~.base.ShardedTrainer`): the
        gradient of the mean loss over all `total` samples; returns that mean loss, equal on every rank.
        The order is the module's (steps 1-6); collective on :attr:`comm`."""
        return self.step_losses(self.train_shares_local(batches, total))[0] / total

    def train_shares_local(self, batches: Sequence[BatchShare], total: int) -> torch.Tensor:
        """Steps 1-5 of :meth:`train_shares`: the same optimizer step, without the loss's message. Returns
        this rank's sum of per-sample losses (float64, one element, on this rank's device) unread, so
        nothing waits for the device here; :meth:`step_losses` sums it over the ranks later, alone or with
        other steps' (fit reduces 16 steps' losses in one message). Collective as the step is."""
        if self.closed:
            raise RuntimeError(f"this {self.label} trainer is finished (trained_model() closed it)")
        self.begin_step(batches)
        with settle_on_error(self._abandon_weight):  # a failed step leaves its weight message alive, forgotten
            self.weigh(batches, total)
            local = self.local_pass(batches, total)
            if self.finish_gradients():
                self.update()
        if self.step_weight == total:
            return local.reshape(1)
        # the weighted sum in samples, so that fit's division by `total` gives the mean over counted elements
        return (local * (total / self.step_weight if self.step_weight else math.nan)).reshape(1)

    def step_losses(self, local: torch.Tensor) -> list[float]:
        """Collective on :attr:`comm` (step 6: one allgather): for each element of `local`, a 1-D float64
        tensor of this rank's :meth:`train_shares_local` results for successive steps, its sum over the
        ranks, correctly rounded (``math.fsum``), so it is the same float on every rank and for any number of
        steps per call. Reads the values back to the host (the one wait for the device)."""
        every = self.comm.allgather(local.reshape(-1)).view(self.comm.size, -1).cpu()
        return [math.fsum(column) for column in every.t().tolist()]

    def begin_step(self, batches: Sequence[BatchShare]) -> None:
        """Before any forward of a step: clear the gradients (default ``optimizer.zero_grad()``)."""
        self.optimizer.zero_grad()

    @abstractmethod
    def local_pass(self, batches: Sequence[BatchShare], total: int) -> torch.Tensor:
        """This rank's forward and backward on its rows of `batches`, each batch's mean loss back-propagated
        times :meth:`scale` (:meth:`backward` does both); returns the sum of this rank's per-sample losses
        (a float64 tensor of one element; zero on a rank without rows, which still takes part)."""

    def finish_gradients(self) -> bool:
        """Make the gradient whole (reduce over replicas, ...); True when this step's gradient is ready to
        apply now (default: it is, backward reduced it)."""
        return True

    def update(self) -> None:
        """With ``precision="fp16"``: unscale the gradients this rank's optimizer steps and skip the step
        on every rank when any rank's is not finite (:meth:`~._scaler.LossScaler.unscale_and_agree`:
        collective on :attr:`comm`). Then clip by the norm of the whole model's gradient when
        ``loop.grad_clip`` is set (equal to one process's ``clip_grad_norm_``), and step the optimizer."""
        scaler = self.loss_scaler
        if scaler is not None and not scaler.unscale_and_agree(self._optimizer_grads(), self.comm,
                                                               self.grads_made_with(), self.stall):
            return
        if self.loop.grad_clip is not None:
            self.clip_grad_norm_(self.loop.grad_clip)
        self.optimizer.step()

    @property
    def loss_scaler(self) -> LossScaler | None:
        """The loss scaler of ``precision="fp16"`` (None otherwise); its state is in fit's checkpoints."""
        if self._scaler is None and self.loop.precision == "fp16":
            self._scaler = LossScaler(self.loop.scaler)
        return self._scaler

    def grads_made_with(self) -> float | None:
        """The loss scale the gradients :meth:`update` applies were made with (None: the current one;
        pipe-sgd's stale gradients were made K steps ago)."""
        return None

    def _optimizer_grads(self) -> list[torch.Tensor]:
        """The gradients this rank's optimizer steps: its parameters' or, under ZeRO, its pieces' (what
        :meth:`clip_grad_norm_` walks)."""
        return [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]

    @abstractmethod
    def clip_grad_norm_(self, max_norm: float) -> None:
        """Scale the (whole, averaged) gradient as ``clip_grad_norm_`` over the whole model in one process;
        collective where the norm needs other ranks' parts."""

    @property
    def ignore_index(self) -> int | None:
        """The target value the strategy's ``loss_fn`` does not count (:func:`~._batching.ignore_index_of`:
        its ``ignore_index``, else -100; None: count rows)."""
        return ignore_index_of(getattr(self, "loss_fn", None))  # every concrete strategy sets loss_fn

    def weight(self, targets: Any, rows: int) -> int:
        """The weight of a share of `rows` samples with `targets` (fit's one rule,
        :func:`~._batching.counted`): the target elements its mean loss counts when the job's targets are
        integers (those other than ``loss_fn.ignore_index``, default -100), else `rows`."""
        if not self.token_weights:
            return rows
        # no need to wait for the first step's verdict: counted() gives float targets their rows, and a rank
        # holding integer targets makes the verdict "integer"
        return counted(targets, rows, self.ignore_index, self.label_shift)

    def share_weights(self, targets: Any, sizes: list[int]) -> list[int]:
        """:meth:`weight` of each block of `sizes` samples of `targets` (``sum(sizes)`` samples, k target
        rows each): a pipeline's micro-batches; `sizes` itself without targets (a rank computing no loss)."""
        if targets is None or not self.token_weights:
            return list(sizes)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [counted_rows(targets, sum(sizes), a, a + s, self.ignore_index, self.label_shift)
                for a, s in zip(starts, sizes)]

    def weigh(self, batches: Sequence[BatchShare], total: int) -> None:
        """Start the step's weight over every rank: the sum of :meth:`weight` over the ranks' shares holding
        targets, read as :attr:`step_weight`. Collective on :attr:`comm` (every rank, before any forward),
        and non-blocking: it starts one allreduce of one or two numbers (``comm.iallreduce``) that
        :attr:`step_weight` waits for where it is first needed (the first share's scaled backward, after
        its forward), under the stall policy :attr:`stall`. The first step also agrees whether any rank
        holds integer targets (the ranks without targets, a pipeline's first stages, learn it there);
        later steps send the count only when they do, and nothing otherwise (the weight is then `total`,
        the samples)."""
        if not self.token_weights or self._counting is False:
            self._step_weight = total
            return
        held = [b for b in batches if b.targets is not None and b.share.rows]
        asking = self._counting is None
        # counted() itself gives a float batch its rows: the count is right before the verdict is known
        mine = float(sum(counted(b.targets, b.share.rows, self.ignore_index, self.label_shift) for b in held))
        integer = any(integer_targets(b.targets) for b in held)
        sums = torch.tensor([mine, float(integer)] if asking else [mine], dtype=torch.float64)
        self._weighing = (self.comm.iallreduce(sums), sums, total)
        self._weighings += 1

    @property
    def step_weight(self) -> float:
        """The current step's weight (:meth:`weigh`): what :meth:`scale` divides by. The first read of a
        step waits for the weight's allreduce (:func:`~mpitrain.comm.wait_collective`: a rank still
        waiting after ``stall.warn_after`` seconds says so, naming the ranks not waiting in it -- a rank that
        stopped before the step among them -- and ends the job after ``stall.abort_after``)."""
        self._settle_weight()
        return self._step_weight

    @step_weight.setter
    def step_weight(self, value: float) -> None:  # a step weighed otherwise (spatial's own losses, tests)
        self._settle_weight()
        self._step_weight = value

    def _abandon_weight(self) -> list[Request]:
        """The weight's request of a step that failed (settle_on_error keeps it alive), now forgotten."""
        pending, self._weighing = self._weighing, None
        return [pending[0]] if pending is not None else []

    def _settle_weight(self) -> None:
        if self._weighing is None:
            return
        req, sums, total = self._weighing
        rank, step = self.comm.rank, self._weighings
        wait_collective(req, self.comm, step, lambda: f"the step's weight allreduce (no. {step} of the "
                        f"{self.label} trainer, over ranks 0-{self.comm.size - 1})", self.stall, who=f"rank {rank}",
                        abort=self.comm.abort)
        self._weighing = None
        if sums.numel() == 2:
            self._counting = bool(sums[1] > 0)
        self._step_weight = float(sums[0]) if self._counting else total

    def scale(self, weight: int, total: int) -> float:
        """The factor on a mean loss of a share of `weight` (:meth:`weight`) in a step of `total` samples:
        ``weight * replicas / step_weight``, so that after the finish's average the gradient is that of the
        step's mean over its counted elements (with rows: its mean loss); times fp16's loss scale
        (:attr:`loss_scaler`; :meth:`update` divides it out)."""
        scaler = self.loss_scaler
        return weight * self.replicas / self.step_weight * (1.0 if scaler is None else scaler.scale)

    def scales(self, weights: Sequence[int], total: int) -> Sequence[float]:
        """:meth:`scale` of each of `weights`, each computed when it is read: a pipeline reads a micro-batch's
        where its loss is back-propagated (the last stage), so the step's weight is waited for there, after
        that stage's first forward, and the other stages never wait for it inside the pass."""
        return _Scales(self, list(weights), total)

    def backward(self, loss: torch.Tensor, weight: int, total: int, out: Any = None) -> torch.Tensor:
        """Back-propagate the mean `loss` of a share of `weight` (:meth:`weight`) times :meth:`scale` (fp16's
        loss scale included); returns ``loss * weight`` in float64 (detached), what :meth:`local_pass` adds
        up. A share of weight 0 (every target ignored: its loss is NaN) back-propagates zero through `out`, the model's
        outputs (:func:`~._batching.zero_loss`), so the gradient holds no NaN, and adds 0."""
        if weight == 0:
            zero_loss(out, loss).backward()
            return torch.zeros((), dtype=torch.float64, device=loss.device)
        (loss * self.scale(weight, total)).backward()
        return loss.detach().double() * weight

    # -- the rest of the Trainer ------------------------------------------------------------------------
    @abstractmethod
    def eval_step(self, inputs: Batch, targets: torch.Tensor) -> Any:
        """Forward only (no grad) on the global batch; the full outputs on every rank."""

    @abstractmethod
    def trained_model(self) -> nn.Module:
        """The user's model with the trained weights, on every rank. Collective; no steps afterwards."""

    @abstractmethod
    def layout(self) -> dict[str, object]:
        """How the state is split (JSON-able, equal on every rank): :class:`~.base.CheckpointTrainer`."""

    @abstractmethod
    def state_dict(self) -> dict[str, object]:
        """This rank's shard (:class:`~.base.CheckpointTrainer`). Collective."""

    @abstractmethod
    def load_state_dict(self, read: Callable[[int], dict[str, object]], saved_layout: Mapping[str, object]) -> None:
        """Restore from a checkpoint of `saved_layout` (:class:`~.base.CheckpointTrainer`); every rank,
        before the first step."""


class _Scales(Sequence[float]):
    """:meth:`StepTrainer.scales`: a read-only sequence of scale factors computed on access."""

    def __init__(self, trainer: StepTrainer, weights: list[int], total: int) -> None:
        self._trainer, self._weights, self._total = trainer, weights, total

    def __len__(self) -> int:
        return len(self._weights)

    def __getitem__(self, i: Any) -> Any:  # Sequence's overloads: an index, or a slice (a list)
        if isinstance(i, slice):
            return [self._trainer.scale(w, self._total) for w in self._weights[i]]
        return self._trainer.scale(self._weights[i], self._total)


@torch.no_grad()
def replica_eval(module: nn.Module, comm: Communicator, place: Place, inputs: Batch, targets: torch.Tensor,
                 device: torch.device, precision: str = "fp32", loss_fn: object = None, shift: int = 0) -> Any:
    """The eval step of a strategy that keeps a whole replica per rank: each replica runs its block of the
    batch (:func:`~._batching.even_share`), the outputs are gathered along dim 0 on every rank, in the
    model's own structure; a 0-dim mean (``out.loss``) is averaged with each block weighted by
    :func:`~._batching.counted` (`loss_fn`'s ignore index, `shift`), as training weighs shares. Collective on `comm`.

    The forward runs in eval mode without grad, as one process evaluates (``model.eval()``): BatchNorm
    normalizes by its running statistics and does not update them, Dropout is off. Each module's own mode
    is put back afterwards (a layer the user froze in eval mode stays so)."""
    n = samples(inputs, targets)
    s = even_share(n, place.replicas, place.replica)
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        with torch.no_grad(), autocast(precision, device):
            out = call_rows(module, inputs, s.start, s.stop, device)
    finally:
        for m, training in modes.items():
            m.train(training)
    blocks = [even_share(n, place.replicas, r) for r in range(place.replicas)]
    ignore = ignore_index_of(loss_fn)
    weights = [counted_rows(targets, n, b.start, b.stop, ignore, shift) for b in blocks]
    return gather_outputs(comm, out, [b.rows for b in blocks], weights)
