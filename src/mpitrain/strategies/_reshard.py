"""Checkpoint state by name, so that it loads into any layout: another world size, other ZeRO stages,
other partitions, another strategy of the same model.

A rank's trainer shard holds, under the user's ``model.state_dict()`` names:

* ``"model"``: whole tensors (``name -> tensor``), as every strategy writes them;
* ``"model_pieces"``: parts of tensors (ZeRO-3's parameters): ``name -> {"shape", "start", "piece"}``,
  elements ``[start, start + len(piece))`` of the tensor flattened row-major;
* ``"optim"``: the optimizer, ``{"groups": [hyperparameters of each param group], "state": {name ->
  {"shape", "start", "flat": {key: 1-D piece}, "other": {key: value}}}}``: a parameter's (or piece's)
  element-wise state (tensors shaped like it: momentum, Adam's moments) as flat pieces, the rest (the
  step count) as it is.

A loading rank names what it holds (:class:`Held`: a name and an element range, the whole tensor or
its ZeRO piece) and reads saved ranks one at a time (:func:`load_named`), copying every overlap, until
all it holds is covered; a saved tensor seen whole wins over pieces, the first saved rank read wins over
later ones (so a rank reading its own saved shard first keeps its own BatchNorm statistics).

What is equal on every rank by construction (a replicated strategy's whole parameters, and at zero=0
their optimizer state) need be written once in total: :func:`split_by_bytes` gives every rank the same
assignment of such tensors to writers, and a reader gathers them from whichever shard holds them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .base import FitError

__all__ = ["Held", "whole", "tensor_entries", "optimizer_entries", "load_named", "assemble", "split_by_bytes",
           "written_elsewhere", "replica_entries", "load_replica", "NAMED"]

#: The layout key that says a checkpoint's shards hold state by name (this module's format).
NAMED = "named"


@dataclass(frozen=True)
class Held:
    """Elements ``[start, stop)`` (row-major) of the tensor the user's state_dict calls `name`, of
    shape `shape`."""

    name: str
    start: int
    stop: int
    shape: tuple[int, ...]

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.stop == _numel(self.shape)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def whole(name: str, t: torch.Tensor) -> Held:
    return Held(name, 0, t.numel(), tuple(t.shape))


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` detached, copied when it is a view into a larger storage (a parameter inside a flat ZeRO
    buffer): torch.save writes a tensor's whole storage, which would put every rank's share on disk."""
    t = t.detach()
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def tensor_entries(held: Iterable[tuple[torch.Tensor, Held]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(``"model"``, ``"model_pieces"``) of the tensors a rank holds: whole ones by name, pieces with
    their range."""
    model: dict[str, torch.Tensor] = {}
    pieces: dict[str, Any] = {}
    for t, h in held:
        if h.is_whole:
            model[h.name] = _own(t).reshape(h.shape)  # a ZeRO piece may be a whole parameter
        else:
            pieces[h.name] = {"shape": list(h.shape), "start": h.start, "stop": h.stop,
                              "piece": _own(t).reshape(-1)}
    return model, pieces


def split_by_bytes(sizes: Sequence[int], parts: int) -> list[int]:
    """The part in ``range(parts)`` that writes each item of `sizes` (bytes): the largest item first, each
    to the part with the fewest bytes so far (the lowest part on a tie). A pure function of its arguments,
    so every rank computes the same assignment from the same sizes; no part gets more than
    ``sum(sizes) / parts + max(sizes)`` (the part an item joins holds at most the average before it)."""
    owner = [0] * len(sizes)
    loads = [(0, p) for p in range(parts)]  # a heap of (bytes so far, part)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, part = heapq.heappop(loads)
        owner[i] = part
        heapq.heappush(loads, (load + int(sizes[i]), part))
    return owner


def written_elsewhere(replicated: Iterable[torch.Tensor], parts: int, part: int) -> set[int]:
    """``id`` of those of `replicated` (tensors equal on every part, listed in the same order on every
    part; one listed twice, a tied weight, counts once) that :func:`split_by_bytes` gives to a part other
    than `part`: what `part` leaves out of its shard so that the parts together write each once."""
    unique: dict[int, torch.Tensor] = {}
    for t in replicated:
        unique.setdefault(id(t), t)
    owners = split_by_bytes([t.numel() * t.element_size() for t in unique.values()], parts)
    return {key for key, owner in zip(unique, owners) if owner != part}


def replica_entries(module: torch.nn.Module, optimizer: torch.optim.Optimizer, parts: int,
                    part: int) -> tuple[dict[str, Any], set[int]]:
    """The shard by name (``"model"``, ``"model_pieces"``, ``"optim"``) of rank `part` of `parts` ranks that
    each hold a whole replica of `module` with `optimizer` over its parameters, and the ``id`` of the
    tensors another rank writes. The parameters (equal on every rank: the caller's guarantee) and their
    optimizer state are split by :func:`written_elsewhere`; the buffers (BatchNorm statistics, which may
    differ per rank; a few KiB) stay in every rank's shard."""
    named = module.state_dict(keep_vars=True)
    params = {id(p) for p in module.parameters()}
    skip = written_elsewhere((t for t in named.values() if id(t) in params), parts, part)
    model, pieces = tensor_entries((t, whole(k, t)) for k, t in named.items() if id(t) not in skip)
    return {"model": model, "model_pieces": pieces,
            "optim": optimizer_entries(optimizer, _param_names(module), skip)}, skip


def load_replica(module: torch.nn.Module, optimizer: torch.optim.Optimizer, read: Callable[[int], Mapping[str, Any]],
                 ranks: Iterable[int], extra: Iterable[tuple[torch.Tensor, Held]] = ()) -> None:
    """Fill a whole replica of `module` (and `extra` tensors, saved under their names in ``"model"``) and
    `optimizer`'s state from the shards by name ``read(r)``, r in `ranks` (:func:`load_named`)."""
    tensors = [(t, whole(k, t)) for k, t in module.state_dict(keep_vars=True).items()]
    load_named(read, ranks, [*tensors, *extra], optimizer, _param_names(module))


def _param_names(module: torch.nn.Module) -> dict[int, Held]:
    """Each parameter of `module` under its first name (a tied one once), as the optimizer's state is named."""
    return {id(p): whole(k, p) for k, p in module.named_parameters()}


def optimizer_entries(optimizer: torch.optim.Optimizer, names: Mapping[int, Held],
                      skip: Collection[int] = ()) -> dict[str, Any]:
    """``"optim"`` of `optimizer`, whose parameters (wholes or pieces) are named by ``names[id(q)]``;
    a parameter whose ``id`` is in `skip` is left out (another rank writes its state)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    state: dict[str, Any] = {}
    for g in optimizer.param_groups:
        for q in g["params"]:
            st = optimizer.state.get(q)
            if not st or id(q) in skip:
                continue
            h = names[id(q)]
            flat = {k: _own(v).reshape(-1) for k, v in st.items()
                    if isinstance(v, torch.Tensor) and v.shape == q.shape and v.dim() > 0}
            other = {k: v for k, v in st.items() if k not in flat}
            state[h.name] = {"shape": list(h.shape), "start": h.start, "stop": h.stop, "flat": flat, "other": other}
    return {"groups": groups, "state": state}


class _Target:
    """One held range being filled from saved entries: a buffer per key, and which elements came in."""

    def __init__(self, held: Held, dtype: torch.dtype | None = None) -> None:
        self.held = held
        self.filled = torch.zeros(held.stop - held.start, dtype=torch.bool)
        self.buffers: dict[str, torch.Tensor] = {}
        self.other: dict[str, Any] | None = None
        self.dtype = dtype

    def put(self, values: Mapping[str, torch.Tensor], start: int, stop: int) -> bool:
        """Copy saved elements ``[start, stop)`` of each key where none came in yet, and mark them;
        False if they bring nothing new."""
        h = self.held
        a, b = max(start, h.start), min(stop, h.stop)
        if a >= b:
            return False
        fresh = ~self.filled[a - h.start:b - h.start]
        if not bool(fresh.any()):
            return False
        for key, piece in values.items():
            buf = self.buffers.get(key)
            if buf is None:
                buf = self.buffers[key] = torch.zeros(h.stop - h.start, dtype=self.dtype or piece.dtype)
            dst = buf[a - h.start:b - h.start]
            dst[fresh] = piece[a - start:b - start].to(buf.dtype)[fresh]
        self.filled[a - h.start:b - h.start] = True
        return True

    def complete(self) -> bool:
        return bool(self.filled.all())


def load_named(read: Callable[[int], Mapping[str, Any]], ranks: Iterable[int],
               tensors: Iterable[tuple[torch.Tensor, Held]],
               optimizer: torch.optim.Optimizer | None = None,
               optim_names: Mapping[int, Held] | None = None, what: str = "checkpoint") -> None:
    """Fill `tensors` (each the tensor this rank holds and what it is) and `optimizer`'s state (its
    parameters named by `optim_names`) from the saved shards ``read(r)`` for r in `ranks`, in that
    order, stopping once everything is covered. FitError naming what a checkpoint does not cover
    (another model). The optimizer's hyperparameters come from the first shard read."""
    model = [(t, _Target(h, t.dtype)) for t, h in tensors]
    params = [(q, _Target(optim_names[id(q)])) for g in optimizer.param_groups
              for q in g["params"]] if optimizer is not None and optim_names is not None else []
    groups: list[dict[str, Any]] | None = None
    for r in ranks:
        if groups is not None and all(tg.complete() for _, tg in [*model, *params]):
            break
        shard = read(r)
        _fill_model(shard, [tg for _, tg in model])
        if "optim" in shard:
            groups = groups if groups is not None else shard["optim"]["groups"]
            _fill_optim(shard["optim"]["state"], [tg for _, tg in params])
    missing = [tg.held.name for _, tg in model if not tg.complete()]
    if missing:
        raise FitError(f"the {what} does not hold {missing[:5]}{' ...' if len(missing) > 5 else ''} (a checkpoint "
                       f"of another model?)")
    with torch.no_grad():
        for t, tg in model:
            t.copy_(tg.buffers["value"].view(t.shape))
    if optimizer is not None:
        _load_optimizer(optimizer, params, groups, what)


def _entry(shard: Mapping[str, Any], name: str) -> tuple[torch.Tensor, int, int] | None:
    """Saved tensor `name` of a shard: (its elements, first, stop), whole or a piece; None if absent."""
    t = shard.get("model", {}).get(name)
    if t is not None:
        return t.reshape(-1), 0, t.numel()
    e = shard.get("model_pieces", {}).get(name)
    if e is not None:
        return e["piece"], int(e["start"]), int(e["stop"])
    return None


def _fill_model(shard: Mapping[str, Any], targets: list[_Target]) -> None:
    for tg in targets:
        found = _entry(shard, tg.held.name)
        if found is not None:
            tg.put({"value": found[0]}, found[1], found[2])


def _fill_optim(state: Mapping[str, Any], targets: list[_Target]) -> None:
    for tg in targets:
        e = state.get(tg.held.name)
        if e is not None and tg.put(e["flat"], int(e["start"]), int(e["stop"])) and tg.other is None:
            tg.other = dict(e["other"])


def _load_optimizer(optimizer: torch.optim.Optimizer, params: list[tuple[torch.Tensor, _Target]],
                    groups: list[dict[str, Any]] | None, what: str) -> None:
    """Load what `params` collected into `optimizer` (a parameter no saved shard had state for starts
    without, as one never stepped; one covered in part is an error)."""
    if groups is None:
        return
    if len(groups) != len(optimizer.param_groups):
        raise FitError(f"the {what} has {len(groups)} optimizer param groups, this optimizer "
                       f"{len(optimizer.param_groups)}: build it the same way")
    state: dict[int, dict[str, Any]] = {}
    for index, (q, tg) in enumerate(params):
        if bool(tg.filled.any()):
            if not tg.complete():
                raise FitError(f"the {what} holds optimizer state for only part of {tg.held.name!r}")
            assert tg.other is not None
            state[index] = {**tg.other, **{k: v.view(q.shape) for k, v in tg.buffers.items()}}
    ids = iter(range(len(params)))
    param_groups = [{**saved, "params": [next(ids) for _ in g["params"]]}
                    for saved, g in zip(groups, optimizer.param_groups)]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def assemble(shards: Iterable[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """The whole tensors of the shards' ``"model"`` and ``"model_pieces"`` (in one process: a
    consolidated state_dict); a whole tensor from the lowest rank holding it wins."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, _Target] = {}
    for shard in shards:
        for name, t in shard.get("model", {}).items():
            out.setdefault(name, t)
        for name, e in shard.get("model_pieces", {}).items():
            shape = tuple(int(s) for s in e["shape"])
            tg = pieces.setdefault(name, _Target(Held(name, 0, _numel(shape), shape)))
            tg.put({"value": e["piece"]}, int(e["start"]), int(e["stop"]))
    for name, tg in pieces.items():
        if name not in out and tg.complete():
            out[name] = tg.buffers["value"].view(tg.held.shape)
    return out
