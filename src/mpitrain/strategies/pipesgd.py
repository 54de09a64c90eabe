"""Pipe-SGD (Li et al., NeurIPS 2018, Algorithm 1): iterations pipelined with bounded staleness K.

Each rank has a compute thread (the caller of ``train_step``) and a communication thread that runs
the gradient allreduces (:func:`mpitrain.comm.ring.ring_allreduce`, compressed with the chosen codec
at every hop) on a private duplicate of the communicator, in submission order. At iteration t the
compute thread waits for the averaged gradient of iteration t-K, updates the weights with it (no
update for the first K iterations: there is nothing to apply), computes the gradient of iteration t
at the updated weights and hands it to the communication thread. After T iterations the weights are
w[T] of Algorithm 1: the gradients of the last K-1 iterations, still in flight, are NOT applied.

``staleness=1`` is synchronous data parallelism (D-Sync): the gradient of a step is reduced and
applied in that step, so T steps apply T updates and equal ``strategy="data"``. ``warmup_steps``
D-Sync steps run first (the paper's warm-up for non-convex models); pipelining then starts from an
empty pipeline, so its first K steps only compute and send.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from .._utils.flat import views
from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm.base import CommError, Communicator
from ..comm.codecs import Codec, get_codec
from ..comm.place import Place
from ..comm.reducer import Bucket, Handle, ReduceError, ReducePolicy, Reducer
from ..comm.ring import DEFAULT_CHUNK_BYTES
from ..timeline import span
from ._batching import call_model, even_share, label_shift
from ._broadcast import ReplicaBuffers, broadcast_parameters, check_same_everywhere
from ._device import autocast, model_device, to_device
from ._reshard import NAMED, load_replica, replica_entries, tensor_entries, whole
from ._sync_bn import check_sync_norms, sync_batch_norms
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
    is_int,
    is_number,
    require_whole_model,
)
from .step import StepTrainer, replica_eval

__all__ = ["make_trainer", "PipeSGDTrainer", "PipeSGDOptions", "CommThread", "LinkEmulation",
           "PipeSGDError"]


class PipeSGDError(RuntimeError):
    """The communication thread failed; raised on the compute thread with the original as its cause."""


@dataclass(frozen=True)
class LinkEmulation:
    """EMULATION of a slower network: after each real allreduce the communication thread sleeps for
    what a ring allreduce of the wire bytes would cost on a link of latency `alpha` seconds and
    `beta` seconds per byte: ``2 (p-1) alpha + 2 (p-1)/p wire_bytes beta``. The sleep releases the
    GIL, so the compute thread keeps running exactly as it would while a NIC transfers data."""

    alpha: float = 0.0
    beta: float = 0.0

    def delay(self, wire_bytes: int, p: int) -> float:
        return 0.0 if p <= 1 else 2 * (p - 1) * self.alpha + 2 * (p - 1) / p * wire_bytes * self.beta


@dataclass(frozen=True)
class PipeSGDOptions(StrategyOptions):
    """Options of ``fit(strategy="pipe-sgd", ...)``: the staleness bound K (1 = synchronous SGD),
    D-Sync warm-up steps, the gradient codec (a name of :mod:`mpitrain.comm.codecs`, a Codec or None)
    with optional error feedback, the ring's chunk size, and `emulate_link` (None, a LinkEmulation
    or ``(alpha_seconds, beta_seconds_per_byte)``, kept as a LinkEmulation)."""

    strategy: ClassVar[str] = "pipe-sgd"
    staleness: int = 2
    warmup_steps: int = 0
    compression: str | Codec | None = None
    error_feedback: bool = False
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    emulate_link: LinkEmulation | tuple[float, float] | None = None

    def __post_init__(self) -> None:
        self.require("staleness", is_int(self.staleness) and self.staleness >= 1,
                     "an int >= 1 (1 = synchronous SGD)")
        self.require("warmup_steps", is_int(self.warmup_steps) and self.warmup_steps >= 0, "an int >= 0")
        self.require("chunk_bytes", is_int(self.chunk_bytes) and self.chunk_bytes >= 1, "a positive int")
        self.require("error_feedback", isinstance(self.error_feedback, bool), "True or False")
        try:
            get_codec(self.compression)
        except CommError as e:
            raise FitError(f"strategy 'pipe-sgd': {e}") from None
        link = self.emulate_link
        if link is not None and not isinstance(link, LinkEmulation):
            ok = isinstance(link, (tuple, list)) and len(link) == 2 and all(is_number(v) and v >= 0 for v in link)
            self.require("emulate_link", ok, "None or (alpha_seconds, beta_seconds_per_byte), both >= 0")
            self.replace_value("emulate_link", LinkEmulation(float(link[0]), float(link[1])))

    @property
    def codec(self) -> Codec:
        return get_codec(self.compression)

    @property
    def link(self) -> LinkEmulation | None:
        assert self.emulate_link is None or isinstance(self.emulate_link, LinkEmulation)
        return self.emulate_link


@dataclass
class _Handle:
    """One allreduce handed to the communication thread; `done` is set when it finished or failed."""

    buf: torch.Tensor
    iteration: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    inner: Handle | None = None  # the reducer's handle; None: restored from a checkpoint, already done


#: The error-feedback group of every gradient buffer: one residual carries each allreduce's compression
#: error into the next, whichever of the K buffers that is.
_FEEDBACK = "gradient"


class CommThread:
    """A thread that averages flat gradient buffers over `comm` in submission order (FIFO): the gradient
    reducer (:class:`~mpitrain.comm.reducer.Reducer`, one worker thread; policy "ring", or "compressed"
    with the codec and error feedback), whose buckets are the K flat gradient buffers, registered as first
    submitted and then reused round-robin (the order every rank follows).

    `comm` must be used by nobody else while the thread runs (pass a ``split(0)`` duplicate). At most
    `max_pending` buffers are in flight (the trainer holds no more). A failure is stored and re-raised as
    PipeSGDError by :meth:`wait` on the compute thread; once failed, every later wait raises too (never a hang).
    """

    def __init__(self, comm: Communicator, codec: Codec, chunk_bytes: int, error_feedback: bool,
                 link: LinkEmulation | None, max_pending: int, stall: StallPolicy = DEFAULT_POLICY) -> None:
        self.comm, self.codec, self.chunk_bytes, self.link, self.stall = comm, codec, chunk_bytes, link, stall
        self.error_feedback, self.max_pending = error_feedback, max_pending
        self.stats = {"comm_s": 0.0, "codec_s": 0.0, "emulated_s": 0.0, "allreduces": 0.0}
        policy = ReducePolicy("ring" if codec.name is None else "compressed", op="avg", codec=codec,
                              error_feedback=error_feedback and codec.name is not None, chunk_bytes=chunk_bytes)
        self.reducer = Reducer(comm, policy, stall, thread=True, name="pipesgd-comm", stats=self.stats,
                               around=self._span, after_reduce=self._emulate)
        self._buckets: dict[int, Bucket] = {}  # by the buffer's address
        self._iteration: dict[int, int] = {}  # bucket index -> the iteration it carries now
        # error feedback without a codec has nothing to carry (ring_allreduce would keep it zero): a restored
        # residual is only held, for the next checkpoint
        self._lossless_residual: torch.Tensor | None = None

    @property
    def residual(self) -> torch.Tensor | None:
        """The error-feedback residual (None before the first compressed allreduce or without feedback)."""
        if not self.reducer.policy.error_feedback:
            return self._lossless_residual
        return self.reducer.residuals.get(_FEEDBACK)

    @residual.setter
    def residual(self, value: torch.Tensor | None) -> None:
        if self.reducer.policy.error_feedback:
            self.reducer.residuals[_FEEDBACK] = value
        else:
            self._lossless_residual = value

    def submit(self, buf: torch.Tensor, iteration: int) -> _Handle:
        """Queue an in-place average of `buf`; the caller must not touch `buf` until :meth:`wait`.

        Never raises for an earlier failure: errors surface in :meth:`wait` of the failed handle, at the
        same iteration on every rank that failed the same way (raising here would race the thread)."""
        bucket = self._buckets.get(buf.data_ptr())
        if bucket is None:
            bucket = self._buckets[buf.data_ptr()] = self.reducer.register([buf], feedback=_FEEDBACK)
        self._iteration[bucket.index] = iteration
        return _Handle(buf, iteration, inner=self.reducer.submit(bucket))

    def wait(self, handle: _Handle) -> torch.Tensor:
        """Block until `handle` is reduced; raises PipeSGDError if it failed. A wait longer than
        ``stall.warn_after`` seconds prints a line naming the iteration (again every warn_after); after
        ``stall.abort_after`` seconds the job ends (:func:`~mpitrain._utils.stall.wait_until`)."""
        if handle.inner is not None:
            with span("wait allreduce", kind="wait", iteration=handle.iteration):
                try:
                    self.reducer.wait(handle.inner, f"the allreduce of iteration {handle.iteration}")
                except ReduceError as e:
                    handle.error = e.__cause__ or e
                finally:
                    handle.done.set()
        if handle.error is not None:
            raise PipeSGDError(f"allreduce of iteration {handle.iteration} failed on rank {self.comm.rank}: "
                               f"{handle.error!r}") from handle.error
        return handle.buf

    def close(self) -> None:
        """Finish every queued allreduce, stop the thread and free the communicator (idempotent).
        Every rank must call it (the queued allreduces are collective)."""
        self.reducer.close()
        if not self.reducer.failed:
            self.comm.free()

    def _span(self, bucket: Bucket) -> AbstractContextManager[Any]:
        return span("allreduce", iteration=self._iteration.get(bucket.index, -1), elements=bucket.numel)

    def _emulate(self, bucket: Bucket) -> None:
        """After each real allreduce: the emulated link's sleep (GIL released), and the count."""
        if self.link is not None:
            word = self.codec.empty_payload(0, bucket.flat.dtype).element_size()
            wire = self.codec.payload_numel(bucket.numel) * word
            delay = self.link.delay(wire, self.comm.size)
            time.sleep(delay)
            self.stats["emulated_s"] += delay
        self.stats["allreduces"] += 1


class PipeSGDTrainer(StepTrainer):
    """fit's Trainer for ``strategy="pipe-sgd"`` (see the module docstring for the exact semantics).

    Devices: batches are moved to the model's device; a CUDA model's flat gradient buffers live on its
    device and the communication thread averages each through a pinned host mirror (the ring works on
    host memory), after an event recorded where backward produced it (the compute stream is never
    waited for as a whole). :meth:`eval_step` returns its outputs on the CPU.

    Every rank trains on its equal slice of the global batch; ``train_step`` returns the global mean
    loss of THIS iteration (one 1-element allreduce on the compute side's communicator). `stats`
    accumulates seconds: compute (forward, backward, update), wait (compute thread blocked on the
    gradient of t-K: the communication that was NOT hidden), and the comm thread's comm/codec/emulated.
    The step is :class:`~.step.StepTrainer`'s, staleness its hooks: :meth:`begin_step` applies the gradient
    of t-K, :meth:`finish_gradients` hands this one to the communication thread.

    BatchNorm statistics are each rank's own during training and rank 0's on every rank after the last
    step and before evaluation (:class:`~._broadcast.ReplicaBuffers`); ``nn.SyncBatchNorm``'s are over
    every rank's rows of each forward (:mod:`._sync_bn`; each rank must have rows of every batch).
    """

    label = "pipe-sgd"

    def __init__(self, model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 opts: PipeSGDOptions, stall: StallPolicy = DEFAULT_POLICY, loop: LoopSpec = DEFAULT_LOOP) -> None:
        self.model, self.loss_fn, self.comm, self.loop = model, loss_fn, comm, loop
        self.label_shift = label_shift(model, loss_fn)
        #: every rank a replica of the whole model
        self.place = Place.of(comm.size, comm.rank, replicas=comm.size)
        self.replicas = comm.size  # the ring averages over the ranks
        self.K, self.warmup, self.error_feedback = opts.staleness, opts.warmup_steps, opts.error_feedback
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = model_device(model)  # batches go here; the flat gradients live here
        broadcast_parameters(model.state_dict(), comm=comm)  # w[0] is the same on every rank
        # each rank's forwards move its BatchNorm statistics by its own rows: rank 0's after the last step
        self._buffers = ReplicaBuffers([b for _, b in model.named_buffers()], comm)
        # nn.SyncBatchNorm: statistics over every rank's rows of each forward (restored in trained_model)
        self.sync_norms = sync_batch_norms(model, comm, stall)
        self.optimizer = optimizer(model.parameters())
        n = sum(p.numel() for p in self.params)
        self._free = collections.deque(torch.zeros(n, dtype=self.params[0].dtype, device=self.params[0].device)
                                       for _ in range(self.K))
        self._pending: collections.deque[_Handle] = collections.deque()
        #: fp16: the loss scale each pending gradient was made with, by iteration (unscaled by it when applied)
        self._made_with: dict[int, float] = {}
        self._applying: float | None = None  # the scale of the gradient update() applies now
        private = comm.split(0)
        assert private is not None  # every rank passes color 0
        self.comm_thread = CommThread(private, opts.codec, opts.chunk_bytes, opts.error_feedback, opts.link, self.K,
                                      stall)
        self.t = 0
        self._sync = True  # this step applies its own gradient (K=1, warm-up)
        self._flat = self._free[0]  # this step's gradient buffer (begin_step takes a free one)
        self.stats = {"compute_s": 0.0, "wait_s": 0.0, "steps": 0.0}
        self._closed = False

    def _bind(self, flat: torch.Tensor) -> None:
        """Make every parameter's .grad a view into `flat` (backward accumulates into it in place)."""
        for p, view in zip(self.params, self._views(flat)):
            p.grad = view

    @property
    def closed(self) -> bool:
        return self._closed

    def _take(self, handle: _Handle) -> None:
        """Wait for `handle`'s averaged gradient (the same on every rank) and bind it as the parameters'
        gradient; its buffer is free again (nothing takes a buffer before the update reads it)."""
        t0 = time.perf_counter()
        flat = self.comm_thread.wait(handle)
        self.stats["wait_s"] += time.perf_counter() - t0
        self._applying = self._made_with.pop(handle.iteration, None)
        self._bind(flat)
        self._free.append(flat)

    def grads_made_with(self) -> float | None:
        """fp16: the scale of the gradient of t-K being applied (the scale may have changed since)."""
        return self._applying

    def update(self) -> None:
        t0 = time.perf_counter()
        super().update()
        self.stats["compute_s"] += time.perf_counter() - t0

    def begin_step(self, batches: Sequence[BatchShare]) -> None:
        """Algorithm 1, lines 3-5: w[t] = w[t-1] - step(g[t-K]) once the gradient of t-K is due (not during
        the D-Sync warm-up, where each step applies its own); then a fresh gradient buffer, bound."""
        size = self.comm.size
        self.sync_norms.check_forwards(batches, size, lambda n, r: int(even_share(n, size, r).rows > 0),
                                       f"use batches of at least {size} samples (drop_last=True for a short last one)")
        self._sync = self.K == 1 or self.t < self.warmup
        if not self._sync and self._pending and self._pending[0].iteration <= self.t + 1 - self.K:
            self._take(self._pending.popleft())
            self.update()
        self._flat = self._free.popleft()
        self._flat.zero_()
        self._bind(self._flat)

    def local_pass(self, batches: Sequence[BatchShare], total: int) -> torch.Tensor:
        """Lines 6-10 on the compute thread: the gradient of the mean loss over the step's `total` samples
        at the current weights (into the bound buffer); a rank without rows leaves it zero."""
        t0 = time.perf_counter()
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for b in batches:
            if b.share.rows == 0 or b.targets is None:
                continue
            weight = self.weight(b.targets, b.share.rows)  # counted targets, or samples (k target rows each)
            with autocast(self.loop.precision, self.device):
                out = call_model(self.model, b.inputs, self.device)
                loss = self.loss_fn(out, to_device(b.targets, self.device))
            local += self.backward(loss, weight, total, out)
            if self.model.training:
                self._buffers.moved()
        self.stats["compute_s"] += time.perf_counter() - t0
        return local

    def finish_gradients(self) -> bool:
        """Hand the gradient to the communication thread. Synchronous steps (K=1, warm-up) wait for it:
        ready, the step applies it; the others leave it pending for iteration t+K: not ready."""
        handle = self.comm_thread.submit(self._flat, self.t + 1)
        if self.loss_scaler is not None:
            self._made_with[self.t + 1] = self.loss_scaler.scale
        self.t += 1
        self.stats["steps"] += 1
        if self._sync:
            self._take(handle)
            return True
        self._pending.append(handle)
        return False

    def clip_grad_norm_(self, max_norm: float) -> None:
        """The averaged gradient is the same on every rank: each clips it alike."""
        torch.nn.utils.clip_grad_norm_(self.params, max_norm)

    def eval_step(self, inputs: Batch, targets: torch.Tensor) -> Any:
        """The model's outputs for the whole batch on every rank (:func:`~.step.replica_eval`), with rank 0's
        buffers on every rank (:class:`~._broadcast.ReplicaBuffers`): those of the model fit returns."""
        self._buffers.agree()
        return replica_eval(self.model, self.comm, self.place, inputs, targets, self.device, self.loop.precision,
                            loss_fn=self.loss_fn,
                            shift=self.label_shift)

    # -- checkpoints (CheckpointTrainer) ---------------------------------------------------------------
    def layout(self) -> dict[str, object]:
        return {"strategy": "pipe-sgd", "world_size": self.comm.size, "replicated": not self.error_feedback,
                "staleness": self.K, NAMED: True}

    def state_dict(self) -> dict[str, object]:
        """This rank's shard by name: its share of the weights, of their optimizer state and of the averaged
        gradients still to be applied (all equal on every rank: each applies bitwise the same averaged
        gradient; together the shards hold each once, split by bytes; the allreduces are completed here,
        not applied: the algorithm applies them at their iteration), the iteration counter, and its own
        buffers and error-feedback residual; under fp16 the scale each pending gradient was made with."""
        shard, skip = replica_entries(self.model, self.optimizer, self.comm.size, self.comm.rank)
        names = {id(p): k for k, p in self.model.named_parameters()}
        pending = []
        for h in self._pending:
            flat = self.comm_thread.wait(h)
            grads, _ = tensor_entries((g, whole(names[id(p)], p)) for p, g in zip(self.params, self._views(flat))
                                      if id(p) not in skip)
            pending.append({"iteration": h.iteration, "grads": grads})
        return {**shard, "t": self.t, "pending": pending, "residual": self.comm_thread.residual,
                "made_with": dict(self._made_with)}

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each trained parameter's gradient in the flat buffer `flat`."""
        return views(flat, [p.shape for p in self.params])

    def load_state_dict(self, read: Callable[[int], dict[str, object]], saved_layout: Mapping[str, object]) -> None:
        """Same world size: this rank's shard first (its buffers, residual), the weights, optimizer state
        and in-flight gradients from whichever shard holds them. Another world size (no error feedback,
        same staleness): rank 0's first; the in-flight gradients are averages, the same on every rank. A
        checkpoint of the older layout (every rank wrote its whole replica, not by name) loads alike."""
        now = self.layout()
        same = saved_layout.get("world_size") == self.comm.size
        if saved_layout.get("strategy") != "pipe-sgd" or saved_layout.get("staleness") != self.K or \
                (not same and not saved_layout.get("replicated")):
            raise FitError(f"cannot resume strategy 'pipe-sgd' (layout {now}) from a checkpoint of layout "
                           f"{dict(saved_layout)}: the staleness must match, and a world-size change needs "
                           f"error_feedback=False (its residuals are per rank)")
        first = self.comm.rank if same else 0
        state: dict[str, Any] = read(first)
        self.t = int(state["t"])
        made_with = state.get("made_with", {})  # fp16's scale per pending gradient (none in older checkpoints)
        self._made_with = {int(k): float(v) for k, v in made_with.items()}
        flats = [self._free.popleft() for _ in state["pending"]]
        if saved_layout.get(NAMED):
            self._load_named(read, int(saved_layout["world_size"]), first, flats)  # type: ignore[call-overload]
        else:  # older: every shard a whole replica, the optimizer's own state_dict, whole flat gradients
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            for flat, (_, grad) in zip(flats, state["pending"]):
                flat.copy_(grad)
        for flat, entry in zip(flats, state["pending"]):
            handle = _Handle(flat, int(entry["iteration"] if isinstance(entry, dict) else entry[0]))
            handle.done.set()
            self._pending.append(handle)
        residual = state["residual"]
        self.comm_thread.residual = residual.clone() if same and isinstance(residual, torch.Tensor) else None

    def _load_named(self, read: Callable[[int], dict[str, object]], world: int, first: int,
                    flats: list[torch.Tensor]) -> None:
        """Weights, optimizer state and the in-flight gradients into `flats`, from the shards by name (saved
        rank `first` first): one pass over the shards, the j-th gradient read under ``pending/j/<name>``
        (no state_dict name holds a "/")."""
        names = {id(p): k for k, p in self.model.named_parameters()}

        def shard(r: int) -> dict[str, Any]:
            s: dict[str, Any] = read(r)
            grads = {f"pending/{j}/{k}": g for j, e in enumerate(s["pending"]) for k, g in e["grads"].items()}
            return {**s, "model": {**s["model"], **grads}}

        extra = [(g, whole(f"pending/{j}/{names[id(p)]}", p))
                 for j, flat in enumerate(flats) for p, g in zip(self.params, self._views(flat))]
        load_replica(self.model, self.optimizer, shard, [first, *(r for r in range(world) if r != first)], extra)

    def trained_model(self) -> nn.Module:
        """The model holding w[T] (same on every rank) and rank 0's buffers (each rank's forwards moved its
        BatchNorm statistics by its own rows; as data's). Collective: completes the allreduces still in
        flight WITHOUT applying them, stops the communication thread, gives the SyncBatchNorm modules their
        own forward back; no more steps afterwards."""
        if not self._closed:
            self._closed = True
            for handle in self._pending:
                self.comm_thread.wait(handle)
            self._pending.clear()
            self.comm_thread.close()
            for p in self.params:
                p.grad = None
            self._buffers.agree()
            self.sync_norms.restore()
        return self.model


def make_trainer(model: nn.Module, loss_fn: LossFn, optimizer: OptimizerFactory, comm: Communicator,
                 spec: FitSpec) -> PipeSGDTrainer:
    """Build the Pipe-SGD Trainer from ``spec.options`` (:class:`PipeSGDOptions`) and ``spec.stall``.
    Refuses bad input with FitError on every rank before any tensor is sent: local checks, then one
    pickled allgather that requires every rank to agree on the options and the parameter shapes."""
    require_whole_model(spec, comm)
    if spec.micro_batches != 1:
        raise FitError(f"strategy 'pipe-sgd' takes one micro-batch per step, got micro_batches={spec.micro_batches}")
    opts = PipeSGDOptions.from_spec(spec)
    if spec.loop.precision == "fp16" and opts.error_feedback and opts.compression is not None:
        # an overflowed gradient's inf would enter the residual and every later gradient: no step again
        raise FitError("strategy 'pipe-sgd': precision='fp16' does not take error_feedback=True (an overflow's inf "
                       "would stay in the error-feedback residual); use error_feedback=False or precision='bf16'")
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in params}
    if not params or len(dtypes) != 1 or not params[0].is_floating_point():
        raise FitError(f"pipe-sgd needs trainable parameters of one floating dtype, got {sorted(map(str, dtypes))}")
    try:
        opts.codec.check_input(params[0].detach()[:0].reshape(-1), "parameters")
    except CommError as e:
        raise FitError(f"strategy 'pipe-sgd': {e}") from None
    signature = (opts.signature(), [(tuple(p.shape), str(p.dtype)) for p in params])
    check_sync_norms(model)
    check_same_everywhere(comm, "pipe-sgd options and parameter shapes", signature, error=FitError)
    trainer = PipeSGDTrainer(model, loss_fn, optimizer, comm, opts, spec.stall, spec.loop)
    trainer.stall = spec.stall  # bounds the wait for each step's weight
    return trainer
