"""Every candidate plan for a world of W ranks, priced by the cost models of :mod:`mpitrain.perf`.

Pure functions of the agreed measurements (no message, no clock), so every rank holding the same
:class:`Measured` builds the same list in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ..comm.place import Place
from ..perf.calibrate import Calibration, Network
from ..perf.pipeline import micro_batch_candidates, pipeline_step
from ..perf.spatial import ConvShape, halo_messages, layer_path
from ..perf.timing import TimingInputs, predict, ring_allreduce_time
from ..strategies.pipeline import balanced_bounds
from ..strategies.pipeline.schedule import SPLIT, chunks_per_rank, peak_in_flight, placement, simulate
from ._overhead import Overheads
from ._profile import ModelProfile
from ._types import Dropped, Plan

__all__ = ["Measured", "candidates", "STRATEGY_NAMES", "CODECS"]

#: The strategies the planner knows, in the order it lists them.
STRATEGY_NAMES = ("data", "model", "hybrid", "spatial", "pipe-sgd", "mixed")
#: Pipe-SGD's gradient compressions tried (None: plain float32).
CODECS: tuple[str | None, ...] = (None, "bf16", "fp16", "int8")
#: Optimizer state kept per parameter byte, besides the weights and gradients (one buffer: momentum).
OPTIMIZER_STATE = 1

SpatialCheck = Callable[[tuple[int, int], int], str | None]


@dataclass(frozen=True)
class Measured:
    """What prices a candidate, the same on every rank: the model profile, the world's network, the
    timing constants of Pipe-SGD's model, the world size, the BatchNorm2d count (spatial statistics
    allreduces), `spatial_check(grid, samples)` (None or why the spatial strategy cannot run it; it may
    run a trial forward over the ranks, so it is called last, for the same layouts on every rank) and
    the runtime's measured per-step overheads, which every plan of a strategy adds to its formula.
    `spare_cores`: cores per rank beyond the compute thread's one (0 .. 1): how much of a
    communication thread's work can run beside compute (eq. 4's overlap needs a core to run on).

    Network levels: `net` is the world's (inter-host when the ranks span hosts), `intra` the ranks
    of one host (None: the same as `net`, as on one host), `hosts` the host index of every rank
    (empty: one host). A pattern among ranks of one host is priced with `intra`
    (:meth:`level`)."""

    prof: ModelProfile
    net: Network
    cal: Calibration
    world: int
    bn_layers: int
    spatial_check: SpatialCheck
    overheads: Overheads = Overheads()
    spare_cores: float = 1.0
    intra: Network | None = None
    hosts: tuple[int, ...] = ()

    def level(self, groups: Iterable[Iterable[int]]) -> Network:
        """The network that prices a pattern run by each of `groups` (world ranks) at once: `intra`
        if every group lies on one host, else `net` (the slowest group bounds the step)."""
        if self.intra is None or not self.hosts:
            return self.net
        one_host = all(len({self.hosts[r] for r in g}) <= 1 for g in groups)
        return self.intra if one_host else self.net


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _update_s(m: Measured, param_bytes: float) -> float:
    """l_up of Pipe-SGD eq. 2: one pass over weights and gradients (read both, write the weights)."""
    return 3 * param_bytes * m.cal.gamma


def _state_bytes(param_bytes: float) -> float:
    return (2 + OPTIMIZER_STATE) * param_bytes


def _data(m: Measured) -> Iterator[Plan | Dropped]:
    B, W, prof = m.prof.batch, m.world, m.prof
    if B % W:
        yield Dropped("data", {}, f"the batch of {B} does not split into {W} equal slices")
        return
    compute = prof.step_s(B / W) + _update_s(m, prof.param_bytes)
    net = m.level([range(W)])
    comm = (net.allreduce.time(prof.param_bytes) if W > 1 else 0.0) + m.overheads.of_data(prof.param_bytes)
    mem = _state_bytes(prof.param_bytes) + prof.param_bytes + prof.activation_bytes_per_sample * B / W
    yield Plan("data", {}, compute + comm, int(mem), {"compute": compute, "communication": comm})


def _pipe_sgd(m: Measured) -> Iterator[Plan | Dropped]:
    """Pipe-SGD eqs. 2 (K=1: synchronous) and 4-5 (K=2: pipelined), codec cost on the comm term. The
    overlap of eq. 4 happens only as far as a spare core runs the communication thread: with none, the
    pipelined step costs eq. 2's sum (both threads share one core)."""
    B, W, prof = m.prof.batch, m.world, m.prof
    if W == 1:
        yield Dropped("pipe-sgd", {}, "one rank: no gradient exchange to pipeline")
        return
    for K in (1, 2):
        for codec in CODECS:
            opts = {"staleness": K, "compression": codec}
            if B % W:
                yield Dropped("pipe-sgd", opts, f"the batch of {B} does not split into {W} equal slices")
                continue
            comp = prof.step_s(B / W)
            c = m.cal
            x = TimingInputs(l_up=_update_s(m, prof.param_bytes), l_for=comp * prof.forward_share,
                             l_back=comp * (1 - prof.forward_share), alpha=c.alpha, beta=c.beta, gamma=c.gamma,
                             n_bytes=prof.param_bytes, p=W, S=c.S, K=K,
                             wire_ratio=c.wire_ratio.get(str(codec), 1.0),
                             codec_per_byte=c.codec_per_byte.get(str(codec), 0.0))
            r = predict(x)
            overlapped = m.spare_cores * r["pipe"] + (1 - m.spare_cores) * r["sync"]
            step = (r["sync"] if K == 1 else overlapped) + m.overheads.of_pipe_sgd(K, prof.param_bytes)
            compute = comp + x.l_up
            mem = _state_bytes(prof.param_bytes) + (K + 1) * prof.param_bytes + prof.activation_bytes_per_sample * B / W
            yield Plan("pipe-sgd", opts, step, int(mem), {"compute": min(compute, step),
                                                          "communication": max(step - compute, 0.0)})


def _stage_sums(values: list[float], bounds: list[int]) -> list[float]:
    return [sum(values[a:b]) for a, b in zip(bounds, bounds[1:])]


def _pipelines(m: Measured) -> Iterator[Plan | Dropped]:
    """HyPar-Flow's model (P = W) and hybrid (P | W, R = W / P) with the best M and schedule
    (perf.pipeline; the schedules of :data:`PLANNED`, the option only when not the default 1f1b)."""
    B, W, prof = m.prof.batch, m.world, m.prof
    for P in _divisors(W)[1:]:
        R = W // P
        strategy = "model" if R == 1 else "hybrid"
        base = {"partitions": P} if R == 1 else {"partitions": P, "replicas": R}
        if prof.capture_error:
            yield Dropped(strategy, base, f"the model cannot be split into partitions ({prof.capture_error})")
            continue
        if len(prof.cuts) + 1 < P:
            yield Dropped(strategy, base, f"the graph can be cut at only {len(prof.cuts)} places")
            continue
        if B % R:
            yield Dropped(strategy, base, f"the batch of {B} does not split over {R} replicas")
            continue
        layout = Place(W, 0, R, P)  # the places fit would give: rank r*P + p runs stage p of replica r
        pipes, groups = m.level(layout.all_members("partition")), m.level(layout.all_members("replica"))
        best: Plan | None = None
        for M in micro_batch_candidates(B // R):
            n = B // (R * M)
            for schedule in _schedules(P, M, len(prof.cuts)):
                plan = _pipeline_plan(m, strategy, base, schedule, P, R, M, n, pipes, groups)
                if best is None or plan.step_s < best.step_s:
                    best = plan
        if best is not None:
            yield best


def _pipeline_plan(m: Measured, strategy: str, base: dict[str, int], schedule: str, P: int, R: int, M: int, n: int,
                   pipes: Network, groups: Network) -> Plan:
    """One pipeline plan: the partitions cut by time (P x chunks of them), each rank's share, the
    replicas' allreduce of the largest rank's gradients, and the schedule's bubble simulated on the
    partitions' times (the GPipe/1F1B formula for 1f1b)."""
    prof = m.prof
    v = chunks_per_rank(schedule)
    bounds = balanced_bounds(prof.node_share, prof.cuts, P * v)
    rows = placement(schedule, P)

    def per_rank(values: list[float]) -> list[float]:
        parts = _stage_sums(values, bounds)
        return [sum(parts[k] for k in row) for row in rows]

    grads = max(per_rank([float(b) for b in prof.node_param_bytes]))
    acts = max(per_rank(prof.node_bytes_per_sample))
    cross = max(prof.crossing_bytes_per_sample[c] for c in bounds[1:-1])
    link = _link(m, groups)
    ar = ring_allreduce_time(grads, R, link[0], link[1], m.cal.gamma, m.cal.S) + m.overheads.of_data(grads) * (R > 1)
    # the probe's per-slot overhead was measured under 1F1B (two actions per micro-batch)
    slots = M * v * (3 if schedule in SPLIT else 2) / 2 + P - 1
    part_s = [prof.step_s(n) * s for s in _stage_sums(prof.node_share, bounds)]
    stage_s = [sum(part_s[k] for k in row) for row in rows]
    bubble = None if schedule == "1f1b" else _makespan(schedule, P, M, part_s, prof.forward_share) - M * max(stage_s)
    cost = pipeline_step(stage_s, M, pipes.p2p.time(cross * n), ar + m.overheads.pipeline_slot * slots,
                         _update_s(m, grads), bubble, v)
    mem = _state_bytes(grads) + acts * n * peak_in_flight(schedule, P, M) + 2 * v * cross * n
    opts = {**base, "micro_batches": M, **({} if schedule == "1f1b" else {"schedule": schedule})}
    return Plan(strategy, opts, cost.total, int(mem), {"compute": cost.compute + cost.update,
                                                       "communication": cost.communication, "bubble": cost.bubble})


#: The schedules the planner prices (gpipe takes 1F1B's time with more memory: never better).
PLANNED = ("1f1b", "interleaved-1f1b", "zb1p", "zbv")


def _schedules(P: int, M: int, cuts: int) -> list[str]:
    """The schedules that can run P ranks and M micro-batches on a graph with `cuts` cut points: two
    partitions per rank need 2P - 1 cuts, interleaved-1f1b M a multiple of P."""
    if P == 1:
        return ["1f1b"]
    return [s for s in PLANNED if chunks_per_rank(s) * P <= cuts + 1 and (s != "interleaved-1f1b" or M % P == 0)]


def _makespan(schedule: str, P: int, M: int, part_s: list[float], forward_share: float) -> float:
    """The makespan of `schedule` on partitions taking `part_s` seconds (forward + backward) per
    micro-batch, the forward the measured share of it and W (weight half) as long as F, at most half
    the backward (a weight GEMM per forward GEMM)."""
    f = min(max(forward_share, 0.05), 0.95)
    b = (1 - f) / f  # the backward in units of the forward
    return simulate(P, M, schedule, b, 2, min(1.0, b / 2), part_s)


def _link(m: Measured, net: Network) -> tuple[float, float]:
    """(alpha, beta) of one link for Pipe-SGD's ring formula: the calibration's ring shift, scaled by
    the ratio of `net`'s point-to-point cost to the world's where `net` is a faster level."""
    if net is m.net or m.net.p2p.alpha <= 0 or m.net.p2p.beta <= 0:
        return m.cal.alpha, m.cal.beta
    return (m.cal.alpha * net.p2p.alpha / m.net.p2p.alpha, m.cal.beta * net.p2p.beta / m.net.p2p.beta)


def _spatial_groups(m: Measured, grid: tuple[int, int], samples: int) -> list[tuple[int, ...]]:
    return Place(m.world, 0, samples, 1, grid).all_members("spatial")


def _halo_s(m: Measured, grid: tuple[int, int], samples: int) -> float:
    """§V-A's halo terms of every conv, forward and backward (not hidden behind compute here), on the
    network level of the spatial groups."""
    net = m.level(_spatial_groups(m, grid, samples))
    return sum(2 * k * net.p2p.time(b) for s in m.prof.convs for k, b in halo_messages(s, grid, samples))


def _padded_area(shape: ConvShape, grid: tuple[int, int]) -> float:
    """(local block + halo) / local block area of one conv on `grid`: §V-A's C is timed on the padded
    block, so a rank's conv compute grows by this factor."""
    o = shape.k // 2
    h, w = shape.h / grid[0], shape.w / grid[1]
    return (h + (2 * o if grid[0] > 1 else 0)) * (w + (2 * o if grid[1] > 1 else 0)) / (h * w)


def _halo_inflation(prof: ModelProfile, grid: tuple[int, int]) -> float:
    """Factor by which a rank's compute grows because each conv also computes over its halo: per conv
    node, :func:`_padded_area` - 1, weighted by the node's share of the step. 1.0 without a per-node
    profile."""
    convs = iter(prof.convs)
    extra = 0.0
    for share, is_conv in zip(prof.node_share, prof.node_is_conv):
        shape = next(convs, None) if is_conv else None
        if shape is not None:
            extra += share * (_padded_area(shape, grid) - 1)
    return 1.0 + extra


def _spatial_cost(m: Measured, grid: tuple[int, int], samples: int) -> tuple[float, dict[str, float], float]:
    """(step seconds, breakdown, memory bytes) of spatial training on `grid` x `samples` groups: the
    step of a share of B / samples / (ph pw) samples (grown by the convs' halo areas), §V-A's halos, the
    BatchNorm statistics allreduces (global statistics: over every rank), the fused gradient allreduce
    over every rank, and the gather of outputs."""
    prof, B = m.prof, m.prof.batch
    per = grid[0] * grid[1]
    work = math.ceil(B / samples) / per
    compute = prof.step_s(work) * _halo_inflation(prof, grid) + _update_s(m, prof.param_bytes)
    halo = _halo_s(m, grid, samples) + m.overheads.spatial_conv * len(prof.convs)
    comm = _spatial_comm(m)
    mem = (_state_bytes(prof.param_bytes) + prof.param_bytes + prof.activation_bytes_per_sample * work
           + prof.output_bytes_per_sample * B)
    return compute + halo + comm, {"compute": compute, "communication": comm, "halo": halo}, mem


def _spatial_comm(m: Measured) -> float:
    """Seconds of a spatial step's collectives over every rank: BatchNorm's global statistics (an
    allgather forward, an allreduce backward, twice per layer), the gradient allreduce, the gather of
    the outputs."""
    W, prof = m.world, m.prof
    net = m.level([range(W)])
    link = _link(m, net)
    stats = 4 * m.bn_layers * ring_allreduce_time(64, W, link[0], link[1], m.cal.gamma)
    return net.allreduce.time(prof.param_bytes) + stats + net.p2p.time(prof.output_bytes_per_sample * prof.batch)


def _grids(per: int) -> list[tuple[int, int]]:
    return [(a, per // a) for a in _divisors(per)]


def _spatial(m: Measured) -> Iterator[Plan | Dropped]:
    B, W, prof = m.prof.batch, m.world, m.prof
    for per in _divisors(W)[1:]:
        samples = W // per
        for grid in _grids(per):
            opts = {"grid": grid, "samples": samples}
            why: str | None = prof.spatial_error
            if not why and not prof.convs:
                why = "the model has no Conv2d to split"
            if not why and B % samples:
                why = f"the batch of {B} does not split into {samples} sample groups"
            if not why and prof.input_shape is not None and (prof.input_shape[2] < grid[0] * 2
                                                            or prof.input_shape[3] < grid[1] * 2):
                why = f"the image {prof.input_shape[2:]} is too small for grid {grid}"
            # last: the check converts and runs a trial forward (collective; the reasons above are the
            # agreed profile's, so every rank reaches it for the same layouts in the same order)
            why = why or m.spatial_check(grid, samples)
            if why:
                yield Dropped("spatial", opts, why)
                continue
            step, breakdown, mem = _spatial_cost(m, grid, samples)
            yield Plan("spatial", opts, step, int(mem), breakdown)


def mixed_path(m: Measured, switch: bool = False) -> tuple[float, list[str]] | None:
    """§V-C's shortest path over (node, distribution): every node either spatial on the W ranks'
    grid (W, 1) (its share of the step on B/W samples' worth of pixels, plus §V-A's halos of a conv)
    or sample-parallel over W (its share on the largest rank's ceil(B/W) samples; a conv also the
    spatial runtime's per-conv overhead, as it still runs as a spatial layer); a spatial -> sample
    edge redistributes the node's output by one alltoall forward and one backward, and is allowed
    only into a node the spatial strategy can switch at (``ModelProfile.switch_points``); sample ->
    spatial is not allowed (the paper's early-spatial, late-sample shape). With `switch`, the path
    must switch (the first node spatial, the last sample-parallel): the best *mixed* plan. Returns
    (seconds, distribution per node) or None when it cannot be priced or no path exists."""
    prof, W, B = m.prof, m.world, m.prof.batch
    if not prof.node_share or not prof.convs or B < W or W < 2:
        return None
    grid = (W, 1)
    net = m.level([range(W)])
    sample_s = prof.step_s(math.ceil(B / W))
    spatial_s = prof.step_s(B / W)
    conv_iter = iter(prof.convs)
    costs: list[list[float]] = []
    for share, conv in zip(prof.node_share, prof.node_is_conv):
        shape = next(conv_iter, None) if conv else None
        spatial, sample = share * spatial_s, share * sample_s
        if shape is not None:  # a conv computes over its halo too, after exchanging it
            spatial = spatial * _padded_area(shape, grid) + m.overheads.spatial_conv
            spatial += sum(2 * k * net.p2p.time(b) for k, b in halo_messages(shape, grid, 1))
            # after the switch the layers still run as the spatial strategy's (on a 1 x 1 grid): the
            # runtime's per-layer cost, measured per conv on the probe, stays
            sample += m.overheads.spatial_conv
        costs.append([spatial, sample])
    if switch:
        costs[0][1] = costs[-1][0] = math.inf
    ok = {c for c, _, h in prof.switch_points if h >= W}

    def shuffle(i: int, d: int, e: int) -> float:
        if d == e:
            return 0.0
        if d == 1 or i + 1 not in ok:
            return math.inf
        return 2 * net.alltoall.time(prof.node_bytes_per_sample[i] * B / W)

    total, path = layer_path(costs, shuffle)
    if not math.isfinite(total):
        return None
    return total, ["spatial" if d == 0 else "sample" for d in path]


def _mixed(m: Measured) -> Iterator[Plan | Dropped]:
    """The best per-layer mix (:func:`mixed_path` with a switch) as a runnable spatial plan: grid
    (W, 1), one sample group, ``switch_at`` the module where the path turns sample-parallel. Its step
    adds to the path the update, the gradient allreduce over every rank, the BatchNorm statistics of
    the spatial part and the gather of the outputs, as the spatial plans do."""
    prof, W, B = m.prof, m.world, m.prof.batch
    found = mixed_path(m, switch=True)
    why = prof.spatial_error or (m.spatial_check((W, 1), 1) if found is not None else None)
    if found is None or why:
        yield Dropped("mixed", {}, why or "no per-layer path: needs a captured NCHW conv model, a batch of at "
                                         "least one sample per rank and a module to switch at (a call whose "
                                         "input is the only value crossing it, an NCHW block)")
        return
    total, path = found
    k = path.index("sample")
    name = next(n for c, n, _ in prof.switch_points if c == k)
    comm = _spatial_comm(m)
    update = _update_s(m, prof.param_bytes)
    mem = (_state_bytes(prof.param_bytes) + prof.param_bytes + prof.activation_bytes_per_sample * math.ceil(B / W)
           + prof.output_bytes_per_sample * B)
    opts = {"grid": (W, 1), "samples": 1, "switch_at": name}
    # the path's seconds hold its halos and alltoalls too: shown as compute (the path is one sum)
    yield Plan("spatial", opts, total + update + comm, int(mem), {"compute": total + update, "communication": comm})


_GENERATORS: dict[str, Callable[[Measured], Iterator[Plan | Dropped]]] = {
    "data": _data, "model": _pipelines, "spatial": _spatial, "pipe-sgd": _pipe_sgd, "mixed": _mixed}


def candidates(m: Measured, strategies: set[str], memory_limit: float,
               exact: bool = False) -> tuple[list[Plan], list[Dropped]]:
    """(plans sorted fastest first, dropped candidates with reasons) over `strategies`; with `exact`,
    plans that change the one-process mathematics (:func:`machinery` 2) are dropped. Predictions
    within :data:`TIE_MARGIN` per :func:`machinery` level go to the plan with less machinery; exact
    ties keep generation order (stable sort): the same order on every rank."""
    plans: list[Plan] = []
    dropped: list[Dropped] = []
    for name, gen in _GENERATORS.items():
        if name == "mixed" and name not in strategies:
            continue
        for c in gen(m):
            if c.strategy not in strategies and name != "mixed":  # a mix runs as a spatial plan
                continue
            if isinstance(c, Dropped):
                dropped.append(c)
            elif exact and machinery(c) >= INEXACT:
                dropped.append(Dropped(c.strategy, c.options, "stale or lossy updates change what one process "
                                       "computes (exact=True)"))
            elif c.memory_bytes > memory_limit:
                why = (f"predicted {c.memory_bytes / 2**20:.0f} MiB per rank exceeds the memory limit of "
                       f"{memory_limit / 2**20:.0f} MiB")
                dropped.append(Dropped(c.strategy, c.options, why))
            else:
                plans.append(c)
    plans.sort(key=lambda p: p.step_s * (1 + TIE_MARGIN * machinery(p)))
    return plans, dropped


#: Predictions within this fraction per :func:`machinery` level count as a tie (measurement noise).
TIE_MARGIN = 0.02


def machinery(p: Plan) -> int:
    """How much a plan changes or adds to plain data parallelism: 0 data; 1 the other strategies that
    compute the one-process mathematics (model, hybrid, spatial, synchronous uncompressed pipe-sgd);
    2 pipe-sgd with staleness or lossy compression (changes the mathematics: worth it only if clearly
    faster). The ranking orders plans by ``step_s * (1 + TIE_MARGIN * machinery)``."""
    if p.strategy == "data":
        return 0
    if p.strategy == "pipe-sgd" and (p.options.get("staleness", 1) > 1 or p.options.get("compression") is not None):
        return INEXACT
    return 1


#: The :func:`machinery` level of plans whose updates differ from one process's (``exact=True`` drops them).
INEXACT = 2
