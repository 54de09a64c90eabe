"""Where fit's samples come from: what a map-style Dataset is (:func:`is_map_dataset`), the order rule
over one, each rank's reads of it (each collate seeded by its rows' place, :func:`collate_seed`), and the
cross-rank check of iterables of global batches. What a sample or batch is (``split_batch``), and which keys
of a mapping one the model is called with (``used_columns``), live in ``strategies``, below fit and the
planner, which share them; here the columns are dropped from each item before its collate.

The order rule (the only one, so any run can be replayed in one process): epoch ``e`` visits
``torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed + e))`` (``arange``
without shuffle) in global batches of ``batch_size``; the last one is smaller unless ``drop_last``.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, default_collate

from .comm.base import Communicator
from .strategies import ACCEPTED, EVERY_COLUMN, Columns, samples, split_batch
from .strategies.base import Batch, BatchShare, FitError, Share

__all__ = ["ACCEPTED", "split_batch", "check_first_item", "check_not_iterable_dataset", "check_global_loader",
           "split_first_batch",
           "eval_loader",
           "DataPlan", "epoch_order", "global_batches", "batch_count", "is_map_dataset", "read_shares", "read_global",
           "check_same_first_batch", "batch_checksum"]


def is_map_dataset(data: object) -> bool:
    """Whether fit reads `data` as a map-style Dataset (by index, each rank its rows) rather than as an
    iterable of global batches. The rule: a ``torch.utils.data.Dataset`` with a length that is not an
    ``IterableDataset``; or any other object with ``__len__`` and ``__getitem__`` (the map-style protocol,
    e.g. a Hugging Face ``datasets.Dataset``, which subclasses no torch class) that is not a sequence
    (a list, tuple or range of global batches), a mapping or a tensor."""
    if isinstance(data, IterableDataset):
        return False
    if isinstance(data, Dataset):
        return hasattr(data, "__len__")
    if isinstance(data, (Sequence, Mapping, torch.Tensor)):
        return False
    return hasattr(type(data), "__len__") and hasattr(type(data), "__getitem__")


#: What to pass instead of an IterableDataset's samples, quoted in its refusals
ITERABLE_RECIPE = ("pass the map-style Dataset (a Hugging Face datasets.Dataset is one) with batch_size=, or "
                   "DataLoader(data, batch_size=B, collate_fn=...) without batch_size= to fit: an iterable of "
                   "global batches that every rank reads whole and alike")


def check_not_iterable_dataset(data: object) -> None:
    """FitError (local) for an ``IterableDataset`` (torch's, or a Hugging Face ``datasets.IterableDataset``
    from ``to_iterable_dataset()``) given with fit's Dataset keywords: it has no index, so no rank can
    read only its rows, and its elements are samples where fit iterates global batches."""
    if isinstance(data, IterableDataset):
        raise FitError(f"fit: a {type(data).__name__} (an IterableDataset) has no index, so fit cannot give each "
                       f"rank its rows: {ITERABLE_RECIPE}")


def _samplers(data: object) -> list[object]:
    """The samplers a DataLoader `data` draws its rows from (``sampler=``, or a ``batch_sampler=``'s own
    ``sampler``); none for anything else."""
    if not isinstance(data, DataLoader):
        return []
    return [data.sampler, getattr(data.batch_sampler, "sampler", None)]


def check_global_loader(data: object, name: str) -> None:
    """FitError (local, every rank alike) for a DataLoader `data` (fit's argument `name`) over a
    ``DistributedSampler`` of more than one replica, as a DDP script builds one per rank: fit takes global
    batches, the same on every rank, and gives each rank its rows itself, so each rank's shard would be
    split again (and its first batch differ between ranks). The message names the replacements, with the
    global batch size."""
    sampler = next((s for s in _samplers(data) if isinstance(s, DistributedSampler) and s.num_replicas > 1), None)
    if sampler is None:  # num_replicas=1: every row, seeded by its own seed + epoch, alike on every rank
        return
    assert isinstance(data, DataLoader)
    ranks = sampler.num_replicas
    per_rank = data.batch_size if data.batch_size is not None else getattr(data.batch_sampler, "batch_size", None)
    size = "B" if per_rank is None else str(per_rank * ranks)
    why = "" if per_rank is None else f" ({per_rank} per rank x {ranks} ranks)"
    raise FitError(f"fit: {name} is a DataLoader over a DistributedSampler (a different shard on each rank, as "
                   f"DDP reads), but fit takes GLOBAL batches, the same on every rank, and gives each rank its rows "
                   f"itself. Drop the DistributedSampler: pass the Dataset itself with the GLOBAL batch size, "
                   f"fit(model, dataset, ..., batch_size={size}{why}, shuffle=True, seed=0) (each rank then reads "
                   f"only its rows), or DataLoader(dataset, batch_size={size}, shuffle=True, "
                   f"generator=torch.Generator().manual_seed(0)) (every rank reads every row)")


def _first_batch_hint(data: object) -> str:
    """What to change when the first batches of the iterable `data` differ between ranks: a DataLoader
    shuffling without ``generator=`` draws its order from torch's global RNG, which the ranks need not
    share (unseeded, or moved apart by random draws of their own: dropout in different pipeline stages)."""
    if any(isinstance(s, RandomSampler) and s.generator is None for s in _samplers(data)):
        return ("The DataLoader shuffles (shuffle=True or a RandomSampler) without generator=, so its order comes "
                "from torch's global RNG, which is not the same on every rank: pass it generator=torch.Generator()"
                ".manual_seed(0), or pass the Dataset with batch_size= (the GLOBAL batch) and shuffle=True, seed=")
    return ("Every rank must yield the same global batches (seed a shuffling DataLoader alike on every rank: "
            "generator=torch.Generator().manual_seed(0)), or pass a map-style Dataset with batch_size=")


def split_first_batch(data: object, batch: Any) -> tuple[Batch, Any]:
    """:func:`split_batch` and the sharding rule (``samples``) on the first batch of the iterable `data`
    (every rank alike). An IterableDataset's elements are usually samples, not global batches (a Hugging
    Face ``to_iterable_dataset()``): its FitError then names :data:`ITERABLE_RECIPE`."""
    try:
        inputs, targets = split_batch(batch)
        samples(inputs, targets)
    except FitError as e:
        if not isinstance(data, IterableDataset):
            raise
        raise FitError(f"{e}. The {type(data).__name__} (an IterableDataset) seems to yield samples, where fit "
                       f"iterates global batches: {ITERABLE_RECIPE}") from None
    return inputs, targets


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
    #: the keys of mapping items the model is called with (fit's ``remove_unused_columns``): the others are
    #: dropped from each item before the collate, which may not take them (a string column)
    columns: Columns = EVERY_COLUMN

    def batches(self, epoch: int) -> list[torch.Tensor]:
        return global_batches(epoch_order(len(self.dataset), self.seed, epoch, self.shuffle), self.batch_size,
                              self.drop_last)

    def count(self) -> int:
        """How many global batches every epoch has (``len(self.batches(e))``, without drawing the order)."""
        return batch_count(len(self.dataset), self.batch_size, self.drop_last)

    def loader(self, index_lists: list[list[int]], epoch: int, keys: list[tuple[int, int]]) -> DataLoader[Any]:
        """A DataLoader over exactly `index_lists` (one batch each, in order); ``keys[i]`` = (the global
        batch's number in the epoch, the position of the list's first row in it) seeds list i's collate
        (:func:`collate_seed`). Its own generator keeps the global torch RNG untouched (dropout streams
        and exact resume depend on it)."""
        batches = [Keyed(rows, collate_seed(self.seed, epoch, b, start)) for rows, (b, start) in zip(index_lists, keys)]
        return DataLoader(KeyedReads(self.dataset), batch_sampler=batches,  # type: ignore[arg-type]
                          num_workers=self.num_workers, pin_memory=self.pin_memory,
                          collate_fn=SeededCollate(self.collate_fn or default_collate, self.columns),
                          generator=torch.Generator().manual_seed(self.seed + epoch))


@contextmanager
def _rngs_restored() -> Iterator[None]:
    """torch's CPU generator and Python's `random` as they were before the block, whatever it draws (a
    collate's masking, a dataset's augmentations): the training's streams (dropout, exact resume) move
    only where the training draws."""
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(state)


def collate_seed(seed: int, epoch: int, batch: int, start: int) -> int:
    """The seed of the collate of the rows from position `start` on of global batch `batch` of `epoch`
    (0-based): a function of fit's `seed` and of where the rows are, so a random collate (masked-LM
    masking) draws the same on any run of the same seed and world size, resumed or not, and differently
    on each rank's rows (each rank holds other positions)."""
    return zlib.crc32(f"collate {seed} {epoch} {batch} {start}".encode())


class Keyed(list[Any]):
    """A list (a batch's indices, then its items) carrying the seed of its collate: the seed travels with
    the indices through the DataLoader's batch sampler, to a worker process too (it pickles)."""

    def __init__(self, values: Iterable[Any], seed: int | None) -> None:
        super().__init__(values)
        self.seed = seed


class KeyedReads:
    """What fit's DataLoader reads: the Dataset's items (by ``__getitems__`` where the dataset has it, as
    a DataLoader would call it), returned as a :class:`Keyed` list holding the seed of their indices."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Keyed:
        many = getattr(self.dataset, "__getitems__", None)
        items = many(list(indices)) if many else [self.dataset[i] for i in indices]
        return Keyed(items, getattr(indices, "seed", None))


@dataclass(frozen=True)
class SeededCollate:
    """`collate` called on the items without the keys `columns` drops (as Hugging Face Trainer's
    ``RemoveColumnsCollator`` does), with torch's CPU generator and Python's `random` seeded by the items'
    key (:func:`collate_seed`) and restored after: a random collate (Hugging Face's
    ``DataCollatorForLanguageModeling``, which masks with the global RNG) is reproducible, independent
    between ranks, and leaves the training's RNG streams (dropout) as a collate drawing nothing would."""

    collate: Callable[[list[Any]], Any]
    columns: Columns = EVERY_COLUMN

    def __call__(self, items: list[Any]) -> Any:
        seed = getattr(items, "seed", None)
        kept = [self.columns(item) for item in items]
        if seed is None:
            return self.collate(kept)
        with _rngs_restored():
            torch.manual_seed(seed)
            random.seed(seed)
            return self.collate(kept)


def eval_loader(dataset: Any, batch_size: int, collate_fn: Callable[[list[Any]], Any] | None,
                seed: int, columns: Columns = EVERY_COLUMN) -> DataLoader[Any]:
    """fit's `eval_data` given as a map-style Dataset: read in order in global batches of `batch_size`,
    each collated whole (without the keys `columns` drops) on every rank with the seed of its batch
    (:class:`SeededCollate`), so every rank holds the same global batch even with a random collate."""
    n = len(dataset)
    # "epoch" -1: evaluation's own seeds, apart from every training epoch's
    batches = [Keyed(range(i, min(i + batch_size, n)), collate_seed(seed, -1, i // batch_size, 0))
               for i in range(0, n, batch_size)]
    return DataLoader(KeyedReads(dataset), batch_sampler=batches,  # type: ignore[arg-type]
                      collate_fn=SeededCollate(collate_fn or default_collate, columns))


def check_first_item(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None,
                     columns: Columns = EVERY_COLUMN) -> list[str]:
    """The keys `columns` drops from the Dataset's item 0 (:meth:`Columns.check`: FitError when that leaves
    only the labels); FitError (local, before any message) unless that item without them -- with a
    `collate_fn`, the batch it collates from that item alone, since a collator may make the labels
    (Hugging Face's ``DataCollatorForLanguageModeling``) or rename them (``DataCollatorWithPadding``:
    "label") -- follows :func:`split_batch`'s rule. Reads item 0 once on this rank, its RNG draws (and
    the collate's) undone (torch's CPU generator and Python's `random`: random augmentations must not
    shift the training's streams). A dataset read by region (``spatial.data.RegionDataset``) is not read
    here: a rank must never read a whole sample of it (its items are checked as the rank reads its
    blocks)."""
    from .spatial.data import RegionDataset  # on first use: fit's import loads no strategy

    if isinstance(dataset, RegionDataset):
        return []
    with _rngs_restored():
        item = dataset[0]
        dropped = columns.check(item)
        item = columns(item)
        if collate_fn is not None:
            item = collate_fn([item])
    split_batch(item)
    return dropped


def read_shares(plan: DataPlan, epoch: int, start: int, share: Callable[[int], Share]) -> Iterator[BatchShare]:
    """This rank's :class:`BatchShare` of each global batch of `epoch` from batch `start` on. Only this
    rank's rows are read (one DataLoader over them), collated with the seed of their place
    (:func:`collate_seed`); a batch where the rank reads nothing yields a share without data and reads
    nothing."""
    batches = plan.batches(epoch)[start:]
    shares = [share(len(b)) for b in batches]
    mine = [(i, b, s) for i, (b, s) in enumerate(zip(batches, shares), start) if s.rows > 0]
    wanted = [b[s.start:s.stop].tolist() for _, b, s in mine]
    it = iter(plan.loader(wanted, epoch, [(i, s.start) for i, _, s in mine])) if wanted else iter(())
    for b, s in zip(batches, shares):
        if s.rows == 0:
            yield BatchShare(None, None, len(b), s)
            continue
        x, y = split_batch(next(it))
        yield BatchShare(x if s.inputs else None, y if s.targets else None, len(b), s)


def read_global(plan: DataPlan, epoch: int, start: int) -> Iterator[tuple[Batch, torch.Tensor]]:
    """Whole global batches of `epoch` from batch `start` on (for trainers without shares: every rank
    reads every sample, and collates with the same seed)."""
    lists = [b.tolist() for b in plan.batches(epoch)[start:]]
    if lists:
        for batch in plan.loader(lists, epoch, [(i, 0) for i in range(start, start + len(lists))]):
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


def check_same_first_batch(comm: Communicator, batch: object, epoch: int, data: object = None,
                           name: str = "data") -> None:
    """Collective: FitError on every rank unless every rank's `batch` (the first global batch of epoch
    `epoch`, 0-based, of the iterable `data`, fit's argument `name`) has the fingerprint of rank 0's
    (:func:`batch_checksum`);
    the message says what to change in `data` (:func:`_first_batch_hint`). One small pickled allgather per
    epoch; nothing at all in a world of one rank."""
    if comm.size == 1:
        return
    sums = comm.allgather_object(batch_checksum(batch))
    bad = [r for r, s in enumerate(sums) if s != sums[0]]
    if bad:
        where = f"epoch {epoch + 1}" if name == "data" else f"{name} (after epoch {epoch + 1})"
        raise FitError(f"the first global batch of {where} differs between ranks: ranks {bad} disagree "
                       f"with rank 0. {_first_batch_hint(data)}")


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
               extra: Sequence[tuple[str, object]], collate_fn: object = None,
               columns: Columns = EVERY_COLUMN) -> list[str]:
    """Local checks of fit's Dataset keywords and of the form of its item 0 (:func:`check_first_item`;
    FitError, the same verdict on every rank); returns the keys `columns` drops from item 0."""
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
    return check_first_item(dataset, collate_fn, columns)
