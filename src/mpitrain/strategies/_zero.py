"""ZeRO (Rajbhandari et al., SC'20) over one communicator: the optimizer state (stage 1), plus the
gradients (2), plus the parameters (3) sharded across its ranks.

The layout, one rule for every user (DataParallel over the world, the pipeline over the replicas of a
partition): the parameters are grouped into buckets (``_buckets.plan_buckets``), each bucket's
parameters lie back to back in one flat buffer padded with zeros to a multiple of the ranks, and rank r
owns block r (equal blocks, ``split_sizes`` of the padded length). A parameter's *piece* on a rank is
the part of it inside that rank's block (a contiguous element range, possibly empty). The optimizer
steps pieces: one 1-D ``nn.Parameter`` per parameter that has one, a view of the rank's block, placed
in the optimizer's own param groups (:meth:`Zero.shard_optimizer`), so per-group hyperparameters are
kept. Stepping pieces equals stepping whole parameters only for element-wise optimizers
(:data:`ELEMENTWISE`); anything else is refused.

* stage 1: gradients are reduced whole (:meth:`Zero.allreduce`, or the caller's own); each piece's
  ``.grad`` is a view of its parameter's averaged gradient; after the step the blocks are allgathered
  in place.
* stage 2: each bucket's gradients are written, pre-scaled, into a transient buffer that is
  reduce-scattered (:meth:`Zero.take`, :meth:`Zero.reduce`); the rank keeps only its block, accumulated
  over backward passes until the pieces' gradients are cleared. Parameters keep ``grad=None``.
* stage 3: as 2, and a bucket's parameters exist whole only between a gather and a release
  (:meth:`Zero.gather`, :meth:`Zero.release`): their storage is resized to zero in between, so what
  autograd saved comes back with the next gather. :class:`ModuleGathers` drives this from module hooks.

Collectives run in one order on every rank on a private duplicate of the communicator, posted as the
ordered ops of one :class:`~mpitrain.comm.reducer.Reducer` (policy flat, sum: gradients are pre-scaled)
with its one worker thread: stage-1 allreduces, stage-2/3 reduce-scatters, allgathers, in the order the
methods below are called (FIFO), so a gather or a reduce-scatter overlaps the caller's compute. Every
wait is the reducer's (the stall policy's way out; a failure on the worker is a ReduceError).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .._utils.flat import spans, views
from .._utils.malloc import lower_mmap_threshold, release_free_memory
from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm.base import Communicator
from ..comm.reducer import OpHandle, ReducePolicy, Reducer

__all__ = ["Zero", "FlatShard", "Piece", "ModuleGathers", "ELEMENTWISE", "STAGES", "check_stage",
           "check_optimizer", "storage_bytes", "module_units", "release_freed_memory"]

#: ZeRO stages: 0 (off: everything replicated), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters).
STAGES = (0, 1, 2, 3)


#: Optimizers whose update of an element reads only that element's parameter, gradient and state (and
#: scalars), so stepping each rank's pieces equals stepping the whole parameters. Subclasses count.
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop)


def check_stage(zero: object) -> None:
    """ValueError unless `zero` is one of :data:`STAGES`."""
    if isinstance(zero, bool) or zero not in STAGES:
        raise ValueError(f"zero must be one of {STAGES} (0: off, 1: optimizer state, 2: + gradients, "
                         f"3: + parameters), got {zero!r}")


def check_optimizer(optimizer: object) -> None:
    """ValueError naming the class unless `optimizer` can step shards (:data:`ELEMENTWISE`)."""
    if not isinstance(optimizer, ELEMENTWISE):
        raise ValueError(f"ZeRO cannot shard {type(optimizer).__name__}: its step needs whole parameters (LBFGS's "
                         f"closure and line search over all of them, Adafactor's row and column factors, Muon's "
                         f"orthogonalised matrices, SparseAdam's sparse gradients); it shards the element-wise "
                         f"optimizers {[c.__name__ for c in ELEMENTWISE]} (and their subclasses). Use zero=0 "
                         f"for this one")


def module_units(module: nn.Module, params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` grouped by the module holding them (first holder in registration order), one group per
    module and dtype/device, in the order backward produces them (modules and their parameters in
    reverse registration order). Stage 3 plans its buckets over these units, so that a module's
    forward gathers whole buckets of its own instead of one it shares with a neighbour (a Linear's
    bias bucketed with the next layer's weight doubled what was gathered at once)."""
    wanted = {p: None for p in params}
    units: list[list[nn.Parameter]] = []
    for m in module.modules():
        mine = [p for p in m.parameters(recurse=False) if p in wanted]
        for p in mine:
            del wanted[p]
        kinds: dict[str, list[nn.Parameter]] = {}
        for p in mine:
            kinds.setdefault(f"{p.dtype}/{p.device}", []).append(p)
        units += [ps for ps in kinds.values()]
    units += [[p] for p in wanted]  # parameters no submodule holds directly (cannot happen for nn.Module)
    return [u[::-1] for u in units[::-1]]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; a released
    ZeRO-3 buffer counts 0): what a rank holds for them, the cheap proxy of its memory."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


#: From stage 2 on, allocations of this size and more get their own mapping, returned when freed.
MMAP_FROM = 4 << 20


def release_freed_memory(stage: int) -> None:
    """After sharding: give glibc's free memory back (the model's own parameter memory, freed by moving
    the parameters into the flat buffers, would otherwise stay resident and count in every rank's peak)
    and, from stage 2 on, lower the mmap threshold to :data:`MMAP_FROM` (``_utils.malloc``: ZeRO's
    bucket-sized transients — gathered parameters, reduce buffers, autograd's fresh gradients —
    fragmented the heap otherwise, a 268 MB model at 4 ranks peaking at 0.59 (zero=2) and 0.41 (zero=3)
    of one process's params + grads + Adam state instead of 0.50 and 0.33, docs/data-parallel.md)."""
    release_free_memory()
    if stage >= 2:
        lower_mmap_threshold(MMAP_FROM)


@dataclass(frozen=True)
class Piece:
    """Parameter `param` (index in its bucket) has elements ``[start, stop)`` in this rank's block, at
    `offset` in the block."""

    param: int
    start: int
    stop: int
    offset: int


class FlatShard:
    """One bucket: its parameters' storage is one flat buffer (padded to ``size * block`` elements, the
    parameters' ``.data`` become views of it) and this rank owns ``[rank * block, (rank + 1) * block)``.

    `pieces` and `piece_params` (1-D ``nn.Parameter`` views of `shard`, the rank's block) are what the
    optimizer steps. Below stage 3 `shard` is that block of `flat` itself; at stage 3 it is a tensor of
    its own and `flat` holds storage only while gathered. Stage >= 2 keeps `grad`, the rank's block of
    the averaged gradient, and `used`: which parameters some rank produced a gradient for."""

    def __init__(self, index: int, params: Sequence[nn.Parameter], size: int, rank: int, stage: int) -> None:
        self.index, self.params, self.size, self.stage = index, list(params), size, stage
        numels = [p.numel() for p in self.params]
        self.spans = spans(numels)
        self.numel = sum(numels)
        self.block = max(1, -(-self.numel // size))
        self.lo = lo = rank * self.block
        hi = lo + self.block
        p0 = self.params[0]
        self.flat = torch.zeros(self.block * size, dtype=p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, v in zip(self.params, views(self.flat, [p.shape for p in self.params])):
                v.copy_(p)
                p.data = v
        self.pieces = [Piece(i, max(a, lo) - a, min(b, hi) - a, max(a, lo) - lo)
                       for i, (a, b) in enumerate(self.spans) if a < hi and b > lo]
        self.shard = self.flat[lo:hi] if stage < 3 else self.flat[lo:hi].clone()
        self.piece_params = [nn.Parameter(self.shard[c.offset:c.offset + c.stop - c.start]) for c in self.pieces]
        self.grad: torch.Tensor | None = None
        self.used = torch.zeros(len(self.params), dtype=torch.bool)
        self.buffer: torch.Tensor | None = None  # stage >= 2: this backward's gradients, before the reduce
        # stage >= 2: element ranges of each parameter in the reduce buffer, laid out as `size` rows of
        # (block + one "used" flag per parameter): row r is rank r's block of the reduce-scatter
        self.row = self.block + len(self.params)
        self.segments = [_segments(a, b, self.block, self.row) for a, b in self.spans]
        if stage == 3:
            self.release()

    # -- stage 3: whole parameters only while gathered ---------------------------------------------------
    @property
    def gathered(self) -> bool:
        return self.flat.untyped_storage().nbytes() > 0

    def allocate(self) -> None:
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())

    def release(self) -> None:
        self.flat.untyped_storage().resize_(0)

    # -- gradients ----------------------------------------------------------------------------------------
    def take(self, i: int, grad: torch.Tensor, scale: float | None) -> None:
        """Write parameter `i`'s gradient (times `scale`) into this backward's reduce buffer."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.size * self.row, dtype=self.flat.dtype, device=self.flat.device)
        g = grad.reshape(-1)
        for s, t, off in self.segments[i]:
            if scale is None:
                self.buffer[off:off + t - s].copy_(g[s:t])
            else:
                torch.mul(g[s:t], scale, out=self.buffer[off:off + t - s])
        self.buffer.view(self.size, self.row)[:, self.block + i] = 1.0

    def apply(self, reduced: torch.Tensor) -> None:
        """Add this rank's reduced row (gradient block, then "used" counts) to `grad`, restarting from it
        when the optimizer cleared every piece's gradient, and attach the pieces' gradients."""
        part, used = reduced[:self.block], reduced[self.block:] > 0
        if self.grad is None or all(q.grad is None for q in self.piece_params):
            self.grad = part.clone() if self.grad is None else self.grad.copy_(part)
            self.used = used
        else:
            self.grad.add_(part)
            self.used = self.used | used
        for c, q in zip(self.pieces, self.piece_params):
            q.grad = self.grad[c.offset:c.offset + c.stop - c.start] if bool(self.used[c.param]) else None

    def attach_full_grads(self) -> None:
        """Stage 1: each piece's gradient is a view of its parameter's (reduced, whole) gradient."""
        for c, q in zip(self.pieces, self.piece_params):
            g = self.params[c.param].grad
            q.grad = None if g is None else g.reshape(-1)[c.start:c.stop]


def _segments(a: int, b: int, block: int, row: int) -> list[tuple[int, int, int]]:
    """Elements ``[a, b)`` of a flat bucket cut at block boundaries: (parameter-local start, stop, offset
    in the reduce buffer whose rows are `row` long and begin with a `block`-element block)."""
    out = []
    e = a
    while e < b:
        r, col = divmod(e, block)
        stop = min(b, (r + 1) * block)
        out.append((e - a, stop - a, r * row + col))
        e = stop
    return out


class Zero:
    """The shards of `buckets` (lists of parameters, in the order every rank reduces them) over `comm`:
    the replica group of the ranks' :class:`~mpitrain.comm.place.Place` (the world for data parallel,
    a partition's replicas for a pipeline).

    Construction is collective (it splits a private communicator). Every method that communicates is
    collective over `comm` and must be called in the same order on every rank; each posts its
    collectives in that order to the reducer's one worker thread. A wait warns after
    ``stall.warn_after`` seconds naming the bucket and op, and ends the job after ``stall.abort_after``;
    a collective that failed on the worker raises :class:`~mpitrain.comm.reducer.ReduceError`."""

    def __init__(self, buckets: Sequence[Sequence[nn.Parameter]], comm: Communicator, stage: int,
                 stall: StallPolicy = DEFAULT_POLICY, name: str = "zero") -> None:
        check_stage(stage)
        if stage == 0:
            raise ValueError("Zero shards at stage 1, 2 or 3")
        self.comm, self.stage, self.name, self.stall = comm, stage, name, stall
        private = comm.split(0, comm.rank)
        assert private is not None
        self._comm = private  # our collectives never interleave with the caller's on `comm`
        self.shards = [FlatShard(i, ps, comm.size, comm.rank, stage) for i, ps in enumerate(buckets)]
        self.slot = {p: (s, i) for s in self.shards for i, p in enumerate(s.params)}
        self._reducer = Reducer(private, ReducePolicy("flat", op="sum"), stall, thread=True, name=name)
        self._posted: dict[int, list[OpHandle]] = {}  # per bucket: its ops posted, not yet waited, in order
        self._reducing: list[tuple[FlatShard, OpHandle]] = []  # reductions posted, in order
        self._inflight: set[int] = set()  # stage 3: gathers queued, not yet waited for
        self._hooked: list[torch.optim.Optimizer] = []
        self._closed = False
        release_freed_memory(stage)  # the parameters' former storage; stage >= 2: mapped transients

    # -- the optimizer ------------------------------------------------------------------------------------
    def pieces_of(self) -> dict[int, nn.Parameter]:
        """``id(parameter) -> its piece on this rank`` (parameters without one are absent)."""
        return {id(s.params[c.param]): q for s in self.shards for c, q in zip(s.pieces, s.piece_params)}

    def piece_ranges(self) -> dict[int, tuple[nn.Parameter, int, int]]:
        """``id(parameter) -> (its piece on this rank, first element, stop)``: what a checkpoint names."""
        return {id(s.params[c.param]): (q, c.start, c.stop) for s in self.shards
                for c, q in zip(s.pieces, s.piece_params)}

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Make `optimizer` (element-wise, built on the whole parameters) step this rank's pieces: in each
        param group, in place, a parameter becomes its piece or leaves the group (a group may become
        empty); state it already holds (Adagrad's initial sums, or a stepped one's) moves to the pieces,
        sliced. Below stage 3 a step-post hook allgathers the updated blocks; its ``zero_grad`` also
        clears the whole parameters' gradients (which the pieces view) at stage 1, and frees the reduced
        gradient blocks from stage 2 on (``set_to_none``). Returns it. Frozen parameters
        (``requires_grad=False``: a fine-tuned backbone) are not sharded and never get a gradient, so no
        element-wise optimizer changes them: they leave the groups with any state they hold, and stay
        whole on every rank."""
        check_optimizer(optimizer)
        pieces = self.pieces_of()
        ranges = self.piece_ranges()
        for p in list(optimizer.state):
            state = optimizer.state.pop(p)
            if id(p) in ranges:
                piece, a, b = ranges[id(p)]
                optimizer.state[piece] = {k: v.detach().reshape(-1)[a:b].clone()
                                          if isinstance(v, torch.Tensor) and v.dim() and v.shape == p.shape else v
                                          for k, v in state.items()}
        known = {id(p) for p in self.slot}
        for group in optimizer.param_groups:
            stray = [tuple(p.shape) for p in group["params"] if id(p) not in known and p.requires_grad]
            if stray:
                raise ValueError(f"ZeRO: the optimizer holds parameters that are not sharded here (shapes {stray}): "
                                 f"build it on the wrapped model's trainable parameters")
            group["params"][:] = [pieces[id(p)] for p in group["params"] if id(p) in pieces]
        if self.stage < 3:
            optimizer.register_step_post_hook(lambda opt, args, kwargs: self.gather_all())
        clear = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            clear(set_to_none)
            if self.stage == 1:  # the whole gradients the pieces view are cleared with them
                for p in self.slot:
                    if p.grad is not None:
                        p.grad = None if set_to_none else p.grad.zero_()
            elif set_to_none:  # the reduced blocks the pieces viewed are freed until the next reduction
                for s in self.shards:  # (held through the next backward, they added to its peak)
                    if all(q.grad is None for q in s.piece_params):
                        s.grad = None
        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        self._hooked.append(optimizer)
        return optimizer

    def gather_all(self) -> None:
        """Collective: every bucket's blocks allgathered in place (below stage 3, after a step)."""
        for s in self.shards:
            self._post(s, functools.partial(self._reducer.post_allgather, s.shard, s.flat), "allgather")
        for s in self.shards:
            self._wait(s)

    # -- gradients (stage >= 2) -------------------------------------------------------------------------
    def take(self, p: nn.Parameter, scale: float | None) -> bool:
        """Move ``p.grad`` (times `scale`) into its bucket's reduce buffer and drop it (``p.grad = None``);
        False if `p` has no gradient. A bucket's first gradient waits for the reduction in flight: at
        most one bucket-sized buffer is reduced while the next fills (unbounded, a backward that outran
        the communication thread held them all: 610 MiB per rank instead of 336 for a 268 MB model at 4
        ranks, zero=3, ``bench memory --zero``), and the reduction still overlaps the next layer's backward."""
        if p.grad is None:
            return False
        s, i = self.slot[p]
        if s.buffer is None:
            self.finish_reduce()
        s.take(i, p.grad, scale)
        p.grad = None
        return True

    def reduce(self, s: FlatShard) -> None:
        """Post the reduce-scatter (sum) of `s`'s buffer (zeros where no gradient was taken); the buffer
        is released when the collective has run (the reducer lets go of it)."""
        if s.buffer is None:
            s.buffer = torch.zeros(s.size * s.row, dtype=s.flat.dtype, device=s.flat.device)
        rows, s.buffer = s.buffer.view(s.size, s.row), None
        self._reducing.append((s, self._post(s, functools.partial(self._reducer.post_reduce_scatter, rows),
                                             "reduce-scatter")))
        del rows  # the reducer holds the buffer now, and drops it once reduce-scattered

    def allreduce(self, s: FlatShard, buffer: torch.Tensor) -> None:
        """Stage 1: post the allreduce (sum, in place) of `s`'s whole gradients in `buffer`."""
        self._reducing.append((s, self._post(s, functools.partial(self._reducer.post_allreduce, buffer),
                                             "allreduce")))

    def finish_reduce(self) -> None:
        """Wait for the posted reductions; reduce-scattered blocks become the pieces' gradients."""
        reducing, self._reducing = self._reducing, []
        for s, handle in reducing:
            self._wait(s)
            if handle.kind == "reduce_scatter":
                assert handle.result is not None
                s.apply(handle.result)
                handle.result = None

    def drop_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Training is over (``trained_model``): free the optimizer's state, its pieces and the gradient
        blocks, and return the freed memory to the kernel, before stage 3 gathers the whole parameters for
        good (:meth:`close`)."""
        optimizer.state.clear()
        for group in optimizer.param_groups:
            group["params"].clear()
        for s in self.shards:
            s.grad = None
            for q in s.piece_params:
                q.grad = None
        # Why trim: a rank whose pieces fall just under the mmap threshold (MMAP_FROM) got its optimizer
        # state from glibc's heap, which keeps freed memory resident (the launcher's 1 GiB trim threshold),
        # while the gathered buckets below are mapped afresh: that rank's peak was the whole model on top
        # of its freed state. At 4 ranks on 16 x Linear(2048, 2048) only rank 0's pieces (bias + 1047040
        # weight elements: 4188160 bytes < 4 MiB) were so: 0.35-0.36 against 0.32 on ranks 1-3
        # (docs/data-parallel.md, "Memory per rank").
        release_free_memory()

    def attach_full_grads(self) -> None:
        for s in self.shards:
            s.attach_full_grads()

    def square_norm(self, skip: Iterable[int] = ()) -> torch.Tensor:
        """Sum of the squared pieces' gradients over the ranks of `comm` (float64, shape (1,)): the
        squared norm of the whole averaged gradient. `skip`: ids of parameters not to count."""
        skipped = set(skip)
        square = torch.zeros(1, dtype=torch.float64)
        for s in self.shards:
            for c, q in zip(s.pieces, s.piece_params):
                if q.grad is not None and id(s.params[c.param]) not in skipped:
                    square += torch.linalg.vector_norm(q.grad, 2.0, dtype=torch.float64) ** 2
        return self.comm.allreduce(square, "sum")

    def scale_grads(self, coef: float) -> None:
        for s in self.shards:
            for q in s.piece_params:
                if q.grad is not None:
                    q.grad.mul_(coef)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Collective: ``clip_grad_norm_`` of the whole averaged gradient, on the pieces; returns the norm."""
        norm = math.sqrt(float(self.square_norm()[0]))
        self.scale_grads(min(max_norm / (norm + 1e-6), 1.0))
        return norm

    # -- parameters (stage 3) -----------------------------------------------------------------------------
    def gather(self, s: FlatShard) -> None:
        """Post the allgather that makes `s`'s parameters whole (nothing if they are, or it is posted)."""
        if s.gathered:
            return
        s.allocate()
        self._inflight.add(s.index)
        # No version-counter care is needed: a gather's write can count on `flat`'s counter (the staging
        # path's copy, the torch backend's collective; MPI's direct write counts nowhere), but the
        # parameters became views of `flat` through `p.data = view` (FlatShard), which keeps each
        # parameter's own counter, so what autograd saved of them still checks out in backward (a former
        # `_unsafe_preserve_version_counter(flat)` here changed nothing: tests/strategies/test_zero.py,
        # the host-staging test, asserts both counters and one process's result)
        self._post(s, functools.partial(self._reducer.post_allgather, s.shard, s.flat), "gather")

    def ready(self, s: FlatShard) -> None:
        """`s`'s parameters whole on return (waits for its gather)."""
        if not s.gathered:
            self.gather(s)
        if s.index in self._inflight:
            self._wait(s)
            self._inflight.discard(s.index)

    def release(self, s: FlatShard) -> None:
        if self.stage == 3 and s.gathered:
            self.ready(s)  # a prefetch may be in flight: MPI must be done writing first
            s.release()

    def release_all(self) -> None:
        for s in self.shards:
            self.release(s)

    # -- the reducer's ordered ops ------------------------------------------------------------------------
    def _post(self, s: FlatShard, post: Callable[..., OpHandle], what: str) -> OpHandle:
        """Post one op of bucket `s` (`post(what=...)`: a Reducer.post_* method, its tensors bound)."""
        handle = post(what=f"{self.name}.b{s.index} {what} ({s.flat.numel()} elements)")
        self._posted.setdefault(s.index, []).append(handle)
        return handle

    def _wait(self, s: FlatShard) -> None:
        """Every op posted for bucket `s` so far is done (in posting order)."""
        for handle in self._posted.pop(s.index, []):
            self._reducer.wait(handle)

    def close(self) -> None:
        """Stage 3: gather every parameter for good (the model becomes a plain module). Stops the
        communication thread and frees the private communicator. Collective; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.stage == 3:
            for s in self.shards:
                self.ready(s)
                # the block is in `flat` now: its own copy (and the pieces viewing it) go
                s.shard = s.flat[s.lo:s.lo + s.block]
                s.piece_params = [nn.Parameter(s.shard[c.offset:c.offset + c.stop - c.start]) for c in s.pieces]
        self._reducer.close()
        self._comm.free()


class ModuleGathers:
    """Stage 3 driven by the modules: a module's forward first waits for the buckets holding its own
    parameters (gathering them) and queues the gather of the next bucket in the previous forward's
    order (prefetch); when every module holding a bucket's parameters has run, the bucket is released.
    During backward the gradient of a module's outputs gathers its buckets again first (prefetching the
    next in reverse order). `end_forward` releases what the forward left gathered.

    The rule this relies on: every rank runs the same modules in the same order (the gathers are
    collectives), and a parameter is used only inside the forward of a module that holds it
    (tied weights are held by each module using them). A parameter read while released fails loudly
    (its storage is empty), never silently."""

    def __init__(self, zero: Zero, module: nn.Module) -> None:
        self.zero = zero
        self.owners: dict[nn.Module, list[FlatShard]] = {}
        holders: dict[int, set[nn.Module]] = {}
        for m in module.modules():
            mine = {zero.slot[p][0].index: zero.slot[p][0] for p in m.parameters(recurse=False) if p in zero.slot}
            if mine:
                self.owners[m] = list(mine.values())
                for i in mine:
                    holders.setdefault(i, set()).add(m)
        self.holders = holders
        self._left: dict[int, set[nn.Module]] = {}   # this forward: modules of a gathered bucket yet to run
        self._order: list[int] = []                    # buckets in first-use order, this forward
        self._previous: list[int] = []                 # ... and the last complete forward's
        self._handles = [h for m in self.owners for h in (m.register_forward_pre_hook(self._pre_forward),
                                                          m.register_forward_hook(self._post_forward))]

    def _need(self, shards: list[FlatShard], order: list[int]) -> None:
        for s in shards:
            self.zero.gather(s)
        last = max(order.index(s.index) if s.index in order else -1 for s in shards)
        if 0 <= last < len(order) - 1:  # prefetch: the next bucket in this order
            self.zero.gather(self.zero.shards[order[last + 1]])
        for s in shards:
            self.zero.ready(s)

    def _pre_forward(self, m: nn.Module, args: Any) -> None:
        shards = self.owners[m]
        for s in shards:
            if s.index not in self._order:
                self._order.append(s.index)
            if not s.gathered or s.index not in self._left:
                self._left[s.index] = set(self.holders[s.index])
        self._need(shards, self._previous)

    def _post_forward(self, m: nn.Module, args: Any, out: Any) -> None:
        shards = self.owners[m]
        for s in shards:
            left = self._left.get(s.index)
            if left is not None:
                left.discard(m)
                if not left:
                    del self._left[s.index]
                    self.zero.release(s)
        if torch.is_grad_enabled():
            outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outs:
                backward = self._order[::-1]
                torch.autograd.graph.register_multi_grad_hook(
                    outs, lambda grads: self._need(shards, backward), mode="any")

    def end_forward(self) -> None:
        """After the root module's forward: release every bucket, remember the order for prefetching."""
        self._previous, self._order = self._order, []
        self._left.clear()
        self.zero.release_all()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
