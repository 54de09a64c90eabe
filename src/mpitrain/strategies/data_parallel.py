"""Data parallelism for any nn.Module: DDP semantics with gradients reduced through a KVStore."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm.base import Communicator
from ..comm.place import Place
from ..runtime import world
from ._batching import batch_size, call_model, even_share, label_shift, split_pairs
from ._broadcast import (
    ReplicaBuffers,
    broadcast_optimizer_state,
    broadcast_parameters,
    broadcast_tensors,
    check_same_everywhere,
    module_tensors,
)
from ._buckets import MB, Bucket, adopt, plan_buckets
from ._device import CPU, autocast, model_device, to_device
from ._grad_allreduce import allreduce_gradients, start_allreduce_gradients
from ._reshard import NAMED, Held, load_named, optimizer_entries, tensor_entries, whole, written_elsewhere
from ._sync_bn import check_sync_norms, sync_batch_norms
from ._zero import ModuleGathers, Zero, check_optimizer, check_stage, module_units, storage_bytes
from .base import (
    DEFAULT_LOOP,
    Batch,
    BatchShare,
    FitError,
    FitSpec,
    LoopSpec,
    LossFn,
    OptimizerFactory,
    StrategyOptions,
    is_number,
    require_whole_model,
)
from .step import StepTrainer, replica_eval

if TYPE_CHECKING:
    from ..kvstore import KVStore

__all__ = ["DataParallel", "KVSTORE_TYPES", "COLLECTIVE_TYPES", "make_trainer", "DataTrainer",
           "DataOptions",
           "broadcast_parameters", "broadcast_optimizer_state", "allreduce_gradients",
           "start_allreduce_gradients"]

#: KVStore types DataParallel creates by name over `comm` (see mpitrain.kvstore).
COLLECTIVE_TYPES = ("dist_sync_mpi", "depchain", "concurrent", "funnel")
#: Every type it runs on: "local" only in a one-rank job; "dist_sync" (servers on ranks of their own)
#: only as a store object the caller created, see :class:`DataParallel`.
KVSTORE_TYPES = (*COLLECTIVE_TYPES, "dist_sync", "local")


class DataParallel(nn.Module):
    """Wrap `module` so that ``loss.backward()`` leaves the average gradient over `comm` in every ``.grad``.

    Guarantees, as PyTorch DDP:

    * Construction is collective over `comm`: rank 0's parameters and buffers are broadcast, after
      one check that every rank wraps the same parameter list (names, shapes, dtypes) with the same
      settings (else ValueError on every rank, before any tensor moves).
    * Gradients live in flat buckets of about `bucket_mb` MiB, filled in reverse registration order
      (the first one capped at `first_bucket_mb` so communication starts early). Each ``.grad`` is a
      view of its bucket, so autograd accumulates straight into the buffer that is reduced.
    * A bucket is pushed to the KVStore (``pushpull``, in place) the moment autograd has produced all
      its gradients, while the rest of backward runs (see `overlap`). Buckets are pushed in bucket
      order only, so every rank issues the same keys in the same order whatever the kvstore type; a
      bucket whose parameters did not all get a gradient (unused this step, data-dependent branches)
      is pushed at the end of backward with its current contents (zeros for a gradient that was None).
      A store that offers ``declare_order`` (``dist_sync_mpi``) is told this order once, at
      construction (collective; a rank with other buckets gets KVStoreError on every rank before any
      gradient moves): it then reduces the buckets through its gradient reducer in bucket order, one
      worker thread, with no negotiation cycle. Other stores order the pushes their own way.
    * When ``loss.backward()`` returns, every ``.grad`` holds the mean over ranks of the local
      gradients (a final autograd callback waits for the buckets). A parameter that no rank used keeps
      ``grad=None``, as in one process; one used on some rank gets the average. Tied parameters are
      one parameter: reduced once.
    * `overlap` (default True, DDP's behaviour) pushes each bucket as soon as it is complete; False
      pushes them all, in the same order, when backward ends (for stores whose per-operation cost
      outweighs the overlap, or to measure it: ``mpitrain bench dataparallel --overlap both``).
    * Inside :meth:`no_sync` nothing is sent; gradients accumulate locally in the buckets and the next
      synchronised backward reduces the sum. Whether a backward synchronises is decided by the forward
      that built its graph (as in DDP).
    * `broadcast_buffers`: in training-mode forwards with grad enabled, rank 0's buffers (e.g. batch
      norm statistics) are broadcast first, so every rank must run those forwards together.
    * With one worker nothing is pushed: the sum over one worker is the gradient itself. A store named
      on a one-rank communicator is then the local one (no store thread runs), and the buckets are not
      registered in it: its :attr:`kv` holds no keys. A store with several workers gets the buckets'
      keys with ``init(..., pushpull_only=True)``: it stores no value for them (``kv.held_bytes()`` is 0;
      ``kv.pull`` of a bucket's key raises KVStoreError), so it keeps no copy of the gradients.
    * Devices: buckets live on the parameters' device. For a model on a CUDA device, the forward's
      tensor arguments are moved there first (as DDP with ``device_ids``; CPU inputs are copied), and
      each bucket is reduced after an event recorded on the backward's stream, on a side stream: the
      backward is never waited for per bucket; when ``backward()`` returns the gradients are complete.

    `kvstore` is a type name for :func:`mpitrain.kvstore.create` (its collectives run on private
    duplicates of `comm`; :meth:`close` releases it) or a store object with
    ``init``/``pushpull``/``wait``/``num_workers`` equal to ``comm.size`` (the caller closes it). The
    parameter server ``dist_sync`` is used that way: its server ranks run ``kv.serve()`` while the
    workers wrap their model with ``comm`` = the workers' communicator.
    ``zero_grad(set_to_none=True)`` (the default) is the cheap way to clear: autograd's fresh gradient
    is copied into its view once, in the hook; with ``set_to_none=False`` the views are zeroed in
    place and autograd accumulates into them.

    `zero` shards state across the ranks (ZeRO, docs/data-parallel.md; :mod:`._zero`): 1 the optimizer
    state, 2 also the gradients, 3 also the parameters. Build the optimizer on :meth:`parameters` as
    usual and pass it once through :meth:`shard_optimizer` (it then steps this rank's pieces of the
    parameters and, below stage 3, allgathers them after each step); clip with :meth:`clip_grad_norm_`.
    At stage 1 ``.grad`` is as above; at stages 2 and 3 the parameters keep ``grad=None`` (each
    backward is reduce-scattered as its buckets complete: only the pieces hold gradients, accumulated
    over backward passes until the optimizer clears them, so :meth:`no_sync` is refused). With `zero`
    the `kvstore` is not used: the buckets are allreduced (1) or reduce-scattered (2, 3) on ZeRO's own
    communicator (a store has no reduce-scatter, and its thread and communicators would be idle). At
    stage 3 a bucket's parameters are whole only from the forward of the first module holding them to
    that of the last, and again in backward (gathered, the next bucket prefetched, released when its
    gradients are reduced): every rank must run the same modules in the same order, and a rank without
    samples must still run forward and backward.
    """

    def __init__(self, module: nn.Module, kvstore: str | KVStore = "dist_sync_mpi", bucket_mb: float = 25.0,
                 comm: Communicator | None = None, *, first_bucket_mb: float = 1.0,
                 broadcast_buffers: bool = True, overlap: bool = True, name: str = "dp", zero: int = 0) -> None:
        super().__init__()
        comm = comm or world()
        _check_args(module, kvstore, bucket_mb, first_bucket_mb, comm)
        check_stage(zero)
        self.module, self.comm, self.broadcast_buffers = module, comm, broadcast_buffers
        self.device = model_device(module)  # batches go here; buckets live on the parameters' devices
        self._moves_inputs = self.device != CPU
        params = [p for p in _unique(module.parameters()) if p.requires_grad]
        kv_name = kvstore if isinstance(kvstore, str) else type(kvstore).__name__
        named = module_tensors(module)
        check_same_everywhere(comm, "DataParallel: settings and parameters", [
            ("settings", kv_name, float(bucket_mb), float(first_bucket_mb), bool(broadcast_buffers), overlap,
             name, zero),
            *((n, tuple(t.shape), str(t.dtype)) for n, t in named)])
        broadcast_tensors([t for _, t in named], comm, 0)
        del named  # detached aliases: they would keep the parameters' memory alive once ZeRO moves them
        self.overlap = bool(overlap)  # push buckets during backward (True) or all when it ends
        self.stage = zero
        # ZeRO reduces on its own communicator (a store has no reduce-scatter); from stage 2 on there
        # are no whole gradient buckets either
        self._owns_kv = isinstance(kvstore, str) and not zero
        self._kv = _make_kvstore(kvstore, comm) if not zero else None
        workers = self._kv.num_workers if self._kv is not None else comm.size
        # autograd produces the last layers' gradients first; stage 3 keeps each module's parameters
        # in one bucket (its forward gathers them)
        units = module_units(module, params) if zero == 3 else [[p] for p in params[::-1]]
        plan = plan_buckets([(sum(p.numel() * p.element_size() for p in u), f"{u[0].dtype}/{u[0].device}")
                             for u in units], int(bucket_mb * MB), int(first_bucket_mb * MB))
        self.buckets = [Bucket(i, f"{name}.b{i}", [p for j in idx for p in units[j]], allocate=zero < 2)
                        for i, idx in enumerate(plan)]
        self._slot = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        self._keys = [b.key for b in self.buckets]
        self._scale = 1.0 / workers if workers > 1 else None
        # one worker: the sum over workers is the gradient itself, so buckets are not pushed at all
        self._solo = workers == 1
        # One worker pushes nothing: a store of its own over one rank gets no registrations at all.
        # A store the caller passed is registered all the same (it may be theirs to use).
        if self._kv is not None and not (self._owns_kv and comm.size == 1):
            self._register_buckets()
            self._declare_order()
        self.zero = Zero([b.params for b in self.buckets], comm, zero, name=f"{name}.zero") if zero else None
        self._gathers = ModuleGathers(self.zero, module) if self.zero is not None and zero == 3 else None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]
        self._sync_enabled = True   # False inside no_sync()
        self._sync_graph = True     # decided by the forward that built the graph being differentiated
        self._closed = False
        self._reset()

    def _register_buckets(self) -> None:
        """Collective: register the buckets' keys in the store. A KVStore gets them ``pushpull_only``: it
        stores no value for them (the buckets are only ever pushpulled in place), so it holds no copy of
        the gradients and rank 0's buckets are not broadcast; a duck-typed store gets a plain ``init``."""
        from ..kvstore import KVStore

        kv = self.kv
        if isinstance(kv, KVStore):
            kv.init(self._keys, [b.buffer for b in self.buckets], pushpull_only=True)
            return
        for b in self.buckets:
            kv.init(b.key, b.buffer)

    def _declare_order(self) -> None:
        """Collective: tell a store that offers ``declare_order`` (dist_sync_mpi) the bucket order, which
        is the same on every rank and every backward, so it reduces the buckets in that order through its
        gradient reducer with no negotiation. Any other store (the sequenced types, ``dist_sync``, a
        duck-typed object) orders the pushes its own way."""
        declare = getattr(self._kv, "declare_order", None)
        if declare is not None and not self._solo:
            declare(self._keys, [b.buffer for b in self.buckets])

    @property
    def kv(self) -> KVStore:
        """The store the gradient buckets go through (RuntimeError with ``zero``, which has none)."""
        if self._kv is None:
            raise RuntimeError(f"DataParallel(zero={self.stage}) reduces on its own communicator: it has no kvstore")
        return self._kv

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        grad = torch.is_grad_enabled() and not self._closed
        if grad:
            self._sync_graph = self._sync_enabled
        if grad and self.training and self.broadcast_buffers:
            buffers = [b for _, b in self.module.named_buffers()]
            if buffers:
                broadcast_tensors(buffers, self.comm, 0)
        if self._moves_inputs:
            args, kwargs = to_device((args, kwargs), self.device)
        try:
            out = self.module(*args, **kwargs)
        finally:
            if self._gathers is not None:
                self._gathers.end_forward()
        return _watch_outputs(out, self) if grad and self._sync_graph and self.buckets else out

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """With ``zero`` >= 1: make `optimizer`, built on :meth:`parameters` and not stepped yet, step this
        rank's pieces (1-D views of its block of each bucket; each param group keeps its
        hyperparameters and holds the pieces of its parameters, possibly none) and, below stage 3,
        allgather the parameters after every step. Returns the same object. Element-wise optimizers only
        (SGD, Adam, AdamW, ...: :data:`._zero.ELEMENTWISE`): ValueError naming any other (LBFGS,
        Adafactor, ...). Without ``zero`` it returns `optimizer` untouched."""
        return optimizer if self.zero is None else self.zero.shard_optimizer(optimizer)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Collective: scale the averaged gradient as ``torch.nn.utils.clip_grad_norm_`` over the whole
        model does in one process (with ``zero``: the norm summed over the ranks' pieces, the pieces
        scaled); returns the norm. Call it after backward, before the step."""
        if self.zero is not None:
            return self.zero.clip_grad_norm_(max_norm)
        return float(self._clip(max_norm))

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Without ``zero``: clip as :meth:`clip_grad_norm_` and return the norm unread (a tensor on the
        gradients' device: no wait for it)."""
        return torch.nn.utils.clip_grad_norm_([p for b in self.buckets for p in b.params], max_norm)

    def held_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds for the trainable parameters, their gradients (buckets, ``.grad``, ZeRO's
        blocks) and `optimizer`'s state, by storage (views count once, a released ZeRO-3 buffer 0): the
        cheap measure of what ``zero`` saves (docs/data-parallel.md)."""
        params: list[torch.Tensor] = [p for b in self.buckets for p in b.params]
        grads: list[torch.Tensor | None] = [b.buffer for b in self.buckets]
        grads += [p.grad for p in params]
        if self.zero is not None:
            params += [s.shard for s in self.zero.shards]
            grads += [s.grad for s in self.zero.shards] + [q.grad for s in self.zero.shards for q in s.piece_params]
        state = [v for st in (optimizer.state.values() if optimizer is not None else [])
                 for v in st.values() if isinstance(v, torch.Tensor)]
        return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(state)}

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards run inside this context build graphs whose backward only accumulates locally.
        Refused with ``zero`` >= 2 (RuntimeError): no rank holds a whole gradient to accumulate into;
        backward passes accumulate into the pieces' gradients, each reduced."""
        if self.stage >= 2:
            raise RuntimeError(f"DataParallel(zero={self.stage}) keeps only this rank's piece of the gradient: "
                               f"no_sync() cannot accumulate whole gradients locally. Call backward several "
                               f"times without it (each is reduced, the pieces' gradients add up until "
                               f"zero_grad), or use zero=1")
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    # -- gradient bookkeeping ---------------------------------------------------------------------------
    def _reset(self) -> None:
        self._next = 0                                   # next bucket to push (buckets go in order)
        self._fired: list[set[int]] = [set() for _ in self.buckets]
        self._absent: list[tuple[Bucket, int]] = []      # no local gradient when their bucket left
        self._queued = False

    _adopt = staticmethod(adopt)  # the buckets' one rule (_buckets.adopt)

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        """Post-accumulate hook: `p.grad` is final for this backward."""
        b, i = self._slot[p]
        if not self._sync_graph:
            self._adopt(p, b.views[i], None)
            return
        self._queue_finalize()
        fired = self._fired[b.index]
        if i in fired or b.index < self._next:
            raise RuntimeError(f"DataParallel: parameter {tuple(p.shape)} of bucket {b.key!r} produced a "
                               f"second gradient in one synchronised backward (reentrant checkpointing of a "
                               f"shared parameter?); use torch.utils.checkpoint(..., use_reentrant=False) "
                               f"or no_sync()")
        # pre-scale by 1/size as the gradient lands, so the sum the store returns is the mean
        if self.stage >= 2:
            assert self.zero is not None
            self.zero.take(p, self._scale)
        else:
            self._adopt(p, b.views[i], self._scale)
        fired.add(i)
        if self.overlap and len(fired) == len(b.params):
            self._push_ready()

    def _push_ready(self) -> None:
        """Push every complete bucket from the next one on, stopping at the first incomplete one."""
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if len(self._fired[b.index]) < len(b.params):
                return
            self._push(b)
            self._next += 1

    def _backward_started(self, grad_outputs: Any) -> None:
        self._queue_finalize()

    def _queue_finalize(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _push(self, b: Bucket) -> None:
        fired = self._fired[b.index]
        if self.zero is not None and self.stage >= 2:  # unused: zeros and "used" 0 in its reduce buffer
            for i, p in enumerate(b.params):
                if i not in fired:
                    self.zero.take(p, self._scale)
            shard = self.zero.shards[b.index]
            self.zero.reduce(shard)
            self.zero.release(shard)  # stage 3: its gradients are all in, autograd reads it no more
            return
        mark = 1.0 if self._scale is None else self._scale
        if len(fired) == len(b.params):
            b.used.fill_(mark)
        else:  # pushed at the end of backward: parameters without a gradient send zeros, "used" 0
            for i, (p, v) in enumerate(zip(b.params, b.views)):
                used = i in fired or self._adopt(p, v, self._scale)
                if not used:
                    v.zero_()
                    self._absent.append((b, i))
                b.used[i] = mark if used else 0.0
        if self.zero is not None:
            self.zero.allreduce(self.zero.shards[b.index], b.buffer)
        elif not self._solo:
            self.kv.pushpull(b.key, b.buffer, priority=-b.index)

    @torch.no_grad()
    def _finalize(self) -> None:
        """End of a synchronised backward: push what is left, in order; wait; attach the gradients of
        parameters that had none here but were used on another rank."""
        try:
            if not self._sync_graph:  # a no_sync forward ran after this graph's: it decides (as DDP)
                return
            for b in self.buckets[self._next:]:
                self._push(b)
            self._next = len(self.buckets)
            if self.zero is not None and self.stage >= 2:
                self.zero.finish_reduce()
                self.zero.release_all()
                return
            if self.zero is not None:
                self.zero.finish_reduce()
            elif not self._solo:
                self.kv.wait(self._keys)
            for b, i in self._absent:
                if b.used[i].item() > 0:
                    b.params[i].grad = b.views[i]  # the average of the other ranks' gradients
            if self.zero is not None:
                self.zero.attach_full_grads()
        finally:
            self._reset()

    def sync_without_backward(self) -> None:
        """Collective: take part in a synchronised backward for which this rank has no samples. Every
        bucket is pushed with zeros (as parameters without a gradient are), so afterwards each ``.grad``
        holds the other ranks' contributions averaged over all ranks, ``grad=None`` where no rank had one.
        Call it after ``zero_grad()`` where the other ranks run their synchronised backward. Refused
        at ``zero=3`` (RuntimeError): the other ranks' forward and backward gather parameters, so every
        rank must run them."""
        if self.stage == 3:
            raise RuntimeError("DataParallel(zero=3): every rank must run forward and backward (they gather the "
                               "parameters bucket by bucket); a rank without samples cannot sit out")
        self._sync_graph = True
        self._finalize()

    def close(self) -> None:
        """Collective: remove the gradient hooks and close the KVStore if this object created it (its
        threads and communicators). The wrapped module keeps working as a plain module. Idempotent."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._closed = True
        if self._gathers is not None:
            self._gathers.remove()
        if self.zero is not None:
            self.zero.close()  # stage 3: the parameters gathered for good
        if self._owns_kv and self._kv is not None:
            self._owns_kv = False
            self._kv.close()


# -- helpers --------------------------------------------------------------------------------------
def _watch_outputs(out: object, dp: DataParallel) -> object:
    """Queue the final callback when backward reaches the outputs (a pre-hook on their autograd
    nodes), so a backward that reaches them always synchronises, even when no local parameter gets
    a gradient. The outputs may be any pytree (tuples, dicts, model-output classes registered with
    torch.utils._pytree); nothing wraps or copies them."""
    seen: set[int] = set()
    for t in tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None and id(t) not in seen:
            seen.add(id(t))
            t.grad_fn.register_prehook(dp._backward_started)
    return out


def _unique(params: Iterator[nn.Parameter]) -> list[nn.Parameter]:
    return list(dict.fromkeys(params))  # tensors hash by identity: tied parameters once, in order


def _check_settings(kvstore: object, bucket_mb: float, first_bucket_mb: float) -> None:
    """The checks that need no communicator (ValueError/TypeError): shared by DataParallel and
    :class:`DataOptions`."""
    if not (is_number(bucket_mb) and is_number(first_bucket_mb) and bucket_mb > 0 and first_bucket_mb > 0):
        raise ValueError(f"bucket_mb and first_bucket_mb must be > 0, got {bucket_mb!r} and {first_bucket_mb!r}")
    if isinstance(kvstore, str):
        if kvstore not in KVSTORE_TYPES:
            raise ValueError(f"unknown kvstore type {kvstore!r}; choose one of {KVSTORE_TYPES}")
        if kvstore == "dist_sync":
            raise ValueError("kvstore 'dist_sync' runs its servers on ranks of their own: create it with "
                             "mpitrain.kvstore.create('dist_sync', num_servers=S), call kv.serve() on the "
                             "ranks where kv.is_server, and pass kvstore=kv with comm= the workers' "
                             "communicator")
    elif not all(hasattr(kvstore, a) for a in ("init", "pushpull", "wait", "num_workers")):
        raise TypeError(f"kvstore must be a type name or a KVStore, got {type(kvstore).__name__}")


def _check_args(module: object, kvstore: str | KVStore, bucket_mb: float, first_bucket_mb: float,
                comm: Communicator) -> None:
    """Local checks, identical on every rank (so every rank raises together, before any message)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
    _check_settings(kvstore, bucket_mb, first_bucket_mb)
    if isinstance(kvstore, str):
        if kvstore == "local" and comm.size > 1:
            raise ValueError(f"kvstore 'local' reduces within one process; this job has {comm.size} ranks: "
                             f"use one of {COLLECTIVE_TYPES}")
    elif kvstore.num_workers != comm.size:
        raise ValueError(f"the kvstore has {kvstore.num_workers} workers but the communicator has "
                         f"{comm.size} ranks; pass comm= the workers' communicator")


def _make_kvstore(kvstore: str | KVStore, comm: Communicator) -> KVStore:
    if not isinstance(kvstore, str):
        return kvstore
    from .. import kvstore as kvmod

    if comm.size == 1:
        # one worker: DataParallel pushes nothing (the sum over one worker is the gradient), so a named
        # store is the local one; dist_sync_mpi's coordinator thread, polling about a thousand times a
        # second, cost 1-2 ms of CPU per step of fit's 10-step epochs and took GIL turns from the thread
        # launching the step's kernels (docs/gpu.md, "fit's cost per epoch")
        return kvmod.create("local")

    # create() splits private communicators: the store's traffic never mixes with ours on comm.
    # depchain's copy of the input exists so a caller may reuse it at once; our buckets are not
    # touched until the final wait, so they are reduced in place (two fewer passes over them).
    # dist_sync_mpi: DataParallel declares its bucket order (declare_order), so the store never
    # negotiates for it; its comm thread starts only if someone pushes other keys through `kv`
    options: dict[str, object] = ({"copy_inputs": False} if kvstore == "depchain" else
                                  {"lazy_thread": True} if kvstore == "dist_sync_mpi" else {})
    return kvmod.create(kvstore, comm=comm, **options)


# -- fit(strategy="data") -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DataOptions(StrategyOptions):
    """Options of ``fit(strategy="data", ...)``: :class:`DataParallel`'s settings (same meaning and
    defaults). `kvstore` is a type name or a store object (see DataParallel)."""

    strategy: ClassVar[str] = "data"
    kvstore: str | KVStore = "dist_sync_mpi"
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    broadcast_buffers: bool = True
    overlap: bool = True
    zero: int = 0

    def __post_init__(self) -> None:
        try:
            _check_settings(self.kvstore, self.bucket_mb, self.first_bucket_mb)
            check_stage(self.zero)
        except (TypeError, ValueError) as e:
            raise FitError(f"strategy 'data': {e}") from None
        for name in ("broadcast_buffers", "overlap"):
            self.require(name, isinstance(getattr(self, name), bool), "True or False")


class DataTrainer(StepTrainer):
    """fit's Trainer for ``strategy="data"``: each rank trains on its rows of the global batch.

    Inputs are a tensor, a tuple (positional arguments) or a dict of tensors (keyword arguments such
    as ``input_ids``, ``attention_mask``): every tensor is sliced along dim 0
    (:func:`~._batching.call_model`).

    A global batch of n rows is split as evenly as possible (rank r gets block r of
    ``split_sizes(n, size)``; a rank may get none), ``micro_batches`` > 1 splits each rank's rows further
    and accumulates under ``no_sync`` (one reduction per step). Each piece's mean loss is weighted by its
    share of the step's samples, so the averaged gradient is that of the mean loss over the step's
    samples: the step equals one process's (BatchNorm statistics are per rank, as in DDP;
    ``nn.SyncBatchNorm``'s are over every rank's rows of each forward, as DDP + SyncBatchNorm:
    :mod:`._sync_bn`, each rank running the same number of forwards, else FitError). With
    ``broadcast_buffers`` rank 0's buffers are broadcast once per step, before its first forward. The
    returned loss is the step's mean, equal on every rank. Inputs and targets are moved to the model's
    device; :meth:`eval_step` returns its outputs on the CPU (where fit's targets are). The step is
    :class:`~.step.StepTrainer`'s; this class supplies its hooks.
    """

    label = "data-parallel"

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 micro_batches: int, opts: DataOptions, loop: LoopSpec = DEFAULT_LOOP,
                 stall: StallPolicy = DEFAULT_POLICY) -> None:
        # built first, so that an optimizer ZeRO cannot shard is refused before any message
        built = optimizer(model.parameters())
        if opts.zero:
            try:
                check_optimizer(built)
            except ValueError as e:
                raise FitError(f"strategy 'data', zero={opts.zero}: {e}") from None
        self.dp = DataParallel(model, opts.kvstore, opts.bucket_mb, comm, first_bucket_mb=opts.first_bucket_mb,
                               broadcast_buffers=opts.broadcast_buffers, overlap=opts.overlap, zero=opts.zero)
        # buffers go once per step (train_shares), so ranks may run different numbers of forwards
        self.dp.broadcast_buffers = False
        # a step's forwards move each rank's buffers its own way after the step's broadcast
        self._buffers = ReplicaBuffers([b for _, b in model.named_buffers()] if opts.broadcast_buffers else [], comm)
        # nn.SyncBatchNorm: statistics over every rank's rows of each forward (restored in trained_model)
        self.sync_norms = sync_batch_norms(model, comm, stall)
        self.loss_fn, self.comm, self.micro_batches, self.loop = loss_fn, comm, micro_batches, loop
        self.label_shift = label_shift(model, loss_fn)
        #: every rank a replica of the whole model (ZeRO's shard group, when sharding, is the world)
        self.place = Place.of(comm.size, comm.rank, replicas=comm.size)
        self.replicas = comm.size  # DataParallel averages over the ranks
        self.device = self.dp.device
        self.optimizer = self.dp.shard_optimizer(built)

    @property
    def closed(self) -> bool:
        return self.dp._closed

    def begin_step(self, batches: Sequence[BatchShare]) -> None:
        """Clear the gradients, broadcast rank 0's buffers once per step; zero=3: check every rank runs
        as many passes."""
        self.optimizer.zero_grad()
        m = self.micro_batches
        self.sync_norms.check_forwards(
            batches, self.comm.size, lambda n, r: min(even_share(n, self.comm.size, r).rows, m),
            f"use batches of at least {self.comm.size * m} samples (drop_last=True for a short last one)")
        if self.dp.training:
            self._buffers.broadcast_before_forwards()
        if self.dp.stage == 3:
            self._check_passes(batches)

    def local_pass(self, batches: Sequence[BatchShare], total: int) -> torch.Tensor:
        """Forward and backward of this rank's rows in `micro_batches` pieces, accumulated under
        ``no_sync`` but the last (one reduction per step); a rank without rows joins the reduction."""
        m = self.micro_batches
        pieces = [pair for b in batches if b.share.rows for pair in split_pairs(b.inputs, b.targets, m)]
        weights = [self.weight(y, batch_size(x)) for x, y in pieces]  # before the move: no device read
        if self.device != CPU:
            pieces = to_device(pieces, self.device)
        local = torch.zeros((), dtype=torch.float64, device=self.device)  # sum of this rank's per-sample losses
        for j, (x, y) in enumerate(pieces):
            # ZeRO >= 2 reduces every backward (into the pieces' gradients): no local accumulation
            local_only = j < len(pieces) - 1 and self.dp.stage < 2
            with self.dp.no_sync() if local_only else contextlib.nullcontext():
                with autocast(self.loop.precision, self.device):
                    out = call_model(self.dp, x)
                    loss = self.loss_fn(out, y)
                local += self.backward(loss, weights[j], total, out)  # weighted by counted targets, or samples
        if not pieces:
            self.dp.sync_without_backward()
        return local

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Gradients are averaged: every rank clips the same global norm (ZeRO: over the pieces). The norm
        is not read back (fit does not use it): on a GPU the step does not wait for it."""
        if self.dp.zero is None:
            self.dp._clip(max_norm)
        else:
            self.dp.clip_grad_norm_(max_norm)

    def _check_passes(self, batches: Sequence[BatchShare]) -> None:
        """zero=3: every rank runs as many forward/backward passes (each gathers every bucket, a
        collective), so each needs at least `micro_batches` rows of every global batch. FitError on
        every rank alike (the batch sizes are known everywhere) before any message."""
        need = self.comm.size * self.micro_batches
        small = [b.n for b in batches if b.n < need]
        if small:
            raise FitError(f"strategy 'data', zero=3: a global batch of {small[0]} samples leaves a rank fewer than "
                           f"micro_batches={self.micro_batches} rows, but every rank must run the same forward and "
                           f"backward passes (each gathers the parameters): use batches of at least {need} "
                           f"samples (drop_last=True for a short last one), or zero <= 2")

    def eval_step(self, inputs: Batch, targets: torch.Tensor) -> Any:
        """The model's outputs for the whole batch on every rank, in the model's own structure (a
        tensor, tuple, ModelOutput: every tensor leaf gathered along dim 0). Every rank evaluates with rank
        0's buffers (:meth:`~._broadcast.ReplicaBuffers.agree`: the step's forwards moved each rank's by its
        own rows), so the outputs are those of the model fit returns."""
        self._buffers.agree()
        return replica_eval(self.dp.module, self.comm, self.place, inputs, targets, self.device, self.loop.precision,
                            self.loss_fn, self.label_shift)

    # -- checkpoints (CheckpointTrainer) ---------------------------------------------------------------
    def layout(self) -> dict[str, object]:
        return {"strategy": "data", "world_size": self.comm.size, "replicated": True, "zero": self.dp.stage,
                NAMED: True}

    def _held(self) -> tuple[list[tuple[torch.Tensor, Held]], dict[int, Held]]:
        """What this rank holds under the user's names: every state_dict tensor whole, except (zero=3)
        a sharded parameter, of which it holds its piece (or nothing); and the optimizer's parameters
        (wholes, or with ``zero`` pieces, each under its parameter's first name)."""
        zero = self.dp.zero
        pieces = zero.piece_ranges() if zero is not None else {}
        tensors: list[tuple[torch.Tensor, Held]] = []
        names: dict[int, Held] = {}
        for name, t in self.dp.module.state_dict(keep_vars=True).items():
            sharded = zero is not None and t in zero.slot
            piece = pieces.get(id(t))
            if piece is not None:
                held = Held(name, piece[1], piece[2], tuple(t.shape))
                names.setdefault(id(piece[0]), held)
                if zero is not None and zero.stage == 3:
                    tensors.append((piece[0], held))
            if not (sharded and zero is not None and zero.stage == 3):
                tensors.append((t, whole(name, t)))
                if zero is None:
                    names.setdefault(id(t), whole(name, t))
        return tensors, names

    def _written_elsewhere(self) -> set[int]:
        """``id`` of the replicated tensors another rank writes. The parameters this rank holds whole are
        equal on every rank (broadcast at construction, then stepped alike from the averaged gradients,
        ZeRO 1/2 gathering the stepped pieces), and so is their optimizer state at zero=0: each is
        written once in total, by the rank :func:`written_elsewhere` assigns it (every rank computes the
        same assignment: the state_dict's names, shapes and dtypes were checked equal at construction).
        A tied parameter goes with all its names. Buffers (BatchNorm statistics differ per rank) and
        ZeRO pieces stay with their rank."""
        zero = self.dp.zero
        params = {id(p) for p in self.dp.module.parameters()}
        return written_elsewhere((t for t in self.dp.module.state_dict(keep_vars=True).values()
                                  if id(t) in params and not (zero is not None and zero.stage == 3 and t in zero.slot)),
                                 self.comm.size, self.comm.rank)

    def state_dict(self) -> dict[str, object]:
        """This rank's shard, by name (:mod:`._reshard`): the buffers it holds, its share of the replicated
        parameters (and at zero=0 of their optimizer state: :meth:`_written_elsewhere`; together the
        ranks' shards hold each once), its pieces of the parameters at zero=3 and its optimizer state's
        pieces with zero. So the checkpoint holds the weights once, and each rank writes ~1/N of them."""
        tensors, names = self._held()
        skip = self._written_elsewhere()
        model, pieces = tensor_entries((t, h) for t, h in tensors if id(t) not in skip)
        return {"model": model, "model_pieces": pieces, "optim": optimizer_entries(self.optimizer, names, skip)}

    def load_state_dict(self, read: Callable[[int], dict[str, object]], saved_layout: Mapping[str, object]) -> None:
        """From a checkpoint by name of any layout (any world size and ZeRO stage, or a pipeline's):
        every tensor and optimizer state this rank holds is read from the saved ranks that cover it (a
        replicated parameter from the one rank that wrote it; a checkpoint in which every rank wrote
        everything loads alike). Same world size and strategy: this rank's own shard first (its
        BatchNorm statistics)."""
        if not saved_layout.get(NAMED):
            raise FitError(f"cannot resume strategy 'data' (layout {self.layout()}) from a checkpoint of layout "
                           f"{dict(saved_layout)}: it predates checkpoints by name")
        saved = int(saved_layout["world_size"])  # type: ignore[call-overload]
        own = self.comm.rank if saved == self.comm.size and saved_layout.get("strategy") == "data" else 0
        tensors, names = self._held()
        load_named(read, [own, *(r for r in range(saved) if r != own)], tensors, self.optimizer, names)

    def trained_model(self) -> nn.Module:
        """The wrapped module (same weights on every rank). Collective: fit calls it last, on every rank,
        so it also closes the KVStore (its comm thread); the trainer takes no more steps after it (with
        ``zero`` its optimizer state is freed first: zero=3 gathers the whole parameters here)."""
        self._buffers.agree()
        self.sync_norms.restore()
        if self.dp.zero is not None:
            self.dp.zero.drop_state(self.optimizer)
        self.dp.close()
        return self.dp.module

def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> DataTrainer:
    """Build the data-parallel Trainer. Refuses with FitError, on every rank before any message,
    options it does not know or cannot use (:class:`DataOptions`) and splits it cannot do
    (`partitions` must be 1, `replicas` None or the world size)."""
    require_whole_model(spec, comm)
    opts = DataOptions.from_spec(spec)
    try:
        _check_args(model, opts.kvstore, opts.bucket_mb, opts.first_bucket_mb, comm)
    except (TypeError, ValueError) as e:
        raise FitError(f"strategy 'data': {e}") from None
    check_sync_norms(model)
    trainer = DataTrainer(model, loss_fn, optimizer, comm, spec.micro_batches, opts, spec.loop, spec.stall)
    trainer.stall = spec.stall  # bounds the wait for each step's weight
    return trainer
