"""The "model" and "hybrid" strategies: R replicas of a pipeline of P partitions behind `fit`'s Trainer.

World rank ``r * P + p`` runs partition p of replica r (a replica's partitions are consecutive ranks,
so a pipeline fills a node and replicas span nodes, as in HyPar-Flow §6.5). Two sub-communicators:
``pipe`` (the P ranks of one replica: activations and partial errors) and ``group`` (the R ranks
holding partition p: its gradient allreduce). Replica r takes slice r of R of each global batch, and
splits it into M micro-batches; the last partition back-propagates ``loss(micro) / M`` and the group
averages gradients, so a step equals one process stepping on the mean loss of the whole batch.

Set-up happens on the first batch, because shapes and per-node times need a sample: every rank
traces the same graph, measures it on one micro-batch (shapes in eval mode; for ``balance="time"``
forward plus backward per node in training mode, buffers, gradients and RNG restored afterwards),
and one ``allgather_object`` checks that all ranks agree on the arguments and averages the measured
times so that every rank computes the same partition. Everything wrong is refused before that
allgather, on every rank (each has the same information).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..._utils.stall import DEFAULT_POLICY, watched
from ...comm.base import Communicator, split_sizes
from .. import FitError
from .._batching import batch_size, check_divisible
from .._grad_allreduce import start_allreduce_gradients
from .graph import Traced, ValueMeta, cut_points, measure, model_args, param_counts, profile, split, trace
from .partition import bounds_from_balance
from .schedule import SCHEDULES, Action
from .stage import Stage, make_edges

__all__ = ["make_trainer", "PipelineTrainer", "OPTIONS"]

#: Strategy options (``fit(..., stall_timeout=60)``): seconds before a stage waiting for a message warns
#: (naming it), seconds after which such a wait ends the job (None: never) -- the defaults of
#: :data:`mpitrain._utils.stall.DEFAULT_POLICY` -- and the profiling passes of ``balance="time"``.
OPTIONS = {"stall_timeout": DEFAULT_POLICY.warn_after, "stall_abort": DEFAULT_POLICY.abort_after,
           "profile_passes": 5}


def _layout(strategy: str, partitions: int, replicas: int | None, size: int) -> tuple[int, int]:
    """(P, R) for the strategy, or a ValueError saying what to change."""
    if not isinstance(partitions, int) or partitions < 1:
        raise FitError(f"partitions must be a positive int, got {partitions!r}")
    if strategy == "model":
        if replicas not in (None, 1):
            raise FitError(f"strategy 'model' has one replica (got replicas={replicas}); "
                             f"use strategy='hybrid'")
        if partitions != size:
            raise FitError(f"strategy 'model' needs partitions == world size; got partitions={partitions} "
                             f"on {size} ranks: pass partitions={size}")
        return partitions, 1
    r = size // partitions if replicas is None else replicas
    if r < 1 or partitions * r != size:
        raise FitError(f"strategy 'hybrid' needs partitions x replicas == world size ({size}); got "
                         f"partitions={partitions}, replicas={replicas}: choose partitions dividing {size}")
    return partitions, r


def _check_spec(spec: Any, size: int) -> tuple[int, int, dict[str, Any]]:
    if spec.strategy not in ("model", "hybrid"):
        raise FitError(f"the pipeline trainer runs strategies 'model' and 'hybrid', not {spec.strategy!r}")
    P, R = _layout(spec.strategy, spec.partitions, spec.replicas, size)
    if spec.schedule not in SCHEDULES:
        raise FitError(f"unknown schedule {spec.schedule!r}; choose one of {sorted(SCHEDULES)}")
    if not isinstance(spec.micro_batches, int) or spec.micro_batches < 1:
        raise FitError(f"micro_batches must be a positive int, got {spec.micro_batches!r}")
    b = spec.balance
    if not (b in ("time", "params") or (isinstance(b, (list, tuple)) and len(b) == P)):
        raise FitError(f"balance must be 'time', 'params' or a list of {P} node counts, got {b!r}")
    unknown = set(spec.options) - set(OPTIONS)
    if unknown:
        raise FitError(f"unknown option(s) {sorted(unknown)} for strategy {spec.strategy!r}; "
                         f"known: {sorted(OPTIONS)}")
    return P, R, {**OPTIONS, "stall_timeout": spec.stall.warn_after, "stall_abort": spec.stall.abort_after, **spec.options}  # noqa: E501


def make_trainer(model: nn.Module, loss_fn: Callable, optimizer: Callable, comm: Communicator,
                 spec: Any) -> PipelineTrainer:
    """Validate `spec` locally (same verdict on every rank), trace `model`, create the sub-communicators."""
    P, R, opts = _check_spec(spec, comm.size)
    traced = trace(model)
    if P > len(traced.nodes):
        raise FitError(f"partitions={P} exceeds the {len(traced.nodes)} nodes of the traced graph of "
                         f"{type(model).__name__}; use partitions <= {len(traced.nodes)}")
    return PipelineTrainer(model, traced, loss_fn, optimizer, comm, spec, P, R, opts)


def _as_args(inputs: Any) -> list[Any]:
    return list(inputs) if isinstance(inputs, (tuple, list)) else [inputs]


def _rows(args: list[Any], start: int, stop: int) -> list[Any]:
    return [a[start:stop] if isinstance(a, torch.Tensor) else a for a in args]


class PipelineTrainer:
    """See the module docstring. Every rank calls every method with the same global batch."""

    def __init__(self, model: nn.Module, traced: Traced, loss_fn: Callable, optimizer: Callable,
                 comm: Communicator, spec: Any, P: int, R: int, opts: dict[str, Any]) -> None:
        self.model, self.traced, self.loss_fn, self.make_optimizer = model, traced, loss_fn, optimizer
        self.comm, self.spec, self.P, self.R, self.opts = comm, spec, P, R, opts
        self.M = spec.micro_batches
        self.replica, self.p = divmod(comm.rank, P)
        self.pipe = comm.split(self.replica, self.p)
        self.group = comm.split(self.p, self.replica)
        self.stage: Stage | None = None
        self._metas: dict[int, dict[str, ValueMeta | None]] = {}

    def world_rank(self, partition: int, replica: int) -> int:
        return replica * self.P + partition

    # -- set-up on the first batch ------------------------------------------------------------------
    def _setup(self, args: list[Any], micro: int) -> None:
        """Measure, agree, cut, and build this rank's stage and optimizer (every rank, same verdicts)."""
        sample = _rows(args, 0, micro)
        timed = self.spec.balance == "time"
        meta = self._metas[micro] = profile(self.traced, sample)
        out = self.traced.output.args[0]
        if not (isinstance(out, torch.fx.Node) and meta.get(out.name) is not None):
            raise FitError("the pipeline strategies need a model whose forward returns one tensor")
        cuts = cut_points(self.traced, meta)
        if isinstance(self.spec.balance, str) and len(cuts) + 1 < self.P:
            raise FitError(f"the graph can only be cut at {len(cuts)} places (where every crossing value "
                             f"is a tensor); use partitions <= {len(cuts) + 1}")
        costs = self._agree(measure(self.traced, sample, self.opts["profile_passes"]) if timed else None,
                            sample)
        self.bounds = bounds_from_balance(self.spec.balance, self.P, costs or param_counts(self.traced), cuts)
        parts = split(self.traced, self.bounds)
        _refuse_shared(parts)
        self.owned = [list(p.module.state_dict()) for p in parts]
        self.part = parts[self.p]
        abort = self.opts["stall_abort"]
        self.stage = Stage(self.part, make_edges(parts, meta), self.pipe, list(range(self.P)), max(self.M, 1),
                           float(self.opts["stall_timeout"]), None if abort is None else float(abort))
        self.params = [q for q in self.part.module.parameters() if q.requires_grad]
        self.optimizer = self.make_optimizer(self.params) if self.params else None
        if self.R > 1:  # replicas start from replica 0's weights (Horovod's broadcast_parameters)
            for t in self.part.module.state_dict().values():
                self.group.broadcast(t, root=0)

    def _agree(self, costs: list[float] | None, sample: list[Any]) -> list[float] | None:
        """The one setup message: check every rank got the same arguments and data shapes, and average
        the measured node times so that every rank computes the same partition."""
        key = (self.spec.strategy, self.P, self.R, self.M, self.spec.schedule, repr(self.spec.balance),
               [n.name for n in self.traced.nodes], [tuple(a.shape) for a in sample if hasattr(a, "shape")])
        seen = self.comm.allgather_object((key, costs))
        bad = [r for r, (k, _) in enumerate(seen) if k != key]
        if bad:
            raise FitError(f"ranks {bad} called fit with a different model, data or arguments than rank 0")
        if costs is None:
            return None
        return [sum(c[i] for _, c in seen) / len(seen) for i in range(len(costs))]

    def _meta(self, args: list[Any], n: int) -> dict[str, ValueMeta | None]:
        if n not in self._metas:
            self._metas[n] = profile(self.traced, _rows(args, 0, n), grad=False)
        return self._metas[n]

    # -- steps ------------------------------------------------------------------------------------
    def train_step(self, inputs: Any, targets: torch.Tensor) -> float:
        args = model_args(self.traced, _as_args(inputs))
        B = batch_size(targets)
        check_divisible(B, self.R * self.M, f"replicas x micro-batches (R={self.R}, M={self.M})")
        n = B // (self.R * self.M)
        if self.stage is None:
            self._setup(args, n)
        meta = self._meta(args, n)
        off = self.replica * n * self.M
        micro_args = [_rows(args, off + m * n, off + (m + 1) * n) for m in range(self.M)]
        micro_tgt = [targets[off + m * n: off + (m + 1) * n] for m in range(self.M)]
        self.part.module.train()
        for q in self.params:
            q.grad = None
        total = [0.0]

        def last_fn(m: int, out: torch.Tensor) -> torch.Tensor:
            loss = self.loss_fn(out, micro_tgt[m])
            total[0] += float(loss.detach())
            return loss / self.M

        actions = SCHEDULES[self.spec.schedule](self.P, self.M, self.p)
        self.stage.run(actions, micro_args, [meta] * self.M, last_fn, train=True)
        # this partition's backward is done: its replicas' allreduce overlaps the other partitions' compute
        handle = start_allreduce_gradients(self.params, self.group, op="avg") if self.R > 1 else None
        self.stage.finish_sends()
        if handle is not None:
            handle.wait()
        if self.optimizer is not None:
            self.optimizer.step()
        mine = total[0] / self.M / self.R if self.p == self.P - 1 else 0.0
        with self._watched("the end-of-step loss allreduce"):
            return float(self.comm.allreduce(torch.tensor([mine], dtype=torch.float64))[0])

    def eval_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """Forward only, in eval mode; any batch size (uneven slices by `split_sizes`)."""
        args = model_args(self.traced, _as_args(inputs))
        B = batch_size(targets)
        per_replica = split_sizes(B, self.R)
        if self.stage is None:
            self._setup(args, max(1, per_replica[0] // self.M))
        off = sum(per_replica[:self.replica])
        sizes = [s for s in split_sizes(per_replica[self.replica], self.M) if s > 0]
        starts = [off + sum(sizes[:m]) for m in range(len(sizes))]
        metas = [self._meta(args, s) for s in sizes]
        out_name = self.traced.output.args[0].name
        out_meta = self._meta(args, 1)[out_name]
        result = torch.empty((B, *out_meta.shape[1:]), dtype=out_meta.dtype)

        def last_fn(m: int, out: torch.Tensor) -> None:
            result[starts[m]:starts[m] + sizes[m]].copy_(out)

        self._sync_buffers()
        self.part.module.eval()
        try:
            micro_args = [_rows(args, a, a + s) for a, s in zip(starts, sizes)]
            forwards = [Action("F", m) for m in range(len(sizes))]
            self.stage.run(forwards, micro_args, metas, last_fn, train=False)
            self.stage.finish_sends()
        finally:
            self.part.module.train()
        with self._watched("the broadcast of the evaluation outputs"):
            for r, size in enumerate(per_replica):  # each replica's last partition shares its slice
                begin = sum(per_replica[:r])
                self.comm.broadcast(result[begin:begin + size], root=self.world_rank(self.P - 1, r))
        return result

    def _watched(self, what: str):
        """A blocking collective over all ranks, with a warning naming it if it outlives stall_timeout."""
        return watched("pipeline collective", f"rank {self.comm.rank} waits in {what} over all "
                       f"{self.comm.size} ranks", float(self.opts["stall_timeout"]))

    def _sync_buffers(self) -> None:
        """Give every replica replica 0's buffers (BatchNorm statistics), as DDP's broadcast_buffers
        does, so evaluation does not depend on which replica computed which slice."""
        if self.R > 1:
            for b in self.part.module.buffers():
                self.group.broadcast(b, root=0)

    def trained_model(self) -> nn.Module:
        """The user's model instance, every tensor broadcast from the partition that trained it
        (replica 0's copy, so BatchNorm statistics are replica 0's, as with DDP's broadcast_buffers)."""
        if self.stage is None:
            return self.model
        state = self.model.state_dict()
        for k, names in enumerate(self.owned):
            for name in names:
                t = state[name]
                buf = t if t.is_contiguous() else t.contiguous()
                self.comm.broadcast(buf, root=self.world_rank(k, 0))
                if buf is not t:
                    t.copy_(buf)
        return self.model


def _refuse_shared(parts: list[Any]) -> None:
    """Tied weights used on both sides of a boundary would get two different updates: refuse them."""
    owner: dict[int, tuple[int, str]] = {}
    for p in parts:
        for name, q in p.module.named_parameters(remove_duplicate=False):
            k, first = owner.setdefault(id(q), (p.index, name))
            if k != p.index:
                raise FitError(f"parameter {first!r} (partition {k}) is also used as {name!r} in partition "
                                 f"{p.index}: weights shared across partitions are not supported; pass a "
                                 f"balance list that keeps their users in one partition")
