"""``nn.SyncBatchNorm`` under fit's replica strategies (data, ZeRO, pipe-sgd): statistics over the job's rows.

torch's SyncBatchNorm synchronises through ``torch.distributed``; fit runs over MPI, where it is not
initialised, and torch then falls back to per-rank batch norm, silently (and with it initialised, the torch
backend, it refuses CPU inputs). :func:`sync_batch_norms` gives each SyncBatchNorm instance of the model, for
the time of fit, a forward that computes what DDP + SyncBatchNorm computes: in training mode, batch statistics
over every rank's rows of the current forward (the project's one synchronised batch norm,
:func:`mpitrain.spatial.batchnorm.sync_batch_norm`: one allgather of 2C+1 numbers forward, one allreduce of 2C
backward; running statistics by torch's rule over the global count). Its collectives run on a duplicate of
fit's communicator (``comm.split(0)``: they never interleave with the gradient buckets' reducer thread or the
step's own messages) and each wait is bounded by fit's stall policy (:func:`~mpitrain.comm.wait_collective`).
Eval mode, and a job of one rank, run torch's own forward: running statistics, no messages.

The classes stay the user's: an instance attribute ``forward`` shadows the class's, and :meth:`SyncedNorms.restore`
deletes it (the trainers call it from ``trained_model``, which fit calls last, also after a refusal), so the
returned model holds plain ``nn.SyncBatchNorm`` modules that work in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm import wait_collective
from ..comm.base import Communicator
from ..spatial.batchnorm import sync_batch_norm, update_running
from .base import BatchShare, FitError

__all__ = ["SyncedNorms", "sync_batch_norms", "sync_norm_names", "check_sync_norms"]


def sync_norm_names(model: nn.Module) -> list[str]:
    """The names of `model`'s ``nn.SyncBatchNorm`` modules, in module order."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.SyncBatchNorm)]


def check_sync_norms(model: nn.Module) -> None:
    """Refuse (FitError, local: the same verdict on every rank) a SyncBatchNorm with a ``process_group``:
    under fit the statistics cover the whole job; a torch.distributed group means nothing over MPI."""
    for name, m in model.named_modules():
        if isinstance(m, nn.SyncBatchNorm) and m.process_group is not None:
            raise FitError(f"SyncBatchNorm {name!r} has a process_group: under fit its statistics cover the whole "
                           f"job (every rank's rows of each forward); leave process_group=None")


class _StallBoundComm:
    """The two collectives :func:`sync_batch_norm` needs, on `comm`, each waited for under `stall`: the
    allgather is an allreduce (sum) of a zeroed (size x k) buffer holding this rank's row (exact: every
    other term is zero; the Communicator has no non-blocking allgather, and the rows are 2C+1 numbers)."""

    def __init__(self, comm: Communicator, stall: StallPolicy) -> None:
        self.comm, self.stall, self.calls = comm, stall, 0

    @property
    def size(self) -> int:
        return self.comm.size

    def _reduce(self, buf: torch.Tensor, what: str) -> torch.Tensor:
        self.calls += 1
        seq, comm = self.calls, self.comm
        wait_collective(comm.iallreduce(buf, "sum"), comm, seq,
                        lambda: f"SyncBatchNorm's {what} (collective no. {seq}, over ranks 0-{comm.size - 1})",
                        self.stall, who=f"rank {comm.rank}", abort=comm.abort)
        return buf

    def allgather(self, t: torch.Tensor) -> torch.Tensor:
        rows = t.new_zeros(self.comm.size, t.numel())
        rows[self.comm.rank] = t.reshape(-1)
        return self._reduce(rows, "statistics allgather").reshape(-1)

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op == "sum"  # sync_batch_norm's backward sums
        return self._reduce(t, "gradient allreduce")


class _Layer:
    """`sync_batch_norm`'s `layer` for one SyncBatchNorm: its eps, and torch's running-statistics rule
    (counted, momentum or cumulative average) on its buffers when it tracks them."""

    def __init__(self, bn: nn.SyncBatchNorm) -> None:
        self.bn, self.eps = bn, bn.eps

    def update_running(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        if self.bn.track_running_stats:
            update_running(self.bn, self.bn.momentum, mean, var, n)


def _synced_forward(bn: nn.SyncBatchNorm, comm: _StallBoundComm) -> Callable[[torch.Tensor], torch.Tensor]:
    layer, own = _Layer(bn), type(bn).forward

    def forward(input: torch.Tensor) -> torch.Tensor:
        if not bn.training:  # torch's: running statistics (or, untracked, this rank's batch), no messages
            return own(bn, input)
        bn._check_input_dim(input)
        return sync_batch_norm(input, bn.weight, bn.bias, layer, comm)

    return forward


class SyncedNorms:
    """The SyncBatchNorm modules of a model, synchronised over a duplicate of a communicator until
    :meth:`restore`. Empty (nothing patched, no communicator) when the model has none or the job one rank."""

    def __init__(self, model: nn.Module, comm: Communicator, stall: StallPolicy = DEFAULT_POLICY) -> None:
        self.names = sync_norm_names(model)
        self.modules: list[nn.SyncBatchNorm] = []
        self._comm: Communicator | None = None
        if not self.names or comm.size == 1:
            return
        check_sync_norms(model)
        private = comm.split(0)  # collective: every rank builds its trainer here
        assert private is not None  # every rank passes color 0
        self._comm, bound = private, _StallBoundComm(private, stall)
        for m in model.modules():
            if isinstance(m, nn.SyncBatchNorm):
                m.forward = _synced_forward(m, bound)  # type: ignore[method-assign, assignment]
                self.modules.append(m)

    def __bool__(self) -> bool:
        return bool(self.modules)

    def check_forwards(self, batches: Sequence[BatchShare], size: int, pieces: Callable[[int, int], int],
                       what: str) -> None:
        """Refuse (FitError, on every rank alike: a pure function of the batch sizes) a step in which the
        ranks would not run the same training forwards: each forward of a SyncBatchNorm is a collective, and
        its statistics are those of every rank's j-th forward. ``pieces(n, r)`` is rank r's number of
        forwards on a global batch of `n` rows; `what` says how to avoid the refusal."""
        if not any(m.training for m in self.modules):  # none synchronises (eval mode): no collective
            return
        counts = [tuple(pieces(b.n, r) for b in batches) for r in range(size)]
        if len(set(counts)) > 1:
            raise FitError(f"SyncBatchNorm {self.names[0]!r}: every rank must run the same training forwards (each "
                           f"combines statistics over the ranks), but this step's batches of "
                           f"{[b.n for b in batches]} samples give the ranks {[sum(c) for c in counts]} forwards; "
                           f"{what}")

    def restore(self) -> None:
        """Give every module its class's forward back and free the duplicate communicator (idempotent).
        Collective when anything was synchronised (every rank calls it)."""
        for m in self.modules:
            if "forward" in m.__dict__:
                del m.forward
        self.modules = []
        if self._comm is not None:
            self._comm.free()
            self._comm = None


def sync_batch_norms(model: nn.Module, comm: Communicator, stall: StallPolicy = DEFAULT_POLICY) -> SyncedNorms:
    """Synchronise `model`'s ``nn.SyncBatchNorm`` modules over `comm` (module docstring) until the returned
    object's :meth:`~SyncedNorms.restore`. Collective when the model has any and the job more than one rank
    (one ``split``); a SyncBatchNorm with a ``process_group`` is refused with FitError on every rank first."""
    return SyncedNorms(model, comm, stall)

