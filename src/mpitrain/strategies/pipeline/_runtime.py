"""`PipelineRuntime`: one rank's running pipeline, built complete from a :class:`~._layout.Layout` and a
:class:`~._cut.Cut`.

Its constructor makes everything a step uses, once: this rank's :class:`~._stage.Stage` per partition,
its parameters' gradient buckets, one sub-communicator per set of pipeline ranks sharing a tied
parameter, replica 0's weights on every replica, and ZeRO's shards. It then runs passes (forward and
backward of micro-batches in the schedule's order), reduces gradients (average over the replicas, sum
over a tie's copies), clips them, and evaluates. The shapes of every message come from the cut's
:class:`~._shapes.Shapes` (per input signature), the same on every rank: no shape messages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..._utils.flat import spans
from ..._utils.stall import DEFAULT_POLICY, StallPolicy, watched
from ...comm import settle_on_error
from ...comm.base import Communicator, Request, split_sizes
from .._batching import target_rows, zero_loss
from .._buckets import Bucket, adopt, gradient_buckets
from .._device import to_device
from .._grad_allreduce import allreduce_gradients
from .._zero import Zero
from ..base import FitError
from ._cut import Cut, mine
from ._graph import Partition, ValueMeta, mutated_attrs, set_training, tied_groups
from ._layout import Groups, Layout
from ._shapes import rows
from ._stage import Stage, make_edges, run
from .schedule import Action, schedule

__all__ = ["PipelineRuntime", "RunSpec"]

_CPU = torch.device("cpu")

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class RunSpec:
    """How a runtime runs: `micro_batches` per replica and step, activation recomputation
    (`checkpoint`: "never", "except_last", "always"), the `stall` policy of every wait, the autocast
    `precision` ("bf16", "fp16", None), whether only pipeline rank 0 holds a batch's inputs
    (`inputs_on_first`), and the `zero` stage."""

    micro_batches: int = 1
    checkpoint: str = "never"
    stall: StallPolicy = DEFAULT_POLICY
    precision: str | None = None
    inputs_on_first: bool = False
    zero: int = 0


class PipelineRuntime:
    """This rank's stages of the split `cut` on `layout`, over `comm` (the pipeline's world) and its
    `groups`. Construction is collective over `comm` (tied-parameter sub-communicators over the pipe,
    replica 0's weights broadcast over the replica group, ZeRO's communicator): every rank builds it
    from the same cut, at the same point. Every method documents which ranks must call it."""

    def __init__(self, comm: Communicator, layout: Layout, groups: Groups, cut: Cut, spec: RunSpec) -> None:
        self.comm, self.layout, self.cut, self.spec = comm, layout, cut, spec
        self.pipe, self.group = groups
        self.shapes = cut.shapes
        held = mine(layout, cut.parts)
        if spec.checkpoint != "never":
            _refuse_recompute_with_batchnorm(held)
        self.stages = self._stages(held)
        self.holds_last = self.stages[-1].last
        unique = {id(q): q for s in self.stages for q in s.part.module.parameters() if q.requires_grad}
        self.params = list(unique.values())  # a dict keeps the first-seen order, the same on replicas
        # this rank's gradients live in buckets allocated once, as DataParallel's: steps reuse them
        # instead of leaving gradient-sized holes in the heap (docs/pipeline.md, "Memory per rank").
        # zero=2: the plan only; autograd's own gradients are moved into ZeRO's reduce buffers and freed
        # one by one (buckets kept besides the reduced blocks: a peak of 0.610 of one process's params +
        # grads + Adam per rank instead of 0.595, hybrid 2 x 2 on a 268 MB model, `bench memory --zero`),
        # and ZeRO maps gradient-sized allocations afresh (no holes)
        self.buckets: list[Bucket] = gradient_buckets(self.params, "pipe", allocate=spec.zero < 2)
        self.views = {id(q): v for b in self.buckets for q, v in zip(b.params, b.views)}
        self.tied = self._tied_comms()
        if layout.R > 1:  # replicas start from replica 0's weights (Horovod's broadcast_parameters)
            with torch.no_grad():
                for s in self.stages:
                    for t in s.part.module.state_dict().values():
                        self.group.broadcast(t, root=0)
        self.zero: Zero | None = None
        if spec.zero:  # sharded as the gradients are bucketed
            self.zero = Zero([b.params for b in self.buckets], self.group, spec.zero, spec.stall,
                             name=f"pipe{layout.p}.zero")

    def _stages(self, held: list[Partition]) -> list[Stage]:
        traced, spec = self.cut.traced, self.spec
        data = [n.name for n in traced.placeholders] if spec.inputs_on_first else None
        edges = make_edges(self.cut.parts, self.cut.meta, data)
        last = spec.micro_batches - 1
        recompute: Callable[[int], bool] = (lambda m: True) if spec.checkpoint == "always" else (
            (lambda m: m != last) if spec.checkpoint == "except_last" else (lambda m: False))
        ranks = self.layout.ranks
        return [Stage(part, edges, self.pipe, ranks, max(spec.micro_batches, 1), spec.stall, recompute, spec.precision)
                for part in held]

    def _tied_comms(self) -> list[tuple[Communicator, list[nn.Parameter]]]:
        """One sub-communicator of the pipeline per set of ranks holding copies of tied parameters
        (a collective over `pipe`: every rank splits for every group, in the same order)."""
        out = []
        for holders, params in tied_groups(self.cut.parts):
            ranks = sorted({self.layout.rank_of(k) for k in holders})
            if len(ranks) < 2:
                continue  # copies on one rank are one tensor: its gradient is already the sum
            sub = self.pipe.split(0 if self.layout.p in ranks else None, self.layout.p)
            if sub is not None:
                out.append((sub, params))
        return out

    # -- passes -----------------------------------------------------------------------------------
    def train_pass(self, flat: list[Any] | None, targets: Any | None, sizes: list[int], scales: Sequence[float],
                   loss_fn: LossFn, weights: list[int]) -> float:
        """Forward and backward of this replica's rows of one batch (every rank of the replica, the
        same `sizes`): see :meth:`~._pipe.Pipeline.train_pass`; `flat`: the inputs' flat leaves
        (pipeline rank 0 only, or every rank without `inputs_on_first`)."""
        if not sizes:
            return 0.0
        blocks = spans(sizes)
        # inputs reach later partitions as messages; non-tensor inputs are the sample's constants
        micro_args = ([rows(flat, a, b) for a, b in blocks] if flat is not None
                      else [self.shapes.constants()] * len(sizes))
        micro_tgt = [target_rows(targets, sum(sizes), a, b) for a, b in blocks] if targets is not None else []
        losses: list[tuple[torch.Tensor, int]] = []  # read once the step is queued: no GPU sync per micro-batch
        out_spec = self.cut.traced.out_spec

        def last_fn(m: int, out: list[Any]) -> torch.Tensor:
            dev = next((o.device for o in out if isinstance(o, torch.Tensor)), _CPU)  # targets go to the outputs
            tree = pytree.tree_unflatten(out, out_spec)
            loss = loss_fn(tree, to_device(micro_tgt[m], dev))
            if weights[m] == 0:  # every target ignored: the loss is NaN, its backward would spread it
                return zero_loss(tree, loss)
            losses.append((loss.detach(), weights[m]))
            return loss * scales[m]

        self.mode(train=True)
        metas = self._train_metas(micro_args[0] if flat is not None else None, micro_args, sizes)
        # each gradient lands in its bucket view; only for this pass: the user's parameters keep no hook
        hooks = [q.register_post_accumulate_grad_hook(self._land) for q in self.params if id(q) in self.views]
        try:
            with settle_on_error(self.abandon):  # a failed step leaves no receive that a late message could fill
                run(self.stages, self._actions(len(sizes)), micro_args, metas, last_fn, train=True)
        finally:
            for h in hooks:
                h.remove()
        total = 0.0
        for loss, n in losses:  # the order and float64 arithmetic of a running sum per micro-batch
            total += float(loss) * n
        return total if self.holds_last else 0.0

    def _train_metas(self, first: list[Any] | None, micro_args: list[list[Any]],
                     sizes: list[int]) -> list[dict[str, ValueMeta | None]]:
        """Each micro-batch's value metas: from the sample's values and the lengths pipeline rank 0
        broadcasts when ranks differ in what they hold (the same on every rank), else its own rows."""
        shared = first is None or self.spec.inputs_on_first
        trailing = None
        if shared:
            waits = self.layout.P > 1  # pipeline rank 0 broadcasts the lengths
            with self.watched("the broadcast of the batch's input shapes") if waits else contextlib.nullcontext():
                trailing = self.shapes.trailing(first, self.pipe)
        return [self.shapes.meta(None if shared else micro_args[m], s, trailing) for m, s in enumerate(sizes)]

    def eval(self, flat: list[Any], B: int, weigh: Callable[[int, int], int]) -> Any:
        """Forward only, in eval mode, of a batch of `B` rows every rank holds (`flat`): the model's
        outputs for the whole batch on every rank (collective over `comm`); a 0-dim mean is weighted per
        micro-batch of rows ``[a, b)`` by ``weigh(a, b)`` (:meth:`~._pipe.Pipeline.eval`)."""
        R, V, M = self.layout.R, self.layout.V, self.spec.micro_batches
        per_replica = split_sizes(B, R)
        off = sum(per_replica[:self.layout.replica])
        sizes = [s for s in split_sizes(per_replica[self.layout.replica], M) if s > 0]
        starts = [off + sum(sizes[:m]) for m in range(len(sizes))]
        weights = [weigh(a, a + s) for a, s in zip(starts, sizes)]
        metas = [self.shapes.meta(flat, s) for s in sizes]
        leaves, means = self._output_leaves(flat, B)

        def last_fn(m: int, out: list[Any]) -> None:
            for i, (r, o) in enumerate(zip(leaves, out)):
                if i in means:  # this replica's weighted sum of a mean the model took over its rows
                    r[self.layout.replica] += float(o) * weights[m] if weights[m] else 0.0
                elif isinstance(r, torch.Tensor):
                    r[starts[m]:starts[m] + sizes[m]].copy_(o)

        self._sync_buffers()
        self.mode(train=False)
        try:
            micro_args = [rows(flat, a, a + s) for a, s in zip(starts, sizes)]
            # (micro, partition) order is a topological order of the forwards: no rank waits forever
            forwards = [Action("F", m, c) for m in range(len(sizes)) for c in range(V)]
            with settle_on_error(self.abandon):
                run(self.stages, forwards, micro_args, metas, last_fn, train=False)
                self.finish_sends()
        finally:
            self.mode(train=True)
        with self.watched("the broadcast of the evaluation outputs"):
            for r, size in enumerate(per_replica):  # each replica's last partition shares its slice
                begin, root = sum(per_replica[:r]), self.layout.world_rank(r, self.layout.last_rank)
                for i, t in enumerate(leaves):
                    if isinstance(t, torch.Tensor):
                        self.comm.broadcast(t[r:r + 1] if i in means else t[begin:begin + size], root=root)
        for i, dtype in means.items():  # the mean over the whole batch, as gather_outputs gives it
            leaves[i] = (leaves[i].sum() / max(weigh(0, B), 1)).to(dtype)
        return pytree.tree_unflatten(leaves, self.cut.traced.out_spec)

    def _actions(self, count: int) -> list[Action]:
        """This rank's schedule for `count` micro-batches. An uneven batch can leave interleaved-1f1b
        a count that is not a multiple of P: then all forwards, then all backwards, in (micro-batch,
        virtual stage) order, a topological order on every rank (no rank waits forever)."""
        L = self.layout
        if L.schedule == "interleaved-1f1b" and count % L.P:
            return ([Action("F", m, c) for m in range(count) for c in range(L.V)]
                    + [Action("B", m, c) for m in range(count) for c in reversed(range(L.V))])
        return schedule(L.schedule, L.P, count, L.p, L.V)

    def _output_leaves(self, flat: list[Any], B: int) -> tuple[list[Any], dict[int, torch.dtype]]:
        """Buffers for the batch's output leaves (constants stay constants), and the 0-dim floating
        outputs by index with their dtype: a mean the model takes over its rows (a Hugging Face model's
        loss from ``labels`` among the inputs), buffered as one float64 sum per replica, each micro-batch's
        mean weighted by what it counts (:meth:`~._pipe.Pipeline.eval`'s `weigh`: its rows by default)."""
        meta = self.shapes.meta(flat, 1)
        out: list[Any] = []
        means: dict[int, torch.dtype] = {}
        for v in self.cut.traced.outputs:
            m = meta.get(v.name) if isinstance(v, torch.fx.Node) else None
            if m is None:
                out.append(v)
            elif not m.shape and m.dtype.is_floating_point:
                means[len(out)] = m.dtype
                out.append(torch.zeros(self.layout.R, dtype=torch.float64))
            elif not m.shape or m.shape[0] != 1:
                raise FitError(f"Pipeline.eval needs every tensor output to have the batch as dim 0 (or be a 0-dim "
                               f"floating mean over the rows, such as a loss); output "
                               f"{v.name!r} has shape {m.shape} for one sample")
            else:
                out.append(torch.empty((B, *m.shape[1:]), dtype=m.dtype))
        return out, means

    # -- gradients --------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Collective over every rank: see :meth:`~._pipe.Pipeline.reduce_gradients`."""
        self.finish_sends()
        if self.zero is not None and self.zero.stage == 2:
            for sub, params in self.tied:
                allreduce_gradients(params, sub, op="sum")
            self._reduce_scatter(self.zero)
            return
        if self.layout.R > 1:
            # in place on the buckets (a gradient None here is averaged as zeros, in its view), one
            # bucket after the other: a nonblocking reduction of every bucket at once would hold MPI's
            # temporary copy of all of this rank's gradients (+0.15-0.25 of one process's params +
            # grads at P = 2 x R = 2 on the bench memory model)
            for b in self.buckets:
                for q, view in zip(b.params, b.views):
                    if q.grad is None:
                        q.grad = view.zero_()
            allreduce_gradients([q for b in self.buckets for q in b.params], self.group, op="avg")
        for sub, params in self.tied:
            allreduce_gradients(params, sub, op="sum")
        if self.zero is not None:  # stage 1: the pieces view the averaged gradients
            self.zero.attach_full_grads()

    def _reduce_scatter(self, zero: Zero) -> None:
        for s in zero.shards:
            for q in s.params:
                zero.take(q, 1.0 / self.layout.R)
            zero.reduce(s)
        zero.finish_reduce()

    def clip_gradients(self, max_norm: float) -> float:
        """Collective over the pipeline's ranks: see :meth:`~._pipe.Pipeline.clip_gradients`."""
        skip = {id(q) for sub, params in self.tied if sub.rank != 0 for q in params}
        if self.zero is not None:  # the partition's square, summed over its replicas' pieces
            square = self.zero.square_norm(skip)
        else:
            square = torch.zeros(1, dtype=torch.float64)
            for q in self.params:
                if q.grad is not None and id(q) not in skip:
                    square += torch.linalg.vector_norm(q.grad, 2.0).double() ** 2
        with self.watched("the gradient-norm allreduce"):
            norm: float = float(self.pipe.allreduce(square)[0]) ** 0.5
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0 and self.zero is not None:
            self.zero.scale_grads(coef)
        elif coef < 1.0:
            for q in self.params:
                if q.grad is not None:
                    q.grad.mul_(coef)
        return norm

    @torch.no_grad()
    def _land(self, q: torch.Tensor) -> None:
        """Post-accumulate hook of a training pass: `q`'s gradient into its bucket view (a copy of the
        first one, then autograd accumulates in place)."""
        adopt(q, self.views[id(q)], None)  # type: ignore[arg-type]

    def in_bucket(self, q: torch.Tensor, g: torch.Tensor) -> bool:
        """Whether `g` is `q`'s bucket view (a step reuses it: a caller keeping it must copy it)."""
        v = self.views.get(id(q))
        return v is not None and g.data_ptr() == v.data_ptr()

    # -- the model's tensors ----------------------------------------------------------------------
    def tensor_ids(self) -> tuple[set[int], set[int]]:
        """The ``id`` of every parameter and buffer of this rank's partitions, and of every partition's."""
        def ids(parts: list[Partition]) -> set[int]:
            return {id(t) for part in parts for t in [*part.module.parameters(), *part.module.buffers()]}

        return ids([s.part for s in self.stages]), ids(self.cut.parts)

    def gather_model(self, model: nn.Module) -> None:
        """Every tensor of `model` broadcast from the first partition writing it in place in its graph
        (a buffer the forward updates: :func:`mutated_attrs`), else the first holding it (replica 0's
        copy), in place (collective over `comm`)."""
        owner: dict[int, int] = {}
        for k, part in enumerate(self.cut.parts):
            for t in mutated_attrs(part.module):
                owner.setdefault(id(t), self.layout.rank_of(k))
        for k, part in enumerate(self.cut.parts):
            for t in [*part.module.parameters(), *part.module.buffers()]:
                owner.setdefault(id(t), self.layout.rank_of(k))
        with torch.no_grad():
            for t in model.state_dict(keep_vars=True).values():
                if id(t) in owner:
                    buf = t.data if t.is_contiguous() else t.data.contiguous()
                    self.comm.broadcast(buf, root=owner[id(t)])
                    if buf is not t.data:
                        t.data.copy_(buf)

    def mode(self, train: bool) -> None:
        """Train or eval mode for this rank's partitions: submodules, and the mode flags either capture
        baked into the graph (ATen ops for export, functional dropout / batch-norm calls for fx)."""
        for s in self.stages:
            s.part.module.train(train)
            set_training(s.part.module, train)

    def _sync_buffers(self) -> None:
        """Give every replica replica 0's buffers (BatchNorm statistics), as DDP's broadcast_buffers
        does, so evaluation does not depend on which replica computed which slice."""
        if self.layout.R > 1:
            with torch.no_grad():
                for s in self.stages:
                    for b in s.part.module.buffers():
                        self.group.broadcast(b, root=0)

    # -- requests ---------------------------------------------------------------------------------
    def abandon(self) -> list[Request]:
        """After a failed pass: the requests still in flight, which the stages forget."""
        return [r for s in self.stages for r in s.abandon()]

    def finish_sends(self) -> None:
        for s in self.stages:
            s.finish_sends()

    def watched(self, what: str) -> Any:
        """A blocking collective over all ranks, with a warning naming it if it outlives warn_after."""
        return watched("pipeline collective", f"rank {self.comm.rank} waits in {what} over all "
                       f"{self.comm.size} ranks", self.spec.stall.warn_after)


def _refuse_recompute_with_batchnorm(parts: list[Partition]) -> None:
    """Recomputing a training forward would update BatchNorm running statistics twice."""
    for part in parts:
        for name, mod in part.module.named_modules():
            if isinstance(mod, nn.modules.batchnorm._BatchNorm) and mod.track_running_stats:
                raise FitError(f"checkpoint={'except_last'!r}/'always' recomputes forwards, which would update "
                               f"the running statistics of BatchNorm {name!r} (partition {part.index}) twice; "
                               f"use checkpoint='never'")
        for n in part.module.graph.nodes:
            if n.op == "call_function" and "batch_norm" in str(n.target):
                raise FitError(f"checkpoint recomputes forwards, which would update the running statistics "
                               f"of batch norm node {n.name!r} (partition {part.index}) twice; use "
                               f"checkpoint='never'")
