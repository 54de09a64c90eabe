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

A `Pipeline` is three things built in order: its :class:`~._layout.Layout` (at construction: places,
placement, sub-communicators), the :class:`~._cut.Cut` (capture -> profile -> agree -> bounds, which
needs a sample batch) and a :class:`~._runtime.PipelineRuntime` built complete from both. Given
`example` all three are built at construction; else the cut and runtime are built in one call on the
first batch (:meth:`Pipeline.build`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ..._utils.stall import DEFAULT_POLICY, StallPolicy
from ...comm.base import Communicator, split_sizes
from ...comm.place import Place, PlaceError
from .._batching import check_divisible, per_sample, plain_inputs, target_rows
from .._buckets import Bucket
from .._device import LOW, model_device
from .._zero import Zero
from ..base import FitError
from ._cut import OWN_MAPPING_FROM, CutSpec, LossSample, capture_model, cut, profile_sample
from ._graph import Partition, Traced, model_args
from ._layout import Layout
from ._materialize import InitFn, is_meta
from ._runtime import LossFn, PipelineRuntime, RunSpec
from ._shapes import batch_size, repeat, rows
from ._stage import Stage
from .schedule import SCHEDULES, SPLIT, chunks_per_rank

__all__ = ["Pipeline", "CHECKPOINTS", "OWN_MAPPING_FROM"]  # the last: its old home, for tests

_CPU = torch.device("cpu")

#: Activation recomputation policies (torchgpipe's): recompute the forward of every training
#: micro-batch during its backward, of all but the last one, or of none.
CHECKPOINTS = ("never", "except_last", "always")


class Pipeline:
    """A model split into `partitions` stages (times `replicas` copies) over `comm` (default: the world).

    Every rank of `comm` constructs it with the same arguments and calls :meth:`step` / :meth:`eval`
    with the same global batch. ``partitions * replicas`` must equal ``comm.size`` (either may be
    left out). `balance`: "time" (measured forward+backward per graph node), "params", or a list of
    node counts per partition. `checkpoint`: one of :data:`CHECKPOINTS`. `example`: a batch's inputs,
    to build it complete at construction (layout, cut and runtime), so that :meth:`parameters` is
    known before the first step; without it the cut waits for the first batch.

    A model on the meta device is captured, measured and split on meta; each rank then allocates and
    initialises only the tensors its partitions use (:func:`._materialize.materialize`: each tensor
    seeded by `seed` and its qualified name, with `init_fn(module)` or the module's
    ``reset_parameters()``).

    For fit's per-rank reads (`inputs_on_first`): only pipeline rank 0 has a batch's inputs, and only
    the rank of the last partition (:attr:`last_rank`) its targets (:meth:`setup_shared`,
    :meth:`train_pass`); a model input read by a later partition is sent there by partition 0.
    `autocast`: forwards and loss under autocast on the model's device: True or "bf16" to bfloat16,
    "fp16" to float16 (shapes and dtypes of the messages are profiled under it too).

    `zero` (1 or 2; fit's ``strategy="hybrid", zero=``) shards each partition's optimizer state (1) and
    gradients (2) across its R replicas (:mod:`.._zero`, over the replica group): the replicas
    reduce-scatter (2) or allreduce (1) instead of averaging, the optimizer, made to step this rank's
    pieces by ``zero.shard_optimizer``, updates them, and the replicas allgather the parameters."""

    def __init__(self, model: nn.Module, partitions: int | None = None, replicas: int | None = None,
                 micro_batches: int = 1, schedule: str = "1f1b", comm: Communicator | None = None,
                 checkpoint: str = "never", *, balance: Any = "time", virtual_stages: int = 2,
                 stall: StallPolicy = DEFAULT_POLICY, profile_passes: int = 5, example: Any = None,
                 seed: int = 0, init_fn: InitFn | None = None, inputs_on_first: bool = False,
                 autocast: bool | str = False, zero: int = 0) -> None:
        if comm is None:
            from ...runtime import init

            comm = init()
        self.model, self.comm = model, comm
        place = _place(partitions, replicas, comm)
        _check_options(place.partitions, micro_batches, schedule, checkpoint, balance, virtual_stages)
        if isinstance(zero, bool) or zero not in (0, 1, 2):
            raise FitError(f"zero for a pipeline must be 0, 1 (optimizer state sharded across the replicas) or 2 "
                           f"(and gradients); got {zero!r} (zero=3 is not offered: every micro-batch of a stage "
                           f"uses its parameters)")
        #: where every partition runs (pure; known before any model or sample)
        self.layout = Layout(place, schedule, chunks_per_rank(schedule, virtual_stages))
        self.balance, self.profile_passes, self.seed, self.init_fn = balance, profile_passes, seed, init_fn
        if autocast not in (False, True, *LOW):
            raise FitError(f"autocast must be a bool, 'bf16' or 'fp16', got {autocast!r}")
        precision = "bf16" if autocast is True else autocast if isinstance(autocast, str) else None
        self.run_spec = RunSpec(micro_batches, checkpoint, stall, precision, inputs_on_first, zero)
        self.on_meta = is_meta(model)
        self.device = _CPU if self.on_meta else model_device(model)  # a meta model is materialised on the CPU
        self.groups = self.layout.split(comm)  # collective: every rank of comm constructs
        self.pipe, self.group = self.groups
        self.traced: Traced | None = None  # captured on the first batch (the cut's first step)
        self._runtime: PipelineRuntime | None = None
        if example is not None:
            self.build(example)

    # -- the layout and options (read-only) ----------------------------------------------------------
    @property
    def place(self) -> Place:
        """This rank's place: replicas x partitions (the grid is one cell)."""
        return self.layout.place

    @property
    def P(self) -> int:
        """Pipeline ranks per replica."""
        return self.layout.P

    @property
    def R(self) -> int:
        """Replicas."""
        return self.layout.R

    @property
    def V(self) -> int:
        """Partitions per pipeline rank (virtual stages; zbv's 2)."""
        return self.layout.V

    @property
    def p(self) -> int:
        """This rank's pipeline rank."""
        return self.layout.p

    @property
    def replica(self) -> int:
        """This rank's replica."""
        return self.layout.replica

    @property
    def last_rank(self) -> int:
        """The pipeline rank running the model's last partition (it computes the loss)."""
        return self.layout.last_rank

    @property
    def placement_name(self) -> str:
        """"loop", or zbv's "v"."""
        return self.layout.placement_name

    @property
    def schedule(self) -> str:
        """The schedule's name."""
        return self.layout.schedule

    @property
    def M(self) -> int:
        """Micro-batches per replica and step."""
        return self.run_spec.micro_batches

    @property
    def checkpoint(self) -> str:
        """The recomputation policy (:data:`CHECKPOINTS`)."""
        return self.run_spec.checkpoint

    @property
    def stall(self) -> StallPolicy:
        """The stall policy of every wait."""
        return self.run_spec.stall

    @property
    def autocast(self) -> str | None:
        """The autocast precision of forwards and loss ("bf16", "fp16"; None: none)."""
        return self.run_spec.precision

    @property
    def inputs_on_first(self) -> bool:
        """Only pipeline rank 0 holds a batch's inputs (fit's per-rank reads)."""
        return self.run_spec.inputs_on_first

    @property
    def zero_stage(self) -> int:
        """ZeRO's stage: 0, 1 or 2."""
        return self.run_spec.zero

    # -- the runtime's state, once built --------------------------------------------------------------
    @property
    def runtime(self) -> PipelineRuntime | None:
        """The running pipeline: None until built (`example`, :meth:`build`, or the first batch)."""
        return self._runtime

    @property
    def stages(self) -> list[Stage]:
        """This rank's :class:`~._stage.Stage` per partition; empty until built."""
        return self._runtime.stages if self._runtime is not None else []

    @property
    def zero(self) -> Zero | None:
        """ZeRO's shards over the replica group (with `zero`), once built."""
        return self._runtime.zero if self._runtime is not None else None

    @property
    def bounds(self) -> list[int]:
        """Where the captured graph was cut (node indices ``[0, c1, ..., n]``); needs the build."""
        return self._built().cut.bounds

    @property
    def _parts(self) -> list[Partition]:
        return self._built().cut.parts

    @property
    def _buckets(self) -> list[Bucket]:
        return self._built().buckets

    def _built(self) -> PipelineRuntime:
        if self._runtime is None:
            raise RuntimeError("the pipeline is not built yet: pass example= or run a first batch")
        return self._runtime

    # -- public ---------------------------------------------------------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """The trainable parameters (each once) for this rank's optimizer.

        Once built (`example` given, or after the first :meth:`step`): this rank's partitions'
        parameters. Before (the partition needs a sample batch to capture, measure and cut): every
        trainable parameter of the model. An optimizer built on those at once, as in
        ``opt = torch.optim.AdamW(pipe.parameters())`` right after construction, steps exactly this
        rank's: the others never get a gradient here and torch's optimizers skip a parameter whose
        ``.grad`` is None (its state is created at its first step, so none is held for them). A
        meta-device model's parameters are materialised in place (the same objects), so this holds
        for it too."""
        if self._runtime is None:
            return iter([q for q in self.model.parameters() if q.requires_grad])  # a tied tensor once
        return iter(self._runtime.params)

    def tensor_ids(self) -> tuple[set[int], set[int]]:
        """The ``id`` of every parameter and buffer of this rank's partitions, and of every partition's
        (the model's tensors that some rank holds). Needs the build."""
        return self._built().tensor_ids()

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
        B = batch_size(flat)
        check_divisible(B, self.R * self.M, f"replicas x micro-batches (R={self.R}, M={self.M})")
        per_sample(B, targets, inputs)  # targets follow the inputs' samples (k rows each): checked before set-up
        n = B // (self.R * self.M)
        rt = (self._runtime if self._runtime is not None
              else self._build(flat, n, LossSample(loss_fn, target_rows(targets, B, 0, n))))
        off = self.replica * n * self.M
        # what .grad held; a copy where it is a bucket view (the user did not clear it), which this step reuses
        before = [None if q.grad is None else q.grad.clone() if rt.in_bucket(q, q.grad) else q.grad
                  for q in rt.params]
        for q in rt.params:
            q.grad = None  # reductions below must see this step's contribution only
        mine = self.train_pass(rows(flat, off, off + n * self.M), target_rows(targets, B, off, off + n * self.M),
                               [n] * self.M, [1.0 / self.M] * self.M, loss_fn, flat=True)
        self.reduce_gradients()
        for q, g in zip(rt.params, before):  # accumulate onto what .grad held, as autograd does
            if g is not None:
                q.grad = g if q.grad is None else q.grad.add_(g)
        with rt.watched("the end-of-step loss allreduce"):
            return float(self.comm.allreduce(torch.tensor([mine / B], dtype=torch.float64))[0])

    def setup_shared(self, inputs: Any | None, micro: int, loss: LossSample | None = None) -> None:
        """Collective, once, before the first :meth:`train_pass` of a pipeline whose ranks do not all
        hold the batch: world rank 0 passes rows of the inputs (the others pass None), which it repeats
        to ``max(2, micro)`` rows (`micro`: the first micro-batch's size, the same on every rank; two at
        least, as torch.export takes a batch of one for a constant) and broadcasts (pickled, one
        message) so that every rank captures, measures and splits the model on the same sample.
        `loss`: the loss and targets for `micro` rows, on the ranks that hold targets (``balance="time"``
        weighs the loss on the last partition where its rank has one)."""
        if self._runtime is not None:
            return
        mine = repeat(inputs, max(2, micro)) if self.comm.rank == 0 else None
        sample = self.comm.broadcast_object(mine)
        self._build(self._flat(sample), micro, loss)

    def build(self, inputs: Any, micro: int | None = None, *, targets: Any = None,
              loss_fn: LossFn | None = None) -> PipelineRuntime:
        """Collective over `comm`, once (every rank, the same `inputs`: a batch as :meth:`step` takes
        it): capture the model (if not yet), cut it on the first `micro` rows of `inputs` (default: a
        micro-batch's share, ``rows // (R * M)``, at least 1) and build the runtime, which it returns.
        What `example` does at construction. With `targets` (of `inputs`' rows) and `loss_fn`,
        ``balance="time"`` weighs the loss on the partition that holds the model's output (as
        :meth:`step` does when it builds). Every rank reaches the same verdicts; anything wrong is a
        FitError on every rank."""
        flat = self._flat(inputs)
        micro = max(1, batch_size(flat) // (self.R * self.M)) if micro is None else micro
        loss = None
        if targets is not None and loss_fn is not None:
            loss = LossSample(loss_fn, target_rows(targets, batch_size(flat), 0, micro))
        return self._build(flat, micro, loss)

    def _build(self, flat: list[Any], micro: int, loss: LossSample | None) -> PipelineRuntime:
        """:meth:`build` on the flat inputs, `loss` holding the targets of their first `micro` rows."""
        if self._runtime is not None:
            raise RuntimeError("the pipeline is already built")
        traced = self._traced()
        shapes = profile_sample(traced, flat, micro, self.device, self.on_meta, self.autocast)
        settings = (self.P, self.R, self.M, self.V, self.schedule, self.checkpoint, repr(self.balance))
        spec = CutSpec(self.balance, self.profile_passes, self.seed, self.init_fn, settings, loss,
                       self.schedule in SPLIT)
        self._runtime = PipelineRuntime(self.comm, self.layout, self.groups,
                                        cut(self.comm, self.layout, self.model, shapes, spec), self.run_spec)
        return self._runtime

    def train_pass(self, inputs: Any | None, targets: Any | None, sizes: list[int], scales: Sequence[float],
                   loss_fn: LossFn, flat: bool = False, weights: list[int] | None = None) -> float:
        """Forward and backward of this replica's rows of one batch, cut into micro-batches of `sizes`
        rows (any sizes >= 1; none: this replica has no rows), micro-batch m back-propagating
        ``loss * scales[m]``. Gradients are ADDED to ``.grad`` and not reduced (:meth:`reduce_gradients`).
        `inputs` (pipeline rank 0 only, else None; `flat`: already :func:`model_args` leaves) and
        `targets` (:attr:`last_rank` only) hold ``sum(sizes)`` rows. Every rank of the replica calls
        it with the same `sizes`, after the build. `weights` (default `sizes`): each micro-batch's weight
        (:func:`~.._batching.counted`); one of weight 0 back-propagates zero instead of its (NaN) loss.
        Returns the sum over its micro-batches of ``loss * weight`` on the last pipeline rank (0 elsewhere)."""
        rt = self._built()
        leaves = None if inputs is None else inputs if flat else self._flat(inputs)
        return rt.train_pass(leaves, targets, sizes, scales, loss_fn, sizes if weights is None else weights)

    def reduce_gradients(self) -> None:
        """Collective over every rank: finish the sends of the passes, average ``.grad`` over the
        replicas and sum the copies of tied parameters (None gradients count as zeros). With `zero`:
        at 1 as without, then each piece's gradient views its parameter's; at 2 the copies are summed
        first, then the replicas reduce-scatter (each rank keeps its pieces' gradients)."""
        self._built().reduce_gradients()

    def clip_gradients(self, max_norm: float) -> float:
        """Collective over the pipeline's ranks, after :meth:`reduce_gradients`: scale every ``.grad``
        as one process's ``clip_grad_norm_(model.parameters(), max_norm)`` does, by the norm of the
        whole model's gradient (all partitions; a tied parameter's copies once: its lowest pipeline rank
        counts it). Returns that norm (the same on every rank: replicas hold averaged gradients)."""
        return self._built().clip_gradients(max_norm)

    def eval(self, inputs: Any, weigh: Callable[[int, int], int] | None = None) -> Any:
        """Forward only, in eval mode, on any batch size (uneven slices by `split_sizes`); returns the
        model's outputs for the whole batch on every rank, in the model's own structure. Every tensor
        output must have the batch as dim 0, or be a 0-dim floating mean the model took over its rows
        (a Hugging Face model's loss from ``labels`` among the inputs): that one comes back as the mean
        over the whole batch, each micro-batch of rows ``[a, b)`` weighted by ``weigh(a, b)`` (default:
        its rows; fit passes :func:`~.._batching.counted` of its targets), one weighing 0 left out."""
        flat = self._flat(inputs)
        B = batch_size(flat)
        rt = self._runtime
        if rt is None:
            rt = self.build(inputs, max(1, split_sizes(B, self.R)[0] // self.M))
        return rt.eval(flat, B, weigh or (lambda a, b: b - a))

    def trained_model(self) -> nn.Module:
        """The user's model instance, every tensor broadcast from the first partition holding it
        (replica 0's copy, so BatchNorm statistics are replica 0's, as with DDP's broadcast_buffers).
        Every rank must call it."""
        if self._runtime is not None and not self.on_meta:  # meta: this rank's partition is real, the rest meta
            self._runtime.gather_model(self.model)
        return self.model

    # -- the cut's first step -------------------------------------------------------------------
    def _flat(self, inputs: Any) -> list[Any]:
        inputs = plain_inputs(inputs)  # a tokenizer's BatchEncoding: its dict (keyword arguments)
        if self.traced is None:
            self.traced = capture_model(self.model, inputs, self.R * self.M)
            if self.traced.mode_branch and self.comm.rank == 0:
                warnings.warn(f"{type(self.model).__name__}'s forward branches on self.training beyond dropout and "
                              f"batch norm (`if self.training: ...`): the captured graph computes the training "
                              f"branch in eval too (fit's eval_data, evaluate); move that code into a torch.nn "
                              f"module (fx calls those as they are) or use strategy='data' (docs/pipeline.md)",
                              UserWarning, stacklevel=2)
        try:
            return model_args(self.traced, inputs)
        except ValueError as e:
            raise FitError(str(e)) from e

    def _traced(self) -> Traced:
        assert self.traced is not None
        return self.traced


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
