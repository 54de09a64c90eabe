"""The cut: capture -> profile -> agree -> bounds -> partitions, one function per step.

Every rank captures the same graph (:func:`capture_model`) on a sample of a few rows and profiles it
(:func:`profile_sample`: the shape and dtype of every value, hence where the graph may be cut). With
``balance="time"`` the graph is first split by parameters and each rank times only its own partitions
(:func:`measure_mine`: no rank runs the whole model, which a meta model could not, and whose
gradients would be one more model's worth of memory), weighing what each partition costs in the
schedule: its nodes scaled to its compiled run (the split backward under zb1p/zbv) and the user's
loss on the partition that holds the output. :func:`agree` is the one communicating step:
one ``allgather_object`` that checks every rank set the pipeline up alike, raises any rank's error on
every rank, and averages the measured times, so that :func:`bounds` (balanced, exact) gives every rank
the same split. A meta model holds exactly its partitions' tensors at each split (:func:`hold`).
Everything wrong is refused before the allgather, on every rank (each has the same information).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..._utils.malloc import lower_mmap_threshold
from ...comm.base import Communicator
from .._device import to_device
from ..base import FitError
from ._graph import (
    Clock,
    Partition,
    Traced,
    TraceFailure,
    ValueMeta,
    capture,
    cut_points,
    measure_loss,
    measure_module,
    measure_plain,
    param_counts,
    reference_seconds,
    split,
    work_clock,
)
from ._layout import Layout
from ._materialize import InitFn, materialize, release
from ._partition import bounds_from_balance
from ._shapes import Shapes, batch_size, rows, slice_rows
from ._stage import autocast

__all__ = ["Cut", "CutSpec", "LossSample", "calibrated", "with_loss", "capture_model", "profile_sample", "agree",
           "bounds", "measure_mine", "hold", "mine", "cut", "OWN_MAPPING_FROM"]

#: The weight size from which a rank's weight-sized blocks get their own mapping: below it, the few
#: blocks the heap cannot reuse (see :mod:`..._utils.malloc`) waste little, and activations that
#: size stay in the heap, reused without page faults
OWN_MAPPING_FROM = 4 << 20


@dataclass(frozen=True)
class LossSample:
    """The user's loss `fn(outputs, targets)` and `targets`: the targets of the profile sample's rows
    (k rows per sample), so that ``balance="time"`` weighs the loss where it runs. Only the ranks that
    hold the model's last partition need one."""

    fn: Callable[[Any, Any], torch.Tensor]
    targets: Any


@dataclass(frozen=True)
class CutSpec:
    """How to cut: `balance` ("time", "params" or node counts per partition), the passes timing a
    partition, a meta model's `seed` and `init_fn`, and `settings`: the arguments every rank must
    have set alike (checked by :func:`agree`). With ``balance="time"``: `loss` (None: not weighed)
    is timed on the partition that holds the model's output, and `split_backward` (the zero-bubble
    schedules) times each partition's backward as its two halves instead of one."""

    balance: Any = "time"
    profile_passes: int = 5
    seed: int = 0
    init_fn: InitFn | None = None
    settings: tuple[Any, ...] = ()
    loss: LossSample | None = None
    split_backward: bool = False


@dataclass(frozen=True)
class Cut:
    """The split of `traced` at node indices `bounds` (``[0, c1, ..., n]``) into `parts` (all the
    model's partitions, in order; a meta model's tensors materialised for this rank's only), `meta`:
    the value metas of the sample (with gradients: which values carry errors back), and the `shapes`
    profiled on the way (their cache passes to the runtime)."""

    traced: Traced
    bounds: list[int]
    parts: list[Partition]
    meta: dict[str, ValueMeta | None]
    shapes: Shapes


def capture_model(model: nn.Module, inputs: Any, per_micro: int) -> Traced:
    """Capture on a sample of a few rows: a micro-batch's (the batch over `per_micro`), two at least
    (a batch dimension of one would be taken for a constant by torch.export). FitError if it cannot."""
    n = batch_size(pytree.tree_leaves(inputs))
    sample = slice_rows(inputs, 0, min(n, max(2, n // per_micro)))
    try:
        return capture(model, sample)
    except TraceFailure as e:
        raise FitError(str(e)) from e


def profile_sample(traced: Traced, flat: list[Any], micro: int, device: torch.device, on_meta: bool,
                   precision: str | None) -> Shapes:
    """The shapes of `traced` on the first `micro` rows of `flat`, moved to `device` (a model on a
    device is profiled there; a meta model's on a meta copy of its graph)."""
    sample = to_device(rows(flat, 0, micro), device)
    graph = dataclasses.replace(traced, gm=copy.deepcopy(traced.gm)) if on_meta else traced
    shapes = Shapes(traced, graph, sample, on_meta, precision, device)
    shapes.first()
    return shapes


def agree(comm: Communicator, key: tuple[Any, ...], costs: Sequence[float | None] | None,
          error: str | None = None) -> list[float] | None:
    """Collective over `comm` (every rank, one ``allgather_object``): FitError on every rank if any
    rank's `key` differs from rank 0's or any rank reports an `error`; else each node's `costs`
    averaged over the ranks that measured it (None: not measured there), the same on every rank;
    None where any rank has no costs."""
    seen = comm.allgather_object((key, None if costs is None else list(costs), error))
    bad = [r for r, (k, _, _) in enumerate(seen) if k != seen[0][0]]  # rank 0's, so every rank names the same
    if bad:
        raise FitError(f"ranks {bad} set up the pipeline with a different model, data or arguments than rank 0")
    for r, (_, _, e) in enumerate(seen):
        if e is not None:
            raise FitError(f"rank {r}: {e}")
    if costs is None or any(c is None for _, c, _ in seen):
        return None
    out = []
    for i in range(len(costs)):
        got = [c[i] for _, c, _ in seen if c is not None and c[i] is not None]
        out.append(sum(got) / len(got) if got else 0.0)
    return out


def bounds(balance: Any, parts: int, costs: Sequence[float], cuts: Sequence[int]) -> list[int]:
    """The split of :func:`._partition.bounds_from_balance` (pure), its ValueError as FitError."""
    try:
        return bounds_from_balance(balance, parts, costs, cuts)
    except ValueError as e:
        raise FitError(str(e)) from e


def mine(layout: Layout, parts: list[Partition]) -> list[Partition]:
    """This rank's partitions of `parts` (its chunks, :attr:`.Layout.mine`). Blocks as large as their
    largest weight get their own mapping from now on (:func:`_map_weight_sized_blocks`)."""
    out = [parts[k] for k in layout.mine]
    _map_weight_sized_blocks(out)
    return out


def hold(model: nn.Module, layout: Layout, traced: Traced, at: list[int], meta: dict[str, ValueMeta | None],
         spec: CutSpec) -> str | None:
    """Make this rank hold exactly its partitions' tensors of the split at `at`: the others go back to
    meta (first, so the peak is the larger of the two holdings, not their union), the missing ones are
    materialised. Returns the error message of a failed initialisation (for :func:`agree`)."""
    keep = {id(t) for part in mine(layout, split(traced, at, meta))
            for t in [*part.module.parameters(), *part.module.buffers()]}
    release(model, keep)
    try:
        materialize(model, keep, spec.seed, spec.init_fn)
    except ValueError as e:
        return str(e)
    return None


def measure_mine(layout: Layout, traced: Traced, at: list[int], shapes: Shapes, passes: int,
                 loss: LossSample | None = None, split_backward: bool = False) -> list[float | None] | None:
    """What each node of this rank's partitions of the split at `at` costs in a step (None for the
    others'): its forward + backward, each partition run alone on the sample's inputs it reads and
    stand-ins for the activations it receives (random floats, zero integers: valid indices). Per-node
    times (:func:`measure_module`) are scaled to add up to the partition's time run as a step runs it
    (:func:`measure_plain`, :func:`calibrated`), with `split_backward` its backward as the zero-bubble
    schedules' two halves (I then W); with `loss`, the loss's forward + backward on the partition that
    holds the model's output is counted on its last node (:func:`with_loss`), so it stays with that
    partition wherever the cut lands. Timed by :func:`._graph.work_clock` (CPU time on the CPU), in units of
    :func:`reference_seconds` timed around the measurement: ranks time different nodes at different
    moments, and a rank slowed by its neighbours meanwhile must not see its nodes as costlier. None
    where a partition cannot run on stand-ins (a received index computed from the data, e.g. a mixture
    of experts' token permutation: zeros leave its inverse partly uninitialised); then every rank keeps
    the split by parameters (:func:`agree`)."""
    meta, device = shapes.first(), shapes.device
    index = {n.name: i for i, n in enumerate(traced.nodes)}
    parts = split(traced, at, meta, device if shapes.on_meta else None)
    clock = work_clock(device)  # CPU time on the CPU: a rank waiting for a core is not doing work
    unit = reference_seconds(passes, clock)
    times: dict[int, float] = {}
    for part in mine(layout, parts):
        k = part.index
        args = ([shapes.sample[i] for i in part.data_inputs]
                + [_stand_in(meta[v], device) for v in part.recv_inputs])
        try:
            with autocast(shapes.precision, device):
                timed = measure_module(part.module, args, passes, clock)
                plain = measure_plain(part.module, args, passes, split_backward, clock)
                extra = _loss_seconds(part, args, loss, traced, passes, clock) if k == len(parts) - 1 else 0.0
        except (IndexError, RuntimeError):
            return None
        mine_times = calibrated({i: s for name, s in timed.items()
                                 if (i := index.get(name)) is not None and at[k] <= i < at[k + 1]}, plain)
        if extra:
            span = range(at[k], at[k + 1])
            mine_times = dict(zip(span, with_loss([mine_times.get(i, 0.0) for i in span], extra)))
        times.update(mine_times)
    unit = min(unit, reference_seconds(passes, clock))
    out: list[float | None] = [None] * len(traced.nodes)
    for i, seconds in times.items():
        out[i] = seconds / unit
    return out


def calibrated(times: dict[int, float], seconds: float) -> dict[int, float]:
    """Per-node `times` of one partition scaled to add up to `seconds`, the partition's time as a step
    runs it (pure). Timing each node costs a roughly fixed overhead per node, so the per-node sums
    overweight a partition of many cheap nodes (GPT-2's embeddings and blocks against its LM head):
    measured at the benchmark's GPT-2, P = 2, the node sums said even where one process ran the second
    partition 12 % longer (docs/pipeline.md, "What balance="time" weighs"). Unchanged where either
    total is zero."""
    total = sum(times.values())
    if total <= 0 or seconds <= 0:
        return dict(times)
    return {i: t * seconds / total for i, t in times.items()}


def with_loss(costs: Sequence[float], loss: float) -> list[float]:
    """`costs` per node with `loss` added to the last node's (pure): the node that produces the model's
    output is always in the last partition, so the loss is weighed there wherever the cut lands."""
    out = [float(c) for c in costs]
    if out:
        out[-1] += loss
    return out


def _loss_seconds(part: Partition, args: list[Any], loss: LossSample | None, traced: Traced,
                  passes: int, clock: Clock) -> float:
    """Seconds of `loss` on the outputs of `part` (the last partition) for `args`, the targets moved to
    the outputs' device as a step moves them; 0 without a loss or where it fails on the sample: the
    loss then goes unweighed, and a loss that cannot run fails at the first step as it would have
    (refusing it here, on this rank alone, would leave the others waiting in :func:`agree`)."""
    if loss is None:
        return 0.0

    def on_outputs(leaves: list[Any]) -> torch.Tensor:
        dev = next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))
        return loss.fn(pytree.tree_unflatten(leaves, traced.out_spec), to_device(loss.targets, dev))

    try:
        return measure_loss(part.module, args, on_outputs, passes, clock)
    except Exception:  # noqa: BLE001 - any error of the user's loss: see above
        return 0.0


def cut(comm: Communicator, layout: Layout, model: nn.Module, shapes: Shapes, spec: CutSpec) -> Cut:
    """Collective over `comm` (every rank of the pipeline's world, with the same arguments): the split
    of `shapes.traced` into ``layout.parts`` partitions. A meta model ends holding exactly this rank's
    partitions' tensors (and nothing else)."""
    traced, n = shapes.traced, layout.parts
    if n > len(traced.nodes):
        raise FitError(f"{n} partitions exceed the {len(traced.nodes)} nodes of the captured graph "
                       f"of {type(model).__name__}; use fewer partitions")
    meta = shapes.first()
    cuts = cut_points(traced, meta)
    if isinstance(spec.balance, str) and len(cuts) + 1 < n:
        raise FitError(f"the graph can only be cut at {len(cuts)} places (where every crossing value "
                       f"is a tensor); use partitions x virtual stages <= {len(cuts) + 1}")
    key = (*spec.settings, [v.name for v in traced.nodes],
           [tuple(a.shape) for a in shapes.sample if hasattr(a, "shape")])
    timed = spec.balance == "time"
    at = bounds("params" if timed else spec.balance, n, param_counts(traced), cuts)
    error = hold(model, layout, traced, at, meta, spec) if shapes.on_meta else None
    measured = (measure_mine(layout, traced, at, shapes, spec.profile_passes, spec.loss, spec.split_backward)
                if timed and error is None else None)
    costs = agree(comm, key, measured, error)
    if costs is not None:
        at = bounds("time", n, costs, cuts)
        if shapes.on_meta:
            agree(comm, key, None, hold(model, layout, traced, at, meta, spec))
    return Cut(traced, at, split(traced, at, meta, shapes.device if shapes.on_meta else None), meta, shapes)


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


def _stand_in(meta: ValueMeta | None, device: torch.device) -> torch.Tensor:
    """A tensor shaped like a received activation, to time a partition alone: random floats (a
    non-leaf when differentiable, so in-place ops on it are allowed, as on a received copy), zeros
    otherwise. The floats come from a generator of their own: torch's global one is the user's (a
    ``DataLoader(shuffle=True)`` without ``generator=`` shuffles with it), and only the ranks that receive
    activations draw stand-ins, so drawing from it would leave the ranks' streams apart after set-up."""
    assert meta is not None  # a boundary only ever carries tensors (cut_points)
    if not meta.dtype.is_floating_point:
        return torch.zeros(meta.shape, dtype=meta.dtype, device=device)
    own = None if device.type == "meta" else torch.Generator(device=device).manual_seed(0)
    x = torch.randn(meta.shape, dtype=meta.dtype, device=device, requires_grad=meta.requires_grad, generator=own)
    return x.clone() if meta.requires_grad else x
