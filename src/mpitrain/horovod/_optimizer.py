"""DistributedOptimizer: Horovod's optimizer wrapper, reducing gradients in flat buckets during backward.

Gradients live in flat buckets (the planner and buffers of DataParallel: strategies.buckets), filled in
reverse registration order; each ``.grad`` becomes a view of its bucket. A bucket is handed to the
engine (one allreduce_async_) as soon as every parameter in it has produced its gradient for the
``backward_passes_per_step``-th time, while the rest of backward runs; buckets leave strictly in
bucket order, so every rank issues the same operations in the same order whatever order autograd
produces gradients in. ``synchronize()`` (called by ``step()``) sends the buckets still waiting, with
zeros for parameters that got no gradient on this rank, and waits for all of them.

Buckets live on their parameters' device (one bucket per dtype and device). A CUDA bucket follows the
engine's stream rule: it is queued with an event on the backward's current stream and reduced on a
side stream after it, so backward keeps running; after ``synchronize()`` every ``.grad`` is complete.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..strategies import MB, Bucket, plan_buckets
from ._basics import Adasum, Average, rank
from ._compression import Compression, Compressor
from ._engine import Key, Op
from ._handles import submit, synchronize
from ._mpi_ops import allreduce_async_
from ._process_sets import ProcessSet, _resolve, global_process_set

__all__ = ["DistributedOptimizer"]

_STEP_WARNING = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                 "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
                 "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code.")
_ZERO_GRAD_ERROR = ("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                    "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
_TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally.")


def _check_names(named_parameters: Any, param_groups: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Horovod's checks (ValueError on the calling rank, before any message): tuples, unique names,
    every optimized parameter named. Without names, parameters are named by group and position."""
    if named_parameters is None:
        return [(f"allreduce.noname.{i}.{j}", p) for i, g in enumerate(param_groups)
                for j, p in enumerate(g["params"])]
    named = list(named_parameters)
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by "
                         "model.named_parameters().")
    seen: set[str] = set()
    dups = sorted({n for n, _ in named if n in seen or seen.add(n)})  # type: ignore[func-returns-value]
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    named_ids = {id(p) for _, p in named}
    unnamed = [id(p) for g in param_groups for p in g["params"] if id(p) not in named_ids]
    if unnamed:
        raise ValueError("named_parameters was specified, but one or more model parameters were not named. "
                         f"Python object ids: {', '.join(str(i) for i in unnamed)}")
    return named


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed in before the wrapped optimizer's class (see :func:`DistributedOptimizer`)."""

    def __init__(self, params: Any, named_parameters: Any, compression: type[Compressor],
                 backward_passes_per_step: int, op: int, gradient_predivide_factor: float,
                 process_set: ProcessSet, bucket_mb: float, first_bucket_mb: float) -> None:
        super().__init__(params)  # type: ignore[call-arg]  # the wrapped class's __init__(params)
        named = _check_names(named_parameters, self.param_groups)
        names = {id(p): n for n, p in named}
        self._parameter_names = {p: n for n, p in named}  # Horovod's attribute (its tests read it)
        self._compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op, self.gradient_predivide_factor, self.process_set = op, gradient_predivide_factor, process_set
        self._synchronized = False
        self._should_synchronize = True
        self._params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._handles: dict[int, tuple[int, Any, torch.Tensor]] = {}   # bucket index -> (handle, ctx, sent)
        self._hooks: list[Any] = []
        self.buckets: list[Bucket] = []
        if not process_set.included():
            return
        pid, ranks = _resolve(process_set)
        layout = tuple((names.get(id(p), "?"), tuple(p.shape), str(p.dtype)) for p in self._params)
        key: Key = ("DistributedOptimizer", None, (("parameters", layout), ("op", op),
                                                   ("backward_passes_per_step", backward_passes_per_step),
                                                   ("gradient_predivide_factor", gradient_predivide_factor)))
        synchronize(submit(Op("DistributedOptimizer", None, pid, key, None, lambda c, i: None)))
        if len(ranks) == 1:
            return  # as Horovod: nothing to reduce in a set of one
        order = self._params[::-1]  # autograd produces the last layers' gradients first
        plan = plan_buckets([(p.numel() * p.element_size(), f"{p.dtype}/{p.device}") for p in order],
                            int(bucket_mb * MB), int(first_bucket_mb * MB))
        self.buckets = [Bucket(i, f"DistributedOptimizer.bucket{i}", [order[j] for j in idx])
                        for i, idx in enumerate(plan)]
        self._slot: dict[Any, tuple[Bucket, int]] = {p: (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        # what travels: each bucket's gradients, without the "used" slots DataParallel keeps at its tail
        self._grads = [b.buffer.narrow(0, 0, b.buffer.numel() - len(b.params)) for b in self.buckets]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self._params]
        self._reset()

    def _reset(self) -> None:
        self._fires = {p: 0 for p in self._params}
        self._next = 0  # the next bucket to send; buckets leave in index order

    @staticmethod
    def _adopt(p: torch.Tensor, view: torch.Tensor) -> None:
        """Make ``p.grad`` its bucket view (zeros if it has no gradient), copying a fresh gradient in."""
        if p.grad is None:
            view.zero_()
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    @torch.no_grad()
    def _on_grad(self, p: Any) -> None:
        b, i = self._slot[p]
        if self._fires[p] >= self.backward_passes_per_step:
            raise AssertionError(_TOO_MANY_PASSES)
        self._fires[p] += 1
        self._adopt(p, b.views[i])
        if self._fires[p] == self.backward_passes_per_step:
            self._send_ready()

    def _send_ready(self) -> None:
        while self._next < len(self.buckets) and all(self._fires[p] == self.backward_passes_per_step
                                                     for p in self.buckets[self._next].params):
            self._send(self.buckets[self._next])
            self._next += 1

    def _send(self, b: Bucket) -> None:
        for p, v in zip(b.params, b.views):
            self._adopt(p, v)
        pre, post = ((1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor)
                     if self.op == Average else (1.0, 1.0))
        sent, ctx = self._compression.compress(self._grads[b.index])
        handle = allreduce_async_(sent, name=b.key, op=self.op, prescale_factor=pre, postscale_factor=post,
                                  process_set=self.process_set)
        self._handles[b.index] = (handle, ctx, sent)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Send the buckets still waiting (zeros for gradients this rank did not produce) and wait for every
        bucket: afterwards each ``.grad`` holds the reduction over the process set."""
        if not self.buckets:
            self._synchronized = True
            return
        try:
            for b in self.buckets[self._next:]:
                self._send(b)
            self._next = len(self.buckets)
            for index, (handle, ctx, sent) in sorted(self._handles.items()):
                out = synchronize(handle)
                if sent is not self._grads[index]:
                    self._grads[index].copy_(self._compression.decompress(out, ctx))
        finally:
            self._handles.clear()
            self._reset()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this context does not synchronize (use after an explicit ``synchronize()``)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(_STEP_WARNING, stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(_ZERO_GRAD_ERROR)
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: Any) -> None:
        self._handles = {}
        self._synchronized = False
        self._should_synchronize = True
        if self.buckets:
            self._reset()
        super().load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        if self.buckets:
            self._reset()


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802 - Horovod's name
                         named_parameters: Iterable[tuple[str, nn.Parameter]] | None = None,
                         compression: type[Compressor] = Compression.none, backward_passes_per_step: int = 1,
                         op: int = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set, *, bucket_mb: float = 25.0,
                         first_bucket_mb: float = 1.0) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that ``step()`` applies gradients reduced over `process_set` (Average by
    default). Returns an instance of the wrapped optimizer's class (a subclass made on the fly) that shares
    its parameter groups, state and defaults.

    Collective over `process_set`: one negotiation checks that every member wraps the same parameters
    (names, shapes, dtypes) with the same settings. Gradients of `backward_passes_per_step` backward
    passes are summed locally, then reduced. `gradient_predivide_factor` f splits the average into a
    1/f scaling before the sum and f/size after (op=Average only). `groups`/`num_groups` (explicit
    fusion groups) are accepted only at their defaults: bucketing (`bucket_mb`, `first_bucket_mb`, in
    MiB as DDP) decides the fusion. Adasum and sparse gradients are not supported.
    """
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if op == Adasum:
        raise NotImplementedError("Adasum is not supported by mpitrain.horovod; use op=Average")
    if num_groups or groups is not None:
        raise ValueError("mpitrain.horovod fuses gradients by bucket size (bucket_mb=); groups/num_groups are "
                         "not supported")
    if sparse_as_dense:
        raise ValueError("sparse gradients are not supported by mpitrain.horovod")
    rank()  # ValueError before init
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step, op,
                  gradient_predivide_factor, process_set, bucket_mb, first_bucket_mb)
    wrapped.defaults = optimizer.defaults
    wrapped.state = optimizer.state
    return wrapped  # type: ignore[no-any-return]
