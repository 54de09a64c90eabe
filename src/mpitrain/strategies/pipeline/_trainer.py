"""The "model" and "hybrid" strategies behind `fit`: a thin loop over :class:`._pipe.Pipeline`.

"model" is one replica of ``partitions == world size``; "hybrid" is ``partitions x replicas == world
size``. Arguments are checked on every rank before any message. Every loop feature of fit is
supported (the step is :class:`..step.StepTrainer`'s; this module supplies its hooks):

* shares: replica r reads block r of each global batch (as even as possible); within a replica only
  pipeline rank 0 reads inputs and only the last pipeline rank targets, middle ranks read nothing.
  Set-up (capture, measurement, partition) happens on the first step, from a few rows that world rank 0
  broadcasts. Micro-batch m of a step of `total` samples back-propagates ``loss * rows * R / total``
  (the replica average divides by R), so the step equals one process's on those samples.
* the optimizer is built at construction from the whole model's parameters (so fit can hand it to an
  LR scheduler at once) and, at set-up, each parameter group keeps only this rank's parameters (a rank
  with none keeps empty groups: its steps and scheduler still run).
* checkpoints: a rank's shard holds its partitions' tensors and its optimizer state by the user's
  ``state_dict`` names (:mod:`.._reshard`), and the layout the cut; they load into any partitions,
  replicas, ZeRO stage or strategy (see :meth:`PipelineTrainer.load_state_dict`).
* ``zero=1|2`` (hybrid): each partition's optimizer state (and gradients) sharded over its replicas
  (:class:`._pipe.Pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from torch import nn

from ...comm.base import Communicator, split_sizes
from .._batching import counted_rows, even_share, ignore_index_of, label_shift, per_sample, samples
from .._device import LOW, as_float
from .._reshard import NAMED, Held, assemble, load_named, optimizer_entries, tensor_entries, whole, written_elsewhere
from .._sync_bn import sync_norm_names
from .._zero import check_optimizer
from ..base import (
    DEFAULT_LOOP,
    BatchShare,
    FitError,
    FitSpec,
    LoopSpec,
    LossFn,
    OptimizerFactory,
    Share,
    StrategyOptions,
    is_int,
)
from ..step import StepTrainer
from ._cut import LossSample
from ._materialize import InitFn
from ._pipe import CHECKPOINTS, Pipeline
from ._shapes import repeat

__all__ = ["make_trainer", "PipelineTrainer", "PipelineOptions"]

@dataclass(frozen=True)
class PipelineOptions(StrategyOptions):
    """Options of ``fit(strategy="model"|"hybrid", ...)``: the profiling passes of ``balance="time"``,
    activation recomputation (:data:`CHECKPOINTS`), the virtual stages of interleaved-1f1b, and the
    seed and per-module initialiser of a model on the meta device (:class:`Pipeline`'s `seed` and
    `init_fn`; the seed is `init_seed` here because fit's own `seed` orders the data). Waits follow
    ``spec.stall`` (fit's `warn_after`/`abort_after`)."""

    strategy: ClassVar[str] = "model/hybrid"
    profile_passes: int = 5
    checkpoint: str = "never"
    virtual_stages: int = 2
    init_seed: int = 0
    init_fn: InitFn | None = None
    zero: int = 0

    def __post_init__(self) -> None:
        self.require("zero", not isinstance(self.zero, bool) and self.zero in (0, 1, 2),
                     "0, 1 (optimizer state sharded across the replicas) or 2 (and gradients)")
        self.require("profile_passes", is_int(self.profile_passes) and self.profile_passes >= 1, "an int >= 1")
        self.require("checkpoint", self.checkpoint in CHECKPOINTS, f"one of {CHECKPOINTS}")
        self.require("virtual_stages", is_int(self.virtual_stages) and self.virtual_stages >= 1, "an int >= 1")
        self.require("init_seed", is_int(self.init_seed), "an int")
        self.require("init_fn", self.init_fn is None or callable(self.init_fn), "None or a callable(module)")

    def strategy_name(self, partitions: int | None, replicas: int | None, world_size: int) -> str:
        """``fit(strategy=PipelineOptions(...))``: "model" when the partitions take every rank (or are not
        given) with one replica, else "hybrid" (partitions x replicas ranks)."""
        return "model" if partitions in (None, world_size) and replicas in (None, 1) else "hybrid"


def _check_spec(spec: FitSpec, size: int) -> PipelineOptions:
    if spec.strategy not in ("model", "hybrid"):
        raise FitError(f"the pipeline trainer runs strategies 'model' and 'hybrid', not {spec.strategy!r}")
    if spec.strategy == "model":
        if spec.replicas not in (None, 1):
            raise FitError(f"strategy 'model' has one replica (got replicas={spec.replicas}); "
                           f"use strategy='hybrid'")
        if spec.partitions != size:
            raise FitError(f"strategy 'model' needs partitions == world size; got partitions={spec.partitions} "
                           f"on {size} ranks: pass partitions={size}")
    return PipelineOptions.from_spec(spec)


def _refuse_sync_norms_across_replicas(model: nn.Module, spec: FitSpec, size: int) -> None:
    """Refuse ``nn.SyncBatchNorm`` under hybrid with more than one replica (FitError, local: before any
    message). The pipeline captures it as plain batch norm per micro-batch (statistics of one replica's
    micro-batch), while a DDP user expects them synchronised over the replicas: rather than silently differ,
    name the layer and the choices. One replica (model, hybrid R=1) has no replicas to sync: allowed, per
    micro-batch as BatchNorm."""
    replicas = spec.replicas if spec.replicas is not None else size // max(spec.partitions, 1)
    names = sync_norm_names(model) if replicas > 1 else []
    if names:
        raise FitError(f"strategy 'hybrid' with {replicas} replicas: SyncBatchNorm {names[0]!r} would not combine "
                       f"statistics over the replicas (the pipeline computes batch norm per micro-batch of one "
                       f"replica); use strategy='data' or 'pipe-sgd' (statistics over every rank's rows), or "
                       f"nn.BatchNorm (per micro-batch statistics), or replicas=1")


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> PipelineTrainer:
    """Validate `spec` locally (same verdict on every rank) and create the pipeline's communicators."""
    opts = _check_spec(spec, comm.size)
    _refuse_sync_norms_across_replicas(model, spec, comm.size)
    built = optimizer(model.parameters())  # first: an optimizer ZeRO cannot shard is refused before any message
    if opts.zero:
        try:
            check_optimizer(built)
        except ValueError as e:
            raise FitError(f"strategy {spec.strategy!r}, zero={opts.zero}: {e}") from None
    pipe = Pipeline(model, spec.partitions, spec.replicas, spec.micro_batches, spec.schedule, comm,
                    opts.checkpoint, balance=spec.balance, virtual_stages=opts.virtual_stages, stall=spec.stall,
                    profile_passes=opts.profile_passes, seed=opts.init_seed, init_fn=opts.init_fn,
                    inputs_on_first=True, autocast=spec.loop.precision in LOW and spec.loop.precision, zero=opts.zero)
    trainer = PipelineTrainer(pipe, loss_fn, lambda params: built, spec.strategy, spec.loop)
    trainer.stall = spec.stall  # bounds the wait for each step's weight
    return trainer


class PipelineTrainer(StepTrainer):
    """`fit`'s Trainer over a :class:`Pipeline` (:class:`~..base.ShardedTrainer` and
    :class:`~..base.CheckpointTrainer`; the step is :class:`~..step.StepTrainer`'s). Every rank calls
    every method."""

    def __init__(self, pipe: Pipeline, loss_fn: Callable[[Any, Any], torch.Tensor], optimizer: OptimizerFactory,
                 strategy: str = "model", loop: LoopSpec = DEFAULT_LOOP) -> None:
        self.pipe, self.loss_fn, self.strategy, self.loop = pipe, loss_fn, strategy, loop
        self.comm = pipe.comm
        self.replicas = pipe.R  # each partition's gradients are averaged over its replicas
        self.label_shift = label_shift(pipe.model, loss_fn)
        self.label = strategy
        # the user's names of the model's parameters: they survive a meta model's materialisation
        self._names = {id(q): name for name, q in pipe.model.named_parameters(remove_duplicate=False)}
        self.optimizer: torch.optim.Optimizer = optimizer(pipe.model.parameters())
        self._pending = False  # a checkpoint to load once the model is split
        self._read: Callable[[int], dict[str, object]] | None = None
        self._saved: Mapping[str, object] = {}

    # -- shares (ShardedTrainer) ------------------------------------------------------------------------
    def share(self, n: int) -> Share:
        """Replica r's block of `n` rows (:func:`~mpitrain.comm.base.split_sizes`); inputs on pipeline
        rank 0, targets on the pipeline rank of the last partition (the last rank; rank 0 under zbv),
        nothing on the others."""
        s = even_share(n, self.pipe.R, self.pipe.replica)
        return Share(s.start, s.stop, inputs=self.pipe.p == 0, targets=self.pipe.p == self.pipe.last_rank)

    def begin_step(self, batches: Sequence[BatchShare]) -> None:
        """Split the model on the first step; clear every gradient (with ZeRO the optimizer holds pieces,
        whose gradients accumulate)."""
        pipe = self.pipe
        if pipe.runtime is None:
            self._setup(batches[0])
        for q in pipe.parameters():
            q.grad = None
        self.optimizer.zero_grad()

    def local_pass(self, batches: Sequence[BatchShare], total: int) -> torch.Tensor:
        """Each batch's rows as `micro_batches` micro-batches through the pipeline, micro-batch m of s rows
        back-propagating ``loss * scale(s)`` (the pipeline's stages do the backward)."""
        pipe = self.pipe
        local = torch.zeros((), dtype=torch.float64)
        for b in batches:
            sizes = [s for s in split_sizes(b.share.stop - b.share.start, pipe.M) if s > 0]
            weights = self.share_weights(b.targets, sizes)  # counted on the last stage (its targets)
            scales = self.scales(weights, total)  # read where a loss is back-propagated: the weight's wait
            local += pipe.train_pass(_own_rows(b.inputs, b), b.targets, sizes, scales, self.loss_fn, weights=weights)
        return local

    def finish_gradients(self) -> bool:
        """Average each partition's gradients over its replicas (and sum tied copies)."""
        self.pipe.reduce_gradients()
        return True

    def clip_grad_norm_(self, max_norm: float) -> None:
        """The norm over every partition (pipeline-allreduced), a tied weight counted once."""
        self.pipe.clip_gradients(max_norm)

    def _setup(self, first: BatchShare) -> None:
        """Build the pipeline (its cut and runtime, in one call: :meth:`Pipeline.setup_shared`) on rows of
        world rank 0's first batch, keep this rank's parameters in the optimizer, and load a pending
        checkpoint."""
        pipe = self.pipe
        micro = -(-split_sizes(first.n, pipe.R)[0] // pipe.M)  # replica 0's first micro-batch, on every rank
        # world rank 0 is replica 0's pipeline rank 0: it has rows (n >= 1) and inputs
        pipe.setup_shared(_own_rows(first.inputs, first) if self.comm.rank == 0 else None, micro,
                          self._loss_sample(first, micro))
        mine = {id(q) for q in pipe.parameters()}
        current = dict(pipe.model.named_parameters(remove_duplicate=False))
        for group in self.optimizer.param_groups:  # in place: an optimizer may hold the list itself
            held = [current[self._names[id(q)]] for q in group["params"]]
            group["params"][:] = [q for q in held if id(q) in mine]
        if pipe.zero is not None:
            pipe.zero.shard_optimizer(self.optimizer)
        if self._pending:
            self._load()
            self._pending = False

    def _loss_sample(self, first: BatchShare, micro: int) -> LossSample | None:
        """The loss and targets for `micro` rows (this rank's first targets repeated in order: the
        shapes of the set-up sample's), where this rank holds targets; for ``balance="time"``."""
        rows = first.share.stop - first.share.start
        if first.targets is None or rows == 0:
            return None
        try:
            k = per_sample(rows, first.targets)
        except FitError:
            return None  # not this rank's to refuse (the step does, on every rank): the loss goes unweighed
        return LossSample(self.loss_fn, repeat(first.targets, k * micro))

    @property
    def bounds(self) -> list[int]:
        """Where the captured graph was cut (node indices ``[0, c1, ..., n]``), once set up."""
        return self.pipe.bounds

    def eval_step(self, inputs: Any, targets: Any) -> Any:
        """Forward only, in eval mode; any batch size (every rank holds it); bf16/fp16 outputs as float32."""
        n, ignore = samples(inputs, targets), ignore_index_of(self.loss_fn)
        out = self.pipe.eval(inputs, lambda a, b: counted_rows(targets, n, a, b, ignore, self.label_shift))
        return pytree.tree_map(as_float, out)

    def trained_model(self) -> nn.Module:
        if self.pipe.runtime is None and self._read is not None:  # resumed after the last step: no set-up
            self._load_everything(self._read)
        model = self.pipe.trained_model()
        if self.pipe.zero is not None:
            self.pipe.zero.close()
        return model

    # -- checkpoints (CheckpointTrainer) -----------------------------------------------------------------
    def layout(self) -> dict[str, object]:
        """Strategy, world size, P, R, virtual stages, their placement ("loop": rank p runs p, p + P, ...;
        "v": zbv's p and 2P-1-p), ZeRO stage and the cut (None before the first step)."""
        pipe = self.pipe
        return {"strategy": self.strategy, "world_size": self.comm.size, "partitions": pipe.P,
                "replicas": pipe.R, "virtual_stages": pipe.V, "placement": pipe.placement_name,
                "zero": pipe.zero_stage, "bounds": list(pipe.bounds) if pipe.runtime is not None else None, NAMED: True}

    def _held(self) -> tuple[list[tuple[torch.Tensor, Held]], dict[int, Held]]:
        """This rank's tensors by name: its partitions' parameters and buffers (a tied weight under each
        of its names, on every rank holding a copy: the copies are equal), plus, on world rank 0, tensors
        no partition holds (before the first step: every tensor); and its optimizer's parameters (whole,
        or with ZeRO this rank's pieces)."""
        pipe = self.pipe
        named = pipe.model.state_dict(keep_vars=True)
        rank0 = self.comm.rank == 0
        if pipe.runtime is None:
            tensors = [(t, whole(k, t)) for k, t in named.items() if rank0 and not t.is_meta]
            return tensors, {}
        own, held = pipe.tensor_ids()
        tensors = [(t, whole(k, t)) for k, t in named.items()
                   if id(t) in own or (rank0 and id(t) not in held and not t.is_meta)]
        params = dict(pipe.model.named_parameters(remove_duplicate=False))
        names: dict[int, Held] = {}
        if pipe.zero is not None:
            for pid, (piece, a, b) in pipe.zero.piece_ranges().items():
                name = self._names[pid]
                names[id(piece)] = Held(name, a, b, tuple(params[name].shape))
        else:
            for q in pipe.parameters():
                names[id(q)] = whole(self._names[id(q)], q)
        return tensors, names

    def _written_elsewhere(self, tensors: list[tuple[torch.Tensor, Held]]) -> set[int]:
        """``id`` of the parameters of this rank's partitions that another replica of them writes. The R
        replicas of a pipeline rank hold the same partitions (the same names, in the state_dict's order)
        with equal parameters (each step applies the replica-averaged gradient; with ``zero`` the
        stepped pieces are gathered), and at zero=0 equal optimizer state: :func:`written_elsewhere`
        splits them among the R replicas by bytes, so the checkpoint holds each partition's once.
        Buffers (BatchNorm statistics of each replica's rows) and ZeRO pieces stay with their rank; so do
        tensors no partition holds (world rank 0 writes them)."""
        pipe = self.pipe
        if pipe.runtime is None or pipe.R == 1:
            return set()
        own, _ = pipe.tensor_ids()
        params = {id(q) for q in pipe.model.parameters()}
        return written_elsewhere((t for t, _ in tensors if id(t) in own and id(t) in params), pipe.R,
                                 pipe.place.coords.replica)

    def state_dict(self) -> dict[str, object]:
        """This rank's shard by name (:mod:`.._reshard`): the tensors of :meth:`_held` and its optimizer's
        state, less its partitions' parameters (and at zero=0 their state) that another replica writes."""
        tensors, names = self._held()
        skip = self._written_elsewhere(tensors)
        model, pieces = tensor_entries((t, h) for t, h in tensors if id(t) not in skip)
        return {"model": model, "model_pieces": pieces, "optim": optimizer_entries(self.optimizer, names, skip)}

    def load_state_dict(self, read: Callable[[int], dict[str, object]], saved_layout: Mapping[str, object]) -> None:
        """Resume from a checkpoint by name of any layout: this rank's tensors and optimizer state are read,
        once the model is split at the first step, from whichever saved ranks hold them (partitions,
        replicas, placement, ZeRO stage and strategy may all differ). Same partitions, virtual stages and
        placement: the model is cut where the saved run cut it (its bounds become ``balance``) and
        pipeline rank p reads saved
        rank p first (replica 0's BatchNorm statistics; its own with the same replicas). The optimizer's
        hyperparameters are set at once (fit reports the lr, a scheduler was built on them)."""
        now = self.layout()
        if not saved_layout.get(NAMED):
            raise FitError(f"cannot resume strategy {self.strategy!r} (layout {now}) from a checkpoint of layout "
                           f"{dict(saved_layout)}: it predates checkpoints by name")
        self._read, self._saved = read, saved_layout
        bounds = saved_layout.get("bounds")
        pipeline = saved_layout.get("strategy") in ("model", "hybrid")
        if pipeline and bounds is None:  # saved before any step: the whole model, on rank 0
            self.pipe.model.load_state_dict(read(0)["model"])  # type: ignore[arg-type]
            return
        if self._same_cut():
            assert isinstance(bounds, list)
            self.pipe.balance = [b - a for a, b in zip(bounds, bounds[1:])]
        saved_groups = read(0)["optim"]["groups"]  # type: ignore[index]
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            group.update(saved)
        if self.pipe.runtime is not None:
            self._load()
        else:
            self._pending = True

    def _same_cut(self) -> bool:
        saved = self._saved
        return (saved.get("strategy") in ("model", "hybrid") and saved.get("partitions") == self.pipe.P
                and saved.get("virtual_stages") == self.pipe.V and isinstance(saved.get("bounds"), list)
                and saved.get("placement", "loop") == self.pipe.placement_name)  # older checkpoints: the loop

    def _load(self) -> None:
        assert self._read is not None
        saved = self._saved
        world = int(saved["world_size"])  # type: ignore[call-overload]
        if self._same_cut():  # same layout: this rank's own shard; other replicas: pipeline rank p's
            same = saved.get("replicas") == self.pipe.R and world == self.comm.size
            first = self.comm.rank if same else self.pipe.place.rank_of(0, self.pipe.p)  # replica 0's copy
        else:
            first = 0
        tensors, names = self._held()
        load_named(self._read, [first, *(r for r in range(world) if r != first)], tensors, self.optimizer, names)

    def _load_everything(self, read: Callable[[int], dict[str, object]]) -> None:
        """The whole model from every saved shard (lowest rank first), for a run resumed with no step left."""
        world = int(self._saved.get("world_size", self.comm.size))  # type: ignore[call-overload]
        merged = assemble(read(r) for r in range(world))
        if not self.pipe.on_meta:
            self.pipe.model.load_state_dict(merged, strict=False)


def _rowed(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0


def _own_rows(inputs: Any, b: BatchShare) -> Any:
    """`b`'s rows of `inputs`: inputs given as the whole global batch (a structure that fit's slicing
    passes through whole, such as a dict) are cut to the share's rows here."""
    if inputs is None:
        return None
    leaves = [t for t in pytree.tree_leaves(inputs) if _rowed(t)]
    rows = b.share.stop - b.share.start
    if leaves and len(leaves[0]) == b.n and rows != b.n:
        return pytree.tree_map(lambda t: t[b.share.start:b.share.stop] if _rowed(t) else t, inputs)
    return inputs
