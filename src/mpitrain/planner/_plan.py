"""`plan(model, sample_batch, loss_fn, ...)`: calibrate on the ranks, agree, price every candidate."""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

from .._utils.stall import DEFAULT_POLICY, StallPolicy
from ..comm.base import Communicator
from ..perf.calibrate import (
    Calibration,
    LinkCost,
    Network,
    calibrate,
    extrapolate_calibration,
    extrapolate_network,
    measure_network,
)
from ..runtime import world
from ..strategies import samples, split_batch, used_columns
from ..strategies.base import Batch, FitError, LossFn, is_int, is_number
from ._candidates import STRATEGY_NAMES, Measured, candidates
from ._measure import measure_plan, trial_forward
from ._overhead import Overheads, measure_overheads
from ._profile import (
    agree,
    cache_path,
    load_cached,
    measure_model,
    model_signature,
    profile_from_dict,
    profile_to_dict,
    store,
)
from ._types import Dropped, Plan, PlanError, Plans

__all__ = ["plan", "available_memory", "parse_bytes"]

#: Largest message of the timing-model calibration (bytes): enough to pin beta, quick to send.
CALIBRATION_BYTES = 1 << 20


def parse_bytes(text: str | float) -> float:
    """``"8G"``, ``"512M"``, ``"1.5e9"`` or a number -> bytes (binary units). ValueError if malformed."""
    if is_number(text):
        return float(text)
    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    scale = units.get(s[-1:], 1)
    return float(s[:-1] if s[-1:] in units else s) * scale


def available_memory() -> float:
    """Bytes the kernel reports as available to new allocations on this node (MemAvailable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _check(model: object, sample_batch: object, loss_fn: object, comm: Communicator, world_size: object,
           memory_limit: object, strategies: object, exact: object, warn_after: object,
           abort_after: object) -> tuple[set[str], float | None, StallPolicy]:
    """Every refusal of bad input; local, so every rank given the same arguments raises alike."""
    try:
        abort = None if abort_after is None else float(abort_after)  # type: ignore[arg-type]
        stall = StallPolicy(float(warn_after), abort)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise PlanError(f"plan: warn_after / abort_after: {e}") from None
    if not isinstance(model, nn.Module):
        raise PlanError(f"plan: model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(sample_batch, (tuple, list)) and len(sample_batch) == 2
            and isinstance(sample_batch[1], torch.Tensor) and sample_batch[1].dim() >= 1
            and len(sample_batch[1]) >= 1):
        raise PlanError("plan: sample_batch must be one global mini-batch (inputs, targets), targets a tensor "
                        "with the batch along dim 0")
    try:  # the sharding rule: B is the inputs' dim 0, the targets k rows per sample (an LM's (B*T,))
        samples(*sample_batch)
    except FitError as e:
        raise PlanError(f"plan: {e}") from None
    if not callable(loss_fn):
        raise PlanError(f"plan: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(exact, bool):
        raise PlanError(f"plan: exact must be True or False, got {exact!r}")
    if world_size is not None and not (is_int(world_size) and world_size >= 1):
        raise PlanError(f"plan: world_size must be a positive int, got {world_size!r}")
    if world_size is not None and world_size != comm.size and comm.size < 2:
        raise PlanError(f"plan: world_size={world_size!r} from one rank: pricing other rank counts extrapolates "
                        f"the network measured between ranks, so run the planner on at least 2 ranks")
    limit: float | None = None
    if memory_limit is not None:
        try:
            limit = parse_bytes(memory_limit)  # type: ignore[arg-type]  # checked by parse_bytes itself
        except (ValueError, TypeError, IndexError):
            limit = -1.0
        if not limit > 0:
            raise PlanError(f"plan: memory_limit must be a positive number of bytes or a size such as '8G', "
                            f"got {memory_limit!r}")
    names = set(STRATEGY_NAMES) if strategies is None else strategies
    if isinstance(names, str) or not isinstance(names, Iterable):
        raise PlanError(f"plan: strategies must be a collection of names from {list(STRATEGY_NAMES)}, got "
                        f"{strategies!r}")
    names = set(names)
    unknown = sorted(str(n) for n in names - set(STRATEGY_NAMES))
    if unknown or not names:
        raise PlanError(f"plan: unknown strategies {unknown or '(none given)'}; choose from {list(STRATEGY_NAMES)}")
    if "model" in names or "hybrid" in names:
        names |= {"model", "hybrid"} & names
    return names, limit, stall


def _spatial_check(model: nn.Module, comm: Communicator, sample_batch: tuple[Batch, torch.Tensor], loss_fn: LossFn,
                   own_ranks: bool, stall: StallPolicy) -> Any:
    """``check(grid, samples)``: None if the spatial strategy runs `model` on this batch, else why. First
    the spatial package's own conversion, on a copy (local: constructing a Distribution sends nothing);
    then a trial forward of the converted copy over `comm` on one row per sample group
    (:func:`~mpitrain.planner._measure.trial_forward`: collective, the verdict agreed, so every rank
    drops the plan with the same reason): converting looks at layers only, and a model that reads its
    input's size (timm's ``PatchEmbed`` asserts it: ViT, Swin) fails only when its forward sees a block.
    The candidates call it in the same order on every rank (their order is the agreed profile's), once
    per layout. Not `own_ranks` (a plan for another rank count): converted and tried over `comm`'s ranks
    on one grid, (comm.size, 1), as whether a layer converts does not depend on the grid. Every wait of
    the trial is bounded by `stall` (fit's ``warn_after`` / ``abort_after`` under ``strategy="auto"``)."""
    from ..spatial.distribution import Distribution, SpatialError
    from ..spatial.parallelize import convert

    verdicts: dict[tuple[tuple[int, int], int], str | None] = {}

    def check(grid: tuple[int, int], samples: int) -> str | None:
        layout = (grid, samples) if own_ranks else ((comm.size, 1), 1)
        if layout not in verdicts:
            verdicts[layout] = _spatial_verdict(*layout)
        return verdicts[layout]

    def _spatial_verdict(grid: tuple[int, int], samples: int) -> str | None:
        try:
            convert(copy.deepcopy(model), Distribution(comm, grid, samples))
        except (SpatialError, ValueError, TypeError) as e:
            return f"the spatial strategy cannot convert the model ({e})"
        trial = Plan("spatial", {"grid": grid, "samples": samples}, 0.0, 0)
        x, y = sample_batch
        if not isinstance(x, torch.Tensor):  # the profile drops spatial for such inputs before this check
            return "its input is not one NCHW tensor"
        failed = trial_forward(model, trial, (x, y), loss_fn, comm, rows=min(samples, len(x)), stall=stall)
        if failed:
            return (f"the model's forward fails on the blocks of the batch's {tuple(x.shape[1:])} samples "
                    f"({failed}); a model that reads its input's size cannot run on blocks")
        return None

    return check


def host_layout(comm: Communicator) -> tuple[int, ...]:
    """The host index of every rank of `comm`, hosts numbered by their lowest rank: from MPI's
    shared-memory split (the MPI runtime's node identity) where `comm` is MPI's, else from host names.
    Collective over `comm`; the same tuple on every rank."""
    if comm.size == 1:
        return (0,)
    mpi_comm = getattr(comm, "mpi_comm", None)
    if mpi_comm is not None:
        from ..comm import host_leaders  # the one host identity (MPI's shared-memory split)

        leaders = host_leaders(mpi_comm)
    else:
        names = comm.allgather_object(socket.gethostname())
        leaders = [names.index(n) for n in names]
    order = sorted(set(leaders))
    return tuple(order.index(leader) for leader in leaders)


def measure_levels(comm: Communicator, hosts: tuple[int, ...]) -> tuple[Network, Network]:
    """(inter, intra): alpha-beta of the world's ranks and of one host's ranks. On one host they are
    one measurement (inter is intra). Across hosts each host's ranks measure their own level at once
    and every number is the maximum over hosts (the slowest host bounds a step). Collective over
    `comm`; the same Networks on every rank."""
    if len(set(hosts)) <= 1:
        net = measure_network(comm, level="world")
        return net, net
    node = comm.split(hosts[comm.rank], comm.rank)
    assert node is not None  # every rank passes a colour
    try:
        own = measure_network(node, level="intra")
    finally:
        node.free()
    links = (own.p2p, own.allreduce, own.alltoall)
    values = torch.tensor([own.ranks, *(v for c in links for v in (c.alpha, c.beta))], dtype=torch.float64)
    comm.allreduce(values, op="max")
    v = values.tolist()
    intra = Network("intra", int(v[0]), LinkCost(v[1], v[2]), LinkCost(v[3], v[4]), LinkCost(v[5], v[6]))
    return measure_network(comm, level="inter"), intra


def _measure(model: nn.Module, loss_fn: LossFn, sample_batch: tuple[Batch, torch.Tensor],
             comm: Communicator, hosts: tuple[int, ...], world: int, stall: StallPolicy) -> dict[str, Any]:
    """Calibrate on every rank at once and agree (max over ranks, then rank 0's numbers broadcast).
    The model is timed on the shares of a `world`-rank plan (B/(4 world) and B/world samples; B counted
    by the sharding rule, :func:`~mpitrain.strategies.samples`: flattened LM targets hold B*T rows)."""
    B, W = samples(*sample_batch), comm.size
    prof = agree(comm, measure_model(model, loss_fn, sample_batch, [max(1, B // (4 * world)), max(1, B // world)]))
    net, intra = measure_levels(comm, hosts)
    cal = calibrate(comm, repeats=5, max_bytes=CALIBRATION_BYTES)
    over = measure_overheads(
        comm, lambda make, p, b: measure_plan(make, p, b, nn.functional.cross_entropy, comm, stall=stall),
        net.allreduce.time)
    data = {"profile": profile_to_dict(prof), "network": asdict(net), "intra": asdict(intra),
            "calibration": asdict(cal), "overheads": asdict(over)}
    out: dict[str, Any] = comm.broadcast_object(data, 0) if W > 1 else data
    return out


def _network(n: dict[str, Any]) -> Network:
    return Network(n["level"], n["ranks"], *(LinkCost(**n[k]) for k in ("p2p", "allreduce", "alltoall")))


def _restore(data: dict[str, Any]) -> tuple[Any, Network, Network, Calibration, Overheads]:
    net = _network(data["network"])
    intra = _network(data["intra"]) if "intra" in data else net
    o = dict(data["overheads"])
    pipe = o["pipe_sgd"]
    over = Overheads((o["data"][0], o["data"][1]), ((pipe[0][0], pipe[0][1]), (pipe[1][0], pipe[1][1])),
                     o["pipeline_slot"], o["spatial_conv"])
    return profile_from_dict(data["profile"]), net, intra, Calibration(**data["calibration"]), over


def _without_synced_replicas(model: nn.Module, plans: list[Plan],
                             dropped: list[Dropped]) -> tuple[list[Plan], list[Dropped]]:
    """`plans` less the hybrid ones with replicas when `model` has an ``nn.SyncBatchNorm``, which fit refuses
    (the pipeline cannot synchronise its statistics over replicas: docs/training-runs.md), moved to `dropped`
    saying so."""
    if not any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        return plans, dropped
    refused = [p for p in plans if p.strategy == "hybrid" and int(p.options.get("replicas", 1)) > 1]
    why = "fit refuses nn.SyncBatchNorm with pipeline replicas (their statistics would not be synchronised)"
    return [p for p in plans if p not in refused], dropped + [Dropped(p.strategy, p.options, why) for p in refused]


def plan(model: nn.Module, sample_batch: tuple[Batch, torch.Tensor] | Mapping[str, Any], loss_fn: LossFn, *,
         comm: Communicator | None = None, world_size: int | None = None, memory_limit: float | str | None = None,
         strategies: Iterable[str] | None = None, exact: bool = False, explain: bool = False,
         cache: str | os.PathLike[str] | bool = True, remove_unused_columns: bool = True,
         warn_after: float = DEFAULT_POLICY.warn_after,
         abort_after: float | None = DEFAULT_POLICY.abort_after) -> Plans:
    """The ways to train `model` on the ranks of `comm` (default: the world), fastest predicted first.

    `sample_batch` is one global mini-batch as ``fit``'s data yields it, read by fit's one rule
    (``strategies.split_batch``): ``(inputs, targets)``, ``(input_1, ..., input_k, targets)``, or a
    Hugging Face mapping holding ``"labels"`` (inputs: the whole mapping; targets: its labels), less the
    keys the model's forward does not take unless `remove_unused_columns` is False (fit's rule and
    default, ``strategies.used_columns``: "text", "idx" of a tokenized dataset are dropped). Each
    returned :class:`Plan` runs as ``fit(model, data, loss_fn, opt, strategy=p.strategy, **p.options)``.
    Candidates: data; model and hybrid for every P dividing the world (M by HyPar-Flow's halving
    search); spatial grids and sample x spatial; pipe-sgd with K in {1, 2} and each compression; and
    §V-C's per-layer shortest path with a switch ("mixed": a spatial plan whose ``switch_at`` names
    the module from which on it runs sample-parallel). `exact` keeps only plans that compute what one
    process computes (no pipe-sgd staleness K > 1, no lossy compression; ``fit(strategy="auto")``'s
    default); the others are dropped with that reason. Plans
    predicted over `memory_limit` bytes per rank (default: the node's available memory divided by
    its ranks), or that cannot run, are left out and listed in the result's ``dropped`` with the
    reason; `explain` also prints the table and those reasons on rank 0.

    `world_size`: price plans for that many ranks instead of ``comm.size`` (at least 2 ranks
    measuring): the model is timed on a W-rank share, the network's alpha-beta is extrapolated
    (:func:`~mpitrain.perf.calibrate.extrapolate_network`) and every plan has ``measured=False``.
    Network levels: where the ranks span hosts (MPI's shared-memory split), the ranks of each host
    and the world are measured apart and a pattern among one host's ranks is priced on the first.

    Collective: every rank of `comm` must call it with the same arguments. Bad arguments raise
    :class:`PlanError` on every rank before any message; ranks given different models or batches
    raise it together at the first message. Calibration (each rank's share timed at the same time,
    the network's alpha-beta, Pipe-SGD's constants, each strategy's per-step overhead on a probe
    model) takes seconds; it is cached per (machine, model
    signature) in `cache` (True: ``~/.cache/mpitrain/planner``; False: not cached). Every rank
    returns the same plans in the same order. Every wait of the calibration's trial steps and of the
    spatial layouts' trial forwards is bounded as fit's are: a line on stderr after `warn_after` seconds,
    the job ended after `abort_after` (None: never), naming what the rank waited for. Torch's global
    (CPU) RNG is left as it was, measured or cached alike: a ``DataLoader(shuffle=True)`` without
    ``generator=`` shuffles with it, and a run's order must not depend on the planner's cache."""
    comm = comm or world()
    try:  # fit's one rule (a mapping holding "labels", "k inputs + target", a BatchEncoding as its dict)
        columns = used_columns(model, remove_unused_columns)
        columns.check(sample_batch)
        sample_batch = split_batch(columns(sample_batch))
    except FitError as e:
        raise PlanError(f"plan: sample_batch: {e}") from None
    names, limit, stall = _check(model, sample_batch, loss_fn, comm, world_size, memory_limit, strategies, exact,
                                 warn_after, abort_after)
    W = comm.size if world_size is None else int(world_size)
    key = model_signature(model, sample_batch, W)
    mine = (key, sorted(names), limit, exact)
    seen = comm.allgather_object(mine) if comm.size > 1 else [mine]
    bad = [r for r, s in enumerate(seen) if s != mine]
    if bad:
        raise PlanError(f"plan: ranks {bad} were given a different model, batch or arguments than rank 0")
    hosts = host_layout(comm)
    per_node = hosts.count(hosts[comm.rank])
    path = cache_path(cache, model_signature(model, sample_batch, W, f"measured on {comm.size} ranks, hosts {hosts}"))
    data = load_cached(path) if comm.rank == 0 else None
    if comm.size > 1:
        data = comm.broadcast_object(data, 0)
    if data is None:
        with torch.random.fork_rng(devices=[]):  # torch's global RNG is the user's: its draws here are the planner's
            data = _measure(model, loss_fn, sample_batch, comm, hosts, W, stall)
        if comm.rank == 0:
            store(path, data)
    prof, net, intra, cal, over = _restore(data)
    if limit is None:  # the smallest available memory of any node bounds its ranks
        own = torch.tensor([available_memory() / per_node], dtype=torch.float64)
        limit = float((comm.allreduce(own, op="min") if comm.size > 1 else own)[0])
    spare = torch.tensor([min(max((os.cpu_count() or 1) / per_node - 1, 0.0), 1.0)], dtype=torch.float64)
    if comm.size > 1:
        comm.allreduce(spare, op="min")
    if W != comm.size:  # priced for W ranks, per host as many as here: an estimate, marked not measured
        hosts = tuple(r // max(hosts.count(h) for h in hosts) for r in range(W)) if len(set(hosts)) > 1 else ()
        net, cal = extrapolate_network(net, W), extrapolate_calibration(cal, comm.size, W)
        intra = intra if hosts else net
    with torch.random.fork_rng(devices=[]):
        check = _spatial_check(model, comm, sample_batch, loss_fn, W == comm.size, stall)
    measured = Measured(prof, net, cal, W, sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()),
                        check, over, float(spare[0]), intra, hosts)
    plans, dropped = _without_synced_replicas(model, *candidates(measured, names, limit, exact))
    if W != comm.size:
        plans = [replace(p, measured=False) for p in plans]
    out = Plans(plans, dropped)
    if explain and comm.rank == 0:
        print(out.table(), flush=True)
        print(out.explanation(), flush=True)
    return out
