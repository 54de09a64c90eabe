"""Where fit's samples come from: the order rule over a map-style Dataset, each rank's reads of it,
and the cross-rank check of iterables of global batches.

The order rule (the only one, so any run can be replayed in one process): epoch ``e`` visits
``torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + e))`` (``arange``
without shuffle) in global batches of ``batch_size``; the last one is smaller unless ``drop_last``.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .comm.base import Communicator
from .strategies import plain_inputs
from .strategies.base import Batch, BatchShare, FitError, Share

__all__ = ["ACCEPTED", "split_batch", "check_first_item",
           "DataPlan", "epoch_order", "global_batches", "batch_count", "is_map_dataset", "read_shares", "read_global",
           "check_same_first_batch", "batch_checksum"]


def is_map_dataset(data: object) -> bool:
    """A map-style ``torch.utils.data.Dataset`` with a length (what fit shards by index)."""
    return isinstance(data, Dataset) and not isinstance(data, IterableDataset) and hasattr(data, "__len__")


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The sample indices epoch `epoch` (0-based) visits, in order."""
    if not shuffle:
        return torch.arange(n)
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def batch_count(n: int, batch_size: int, drop_last: bool) -> int:
    """How many global batches of `batch_size` `n` samples make (the last smaller unless `drop_last`)."""
    return n // batch_size if drop_last else -(-n // batch_size)


def global_batches(order: torch.Tensor, batch_size: int, drop_last: bool) -> list[torch.Tensor]:
    """`order` cut into global batches of `batch_size`; the last smaller unless `drop_last`."""
    count = batch_count(len(order), batch_size, drop_last)
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(count)]


@dataclass(frozen=True)
class DataPlan:
    """fit's reading settings for a map-style Dataset (every rank holds the same)."""

    dataset: Any
    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    num_workers: int
    pin_memory: bool
    #: how a DataLoader joins items into a batch (None: torch's default_collate, which stacks equal
    #: shapes; variable-length items need a padding one, such as Hugging Face's DataCollatorWithPadding)
    collate_fn: Callable[[list[Any]], Any] | None = None

    def batches(self, epoch: int) -> list[torch.Tensor]:
        return global_batches(epoch_order(len(self.dataset), self.seed, epoch, self.shuffle), self.batch_size,
                              self.drop_last)

    def count(self) -> int:
        """How many global batches every epoch has (``len(self.batches(e))``, without drawing the order)."""
        return batch_count(len(self.dataset), self.batch_size, self.drop_last)

    def loader(self, index_lists: list[list[int]], epoch: int) -> DataLoader[Any]:
        """A DataLoader over exactly `index_lists` (one batch each, in order). Its own generator keeps
        the global torch RNG untouched (dropout streams and exact resume depend on it)."""
        return DataLoader(self.dataset, batch_sampler=index_lists, num_workers=self.num_workers,
                          pin_memory=self.pin_memory, collate_fn=self.collate_fn,
                          generator=torch.Generator().manual_seed(self.seed + epoch))


#: What fit takes as one sample (a Dataset's item) or one batch (a collated batch, an iterable's element):
#: the one rule of :func:`split_batch`, quoted in every refusal
ACCEPTED = ("(inputs, target), (input_1, ..., input_k, target), or a mapping holding "
            "\"labels\" (Hugging Face's convention: the model is called with every key, labels included, "
            "and the target is item[\"labels\"])")


def split_batch(batch: Any) -> tuple[Batch, Any]:
    """``(inputs, targets)`` of a Dataset's item or collated batch, or of an iterable's (or eval_data's)
    batch, by the one rule: a tuple/list ``(inputs, target)`` or ``(input_1, ..., input_k, target)``
    (positional inputs), or a mapping holding ``"labels"`` -- then the inputs are the
    whole mapping as a dict (the model computes its own loss from the labels, e.g. ``loss_fn =
    lambda out, y: out.loss``) and the targets are ``batch["labels"]``, so per-sample slicing, eval
    weighting and the ``(B*T,)``/``(B, T)`` target rule apply to them. Anything else: FitError naming
    what is accepted (local: every rank holding the same batch refuses alike)."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise FitError(f"fit: a mapping item or batch must hold \"labels\" (its keys: {sorted(map(str, batch))}); "
                           f"fit takes {ACCEPTED}")
        inputs = plain_inputs(batch)  # a BatchEncoding: its dict, so pytree slices its tensors
        return inputs, inputs["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        if len(batch) == 2:
            return plain_inputs(batch[0]), batch[1]
        return tuple(batch[:-1]), batch[-1]
    raise FitError(f"fit: got a {type(batch).__name__}{f' of {len(batch)}' if isinstance(batch, (tuple, list)) else ''}"
                   f" as an item or batch; fit takes {ACCEPTED}")


def check_first_item(dataset: Any) -> None:
    """FitError (local, before any message) unless the Dataset's item 0 follows :func:`split_batch`'s rule.
    Reads item 0 once on this rank, its RNG draws undone (torch's CPU generator and Python's `random`:
    random augmentations must not shift the training's streams). A dataset read by region
    (``spatial.data.RegionDataset``) is not read here: a rank must never read a whole sample of it (its
    items are checked as the rank reads its blocks)."""
    from .spatial.data import RegionDataset  # on first use: fit's import loads no strategy

    if isinstance(dataset, RegionDataset):
        return
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        item = dataset[0]
    random.setstate(state)
    split_batch(item)


def read_shares(plan: DataPlan, epoch: int, start: int, share: Callable[[int], Share]) -> Iterator[BatchShare]:
    """This rank's :class:`BatchShare` of each global batch of `epoch` from batch `start` on. Only this
    rank's rows are read (one DataLoader over them); a batch where the rank reads nothing yields a share
    without data and reads nothing."""
    batches = plan.batches(epoch)[start:]
    shares = [share(len(b)) for b in batches]
    wanted = [b[s.start:s.stop].tolist() for b, s in zip(batches, shares) if s.rows > 0]
    it = iter(plan.loader(wanted, epoch)) if wanted else iter(())
    for b, s in zip(batches, shares):
        if s.rows == 0:
            yield BatchShare(None, None, len(b), s)
            continue
        x, y = split_batch(next(it))
        yield BatchShare(x if s.inputs else None, y if s.targets else None, len(b), s)


def read_global(plan: DataPlan, epoch: int, start: int) -> Iterator[tuple[Batch, torch.Tensor]]:
    """Whole global batches of `epoch` from batch `start` on (for trainers without shares: every rank
    reads every sample)."""
    lists = [b.tolist() for b in plan.batches(epoch)[start:]]
    if lists:
        for batch in plan.loader(lists, epoch):
            yield split_batch(batch)


#: Elements of each tensor that the first-batch check hashes, spread over every row: two different
#: batches (another shuffle, other samples, other augmentations) differ there, and the check costs tens
#: of microseconds on any device (hashing all of a ResNet-50 batch, 38 MiB, cost ~50 ms an epoch).
FINGERPRINT_ELEMENTS = 1 << 14


def _spread(t: torch.Tensor, limit: int = FINGERPRINT_ELEMENTS) -> torch.Tensor:
    """About `limit` elements of `t` (all of them if it has no more), flat: evenly spaced rows (all rows
    up to `limit`) and evenly spaced columns within each, gathered on `t`'s own device."""
    if t.numel() <= limit or t.dim() == 0:
        return t.reshape(-1)
    rows = t.reshape(t.shape[0], -1)
    if rows.shape[0] > limit:
        rows = rows.index_select(0, torch.linspace(0, rows.shape[0] - 1, limit).long().to(t.device))
    cols = torch.linspace(0, rows.shape[1] - 1, max(1, limit // rows.shape[0])).long().to(t.device)
    return rows.index_select(1, cols).reshape(-1)


def batch_checksum(batch: object) -> tuple[int, tuple[tuple[object, ...], ...]]:
    """A fingerprint of `batch`: every tensor's shape and dtype, and the CRC32 of the bytes of
    :data:`FINGERPRINT_ELEMENTS` of its elements spread over all its rows (:func:`_spread`: picked on
    the tensor's device, so a CUDA batch sends only those to the host) and of every other leaf's repr.
    Equal batches give equal fingerprints; batches that differ in rows (order or content) almost surely
    differ in the sampled elements."""
    crc, shapes = 0, []
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor):
            sample = _spread(t.detach()).cpu().contiguous()
            crc = zlib.crc32(sample.view(torch.uint8).numpy().data, crc)  # the bytes as they are: no copy
            shapes.append((tuple(t.shape), str(t.dtype)))
        else:
            crc = zlib.crc32(repr(t).encode(), crc)
    return crc, tuple(shapes)


def check_same_first_batch(comm: Communicator, batch: object, epoch: int) -> None:
    """Collective: FitError on every rank unless every rank's `batch` (the first global batch of epoch
    `epoch`, 0-based) has the fingerprint of rank 0's (:func:`batch_checksum`). One small pickled
    allgather per epoch; nothing at all in a world of one rank."""
    if comm.size == 1:
        return
    sums = comm.allgather_object(batch_checksum(batch))
    bad = [r for r, s in enumerate(sums) if s != sums[0]]
    if bad:
        raise FitError(f"the first global batch of epoch {epoch + 1} differs between ranks: ranks {bad} disagree "
                       f"with rank 0. Every rank must yield the same global batches (seed a shuffling "
                       f"DataLoader alike on every rank), or pass a map-style Dataset with batch_size=")


def take(it: Iterator[Any], k: int) -> list[Any]:
    """Up to `k` next items of `it`."""
    out = []
    for _ in range(k):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def skip(data: Iterable[Any], count: int) -> Iterator[Any]:
    """An iterator over `data` past its first `count` items (read and dropped: iterables cannot seek)."""
    it = iter(data)
    for _ in range(count):
        next(it, None)
    return it


def check_plan(dataset: object, batch_size: int | None, seed: object, num_workers: object,
               extra: Sequence[tuple[str, object]], collate_fn: object = None) -> None:
    """Local checks of fit's Dataset keywords and of the form of its item 0 (:func:`check_first_item`;
    FitError, the same verdict on every rank)."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise FitError(f"fit on a Dataset needs batch_size=, a positive int (the GLOBAL batch), got {batch_size!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise FitError(f"seed must be an int, got {seed!r}")
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise FitError(f"num_workers must be an int >= 0, got {num_workers!r}")
    for name, value in extra:
        if not isinstance(value, bool):
            raise FitError(f"{name} must be True or False, got {value!r}")
    if collate_fn is not None and not callable(collate_fn):
        raise FitError(f"collate_fn must be None or callable (items -> batch), got {collate_fn!r}")
    if len(dataset) == 0:  # type: ignore[arg-type]
        raise FitError("the Dataset is empty")
    check_first_item(dataset)
