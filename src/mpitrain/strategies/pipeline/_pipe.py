"""`Pipeline`: R replicas of a pipeline of P partitions of an unmodified model, for the user's own loop.

World rank ``r * P + p`` runs pipeline rank p of replica r (:class:`~mpitrain.comm.place.Place`, the
project's one placement rule: a replica's partitions are consecutive ranks, so a pipeline fills a node and
replicas span nodes, as in HyPar-Flow §6.5). Sub-communicators: ``pipe`` (the place's partition group: the
P ranks of one replica, activations and partial errors), ``group`` (its replica group: the R ranks holding
pipeline rank p, the gradient average and ZeRO's shards) and one per set of pipeline ranks sharing a tied
parameter (the sum of its copies' gradients). Replica r takes slice r of R of each global batch and splits it
into M micro-batches; the last partition back-propagates ``loss(micro) / M``, so after :meth:`step`
the gradients equal one process's gradients of the mean loss over the whole batch.

With ``schedule="interleaved-1f1b"`` the model is cut into ``P * virtual_stages`` partitions and
pipeline rank p runs partitions p, p + P, ... (Megatron-LM's virtual stages); with ``"zbv"`` into 2P
partitions, rank p running p and 2P-1-p (a V: rank 0 holds the first and the last partition, and
computes the loss). ``"zb1p"`` and ``"zbv"`` split each backward into its input half and its weight
half (:mod:`._backward`), the weight halves filling what would be the pipeline's bubble.

Set-up happens on the first batch (or at construction given `example`), because capture, shapes and
per-node times need a sample: every rank captures the same graph (:func:`._graph.capture`), measures
it on one micro-batch, and one ``allgather_object`` checks that all ranks agree on the arguments and
averages the measured times so that every rank computes the same partition. Everything wrong is
refused before that allgather, on every rank (each has the same information).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..._utils.flat import spans
from ..._utils.malloc import lower_mmap_threshold
from ..._utils.stall import DEFAULT_POLICY, StallPolicy, watched
from ...comm import settle_on_error
from ...comm.base import Communicator, Request, split_sizes
from ...comm.place import Place, PlaceError
from .._batching import check_divisible, per_sample, target_rows
from .._buckets import Bucket, adopt, gradient_buckets
from .._device import model_device, to_device
from .._grad_allreduce import allreduce_gradients
from .._zero import Zero
from ..base import FitError
from ._graph import (
    Partition,
    Traced,
    TraceFailure,
    ValueMeta,
    capture,
    check_shapes,
    cut_points,
    measure_module,
    model_args,
    param_counts,
    profile,
    reference_seconds,
    set_training,
    split,
    tied_groups,
)
from ._materialize import InitFn, is_meta, materialize, release
from ._partition import bounds_from_balance
from ._stage import Stage, autocast, make_edges, run
from .schedule import SCHEDULES, SPLIT, Action, chunks_per_rank, placement, schedule

__all__ = ["Pipeline", "CHECKPOINTS"]

_CPU = torch.device("cpu")

#: Activation recomputation policies (torchgpipe's): recompute the forward of every training
#: micro-batch during its backward, of all but the last one, or of none.
CHECKPOINTS = ("never", "except_last", "always")

LossFn = Callable[[Any, Any], torch.Tensor]


def _rowed(a: Any) -> bool:
    """A tensor with a batch dimension (sliced into rows; other leaves are constants)."""
    return isinstance(a, torch.Tensor) and a.dim() > 0


def _rows(args: list[Any], start: int, stop: int) -> list[Any]:
    return [a[start:stop] if _rowed(a) else a for a in args]


def _slice(tree: Any, start: int, stop: int) -> Any:
    """Rows start:stop of every tensor of a pytree (targets may be a tensor, tuple or dict)."""
    return pytree.tree_map(lambda t: t[start:stop] if _rowed(t) else t, tree)


def _repeat(tree: Any, n: int) -> Any:
    """`n` rows made of every tensor's rows repeated in order (the shapes of a batch of `n` rows)."""
    return pytree.tree_map(lambda t: _tile(t, (n, *t.shape[1:])) if _rowed(t) else t, tree)


def _tile(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` made of `t`'s elements repeated cyclically along every dimension: another
    batch's shapes with the sample's values (valid token ids, masks of zeros and ones)."""
    for d, size in enumerate(shape):
        if size != t.shape[d]:
            t = t.index_select(d, torch.arange(size, device=t.device) % max(t.shape[d], 1))
    return t


def _signature(flat: list[Any]) -> tuple[Any, ...]:
    """The shapes of a micro-batch's flat inputs (None for a non-tensor): the key of its value metas."""
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in flat)


#: value metas kept per pipeline: distinct input shape signatures (micro-batch sizes x lengths); the
#: oldest is dropped beyond it (profiled again if it comes back)
SIGNATURES = 64


def _batch(flat: list[Any]) -> int:
    for a in flat:
        if _rowed(a):
            return int(a.shape[0])
    raise FitError("the inputs hold no tensor with a batch dimension to split into micro-batches")


class Pipeline:
    """A model split into `partitions` stages (times `replicas` copies) over `comm` (default: the world).

    Every rank of `comm` constructs it with the same arguments and calls :meth:`step` / :meth:`eval`
    with the same global batch. ``partitions * replicas`` must equal ``comm.size`` (either may be
    left out). `balance`: "time" (measured forward+backward per graph node), "params", or a list of
    node counts per partition. `checkpoint`: one of :data:`CHECKPOINTS`. `example`: a batch's inputs,
    to set up at construction, so that :meth:`parameters` is known before the first step.

    A model on the meta device is captured, measured and split on meta; each rank then allocates and
    initialises only the tensors its partitions use (:func:`._materialize.materialize`: each tensor
    seeded by `seed` and its qualified name, with `init_fn(module)` or the module's
    ``reset_parameters()``).

    For fit's per-rank reads (`inputs_on_first`): only pipeline rank 0 has a batch's inputs, and only
    the rank of the last partition (:attr:`last_rank`) its targets (:meth:`setup_shared`,
    :meth:`train_pass`); a model input read by a later partition is sent there by partition 0.
    `autocast`: forwards and loss under CPU bf16 autocast (shapes and dtypes of the messages are
    profiled under it too).

    `zero` (1 or 2; fit's ``strategy="hybrid", zero=``) shards each partition's optimizer state (1) and
    gradients (2) across its R replicas (:mod:`.._zero`, over the replica group): the replicas
    reduce-scatter (2) or allreduce (1) instead of averaging, the optimizer, made to step this rank's
    pieces by ``zero.shard_optimizer``, updates them, and the replicas allgather the parameters."""

    def __init__(self, model: nn.Module, partitions: int | None = None, replicas: int | None = None,
                 micro_batches: int = 1, schedule: str = "1f1b", comm: Communicator | None = None,
                 checkpoint: str = "never", *, balance: Any = "time", virtual_stages: int = 2,
                 stall: StallPolicy = DEFAULT_POLICY, profile_passes: int = 5, example: Any = None,
                 seed: int = 0, init_fn: InitFn | None = None, inputs_on_first: bool = False,
                 autocast: bool = False, zero: int = 0) -> None:
        if comm is None:
            from ...runtime import init

            comm = init()
        self.model, self.comm = model, comm
        #: this rank's place: replicas x partitions (the grid is one cell)
        self.place = _place(partitions, replicas, comm)
        self.P, self.R = self.place.partitions, self.place.replicas
        self.M, self.schedule, self.checkpoint, self.balance = micro_batches, schedule, checkpoint, balance
        self.stall, self.profile_passes, self.seed, self.init_fn = stall, profile_passes, seed, init_fn
        self.inputs_on_first, self.autocast = inputs_on_first, autocast
        _check_options(self.P, micro_batches, schedule, checkpoint, balance, virtual_stages)
        if isinstance(zero, bool) or zero not in (0, 1, 2):
            raise FitError(f"zero for a pipeline must be 0, 1 (optimizer state sharded across the replicas) or 2 "
                           f"(and gradients); got {zero!r} (zero=3 is not offered: every micro-batch of a stage "
                           f"uses its parameters)")
        self.zero_stage = zero
        self.zero: Zero | None = None  # made at set-up, over the replica group
        self.on_meta = is_meta(model)
        self.device = _CPU if self.on_meta else model_device(model)  # a meta model is materialised on the CPU
        # the partitions of a meta model create on its device the tensors its graph creates on meta
        self._place = self.device if self.on_meta else None
        self.V = chunks_per_rank(schedule, virtual_stages)
        # rank p runs partitions self._where[p] (its chunks, in order); partition k runs on self._rank_of[k]
        self._where = placement(schedule, self.P, self.V)
        self._rank_of = {k: p for p, row in enumerate(self._where) for k in row}
        #: the pipeline rank running the model's last partition (it computes the loss)
        self.last_rank = self._rank_of[self.P * self.V - 1]
        self.placement_name = "v" if schedule == "zbv" else "loop"
        self.replica, self.p = self.place.replica, self.place.partition
        groups = self.place.split(comm, ("replica", "partition"))
        self.pipe, self.group = groups.of("partition"), groups.of("replica")
        self.traced: Traced | None = None
        self.stages: list[Stage] = []
        self._metas: dict[tuple[Any, ...], dict[str, ValueMeta | None]] = {}  # by _signature
        self._sample: list[Any] = []  # a micro-batch of the set-up sample: the shapes of other sizes
        if example is not None:
            flat = self._flat(example)
            self._setup(example, flat, max(1, _batch(flat) // (self.R * self.M)))

    # -- public ---------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """The trainable parameters (each once) for this rank's optimizer.

        Once set up (`example` given, or after the first :meth:`step`): this rank's partitions'
        parameters. Before (the partition needs a sample batch to capture, measure and cut): every
        trainable parameter of the model. An optimizer built on those at once, as in
        ``opt = torch.optim.AdamW(pipe.parameters())`` right after construction, steps exactly this
        rank's: the others never get a gradient here and torch's optimizers skip a parameter whose
        ``.grad`` is None (its state is created at its first step, so none is held for them). A
        meta-device model's parameters are materialised in place (the same objects), so this holds
        for it too."""
        if not self.stages:
            return iter([q for q in self.model.parameters() if q.requires_grad])  # a tied tensor once
        return iter(self._params)

    def tensor_ids(self) -> tuple[set[int], set[int]]:
        """The ``id`` of every parameter and buffer of this rank's partitions, and of every partition's
        (the model's tensors that some rank holds). Needs the set-up."""
        def ids(parts: list[Partition]) -> set[int]:
            return {id(t) for part in parts for t in [*part.module.parameters(), *part.module.buffers()]}

        return ids([s.part for s in self.stages]), ids(self._parts)

    @property
    def partitions(self) -> list[nn.Module]:
        """This rank's partition modules (one, or `virtual_stages` with interleaved-1f1b)."""
        return [s.part.module for s in self.stages]

    def step(self, inputs: Any, targets: Any, loss_fn: LossFn) -> float:
        """Forward and backward of one global batch (the optimizer step is the caller's). Returns the
        mean loss over the batch, on every rank. Afterwards each parameter's ``.grad`` holds, added to
        what it held before, the gradient of that mean loss: averaged over replicas and summed over a
        tied parameter's copies, so every copy gets the same update. `loss_fn(outputs, targets)`
        receives the model's outputs as the model returns them (a tensor, tuple, ModelOutput)."""
        if self.zero_stage:
            raise RuntimeError("Pipeline(zero=...) shards the optimizer, which step() leaves to the caller: "
                               "train it through fit(strategy='hybrid', zero=...)")
        flat = self._flat(inputs)
        B = _batch(flat)
        check_divisible(B, self.R * self.M, f"replicas x micro-batches (R={self.R}, M={self.M})")
        per_sample(B, targets, inputs)  # targets follow the inputs' samples (k rows each): checked before set-up
        n = B // (self.R * self.M)
        if not self.stages:
            self._setup(inputs, flat, n)
        off = self.replica * n * self.M
        # what .grad held; a copy where it is a bucket view (the user did not clear it), which this step reuses
        before = [None if q.grad is None else q.grad.clone() if self._in_bucket(q, q.grad) else q.grad
                  for q in self._params]
        for q in self._params:
            q.grad = None  # reductions below must see this step's contribution only
        mine = self.train_pass(_rows(flat, off, off + n * self.M), target_rows(targets, B, off, off + n * self.M),
                               [n] * self.M, [1.0 / self.M] * self.M, loss_fn, flat=True)
        self.reduce_gradients()
        for q, g in zip(self._params, before):  # accumulate onto what .grad held, as autograd does
            if g is not None:
                q.grad = g if q.grad is None else q.grad.add_(g)
        with self._watched("the end-of-step loss allreduce"):
            return float(self.comm.allreduce(torch.tensor([mine / B], dtype=torch.float64))[0])

    def setup_shared(self, inputs: Any | None, micro: int) -> None:
        """Collective, once, before the first :meth:`train_pass` of a pipeline whose ranks do not all
        hold the batch: world rank 0 passes rows of the inputs (the others pass None), which it repeats
        to ``max(2, micro)`` rows (`micro`: the first micro-batch's size, the same on every rank; two at
        least, as torch.export takes a batch of one for a constant) and broadcasts (pickled, one
        message) so that every rank captures, measures and splits the model on the same sample."""
        if self.stages:
            return
        mine = _repeat(inputs, max(2, micro)) if self.comm.rank == 0 else None
        sample = self.comm.broadcast_object(mine)
        self._setup(sample, self._flat(sample), micro)

    def train_pass(self, inputs: Any | None, targets: Any | None, sizes: list[int], scales: list[float],
                   loss_fn: LossFn, flat: bool = False) -> float:
        """Forward and backward of this replica's rows of one batch, cut into micro-batches of `sizes`
        rows (any sizes >= 1; none: this replica has no rows), micro-batch m back-propagating
        ``loss * scales[m]``. Gradients are ADDED to ``.grad`` and not reduced (:meth:`reduce_gradients`).
        `inputs` (pipeline rank 0 only, else None; `flat`: already :func:`model_args` leaves) and
        `targets` (:attr:`last_rank` only) hold ``sum(sizes)`` rows. Every rank of the replica calls
        it with the same `sizes`. Returns the sum over its micro-batches of ``loss * size`` on the last
        pipeline rank (0 elsewhere)."""
        if not sizes:
            return 0.0
        traced = self._traced()
        blocks = spans(sizes)
        if inputs is not None:
            rows = inputs if flat else self._flat(inputs)
            micro_args = [_rows(rows, a, b) for a, b in blocks]
        else:  # inputs reach later partitions as messages; non-tensor inputs are the sample's constants
            constants = [None if isinstance(a, torch.Tensor) else a for a in self._sample]
            micro_args = [constants] * len(sizes)
        micro_tgt = [target_rows(targets, sum(sizes), a, b) for a, b in blocks] if targets is not None else []
        losses: list[tuple[torch.Tensor, int]] = []  # read once the step is queued: no GPU sync per micro-batch

        def last_fn(m: int, out: list[Any]) -> torch.Tensor:
            dev = next((o.device for o in out if isinstance(o, torch.Tensor)), _CPU)  # targets go to the outputs
            loss = loss_fn(pytree.tree_unflatten(out, traced.out_spec), to_device(micro_tgt[m], dev))
            losses.append((loss.detach(), sizes[m]))
            return loss * scales[m]

        self._mode(train=True)
        # shapes from the set-up sample when ranks differ in what they hold: the same on every rank
        shared = inputs is None or self.inputs_on_first
        trailing = self._trailing(micro_args[0] if inputs is not None else None) if shared else None
        metas = [self._meta(None if shared else micro_args[m], s, trailing) for m, s in enumerate(sizes)]
        # each gradient lands in its bucket view; only for this pass: the user's parameters keep no hook
        hooks = [q.register_post_accumulate_grad_hook(self._land) for q in self._params if id(q) in self._views]
        try:
            with settle_on_error(self._abandon):  # a failed step leaves no receive that a late message could fill
                run(self.stages, self._actions(len(sizes)), micro_args, metas, last_fn, train=True)
        finally:
            for h in hooks:
                h.remove()
        total = 0.0
        for loss, n in losses:  # the order and float64 arithmetic of a running sum per micro-batch
            total += float(loss) * n
        return total if self._holds_last else 0.0

    def reduce_gradients(self) -> None:
        """Collective over every rank: finish the sends of the passes, average ``.grad`` over the
        replicas and sum the copies of tied parameters (None gradients count as zeros). With `zero`:
        at 1 as without, then each piece's gradient views its parameter's; at 2 the copies are summed
        first, then the replicas reduce-scatter (each rank keeps its pieces' gradients)."""
        if self.zero is not None and self.zero.stage == 2:
            self._finish_sends()
            for sub, params in self._tied:
                allreduce_gradients(params, sub, op="sum")
            self._reduce_scatter(self.zero)
            return
        self._finish_sends()
        if self.R > 1:
            # in place on the buckets (a gradient None here is averaged as zeros, in its view), one
            # bucket after the other: a nonblocking reduction of every bucket at once would hold MPI's
            # temporary copy of all of this rank's gradients (+0.15-0.25 of one process's params +
            # grads at P = 2 x R = 2 on the bench memory model)
            for b in self._buckets:
                for q, view in zip(b.params, b.views):
                    if q.grad is None:
                        q.grad = view.zero_()
            allreduce_gradients([q for b in self._buckets for q in b.params], self.group, op="avg")
        for sub, params in self._tied:
            allreduce_gradients(params, sub, op="sum")
        if self.zero is not None:  # stage 1: the pieces view the averaged gradients
            self.zero.attach_full_grads()

    def _reduce_scatter(self, zero: Zero) -> None:
        for s in zero.shards:
            for q in s.params:
                zero.take(q, 1.0 / self.R)
            zero.reduce(s)
        zero.finish_reduce()

    def clip_gradients(self, max_norm: float) -> float:
        """Collective over the pipeline's ranks, after :meth:`reduce_gradients`: scale every ``.grad``
        as one process's ``clip_grad_norm_(model.parameters(), max_norm)`` does, by the norm of the
        whole model's gradient (all partitions; a tied parameter's copies once: its lowest pipeline rank
        counts it). Returns that norm (the same on every rank: replicas hold averaged gradients)."""
        skip = {id(q) for sub, params in self._tied if sub.rank != 0 for q in params}
        if self.zero is not None:  # the partition's square, summed over its replicas' pieces
            square = self.zero.square_norm(skip)
        else:
            square = torch.zeros(1, dtype=torch.float64)
            for q in self._params:
                if q.grad is not None and id(q) not in skip:
                    square += torch.linalg.vector_norm(q.grad, 2.0).double() ** 2
        with self._watched("the gradient-norm allreduce"):
            norm: float = float(self.pipe.allreduce(square)[0]) ** 0.5
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0 and self.zero is not None:
            self.zero.scale_grads(coef)
        elif coef < 1.0:
            for q in self._params:
                if q.grad is not None:
                    q.grad.mul_(coef)
        return norm

    def eval(self, inputs: Any) -> Any:
        """Forward only, in eval mode, on any batch size (uneven slices by `split_sizes`); returns the
        model's outputs for the whole batch on every rank, in the model's own structure. Every tensor
        output must have the batch as dim 0."""
        flat = self._flat(inputs)
        B = _batch(flat)
        per_replica = split_sizes(B, self.R)
        if not self.stages:
            self._setup(inputs, flat, max(1, per_replica[0] // self.M))
        traced = self._traced()
        off = sum(per_replica[:self.replica])
        sizes = [s for s in split_sizes(per_replica[self.replica], self.M) if s > 0]
        starts = [off + sum(sizes[:m]) for m in range(len(sizes))]
        metas = [self._meta(flat, s) for s in sizes]
        leaves = self._output_leaves(flat, B)

        def last_fn(m: int, out: list[Any]) -> None:
            for r, o in zip(leaves, out):
                if isinstance(r, torch.Tensor):
                    r[starts[m]:starts[m] + sizes[m]].copy_(o)

        self._sync_buffers()
        self._mode(train=False)
        try:
            micro_args = [_rows(flat, a, a + s) for a, s in zip(starts, sizes)]
            # (micro, partition) order is a topological order of the forwards: no rank waits forever
            forwards = [Action("F", m, c) for m in range(len(sizes)) for c in range(self.V)]
            with settle_on_error(self._abandon):
                run(self.stages, forwards, micro_args, metas, last_fn, train=False)
                self._finish_sends()
        finally:
            self._mode(train=True)
        with self._watched("the broadcast of the evaluation outputs"):
            for r, size in enumerate(per_replica):  # each replica's last partition shares its slice
                begin = sum(per_replica[:r])
                for t in leaves:
                    if isinstance(t, torch.Tensor):
                        self.comm.broadcast(t[begin:begin + size], root=self.place.rank_of(r, self.last_rank))
        return pytree.tree_unflatten(leaves, traced.out_spec)

    def trained_model(self) -> nn.Module:
        """The user's model instance, every tensor broadcast from the first partition holding it
        (replica 0's copy, so BatchNorm statistics are replica 0's, as with DDP's broadcast_buffers).
        Every rank must call it."""
        if not self.stages or self.on_meta:  # meta: this rank's partition is real, the rest stays meta
            return self.model
        owner: dict[int, int] = {}
        for k, part in enumerate(self._parts):
            for t in [*part.module.parameters(), *part.module.buffers()]:
                owner.setdefault(id(t), self._rank_of[k])
        with torch.no_grad():
            for t in self.model.state_dict(keep_vars=True).values():
                if id(t) in owner:
                    buf = t.data if t.is_contiguous() else t.data.contiguous()
                    self.comm.broadcast(buf, root=owner[id(t)])
                    if buf is not t.data:
                        t.data.copy_(buf)
        return self.model

    # -- set-up ---------------------------------------------------------------------------------
    def _flat(self, inputs: Any) -> list[Any]:
        if self.traced is None:
            self._capture(inputs)
        try:
            return model_args(self._traced(), inputs)
        except ValueError as e:
            raise FitError(str(e)) from e

    def _capture(self, inputs: Any) -> None:
        """Capture once, on a sample of a few rows (two at least: a batch dimension of one would be
        taken for a constant by torch.export)."""
        flat = pytree.tree_leaves(inputs)
        rows = min(_batch(flat), max(2, _batch(flat) // (self.R * self.M)))
        sample = _slice(inputs, 0, rows)
        try:
            self.traced = capture(self.model, sample)
        except TraceFailure as e:
            raise FitError(str(e)) from e

    def _traced(self) -> Traced:
        assert self.traced is not None
        return self.traced

    def _setup(self, inputs: Any, flat: list[Any], micro: int) -> None:
        """Measure, agree, cut, and build this rank's stages (every rank, same verdicts)."""
        traced = self._traced()
        parts_n = self.P * self.V
        if parts_n > len(traced.nodes):
            raise FitError(f"{parts_n} partitions exceed the {len(traced.nodes)} nodes of the captured graph "
                           f"of {type(self.model).__name__}; use fewer partitions")
        # a model on a device (CUDA) is profiled there: the loader's rows arrive on the CPU (as is for a
        # CPU or meta model, whose device here is the CPU)
        sample = self._sample = to_device(_rows(flat, 0, micro), self.device)
        # shapes of a meta model come from a meta copy of its graph (no storage), before and after
        # this rank materialises its own partition
        self._shapes = dataclasses.replace(traced, gm=copy.deepcopy(traced.gm)) if self.on_meta else traced
        meta = self._metas[_signature(sample)] = self._profile(sample, grad=True)
        cuts = cut_points(traced, meta)
        if isinstance(self.balance, str) and len(cuts) + 1 < parts_n:
            raise FitError(f"the graph can only be cut at {len(cuts)} places (where every crossing value "
                           f"is a tensor); use partitions x virtual stages <= {len(cuts) + 1}")
        self.bounds = bounds = self._choose_bounds(sample, meta, cuts)
        parts = split(traced, bounds, meta, self._place)
        mine = self._mine(parts)
        if self.checkpoint != "never":
            _refuse_recompute_with_batchnorm(mine)
        edges = make_edges(parts, meta, [n.name for n in traced.placeholders] if self.inputs_on_first else None)
        ranks = [self._rank_of[k] for k in range(parts_n)]
        last = self.M - 1
        recompute = (lambda m: True) if self.checkpoint == "always" else (
            (lambda m: m != last) if self.checkpoint == "except_last" else (lambda m: False))
        self._parts = parts
        self.stages = [Stage(part, edges, self.pipe, ranks, max(self.M, 1), self.stall, recompute, self.autocast)
                       for part in mine]
        self._holds_last = self.stages[-1].last
        unique = {id(q): q for s in self.stages for q in s.part.module.parameters() if q.requires_grad}
        self._params = list(unique.values())  # a dict keeps the first-seen order, the same on replicas
        # this rank's gradients live in buckets allocated once, as DataParallel's: steps reuse them
        # instead of leaving gradient-sized holes in the heap (docs/pipeline.md, "Memory per rank").
        # zero=2: the plan only; autograd's own gradients are moved into ZeRO's reduce buffers and freed
        # one by one (buckets kept besides the reduced blocks: a peak of 0.610 of one process's params +
        # grads + Adam per rank instead of 0.595, hybrid 2 x 2 on a 268 MB model, `bench memory --zero`),
        # and ZeRO maps gradient-sized allocations afresh (no holes)
        self._buckets: list[Bucket] = gradient_buckets(self._params, "pipe", allocate=self.zero_stage < 2)
        self._views = {id(q): v for b in self._buckets for q, v in zip(b.params, b.views)}
        self._tied = self._tied_comms(parts)
        if self.R > 1:  # replicas start from replica 0's weights (Horovod's broadcast_parameters)
            with torch.no_grad():
                for s in self.stages:
                    for t in s.part.module.state_dict().values():
                        self.group.broadcast(t, root=0)
        if self.zero_stage:  # sharded as the gradients are bucketed
            self.zero = Zero([b.params for b in self._buckets], self.group, self.zero_stage, self.stall,
                             name=f"pipe{self.p}.zero")

    def _choose_bounds(self, sample: list[Any], meta: dict[str, ValueMeta | None], cuts: list[int]) -> list[int]:
        """The split; a meta model ends with this rank's partitions materialised (and nothing else).

        `balance` "params" or a list: that split. "time": no rank times the whole model (a meta model
        cannot run whole, and the whole model's gradients would be one more model's worth of memory on
        every rank): the graph is first split by parameters; each rank times only its own partitions
        (stand-in activations of the shapes the profile gave; a meta model's partitions materialised
        first), one allgather shares the per-node times, every rank splits by them (a meta model
        materialises its final partitions and frees what it no longer holds). Errors (an init that
        fails) travel in those allgathers: every rank raises together."""
        traced = self._traced()
        parts_n = self.P * self.V
        timed = self.balance == "time"
        bounds = _bounds("params" if timed else self.balance, parts_n, param_counts(traced), cuts)
        error = self._hold(bounds, meta) if self.on_meta else None
        mine = self._measure_mine(bounds, meta, sample) if timed and error is None else None
        costs = self._agree(mine, sample, error)
        if costs is None:
            return bounds
        bounds = _bounds("time", parts_n, costs, cuts)
        if self.on_meta:
            _raise_first(self.comm.allgather_object(self._hold(bounds, meta)))
        return bounds

    def _hold(self, bounds: list[int], meta: dict[str, ValueMeta | None]) -> str | None:
        """Make this rank hold exactly its partitions' tensors of the split at `bounds`: the others go
        back to meta (first, so the peak is the larger of the two holdings, not their union), the
        missing ones are materialised. Returns the error message of a failed initialisation."""
        keep = {id(t) for part in self._mine(split(self._traced(), bounds, meta))
                for t in [*part.module.parameters(), *part.module.buffers()]}
        release(self.model, keep)
        try:
            materialize(self.model, keep, self.seed, self.init_fn)
        except ValueError as e:
            return str(e)
        return None

    def _mine(self, parts: list[Partition]) -> list[Partition]:
        """This rank's partitions of `parts` (its chunks, :func:`.schedule.placement`). Blocks as large as
        their largest weight get their own mapping from now on (:func:`_map_weight_sized_blocks`)."""
        mine = [parts[k] for k in self._where[self.p]]
        _map_weight_sized_blocks(mine)
        return mine

    def _measure_mine(self, bounds: list[int], meta: dict[str, ValueMeta | None],
                      sample: list[Any]) -> list[float | None] | None:
        """Forward + backward time of the nodes of this rank's partitions (None for the others'), each
        partition run alone on the sample's inputs it reads and stand-ins for the activations it
        receives (random floats, zero integers: valid indices). In units of :func:`reference_seconds`
        timed around the measurement: ranks time different nodes at different moments, and a rank
        slowed by its neighbours meanwhile must not see its nodes as costlier. None where a partition
        cannot run on stand-ins (a received index computed from the data, e.g. a mixture of experts'
        token permutation: zeros leave its inverse partly uninitialised); then every rank keeps the
        split by parameters (:meth:`_agree`)."""
        traced = self._traced()
        index = {n.name: i for i, n in enumerate(traced.nodes)}
        parts = split(traced, bounds, meta, self._place)
        out: list[float | None] = [None] * len(traced.nodes)
        unit = reference_seconds(self.profile_passes)
        times: dict[int, float] = {}
        for part in self._mine(parts):
            k = part.index
            args = [sample[i] for i in part.data_inputs] + [_stand_in(meta[v], self.device) for v in part.recv_inputs]
            try:
                with autocast(self.autocast, self.device):
                    timed = measure_module(part.module, args, self.profile_passes)
            except (IndexError, RuntimeError):
                return None
            for name, seconds in timed.items():
                i = index.get(name)
                if i is not None and bounds[k] <= i < bounds[k + 1]:
                    times[i] = seconds
        unit = min(unit, reference_seconds(self.profile_passes))
        for i, seconds in times.items():
            out[i] = seconds / unit
        return out

    def _tied_comms(self, parts: list[Partition]) -> list[tuple[Communicator, list[nn.Parameter]]]:
        """One sub-communicator of the pipeline per set of ranks holding copies of tied parameters
        (a collective over `pipe`: every rank splits for every group, in the same order)."""
        out = []
        for holders, params in tied_groups(parts):
            ranks = sorted({self._rank_of[k] for k in holders})
            if len(ranks) < 2:
                continue  # copies on one rank are one tensor: its gradient is already the sum
            sub = self.pipe.split(0 if self.p in ranks else None, self.p)
            if sub is not None:
                out.append((sub, params))
        return out

    def _agree(self, costs: list[float] | None | list[float | None], sample: list[Any],
               error: str | None = None) -> list[float] | None:
        """The setup message: check every rank got the same arguments and data shapes, raise any
        rank's `error` on every rank, and average each node's measured times over the ranks that
        measured it (None: not measured here) so that every rank computes the same partition; None
        (the split stays by parameters) where any rank has no costs."""
        traced = self._traced()
        key = (self.P, self.R, self.M, self.V, self.schedule, self.checkpoint, repr(self.balance),
               [n.name for n in traced.nodes], [tuple(a.shape) for a in sample if hasattr(a, "shape")])
        seen = self.comm.allgather_object((key, costs, error))
        bad = [r for r, (k, _, _) in enumerate(seen) if k != key]
        if bad:
            raise FitError(f"ranks {bad} set up the pipeline with a different model, data or arguments "
                           f"than rank 0")
        _raise_first([e for _, _, e in seen])
        if costs is None or any(c is None for _, c, _ in seen):
            return None
        out = []
        for i in range(len(costs)):
            got = [c[i] for _, c, _ in seen if c is not None and c[i] is not None]
            out.append(sum(got) / len(got) if got else 0.0)
        return out

    def _meta(self, flat: list[Any] | None, n: int,
              trailing: list[tuple[int, ...] | None] | None = None) -> dict[str, ValueMeta | None]:
        """Value metas of a micro-batch of `n` rows: profiled on `flat`'s first rows, or (None: this
        rank has no inputs) on the set-up sample's values tiled to `n` rows and the `trailing` shapes
        (:meth:`_trailing`); the same shapes on every rank. Profiled once per shape signature (at most
        :data:`SIGNATURES` kept); a signature the captured graph cannot run raises FitError."""
        rows = (_rows(flat, 0, n) if flat is not None else
                [_tile(a, (n, *(shape if shape is not None else a.shape[1:]))) if _rowed(a) else a
                 for a, shape in zip(self._sample, trailing or [None] * len(self._sample))])
        key = _signature(rows)
        if key not in self._metas:
            try:
                check_shapes(self._traced(), rows)
                meta = self._profile(rows, grad=False, fake=True)
            except (ValueError, RuntimeError) as e:
                raise FitError(f"the model cannot run on inputs of shapes {list(key)}: {e}") from e
            if len(self._metas) >= SIGNATURES:
                del self._metas[next(iter(self._metas))]
            self._metas[key] = meta
        return self._metas[key]

    def _trailing(self, rows: list[Any] | None) -> list[tuple[int, ...] | None]:
        """The shape beyond the batch dimension of every flat input of this pass (None: not a tensor
        with a batch dimension), the same on every rank of the pipeline: pipeline rank 0, which holds
        the inputs, broadcasts them over the pipeline (one message of a few integers per pass) when
        any input has such dimensions (sequence lengths, image sizes), which may change between
        batches."""
        dims = [a.dim() - 1 if _rowed(a) else None for a in self._sample]
        count = sum(d for d in dims if d is not None)
        held = rows if rows is not None else self._sample  # the sample: overwritten by the broadcast
        lengths = [int(s) for a, d in zip(held, dims) if d is not None for s in a.shape[1:]]
        if count and self.P > 1:
            with self._watched("the broadcast of the batch's input shapes"):
                lengths = self.pipe.broadcast(torch.tensor(lengths, dtype=torch.int64), root=0).tolist()
        out: list[tuple[int, ...] | None] = []
        for d in dims:
            out.append(None if d is None else tuple(lengths[:d]))
            lengths = lengths[d or 0:]
        return out

    def _profile(self, sample: list[Any], grad: bool, fake: bool = False) -> dict[str, ValueMeta | None]:
        """Value metas of one forward on `sample`; for a meta model on meta copies of the inputs. With
        `fake` (another shape of a graph already profiled) on fake tensors: no compute, no memory;
        a graph with an op that has no fake implementation is run for real."""
        if self.on_meta:
            sample = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in sample]
        with autocast(self.autocast, self.device):  # bf16 messages are received into bf16 buffers
            if fake and not self.on_meta:
                try:
                    return profile(self._shapes, sample, grad=grad, fake=True)
                except Exception:  # noqa: BLE001 - any failure of fake propagation: the real forward decides
                    pass
            return profile(self._shapes, sample, grad=grad)

    def _actions(self, count: int) -> list[Action]:
        """This rank's schedule for `count` micro-batches. An uneven batch can leave interleaved-1f1b
        a count that is not a multiple of P: then all forwards, then all backwards, in (micro-batch,
        virtual stage) order, a topological order on every rank (no rank waits forever)."""
        if self.schedule == "interleaved-1f1b" and count % self.P:
            return ([Action("F", m, c) for m in range(count) for c in range(self.V)]
                    + [Action("B", m, c) for m in range(count) for c in reversed(range(self.V))])
        return schedule(self.schedule, self.P, count, self.p, self.V)

    def _output_leaves(self, flat: list[Any], B: int) -> list[Any]:
        """Buffers for the batch's output leaves (constants stay constants)."""
        traced = self._traced()
        meta = self._meta(flat, 1)
        out: list[Any] = []
        for v in traced.outputs:
            m = meta.get(v.name) if isinstance(v, torch.fx.Node) else None
            if m is None:
                out.append(v)
            elif not m.shape or m.shape[0] != 1:
                raise FitError(f"Pipeline.eval needs every tensor output to have the batch as dim 0; output "
                               f"{v.name!r} has shape {m.shape} for one sample")
            else:
                out.append(torch.empty((B, *m.shape[1:]), dtype=m.dtype))
        return out

    def _mode(self, train: bool) -> None:
        """Train or eval mode for this rank's partitions: submodules (fx) and ATen mode flags (export)."""
        for s in self.stages:
            s.part.module.train(train)
            if self._traced().how == "export":
                set_training(s.part.module, train)

    @torch.no_grad()
    def _land(self, q: torch.Tensor) -> None:
        """Post-accumulate hook of a training pass: `q`'s gradient into its bucket view (a copy of the
        first one, then autograd accumulates in place)."""
        adopt(q, self._views[id(q)], None)  # type: ignore[arg-type]

    def _in_bucket(self, q: torch.Tensor, g: torch.Tensor) -> bool:
        v = self._views.get(id(q))
        return v is not None and g.data_ptr() == v.data_ptr()

    def _abandon(self) -> list[Request]:
        return [r for s in self.stages for r in s.abandon()]

    def _finish_sends(self) -> None:
        for s in self.stages:
            s.finish_sends()

    def _watched(self, what: str) -> Any:
        """A blocking collective over all ranks, with a warning naming it if it outlives warn_after."""
        return watched("pipeline collective", f"rank {self.comm.rank} waits in {what} over all "
                       f"{self.comm.size} ranks", self.stall.warn_after)

    def _sync_buffers(self) -> None:
        """Give every replica replica 0's buffers (BatchNorm statistics), as DDP's broadcast_buffers
        does, so evaluation does not depend on which replica computed which slice."""
        if self.R > 1:
            with torch.no_grad():
                for s in self.stages:
                    for b in s.part.module.buffers():
                        self.group.broadcast(b, root=0)


#: The weight size from which a rank's weight-sized blocks get their own mapping: below it, the few
#: blocks the heap cannot reuse (see :mod:`..._utils.malloc`) waste little, and activations that
#: size stay in the heap, reused without page faults
OWN_MAPPING_FROM = 4 << 20


def _map_weight_sized_blocks(parts: list[Partition]) -> None:
    """Lower glibc's mmap threshold to the largest weight of `parts` (at least :data:`OWN_MAPPING_FROM`).

    Every step allocates one temporary per weight and micro-batch as large as the weight (autograd's
    weight gradient, added into ``.grad``); in the heap, each can leave a hole that the next one cannot
    reuse (:mod:`..._utils.malloc`), measured at 1 to 13 extra 16 MiB blocks per rank at P = 4 on
    the ``bench memory`` model. Mapped on their own they are returned when freed, at the price of
    page faults per temporary (docs/pipeline.md, "Memory per rank")."""
    largest = max((q.numel() * q.element_size() for part in parts for q in part.module.parameters()), default=0)
    if largest >= OWN_MAPPING_FROM:
        lower_mmap_threshold(largest)


def _bounds(balance: Any, parts: int, costs: list[float], cuts: list[int]) -> list[int]:
    try:
        return bounds_from_balance(balance, parts, costs, cuts)
    except ValueError as e:
        raise FitError(str(e)) from e


def _raise_first(errors: list[str | None]) -> None:
    """FitError on every rank (each holds the same gathered list) if any rank reported an error."""
    for r, e in enumerate(errors):
        if e is not None:
            raise FitError(f"rank {r}: {e}")


def _stand_in(meta: ValueMeta | None, device: torch.device) -> torch.Tensor:
    """A tensor shaped like a received activation, to time a partition alone: random floats (a
    non-leaf when differentiable, so in-place ops on it are allowed, as on a received copy), zeros
    otherwise."""
    assert meta is not None  # a boundary only ever carries tensors (cut_points)
    if not meta.dtype.is_floating_point:
        return torch.zeros(meta.shape, dtype=meta.dtype, device=device)
    x = torch.randn(meta.shape, dtype=meta.dtype, device=device, requires_grad=meta.requires_grad)
    return x.clone() if meta.requires_grad else x


def _place(partitions: int | None, replicas: int | None, comm: Communicator) -> Place:
    """This rank's place, P x R == comm.size (either may be left out), or a FitError saying what to change."""
    try:
        return Place.of(comm.size, comm.rank, replicas=replicas, partitions=partitions)
    except PlaceError as e:
        raise FitError(f"partitions x replicas must equal the {comm.size} ranks; got partitions={partitions}, "
                       f"replicas={replicas}: {e}") from None


def _check_options(P: int, M: int, schedule: str, checkpoint: str, balance: Any, virtual: int) -> None:
    if schedule not in SCHEDULES:
        raise FitError(f"unknown schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    if not isinstance(M, int) or M < 1:
        raise FitError(f"micro_batches must be a positive int, got {M!r}")
    if checkpoint not in CHECKPOINTS:
        raise FitError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
    if schedule == "interleaved-1f1b" and (not isinstance(virtual, int) or virtual < 1 or M % P):
        raise FitError(f"schedule 'interleaved-1f1b' needs virtual_stages >= 1 and micro_batches a multiple "
                       f"of partitions ({P}); got virtual_stages={virtual!r}, micro_batches={M}")
    if schedule in SPLIT and checkpoint != "never":
        raise FitError(f"schedule {schedule!r} splits each backward in two halves, and recomputation "
                       f"(checkpoint={checkpoint!r}) would recompute the forward in each of them (and once per "
                       f"weight group); use checkpoint='never', or schedule '1f1b' with recomputation")
    if schedule == "zbv" and virtual != 2:
        raise FitError(f"schedule 'zbv' runs exactly 2 partitions per rank (in a V); got virtual_stages={virtual!r}: "
                       f"leave virtual_stages at 2")
    parts = P * chunks_per_rank(schedule, virtual)
    if not (balance in ("time", "params") or (isinstance(balance, (list, tuple)) and len(balance) == parts)):
        raise FitError(f"balance must be 'time', 'params' or a list of {parts} node counts, got {balance!r}")


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
