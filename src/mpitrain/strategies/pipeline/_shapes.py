"""Batches as a pipeline sees them: rows of flat inputs, and the value metas of each input shape.

Every rank computes the shape and dtype of every message (:class:`~._graph.ValueMeta`) from the same
sample, so no shape travels with a message. :class:`Shapes` keeps them per input shape signature
(micro-batch size x lengths): one graph serves every shape, profiled once per signature.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from ...comm.base import Communicator
from ..base import FitError
from ._graph import Traced, ValueMeta, check_shapes, profile
from ._stage import autocast

__all__ = ["Shapes", "SIGNATURES", "rowed", "rows", "slice_rows", "repeat", "tile", "signature", "batch_size"]

#: value metas kept per pipeline: distinct input shape signatures (micro-batch sizes x lengths); the
#: oldest is dropped beyond it (profiled again if it comes back)
SIGNATURES = 64


def rowed(a: Any) -> bool:
    """A tensor with a batch dimension (sliced into rows; other leaves are constants)."""
    return isinstance(a, torch.Tensor) and a.dim() > 0


def rows(args: list[Any], start: int, stop: int) -> list[Any]:
    """Rows start:stop of every flat input with a batch dimension (the others as they are)."""
    return [a[start:stop] if rowed(a) else a for a in args]


def slice_rows(tree: Any, start: int, stop: int) -> Any:
    """Rows start:stop of every tensor of a pytree (targets may be a tensor, tuple or dict)."""
    return pytree.tree_map(lambda t: t[start:stop] if rowed(t) else t, tree)


def repeat(tree: Any, n: int) -> Any:
    """`n` rows made of every tensor's rows repeated in order (the shapes of a batch of `n` rows)."""
    return pytree.tree_map(lambda t: tile(t, (n, *t.shape[1:])) if rowed(t) else t, tree)


def tile(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` made of `t`'s elements repeated cyclically along every dimension: another
    batch's shapes with the sample's values (valid token ids, masks of zeros and ones)."""
    for d, size in enumerate(shape):
        if size != t.shape[d]:
            t = t.index_select(d, torch.arange(size, device=t.device) % max(t.shape[d], 1))
    return t


def signature(flat: list[Any]) -> tuple[Any, ...]:
    """The shapes of a micro-batch's flat inputs (None for a non-tensor): the key of its value metas."""
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else None for a in flat)


def batch_size(flat: list[Any]) -> int:
    """The rows of a batch's flat inputs (its first tensor with a batch dimension); FitError if none."""
    for a in flat:
        if rowed(a):
            return int(a.shape[0])
    raise FitError("the inputs hold no tensor with a batch dimension to split into micro-batches")


class Shapes:
    """Value metas of the captured graph per input shape signature (at most :data:`SIGNATURES` kept).

    `traced`: the captured graph (its inputs' shapes are checked against it); `graph`: the one to
    profile (a meta model's: a meta copy, with no storage, before and after this rank materialises its
    partitions); `sample`: a micro-batch of the set-up sample, whose values stand in for inputs this rank
    does not hold. Profiling runs under autocast to `precision` ("bf16", "fp16"; None: none), so
    messages are received into buffers of the autocast dtype. Not thread-safe; every rank of a
    pipeline asks for the same signatures in the same order."""

    def __init__(self, traced: Traced, graph: Traced, sample: list[Any], on_meta: bool, precision: str | None,
                 device: torch.device) -> None:
        self.traced, self.graph, self.sample = traced, graph, sample
        self.on_meta, self.precision, self.device = on_meta, precision, device
        self._metas: dict[tuple[Any, ...], dict[str, ValueMeta | None]] = {}

    def first(self) -> dict[str, ValueMeta | None]:
        """The sample's value metas, with gradients (which values carry errors back): profiled once."""
        key = signature(self.sample)
        if key not in self._metas:
            self._metas[key] = self.profile(self.sample, grad=True)
        return self._metas[key]

    def profile(self, sample: list[Any], grad: bool, fake: bool = False) -> dict[str, ValueMeta | None]:
        """Value metas of one forward on `sample`; for a meta model on meta copies of the inputs. With
        `fake` (another shape of a graph already profiled) on fake tensors: no compute, no memory;
        a graph with an op that has no fake implementation is run for real."""
        if self.on_meta:
            sample = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in sample]
        with autocast(self.precision, self.device):  # bf16/fp16 messages are received into such buffers
            if fake and not self.on_meta:
                try:
                    return profile(self.graph, sample, grad=grad, fake=True)
                except Exception:  # noqa: BLE001 - any failure of fake propagation: the real forward decides
                    pass
            return profile(self.graph, sample, grad=grad)

    def meta(self, flat: list[Any] | None, n: int,
             trailing: list[tuple[int, ...] | None] | None = None) -> dict[str, ValueMeta | None]:
        """Value metas of a micro-batch of `n` rows: profiled on `flat`'s first rows, or (None: this
        rank has no inputs) on the sample's values tiled to `n` rows and the `trailing` shapes
        (:meth:`trailing`); the same shapes on every rank. A signature the captured graph cannot run
        raises FitError."""
        got = (rows(flat, 0, n) if flat is not None else
               [tile(a, (n, *(shape if shape is not None else a.shape[1:]))) if rowed(a) else a
                for a, shape in zip(self.sample, trailing or [None] * len(self.sample))])
        key = signature(got)
        if key not in self._metas:
            try:
                check_shapes(self.traced, got)
                meta = self.profile(got, grad=False, fake=True)
            except (ValueError, RuntimeError) as e:
                raise FitError(f"the model cannot run on inputs of shapes {list(key)}: {e}") from e
            if len(self._metas) >= SIGNATURES:
                del self._metas[next(iter(self._metas))]
            self._metas[key] = meta
        return self._metas[key]

    def trailing(self, held: list[Any] | None, pipe: Communicator) -> list[tuple[int, ...] | None]:
        """The shape beyond the batch dimension of every flat input of this pass (None: not a tensor
        with a batch dimension), the same on every rank of `pipe`: its rank 0, which holds the inputs
        (`held`; None elsewhere), broadcasts them (one message of a few integers; collective over
        `pipe`) when any input has such dimensions (sequence lengths, image sizes), which may change
        between batches. The caller bounds the wait."""
        dims = [a.dim() - 1 if rowed(a) else None for a in self.sample]
        count = sum(d for d in dims if d is not None)
        source = held if held is not None else self.sample  # the sample: overwritten by the broadcast
        lengths = [int(s) for a, d in zip(source, dims) if d is not None for s in a.shape[1:]]
        if count and pipe.size > 1:
            lengths = pipe.broadcast(torch.tensor(lengths, dtype=torch.int64), root=0).tolist()
        out: list[tuple[int, ...] | None] = []
        for d in dims:
            out.append(None if d is None else tuple(lengths[:d]))
            lengths = lengths[d or 0:]
        return out

    def constants(self) -> list[Any]:
        """The sample's non-tensor inputs (None for each tensor): the inputs of a rank holding none."""
        return [None if isinstance(a, torch.Tensor) else a for a in self.sample]
