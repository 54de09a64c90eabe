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
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm.base import CommError, Communicator
from ..comm.codecs import Codec, get_codec
from ..comm.ring import DEFAULT_CHUNK_BYTES, ring_allreduce
from .batching import batch_size, check_divisible, shard
from .broadcast import broadcast_parameters, check_same_everywhere

__all__ = ["make_trainer", "PipeSGDTrainer", "CommThread", "LinkEmulation", "PipeSGDError", "OPTIONS"]

#: Options of ``fit(strategy="pipe-sgd", ...)`` and their defaults.
OPTIONS: dict[str, Any] = {"staleness": 2, "warmup_steps": 0, "compression": None, "error_feedback": False,
                           "chunk_bytes": DEFAULT_CHUNK_BYTES, "emulate_link": None, "stall_warning_s": 60.0}


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


@dataclass
class _Handle:
    """One allreduce handed to the communication thread; `done` is set when it finished or failed."""

    buf: torch.Tensor
    iteration: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class CommThread:
    """A thread that averages flat gradient buffers over `comm` in submission order (FIFO).

    `comm` must be used by nobody else while the thread runs (pass a ``split(0)`` duplicate). At most
    `max_pending` buffers wait in the queue. A failure is stored and re-raised as PipeSGDError by
    :meth:`wait` on the compute thread; once failed, every later wait raises too (never a hang).
    """

    def __init__(self, comm: Communicator, codec: Codec, chunk_bytes: int, error_feedback: bool,
                 link: LinkEmulation | None, max_pending: int, warn_s: float) -> None:
        self.comm, self.codec, self.chunk_bytes, self.link, self.warn_s = comm, codec, chunk_bytes, link, warn_s
        self.error_feedback = error_feedback
        self.residual: torch.Tensor | None = None
        self.stats = {"comm_s": 0.0, "codec_s": 0.0, "emulated_s": 0.0, "allreduces": 0.0}
        self._queue: queue.Queue[_Handle | None] = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def submit(self, buf: torch.Tensor, iteration: int) -> _Handle:
        """Queue an in-place average of `buf`; the caller must not touch `buf` until :meth:`wait`.

        Never raises for an earlier failure: errors surface in :meth:`wait` of the failed handle, at the
        same iteration on every rank that failed the same way (raising here would race the thread)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mpitrain-pipesgd-comm", daemon=True)
            self._thread.start()
        handle = _Handle(buf, iteration)
        self._queue.put(handle)
        return handle

    def wait(self, handle: _Handle) -> torch.Tensor:
        """Block until `handle` is reduced; warns every `warn_s` seconds; raises PipeSGDError on failure."""
        waited = 0.0
        while not handle.done.wait(timeout=self.warn_s):
            waited += self.warn_s
            warnings.warn(f"pipe-sgd rank {self.comm.rank}: the allreduce of iteration {handle.iteration} has "
                          f"not finished after {waited:.0f}s", RuntimeWarning, stacklevel=2)
        if handle.error is not None:
            raise PipeSGDError(f"allreduce of iteration {handle.iteration} failed on rank {self.comm.rank}: "
                               f"{handle.error!r}") from handle.error
        return handle.buf

    def close(self) -> None:
        """Finish every queued allreduce, stop the thread and free the communicator (idempotent).
        Every rank must call it (the queued allreduces are collective)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._error is None:
            self.comm.free()

    def _reduce(self, buf: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if self.error_feedback and self.residual is None:
            self.residual = torch.zeros_like(buf)
        ring_allreduce(self.comm, buf, self.codec, op="avg", chunk_bytes=self.chunk_bytes,
                       error_feedback=self.residual, warn_after=self.warn_s, stats=self.stats)
        self.stats["comm_s"] += time.perf_counter() - t0
        if self.link is not None:
            wire = self.codec.payload_numel(buf.numel()) * self.codec.empty_payload(0, buf.dtype).element_size()
            delay = self.link.delay(wire, self.comm.size)
            time.sleep(delay)
            self.stats["emulated_s"] += delay
        self.stats["allreduces"] += 1

    def _run(self) -> None:
        while (handle := self._queue.get()) is not None:
            try:
                if self._error is not None:
                    raise PipeSGDError("an earlier allreduce failed") from self._error
                self._reduce(handle.buf)
            except BaseException as e:  # handed to the compute thread, which re-raises it
                self._error = self._error or e
                handle.error = e
            finally:
                handle.done.set()


class PipeSGDTrainer:
    """fit's Trainer for ``strategy="pipe-sgd"`` (see the module docstring for the exact semantics).

    Every rank trains on its equal slice of the global batch; ``train_step`` returns the global mean
    loss of THIS iteration (one 1-element allreduce on the compute side's communicator). `stats`
    accumulates seconds: compute (forward, backward, update), wait (compute thread blocked on the
    gradient of t-K: the communication that was NOT hidden), and the comm thread's comm/codec/emulated.
    """

    def __init__(self, model: nn.Module, loss_fn: Any, optimizer: Any, comm: Communicator, opts: dict[str, Any],
                 codec: Codec) -> None:
        self.model, self.loss_fn, self.comm = model, loss_fn, comm
        self.K, self.warmup = opts["staleness"], opts["warmup_steps"]
        self.params = [p for p in model.parameters() if p.requires_grad]
        broadcast_parameters(model.state_dict(), comm=comm)  # w[0] is the same on every rank
        self.optimizer = optimizer(model.parameters())
        n = sum(p.numel() for p in self.params)
        self._free = collections.deque(torch.zeros(n, dtype=self.params[0].dtype) for _ in range(self.K))
        self._pending: collections.deque[_Handle] = collections.deque()
        link = opts["emulate_link"]
        self.comm_thread = CommThread(comm.split(0), codec, opts["chunk_bytes"], opts["error_feedback"],
                                      LinkEmulation(*link) if link is not None else None, self.K,
                                      opts["stall_warning_s"])
        self.t = 0
        self.stats = {"compute_s": 0.0, "wait_s": 0.0, "steps": 0.0}
        self._closed = False

    def _bind(self, flat: torch.Tensor) -> None:
        """Make every parameter's .grad a view into `flat` (backward accumulates into it in place)."""
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def _apply(self, handle: _Handle) -> None:
        t0 = time.perf_counter()
        flat = self.comm_thread.wait(handle)
        t1 = time.perf_counter()
        self._bind(flat)
        self.optimizer.step()
        self._free.append(flat)
        self.stats["wait_s"] += t1 - t0
        self.stats["compute_s"] += time.perf_counter() - t1

    def _compute(self, inputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, _Handle]:
        """Gradient of the local slice at the current weights, handed to the comm thread."""
        t0 = time.perf_counter()
        flat = self._free.popleft()
        flat.zero_()
        self._bind(flat)
        x, y = shard(inputs, self.comm.size, self.comm.rank), shard(targets, self.comm.size, self.comm.rank)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.stats["compute_s"] += time.perf_counter() - t0
        return loss.detach(), self.comm_thread.submit(flat, self.t + 1)

    def train_step(self, inputs: Any, targets: torch.Tensor) -> float:
        if self._closed:
            raise RuntimeError("this pipe-sgd trainer is finished (trained_model() closed it)")
        check_divisible(batch_size(targets), self.comm.size, "ranks")
        sync = self.K == 1 or self.t < self.warmup
        if not sync and self._pending and self._pending[0].iteration <= self.t + 1 - self.K:
            self._apply(self._pending.popleft())  # Algorithm 1, lines 3-5: w[t] = w[t-1] - step(g[t-K])
        loss, handle = self._compute(inputs, targets)  # lines 6-10 on the compute thread
        if sync:
            self._apply(handle)
        else:
            self._pending.append(handle)
        self.t += 1
        self.stats["steps"] += 1
        return self.comm.allreduce(loss.reshape(1).to(torch.float64), "avg").item()

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        check_divisible(batch_size(targets), self.comm.size, "ranks")
        x = shard(inputs, self.comm.size, self.comm.rank)
        return self.comm.allgather(self.model(x).contiguous())

    def trained_model(self) -> nn.Module:
        """The model holding w[T] (same on every rank). Collective: completes the allreduces still in
        flight WITHOUT applying them, stops the communication thread; no more steps afterwards."""
        if not self._closed:
            self._closed = True
            for handle in self._pending:
                self.comm_thread.wait(handle)
            self._pending.clear()
            self.comm_thread.close()
            for p in self.params:
                p.grad = None
        return self.model


def _check_options(options: dict[str, Any], comm: Communicator, spec: Any) -> dict[str, Any]:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"strategy 'pipe-sgd' does not take option(s) {unknown}; it takes {list(OPTIONS)}")
    opts = {**OPTIONS, **options}
    if not isinstance(opts["staleness"], int) or opts["staleness"] < 1:
        raise ValueError(f"staleness must be an int >= 1 (1 = synchronous SGD), got {opts['staleness']!r}")
    if not isinstance(opts["warmup_steps"], int) or opts["warmup_steps"] < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {opts['warmup_steps']!r}")
    if not isinstance(opts["chunk_bytes"], int) or opts["chunk_bytes"] < 1:
        raise ValueError(f"chunk_bytes must be a positive int, got {opts['chunk_bytes']!r}")
    link = opts["emulate_link"]
    if link is not None and (len(tuple(link)) != 2 or any(not isinstance(v, (int, float)) or v < 0 for v in link)):
        raise ValueError(f"emulate_link must be None or (alpha_seconds, beta_seconds_per_byte) >= 0, got {link!r}")
    if spec.partitions != 1 or spec.replicas not in (None, comm.size) or spec.micro_batches != 1:
        raise ValueError(f"strategy 'pipe-sgd' replicates the whole model on every rank: it needs partitions=1, "
                         f"replicas None or {comm.size}, micro_batches=1; got partitions={spec.partitions}, "
                         f"replicas={spec.replicas}, micro_batches={spec.micro_batches}")
    return opts


def make_trainer(model: nn.Module, loss_fn: Any, optimizer: Any, comm: Communicator, spec: Any) -> PipeSGDTrainer:
    """Build the Pipe-SGD Trainer from ``spec.options`` (see :data:`OPTIONS`). Refuses bad options with
    ValueError on every rank before any tensor is sent: local checks, then one pickled allgather that
    requires every rank to agree on the options and the parameter shapes."""
    opts = _check_options(dict(spec.options), comm, spec)
    try:
        codec = get_codec(opts["compression"])
    except CommError as e:
        raise ValueError(str(e)) from None
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in params}
    if not params or len(dtypes) != 1 or not params[0].is_floating_point():
        raise ValueError(f"pipe-sgd needs trainable parameters of one floating dtype, got {sorted(map(str, dtypes))}")
    try:
        codec.check_input(params[0].detach()[:0].reshape(-1), "parameters")
    except CommError as e:
        raise ValueError(str(e)) from None
    signature = (sorted((k, repr(v)) for k, v in opts.items() if k != "stall_warning_s"),
                 [(tuple(p.shape), str(p.dtype)) for p in params])
    check_same_everywhere(comm, "pipe-sgd options and parameter shapes", signature)
    return PipeSGDTrainer(model, loss_fn, optimizer, comm, opts, codec)
